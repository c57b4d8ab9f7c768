"""GGUF in: small files written here by the `gguf` package, one per supported architecture
and tensor type, converted and run through mlx-lm against the weights they were made from;
files the converter must refuse; and `orchestrator convert-gguf` as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402

from policy.from_gguf import GGUFError, convert  # noqa: E402

# llama.cpp's names for mlx-lm's modules, as its convert_hf_to_gguf writes them.
GGUF_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=256,
)
CHAT = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def byte_vocab() -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary (GPT-2's byte alphabet, a few merges, two specials)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "i n"]
    return ["<|im_start|>", "<|im_end|>", *alphabet, *(m.replace(" ", "") for m in merges)], merges


def hf_model(arch: str, tied: bool, seed: int = 0):
    """A random mlx-lm model of the architecture, in float32, and its weights by name."""
    import importlib

    import mlx.nn as nn
    from mlx.utils import tree_flatten

    tokens, _ = byte_vocab()
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    args = dict(SHAPE, model_type=arch, vocab_size=len(tokens), tie_word_embeddings=tied)
    if arch == "qwen3":
        args["head_dim"] = 16
    model = module.Model(module.ModelArgs.from_dict(args))
    mx.random.seed(seed)
    model.update(nn.utils.tree_map(lambda p: 0.2 * mx.random.normal(p.shape), model.parameters()))
    return model, {k: np.array(v) for k, v in tree_flatten(model.parameters())}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to a Llama's Q and K rows."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(name: str) -> str:
    module, _, leaf = name.rpartition(".")
    if module.startswith("model.layers."):
        _, _, i, rest = module.split(".", 3)
        return f"blk.{i}.{GGUF_NAMES[rest]}.{leaf}"
    return f"{GGUF_NAMES[module]}.{leaf}"


def encoded(w: np.ndarray, kind: T) -> np.ndarray:
    if kind == T.F32:
        return w.astype(np.float32)
    if kind == T.F16:
        return w.astype(np.float16)
    if kind == T.I32:
        return w.astype(np.int32)
    return gguf.quants.quantize(w.astype(np.float32), kind)


def write_gguf(
    path: Path, arch: str, weights: dict[str, np.ndarray], kind: T, kinds: dict[str, T] | None = None
) -> dict:
    """A GGUF file as llama.cpp writes one: 2-D weights in `kind`, norms and biases in F32.
    Returns what each weight reads back as (gguf's dequantization), by mlx-lm name."""
    tokens, merges = byte_vocab()
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(SHAPE["num_hidden_layers"])
    writer.add_embedding_length(SHAPE["hidden_size"])
    writer.add_feed_forward_length(SHAPE["intermediate_size"])
    writer.add_head_count(SHAPE["num_attention_heads"])
    writer.add_head_count_kv(SHAPE["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(SHAPE["rms_norm_eps"])
    writer.add_rope_freq_base(SHAPE["rope_theta"])
    writer.add_context_length(SHAPE["max_position_embeddings"])
    if arch == "qwen3":
        writer.add_key_length(16)
        writer.add_value_length(16)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_chat_template(CHAT)
    read_back = {}
    for name, w in weights.items():
        stored = w
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = SHAPE["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            stored = llama_cpp_permute(w, heads)
        t = (kinds or {}).get(name, kind if w.ndim == 2 else T.F32)
        data = encoded(stored, t)
        writer.add_tensor(gguf_name(name), data, raw_dtype=t)
        if t == T.I32:
            continue
        # Rows are quantized independently, so dequantizing the permuted rows and putting
        # them back equals dequantizing the unpermuted weight.
        read_back[name] = gguf.quants.dequantize(encoded(w, t), t).astype(np.float32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return read_back


def logits_of(model, ids: list[int]) -> np.ndarray:
    return np.array(model(mx.array([ids])).astype(mx.float32))


def dequantized(model) -> None:
    """The model's quantized layers replaced by float32 ones (exactly what their blocks hold)."""
    from policy.model import dequantize_base

    dequantize_base(model)


IDS = [0, 5, 40, 77, 120, 255, 257, 3, 90, 1]


@pytest.mark.parametrize("arch,tied", [("llama", True), ("llama", False), ("qwen2", True), ("qwen3", False)])
def test_each_architecture_converts_to_the_model_it_was_made_from(tmp_path, arch, tied):
    """F32 throughout: the converted folder's logits through mlx-lm equal the original
    model's. Llama's Q/K rows come back from llama.cpp's permutation (the forward would
    differ otherwise); Qwen2's biases and Qwen3's Q/K norms land in their places."""
    from mlx_lm import load

    model, weights = hf_model(arch, tied)
    write_gguf(tmp_path / "m.gguf", arch, weights, T.F32)
    folder = convert(tmp_path / "m.gguf", tmp_path / "out", say=lambda _: None)
    converted, tok = load(str(folder))
    np.testing.assert_allclose(logits_of(converted, IDS), logits_of(model, IDS), atol=1e-4, rtol=1e-4)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == arch and config["tie_word_embeddings"] == tied
    assert "quantization" not in config


@pytest.mark.parametrize(
    "kind", [T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q8_0, T.Q5_0, T.Q5_1], ids=lambda k: k.name
)
def test_each_tensor_type_reads_as_the_gguf_package_dequantizes_it(tmp_path, kind):
    """Q4_0, Q4_1 and Q8_0 stay quantized (bits per tensor in config.json) and hold
    exactly the values gguf dequantizes; other types are dequantized (float16, BF16 kept).
    The folder's logits, dequantized to float32, equal a forward over gguf's values."""
    from mlx_lm import load

    model, weights = hf_model("llama", tied=True)
    read_back = write_gguf(tmp_path / "m.gguf", "llama", weights, kind)
    folder = convert(tmp_path / "m.gguf", tmp_path / "out", say=lambda _: None)
    config = json.loads((folder / "config.json").read_text())
    converted, _ = load(str(folder))
    native = {T.Q4_0: 4, T.Q4_1: 4, T.Q8_0: 8}
    if kind in native:
        assert config["quantization"]["bits"] == native[kind] and config["quantization"]["group_size"] == 32
        assert type(converted.model.layers[0].self_attn.q_proj).__name__ == "QuantizedLinear"
    else:
        assert "quantization" not in config
    dequantized(converted)
    from mlx.utils import tree_flatten

    got = {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(converted.parameters())}
    tolerance = 0 if kind in native or kind == T.BF16 else 1e-3  # float16 storage of other types
    for name, value in read_back.items():
        np.testing.assert_allclose(got[name], value, atol=tolerance, rtol=tolerance, err_msg=name)
    model.load_weights([(k, mx.array(v)) for k, v in read_back.items()])
    np.testing.assert_allclose(logits_of(converted, IDS), logits_of(model, IDS), atol=2e-3)


def test_the_tokenizer_and_chat_template_come_from_the_file(tmp_path):
    from mlx_lm import load

    _, weights = hf_model("qwen2", tied=True)
    write_gguf(tmp_path / "m.gguf", "qwen2", weights, T.F32)
    _, tok = load(str(convert(tmp_path / "m.gguf", tmp_path / "out", say=lambda _: None)))
    tokens, _ = byte_vocab()
    ids = tok.encode(" the thin")
    assert [tokens[i] for i in ids] == ["Ġthe", "Ġt", "h", "in"]  # the file's merges, in order
    assert tok.decode(ids) == " the thin"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n"
    assert tok.encode("<|im_end|>") == [1] and tok.eos_token_id == 1
    saved = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert saved["chat_template"] == CHAT


def test_an_unsupported_architecture_is_refused_by_name(tmp_path):
    _, weights = hf_model("llama", tied=True)
    write_gguf(tmp_path / "m.gguf", "gemma2", weights, T.F32)
    with pytest.raises(GGUFError, match="architecture 'gemma2' is not supported"):
        convert(tmp_path / "m.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_unsupported_tensor_type_is_refused_by_name(tmp_path):
    _, weights = hf_model("llama", tied=True)
    write_gguf(
        tmp_path / "m.gguf", "llama", weights, T.F32, kinds={"model.layers.0.mlp.up_proj.weight": T.I32}
    )
    with pytest.raises(GGUFError, match=r"'blk\.0\.ffn_up\.weight' has type I32"):
        convert(tmp_path / "m.gguf", tmp_path / "out")


def test_convert_gguf_command_writes_a_folder_mlx_lm_generates_from(tmp_path):
    """`orchestrator convert-gguf FILE OUT` from a user's folder; `mlx_lm.generate` runs on
    the result."""
    _, weights = hf_model("llama", tied=True)
    write_gguf(tmp_path / "m.gguf", "llama", weights, T.Q8_0)
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", "convert-gguf", "m.gguf", "model"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "converted m.gguf (llama, 2 layers" in done.stdout
    gen = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_lm",
            "generate",
            "--model",
            "model",
            "--prompt",
            "the",
            "--max-tokens",
            "4",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert gen.returncode == 0, gen.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "orchestrator", "convert-gguf", "missing.gguf", "model2"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "missing.gguf: no such file" in bad.stderr


def llama_cpp_logits(path: Path, ids: list[int]) -> np.ndarray:
    """An independent forward of a Llama GGUF file, in numpy float32, over its own tensors
    as the gguf package dequantizes them and in llama.cpp's arrangement: Q and K rows as
    stored, RoPE on adjacent pairs of dimensions (the converter's un-permuted rows and
    mlx-lm's rotated halves must come to the same)."""
    reader = gguf.GGUFReader(str(path))
    meta = {name: field.contents() for name, field in reader.fields.items()}
    w = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32) for t in reader.tensors}
    heads, kv_heads = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]
    eps, theta = meta["llama.attention.layer_norm_rms_epsilon"], meta["llama.rope.freq_base"]
    x = w["token_embd.weight"][ids]
    n, dim = x.shape
    hd = dim // heads
    angles = np.arange(n)[:, None] * theta ** (-np.arange(0, hd, 2) / hd)[None, :]
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)

    def norm(v, weight):
        return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps) * weight

    def rope(v):  # (heads, n, hd)
        a, b = v[..., 0::2], v[..., 1::2]
        out = np.empty_like(v)
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
        return out

    def split(v, h):
        return v.reshape(n, h, hd).transpose(1, 0, 2)

    mask = np.triu(np.full((n, n), -np.inf, np.float32), 1)
    for i in range(meta["llama.block_count"]):
        b = f"blk.{i}."
        h = norm(x, w[b + "attn_norm.weight"])
        q = rope(split(h @ w[b + "attn_q.weight"].T, heads))
        k = np.repeat(rope(split(h @ w[b + "attn_k.weight"].T, kv_heads)), heads // kv_heads, axis=0)
        v = np.repeat(split(h @ w[b + "attn_v.weight"].T, kv_heads), heads // kv_heads, axis=0)
        scores = q @ k.transpose(0, 2, 1) / np.sqrt(hd) + mask
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        attended = (scores / scores.sum(-1, keepdims=True)) @ v
        x = x + attended.transpose(1, 0, 2).reshape(n, dim) @ w[b + "attn_output.weight"].T
        h = norm(x, w[b + "ffn_norm.weight"])
        gate = h @ w[b + "ffn_gate.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * (h @ w[b + "ffn_up.weight"].T)) @ w[b + "ffn_down.weight"].T
    head = w.get("output.weight", w["token_embd.weight"])
    return norm(x, w["output_norm.weight"]) @ head.T


@pytest.mark.slow
def test_the_real_smollm2_file_converts_to_the_same_forward(smollm2):
    """SmolLM2-135M-Instruct (Q4_1 and Q8_0 blocks): the converted folder through mlx-lm,
    its quantized layers dequantized exactly, gives the logits of an independent forward
    over the file's own tensors to 1e-4 (relative and absolute: the largest logits are near
    30, where float32 differs from the reference in the fifth digit)."""
    from mlx_lm import load

    model, tok = load(str(smollm2))
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "QuantizedLinear"
    dequantized(model)
    messages = [{"role": "user", "content": "What is 47 + 38?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    ours = logits_of(model, ids)[0]
    reference = llama_cpp_logits(smollm2.parent / "SmolLM2-135M-Instruct.Q4_1.gguf", ids)
    np.testing.assert_allclose(ours, reference, rtol=1e-4, atol=1e-4)
    assert (ours.argmax(-1) == reference.argmax(-1)).all()


@pytest.mark.slow
def test_the_real_smollm2_tokenizer_follows_the_file(smollm2):
    """Text, digits and the chat template split and round-trip as the file's metadata
    says: its token list, one token per digit (SmolLM2's pre-tokenizer), its special tokens
    whole, and its own chat template rendered by jinja2."""
    import jinja2
    from mlx_lm import load

    reader = gguf.GGUFReader(str(smollm2.parent / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    meta = {name: field.contents() for name, field in reader.fields.items()}
    tokens = meta["tokenizer.ggml.tokens"]
    _, tok = load(str(smollm2))
    for text in ["What is 47 + 38?", "12345 apples\n\nand  spaces", "héllo wörld, 日本"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert all(0 <= i < len(tokens) for i in ids)
    digits = tok.encode("90817")
    assert [tokens[i] for i in digits] == list("90817")
    messages = [{"role": "user", "content": "What is 47 + 38?"}]
    expected = (
        jinja2.Environment()
        .from_string(meta["tokenizer.chat_template"])
        .render(messages=messages, add_generation_prompt=True)
    )
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == expected
    for special in ("<|im_start|>", "<|im_end|>"):
        assert [tokens[i] for i in tok.encode(special)] == [special]
    assert tokens[tok.eos_token_id] == tokens[meta["tokenizer.ggml.eos_token_id"]] == "<|im_end|>"

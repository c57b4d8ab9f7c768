"""Turn a GGUF file (what llama.cpp, Ollama and LM Studio keep on disk) into an mlx-lm
model folder: model.safetensors, config.json, tokenizer.json and tokenizer_config.json
with the chat template.

- Architectures: the Llama family (SmolLM, Llama 2 and 3) and Qwen2/Qwen3, the ones
  mlx-lm's `llama`, `qwen2` and `qwen3` models run. Anything else is refused by name.
- Q4_0, Q4_1 and Q8_0 blocks are MLX's affine quantization with groups of 32 written
  another way (a scale and a bias per group), so they stay quantized, exactly, with
  their bits per tensor in config.json. F32, F16 and BF16 are kept as they are. Every
  other type is dequantized to float16 by the `gguf` package.
- llama.cpp stores a Llama's Q and K projections with their rows permuted for its RoPE
  layout (pairs of adjacent dimensions); mlx-lm rotates halves, so the rows are put back.
- The tokenizer is built by transformers' GGUF converter from the file's metadata.

Needs the `gguf` package (`pip install 'mlx-rl-ipc[gguf]'`).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

GROUP = 32  # elements per block in Q4_0, Q4_1 and Q8_0: MLX's group size for them
NATIVE_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}  # block types that stay quantized, and their bits
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}  # GGUF name: mlx-lm model_type

# GGUF tensor names (blk.N.<name>) and mlx-lm's module paths.
TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class GGUFError(ValueError):
    """The file is not one this converter can turn into an mlx-lm folder; says why."""


def convert(gguf_path: str | Path, out_dir: str | Path, say: Callable[[str], None] = print) -> Path:
    """Write the mlx-lm folder for `gguf_path` into `out_dir` (created) and return it."""
    try:
        import gguf
    except ImportError:
        raise GGUFError("reading GGUF files needs the gguf package: pip install 'mlx-rl-ipc[gguf]'") from None
    path, out = Path(gguf_path), Path(out_dir)
    if not path.is_file():
        raise GGUFError(f"{path}: no such file")
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as e:
        raise GGUFError(f"{path} is not a GGUF file gguf can read: {e}") from None
    meta = {name: field.contents() for name, field in reader.fields.items()}
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{path}: architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    names = {t.name for t in reader.tensors}
    config = model_config(arch, meta, names)
    weights: dict[str, np.ndarray] = {}
    bits: dict[str, int] = {}
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            continue  # Llama 3's RoPE scaling: read into config.json by model_config
        module, leaf = mlx_name(tensor.name, path)
        arrays = tensor_arrays(tensor, path)
        if tensor.tensor_type.name in NATIVE_BITS:
            bits[module] = NATIVE_BITS[tensor.tensor_type.name]
        if arch == "llama" and leaf == "weight" and module.endswith(("q_proj", "k_proj")):
            heads = config["num_attention_heads" if module.endswith("q_proj") else "num_key_value_heads"]
            arrays = [unpermute_rows(a, heads) for a in arrays]
        for suffix, array in zip((leaf, "scales", "biases"), arrays):
            weights[f"{module}.{suffix}"] = array
    if bits:
        common = Counter(bits.values()).most_common(1)[0][0]
        config["quantization"] = {
            "group_size": GROUP,
            "bits": common,
            **{m: {"group_size": GROUP, "bits": b} for m, b in sorted(bits.items()) if b != common},
        }
    out.mkdir(parents=True, exist_ok=True)
    save_weights(weights, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_tokenizer(arch, meta, out)
    kinds = Counter(t.tensor_type.name for t in reader.tensors)
    say(
        f"converted {path.name} ({arch}, {config['num_hidden_layers']} layers; tensors: "
        f"{', '.join(f'{n} {k}' for k, n in kinds.most_common())}) into {out}"
    )
    return out


def mlx_name(name: str, path: Path) -> tuple[str, str]:
    """(module path, leaf) in mlx-lm for a GGUF tensor name; GGUFError for one it lacks."""
    stem, _, leaf = name.rpartition(".")
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if match and match.group(2) in BLOCK:
        return f"model.layers.{match.group(1)}.{BLOCK[match.group(2)]}", leaf
    if stem in TOP:
        return TOP[stem], leaf
    raise GGUFError(
        f"{path}: tensor {name!r} has no place in mlx-lm's model (an architecture variant this "
        "converter does not know)"
    )


def tensor_arrays(tensor: Any, path: Path) -> list[np.ndarray]:
    """[weight] for a float tensor, [weight, scales, biases] (MLX's affine format) for
    Q4_0, Q4_1 and Q8_0, [float16 weight] for the other quantized types."""
    import gguf
    from gguf import GGMLQuantizationType as T

    kind, data = tensor.tensor_type, np.asarray(tensor.data)
    if kind == T.F32:
        return [data.astype(np.float32)]
    if kind == T.F16:
        return [data.astype(np.float16)]
    if kind == T.BF16:  # kept as bfloat16: numpy has no such type, so the 16 bits travel as uint16
        return [data.view(np.uint16).reshape(data.shape[:-1] + (-1,))]
    if kind in (T.Q4_0, T.Q4_1, T.Q8_0):
        return affine(kind, data)
    try:
        return [gguf.quants.dequantize(data, kind).astype(np.float16)]
    except (NotImplementedError, KeyError, ValueError):
        raise GGUFError(
            f"{path}: tensor {tensor.name!r} has type {kind.name}, which the gguf package cannot dequantize"
        ) from None


def affine(kind: Any, data: np.ndarray) -> list[np.ndarray]:
    """Q4_0 / Q4_1 / Q8_0 blocks (rows x bytes) as MLX's packed uint32 weight, float16
    scales and biases: w = scale * q + bias with q unsigned, as mx.dequantize reads it."""
    from gguf import GGMLQuantizationType as T

    rows = data.shape[0]
    size = {T.Q4_0: 18, T.Q4_1: 20, T.Q8_0: 34}[kind]
    blocks = data.reshape(rows, -1, size)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    if kind == T.Q8_0:  # signed int8: shifted to unsigned, the shift moved into the bias
        q = (blocks[..., 2:].copy().view(np.int8).astype(np.int16) + 128).astype(np.uint32)
        bias, per_word = -128 * d, 4
    else:
        packed = blocks[..., 4:] if kind == T.Q4_1 else blocks[..., 2:]
        # The first 16 elements of a block are the low nibbles, the last 16 the high ones.
        q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.uint32)
        bias = blocks[..., 2:4].copy().view(np.float16)[..., 0] if kind == T.Q4_1 else -8 * d
        per_word = 8
    width = 32 // per_word
    q = q.reshape(rows, -1, per_word)
    weight = np.zeros(q.shape[:2], np.uint32)
    for k in range(per_word):
        weight |= q[..., k] << np.uint32(width * k)
    return [weight, d.astype(np.float16), bias.astype(np.float16)]


def unpermute_rows(array: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf `permute` of Q/K rows (per head: the two halves
    interleaved into adjacent pairs). Rows only, so it applies to packed weights, scales
    and biases alike."""
    rows = array.shape[0]
    return array.reshape(heads, rows // heads // 2, 2, *array.shape[1:]).swapaxes(1, 2).reshape(array.shape)


def model_config(arch: str, meta: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """mlx-lm's config.json from the file's metadata."""

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    tokens = meta.get("tokenizer.ggml.tokens") or []
    config: dict[str, Any] = {
        "model_type": ARCHITECTURES[arch],
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": as_float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": as_float(get("rope.freq_base", 10000.0)),
        "vocab_size": int(get("vocab_size", len(tokens))),
        "max_position_embeddings": int(get("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": False,
    }
    eos = [
        meta[f"tokenizer.ggml.{k}"]
        for k in ("eos_token_id", "eot_token_id", "eom_token_id")
        if f"tokenizer.ggml.{k}" in meta
    ]
    if eos:
        config["eos_token_id"] = sorted({int(e) for e in eos}) if len(set(eos)) > 1 else int(eos[0])
    if "tokenizer.ggml.bos_token_id" in meta:
        config["bos_token_id"] = int(meta["tokenizer.ggml.bos_token_id"])
    scaling = get("rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise GGUFError(f"RoPE scaling {scaling!r} is not supported")
    if "rope_freqs.weight" in names:
        raise GGUFError("Llama 3.1-style RoPE frequencies (rope_freqs.weight) are not supported yet")
    return config


def as_float(value: Any) -> float:
    """A float32 field as the number it was written as (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def save_weights(weights: dict[str, np.ndarray], path: Path) -> None:
    """model.safetensors through MLX (bfloat16 arrays arrive as uint16 and are viewed back)."""
    import mlx.core as mx

    arrays = {}
    for name, array in weights.items():
        value = mx.array(array)
        arrays[name] = value.view(mx.bfloat16) if array.dtype == np.uint16 else value
    mx.save_safetensors(str(path), arrays, metadata={"format": "mlx"})


def save_tokenizer(arch: str, meta: dict[str, Any], out: Path) -> None:
    """tokenizer.json and tokenizer_config.json (with the chat template) through
    transformers' GGUF tokenizer converter, fed with the file's metadata."""
    from transformers import PreTrainedTokenizerFast

    # transformers >= 5.7, as mlx-lm requires (4.x kept these in integrations.ggml).
    from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    if "tokenizer.ggml.tokens" not in meta:
        raise GGUFError("the file holds no tokenizer (tokenizer.ggml.tokens)")
    groups = {
        group: {name: meta[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in meta}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer, tokenizer_config = groups["tokenizer"], groups["tokenizer_config"]
    backend, extra = convert_gguf_tokenizer(arch, tokenizer)
    tokens = tokenizer["tokens"]
    for name, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        if f"tokenizer.ggml.{key}" in meta:
            tokenizer_config[name] = tokens[int(meta[f"tokenizer.ggml.{key}"])]
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)
    fast.save_pretrained(str(out))
    # The chat template goes in tokenizer_config.json, where every version of transformers
    # (and mlx-lm's server) looks, whether or not save_pretrained wrote chat_template.jinja.
    config_path = out / "tokenizer_config.json"
    saved = json.loads(config_path.read_text())
    saved["tokenizer_class"] = "PreTrainedTokenizerFast"  # the name transformers 4 and 5 both know
    if "chat_template" in tokenizer_config:
        saved["chat_template"] = tokenizer_config["chat_template"]
        (out / "chat_template.jinja").unlink(missing_ok=True)
    config_path.write_text(json.dumps(saved, indent=2, ensure_ascii=False) + "\n")

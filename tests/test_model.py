"""The shared model code: LoRA attach, adapter weights in and out, mlx-lm format, tiny model."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from learner.algorithms import GRPO
from learner.batching import TrainRow, completion_values, make_batch, token_rows
from policy.logprobs import sequence_logprobs
from policy.model import (
    adapter_weights,
    adapter_weights_numpy,
    adapters_disabled,
    load_policy,
    save_adapters,
    set_adapter_weights,
)
from policy.tiny import build_tiny_model
from runtime.config import QUANT_GROUP, LoraConfig
from tests.helpers import TINY_MODEL, trainer_for

LORA = LoraConfig(rank=4, scale=10.0)


def fresh():
    return load_policy(str(TINY_MODEL), LORA)


def perturb(model, seed=0):
    """Give lora_b non-zero values so the adapters change the model's output."""
    rng = np.random.default_rng(seed)
    weights = {
        k: v + (rng.normal(0, 0.2, v.shape).astype(np.float32) if k.endswith("lora_b") else 0)
        for k, v in adapter_weights_numpy(model).items()
    }
    set_adapter_weights(model, weights)


TOKENS = mx.array([[10, 11, 12, 13, 14, 15, 16]])


def test_only_lora_parameters_are_trainable():
    model, _, cfg = fresh()
    names = [k for k, _ in tree_flatten(model.trainable_parameters())]
    assert names and all(k.endswith(("lora_a", "lora_b")) for k in names)
    # 2 layers x 7 linear projections x (lora_a, lora_b)
    assert len(names) == 2 * 7 * 2
    assert cfg["num_layers"] == 2 and cfg["lora_parameters"]["rank"] == 4


def test_adapters_disabled_gives_the_base_model():
    from mlx_lm import load

    base, _ = load(str(TINY_MODEL))
    model, _, _ = fresh()
    perturb(model)
    on = sequence_logprobs(model, TOKENS, 1.0)
    with adapters_disabled(model):
        off = sequence_logprobs(model, TOKENS, 1.0)
    expected = sequence_logprobs(base, TOKENS, 1.0)
    np.testing.assert_allclose(np.array(off), np.array(expected), atol=1e-6)
    assert np.abs(np.array(on) - np.array(expected)).max() > 1e-3
    # and the scales are back afterwards
    np.testing.assert_allclose(np.array(sequence_logprobs(model, TOKENS, 1.0)), np.array(on), atol=1e-7)


def test_set_adapter_weights_refuses_mismatches():
    model, _, _ = fresh()
    weights = adapter_weights_numpy(model)
    name = next(iter(weights))
    with pytest.raises(ValueError, match="missing"):
        set_adapter_weights(model, {k: v for k, v in weights.items() if k != name})
    with pytest.raises(ValueError, match="unexpected"):
        set_adapter_weights(model, {**weights, "model.bogus.lora_a": weights[name]})
    with pytest.raises(ValueError, match="has shape"):
        set_adapter_weights(model, {**weights, name: np.zeros((1, 1), np.float32)})


def test_saved_adapters_load_in_mlx_lm_and_generate(tmp_path):
    from mlx_lm import generate, load

    model, tok, cfg = fresh()
    perturb(model, seed=1)
    out = save_adapters(model, tmp_path / "adapters", cfg)
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapters.safetensors"]
    assert json.loads((out / "adapter_config.json").read_text())["model"] == str(TINY_MODEL)
    loaded, tok2 = load(str(TINY_MODEL), adapter_path=str(out))
    np.testing.assert_allclose(
        np.array(sequence_logprobs(loaded, TOKENS, 1.0)),
        np.array(sequence_logprobs(model, TOKENS, 1.0)),
        atol=1e-6,
    )
    text = generate(loaded, tok2, "repeat 4", max_tokens=5)
    assert isinstance(text, str) and len(text) > 0
    # Saving again replaces the directory whole, leaving no temporary siblings behind.
    save_adapters(model, out, cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapters"]


def test_make_batch_puts_completion_tokens_under_the_mask():
    s1 = TrainRow(np.array([1, 2, 3]), np.array([7, 8]), np.array([-0.5, -0.25]), "length")
    s2 = TrainRow(np.array([4]), np.array([9, 9, 9]), np.array([-1.0, -2.0, -3.0]), "stop")
    b = make_batch([s1, s2], pad_id=0)
    np.testing.assert_array_equal(np.array(b.tokens), [[1, 2, 3, 7, 8], [4, 9, 9, 9, 0]])
    np.testing.assert_array_equal(np.array(b.mask), [[0, 0, 1, 1], [1, 1, 1, 0]])
    np.testing.assert_array_equal(np.array(b.behavior), [[0, 0, -0.5, -0.25], [-1, -2, -3, 0]])


def test_completion_values_read_back_what_token_rows_lay_out_under_the_mask():
    s1 = TrainRow(np.array([1, 2, 3]), np.array([7, 8]), np.array([-0.5, -0.25]), "length")
    s2 = TrainRow(np.array([4]), np.array([9, 9, 9]), np.array([-1.0, -2.0, -3.0]), "stop")
    laid = token_rows([s1, s2], [np.array([10.0, 11.0]), np.array([20.0, 21.0, 22.0])])
    np.testing.assert_array_equal(laid, [[0, 0, 10, 11], [20, 21, 22, 0]])  # as make_batch's mask
    back = completion_values([s1, s2], laid + 100 * (laid == 0))  # off the completions: not read
    assert [v.tolist() for v in back] == [[10.0, 11.0], [20.0, 21.0, 22.0]]


def test_an_optimizer_step_moves_only_the_adapters():
    model, _, _ = fresh()
    base_before = {k: np.array(v) for k, v in tree_flatten(model.parameters()) if "lora" not in k}
    lora_before = adapter_weights_numpy(model)
    samples = [
        TrainRow(np.array([5, 6]), np.array([10 + i, 11]), np.array([-4.0, -4.0]), "length") for i in range(4)
    ]
    batch = make_batch(samples, 0)
    adv = GRPO().advantages(np.array([[1.0, 0.0, 0.0, 1.0]]))
    trainer = trainer_for(model)
    stats = trainer.step(trainer.prepare(batch), adv)
    assert np.isfinite(stats["loss"]) and stats["grad_norm"] > 0
    lora_after = adapter_weights_numpy(model)
    assert any(not np.array_equal(lora_before[k], lora_after[k]) for k in lora_before)
    for k, v in tree_flatten(model.parameters()):
        if "lora" not in k:
            np.testing.assert_array_equal(np.array(v), base_before[k])
    assert set(adapter_weights(model)) == set(lora_before)


def test_tiny_model_build_is_deterministic(tmp_path):
    a, b = build_tiny_model(tmp_path / "a"), build_tiny_model(tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert json.loads((a / "config.json").read_text()) == json.loads((TINY_MODEL / "config.json").read_text())
    committed = mx.load(str(TINY_MODEL / "model.safetensors"))
    rebuilt = mx.load(str(a / "model.safetensors"))
    assert committed.keys() == rebuilt.keys()
    for k in committed:
        np.testing.assert_allclose(np.array(committed[k]), np.array(rebuilt[k]), atol=1e-6)


def quantized_copy(out, bits: int = 4):
    """The tiny model saved quantized, as mlx-lm's convert writes it (config "quantization")."""
    from mlx_lm import load

    from policy.model import quantize_base
    from policy.tiny import save_model

    model, _ = load(str(TINY_MODEL))
    quantize_base(model, bits)
    config = json.loads((TINY_MODEL / "config.json").read_text())
    return save_model(out, model, {**config, "quantization": {"group_size": QUANT_GROUP, "bits": bits}})


def test_qlora_trains_on_a_model_saved_quantized(tmp_path):
    """QLoRA: LoRA on 4-bit base weights. The adapters have the names and shapes of the
    full-precision model's (so weights move between a quantized and a full process), the
    base layers are quantized, and a step moves the adapters."""
    import mlx.nn as nn

    path = quantized_copy(tmp_path / "q4")
    model, tok, _ = load_policy(str(path), LORA)
    full, _, _ = fresh()
    assert {k: v.shape for k, v in adapter_weights_numpy(model).items()} == {
        k: v.shape for k, v in adapter_weights_numpy(full).items()
    }
    assert isinstance(model.layers[0].self_attn.q_proj.linear, nn.QuantizedLinear)
    start = adapter_weights_numpy(model)
    rng = np.random.default_rng(0)
    samples = [
        TrainRow(np.array([10, 11, 12]), rng.integers(5, 50, 6), np.full(6, -3.0), "length") for _ in range(4)
    ]
    batch = make_batch(samples, 0)
    model.train()
    trainer = trainer_for(model, beta=0.04)
    trainer.step(trainer.prepare(batch), np.array([1.0, -1.0, 0.5, -0.5]))
    assert max(np.abs(v - start[k]).max() for k, v in adapter_weights_numpy(model).items()) > 1e-4


def test_a_quantized_actor_samples_close_to_the_full_model():
    """load_policy(quantize_bits=...) quantizes the base as it loads: the same adapters,
    logprobs near the full model's, never equal, and nearer at 8 bits than at 4."""
    full, _, _ = fresh()
    perturb(full)
    gaps = {}
    for bits in (4, 8):
        quant, _, _ = load_policy(str(TINY_MODEL), LORA, quantize_bits=bits)
        set_adapter_weights(quant, adapter_weights_numpy(full))
        diff = sequence_logprobs(quant, TOKENS, 1.0) - sequence_logprobs(full, TOKENS, 1.0)
        gaps[bits] = float(mx.abs(diff).mean().item())
    assert 0 < gaps[8] < gaps[4] / 4 and gaps[4] < 1.0, gaps


def test_rounded_and_held_dense_computes_what_the_quantized_model_does():
    """On the CPU an actor's quantize_bits weights are rounded, then held as float32
    (dequantize=True): no quantized layer is left, and its logprobs equal the quantized
    model's to float32 summation order, while both stay as far from the full model as
    4 bits puts them."""
    full, _, _ = fresh()
    perturb(full)
    quant, _, _ = load_policy(str(TINY_MODEL), LORA, quantize_bits=4)
    dense, _, _ = load_policy(str(TINY_MODEL), LORA, quantize_bits=4, dequantize=True)
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in quant.named_modules())
    assert not any(
        isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in dense.named_modules()
    )
    trainable = {k for k, _ in tree_flatten(dense.trainable_parameters())}
    assert trainable and all(k.endswith(("lora_a", "lora_b")) for k in trainable)
    for model in (quant, dense):
        set_adapter_weights(model, adapter_weights_numpy(full))
    lp = {name: sequence_logprobs(m, TOKENS, 1.0) for name, m in [("q", quant), ("d", dense), ("f", full)]}
    same = float(mx.abs(lp["d"] - lp["q"]).max().item())
    quantized = float(mx.abs(lp["q"] - lp["f"]).mean().item())
    assert same < 1e-4 and quantized > 100 * same, (same, quantized)

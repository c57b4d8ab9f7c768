"""The one place that loads a model with LoRA attached and moves adapter weights in and out.

Both the actor and the learner call these functions, so the two processes build exactly
the same module tree, parameter names and LoRA layers from the same config.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from runtime.config import QUANT_GROUP, LoraConfig

ADAPTER_LEAVES = ("lora_a", "lora_b")
log = logging.getLogger(__name__)


def lora_settings(lora: LoraConfig, num_model_layers: int) -> dict[str, Any]:
    """mlx-lm's adapter_config fields for a [lora] config section."""
    num_layers = lora.num_layers
    if num_layers <= 0 or num_layers > num_model_layers:
        num_layers = num_model_layers
    params: dict[str, Any] = {"rank": lora.rank, "scale": lora.scale, "dropout": lora.dropout}
    if lora.keys:
        params["keys"] = list(lora.keys)
    return {"fine_tune_type": "lora", "num_layers": num_layers, "lora_parameters": params}


def quantize_base(model: nn.Module, bits: int) -> None:
    """Quantize the frozen base weights (QLoRA style), where MLX can: linear and embedding
    layers whose input size is a multiple of the group size. Layers already quantized are
    left as they are."""

    def quantizable(_: str, m: nn.Module) -> bool:
        return hasattr(m, "to_quantized") and m.weight.shape[-1] % QUANT_GROUP == 0

    nn.quantize(model, group_size=QUANT_GROUP, bits=bits, class_predicate=quantizable)


def dequantize_base(model: nn.Module) -> int:
    """Replace every quantized linear and embedding layer by a float32 one holding exactly
    the values its blocks encode (scales and biases widened first, so no float16 rounding).
    For the CPU, where MLX's quantized matmuls are many times slower than dense float32
    ones; on an Apple GPU quantized is the fast path. Returns how many layers it replaced."""
    replaced = []
    for path, module in model.named_modules():
        if not isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            continue
        weight = mx.dequantize(
            module.weight,
            module.scales.astype(mx.float32),
            None if module.biases is None else module.biases.astype(mx.float32),
            group_size=module.group_size,
            bits=module.bits,
            mode=module.mode,
        )
        if isinstance(module, nn.QuantizedEmbedding):
            dense: nn.Module = nn.Embedding(*weight.shape)
        else:
            dense = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in module)
            if "bias" in module:
                dense.bias = module.bias.astype(mx.float32)
        dense.weight = weight
        replaced.append((path, dense))
    if replaced:
        model.update_modules(tree_unflatten(replaced))
    return len(replaced)


def runs_on_cpu() -> bool:
    """Whether MLX computes on the CPU here (Linux, or a Mac told to)."""
    return mx.default_device().type == mx.DeviceType.cpu


def dequantizes(dequantize_on_cpu: bool) -> bool:
    """Whether a process holds quantized weights as float32: on the CPU, unless the config
    says no. That covers a quantized checkpoint and the actor's own quantization
    (actor.quantize_bits: rounded to that many bits, then held dense). The orchestrator
    turns `dequantize_on_cpu` off in a run's config when the plan has no room for it."""
    return dequantize_on_cpu and runs_on_cpu()


def load_policy(
    model_path: str,
    lora: LoraConfig,
    adapter_path: str | None = None,
    quantize_bits: int = 0,
    dequantize: bool = False,
):
    """Load a model through mlx-lm, freeze it and attach LoRA layers.

    Returns (model, tokenizer, adapter_config). With `adapter_path`, the saved adapter
    weights are loaded into the fresh LoRA layers (its LoRA settings must match). With
    `quantize_bits` the base weights are quantized as they load (lazily, so the full
    precision weights never all exist at once); the LoRA layers stay float32. With
    `dequantize`, quantized layers become float32 ones (dequantize_base): a quantized
    checkpoint's, and with `quantize_bits` the freshly rounded ones, so the model computes
    what the quantized one does at dense speed (the CPU's case).
    """
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, tokenizer = load(model_path, lazy=bool(quantize_bits))[:2]
    if dequantize and (layers := dequantize_base(model)):  # before freeze(): the new layers are frozen too
        log.info(
            "loaded %d quantized layers dequantized to float32 (MLX runs on the CPU here, where "
            "quantized matmuls are slow; model.dequantize_on_cpu = false keeps them)",
            layers,
        )
    if quantize_bits:
        quantize_base(model, quantize_bits)
        if dequantize:
            dequantize_base(model)
            log.info(
                "base weights rounded to %d bits and held as float32 (MLX runs on the CPU here, "
                "where quantized matmuls are slow; model.dequantize_on_cpu = false keeps them quantized)",
                quantize_bits,
            )
    model.freeze()
    settings = lora_settings(lora, len(model.layers))
    linear_to_lora_layers(model, settings["num_layers"], settings["lora_parameters"])
    if adapter_path is not None:
        set_adapter_weights(model, load_arrays(Path(adapter_path) / "adapters.safetensors"))
    model.eval()
    mx.eval(model.parameters())
    return model, tokenizer, dict(settings, model=model_path)


def load_arrays(path: str | Path) -> dict[str, mx.array]:
    """The arrays of a .safetensors file by name (mx.load's one-file case)."""
    arrays = mx.load(str(path))
    if not isinstance(arrays, dict):
        raise ValueError(f"{path} holds no named arrays")
    return arrays


def adapter_weights(model: nn.Module) -> dict[str, mx.array]:
    """The LoRA parameters by their mlx-lm names (what adapters.safetensors holds)."""
    leaves = cast(list[tuple[str, mx.array]], tree_flatten(model.trainable_parameters()))
    return {k: v for k, v in leaves if k.rsplit(".", 1)[-1] in ADAPTER_LEAVES}


def set_adapter_weights(model: nn.Module, weights: Mapping[str, Any]) -> None:
    """Load adapter weights, refusing any name or shape the model does not have."""
    current = adapter_weights(model)
    missing = sorted(set(current) - set(weights))
    extra = sorted(set(weights) - set(current))
    if missing or extra:
        raise ValueError(
            f"adapter weights do not match the model: missing {missing[:3]}, unexpected {extra[:3]}"
        )
    update = []
    for name, value in weights.items():
        if tuple(value.shape) != tuple(current[name].shape):
            raise ValueError(
                f"adapter weight {name} has shape {tuple(value.shape)}, "
                f"model expects {tuple(current[name].shape)}"
            )
        update.append((name, mx.array(value).astype(current[name].dtype)))
    model.load_weights(update, strict=False)
    mx.eval(model.parameters())


def adapter_weights_numpy(model: nn.Module) -> dict[str, np.ndarray]:
    """Adapter weights as float32 numpy arrays, ready for raw frames."""
    return {k: np.array(v.astype(mx.float32)) for k, v in adapter_weights(model).items()}


def weights_frame_bytes(model: nn.Module) -> int:
    """The largest array frame of a `weights` message: one adapter array as float32."""
    return 4 * max((v.size for v in adapter_weights(model).values()), default=0)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run the base model: every LoRA layer's scale is set to 0, then restored.

    This gives reference logprobs from the same model object, without a second copy of
    the base weights.
    """
    layers = [m for _, m in model.named_modules() if hasattr(m, "lora_a")]
    scales = [m.scale for m in layers]
    for m in layers:
        m.scale = 0.0
    try:
        yield
    finally:
        for m, s in zip(layers, scales):
            m.scale = s


def save_adapters(model: nn.Module, out_dir: str | Path, adapter_config: Mapping) -> Path:
    """Write adapters.safetensors + adapter_config.json in mlx-lm's format, atomically.

    Both files go to a temporary sibling directory that then replaces `out_dir`, so a
    crash mid-write leaves the previous adapters whole.
    """
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    mx.save_safetensors(str(tmp / "adapters.safetensors"), adapter_weights(model))
    (tmp / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old")
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    return out


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A short hash of the vocabulary and EOS ids: both sides must tokenize alike."""
    vocab = sorted(tokenizer.get_vocab().items())
    eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id])
    blob = json.dumps([vocab, eos], ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()[:16]

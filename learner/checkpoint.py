"""Checkpoints: everything a resume needs, written so that a crash never leaves a broken one.

A checkpoint is a directory `RUN/checkpoints/step_000042/` holding the adapters (mlx-lm
format), the optimizer state and `state.json` (step, policy version, data cursor, group
counts, config). It is written to a hidden temporary directory and renamed into place,
so a directory with that name is always complete; the newest one wins on resume.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from policy.model import adapter_weights, load_arrays, save_adapters, set_adapter_weights

log = logging.getLogger("learner")

ATTEMPTS, RETRY_S = 30, 2.0  # a checkpoint that cannot be written is tried again for a minute


def adapters_digest(model: nn.Module) -> str:
    """SHA-256 over the adapter arrays' names and bytes: equal digests, equal adapters."""
    h = hashlib.sha256()
    for name, value in sorted(adapter_weights(model).items()):
        h.update(name.encode())
        h.update(np.asarray(value.astype(mx.float32)).tobytes())
    return h.hexdigest()[:16]


def save_checkpoint(
    run_dir: Path,
    model: nn.Module,
    optimizer: optim.Optimizer,
    adapter_config: dict,
    state: dict[str, Any],
    keep: int,
) -> Path:
    """Write `RUN/checkpoints/step_NNNNNN/` whole or not at all, keep the newest `keep`.
    A write can fail for a while (every descriptor taken by a flood of connections, a
    full disk): it is tried again for a minute before the run fails on it."""
    for attempt in range(ATTEMPTS):
        try:
            return _save(run_dir, model, optimizer, adapter_config, state, keep)
        except (OSError, RuntimeError) as e:  # MLX reports a failed open as RuntimeError
            if attempt == ATTEMPTS - 1:
                raise
            log.error(
                "cannot write the checkpoint of step %d: %s; trying again in %.0f s",
                state["step"],
                e,
                RETRY_S,
            )
            time.sleep(RETRY_S)
    raise AssertionError("unreachable")


def _save(
    run_dir: Path,
    model: nn.Module,
    optimizer: optim.Optimizer,
    adapter_config: dict,
    state: dict[str, Any],
    keep: int,
) -> Path:
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{state['step']:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    save_adapters(model, tmp / "adapters", adapter_config)
    mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(optimizer.state)))
    state = dict(state, adapters_digest=adapters_digest(model))
    (tmp / "state.json").write_text(json.dumps(state, indent=2) + "\n")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in sorted(root.glob("step_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    # RUN/adapters holds the newest checkpoint's adapters, for mlx_lm.generate --adapter-path.
    save_adapters(model, Path(run_dir) / "adapters", adapter_config)
    return final


def load_checkpoint(path: Path, model: nn.Module, optimizer: optim.Optimizer) -> dict[str, Any]:
    """Restore adapters and optimizer state; return the saved state (checked digest)."""
    set_adapter_weights(model, load_arrays(path / "adapters" / "adapters.safetensors"))
    optimizer.init(model.trainable_parameters())
    optimizer.state = tree_unflatten(list(load_arrays(path / "optimizer.safetensors").items()))
    state = json.loads((path / "state.json").read_text())
    if adapters_digest(model) != state["adapters_digest"]:
        raise RuntimeError(f"checkpoint {path} is corrupt: adapter digest differs")
    return state

"""Hold a process to the memory share the orchestrator gave it.

The orchestrator passes the share in MLXRL_MEMORY_LIMIT_MB. MLX then keeps its allocations
under it (set_memory_limit), keeps at most a quarter of it as cache of freed buffers, and
on Apple Silicon wires at most the share (so two processes cannot both wire the GPU's
whole working set).
"""

from __future__ import annotations

import os

import mlx.core as mx

from runtime.config import MEMORY_SHARE_ENV


def apply_memory_share() -> int | None:
    """Apply the share from the environment; returns it in bytes, or None if unset."""
    value = os.environ.get(MEMORY_SHARE_ENV)
    if not value:
        return None
    limit = int(float(value) * (1 << 20))
    mx.set_memory_limit(limit)
    mx.set_cache_limit(limit // 4)
    if mx.metal.is_available():
        mx.set_wired_limit(limit)
    return limit

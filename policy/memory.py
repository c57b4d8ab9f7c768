"""Hold a process to the memory share the orchestrator gave it.

The orchestrator passes the share in MLXRL_MEMORY_LIMIT_MB. MLX then keeps its allocations
under it (set_memory_limit), keeps as cache of freed buffers at most a quarter of it and
never more than MLX's own cache limit, and on Apple Silicon wires at most the share (so
two processes cannot both wire the GPU's whole working set).

Why the cache is only ever lowered: on Metal MLX caches up to its whole memory limit, and
a quarter of the share leaves the other process room. On the CPU backend MLX caches 32 MB,
and freed buffers go back to malloc, which hands their pages to the next allocation of any
size. Raised to a quarter of the share (gigabytes), the cache kept buffers of the sizes the
last forwards freed, which under long-tailed lengths the next ones rarely ask for again:
each new size then came from fresh pages (page faults, the kernel zeroing them), the
learner's memory grew by about 100 MB a second to the limit, and its step took 5% to 6%
longer (`python -m benchmarks.learner_takes --cache-mb 5443`; docs/benchmarks.md, "A cache
limit the share only lowers").
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
    own = mx.set_cache_limit(limit // 4)
    if own < limit // 4:
        mx.set_cache_limit(own)
    if mx.metal.is_available():
        mx.set_wired_limit(limit)
    return limit

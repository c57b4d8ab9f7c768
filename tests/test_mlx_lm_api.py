"""What this project uses of mlx-lm beyond its public loaders: the cache classes the
engine and the learner batch, grow, trim, cut and merge (policy/engine.py,
policy/logprobs.py), and the tuner's LoRA and checkpointing hooks. pyproject.toml bounds
mlx-lm to the minor versions tested; a new one that renames any of these fails here,
naming the attribute, instead of deep inside a run."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import cache as mlx_cache

KV_ATTRIBUTES = ("keys", "values", "offset", "update_and_fetch", "trim")
BATCH_ATTRIBUTES = (
    "keys",
    "values",
    "offset",
    "_idx",
    "left_padding",
    "update_and_fetch",
    "extract",
    "extend",
    "filter",
    "merge",
)


def grown(cache, rows: int):
    keys = mx.ones((rows, 2, 3, 4))
    cache.update_and_fetch(keys, keys)
    return cache


@pytest.mark.parametrize(
    "name,make,attributes",
    [
        ("KVCache", lambda: grown(mlx_cache.KVCache(), 1), KV_ATTRIBUTES),
        ("BatchKVCache", lambda: grown(mlx_cache.BatchKVCache([0, 1]), 2), BATCH_ATTRIBUTES),
    ],
)
def test_the_cache_classes_have_what_the_engine_and_learner_use(name, make, attributes):
    cache = make()
    missing = [a for a in attributes if not hasattr(cache, a)]
    assert not missing, f"mlx-lm's {name} lacks {missing}: policy/engine.py and policy/logprobs.py use them"


def test_batch_caches_cut_merge_and_extract_rows_as_the_engine_relies_on():
    batch = grown(mlx_cache.BatchKVCache([0, 1]), 2)
    row = batch.extract(1)
    assert isinstance(row, mlx_cache.KVCache) and row.offset == 3 - 1  # its left padding dropped
    merged = mlx_cache.BatchKVCache.merge([row, grown(mlx_cache.KVCache(), 1)])
    assert merged.keys.shape[0] == 2
    merged.filter(mx.array([0]))
    assert merged.keys.shape[0] == 1
    merged.extend(grown(mlx_cache.BatchKVCache([0]), 1))
    assert merged.keys.shape[0] == 2


def test_a_trimmed_cache_drops_its_last_positions_as_the_engine_relies_on():
    """A kept episode cache (a row extracted from the batch's) whose next prompt adds
    nothing is trimmed by one token, which then runs again (policy/engine.py, `_continue`):
    `trim(n)` drops the last n positions, and the next update writes where they were, so
    the keys fetched are the ones kept and the new one, not the old last one twice."""
    batch = mlx_cache.BatchKVCache([0, 1])  # row 1 is left-padded by one position
    for position in range(3):
        keys = mx.full((2, 2, 1, 4), float(position))
        batch.update_and_fetch(keys, keys)
    kept = batch.extract(1)
    assert kept.offset == 2 and kept.keys[0, 0, : kept.offset, 0].tolist() == [1.0, 2.0]
    assert kept.trim(1) == 1 and kept.offset == 1
    again = mx.full((1, 2, 1, 4), 9.0)
    keys, values = kept.update_and_fetch(again, again)
    assert kept.offset == 2 and keys.shape == values.shape == (1, 2, 2, 4)
    assert keys[0, 0, :, 0].tolist() == values[0, 1, :, 0].tolist() == [1.0, 9.0]


def test_the_tuner_hooks_exist():
    from mlx_lm.tuner import trainer, utils

    for module, name in ((utils, "linear_to_lora_layers"), (trainer, "grad_checkpoint")):
        assert callable(getattr(module, name, None)), f"mlx-lm's tuner lacks {module.__name__}.{name}"

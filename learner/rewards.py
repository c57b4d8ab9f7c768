"""In-process reward functions with TRL's signature.

`fn(prompts, completions, completion_ids, **columns) -> list[float | None]`, one entry per
completion. Completions come in the prompt's shape: plain text for text prompts, a list
with one assistant message for chat prompts. Dataset columns are repeated per completion.
A None reward counts as 0, as in TRL's weighted nan-sum.
"""

from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

RewardFn = Callable[..., list]


class RewardError(RuntimeError):
    """A reward function failed or returned something unusable."""


def load_reward_function(spec: str, search_path: str | None = None) -> RewardFn:
    """Import `module:function`, looking beside the config file first."""
    module_name, _, fn_name = spec.partition(":")
    if search_path and search_path not in sys.path:
        sys.path.insert(0, search_path)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise RewardError(f"reward.function {spec!r}: cannot import {module_name!r}: {e}") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise RewardError(f"reward.function {spec!r}: {module_name} has no function {fn_name!r}")
    return fn


def reward_inputs(groups: list[Any]) -> dict[str, list]:
    """Flatten groups into TRL's per-completion argument lists."""
    prompts, completions, completion_ids = [], [], []
    columns: dict[str, list] = {}
    for g in groups:
        chat = isinstance(g.prompt, list)
        for text, ids in zip(g.texts, g.completion_ids):
            prompts.append(g.prompt)
            completions.append([{"role": "assistant", "content": text}] if chat else text)
            completion_ids.append(list(ids))
    names = {k for g in groups for k in g.columns}
    for name in sorted(names):
        columns[name] = [g.columns.get(name) for g in groups for _ in g.texts]
    return dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)


def score(fn: RewardFn, groups: list[Any]) -> np.ndarray:
    """Call the reward function once for the whole batch; rewards as [groups, G]."""
    inputs = reward_inputs(groups)
    n = len(inputs["completions"])
    try:
        values = fn(**inputs)
    except Exception as e:
        raise RewardError(f"reward function raised {type(e).__name__}: {e}") from e
    if not isinstance(values, (list, tuple, np.ndarray)) or len(values) != n:
        got = len(values) if hasattr(values, "__len__") else type(values).__name__
        raise RewardError(f"reward function must return {n} values (one per completion), got {got}")
    rewards = []
    for i, v in enumerate(values):
        if v is None:
            rewards.append(0.0)
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not math.isfinite(v):
            raise RewardError(f"reward function returned {v!r} for completion {i}; "
                              "expected a finite number or None")
        rewards.append(float(v))
    sizes = [len(g.texts) for g in groups]
    return np.array(rewards, dtype=np.float64).reshape(len(groups), sizes[0])

"""In-process reward functions with TRL's signature.

`fn(prompts, completions, completion_ids, **columns) -> list[float | None]`, one entry per
completion. Completions come in the prompt's shape: plain text for text prompts, a list
with one assistant message for chat prompts. Dataset columns are repeated per completion.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

RewardFn = Callable[..., list]
WORKER = "worker"  # a reward entry served by external workers on the reward socket
ENV = "env"  # a reward entry that is what an episode's environment returned


class RewardError(RuntimeError):
    """A reward function failed or returned something unusable."""


def import_spec(
    spec: str, search_path: str | None, error: type[Exception], what: str
) -> tuple[str, str, Any]:
    """Import `module:name`, looking in `search_path` (the config's directory) first, like
    a local import. Returns (module name, name, the object or None); raises `error`
    naming the `what` when the module does not import.

    A module found in `search_path` is loaded from its file under a name of its own, so a
    user's `rewards.py` or `policy.py` is never taken for this project's package of that
    name (an import by name would find the one already loaded). The directory goes on the
    end of sys.path, so the module's own imports of its neighbours still work."""
    module_name, _, name = spec.partition(":")
    if search_path and search_path not in sys.path:
        sys.path.append(search_path)
    try:
        module = _import_from(search_path, module_name) or importlib.import_module(module_name)
    except ImportError as e:
        raise error(f"{what} {spec!r}: cannot import {module_name!r}: {e}") from None
    return module_name, name, getattr(module, name, None)


def _import_from(directory: str | None, module_name: str) -> ModuleType | None:
    """`module_name` loaded from its file in `directory` under a private name, or None if
    it has no file there. A dotted name's top package is loaded so, then the rest from it."""
    if not directory:
        return None
    top, _, rest = module_name.partition(".")
    base = Path(directory).resolve() / top
    package = base / "__init__.py"
    path = package if package.is_file() else base.with_suffix(".py")
    if not path.is_file():
        return None
    private = f"_user_{hashlib.sha256(str(path).encode()).hexdigest()[:12]}_{top}"
    if private not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            private, path, submodule_search_locations=[str(base)] if path == package else None
        )
        if spec is None or spec.loader is None:
            raise ImportError(f"{path} cannot be loaded as a module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[private] = module  # before it runs: dataclasses and pickle look it up
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[private]
            raise
    return importlib.import_module(f"{private}.{rest}") if rest else sys.modules[private]


def load_reward_function(spec: str, search_path: str | None = None) -> RewardFn:
    """Import `module:function`, looking in `search_path` (the config's directory) first."""
    module_name, fn_name, fn = import_spec(spec, search_path, RewardError, "reward function")
    if not callable(fn):
        raise RewardError(f"reward function {spec!r}: {module_name} has no function {fn_name!r}")
    return fn


def reward_inputs(
    prompt: Any,
    texts: list[str],
    completion_ids: list[list[int]],
    columns: dict[str, Any],
    turns: list[list[dict]] | None = None,
) -> dict[str, list]:
    """TRL's per-completion argument lists for one prompt and its completions. A chat
    episode's completion is its list of turns (assistant and environment messages); a text
    episode's is its whole text, the environment's included."""
    n = len(texts)
    chat = isinstance(prompt, list)
    completions: list[Any]
    if chat and turns is not None:
        completions = turns
    else:
        completions = [[{"role": "assistant", "content": t}] if chat else t for t in texts]
    inputs = {
        "prompts": [prompt] * n,
        "completions": completions,
        "completion_ids": [list(map(int, ids)) for ids in completion_ids],
    }
    for name, value in columns.items():
        if name not in inputs:
            inputs[name] = [value] * n
    return inputs


def check_rewards(values: Any, n: int, source: str) -> list[float | None]:
    """One finite number or None per completion, or RewardError saying what is wrong."""
    if not isinstance(values, (list, tuple)) and not hasattr(values, "tolist"):
        raise RewardError(f"{source} must return a list, got {type(values).__name__}")
    values = list(values.tolist() if hasattr(values, "tolist") else values)
    if len(values) != n:
        raise RewardError(f"{source} returned {len(values)} values for {n} completions")
    out: list[float | None] = []
    for i, v in enumerate(values):
        if v is None:
            out.append(None)
        elif isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise RewardError(f"{source} returned {v!r} for completion {i}; expected a finite number or None")
        else:
            out.append(float(v))
    return out


def call_reward(fn: RewardFn, inputs: dict[str, list], name: str) -> list[float | None]:
    n = len(inputs["completions"])
    try:
        values = fn(**inputs)
    except Exception as e:
        raise RewardError(f"reward function {name} raised {type(e).__name__}: {e}") from e
    return check_rewards(values, n, f"reward function {name}")

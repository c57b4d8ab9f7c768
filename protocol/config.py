"""The run configuration: one TOML file, validated in full before any model loads.

It lives beside the wire format because it is the other contract between the processes:
the orchestrator validates it and writes the resolved copy (`config.json`, absolute paths)
into the run directory, and the actor and learner read that copy. No MLX here.
"""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from protocol.lifecycle import write_atomic

REQUIRED = object()

# The orchestrator hands each process its memory share (MB) in this variable.
MEMORY_SHARE_ENV = "MLXRL_MEMORY_LIMIT_MB"


class ConfigError(ValueError):
    """A configuration problem; the message names the key."""


def _range(lo=None, hi=None, lo_open=False, hi_open=False) -> Callable[[Any], str | None]:
    def check(v):
        if lo is not None and (v <= lo if lo_open else v < lo):
            return f"must be {'>' if lo_open else '>='} {lo}"
        if hi is not None and (v >= hi if hi_open else v > hi):
            return f"must be {'<' if hi_open else '<='} {hi}"
        return None
    return check


def _one_of(*choices) -> Callable[[Any], str | None]:
    return lambda v: None if v in choices else f"must be one of {', '.join(map(repr, choices))}"


def _reward_functions(v: list) -> str | None:
    if not v:
        return "must name at least one reward"
    for spec in v:
        module, _, fn = spec.partition(":") if isinstance(spec, str) else ("", "", "")
        if spec != "worker" and not (module and fn):
            return f"entries must be 'module:function' or 'worker' ({spec!r} is neither)"
    if len(set(v)) < len(v):
        return "may name each function (and 'worker') once"
    return None


def _numbers(v: list) -> str | None:
    ok = all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v)
    return None if ok else "must be a list of finite numbers"


# section -> key -> (type, default, check). Types are Python types; float accepts ints.
# A default of None means "unset": the objective's own default applies.
SCHEMA: dict[str, dict[str, tuple]] = {
    "model": {
        "path": (str, REQUIRED, None),
    },
    "lora": {
        "rank": (int, 8, _range(1)),
        "scale": (float, 20.0, _range(0, lo_open=True)),
        "dropout": (float, 0.0, _range(0, 1, hi_open=True)),
        "num_layers": (int, -1, _range(-1)),
        "keys": (list, [], None),
    },
    "data": {
        "prompts": (str, REQUIRED, None),
        "shuffle": (bool, True, None),
        "seed": (int, 0, None),
    },
    "sampling": {
        "group_size": (int, 8, _range(2)),
        "temperature": (float, 1.0, _range(0, lo_open=True)),
        "top_p": (float, 1.0, _range(0, 1, lo_open=True)),
        "top_k": (int, 0, _range(0)),
        "min_p": (float, 0.0, _range(0, 1, hi_open=True)),
        "max_tokens": (int, 64, _range(1)),
        "max_prompt_tokens": (int, 1024, _range(1)),
        "seed": (int, 0, None),
    },
    "train": {
        "steps": (int, 100, _range(1)),
        "batch_size": (int, 8, _range(1)),
        "learning_rate": (float, 1e-5, _range(0, lo_open=True)),
        "max_grad_norm": (float, 1.0, _range(0, lo_open=True)),
        "micro_batch_size": (int, 0, _range(0)),
        "grad_checkpoint": (bool, False, None),
        "max_staleness": (int, 0, _range(0)),
        "checkpoint_every": (int, 10, _range(0)),
        "keep_checkpoints": (int, 3, _range(1)),
        "seed": (int, 0, None),
    },
    "algorithm": {
        "name": (str, "grpo", _one_of("grpo", "bnpo", "dapo", "dr_grpo", "gspo", "rloo")),
        "beta": (float, 0.0, _range(0)),
        "epsilon": (float, None, _range(0, 1, lo_open=True, hi_open=True)),
        "epsilon_high": (float, None, _range(0, lo_open=True)),
        "scale_rewards": (str, "default", _one_of("default", "group", "batch", "none")),
        "num_iterations": (int, 1, _range(1)),
        "is_correction": (str, "none", _one_of("none", "truncate", "mask")),
        "is_level": (str, "token", _one_of("token", "sequence")),
        "is_cap": (float, 2.0, _range(1, lo_open=True)),
    },
    "reward": {
        "functions": (list, REQUIRED, _reward_functions),
        "weights": (list, [], _numbers),
        "timeout_s": (float, 60.0, _range(0, lo_open=True)),
        "max_attempts": (int, 5, _range(1)),
    },
    "run": {
        "dir": (str, "runs/default", None),
        "transport": (str, "ipc", _one_of("ipc", "tcp")),
        "host": (str, "127.0.0.1", None),
        "port": (int, 5555, _range(1, 65535)),
        "max_restarts": (int, 3, _range(0)),
        "hang_timeout_s": (float, 600.0, _range(0, lo_open=True)),
    },
}

_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false",
               list: "a list"}


def _check_value(section: str, key: str, value: Any) -> Any:
    typ, _, check = SCHEMA[section][key]
    ok = isinstance(value, typ) and not (typ is int and isinstance(value, bool))
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise ConfigError(f"{section}.{key} must be {_TYPE_NAMES[typ]}, got {value!r}")
    if typ is float and not math.isfinite(value):
        raise ConfigError(f"{section}.{key} must be a finite number, got {value!r}")
    if typ is str and not value:
        raise ConfigError(f"{section}.{key} must not be empty")
    if check is not None and (problem := check(value)):
        raise ConfigError(f"{section}.{key} {problem}, got {value!r}")
    return value


def validate(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Fill defaults and check every key; raise ConfigError naming the first bad one."""
    for section, table in raw.items():
        if section not in SCHEMA:
            raise ConfigError(f"unknown section [{section}]; known: {', '.join(SCHEMA)}")
        if not isinstance(table, dict):
            raise ConfigError(f"[{section}] must be a table")
        for key in table:
            if key not in SCHEMA[section]:
                raise ConfigError(f"unknown key {section}.{key}; known: {', '.join(SCHEMA[section])}")
    cfg: dict[str, dict[str, Any]] = {}
    for section, keys in SCHEMA.items():
        cfg[section] = {}
        for key, (_, default, _) in keys.items():
            if default is None and raw.get(section, {}).get(key) is None:
                cfg[section][key] = None  # unset (config.json writes it as null)
            elif key in raw.get(section, {}):
                cfg[section][key] = _check_value(section, key, raw[section][key])
            elif default is REQUIRED:
                raise ConfigError(f"missing required key {section}.{key}")
            else:
                cfg[section][key] = list(default) if isinstance(default, list) else default
    reward = cfg["reward"]
    if reward["weights"] and len(reward["weights"]) != len(reward["functions"]):
        raise ConfigError(f"reward.weights has {len(reward['weights'])} entries for "
                          f"{len(reward['functions'])} reward.functions")
    return cfg


def parse_override(item: str) -> tuple[str, str, Any]:
    """'section.key=value' -> (section, key, value); value is read as TOML, else a string."""
    name, eq, text = item.partition("=")
    section, dot, key = name.strip().partition(".")
    if not eq or not dot or not key:
        raise ConfigError(f"--set expects section.key=value, got {item!r}")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    return section, key, value


def load_config(path: str | Path, overrides: list[str] = (), run_dir: str | None = None,
                steps: int | None = None) -> dict[str, dict[str, Any]]:
    """Read, override, validate and resolve a TOML config. Model and data paths are
    relative to the file's directory, run.dir to the current directory (like any output
    directory); the result has absolute paths."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from None
    settings = [parse_override(item) for item in overrides]
    if run_dir is not None:
        settings.append(("run", "dir", run_dir))
    if steps is not None:
        settings.append(("train", "steps", steps))
    for section, key, value in settings:
        table = raw.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"[{section}] must be a table, got {table!r}")
        table[key] = value
    cfg = validate(raw)
    return resolve_paths(cfg, path.resolve().parent)


def resolve_paths(cfg: dict, base: Path) -> dict:
    """Make file paths absolute. A model path that is not a local directory is a hub id."""
    model = base / cfg["model"]["path"]
    if model.is_dir():
        cfg["model"]["path"] = str(model)
    elif cfg["model"]["path"].startswith((".", "/")):
        raise ConfigError(f"model.path {cfg['model']['path']!r} is not a directory")
    prompts = base / cfg["data"]["prompts"]
    if not prompts.is_file():
        raise ConfigError(f"data.prompts file {prompts} does not exist")
    cfg["data"]["prompts"] = str(prompts)
    cfg["run"]["dir"] = str((Path.cwd() / cfg["run"]["dir"]).resolve())
    # Reward modules are looked up beside the config file first, like a local import.
    cfg["reward"]["search_path"] = str(base)
    return cfg


def write_run_config(run_dir: Path, cfg: dict) -> None:
    write_atomic(Path(run_dir) / "config.json", json.dumps(cfg, indent=2) + "\n")


def read_run_config(run_dir: str | Path) -> dict:
    return json.loads((Path(run_dir) / "config.json").read_text())

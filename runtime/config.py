"""The run configuration: one TOML file, validated in full before any model loads.

Each `[section]` is a frozen dataclass (runtime/config_sections.py); its fields are the
section's keys, with their defaults, one line of help each (docs/configuration.md's
reference is generated from them: `python -m runtime.config`) and a check. `validate`
turns a TOML-shaped dict into a `Config` and names the key of the first problem;
`load_config` reads a file, applies `--set section.key=value` overrides and makes paths
absolute. The orchestrator writes the result into the run directory (`config.json`),
and every process reads that copy.

It lives beside the wire format because it is the other contract between the processes.
No MLX here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
import tomllib
import types
import typing
from collections.abc import Iterable
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any, Literal

# ALGORITHM_NAMES (the built-in objectives, which learner/algorithms.py registers) and the
# Literal types are re-exported: the learner's objectives and its correction take them from
# here, with the sections.
from runtime.config_sections import ALGORITHM_NAMES as ALGORITHM_NAMES
from runtime.config_sections import (
    ActorConfig,
    AgentConfig,
    AlgorithmConfig,
    DataConfig,
    EnvConfig,
    EvalConfig,
    LearnerConfig,
    LogConfig,
    LoraConfig,
    ModelConfig,
    RewardConfig,
    RunConfig,
    SamplingConfig,
    TrainConfig,
)
from runtime.config_sections import CorrectionLevel as CorrectionLevel
from runtime.config_sections import CorrectionMode as CorrectionMode
from runtime.config_sections import ScaleRewards as ScaleRewards
from runtime.rundir import write_atomic

# The orchestrator hands each process its memory share (MB) in this variable.
MEMORY_SHARE_ENV = "MLXRL_MEMORY_LIMIT_MB"


class ConfigError(ValueError):
    """A configuration problem; the message names the key."""


def ceil_div(a: int, b: int) -> int:
    """a / b rounded up, in integers (a >= 0, b > 0)."""
    return -(-a // b)


def credit_window(max_staleness: int, batch_size: int, actors: int) -> int:
    """The groups one of `actors` live actors may keep in flight (its credit window):
    (max_staleness + 1) batches shared among them, ceil((k + 1) * B / n). The learner
    tells each actor this; an actor assumes it until told; the docs and the memory plan
    follow it."""
    return ceil_div((max_staleness + 1) * batch_size, max(actors, 1))


def logit_chunk_positions(chunk_mb: float, vocab: int) -> int:
    """Positions (rows x tokens) per chunk of `train.logit_chunk_mb` at a vocabulary; 0 = whole."""
    return max(1, int(chunk_mb * (1 << 20) / (4 * vocab))) if chunk_mb > 0 else 0


# Quantized weights (actor.quantize_bits) carry a scale and a bias per group of this many.
QUANT_GROUP = 64


@dataclass(frozen=True, kw_only=True)
class Config:
    """A whole run's configuration: one field per TOML section."""

    model: ModelConfig
    lora: LoraConfig = LoraConfig()
    data: DataConfig
    sampling: SamplingConfig = SamplingConfig()
    train: TrainConfig = TrainConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    actor: ActorConfig = ActorConfig()
    learner: LearnerConfig = LearnerConfig()
    reward: RewardConfig
    env: EnvConfig = EnvConfig()
    agent: AgentConfig = AgentConfig()
    log: LogConfig = LogConfig()
    eval: EvalConfig = EvalConfig()
    run: RunConfig = RunConfig()

    @property
    def actor_share(self) -> int:
        """The groups of a batch one actor samples: ceil(batch_size / actor.count)."""
        return ceil_div(self.train.batch_size, self.actor.count)

    @property
    def decode_rows(self) -> int:
        """Rows an actor's engine decodes at once (what the memory plan counts):
        `actor.max_rows`, by default the rows of every group the actor may keep in flight,
        its credit window. With max_staleness = k >= 1 that is k + 1 batches' share, so the
        groups sampled ahead decode beside the current batch's slowest rows instead of
        queueing behind them: with one prompt a step, one group at a time would otherwise
        decode. A static engine and episodes take a share of a batch at a time (a model
        whose caches force the static engine at load is planned for more rows than it
        decodes: the plan is made before any model loads)."""
        if self.actor.max_rows:
            return self.actor.max_rows
        groups = self.actor_share
        if self.actor.engine == "continuous" and not self.env.environment:
            groups = credit_window(self.train.max_staleness, self.train.batch_size, self.actor.count)
        return groups * self.sampling.group_size

    @property
    def partials_mb(self) -> float:
        """What the learner may hold for the reference logprobs of groups still sampled
        (learner/ahead.py): `train.reference_ahead_mb` with the KL penalty, groups
        streamed and a learner alone (whatever the loss: a batch-scaled one never streams,
        which only the learner knows); none for episodes and agent sessions, whose actors
        send no partials."""
        on = self.algorithm.beta > 0 and self.train.stream_groups and self.learner.ranks == 1
        sampled = not (self.env.environment or self.agent.enabled)
        return self.train.reference_ahead_mb if on and sampled else 0.0

    @property
    def max_completion_tokens(self) -> int:
        """The longest completion: `sampling.max_tokens`, or for episodes (model and
        environment tokens together) `env.max_episode_tokens`, for agent sessions
        `agent.max_episode_tokens`."""
        if self.agent.enabled:
            return self.agent.max_episode_tokens
        return self.env.max_episode_tokens if self.env.environment else self.sampling.max_tokens

    @property
    def rollout_array_bytes(self) -> int:
        """The largest array frame a rollout of this run carries: 4 bytes (int32, float32)
        per token of the group's completions, or of the prompt. The rollout socket refuses
        larger frames (protocol.sockets). An agent session's traces carry the part of their
        first prompts the group does not share, within the session's budget."""
        if self.agent.enabled:  # a session's traces: the rest of its first prompt, and its budget
            row = self.sampling.max_prompt_tokens + self.agent.max_episode_tokens
            return 4 * self.sampling.group_size * row
        return 4 * max(self.sampling.group_size * self.max_completion_tokens, self.sampling.max_prompt_tokens)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain JSON data: what config.json holds (lists, null for unset)."""
        return as_dict(self)

    def replace(self, **sections: dict[str, Any]) -> Config:
        """A copy with some keys changed and validated again: replace(train={"steps": 3})."""
        raw = self.to_dict()
        for section, keys in sections.items():
            raw.setdefault(section, {}).update(keys)
        return validate(raw)


SECTIONS: dict[str, type] = {f.name: typing.get_type_hints(Config)[f.name] for f in fields(Config)}


def as_dict(obj: Any) -> dict[str, Any]:
    """A config or a section as plain JSON data (tuples become lists), for files and wires."""
    return json.loads(json.dumps(dataclasses.asdict(obj)))


# --------------------------------------------------------------------------- validation

_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}


def _typed(name: str, typ: Any, value: Any) -> Any:
    """`value` as `typ` (str, int, float, bool, tuple[X, ...], X | None), or ConfigError."""
    if typing.get_origin(typ) in (types.UnionType, typing.Union):
        if value is None:
            return None
        (typ,) = [t for t in typing.get_args(typ) if t is not type(None)]
    if typing.get_origin(typ) is Literal:  # the type of its choices; the key's check names them
        typ = type(typing.get_args(typ)[0])
    if typing.get_origin(typ) is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name} must be a list, got {value!r}")
        item = typing.get_args(typ)[0]
        return tuple(_typed(f"{name}[{i}]", item, v) for i, v in enumerate(value))
    ok = isinstance(value, typ) and not (typ in (int, float) and isinstance(value, bool))
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise ConfigError(f"{name} must be {_TYPE_NAMES[typ]}, got {value!r}")
    if typ is float and not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    if typ is str and not value:
        raise ConfigError(f"{name} must not be empty")
    return value


def _section(name: str, cls: type, table: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    values = {}
    for f in fields(cls):
        path = f"{name}.{f.name}"
        if f.name not in table or (table[f.name] is None and f.default is None):
            if f.default is MISSING:
                raise ConfigError(f"missing required key {path}")
            continue
        value = _typed(path, hints[f.name], table[f.name])
        check = f.metadata["check"]
        if value is not None and check is not None and (problem := check(value)):
            raise ConfigError(f"{path} {problem}, got {table[f.name]!r}")
        values[f.name] = value
    return cls(**values)


def validate(raw: dict[str, Any]) -> Config:
    """A Config from TOML-shaped data; raise ConfigError naming the first bad key."""
    _check_names(raw)
    agent = raw.get("agent", {})
    if (agent.get("function") or agent.get("command")) and "functions" not in raw.get("reward", {}):
        # An agent's sessions bring their rewards: "env", unless reward.functions says more.
        raw = {**raw, "reward": {**raw.get("reward", {}), "functions": ["env"]}}
    cfg = Config(**{name: _section(name, cls, raw.get(name, {})) for name, cls in SECTIONS.items()})
    _check_agent(cfg)
    _check_rewards_and_env(cfg)
    _check_processes(cfg)
    return cfg


def _check_names(raw: dict[str, Any]) -> None:
    """Every section and key is one we know."""
    for section, table in raw.items():
        if section not in SECTIONS:
            raise ConfigError(f"unknown section [{section}]; known: {', '.join(SECTIONS)}")
        if not isinstance(table, dict):
            raise ConfigError(f"[{section}] must be a table")
        known = [f.name for f in fields(SECTIONS[section])]
        for name in table:
            if name not in known:
                raise ConfigError(f"unknown key {section}.{name}; known: {', '.join(known)}")


def _check_rewards_and_env(cfg: Config) -> None:
    """The rewards, the environment and the evaluation agree with each other."""
    reward = cfg.reward
    if reward.weights and len(reward.weights) != len(reward.functions):
        raise ConfigError(
            f"reward.weights has {len(reward.weights)} entries for {len(reward.functions)} reward.functions"
        )
    if (cfg.env.environment == "openenv") != (cfg.env.openenv_url is not None):
        raise ConfigError('env.openenv_url goes with env.environment = "openenv", and only with it')
    if "env" in reward.functions and cfg.env.environment is None and not cfg.agent.enabled:
        raise ConfigError("reward.functions names 'env', but no env.environment or [agent] is set")
    if cfg.eval.every and (cfg.env.environment or cfg.agent.enabled):
        raise ConfigError(
            "eval.every with an environment or an [agent]: its held-out episodes are evaluated "
            "before the first step and after the last (set eval.every = 0)"
        )
    if cfg.algorithm.gigpo_omega > 0 and not cfg.env.environment and not cfg.agent.enabled:
        raise ConfigError(
            "algorithm.gigpo_omega: GiGPO's step-level advantage needs multi-turn episodes "
            "(env.environment or an [agent]); set it to 0 for single-turn completions"
        )
    if cfg.eval.every and not cfg.eval.prompts:
        raise ConfigError("eval.every needs eval.prompts (the held-out prompt rows)")


def _check_processes(cfg: Config) -> None:
    """The actors and learner ranks can share the work as the config splits it."""
    if cfg.env.environment and cfg.actor.count > 1:
        # Each actor would bind the one env socket of the run directory.
        raise ConfigError(
            f"actor.count = {cfg.actor.count} with env.environment: one actor serves the "
            "environment's episodes for now; set actor.count = 1"
        )
    if 0 < cfg.actor.max_rows < cfg.sampling.group_size:
        raise ConfigError(
            f"actor.max_rows = {cfg.actor.max_rows} is below sampling.group_size = "
            f"{cfg.sampling.group_size}: a group's rows decode together (0 = the default)"
        )
    if cfg.actor.remote >= cfg.actor.count:
        raise ConfigError(
            f"actor.remote = {cfg.actor.remote} must be below actor.count = {cfg.actor.count}: "
            "`up` starts at least one actor"
        )
    if cfg.learner.ranks > cfg.train.batch_size * cfg.sampling.group_size:
        raise ConfigError(
            f"learner.ranks = {cfg.learner.ranks} is more than the "
            f"{cfg.train.batch_size * cfg.sampling.group_size} completions of a batch "
            "(train.batch_size * sampling.group_size): every rank needs rows to train"
        )


def _check_agent(cfg: Config) -> None:
    agent = cfg.agent
    if agent.function is not None and agent.command:
        raise ConfigError("agent.function and agent.command: name your agent one way, not both")
    if agent.enabled and "env" not in cfg.reward.functions:
        raise ConfigError(
            "reward.functions must name 'env' with an [agent]: the reward the agent reports "
            "(other functions may add to it)"
        )
    if agent.enabled and cfg.env.environment:
        raise ConfigError(
            "[agent] and env.environment: a run's rollouts are agent sessions or environment "
            "episodes, not both"
        )


# --------------------------------------------------------------------------- files and overrides


def parse_override(item: str) -> tuple[str, str, Any]:
    """'section.key=value' -> (section, key, value); value is read as TOML, else a string."""
    name, eq, text = item.partition("=")
    section, dot, name = name.strip().partition(".")
    if not eq or not dot or not name:
        raise ConfigError(f"--set expects section.key=value, got {item!r}")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    return section, name, value


def _override(raw: dict[str, Any], overrides: Iterable[str], run_dir: str | None, steps: int | None) -> None:
    """Apply --set items, then --run-dir and --steps (which win), to TOML-shaped data."""
    settings = [parse_override(item) for item in overrides]
    if run_dir is not None:
        settings.append(("run", "dir", run_dir))
    if steps is not None:
        settings.append(("train", "steps", steps))
    for section, name, value in settings:
        table = raw.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"[{section}] must be a table, got {table!r}")
        table[name] = value


def load_config(
    path: str | Path, overrides: Iterable[str] = (), run_dir: str | None = None, steps: int | None = None
) -> Config:
    """Read, override, validate and resolve a TOML config. Model, data and reward-module
    paths are relative to the file's directory, run.dir to the current directory (like
    any output directory); the result has absolute paths."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from None
    _override(raw, overrides, run_dir, steps)
    return resolve_paths(validate(raw), path.resolve().parent)


def load_run_config(run_dir: str | Path, overrides: Iterable[str] = (), steps: int | None = None) -> Config:
    """A stopped run's own config (its config.json), with --set / --steps applied. The
    directory given is the run, even if it was moved or copied since it started; paths in
    overrides are relative to the current directory."""
    if not (Path(run_dir) / "config.json").exists():
        raise ConfigError(f"{run_dir} is not a run directory (no config.json)")
    raw = json.loads((Path(run_dir) / "config.json").read_text())
    _override(raw, overrides, str(Path(run_dir).resolve()), steps)
    return resolve_paths(validate(raw), Path.cwd())


# Files data.prompts may name (anything else that is no path is a dataset name).
DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


def resolve_paths(cfg: Config, base: Path) -> Config:
    """Make file paths absolute. A model path that is not a local directory is a hub id."""
    model = cfg.model.path
    if (base / model).is_dir():
        model = str(base / model)
    elif model.startswith((".", "/")):
        raise ConfigError(f"model.path {model!r} is not a directory")
    eval_prompts = cfg.eval.prompts and _resolve_prompts("eval.prompts", cfg.eval.prompts, base)
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, path=model),
        data=dataclasses.replace(cfg.data, prompts=_resolve_prompts("data.prompts", cfg.data.prompts, base)),
        eval=dataclasses.replace(cfg.eval, prompts=eval_prompts),
        run=dataclasses.replace(cfg.run, dir=str((Path.cwd() / cfg.run.dir).resolve())),
        # Reward modules are looked up beside the config file first, like a local import.
        reward=dataclasses.replace(cfg.reward, search_path=str(base / (cfg.reward.search_path or ""))),
    )


def _resolve_prompts(name: str, value: str, base: Path) -> str:
    """A prompt file's absolute path, or a dataset name (looked up in the Hugging Face cache)."""
    path = base / value
    if path.exists():
        return str(path)
    if value.startswith((".", "/")) or Path(value).suffix in DATA_SUFFIXES:
        raise ConfigError(f"{name} file {path} does not exist")
    return value


def write_run_config(run_dir: str | Path, cfg: Config) -> None:
    write_atomic(Path(run_dir) / "config.json", json.dumps(cfg.to_dict(), indent=2) + "\n")


def read_run_config(run_dir: str | Path) -> Config:
    """The run directory's config.json, validated again (it may be edited or old)."""
    return validate(json.loads((Path(run_dir) / "config.json").read_text()))


# --------------------------------------------------------------------------- the reference


def _shown(f: dataclasses.Field) -> str:
    if f.metadata["shown"]:
        return f.metadata["shown"]
    if f.default is MISSING:
        return "required"
    if isinstance(f.default, str):
        return f'`"{f.default}"`'
    # TOML's spelling for numbers and booleans, with 1e-5 rather than Python's 1e-05.
    return re.sub(r"e-0(\d)", r"e-\1", json.dumps(f.default))


def reference_table() -> str:
    """docs/configuration.md's reference, one row per key, from the section dataclasses."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for name, cls in SECTIONS.items():
        rows += [f"| `{name}.{f.name}` | {_shown(f)} | {f.metadata['doc']} |" for f in fields(cls)]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(reference_table())

"""The run configuration: one TOML file, validated in full before any model loads.

Each `[section]` is a frozen dataclass below; its fields are the section's keys, with their
defaults, one line of help each (docs/configuration.md's reference is generated from them:
`python -m protocol.config`) and a check. `validate` turns a TOML-shaped dict into a
`Config` and names the key of the first problem; `load_config` reads a file, applies
`--set section.key=value` overrides and makes paths absolute. The orchestrator writes the
result into the run directory (`config.json`), and every process reads that copy.

It lives beside the wire format because it is the other contract between the processes.
No MLX here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
import sys
import tomllib
import types
import typing
from collections.abc import Callable, Iterable, Iterator
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args

from protocol.lifecycle import fail, write_atomic

# The orchestrator hands each process its memory share (MB) in this variable.
MEMORY_SHARE_ENV = "MLXRL_MEMORY_LIMIT_MB"

# The choices of [algorithm], named once: the learner's objectives (learner/algorithms.py)
# and its correction (learner/step.py) take these types.
AlgorithmName = Literal["grpo", "bnpo", "dapo", "dr_grpo", "gspo", "rloo", "cispo", "sapo"]
ScaleRewards = Literal["group", "batch", "none"]
CorrectionMode = Literal["none", "truncate", "mask"]
CorrectionLevel = Literal["token", "sequence"]
EngineName = Literal["continuous", "static"]
Transport = Literal["ipc", "tcp"]
ALGORITHM_NAMES: tuple[str, ...] = get_args(AlgorithmName)


class ConfigError(ValueError):
    """A configuration problem; the message names the key."""


@contextlib.contextmanager
def config_errors(*also: type[Exception]) -> Iterator[None]:
    """In a command: a bad config (ConfigError, or `also`) ends it with `config error: ...`
    on stderr and exit code 2 (EXIT_CONFIG)."""
    try:
        yield
    except (ConfigError, *also) as e:  # type: ignore[misc]  # mypy cannot see a tuple of classes
        fail(f"config error: {e}")


Check = Callable[[Any], "str | None"]


def _range(lo=None, hi=None, lo_open=False, hi_open=False) -> Check:
    def check(v):
        if lo is not None and (v <= lo if lo_open else v < lo):
            return f"must be {'>' if lo_open else '>='} {lo}"
        if hi is not None and (v >= hi if hi_open else v > hi):
            return f"must be {'<' if hi_open else '<='} {hi}"
        return None

    return check


def _one_of(*choices) -> Check:
    return lambda v: None if v in choices else f"must be one of {', '.join(map(repr, choices))}"


def _reward_functions(v: tuple[str, ...]) -> str | None:
    if not v:
        return "must name at least one reward"
    for spec in v:
        module, _, fn = spec.partition(":")
        if spec not in ("worker", "env") and not (module and fn):
            return f"entries must be 'module:function', 'worker' or 'env' ({spec!r} is none of these)"
    if len(set(v)) < len(v):
        return "may name each function (and 'worker', 'env') once"
    return None


def _environment(v: str) -> str | None:
    module, _, cls = v.partition(":")
    return (
        None
        if v in ("socket", "openenv") or (module and cls)
        else "must be 'module:Class', 'socket' or 'openenv'"
    )


def key(default: Any = MISSING, doc: str = "", check: Check | None = None, shown: str | None = None):
    """A config key: its default (none = required), one line of help, a check of its value
    returning the problem or None, and how docs/configuration.md shows the default when not literally."""
    return field(default=default, metadata={"doc": doc, "check": check, "shown": shown})


# A default of None means "unset": the objective's own default applies.


@dataclass(frozen=True)
class ModelConfig:
    path: str = key(doc="local model directory or hub id (mlx-lm's loader)")
    dequantize_on_cpu: bool = key(
        True,
        "where MLX runs on the CPU, load a quantized checkpoint dequantized "
        "to float32, and hold an actor's `quantize_bits` weights rounded but "
        "dense (MLX's quantized matmuls are many times slower there), when "
        "the memory plan has room; on a GPU nothing changes",
    )


@dataclass(frozen=True)
class LoraConfig:
    rank: int = key(8, "LoRA rank", _range(1))
    scale: float = key(20.0, "LoRA scale (mlx-lm's `scale`, not `alpha`)", _range(0, lo_open=True))
    dropout: float = key(0.0, "LoRA dropout (keep 0 for on-policy logprobs)", _range(0, 1, hi_open=True))
    num_layers: int = key(-1, "number of last transformer blocks with LoRA; -1 = all", _range(-1))
    keys: tuple[str, ...] = key(
        (),
        'module names to adapt, e.g. `["self_attn.q_proj", "self_attn.v_proj"]`; empty = every linear layer',
        shown="all linear",
    )


@dataclass(frozen=True)
class DataConfig:
    prompts: str = key(
        doc="prompt rows: a JSONL, JSON, CSV or parquet file, a `datasets` `save_to_disk` "
        "folder (paths relative to the config file), or a dataset name in the local "
        "Hugging Face cache"
    )
    split: str | None = key(
        None,
        "the split to read where there are several (a saved DatasetDict, a cached dataset)",
        shown="train",
    )
    prompt_column: str = key(
        "prompt",
        "the column that holds the prompt (text or chat messages); every "
        "other column goes to the reward functions",
    )
    shuffle: bool = key(True, "reshuffle the prompts each epoch")
    seed: int = key(0, "the shuffle's seed")


@dataclass(frozen=True)
class SamplingConfig:
    group_size: int = key(8, "G, completions per prompt (>= 2)", _range(2))
    temperature: float = key(
        1.0, "> 0; the same temperature scales the learner's logprobs", _range(0, lo_open=True)
    )
    top_p: float = key(
        1.0,
        "nucleus truncation of what is sampled (not of the logprobs; see below)",
        _range(0, 1, lo_open=True),
    )
    top_k: int = key(0, "sample among the k most likely tokens; 0 = off", _range(0))
    min_p: float = key(
        0.0, "drop tokens below min_p times the top probability; 0 = off", _range(0, 1, hi_open=True)
    )
    max_tokens: int = key(64, "completion length limit", _range(1))
    max_prompt_tokens: int = key(1024, "longer prompts keep their last tokens", _range(1))
    seed: int = key(
        0, "sampling seed; a sample's noise is keyed by it and by the prompt's place in the data stream"
    )


def credit_window(max_staleness: int, batch_size: int, actors: int) -> int:
    """The groups one of `actors` live actors may keep in flight (its credit window):
    (max_staleness + 1) batches shared among them, ceil((k + 1) * B / n). The learner
    tells each actor this; an actor assumes it until told; the docs and the memory plan
    follow it."""
    return -(-(max_staleness + 1) * batch_size // max(actors, 1))


def logit_chunk_positions(chunk_mb: float, vocab: int) -> int:
    """Positions (rows x tokens) per chunk of `train.logit_chunk_mb` at a vocabulary; 0 = whole."""
    return max(1, int(chunk_mb * (1 << 20) / (4 * vocab))) if chunk_mb > 0 else 0


@dataclass(frozen=True)
class TrainConfig:
    steps: int = key(100, "optimizer steps", _range(1))
    batch_size: int = key(
        8, "prompts (groups) per step; a step trains on `batch_size * group_size` completions", _range(1)
    )
    learning_rate: float = key(1e-5, "Adam learning rate", _range(0, lo_open=True))
    max_grad_norm: float = key(1.0, "gradient-norm clipping", _range(0, lo_open=True))
    micro_batch_size: int = key(
        0,
        "completions per forward/backward; gradients accumulate exactly over micro-batches; 0 = whole batch",
        _range(0),
    )
    sort_by_length: bool = key(
        True,
        "form micro-batches of rows of similar length, each padded only to "
        "its own longest row (and cut where padding would pass 10%); false: rows "
        "in order, padded to the batch's longest",
    )
    share_prompts: bool = key(
        True,
        "run each group's prompt once per micro-batch and its completions "
        "after it (a KV cache), instead of the prompt again in every row; not "
        "with `grad_checkpoint`",
    )
    grad_checkpoint: bool = key(
        False, "recompute each block's activations in backward (less memory, more time)"
    )
    fuse_old_logprobs: bool = key(
        True,
        "with `algorithm.num_iterations = 1`, take the old-policy logprobs "
        "from the training forward (stop-gradient) instead of a forward of "
        "their own; the same update, one forward fewer",
    )
    logit_chunk_mb: float = key(
        64.0,
        "MB of float32 logits the learner forms at once (one copy; its step "
        "holds about four): a micro-batch whose logits are larger is done a "
        "chunk of positions at a time, running the model body once more; "
        "0 = always whole",
        _range(0),
    )
    max_staleness: int = key(0, "batches the actor may sample ahead of training (0 = on-policy)", _range(0))
    checkpoint_every: int = key(
        10, "write a checkpoint every N steps (and always at the end or on Ctrl-C); 0 = only then", _range(0)
    )
    keep_checkpoints: int = key(3, "how many checkpoints to keep", _range(1))
    seed: int = key(0, "the learner's random seed (LoRA init)")


@dataclass(frozen=True)
class AlgorithmConfig:
    name: AlgorithmName = key(
        "grpo",
        "`grpo`, `bnpo`, `dapo`, `dr_grpo`, `gspo`, `rloo`, `cispo` or `sapo` (see below)",
        _one_of(*ALGORITHM_NAMES),
    )
    beta: float = key(
        0.0,
        "KL penalty weight (k3 estimator against the adapters-off model); 0 skips the reference pass",
        _range(0),
    )
    epsilon: float | None = key(
        None,
        "lower clip range: 0.2, GSPO 3e-4",
        _range(0, 1, lo_open=True, hi_open=True),
        shown="objective's",
    )
    epsilon_high: float | None = key(
        None,
        "upper clip range: `epsilon`, DAPO 0.28, GSPO 4e-4; CISPO's cap on its weight, 5.0",
        _range(0, lo_open=True),
        shown="objective's",
    )
    scale_rewards: ScaleRewards | None = key(
        None,
        "`group` (GRPO, BNPO, DAPO, GSPO), `batch`, or `none` (Dr. GRPO, RLOO)",
        _one_of(*get_args(ScaleRewards)),
        shown="objective's",
    )
    num_iterations: int = key(
        1, "optimizer steps per batch (TRL's mu), old-policy logprobs frozen across them", _range(1)
    )
    is_correction: CorrectionMode = key(
        "none",
        "behavior-policy correction: `none`, `truncate` or `mask` (see below)",
        _one_of(*get_args(CorrectionMode)),
    )
    is_level: CorrectionLevel = key(
        "token", "`token` or `sequence` importance weights", _one_of(*get_args(CorrectionLevel))
    )
    is_cap: float = key(2.0, "C: truncate at C, or mask outside [1/C, C]", _range(1, lo_open=True))
    sapo_temperature_pos: float = key(
        1.0, "SAPO's gate temperature where the advantage is positive", _range(0, lo_open=True)
    )
    sapo_temperature_neg: float = key(1.05, "SAPO's gate temperature elsewhere", _range(0, lo_open=True))


# Quantized weights (actor.quantize_bits) carry a scale and a bias per group of this many.
QUANT_GROUP = 64


@dataclass(frozen=True)
class ActorConfig:
    quantize_bits: int = key(
        0,
        "sample from a copy of the base weights quantized to 4 or 8 bits (the "
        "learner trains full precision; the behavior logprobs carry the "
        "difference, see `is_correction`); 0 = off",
        _one_of(0, 4, 8),
    )
    count: int = key(
        1,
        "actors feeding the learner; each samples every count-th prompt and keeps "
        "ceil((max_staleness + 1) * batch_size / count) groups in flight",
        _range(1),
    )
    remote: int = key(
        0,
        "how many of them join from other machines (`actor run --slot I`, slots "
        "count - remote to count - 1); `up` starts the others",
        _range(0),
    )
    engine: EngineName = key(
        "continuous",
        "`continuous`: rows refill the decode batch as others end, each "
        "group is sent the step its last row ends, and with "
        "max_staleness >= 1 new weights land between two decode "
        "steps; `static`: each share of a batch decodes until its "
        "longest row ends",
        _one_of(*get_args(EngineName)),
    )
    max_rows: int = key(
        0,
        "rows the continuous engine decodes at once; 0 = the rows of the actor's share "
        "of a batch, ceil(batch_size / count) * group_size (what the memory plan counts)",
        _range(0),
    )


@dataclass(frozen=True)
class LearnerConfig:
    ranks: int = key(
        1,
        "data-parallel learner processes on this machine (mlx.core.distributed, ring "
        "backend); each trains its share of every batch, rank 0 owns the sockets and "
        "checkpoints. Several Macs: `mlx.launch --hostfile` (docs/scale-out.md)",
        _range(1),
    )


@dataclass(frozen=True)
class LogConfig:
    completions_every: int = key(
        0,
        "every N steps, write a sample of the batch's groups (prompt, "
        "completions, rewards, advantages) to `completions.jsonl`; 0 = never",
        _range(0),
    )
    completions_groups: int = key(2, "groups written at each such step", _range(1))
    report_to: tuple[str, ...] = key(
        (),
        "where else metrics go, beside metrics.jsonl (TRL's name): "
        "`tensorboard` (RUN/tensorboard), `trackio` (RUN/trackio), `wandb` "
        "(offline, RUN/wandb); each its own extra",
        lambda v: (
            None
            if set(v) <= {"tensorboard", "trackio", "wandb"}
            else "entries must be 'tensorboard', 'trackio' or 'wandb'"
        ),
    )
    project: str = key("mlx-rl-ipc", "the trackio / W&B project; the run is named after its directory")


@dataclass(frozen=True)
class EvalConfig:
    prompts: str | None = key(
        None, "held-out prompt rows, in any form `data.prompts` takes; unset = no evaluation", shown="unset"
    )
    every: int = key(
        0,
        "evaluate every N steps; with `prompts` set, always before the first step and "
        "after the last (0 = only then)",
        _range(0),
    )
    num_samples: int = key(
        4, "completions per prompt (n): pass@1 and pass@k for k = 2, 4, ... up to n", _range(1)
    )
    temperature: float | None = key(
        None, "sampling temperature", _range(0, lo_open=True), shown="`sampling.temperature`"
    )
    max_tokens: int | None = key(None, "completion length limit", _range(1), shown="`sampling.max_tokens`")
    limit: int = key(0, "evaluate the first N prompts; 0 = all", _range(0))
    pass_threshold: float = key(1.0, "a completion passes when its total reward is at least this")
    seed: int = key(0, "sampling seed; the same at every evaluation, so steps are compared on the same draws")


@dataclass(frozen=True)
class EnvConfig:
    environment: str | None = key(
        None,
        "multi-turn episodes: `module:Class` (served by env workers the "
        'orchestrator starts), `"openenv"` (the OpenEnv server at '
        '`env.openenv_url`, through such workers) or `"socket"` (you '
        "attach workers, in any language, to the env socket; PROTOCOL.md); "
        "unset = one completion per prompt",
        _environment,
        shown="unset",
    )
    num_workers: int = key(
        1, "env workers the orchestrator starts for a `module:Class` or `openenv`", _range(1)
    )
    openenv_url: str | None = key(
        None, 'the OpenEnv server (`http://host:port`) of `environment = "openenv"`', shown="unset"
    )
    openenv_action_field: str = key("message", "OpenEnv: the action's field that carries the model's turn")
    openenv_observation_field: str | None = key(
        None, "OpenEnv: the observation's field the model sees; unset = all its fields as JSON", shown="unset"
    )
    max_turns: int = key(4, "model turns per episode", _range(1))
    max_episode_tokens: int = key(
        256,
        "completion tokens per episode, the model's and the environment's "
        "together (each model turn is also capped by `sampling.max_tokens`)",
        _range(1),
    )
    timeout_s: float = key(60.0, "deadline for an env worker's reply", _range(0, lo_open=True))
    max_attempts: int = key(
        3,
        "times an episode is started (again on another worker when its worker is "
        "lost) before its group is dropped",
        _range(1),
    )


@dataclass(frozen=True)
class RewardConfig:
    functions: tuple[str, ...] = key(
        doc='list of `module:function`, `"worker"` (external workers) and '
        '`"env"` (the rewards the environment returned, summed over the '
        "episode), each once",
        check=_reward_functions,
    )
    weights: tuple[float, ...] = key((), "one weight per function", shown="all 1.0")
    timeout_s: float = key(60.0, "deadline for an external worker's reply", _range(0, lo_open=True))
    max_attempts: int = key(5, "dispatches of one request before its group is dropped", _range(1))
    search_path: str | None = key(
        None,
        "directory searched first for reward and environment modules (relative to the config file)",
        shown="the config file's directory",
    )


@dataclass(frozen=True)
class RunConfig:
    dir: str = key("runs/default", "run directory (relative to where you run the command)")
    transport: Transport = key(
        "ipc",
        "`ipc` (private socket files) or `tcp` (encrypted, and only peers "
        "with the run's CURVE keys get in; see `insecure`)",
        _one_of(*get_args(Transport)),
    )
    insecure: bool = key(
        False,
        "`tcp` without CURVE keys: plain ZeroMQ, no encryption, no "
        "authentication; anyone who reaches the ports can join the run",
    )
    host: str = key("127.0.0.1", "for `tcp`")
    port: int = key(
        5555, "for `tcp` (the reward socket takes port + 1, the env socket port + 2)", _range(1, 65535)
    )
    max_restarts: int = key(3, "restarts allowed per process", _range(0))
    hang_timeout_s: float = key(
        600.0, "a process whose heartbeat is older is killed and restarted", _range(0, lo_open=True)
    )


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
    log: LogConfig = LogConfig()
    eval: EvalConfig = EvalConfig()
    run: RunConfig = RunConfig()

    @property
    def decode_rows(self) -> int:
        """Rows an actor's continuous engine decodes at once: `actor.max_rows`, by default
        the rows of the actor's share of a batch (what the memory plan counts)."""
        share = -(-self.train.batch_size // self.actor.count) * self.sampling.group_size
        return self.actor.max_rows or share

    @property
    def max_completion_tokens(self) -> int:
        """The longest completion: `sampling.max_tokens`, or for episodes (model and
        environment tokens together) `env.max_episode_tokens`."""
        return self.env.max_episode_tokens if self.env.environment else self.sampling.max_tokens

    @property
    def rollout_array_bytes(self) -> int:
        """The largest array frame a rollout of this run carries: 4 bytes (int32, float32)
        per token of the group's completions, or of the prompt. The rollout socket refuses
        larger frames (protocol.sockets)."""
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
    for section, table in raw.items():
        if section not in SECTIONS:
            raise ConfigError(f"unknown section [{section}]; known: {', '.join(SECTIONS)}")
        if not isinstance(table, dict):
            raise ConfigError(f"[{section}] must be a table")
        known = [f.name for f in fields(SECTIONS[section])]
        for name in table:
            if name not in known:
                raise ConfigError(f"unknown key {section}.{name}; known: {', '.join(known)}")
    cfg = Config(**{name: _section(name, cls, raw.get(name, {})) for name, cls in SECTIONS.items()})
    reward = cfg.reward
    if reward.weights and len(reward.weights) != len(reward.functions):
        raise ConfigError(
            f"reward.weights has {len(reward.weights)} entries for {len(reward.functions)} reward.functions"
        )
    if (cfg.env.environment == "openenv") != (cfg.env.openenv_url is not None):
        raise ConfigError('env.openenv_url goes with env.environment = "openenv", and only with it')
    if "env" in reward.functions and cfg.env.environment is None:
        raise ConfigError("reward.functions names 'env', but no env.environment is set")
    if cfg.eval.prompts and cfg.env.environment:
        raise ConfigError(
            "eval.prompts: evaluating episodes with an environment is not supported yet; "
            "leave [eval] out of a run with env.environment"
        )
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
    if cfg.eval.every and not cfg.eval.prompts:
        raise ConfigError("eval.every needs eval.prompts (the held-out prompt rows)")
    return cfg


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
    """docs/configuration.md's reference, one row per key, from the dataclasses above."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for name, cls in SECTIONS.items():
        rows += [f"| `{name}.{f.name}` | {_shown(f)} | {f.metadata['doc']} |" for f in fields(cls)]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(reference_table())

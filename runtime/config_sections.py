"""Every [section] of the run configuration: a frozen dataclass whose fields are the
section's keys, each with its default, one line of help and a check of its value.

The schema is apart from runtime/config.py (the whole `Config`, its validation, loading,
overrides and the reference table) so that each file holds one job: here, what a key
is; there, what is done with keys. No MLX here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, dataclass, field
from typing import Any, Literal, get_args

# The built-in objectives' names, the one list this MLX-free layer has of them: the config
# accepts these or a user's `module:Class`. learner/algorithms.py registers a class under
# each (a test keeps the two, and docs/algorithms.md's table, equal); see `_algorithm_name`.
ALGORITHM_NAMES: tuple[str, ...] = (
    "grpo",
    "bnpo",
    "dapo",
    "dr_grpo",
    "gspo",
    "rloo",
    "cispo",
    "sapo",
    "luspo",
    "vespo",
)
# The other choices of [algorithm], named once: the learner's objectives and its correction
# (learner/correction.py) take these types.
ScaleRewards = Literal["group", "batch", "none"]
CorrectionMode = Literal["none", "truncate", "mask"]
CorrectionLevel = Literal["token", "sequence"]
EngineName = Literal["continuous", "static"]
Transport = Literal["ipc", "tcp"]


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


def _algorithm_name(v: str) -> str | None:
    """A built-in objective's name, or `module:Class`: a user's loss, imported from beside
    the config (`reward.search_path`) when the learner starts, which says there if the
    module does not import, has no such class, or the class is no loss.

    The design: this layer may not import the learner's MLX code (tests/test_house.py), so
    it knows the built-ins by name only, from ALGORITHM_NAMES; the classes register
    themselves under those names (learner/algorithms.py, `register`), and tests fail when
    the registry, this list or docs/algorithms.md's table (generated from the registry)
    disagree. A new built-in is its class and its name here."""
    module, _, cls = v.partition(":")
    if v in ALGORITHM_NAMES or (module and cls and ":" not in cls):
        return None
    return f"must be one of {', '.join(map(repr, ALGORITHM_NAMES))} or 'module:Class'"


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
    stream_groups: bool = key(
        True,
        "learn each group as it arrives: its forward and backward run while the batch's "
        "other groups are still sampled, and the update, once the batch is complete, is "
        "the same; false: wait for the whole batch. Batch-scaled advantages "
        '(`algorithm.scale_rewards = "batch"`), and more learner ranks than '
        "`sampling.group_size`, always wait",
    )
    sort_by_length: bool = key(
        True,
        "form micro-batches of rows of similar length, each padded only to "
        "its own longest row (cut where the forwards cost least: padding, shared "
        "prompts, a forward's own cost); false: rows in order, padded to the "
        "batch's longest",
    )
    share_prompts: bool = key(
        True,
        "run each group's prompt once and its completions after it (a KV cache), "
        "instead of the prompt again in every row; once for all the micro-batches "
        "its rows went to, unless LoRA dropout makes each forward random; not with "
        "`grad_checkpoint`",
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
    reference_ahead_mb: float = key(
        256.0,
        "MB of keys and values the learner may hold to take the reference "
        "logprobs (`algorithm.beta > 0`) of groups still being sampled, from "
        "the actors' partials (PROTOCOL.md, `partial`), while it would wait; "
        "their steps then skip most of the reference pass. 0 = none",
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
    name: str = key(
        "grpo",
        ", ".join(f"`{n}`" for n in ALGORITHM_NAMES[:-1])
        + f" or `{ALGORITHM_NAMES[-1]}` (see below); or `module:Class`, a loss of your own beside "
        "the config (docs/algorithms.md)",
        _algorithm_name,
    )
    beta: float = key(
        0.0,
        "KL penalty weight (k3 estimator against the adapters-off model); 0 skips the reference pass",
        _range(0),
    )
    epsilon: float | None = key(
        None,
        "lower clip range: 0.2, GSPO 3e-4, LUSPO 2e-3",
        _range(0, 1, lo_open=True, hi_open=True),
        shown="objective's",
    )
    epsilon_high: float | None = key(
        None,
        "upper clip range: `epsilon`, DAPO 0.28, GSPO 4e-4, LUSPO 2.5e-3; CISPO's cap on its weight, 5.0",
        _range(0, lo_open=True),
        shown="objective's",
    )
    scale_rewards: ScaleRewards | None = key(
        None,
        "`group` (all but Dr. GRPO and RLOO), `batch`, or `none` (Dr. GRPO, RLOO)",
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
    vespo_k_pos: float = key(
        2.0, "VESPO's power k of its weight W^k e^(lambda (1 - W)) where the advantage is >= 0", _range(0)
    )
    vespo_lambda_pos: float = key(
        3.0, "VESPO's decay lambda of that weight where the advantage is >= 0", _range(0, lo_open=True)
    )
    vespo_k_neg: float = key(3.0, "VESPO's k where the advantage is negative", _range(0))
    vespo_lambda_neg: float = key(
        2.0, "VESPO's lambda where the advantage is negative", _range(0, lo_open=True)
    )
    gigpo_omega: float = key(
        0.0,
        "GiGPO: weight of the step-level advantage added to the episode's, for multi-turn "
        "episodes (env.environment or an [agent]); 0 = off (see below)",
        _range(0),
    )
    gigpo_gamma: float = key(0.95, "GiGPO: discount of the step rewards' returns", _range(0, 1))


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
        "rows the engine decodes at once (a static batch too); 0 = the rows of the groups the actor "
        "may keep in flight, ceil((max_staleness + 1) * batch_size / count) * group_size (engine = "
        '"static" and episodes: ceil(batch_size / count) * group_size), what the memory plan counts '
        "(a model whose caches force the static engine decodes a share of a batch at a time)",
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


# report_to entry -> (module it needs, extra that installs it)
REPORT_BACKENDS = {
    "tensorboard": ("tensorboardX", "tensorboard"),
    "trackio": ("trackio", "trackio"),
    "wandb": ("wandb", "wandb"),
}


def missing_backends(names: tuple[str, ...]) -> list[str]:
    """The `pip install` hint for each named backend whose library is not installed."""
    import importlib.util

    hints = []
    for name in names:
        module, extra = REPORT_BACKENDS[name]
        if importlib.util.find_spec(module) is None:
            hints.append(f"log.report_to {name!r} needs {module}: pip install 'mlx-rl-ipc[{extra}]'")
    return hints


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
            None if set(v) <= set(REPORT_BACKENDS) else "entries must be 'tensorboard', 'trackio' or 'wandb'"
        ),
    )
    project: str = key("mlx-rl-ipc", "the trackio / W&B project; the run is named after its directory")
    completions_tokens: bool = key(
        False,
        "`completions.jsonl` also holds each completion's token ids, loss mask and behavior "
        "logprobs: exactly what was trained",
    )
    timeline: bool = key(
        True,
        "every process records its spans (busy, waiting) in RUN/timeline/; "
        "`orchestrator timeline` shows them",
    )


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
        4, "completions per prompt (n): pass@1 and pass@k for k = 2, 4, ... below n, and k = n", _range(1)
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


def _agent_function(v: str) -> str | None:
    module, _, fn = v.partition(":")
    return None if module and fn else "must be 'module:function'"


@dataclass(frozen=True)
class AgentConfig:
    function: str | None = key(
        None,
        "your agent as a Python function `module:function` (beside the config; sync or async), "
        "called once per session with `row`, `base_url` and `api_key`; it returns the reward",
        _agent_function,
        shown="unset",
    )
    command: tuple[str, ...] = key(
        (),
        "your agent as a program in any language: gets OPENAI_BASE_URL, OPENAI_API_KEY and the "
        "row as JSON on stdin; prints its reward last (or POSTs it to `/v1/session/reward`)",
        shown="unset",
    )
    timeout_s: float = key(
        300.0, "a session's deadline, from its start to its reward", _range(0, lo_open=True)
    )
    max_attempts: int = key(
        3, "times a session is started (again after its agent failed) before its group is dropped", _range(1)
    )
    max_episode_tokens: int = key(
        1024,
        "tokens a session may add after its first prompt, the model's and the agent's together "
        "(each call is also capped by `sampling.max_tokens`); a call past it ends with `length`",
        _range(1),
    )
    host: str = key(
        "127.0.0.1", "where the actor serves the sessions' OpenAI API (loopback unless told otherwise)"
    )

    @property
    def enabled(self) -> bool:
        """Whether the run's rollouts are agent sessions."""
        return self.function is not None or bool(self.command)


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
        "directory searched first for reward, environment and agent modules (relative to the config file)",
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

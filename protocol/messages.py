"""Every message of the protocol, defined once: its fields, their types and checks, and
what each means.

A definition is a dataclass. The sender builds one (`Rollout(group_id=..., ...)`, then
`.frames()`), `decode` checks every message that arrives against its kind's definition,
and the receiver reads typed fields from it (`Rollout.read(msg)`). PROTOCOL.md's field
tables are printed from these definitions (`python -m protocol --write PROTOCOL.md`; a
test keeps them equal), so a new field is one line here and nothing else.

A field's `type` is one of the names in TYPES, as PROTOCOL.md writes them. An optional
field may be `lenient`: a value of the wrong type reads as absent instead of refusing the
message (for facts a receiver can do without: timings, counters, a place in the data).
Checks that span fields (a rollout's lengths agree) are the definition's `check`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import numpy as np

from protocol.wire import (
    CREDIT,
    END,
    FINISH_REASONS,
    HEARTBEAT,
    HELLO,
    MAX_MESSAGE_BYTES,
    OBSERVATION,
    PARTIAL,
    READY,
    RESET,
    ROLES,
    ROLLOUT,
    SCORE,
    SCORE_REPLY,
    STEP,
    STOP,
    WEIGHTS,
    Message,
    ProtocolError,
    encode,
    is_data_cursor,
    unpack,
)

# On the rollout socket an actor (or observer) must also say what it runs, so the learner
# can refuse a mismatch (the actor's hello on the env socket has none).
HELLO_MODEL_FIELDS = ("model", "tokenizer", "lora")


def is_reward(v: Any) -> bool:
    """A reward: a finite number (not a bool), or nil."""
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _count(v: Any) -> bool:
    return type(v) is int and v >= 0


def _list_of(ok: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, list) and all(ok(x) for x in v)


def _chat(v: Any) -> bool:
    return isinstance(v, dict) and isinstance(v.get("role"), str) and isinstance(v.get("content"), str)


# Each type as PROTOCOL.md names it, and its check.
TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "int": _count,  # every integer of the protocol is >= 0; a bool is not one
    "number": _number,
    "bool": lambda v: isinstance(v, bool),
    "map": lambda v: isinstance(v, dict),
    "list": lambda v: isinstance(v, list),
    "any": lambda v: True,
    "list of string": _list_of(lambda x: isinstance(x, str)),
    "list of int": _list_of(_count),
    "list of number/nil": _list_of(is_reward),
    "list of list of number": _list_of(_list_of(lambda x: x is not None and is_reward(x))),
    "list of messages": _list_of(_list_of(_chat)),
    "number/nil": is_reward,
    "[int, int]": is_data_cursor,
    "[int, int] or nil": lambda v: v is None or is_data_cursor(v),
    "list of [int, int]": _list_of(is_data_cursor),
}


@dataclass(frozen=True)
class Spec:
    """One field of a definition: a header field, or (with `dtype`) an array frame."""

    type: str
    doc: str
    optional: bool = False
    lenient: bool = False  # a malformed value reads as absent instead of refusing the message
    shown: str | None = None  # the type as PROTOCOL.md shows it, when the check is looser
    dtype: str | None = None  # an array's
    shape: str = ""  # an array's, as PROTOCOL.md writes it: "[T]"

    def ok(self, value: Any) -> bool:
        return TYPES[self.type](value)


def header(
    type: str, doc: str, *, optional: bool = False, lenient: bool = False, shown: str | None = None
) -> Any:
    """A header field of a definition."""
    assert type in TYPES, type
    assert not lenient or optional, "only an optional field can be read as absent"
    spec = Spec(type, doc, optional, lenient, shown)
    return field(default=None, metadata={"wire": spec}) if optional else field(metadata={"wire": spec})


def array(dtype: str, shape: str, doc: str, *, optional: bool = False) -> Any:
    """An array frame of a definition: `shape` as PROTOCOL.md writes it ("[T]")."""
    spec = Spec("any", doc, optional, dtype=dtype, shape=shape)
    return field(default=None, metadata={"wire": spec}) if optional else field(metadata={"wire": spec})


T = TypeVar("T", bound="Definition")
_SPECS: dict[type, dict[str, Spec]] = {}  # each definition's specs, worked out once


class Definition:
    """What every message definition has: its kind, PROTOCOL.md's heading for it, and the
    way it is built, checked and read."""

    kind: ClassVar[str]
    title: ClassVar[str]  # e.g. "(actor -> learner): one group of G completions of one prompt"

    @classmethod
    def specs(cls) -> dict[str, Spec]:
        """Its fields' specs by name (every message is held to them: worked out once)."""
        if cls not in _SPECS:
            _SPECS[cls] = {f.name: f.metadata["wire"] for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        return _SPECS[cls]

    def frames(self) -> list:
        """The message, ready to send (absent optional fields left out)."""
        head: dict[str, Any] = {}
        arrays: dict[str, Any] = {}
        for name, spec in self.specs().items():
            value = getattr(self, name)
            if value is not None:
                (arrays if spec.dtype else head)[name] = value
        return encode(self.kind, head, arrays)

    @classmethod
    def read(cls: type[T], msg: Message) -> T:
        """The typed message of a decoded one (lenient fields that are malformed: None)."""
        values = {}
        for name, spec in cls.specs().items():
            value = msg.arrays.get(name) if spec.dtype else msg.header.get(name)
            values[name] = None if spec.lenient and value is not None and not spec.ok(value) else value
        return cls(**values)

    def check(self) -> None:
        """Checks across fields; raise ProtocolError naming the problem."""


MESSAGES: dict[str, type[Definition]] = {}


def message(kind: str, title: str) -> Callable[[type[T]], type[T]]:
    """Register a definition (a keyword-only dataclass) for `kind`."""

    def register(cls: type[T]) -> type[T]:
        cls.kind, cls.title = kind, title
        MESSAGES[kind] = cls
        return cls

    return register


@message(HELLO, "(peer -> learner, then learner -> peer)")
@dataclass(kw_only=True)
class Hello(Definition):
    role: str = header(
        "string",
        '`"actor"`, `"observer"`, `"learner"`, `"reward_worker"`, `"env_worker"` or `"orchestrator"`',
    )
    pid: int = header("int", "the sender's process id (for logs)")
    model: str | None = header(
        "string",
        "required from an actor or observer (the learner sends it too): the model path or hub id being run",
        optional=True,
        lenient=True,
    )
    tokenizer: str | None = header(
        "string",
        "required from an actor or observer (the learner sends it too): tokenizer fingerprint, the "
        "first 16 hex digits of SHA-256 over the JSON `[sorted (token, id) pairs, sorted EOS ids]`",
        optional=True,
        lenient=True,
    )
    lora: dict | None = header(
        "map",
        "required from an actor or observer (the learner sends it too): the `[lora]` config section "
        "(`rank`, `scale`, `dropout`, `num_layers`, `keys`)",
        optional=True,
        lenient=True,
    )
    instance: str | None = header(
        "string",
        "a socket owner's (the learner's; the actor's on the env socket): a new id each time its "
        "process starts; how a peer tells that it restarted",
        optional=True,
        lenient=True,
    )
    heartbeat_s: float | None = header(
        "number",
        "a worker socket owner's (the learner on the reward socket, the actor on the env socket): how "
        "often workers beat (1.0)",
        optional=True,
        lenient=True,
    )
    timeout_s: float | None = header(
        "number",
        "a worker socket owner's: the deadline for a reply to a request, in seconds "
        "(`reward.timeout_s`, `env.timeout_s`)",
        optional=True,
        lenient=True,
    )
    attached: bool | None = header(
        "bool",
        "a socket owner's (the learner's on both its sockets, the actor's on the env socket): `true` "
        "answers your `hello`; `false` means the owner does not know you (it was restarted, or it "
        "took you for gone) and you must drop all you hold and say `hello`",
        optional=True,
        lenient=True,
    )
    slot: int | None = header(
        "int",
        "an actor's: which of the run's `actor.count` actors it is, `0` to `count - 1` (default 0); it "
        "samples the stream prompts whose index `i` (epoch * rows + position) has `i mod count == "
        'slot`. Out of range: `stop`, `"incompatible: slot ..."`',
        optional=True,
        lenient=True,
    )
    data_cursor: list[int] | None = header(
        "[int, int] or nil",
        "the learner's, to an actor: where the actor's data continues (see below); nil: the data's "
        "start, `[0, 0]`",
        optional=True,
        lenient=True,
    )
    data_skip: list[list[int]] | None = header(
        "list of [int, int]",
        "the learner's, to an actor: cursors of prompts beyond `data_cursor` the learner already "
        "holds (see below); absent (an older learner): none",
        optional=True,
        lenient=True,
    )
    max_staleness: int | None = header(
        "int",
        "the learner's, to an actor: the run's `train.max_staleness` k, which the actor then keeps "
        "to, whatever its own config says: the versions a group's tokens may span, the groups it "
        "gives up as stale, and its window until the first `credit` (see `credit`); absent (an "
        "older learner): the actor's own",
        optional=True,
        lenient=True,
    )
    partials: int | None = header(
        "int",
        "the learner's, to an actor: send a `partial` of each group it samples every this many "
        "tokens, while the group is sampled; absent or `0`: send none",
        optional=True,
        lenient=True,
    )
    beats_while_working: bool | None = header(
        "bool",
        "a worker's (reward or env): `true` promises heartbeats even while it works on a request (see "
        '"Liveness"). `beats_while_scoring` is an older name for it, still accepted from a reward '
        "worker. A worker's hello needs only `role` and `pid` besides",
        optional=True,
        lenient=True,
    )

    def check(self) -> None:
        if self.role not in ROLES:
            raise ProtocolError(f"hello: unknown role {self.role!r}")


@message(ROLLOUT, "(actor -> learner): one group of G completions of one prompt")
@dataclass(kw_only=True)
class Rollout(Definition):
    group_id: str = header(
        "string",
        "unique per actor connection (never reused on it), for logs; the group's `partial`s carry it too",
    )
    policy_version: int = header(
        "int",
        "version of the weights that sampled every completion in the group; with `policy_versions`, "
        "the oldest of them",
    )
    prompt: Any = header(
        "any", 'the prompt as in the data file: a string, or a list of `{"role", "content"}` messages'
    )
    columns: dict = header("map", "the data row's other columns, passed to reward functions")
    texts: list[str] = header(
        "list", "decoded completions (special tokens skipped), one per completion", shown="list of string"
    )
    finish_reasons: list[str] = header(
        "list",
        '`"stop"` (an EOS token was sampled; it is the last ID) or `"length"` (hit `max_tokens`); an '
        'episode\'s: `"env_done"`, `"env_error"`, `"max_turns"` or `"length"` (see "Episodes" below)',
        shown="list of string",
    )
    gen_s: float | None = header("number", "seconds spent sampling this group", optional=True, lenient=True)
    cursor: list[int] | None = header(
        "[int, int]",
        "the actor's data cursor (epoch, position) just after this prompt; the learner keeps, per "
        "slot, how far it holds every prompt (see `hello`), and checkpoints the consumed ones",
        optional=True,
        lenient=True,
    )
    start_cursor: Any = header(
        "any",
        "the data cursor just before this prompt (after the slot's previous prompt, sampled or "
        "skipped); with it, groups may be sent in any order (see `hello`). One that is not a cursor "
        "before `cursor` drops the group",
        optional=True,
        shown="[int, int]",
    )
    row: int | None = header(
        "int",
        "the prompt's row in the data file (0-based), named in error messages",
        optional=True,
        lenient=True,
    )
    weights_transfer_s: float | None = header(
        "number",
        "for the newest weights the actor applied: seconds from the learner's `sent_at` to receipt",
        optional=True,
        lenient=True,
    )
    weights_apply_s: float | None = header(
        "number",
        "for the newest weights the actor applied: seconds to load them into the model",
        optional=True,
        lenient=True,
    )
    peak_memory_mb: float | None = header(
        "number", "the actor's peak memory so far", optional=True, lenient=True
    )
    turns: list[list[dict]] | None = header(
        "list of messages",
        'episodes: per completion, its turns after the prompt as `{"role", "content"}` messages '
        '(`"assistant"` for the model\'s)',
        optional=True,
    )
    env_rewards: list[float | None] | None = header(
        "list of number/nil",
        "episodes: per completion, the sum of the rewards its environment returned; nil if it "
        "returned none. Agent sessions (an actor with an `[agent]`) are sent as episodes: this is "
        "the reward the agent reported",
        optional=True,
    )
    turn_rewards: list[list[float]] | None = header(
        "list of list of number",
        "episodes: per completion, one reward per model turn (per run of `loss_mask` 1, or one for a "
        "completion without `loss_mask`), for GiGPO's step-level advantage "
        "(`algorithm.gigpo_omega`); absent means 0 for every turn but the last, which has the "
        "completion's scored reward. A count that differs from the model turns drops the group",
        optional=True,
    )
    env_retries: int | None = header(
        "int",
        "episodes: how many episodes the actor has started again so far (their worker was lost); "
        "agent sessions: how many sessions it started again (their agent failed)",
        optional=True,
        lenient=True,
    )
    sessions: list[int] | None = header(
        "list of int",
        "agent sessions: per completion, the session it belongs to (0 to G-1), when a session sent "
        "more than one (its agent rewrote its history: docs/agents.md). Then a group has more "
        "completions than `group_size`; every session must appear. The learner computes advantages "
        "over the G sessions (a session's reward is its last completion's) and gives each completion "
        "its session's",
        optional=True,
    )
    agent_splits: int | None = header(
        "int",
        "agent sessions: how many calls so far did not continue their session's last call "
        "(docs/agents.md); the learner reports it as `agent/splits`",
        optional=True,
        lenient=True,
    )
    in_flight: list[int] | None = header(
        "list of int",
        "the policy version of each group this actor is still sampling as it sends this one (its "
        "oldest sampled token's), for the learner to keep room in a batch for the groups that can "
        "join no later one (see `credit`); absent means unknown",
        optional=True,
        lenient=True,
    )
    error: str | None = header(
        "string",
        "the actor could not complete this group (an episode failed `env.max_attempts` times), or "
        'stopped sampling it as too stale to train on (`"stale"`: see `credit`): the learner counts '
        "it as dropped with this reason and reads nothing else but `cursor` and `start_cursor` (its "
        "place in the data: held, not sampled again)",
        optional=True,
    )
    prompt_ids: np.ndarray = array(
        "int32", "[P]", "the prompt's token IDs exactly as fed to the model, `P >= 1`"
    )
    completion_ids: np.ndarray = array("int32", "[T]", "all completions' sampled IDs, concatenated")
    completion_lens: np.ndarray = array("int32", "[G]", "length of each completion; sums to `T`")
    logprobs: np.ndarray = array(
        "float32",
        "[T]",
        "behavior logprob of each sampled ID (see below); finite and `<= 0`; `0` where `loss_mask` is 0",
    )
    loss_mask: np.ndarray | None = array(
        "uint8",
        "[T]",
        "optional (episodes): `1` for the IDs the model sampled, `0` for the environment's; "
        "absent means all `1`",
        optional=True,
    )
    policy_versions: np.ndarray | None = array(
        "int32",
        "[T]",
        "optional: the version of the weights whose logits each ID was sampled from (its `logprobs` "
        "entry is of those very logits), `>= 0`; for an actor whose weights can change while a group "
        "decodes. Entries where `loss_mask` is 0 are ignored. Absent means all `policy_version`",
        optional=True,
    )

    def check(self) -> None:
        lens, ids = self.completion_lens, self.completion_ids
        g = len(lens)
        if g == 0:
            raise ProtocolError("rollout: a group needs at least one completion")
        if len(self.texts) != g or len(self.finish_reasons) != g:
            raise ProtocolError(
                f"rollout: {g} completions but {len(self.texts)} texts and "
                f"{len(self.finish_reasons)} finish reasons"
            )
        if not all(isinstance(t, str) for t in self.texts):
            raise ProtocolError("rollout: every text must be a string")
        bad = [r for r in self.finish_reasons if not isinstance(r, str) or r not in FINISH_REASONS]
        if bad:
            raise ProtocolError(f"rollout: unknown finish reason {bad[0]!r}")
        if (lens < 0).any() or int(lens.sum()) != len(ids):
            raise ProtocolError("rollout: completion_lens must be >= 0 and sum to len(completion_ids)")
        if len(self.logprobs) != len(ids):
            raise ProtocolError("rollout: logprobs and completion_ids differ in length")
        if len(self.prompt_ids) == 0:
            raise ProtocolError("rollout: prompt_ids is empty")
        if not np.isfinite(self.logprobs).all() or (self.logprobs > 1e-4).any():
            raise ProtocolError("rollout: logprobs must be finite and <= 0")
        versions, mask = self.policy_versions, self.loss_mask
        if versions is not None and (versions.shape != ids.shape or (versions < 0).any()):
            raise ProtocolError("rollout: policy_versions must be int32 >= 0, one per completion id")
        if mask is not None and (mask.shape != ids.shape or (mask > 1).any()):
            raise ProtocolError("rollout: loss_mask must be uint8 0/1, one per completion id")
        for name in ("env_rewards", "turns", "turn_rewards", "sessions"):
            value = getattr(self, name)
            if value is not None and len(value) != g:
                raise ProtocolError(f"rollout: {name} must have {g} entries, one per completion")


@message(PARTIAL, "(actor -> learner): a group's completions so far, while it is sampled")
@dataclass(kw_only=True)
class Partial(Definition):
    group_id: str = header("string", "the `group_id` the group's `rollout` will carry")
    prompt_ids: np.ndarray = array("int32", "[P]", "the prompt's token IDs, as its `rollout` will carry them")
    completion_ids: np.ndarray = array("int32", "[T]", "each completion's IDs sampled so far, concatenated")
    completion_lens: np.ndarray = array(
        "int32", "[G]", "how many IDs each completion has so far; sums to `T`"
    )

    @classmethod
    def of(cls, group_id: str, prompt_ids: Sequence[int], completions: Sequence[Sequence[int]]) -> Partial:
        """The partial of a group: its prompt and each completion's tokens so far."""
        return cls(
            group_id=group_id,
            prompt_ids=np.asarray(prompt_ids, np.int32),
            completion_ids=np.array([t for c in completions for t in c], np.int32),
            completion_lens=np.array([len(c) for c in completions], np.int32),
        )

    def check(self) -> None:
        lens = self.completion_lens
        if len(lens) == 0 or len(self.prompt_ids) == 0:
            raise ProtocolError("partial: a group needs a prompt and at least one completion")
        if (lens < 0).any() or int(lens.sum()) != len(self.completion_ids):
            raise ProtocolError("partial: completion_lens must be >= 0 and sum to len(completion_ids)")


@message(WEIGHTS, "(learner -> actor)")
@dataclass(kw_only=True)
class Weights(Definition):
    version: int = header("int", "the policy version: the number of optimizer steps taken")
    sent_at: float | None = header(
        "number",
        "the learner's Unix time when it sent the message (for the transfer time)",
        optional=True,
        lenient=True,
    )


@message(CREDIT, "(learner -> actor)")
@dataclass(kw_only=True)
class Credit(Definition):
    groups_consumed: int = header(
        "int",
        "how many of this actor's groups the learner has consumed since its `hello`: trained on or dropped",
    )
    window: int | None = header(
        "int",
        "the groups this actor may keep in flight from now on; until the first `credit` that says, "
        "`ceil((k + 1) * B / actor.count)`",
        optional=True,
        lenient=True,
    )


@message(HEARTBEAT, "(any direction)")
@dataclass(kw_only=True)
class Heartbeat(Definition):
    role: str = header("string", "the sender's role")
    time: float = header("number", "sender's Unix time, seconds")


@message(STOP, "(any direction)")
@dataclass(kw_only=True)
class Stop(Definition):
    reason: str = header("string", "why, for the receiver's log")
    code: str | None = header(
        "string",
        'why, for the receiver\'s program: `"incompatible"` when a `hello` was refused (another '
        "model, tokenizer, LoRA config or slot; a restart would be refused again, so the actor exits "
        "4); absent otherwise",
        optional=True,
    )
    final: bool | None = header(
        "bool",
        "from a socket's owner: `true` (or absent) when the run is over: exit. `false` when only the "
        "owner goes away (it is being restarted, or its orchestrator died and `up --resume` will "
        "start it again): stay, drop what you hold, and attach again when the new owner greets you "
        "(`hello`, `attached: false`)",
        optional=True,
    )


@message(READY, "(worker -> learner)")
@dataclass(kw_only=True)
class Ready(Definition):
    pass


@message(SCORE, "(learner -> worker): one prompt's G completions")
@dataclass(kw_only=True)
class Score(Definition):
    request_id: str = header("string", "echo it, byte for byte, in the reply")
    prompts: list = header("list", "the prompt, repeated once per completion (string or message list)")
    completions: list = header(
        "list",
        'one per completion: a string for string prompts, `[{"role": "assistant", "content": str}]` '
        "for chat prompts",
    )
    completion_ids: list = header(
        "list", "the sampled token IDs of each completion", shown="list of lists of int"
    )
    columns: dict = header(
        "map",
        "every other column of the data row, each a list with one value per completion; the values "
        "are the row's JSON values as msgpack (string, number, bool, nil, list, map)",
    )


@message(SCORE_REPLY, "(worker -> learner)")
@dataclass(kw_only=True)
class ScoreReply(Definition):
    request_id: str = header("string", "the `request_id` of the `score` you answer")
    rewards: list = header(
        "list",
        'one per completion, in order; nil means "no opinion" and counts as 0 in the weighted sum; '
        "integers are fine",
        shown="list of number/nil",
    )
    rewards_by_function: dict | None = header(
        "map",
        "name -> list like `rewards`, reported in metrics as `rewards/worker:NAME/mean` and `/std`",
        optional=True,
    )
    error: str | None = header(
        "string",
        "your function failed on this request: say why. `rewards` is then ignored (send `[]`)",
        optional=True,
    )

    def check(self) -> None:
        if self.error is not None:
            return  # the function failed: the rewards are not used
        if not all(is_reward(v) for v in self.rewards):
            raise ProtocolError("score_reply: every reward must be a finite number or nil")
        n = len(self.rewards)
        if self.rewards_by_function is not None and not all(
            isinstance(k, str) and TYPES["list of number/nil"](v) and len(v) == n
            for k, v in self.rewards_by_function.items()
        ):
            raise ProtocolError(
                "score_reply: rewards_by_function must map names to lists of "
                "finite numbers or nil, one per completion"
            )


@message(RESET, "(actor -> worker): start an episode")
@dataclass(kw_only=True)
class Reset(Definition):
    request_id: str = header("string", "echo it in the reply")
    episode_id: str = header("string", "a new episode, unique for this actor `instance`")
    prompt: Any = header(
        "any", 'the data row\'s prompt: a string or a list of `{"role", "content"}` messages'
    )
    columns: dict = header(
        "map",
        "the data row's other columns, **one value each** (unlike `score`'s lists): the row's JSON "
        "values as msgpack",
    )


@message(STEP, "(actor -> worker): the model's turn")
@dataclass(kw_only=True)
class Step(Definition):
    request_id: str = header("string", "echo it in the reply")
    episode_id: str = header("string", "an episode you answered `reset` for")
    action: str = header("string", "the model's turn, decoded with special tokens skipped")
    action_ids: list = header("list", "the token IDs the model sampled for this turn", shown="list of int")


@message(OBSERVATION, "(worker -> actor): the reply to `reset` and `step`")
@dataclass(kw_only=True)
class Observation(Definition):
    request_id: str = header("string", "the `request_id` of the request you answer")
    observation: str = header(
        "string", 'the environment\'s turn; `""` for none (e.g. a `reset` whose prompt says it all)'
    )
    done: bool = header("bool", "the episode is over (`observation` is then not shown to the model)")
    reward: float | None = header(
        "number/nil",
        "added to the episode's environment reward (the sum of all you returned; nil or absent adds nothing)",
        optional=True,
    )
    role: str | None = header(
        "string",
        'for chat prompts, the role the observation speaks in: `"user"` (default) or e.g. `"tool"`',
        optional=True,
    )
    info: dict | None = header(
        "map", "anything; this implementation logs nothing of it and ignores it", optional=True
    )
    error: str | None = header(
        "string",
        'the environment failed on this episode: it ends (finish reason `"env_error"`), keeping the '
        'rewards returned so far. Still send `observation` (`""`) and `done` (`true`)',
        optional=True,
    )

    def check(self) -> None:
        if self.role is not None and not self.role:
            raise ProtocolError("observation: field 'role' must be a non-empty string")


@message(END, "(actor -> worker): forget an episode")
@dataclass(kw_only=True)
class End(Definition):
    episode_id: str = header("string", "the episode that ended")


# What a value of each type must be, in an error message.
_MUST = {
    "string": "a string",
    "int": "an integer",
    "number": "a number",
    "bool": "true or false",
    "map": "a map",
    "list": "a list",
    "list of string": "a list of strings",
    "list of int": "a list of integers >= 0",
    "list of number/nil": "a list of finite numbers or nil",
    "list of list of number": "a list of lists of finite numbers",
    "list of messages": "a list of lists of {'role': str, 'content': str} messages",
    "number/nil": "a finite number or nil",
    "[int, int]": "an [epoch, position] cursor",
    "[int, int] or nil": "an [epoch, position] cursor or nil",
    "list of [int, int]": "a list of [epoch, position] cursors",
}


def _problem(kind: str, name: str, spec: Spec, value: Any) -> str:
    """Why `value` is not a `spec` field: its type named for simple types, and an integer's sign."""
    if spec.type == "int" and type(value) is int:
        return f"{kind}: field {name!r} must be >= 0, got {value}"
    simple = spec.type in ("string", "int", "number", "bool", "map", "list")
    got = f", got {type(value).__name__}" if simple else ""
    return f"{kind}: field {name!r} must be {_MUST[spec.type]}{got}"


def check(msg: Message) -> None:
    """Hold a decoded message to its kind's definition; raise ProtocolError naming what is wrong."""
    cls = MESSAGES[msg.kind]
    for name, spec in cls.specs().items():
        if spec.dtype:
            a = msg.arrays.get(name)
            if a is None and not spec.optional:
                raise ProtocolError(f"{msg.kind}: missing array {name!r}")
            ndim = spec.shape.count(",") + 1
            if a is not None and (a.dtype.name != spec.dtype or a.ndim != ndim):
                raise ProtocolError(f"{msg.kind}: array {name!r} must be {spec.dtype} of rank {ndim}")
            continue
        if name not in msg.header or (spec.optional and msg.header[name] is None):
            if not spec.optional:
                raise ProtocolError(f"{msg.kind}: missing field {name!r}")
            continue
        if not spec.lenient and not spec.ok(msg.header[name]):
            raise ProtocolError(_problem(msg.kind, name, spec, msg.header[name]))
    cls.read(msg).check()


def decode(frames: list, max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """Parse a message (protocol.wire) and hold it to its definition: raise ProtocolError
    naming the problem. Arrays are read-only views of the frames, not copies."""
    msg = unpack(frames, MESSAGES, max_bytes)
    check(msg)
    return msg


def tables(kind: str) -> str:
    """PROTOCOL.md's tables for `kind`: its header fields, and its arrays if it has any."""
    specs = MESSAGES[kind].specs()
    fields = [
        f"| `{n}` | {s.shown or s.type}{', optional' if s.optional else ''}"
        f"{', lenient' if s.lenient else ''} | {s.doc} |"
        for n, s in specs.items()
        if not s.dtype
    ]
    arrays = [f"| `{n}` | {s.dtype} | `{s.shape}` | {s.doc} |" for n, s in specs.items() if s.dtype]
    rows = ["| field | type | meaning |", "|---|---|---|", *fields] if fields else ["No fields."]
    if arrays:
        rows += ["", "| array | dtype | shape | meaning |", "|---|---|---|---|", *arrays]
    return "\n".join(rows)


GENERATED = "generated by `python -m protocol --write PROTOCOL.md`"
BLOCK = re.compile(rf"(<!-- (\w+): {re.escape(GENERATED)} -->\n).*?(\n<!-- end -->)", re.S)


def fill(text: str) -> str:
    """`text` (PROTOCOL.md) with each kind's generated block made anew from its definition."""
    return BLOCK.sub(lambda m: m.group(1) + tables(m.group(2)) + m.group(3), text)


def reference() -> str:
    """Every kind's heading and tables, as PROTOCOL.md has them."""
    return "\n\n".join(f"### `{k}` {c.title}\n\n{tables(k)}" for k, c in MESSAGES.items())

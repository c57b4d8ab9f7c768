"""Protocol v1: message kinds, the msgpack codec, raw array frames and validation.

A message is a ZeroMQ multipart: frame 0 is a msgpack map (the header), frames 1..n carry
the raw bytes of the arrays the header lists under "arrays", in that order. PROTOCOL.md is
the specification; this module is its reference implementation. It imports no MLX and
nothing else of this project, so a peer in plain Python needs only this file (or nothing:
the format is documented).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import msgpack
import numpy as np

PROTOCOL_VERSION = 1

# Adapter weights of a 7B model at rank 64 are a few hundred MB; beyond this a message is
# far more likely to be garbage or an attack than a real peer.
MAX_MESSAGE_BYTES = 1 << 30
MAX_HEADER_BYTES = 16 << 20
MAX_NDIM = 8
MAX_DIM = 1 << 32

DTYPES = {"uint8", "int32", "int64", "float16", "float32"}
ROLES = {"actor", "observer", "learner", "reward_worker", "env_worker", "orchestrator"}
# An episode (a rollout with an environment) also ends by the environment or by max_turns.
FINISH_REASONS = {"stop", "length", "max_turns", "env_done", "env_error"}

HELLO = "hello"
ROLLOUT = "rollout"
WEIGHTS = "weights"
HEARTBEAT = "heartbeat"
CREDIT = "credit"
STOP = "stop"
# A stop's `code`: why, for the receiver's program (`reason` is for its log).
INCOMPATIBLE = "incompatible"  # the hello was refused: another model, tokenizer, LoRA or slot
READY = "ready"
SCORE = "score"
SCORE_REPLY = "score_reply"
RESET = "reset"
STEP = "step"
OBSERVATION = "observation"
END = "end"


class ProtocolError(ValueError):
    """A message that cannot be used. The text says what is wrong with it."""


@dataclass
class Message:
    kind: str
    header: dict[str, Any]
    arrays: dict[str, np.ndarray] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.header[key]


_ANY = object()
_NUMBER = (int, float)

# Required fields of each kind, beyond "protocol", "kind" and "arrays".
_SCHEMA: dict[str, dict[str, Any]] = {
    HELLO: {"role": str, "pid": int},
    ROLLOUT: {
        "group_id": str,
        "policy_version": int,
        "prompt": _ANY,
        "columns": dict,
        "finish_reasons": list,
        "texts": list,
    },
    WEIGHTS: {"version": int},
    CREDIT: {"groups_consumed": int},
    HEARTBEAT: {"role": str, "time": _NUMBER},
    STOP: {"reason": str},
    READY: {},
    SCORE: {"request_id": str, "prompts": list, "completions": list, "completion_ids": list, "columns": dict},
    SCORE_REPLY: {"request_id": str, "rewards": list},
    RESET: {"request_id": str, "episode_id": str, "prompt": _ANY, "columns": dict},
    STEP: {"request_id": str, "episode_id": str, "action": str, "action_ids": list},
    OBSERVATION: {"request_id": str, "observation": str, "done": bool},
    END: {"episode_id": str},
}

# On the rollout socket an actor (or observer) must also say what it runs, so the learner
# can refuse a mismatch; the learner checks them (the actor's hello on the env socket has none).
HELLO_MODEL_FIELDS = {"model": str, "tokenizer": str, "lora": dict}

# Arrays each kind must carry, with their dtype and rank.
_ARRAYS: dict[str, dict[str, tuple[str, int]]] = {
    ROLLOUT: {
        "prompt_ids": ("int32", 1),
        "completion_ids": ("int32", 1),
        "completion_lens": ("int32", 1),
        "logprobs": ("float32", 1),
    },
}


def encode(kind: str, header: dict[str, Any] | None = None, arrays: dict | None = None) -> list:
    """Build the frames of one message: the header's bytes, then each array's raw bytes as
    a uint8 view of the (C-contiguous, little-endian) array, so sending with copy=False
    copies nothing. Do not modify the arrays until the message is sent."""
    head = dict(header or {}, protocol=PROTOCOL_VERSION, kind=kind)
    specs, frames = [], []
    for name, value in (arrays or {}).items():
        a = np.asarray(value)
        if not a.flags.c_contiguous:  # (ascontiguousarray would turn 0-d into 1-d)
            a = a.copy(order="C")
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        specs.append({"name": name, "dtype": a.dtype.name, "shape": list(a.shape)})
        frames.append(a.reshape(-1).view(np.uint8))  # the array's own bytes, not a copy
    head["arrays"] = specs
    return [msgpack.packb(head, use_bin_type=True), *frames]


def decode(frames: list, max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """Parse and validate a multipart message; raise ProtocolError naming the problem.

    Frames are bytes-like (bytes, memoryview of a zmq.Frame); arrays are read-only views
    of them, not copies."""
    if not frames:
        raise ProtocolError("empty message")
    total = sum(len(f) for f in frames)
    if total > max_bytes:
        raise ProtocolError(f"message of {total} bytes exceeds the limit of {max_bytes}")
    if len(frames[0]) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(frames[0])} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        head = msgpack.unpackb(bytes(frames[0]), raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types
        raise ProtocolError(f"header is not valid msgpack: {e}") from None
    if not isinstance(head, dict):
        raise ProtocolError(f"header must be a map, got {type(head).__name__}")
    version = head.get("protocol")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r} is not {PROTOCOL_VERSION}")
    kind = head.get("kind")
    if not isinstance(kind, str) or kind not in _SCHEMA:
        raise ProtocolError(f"unknown message kind {kind!r}")
    _check_fields(kind, head)
    # A message without arrays may leave the field out (senders should write []).
    arrays = _decode_arrays(kind, head.get("arrays", []), frames[1:])
    msg = Message(kind, head, arrays)
    if kind == ROLLOUT:
        _check_rollout(msg)
    elif kind == HELLO:
        if head["role"] not in ROLES:
            raise ProtocolError(f"hello: unknown role {head['role']!r}")
    elif kind == SCORE_REPLY:
        _check_score_reply(head)
    elif kind == OBSERVATION:
        _check_observation(head)
    elif kind == STOP and head.get("final") is not None and not isinstance(head["final"], bool):
        raise ProtocolError("stop: field 'final' must be true or false")
    elif kind == STOP and head.get("code") is not None and not isinstance(head["code"], str):
        raise ProtocolError("stop: field 'code' must be a string")
    return msg


def is_data_cursor(value: Any) -> TypeGuard[list[int]]:
    """A data cursor, `[epoch, position]` (PROTOCOL.md, "Where the data continues")."""
    return isinstance(value, list) and len(value) == 2 and all(type(c) is int and c >= 0 for c in value)


def newer_weights(held: Message | None, msg: Message) -> Message:
    """Of the `weights` held (not applied yet) and one that arrived, the one to apply: the
    higher version, or the later of two equal ones. The version applied before does not
    count: a learner that restarted from a checkpoint sends an older one, and it is the
    run's policy now."""
    return msg if held is None or msg["version"] >= held["version"] else held


def _check_fields(kind: str, head: dict, schema: dict | None = None) -> None:
    for name, typ in (schema or _SCHEMA[kind]).items():
        if name not in head:
            raise ProtocolError(f"{kind}: missing field {name!r}")
        value = head[name]
        if typ is _ANY:
            continue
        # bool is an int in Python; a peer sending true for a version is still wrong.
        if isinstance(value, bool) and typ is not bool:
            raise ProtocolError(f"{kind}: field {name!r} must be {_type_name(typ)}, got bool")
        if not isinstance(value, typ):
            raise ProtocolError(
                f"{kind}: field {name!r} must be {_type_name(typ)}, got {type(value).__name__}"
            )
        if typ is int and value < 0:
            raise ProtocolError(f"{kind}: field {name!r} must be >= 0, got {value}")


def _type_name(typ: Any) -> str:
    if isinstance(typ, tuple):
        return "a number"
    return {str: "a string", int: "an integer", dict: "a map", list: "a list", bool: "true or false"}.get(
        typ, str(typ)
    )


def _decode_arrays(kind: str, specs: Any, frames: list[bytes]) -> dict[str, np.ndarray]:
    if not isinstance(specs, list):
        raise ProtocolError(f"{kind}: field 'arrays' must be a list")
    if len(specs) != len(frames):
        raise ProtocolError(f"{kind}: header lists {len(specs)} arrays but {len(frames)} frames follow")
    arrays: dict[str, np.ndarray] = {}
    for spec, frame in zip(specs, frames):
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise ProtocolError(f"{kind}: every array needs a string 'name'")
        name, dtype, shape = spec["name"], spec.get("dtype"), spec.get("shape")
        if name in arrays:
            raise ProtocolError(f"{kind}: array {name!r} appears twice")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise ProtocolError(f"{kind}: array {name!r} has unsupported dtype {dtype!r}")
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_NDIM
            or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_DIM for d in shape)
        ):
            raise ProtocolError(
                f"{kind}: array {name!r} needs a shape of at most {MAX_NDIM} integers in [0, {MAX_DIM}]"
            )
        expected = math.prod(shape) * np.dtype(dtype).itemsize
        if len(frame) != expected:
            raise ProtocolError(
                f"{kind}: array {name!r} {dtype}{shape} needs {expected} bytes, frame has {len(frame)}"
            )
        arrays[name] = np.frombuffer(frame, dtype=np.dtype(dtype).newbyteorder("<")).reshape(shape)
    for name, (dtype, ndim) in _ARRAYS.get(kind, {}).items():
        a = arrays.get(name)
        if a is None:
            raise ProtocolError(f"{kind}: missing array {name!r}")
        if a.dtype.name != dtype or a.ndim != ndim:
            raise ProtocolError(f"{kind}: array {name!r} must be {dtype} of rank {ndim}")
    return arrays


def _is_reward(v: Any) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))


def _check_score_reply(head: dict) -> None:
    error = head.get("error")
    if error is not None:
        if not isinstance(error, str):
            raise ProtocolError("score_reply: field 'error' must be a string")
        return  # the function failed: the rewards are not used
    if not all(_is_reward(v) for v in head["rewards"]):
        raise ProtocolError("score_reply: every reward must be a finite number or nil")
    by_fn = head.get("rewards_by_function")
    if by_fn is not None:
        if not isinstance(by_fn, dict) or not all(
            isinstance(k, str)
            and isinstance(v, list)
            and len(v) == len(head["rewards"])
            and all(_is_reward(x) for x in v)
            for k, v in by_fn.items()
        ):
            raise ProtocolError(
                "score_reply: rewards_by_function must map names to lists of "
                "finite numbers or nil, one per completion"
            )


def _check_observation(head: dict) -> None:
    for name, ok, what in (
        ("reward", _is_reward, "a finite number or nil"),
        ("role", lambda v: isinstance(v, str) and v, "a non-empty string"),
        ("info", lambda v: isinstance(v, dict), "a map"),
        ("error", lambda v: isinstance(v, str), "a string"),
    ):
        if head.get(name) is not None and not ok(head[name]):
            raise ProtocolError(f"observation: field {name!r} must be {what}")


def _check_rollout(msg: Message) -> None:
    a, h = msg.arrays, msg.header
    lens = a["completion_lens"]
    g = len(lens)
    if g == 0:
        raise ProtocolError("rollout: a group needs at least one completion")
    if len(h["texts"]) != g or len(h["finish_reasons"]) != g:
        raise ProtocolError(
            f"rollout: {g} completions but {len(h['texts'])} texts and "
            f"{len(h['finish_reasons'])} finish reasons"
        )
    if not all(isinstance(t, str) for t in h["texts"]):
        raise ProtocolError("rollout: every text must be a string")
    bad = [r for r in h["finish_reasons"] if not isinstance(r, str) or r not in FINISH_REASONS]
    if bad:
        raise ProtocolError(f"rollout: unknown finish reason {bad[0]!r}")
    if (lens < 0).any() or int(lens.sum()) != len(a["completion_ids"]):
        raise ProtocolError("rollout: completion_lens must be >= 0 and sum to len(completion_ids)")
    if len(a["logprobs"]) != len(a["completion_ids"]):
        raise ProtocolError("rollout: logprobs and completion_ids differ in length")
    if len(a["prompt_ids"]) == 0:
        raise ProtocolError("rollout: prompt_ids is empty")
    lp = a["logprobs"]
    if not np.isfinite(lp).all() or (lp > 1e-4).any():
        raise ProtocolError("rollout: logprobs must be finite and <= 0")
    versions = a.get("policy_versions")
    if versions is not None and (
        versions.dtype != np.int32 or versions.shape != a["completion_ids"].shape or (versions < 0).any()
    ):
        raise ProtocolError("rollout: policy_versions must be int32 >= 0, one per completion id")
    _check_episode_fields(msg, g)


def _check_episode_fields(msg: Message, g: int) -> None:
    """The optional fields of a rollout whose completions are episodes."""
    a, h = msg.arrays, msg.header
    mask = a.get("loss_mask")
    if mask is not None and (
        mask.dtype != np.uint8 or mask.shape != a["completion_ids"].shape or (mask > 1).any()
    ):
        raise ProtocolError("rollout: loss_mask must be uint8 0/1, one per completion id")
    rewards = h.get("env_rewards")
    if rewards is not None and not (
        isinstance(rewards, list) and len(rewards) == g and all(_is_reward(v) for v in rewards)
    ):
        raise ProtocolError(f"rollout: env_rewards must be {g} finite numbers or nil")
    turns = h.get("turns")
    if turns is not None and not (
        isinstance(turns, list)
        and len(turns) == g
        and all(
            isinstance(t, list)
            and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in t
            )
            for t in turns
        )
    ):
        raise ProtocolError(f"rollout: turns must be {g} lists of {{'role': str, 'content': str}} messages")
    turn_rewards = h.get("turn_rewards")
    if turn_rewards is not None and not (
        isinstance(turn_rewards, list)
        and len(turn_rewards) == g
        and all(isinstance(r, list) and all(v is not None and _is_reward(v) for v in r) for r in turn_rewards)
    ):
        raise ProtocolError(f"rollout: turn_rewards must be {g} lists of finite numbers")
    sessions = h.get("sessions")
    if sessions is not None and not (
        isinstance(sessions, list) and len(sessions) == g and all(type(v) is int and v >= 0 for v in sessions)
    ):
        raise ProtocolError(f"rollout: sessions must be {g} integers >= 0, one per completion")
    if h.get("error") is not None and not isinstance(h["error"], str):
        raise ProtocolError("rollout: field 'error' must be a string")

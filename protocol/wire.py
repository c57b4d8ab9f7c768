"""Protocol v1: message kinds, the msgpack codec and raw array frames.

A message is a multipart: frame 0 is a msgpack map (the header), frames 1..n carry the raw
bytes of the arrays the header lists under "arrays", in that order. PROTOCOL.md is the
specification; this module and protocol/messages.py (each kind's fields and checks) are its
reference implementation. Neither imports MLX or anything else of this project.
"""

from __future__ import annotations

import math
from collections.abc import Container
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
PARTIAL = "partial"
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


def unpack(frames: list, known: Container[str], max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """Parse a multipart message whose kind is one of `known`; raise ProtocolError naming
    the problem. Its fields are checked by protocol/messages.py (`decode`).

    Frames are bytes-like (bytes, memoryviews); arrays are read-only views of them, not
    copies."""
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
    if not isinstance(kind, str) or kind not in known:
        raise ProtocolError(f"unknown message kind {kind!r}")
    # A message without arrays may leave the field out (senders should write []).
    return Message(kind, head, _decode_arrays(kind, head.get("arrays", []), frames[1:]))


def is_data_cursor(value: Any) -> TypeGuard[list[int]]:
    """A data cursor, `[epoch, position]` (PROTOCOL.md, "Where the data continues")."""
    return isinstance(value, list) and len(value) == 2 and all(type(c) is int and c >= 0 for c in value)


def newer_weights(held: Message | None, msg: Message) -> Message:
    """Of the `weights` held (not applied yet) and one that arrived, the one to apply: the
    higher version, or the later of two equal ones. The version applied before does not
    count: a learner that restarted from a checkpoint sends an older one, and it is the
    run's policy now."""
    return msg if held is None or msg["version"] >= held["version"] else held


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
    return arrays

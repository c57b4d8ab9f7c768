"""The sockets every process opens, through the transport seam (transport/), and the one
way each reads them: `incoming` polls, receives and decodes, and hands a malformed message
to the caller as a ProtocolError instead of raising: a process never crashes on a peer's
bad message."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from protocol.messages import decode
from protocol.wire import MAX_HEADER_BYTES, Message, ProtocolError
from transport import Socket, Transport, Watch


def frame_limit(*array_bytes: int) -> int:
    """The largest frame a socket takes: a header (MAX_HEADER_BYTES, the protocol's limit)
    or the largest array frame its messages carry in this run."""
    return max(MAX_HEADER_BYTES, *array_bytes)


def listen(
    net: Transport, endpoint: str, keys: Path | None = None, name: str = "", max_frame: int = MAX_HEADER_BYTES
) -> Socket:
    """The owner's socket on `endpoint` (`keys`: the run's key directory, for TCP; `name`
    names it in logs; `max_frame`: see frame_limit)."""
    return net.listen(endpoint, keys, name, max_frame)


def connect(
    net: Transport, endpoint: str, keys: Path | None = None, max_frame: int = MAX_HEADER_BYTES
) -> tuple[Socket, Watch]:
    """A peer's socket connected to `endpoint`, and the watch that says whether its owner
    is there."""
    return net.connect(endpoint, keys, max_frame)


@dataclass
class Incoming:
    """One message as read: the decoded `msg`, or the `error` that made it unreadable."""

    peer: bytes  # the sender's identity on a listening socket; b"" on a peer's (its one owner)
    msg: Message | None
    error: ProtocolError | None
    frames: list  # the message frames, without the identity


def incoming(sock: Socket, timeout_ms: int = 0) -> Iterator[Incoming]:
    """Every message that arrives within `timeout_ms`, and then those already queued."""
    while sock.poll(timeout_ms):
        timeout_ms = 0
        frames: list = sock.recv()
        peer = bytes(frames.pop(0)) if sock.routed else b""
        try:
            msg, error = decode(frames), None
        except ProtocolError as e:
            msg, error = None, e
        yield Incoming(peer, msg, error, frames)

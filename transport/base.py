"""The transport seam's interfaces: how a message's frames move between two processes.

Everything above this package (the wire in `protocol`, the actor, the learner, the workers
and the orchestrator) talks to the three small interfaces below. ZeroMQ (transport/zeromq.py,
with its CURVE keys in transport/keys.py) is the one implementation a run uses;
transport/fake.py is an in-process one that tests run a whole run over. A new transport is
one more module with a `Transport` in it.

The shape is ZeroMQ's ROUTER/DEALER, because the protocol is written for it (PROTOCOL.md,
"Sockets"): a socket's owner *listens* and receives each message with its sender's
identity first; a peer *connects*, sends and receives plain messages, and holds a `Watch`
that says whether the owner is there. A message is a list of frames (bytes-like); each
message arrives whole or not at all, in order per peer.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

# A connecting socket's send waits at most this long: while its owner is away messages
# queue; a send blocks only when the connection was refused for good, which the Watch says.
SEND_TIMEOUT_MS = 10_000


class TransportError(Exception):
    """A send or receive failed: the socket is closed, or the connection is gone for good."""


class Again(TransportError):
    """A send could not go now (`wait=False`, or the send timed out): nothing was sent."""


class Socket(Protocol):
    @property
    def routed(self) -> bool:
        """True on a listening socket: each message received starts with its sender's
        identity frame, and each message sent starts with its recipient's."""

    def send(self, frames: Sequence[bytes | memoryview], wait: bool = True) -> None:
        """Send one message. Raises Again when it cannot go now (never with half of it sent)."""

    def recv(self) -> list[memoryview]:
        """One message's frames; call after `poll` said there is one."""

    def poll(self, timeout_ms: int, writable: bool = False) -> bool:
        """True when a message can be received (or, `writable`, sent) within `timeout_ms`."""

    def close(self, linger: int | None = None) -> None:
        """Close; queued messages still leave for `linger` ms (None: the socket's default)."""


class Watch(Protocol):
    """A connecting peer's view of the owner it connects to."""

    @property
    def refused(self) -> str | None:
        """Why the owner will never let us in (a refused key), or None."""

    @property
    def connections(self) -> int:
        """Connections made so far: a new one means the owner may be a new process."""

    def down_for(self) -> float:
        """Seconds without a connected owner (0 while connected)."""

    def close(self) -> None: ...


class Transport(Protocol):
    """Opens the sockets of one process, and closes them all at its end."""

    def listen(self, endpoint: str, keys: Path | None, name: str, max_frame: int) -> Socket:
        """The owner's side, bound to `endpoint`. `keys`: the run's key directory (CURVE
        over TCP); `name` names the socket in logs; `max_frame`: the largest frame taken."""

    def connect(self, endpoint: str, keys: Path | None, max_frame: int) -> tuple[Socket, Watch]:
        """A peer's side, connected to `endpoint` (with `keys`: a key directory)."""

    def close(self) -> None:
        """End the transport; its sockets must be closed first."""

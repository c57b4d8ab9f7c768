"""An in-process transport: sockets are queues in this process, endpoints are names.

It keeps the seam honest: a test runs a learner and an actor as threads of one process
over it, with no ZeroMQ underneath. It gives what the protocol relies on and no more:
messages whole and in order per peer, identities on the listening side, a peer's sends
queued until its owner listens, and a `Watch` that says whether the owner is there.
Frames are copied on send, as a process boundary would: nothing the receiver holds
aliases the sender's arrays. No keys (a fake has no strangers) and no frame limit.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

from transport.base import TransportError


class Fake:
    """One network shared by every process of a test: give each the same instance."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.owners: dict[str, FakeSocket] = {}  # endpoint -> its listening socket
        self.peers: dict[bytes, FakeSocket] = {}  # identity -> a connected socket
        self.ids = itertools.count()

    def listen(self, endpoint: str, keys: Path | None, name: str, max_frame: int) -> FakeSocket:
        with self.lock:
            if endpoint in self.owners:
                raise TransportError(f"{endpoint} is already bound")
            sock = self.owners[endpoint] = FakeSocket(self, endpoint, routed=True)
            for peer in self.peers.values():  # what peers sent before we listened
                if peer.endpoint == endpoint:
                    while peer.unsent:
                        sock.inbox.append([peer.identity, *peer.unsent.popleft()])
            self.lock.notify_all()
            return sock

    def connect(self, endpoint: str, keys: Path | None, max_frame: int) -> tuple[FakeSocket, FakeWatch]:
        with self.lock:
            sock = FakeSocket(self, endpoint, routed=False, identity=f"peer-{next(self.ids)}".encode())
            self.peers[sock.identity] = sock
            return sock, FakeWatch(self, endpoint)

    def close(self) -> None:
        """Nothing to end: each socket closes itself (the network is the test's)."""


class FakeSocket:
    def __init__(self, net: Fake, endpoint: str, routed: bool, identity: bytes = b"") -> None:
        self.net, self.endpoint, self.routed, self.identity = net, endpoint, routed, identity
        self.inbox: deque[list[bytes]] = deque()
        self.unsent: deque[list[bytes]] = deque()  # a peer's messages before its owner listens
        self.closed = False

    def send(self, frames: Sequence[bytes | memoryview], wait: bool = True) -> None:
        message = [bytes(f) for f in frames]
        with self.net.lock:
            if self.closed:
                raise TransportError("the socket is closed")
            if self.routed:
                peer = self.net.peers.get(message[0])
                if peer is not None and not peer.closed:  # ZeroMQ drops what has no route
                    peer.inbox.append(message[1:])
            else:
                owner = self.net.owners.get(self.endpoint)
                if owner is None or owner.closed:
                    self.unsent.append(message)
                else:
                    owner.inbox.append([self.identity, *message])
            self.net.lock.notify_all()

    def recv(self) -> list[memoryview]:
        with self.net.lock:
            if not self.inbox:
                raise TransportError("nothing to receive: poll first")
            return [memoryview(f) for f in self.inbox.popleft()]

    def poll(self, timeout_ms: int, writable: bool = False) -> bool:
        if writable:
            return not self.closed
        with self.net.lock:
            return self.net.lock.wait_for(lambda: bool(self.inbox), timeout_ms / 1000)

    def close(self, linger: int | None = None) -> None:
        with self.net.lock:
            self.closed = True
            if self.routed and self.net.owners.get(self.endpoint) is self:
                del self.net.owners[self.endpoint]
            self.net.peers.pop(self.identity, None)


class FakeWatch:
    def __init__(self, net: Fake, endpoint: str) -> None:
        self.net, self.endpoint = net, endpoint
        self.refused: str | None = None
        self.connections = 0
        self.since: float | None = time.monotonic()  # down since; None while the owner is there
        self.seen: FakeSocket | None = None

    def down_for(self) -> float:
        with self.net.lock:
            owner = self.net.owners.get(self.endpoint)
        if owner is not None and owner is not self.seen:  # a new owner: a new connection
            self.seen, self.since = owner, None
            self.connections += 1
        elif owner is None and self.since is None:
            self.seen, self.since = None, time.monotonic()
        return 0.0 if self.since is None else time.monotonic() - self.since

    def close(self) -> None:
        """Nothing to stop."""

"""The sockets every process opens, and the one way each reads them.

The learner binds ROUTER sockets (rollouts, rewards); actors and reward workers connect a
DEALER with a `ConnectionWatch`, which tells them when the learner is gone for good. Each
socket lingers on close, so a last `stop` still leaves. Reading is the same everywhere:
`incoming` polls, receives and decodes, and hands a malformed message to the caller as a
ProtocolError instead of raising: a process never crashes on a peer's bad message.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import zmq

from protocol.keys import secure_client, secure_server, stop_authenticator
from protocol.lifecycle import HEARTBEAT_S
from protocol.wire import Message, ProtocolError, decode

LINGER_MS = 2000  # how long a closing socket keeps trying to deliver its last messages


def listen(ctx: zmq.Context, endpoint: str, keys: Path | None = None, name: str = "") -> zmq.Socket:
    """The binding side: a ROUTER bound to `endpoint`; with `keys` (a run's key directory)
    a CURVE server that lets in only authorized clients (protocol.keys). `name` names the
    socket in the log of a refused client."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    if keys is not None:
        secure_server(sock, keys, name or endpoint)
    sock.bind(endpoint)
    return sock


def connect(ctx: zmq.Context, endpoint: str, keys: Path | None = None) -> tuple[zmq.Socket, ConnectionWatch]:
    """A peer's side: a DEALER connected to `endpoint`, and its watch; with `keys` (a key
    directory) a CURVE client."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    if keys is not None:
        secure_client(sock, keys)
    return sock, ConnectionWatch(sock, endpoint)


def close_context(ctx: zmq.Context) -> None:
    """End a context whose sockets are closed, the ZAP handler of its CURVE servers first."""
    stop_authenticator(ctx)
    ctx.term()


@dataclass
class Incoming:
    """One message as read: the decoded `msg`, or the `error` that made it unreadable."""

    peer: bytes | None  # the sender's identity on a ROUTER; None on a DEALER
    msg: Message | None
    error: ProtocolError | None
    frames: list  # the message frames, without the identity


def incoming(sock: zmq.Socket, timeout_ms: int = 0) -> Iterator[Incoming]:
    """Every message that arrives within `timeout_ms`, and then those already queued."""
    routed = sock.type == zmq.ROUTER
    while sock.poll(timeout_ms):
        timeout_ms = 0
        frames = [f.buffer for f in sock.recv_multipart(copy=False)]
        peer = bytes(frames.pop(0)) if routed else None
        try:
            msg, error = decode(frames), None
        except ProtocolError as e:
            msg, error = None, e
        yield Incoming(peer, msg, error, frames)


class ConnectionWatch:
    """Connects `sock` to `endpoint` and tells whether it has a live peer, from libzmq's
    monitor events. Over `ipc://` a peer's death closes the connection at once. Over
    `tcp://` ZMTP heartbeats find a dead or unreachable host; libzmq's I/O thread answers
    them even while the learner is busy in a long step, so the timeout is generous: a
    dropped connection comes back under a new identity, which the learner must re-greet."""

    def __init__(self, sock: zmq.Socket, endpoint: str) -> None:
        if endpoint.startswith("tcp://"):
            sock.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_S * 1000))
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 30_000)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)  # find a restarted learner within a second
        self.sock = sock
        self.monitor = sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        self.down_since: float | None = time.monotonic()  # not connected yet
        # Why a CURVE handshake fails: no retry with the same keys would succeed.
        self.refused: str | None = None
        self.failed_handshakes = 0  # in a row
        sock.connect(endpoint)

    def down_for(self) -> float:
        """Seconds without a connected peer (0 while connected)."""
        from zmq.utils.monitor import recv_monitor_message

        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.down_since, self.failed_handshakes = None, 0
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self.refused = ("it refused our CURVE key: the key directory's client key is not in the "
                                "run's keys/authorized (`orchestrator keys add-peer` makes one that is)")
            elif event in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
                # With another server's key the server cannot read our hello and drops the
                # connection, saying nothing; a single failure may be a restart in between.
                self.failed_handshakes += 1
                if self.failed_handshakes >= 3:
                    self.refused = ("the CURVE handshake failed 3 times: the key directory's server.key "
                                    "is not this run's (or the other end does not use CURVE: see "
                                    "run.insecure)")
            elif event == zmq.EVENT_DISCONNECTED and self.down_since is None:
                self.down_since = time.monotonic()
        return 0.0 if self.down_since is None else time.monotonic() - self.down_since

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)

"""The ZeroMQ transport: a ROUTER for a socket's owner, a DEALER with a `ConnectionWatch`
for each peer, CURVE over TCP (transport/keys.py). Each socket lingers on close, so a last
`stop` still leaves.

A bound TCP socket may be reached by strangers (docs/scale-out.md, "TCP and CURVE keys"). CURVE keeps
them from joining; these keep them from ending the run:
- every socket refuses a frame larger than the run's messages can hold (ZMQ_MAXMSGSIZE)
  before buffering it;
- a connection that has not finished its handshake in HANDSHAKE_S is closed;
- beyond MAX_CONNECTIONS, a bound TCP socket sheds connections that have said nothing
  (`ConnectionCap`);
- the process may open as many descriptors as its hard limit allows.
"""

from __future__ import annotations

import collections
import logging
import socket
import struct
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from pathlib import Path

import zmq
from zmq.utils.monitor import recv_monitor_message

from runtime.lifecycle import raise_fd_limit
from transport.base import SEND_TIMEOUT_MS, Again, TransportError
from transport.keys import secure_client, secure_server, stop_authenticator

log = logging.getLogger("sockets")

HEARTBEAT_S = 1.0  # ZMTP heartbeats over TCP, as often as peers beat (protocol.connection)

LINGER_MS = 2000  # how long a closing socket keeps trying to deliver its last messages
# A real peer's handshake (CURVE and the ZAP check included) takes milliseconds, and is
# done within GRACE_S even over a slow link to a busy process; a connection that has not
# finished it after HANDSHAKE_S is a stranger holding a descriptor, and libzmq closes it.
GRACE_S = 1.0
HANDSHAKE_S = 5.0
# A connecting peer whose handshakes keep failing for this long without a word from the
# other end holds the wrong server key (the server cannot read its hello and says nothing).
WRONG_KEY_S = 5.0
SECURE_RUN_HINT = (
    "connect with its keys (--key-dir, or the run directory's keys/), not --insecure or run.insecure = true"
)
# Connections one bound TCP socket holds at a time: a run's actors, observers and workers
# are a few dozen at most; beyond this the silent ones are shut down (`ConnectionCap`).
MAX_CONNECTIONS = 128


class ZmqSocket:
    """A ZeroMQ socket behind the seam's `Socket` (transport/__init__.py)."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self.routed = sock.type == zmq.ROUTER

    def send(self, frames: Sequence[bytes | memoryview], wait: bool = True) -> None:
        try:
            self.sock.send_multipart(frames, flags=0 if wait else zmq.NOBLOCK, copy=False)
        except zmq.Again as e:  # NOBLOCK with no room, or SNDTIMEO passed: nothing went
            raise Again(str(e)) from None
        except zmq.ZMQError as e:
            raise TransportError(str(e)) from None

    def recv(self) -> list[memoryview]:
        return [f.buffer for f in self.sock.recv_multipart(copy=False)]

    def poll(self, timeout_ms: int, writable: bool = False) -> bool:
        return bool(self.sock.poll(timeout_ms, zmq.POLLOUT if writable else zmq.POLLIN))

    def close(self, linger: int | None = None) -> None:
        self.sock.close(linger=linger)


class ZeroMQ:
    """The ZeroMQ transport of one process: one context for all its sockets."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()

    def listen(self, endpoint: str, keys: Path | None, name: str, max_frame: int) -> ZmqSocket:
        """A ROUTER bound to `endpoint`; with `keys` (a run's key directory) a CURVE server
        that lets in only authorized clients (transport.keys). Over TCP, strangers'
        connections are bounded (the module's docstring)."""
        raise_fd_limit()
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame)
        tcp = endpoint.startswith("tcp://")
        if keys is not None:
            secure_server(sock, keys, name or endpoint)
        if tcp:
            sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
            # ZMTP heartbeats close the connection of a peer whose host died (its descriptor too).
            sock.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_S * 1000))
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 30_000)
        sock.bind(endpoint)
        if tcp:
            _caps.setdefault(self.ctx, []).append(ConnectionCap(sock, name or endpoint))
        return ZmqSocket(sock)

    def connect(self, endpoint: str, keys: Path | None, max_frame: int) -> tuple[ZmqSocket, ConnectionWatch]:
        """A DEALER connected to `endpoint`, and its watch; with `keys` (a key directory) a
        CURVE client."""
        raise_fd_limit()
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame)
        sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        if keys is not None:
            secure_client(sock, keys)
        return ZmqSocket(sock), ConnectionWatch(sock, endpoint, curve=keys is not None)

    def close(self) -> None:
        """End the context, its sockets closed: the ZAP handler of its CURVE servers and
        the connection caps of its TCP servers first."""
        stop_authenticator(self.ctx)
        for cap in _caps.pop(self.ctx, []):
            cap.thread.join(timeout=LINGER_MS / 1000 + 1)
        self.ctx.term()


def monitor_socket(sock: zmq.Socket, events: int) -> zmq.Socket:
    """A PAIR socket that receives `sock`'s monitor `events`. Its queue is unbounded: libzmq
    drops an event that finds the queue full, and a flood's thousands of connections in a
    second must not lose the event that says one closed."""
    address = f"inproc://monitor-{uuid.uuid4().hex}"
    sock.monitor(address, events)
    pair = sock.context.socket(zmq.PAIR)
    pair.setsockopt(zmq.RCVHWM, 0)
    pair.connect(address)
    return pair


class ConnectionWatch:
    """Connects `sock` to `endpoint` and tells whether it has a live peer, from libzmq's
    monitor events. Over `ipc://` a peer's death closes the connection at once. Over
    `tcp://` ZMTP heartbeats find a dead or unreachable host; libzmq's I/O thread answers
    them even while the learner is busy in a long step, so the timeout is generous: a
    dropped connection comes back under a new identity, which the learner must re-greet.

    `refused` says why the other end will never let us in. libzmq 4.3 gives up on a
    connection for good after a refused key (HANDSHAKE_FAILED_AUTH) or a protocol error
    such as one side using CURVE and the other not (HANDSHAKE_FAILED_PROTOCOL): a send
    would then wait forever, so a peer checks `refused` before it sends."""

    def __init__(self, sock: zmq.Socket, endpoint: str, curve: bool = False) -> None:
        if endpoint.startswith("tcp://"):
            sock.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_S * 1000))
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 30_000)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)  # find a restarted learner within a second
        self.sock, self.curve = sock, curve
        self.monitor = monitor_socket(
            sock,
            zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_DISCONNECTED
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
        )
        self.down_since: float | None = time.monotonic()  # not connected yet
        self.refused: str | None = None  # why no retry could succeed
        self.failing_since: float | None = None  # the first of the handshakes failing in a row
        self.connections = 0  # handshakes that succeeded: a new one is a new connection
        sock.connect(endpoint)

    def down_for(self) -> float:
        """Seconds without a connected peer (0 while connected)."""
        while self.monitor.poll(0):
            message = recv_monitor_message(self.monitor)
            event, value = message["event"], message["value"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.down_since, self.failing_since = None, None
                self.connections += 1
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self.refused = (
                    "it refused our CURVE key: the key directory's client key is not in the "
                    "run's keys/authorized (`orchestrator keys add-peer` makes one that is)"
                )
            elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                self.refused = self.protocol_failure(value)
            elif event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                # With another server's key the server cannot read our hello and drops the
                # connection, saying nothing; libzmq retries every second. A few failures
                # may be a restart in between, or a flood the server is shedding.
                now = time.monotonic()
                self.failing_since = self.failing_since or now
                if now - self.failing_since >= WRONG_KEY_S:
                    self.refused = self.silent_failures()
            elif event == zmq.EVENT_DISCONNECTED and self.down_since is None:
                self.down_since = time.monotonic()
        return 0.0 if self.down_since is None else time.monotonic() - self.down_since

    def silent_failures(self) -> str:
        """Why every handshake failed without a word. A plain-TCP peer facing CURVE is
        usually told so (a protocol error), but when the other end closes before its greeting
        is read (under load) the mismatch arrives as a silent failure like a wrong key's."""
        if self.curve:
            return (
                f"every CURVE handshake failed for {WRONG_KEY_S:.0f} s: the key directory's "
                "server.key is not this run's (or the other end does not use CURVE: see "
                "run.insecure)"
            )
        return (
            f"every handshake failed for {WRONG_KEY_S:.0f} s in plain TCP: the other end most "
            f"likely uses CURVE (or is no ZeroMQ peer); if the run is secure, {SECURE_RUN_HINT}"
        )

    def protocol_failure(self, code: int) -> str:
        if code == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            if self.curve:
                return (
                    "the other end is plain TCP and we use CURVE: the run is insecure (run.insecure = "
                    "true); connect with --insecure, or make the run secure"
                )
            return (
                f"the other end uses CURVE and we connected in plain TCP: the run is secure, "
                f"so {SECURE_RUN_HINT}"
            )
        return f"the handshake failed with ZMTP protocol error {code:#x}; libzmq will not retry"

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)


class ConnectionCap:
    """Holds a bound TCP socket to MAX_CONNECTIONS connections, from a thread that reads its
    monitor: over the cap, it shuts down the connections that have said nothing since they
    were accepted GRACE_S ago or more, oldest first (libzmq sees the connection end and
    closes it itself). libzmq has no such option; without it a flood of idle connections
    takes every descriptor the process has, and its next file write fails.

    A real peer speaks at once (its greeting), so it is never cut, even when it connects in
    the middle of a flood; where the system does not say what a connection received (only
    Linux and macOS do), the cap cuts by age alone. Only connections younger than libzmq's
    handshake timeout are looked at: an older one has finished its handshake. `shutdown`
    never closes the descriptor, and a descriptor is touched only while the monitor still
    reports it open and it is a TCP socket on this socket's port."""

    def __init__(self, sock: zmq.Socket, name: str, limit: int = MAX_CONNECTIONS) -> None:
        self.name, self.limit = name, limit
        self.port = int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self.monitor = monitor_socket(
            sock, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_MONITOR_STOPPED
        )
        self.opened: dict[int, float] = {}  # descriptor -> when accepted
        self.refused: collections.deque[float] = collections.deque()  # when, over the last minute
        self.last_said = -60.0
        self.thread = threading.Thread(target=self.run, name=f"cap-{name}", daemon=True)
        self.thread.start()

    def run(self) -> None:
        try:
            while self.read_events():
                self.enforce()
        except zmq.ZMQError:  # the context ended under us (ctx.destroy): nothing left to guard
            pass
        finally:
            self.monitor.close(linger=0)

    def read_events(self) -> bool:
        """Take in every queued event; False once the socket is closed."""
        if not self.monitor.poll(1000):
            return True
        while self.monitor.poll(0):
            message = recv_monitor_message(self.monitor)
            event, fd = message["event"], int(message["value"])
            if event == zmq.EVENT_MONITOR_STOPPED:
                return False
            if event == zmq.EVENT_ACCEPTED:
                self.opened[fd] = time.monotonic()
            else:
                self.opened.pop(fd, None)
        return True

    def enforce(self) -> None:
        over = len(self.opened) - self.limit
        if over <= 0:
            return
        now = time.monotonic()
        # Only connections younger than the handshake timeout: an older one has finished it.
        waiting = sorted((t, fd) for fd, t in self.opened.items() if GRACE_S <= now - t < HANDSHAKE_S + 1)
        for _, fd in waiting:
            if over == 0:
                break
            if shut_down_if_silent(fd, self.port):
                del self.opened[fd]
                self.refused.append(now)
                over -= 1
        while self.refused and now - self.refused[0] > 60:
            self.refused.popleft()
        if self.refused and now - self.last_said >= 60:
            self.last_said = now
            log.warning(
                "the %s socket is over its cap of %d connections: closed %d silent ones in the last "
                "minute (a flood? docs/scale-out.md, 'TCP and CURVE keys', says how to firewall "
                "the port)",
                self.name,
                self.limit,
                len(self.refused),
            )


def shut_down_if_silent(fd: int, port: int) -> bool:
    """Shut down the TCP connection on descriptor `fd` if it is one to local `port` and its
    peer has sent nothing (as far as the system tells)."""
    try:
        conn = socket.socket(fileno=fd)
    except OSError:  # closed meanwhile, or not a socket
        return False
    try:
        if (
            conn.family in (socket.AF_INET, socket.AF_INET6)
            and conn.getsockname()[1] == port
            and not bytes_received(conn)
        ):
            conn.shutdown(socket.SHUT_RDWR)
            return True
    except OSError:
        pass
    finally:
        conn.detach()  # the descriptor stays libzmq's
    return False


def bytes_received(conn: socket.socket) -> int | None:
    """The payload bytes the kernel has received on a TCP connection: Linux's TCP_INFO
    (tcpi_bytes_received, since 4.1) and macOS's TCP_CONNECTION_INFO (tcpi_rxbytes); None
    where the system does not say."""
    if sys.platform.startswith("linux"):
        option, size, offset = socket.TCP_INFO, 136, 128
    elif sys.platform == "darwin":
        option, size, offset = getattr(socket, "TCP_CONNECTION_INFO", 0x106), 112, 88
    else:
        return None
    try:
        info = conn.getsockopt(socket.IPPROTO_TCP, option, size)
    except OSError:
        return None
    return struct.unpack_from("=Q", info, offset)[0] if len(info) >= offset + 8 else None


_caps: weakref.WeakKeyDictionary[zmq.Context, list[ConnectionCap]] = weakref.WeakKeyDictionary()

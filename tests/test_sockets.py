"""protocol/sockets.py over transport/zeromq.py: the one read path (poll, receive, decode,
errors handed back) and the connection watch, on real ZeroMQ sockets in this process."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

import protocol
from orchestrator.launch import free_ports
from protocol import sockets
from transport import zeromq
from transport.zeromq import ZeroMQ


@pytest.fixture
def net():
    transport = ZeroMQ()
    yield transport
    transport.ctx.destroy(linger=0)


def test_incoming_yields_messages_and_errors_with_the_sender(net, tmp_path):
    endpoint = f"ipc://{tmp_path}/s.sock"
    router = sockets.listen(net, endpoint)
    dealer, watch = sockets.connect(net, endpoint)
    dealer.send(protocol.encode(protocol.HEARTBEAT, {"role": "actor", "time": 1.0}))
    dealer.send([b"\x00not msgpack"])
    dealer.send(protocol.encode(protocol.WEIGHTS, {"version": 3}, {"w": np.arange(4, dtype=np.float32)}))
    got = []
    deadline = time.monotonic() + 10
    while len(got) < 3 and time.monotonic() < deadline:
        got += list(sockets.incoming(router, 100))
    assert len(got) == 3
    assert len({m.peer for m in got}) == 1 and isinstance(got[0].peer, bytes)
    first, bad, weights = got
    assert first.msg.kind == protocol.HEARTBEAT and first.error is None
    assert bad.msg is None and isinstance(bad.error, protocol.ProtocolError)
    assert bytes(bad.frames[0]) == b"\x00not msgpack"  # the frames, without the identity
    assert weights.msg["version"] == 3
    np.testing.assert_array_equal(weights.msg.arrays["w"], np.arange(4, dtype=np.float32))
    # An answer routed back by that identity reaches the dealer, which reads it the same way.
    router.send([first.peer, *protocol.encode(protocol.STOP, {"reason": "done"})])
    (answer,) = list(sockets.incoming(dealer, 5000))
    assert answer.peer == b"" and answer.msg["reason"] == "done"
    assert watch.down_for() == 0.0  # connected
    watch.close()


def test_incoming_waits_at_most_the_timeout(net, tmp_path):
    router = sockets.listen(net, f"ipc://{tmp_path}/s.sock")
    t0 = time.monotonic()
    assert list(sockets.incoming(router, 200)) == []
    assert 0.15 < time.monotonic() - t0 < 5


def test_watch_counts_time_without_a_learner(net, tmp_path):
    endpoint = f"ipc://{tmp_path}/s.sock"
    dealer, watch = sockets.connect(net, endpoint)
    time.sleep(0.3)
    assert watch.down_for() >= 0.25  # nobody bound yet
    router = sockets.listen(net, endpoint)
    deadline = time.monotonic() + 10
    while watch.down_for() > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert watch.down_for() == 0.0
    router.close(linger=0)
    deadline = time.monotonic() + 10
    while watch.down_for() == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert watch.down_for() > 0  # the learner went away
    watch.close()


def raw_connections(port: int, n: int) -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(n)]


def closed_by_peer(conn: socket.socket) -> bool:
    """Whether the other end has closed or shut down the connection (EOF or reset), past
    what it sent before (libzmq's greeting)."""
    try:
        while conn.recv(1 << 16, socket.MSG_DONTWAIT):
            pass
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True


@pytest.mark.slow
def test_a_bound_tcp_socket_sheds_silent_connections_beyond_its_cap(net):
    """400 idle connections to a socket whose cap is 128: those beyond the cap that have
    said nothing for GRACE_S are shut down, long before libzmq's handshake timeout. A real
    peer that connects in the middle of them speaks at once, so its connection is never
    cut: it delivers on the one connection it made."""
    port = free_ports(1)[0]
    router = sockets.listen(net, f"tcp://127.0.0.1:{port}", name="test")
    idle = raw_connections(port, 250)
    dealer, watch = sockets.connect(net, f"tcp://127.0.0.1:{port}")
    idle += raw_connections(port, 150)
    try:
        t0 = time.monotonic()
        while sum(closed_by_peer(c) for c in idle) < len(idle) - zeromq.MAX_CONNECTIONS:
            assert time.monotonic() - t0 < zeromq.HANDSHAKE_S, sum(closed_by_peer(c) for c in idle)
            time.sleep(0.1)
        dealer.send(protocol.encode(protocol.HEARTBEAT, {"role": "actor", "time": 1.0}))
        (got,) = list(sockets.incoming(router, 5000))
        assert got.msg.kind == protocol.HEARTBEAT
        assert watch.down_for() == 0.0 and watch.connections == 1  # never cut, never reconnected
    finally:
        for c in idle:
            c.close()
        watch.close()
        dealer.close(linger=0)
        router.close(linger=0)


def test_a_frame_over_the_limit_is_refused_before_it_is_buffered(net):
    """A plain-TCP socket (no CURVE, where nothing else stops a stranger's frame): a frame
    that announces 64 MB ends the connection when its size arrives, long before 64 MB are
    sent; a frame within the limit is delivered."""
    port = free_ports(1)[0]
    router = sockets.listen(net, f"tcp://127.0.0.1:{port}", max_frame=sockets.frame_limit(1 << 20))
    stranger = socket.create_connection(("127.0.0.1", port), timeout=5)
    sent = 0
    try:
        # ZMTP 2.0: signature, revision 1, a DEALER; then a long frame's flags and size.
        stranger.sendall(b"\xff" + b"\0" * 8 + b"\x7f" + b"\x01\x05")
        stranger.sendall(b"\x02" + (64 << 20).to_bytes(8, "big"))
        chunk = b"\x01" * (1 << 20)
        for _ in range(64):
            stranger.sendall(chunk)
            sent += len(chunk)
    except OSError:
        pass
    assert sent < 16 << 20, sent
    dealer, watch = sockets.connect(net, f"tcp://127.0.0.1:{port}", max_frame=sockets.frame_limit(1 << 20))
    try:
        dealer.send(
            protocol.encode(protocol.WEIGHTS, {"version": 1}, {"w": np.zeros(1 << 18, dtype=np.float32)})
        )  # 1 MB
        (got,) = list(sockets.incoming(router, 5000))
        assert got.msg.arrays["w"].nbytes == 1 << 20
    finally:
        stranger.close()
        watch.close()
        dealer.close(linger=0)
        router.close(linger=0)

"""protocol/sockets.py: the one read path (poll, receive, decode, errors handed back) and
the connection watch, on real ZeroMQ sockets in this process."""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

import protocol
from protocol import sockets


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def test_incoming_yields_messages_and_errors_with_the_sender(ctx, tmp_path):
    endpoint = f"ipc://{tmp_path}/s.sock"
    router = sockets.listen(ctx, endpoint)
    dealer, watch = sockets.connect(ctx, endpoint)
    dealer.send_multipart(protocol.encode(protocol.HEARTBEAT, {"role": "actor", "time": 1.0}))
    dealer.send_multipart([b"\x00not msgpack"])
    dealer.send_multipart(protocol.encode(protocol.WEIGHTS, {"version": 3},
                                          {"w": np.arange(4, dtype=np.float32)}))
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
    router.send_multipart([first.peer, *protocol.encode(protocol.STOP, {"reason": "done"})])
    (answer,) = list(sockets.incoming(dealer, 5000))
    assert answer.peer is None and answer.msg["reason"] == "done"
    assert watch.down_for() == 0.0  # connected
    watch.close()


def test_incoming_waits_at_most_the_timeout(ctx, tmp_path):
    router = sockets.listen(ctx, f"ipc://{tmp_path}/s.sock")
    t0 = time.monotonic()
    assert list(sockets.incoming(router, 200)) == []
    assert 0.15 < time.monotonic() - t0 < 5


def test_watch_counts_time_without_a_learner(ctx, tmp_path):
    endpoint = f"ipc://{tmp_path}/s.sock"
    dealer, watch = sockets.connect(ctx, endpoint)
    time.sleep(0.3)
    assert watch.down_for() >= 0.25  # nobody bound yet
    router = sockets.listen(ctx, endpoint)
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

"""The reward socket's rules (PROTOCOL.md, "Liveness" and "What the learner does with
your messages"), driven message by message: the real pool on a real ROUTER, the
test as the workers on real DEALERs."""

from __future__ import annotations

import time

import pytest
import zmq

import protocol
from protocol.connection import WORKER_TIMEOUT_S
from protocol.worker_socket import WorkerPool
from transport.zeromq import ZeroMQ


@pytest.fixture
def socket_pair(tmp_path):
    net = ZeroMQ()
    ctx = net.ctx  # workers' sides are plain ZeroMQ sockets
    pool = WorkerPool(
        net,
        f"ipc://{tmp_path}/reward.sock",
        "reward_worker",
        protocol.SCORE_REPLY,
        timeout_s=60,
        max_attempts=5,
    )
    workers = []

    def worker() -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.connect(pool.endpoint)
        workers.append(sock)
        return sock

    yield pool, worker
    for w in workers:
        w.close(linger=0)
    pool.sock.close(linger=0)
    net.close()


def send(sock: zmq.Socket, kind: str, **header) -> None:
    sock.send_multipart(protocol.encode(kind, header))


def receive(sock: zmq.Socket, pool: WorkerPool, kind: str, timeout: float = 5.0) -> protocol.Message:
    """Pump the pool until `sock` receives a message of `kind` (others are skipped)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pool.poll(10)
        while sock.poll(0):
            msg = protocol.decode(sock.recv_multipart())
            if msg.kind == kind:
                return msg
    raise AssertionError(f"no {kind} within {timeout} s")


def attach(sock: zmq.Socket, pool: WorkerPool) -> protocol.Message:
    send(sock, protocol.HELLO, role="reward_worker", pid=1)
    send(sock, protocol.READY)
    return receive(sock, pool, protocol.HELLO)


def request(pool: WorkerPool, rid: str) -> None:
    pool.submit(
        rid, {"prompts": ["p"], "completions": ["c"], "completion_ids": [[1]], "columns": {}}, protocol.SCORE
    )


def test_the_answer_to_a_hello_says_attached_and_a_stranger_is_told_it_is_not(socket_pair):
    pool, worker = socket_pair
    a = worker()
    hello = attach(a, pool)
    assert hello["attached"] is True and hello["instance"] == pool.instance
    assert hello["heartbeat_s"] == 1.0 and "model" not in hello.header
    stranger = worker()  # e.g. a worker of the learner before a restart
    send(stranger, protocol.HEARTBEAT, role="reward_worker", time=1.0)
    send(stranger, protocol.READY)
    assert receive(stranger, pool, protocol.HELLO)["attached"] is False
    pool.poll(50)
    assert not stranger.poll(100), "the greeting is sent once"
    request(pool, "r1")
    assert receive(a, pool, protocol.SCORE)["request_id"] == "r1"  # never to the stranger


def test_a_worker_that_says_stop_hands_on_its_request_at_once(socket_pair):
    pool, worker = socket_pair
    a, b = worker(), worker()
    attach(a, pool)
    request(pool, "r1")
    assert receive(a, pool, protocol.SCORE)["request_id"] == "r1"
    attach(b, pool)
    send(a, protocol.STOP, reason="leaving")
    t0 = time.monotonic()
    assert receive(b, pool, protocol.SCORE)["request_id"] == "r1"
    assert time.monotonic() - t0 < 1
    send(b, protocol.SCORE_REPLY, request_id="r1", rewards=[0.5])
    done, failed = [], []
    while not done:
        replies, failures = pool.poll(10)
        done += replies
        failed += failures
    assert [r.request_id for r in done] == ["r1"] and not failed


@pytest.mark.slow
def test_a_worker_taken_for_gone_is_greeted_as_a_stranger_and_attaches_again(socket_pair):
    """A worker that fell silent is forgotten; when it speaks again it is told it is not
    attached (`hello`, `attached: false`), and once it says hello and ready it works."""
    pool, worker = socket_pair
    a = worker()
    attach(a, pool)
    deadline = time.monotonic() + WORKER_TIMEOUT_S + 3
    while pool.n_workers and time.monotonic() < deadline:  # silent: no heartbeats
        pool.poll(50)
    assert pool.n_workers == 0 and pool.stats["lost_workers"] == 1
    send(a, protocol.HEARTBEAT, role="reward_worker", time=1.0)  # it was only slow to beat
    assert receive(a, pool, protocol.HELLO)["attached"] is False
    request(pool, "r1")
    assert attach(a, pool)["attached"] is True
    assert receive(a, pool, protocol.SCORE)["request_id"] == "r1"


def test_a_pinned_request_waits_for_its_worker_and_fails_when_that_worker_leaves(socket_pair):
    """The env socket's rule: a step goes only to the worker that holds the episode, in the
    attachment that took the episode: once that worker left (or said hello again), its
    pinned requests fail, and so does one pinned to the attachment it left."""
    pool, worker = socket_pair
    a, b = worker(), worker()
    attach(a, pool)
    request(pool, "r1")
    assert receive(a, pool, protocol.SCORE)["request_id"] == "r1"  # a is busy now
    attach(b, pool)
    send(a, protocol.SCORE_REPLY, request_id="r1", rewards=[0.0])
    identity, attached = next(iter(pool.workers.items()))  # a attached first
    holder = (identity, attached.session)
    header = {"prompts": ["p"], "completions": ["c"], "completion_ids": [[1]], "columns": {}}
    pool.submit("r2", header, protocol.SCORE, pinned=holder)
    assert receive(a, pool, protocol.SCORE)["request_id"] == "r2"
    pool.submit("r3", header, protocol.SCORE, pinned=holder)
    for _ in range(20):  # b is ready, a is busy: r3 waits for a
        pool.poll(10)
    while b.poll(0):
        assert protocol.decode(b.recv_multipart()).kind != protocol.SCORE
    send(a, protocol.STOP, reason="leaving")
    failed = []
    while len(failed) < 2:
        failed += pool.poll(10)[1]
    assert sorted(rid for rid, _ in failed) == ["r2", "r3"]  # pinned: never handed on
    assert all("the worker left" in why for _, why in failed)
    attach(a, pool)  # back, afresh: what was pinned to its old attachment is not for it
    pool.submit("r4", header, protocol.SCORE, pinned=holder)
    assert pool.poll(10)[1] == [("r4", "reward worker: the worker holding it is gone")]


def test_a_request_over_the_protocol_s_limit_fails_instead_of_being_sent(socket_pair):
    """A worker's socket refuses a frame over the protocol's header limit unread, so the
    request would never be answered: it fails at once, naming the size, and the next one
    goes out as usual."""
    from protocol.wire import MAX_HEADER_BYTES

    pool, worker = socket_pair
    w = worker()
    attach(w, pool)
    huge = {
        "prompts": ["x"],
        "completions": ["y"],
        "completion_ids": [[1]],
        "columns": {"blob": ["z" * (MAX_HEADER_BYTES + 1)]},
    }
    pool.submit("huge", huge)
    _, failed = pool.poll(10)
    size = len(protocol.encode(protocol.SCORE, {"request_id": "huge", **huge})[0])
    assert size > MAX_HEADER_BYTES
    assert failed == [
        (
            "huge",
            f"reward worker: the request's {size} bytes exceed the protocol's limit of {MAX_HEADER_BYTES}",
        )
    ]
    request(pool, "r1")
    assert receive(w, pool, protocol.SCORE)["request_id"] == "r1"


def test_a_worker_that_dropped_a_request_is_ready_again_after_the_deadline(socket_pair, caplog, monkeypatch):
    """PROTOCOL.md tells a worker to drop a request it cannot read. Its deadline passes and
    the worker is taken for gone; its next heartbeat is answered with `attached: false`,
    it attaches again, and the request comes back to it (the only worker) instead of
    waiting forever. The hello says the deadline; a request that waits for a worker is
    said in the log."""
    import protocol.worker_socket as workers_module

    pool, worker = socket_pair
    pool.timeout_s = 0.5
    a = worker()
    assert attach(a, pool)["timeout_s"] == 0.5
    request(pool, "r1")
    assert receive(a, pool, protocol.SCORE)["request_id"] == "r1"  # and dropped, unread
    deadline = time.monotonic() + 5
    while pool.stats["lost_workers"] == 0 and time.monotonic() < deadline:
        send(a, protocol.HEARTBEAT, role="reward_worker", time=1.0)
        pool.poll(50)
    monkeypatch.setattr(workers_module, "STARVED_SAY_S", 0.0)
    with caplog.at_level("WARNING", logger="workers"):
        pool.poll(50)
    assert "no reward worker has been ready for" in caplog.text
    assert "1 request(s) wait, 0 worker(s) attached" in caplog.text
    send(a, protocol.HEARTBEAT, role="reward_worker", time=1.0)  # still there: told to attach again
    assert receive(a, pool, protocol.HELLO)["attached"] is False
    attach(a, pool)
    again = receive(a, pool, protocol.SCORE)
    assert again["request_id"] == "r1" and pool.stats["retries"] == 1

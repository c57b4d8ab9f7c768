"""The reward socket: scoring requests handed to external reward workers.

The owner (learner, or `actor sample`) binds a ROUTER socket; workers connect a DEALER,
say hello, then `ready`. Each worker holds at most one request at a time; a reply makes it
ready again. A request whose worker misses the deadline, or answers with a malformed or
mismatched reply, goes to another worker; a late reply to a request already handed on is
ignored, so nothing is scored twice. After `max_attempts` a request fails with a reason.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from dataclasses import dataclass

import zmq

import protocol

log = logging.getLogger("rewards")


@dataclass
class Request:
    request_id: str
    header: dict
    n: int
    attempts: int = 0
    worker: bytes | None = None
    deadline: float = 0.0


@dataclass
class Reply:
    request_id: str
    rewards: list[float | None]
    by_function: dict[str, list[float | None]]


class RewardDispatcher:
    def __init__(self, ctx: zmq.Context, endpoint: str, timeout_s: float, max_attempts: int) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.endpoint = endpoint
        self.timeout_s, self.max_attempts = timeout_s, max_attempts
        self.workers: dict[bytes, dict] = {}
        self.known: set[bytes] = set()  # every worker that ever said hello
        self.ready: collections.deque[bytes] = collections.deque()
        self.waiting: collections.deque[Request] = collections.deque()
        self.assigned: dict[str, Request] = {}
        self.busy: dict[bytes, str] = {}  # worker -> request id
        self.stats = collections.Counter()

    @property
    def n_workers(self) -> int:
        return len(self.workers)

    @property
    def pending(self) -> int:
        return len(self.waiting) + len(self.assigned)

    def submit(self, request_id: str, header: dict, n: int) -> None:
        self.waiting.append(Request(request_id, header, n))

    def poll(self, timeout_ms: int = 0) -> tuple[list[Reply], list[tuple[str, str]]]:
        """Handle worker messages, deadlines and dispatch. Returns (replies, failures)."""
        done: list[Reply] = []
        failed: list[tuple[str, str]] = []
        while self.sock.poll(timeout_ms):
            timeout_ms = 0
            identity, *frames = self.sock.recv_multipart()
            try:
                msg = protocol.decode(frames)
            except protocol.ProtocolError as e:
                self.reject(identity, f"malformed message: {e}", failed)
                continue
            self.handle(identity, msg, done, failed)
        self.expire(failed)
        self.dispatch()
        return done, failed

    def handle(self, identity: bytes, msg: protocol.Message, done: list, failed: list) -> None:
        if msg.kind == protocol.HELLO:
            if msg["role"] != "reward_worker":
                log.error("refused a %s on the reward socket", msg["role"])
                self.send(identity, protocol.STOP, {"reason": "only reward workers attach here"})
                return
            self.workers[identity] = msg.header
            self.known.add(identity)
            log.info("reward worker pid %s attached (%d attached)", msg["pid"], len(self.workers))
            self.send(identity, protocol.HELLO, {"role": "learner", "pid": os.getpid()})
        elif msg.kind == protocol.READY:
            self.mark_ready(identity)
        elif msg.kind == protocol.SCORE_REPLY:
            request = self.assigned.get(msg["request_id"])
            if (request is None or request.worker != identity) and identity in self.busy:
                self.reject(identity, f"reply names request {msg['request_id']!r}, "
                            f"the worker holds {self.busy[identity]!r}", failed)
                return
            if request is None or request.worker != identity:
                self.stats["late_replies"] += 1
                log.warning("ignored a reply to request %s: not (or no longer) assigned to "
                            "that worker", msg["request_id"])
                self.mark_ready(identity)
                return
            rewards = msg["rewards"]
            by_fn = msg.header.get("rewards_by_function") or {}
            if len(rewards) != request.n:
                self.reject(identity, f"{len(rewards)} rewards for {request.n} completions", failed)
                return
            del self.assigned[request.request_id]
            self.busy.pop(identity, None)
            self.mark_ready(identity)
            done.append(Reply(request.request_id, rewards, by_fn))
        elif msg.kind == protocol.STOP:
            log.info("reward worker leaves: %s", msg["reason"])
            self.forget(identity)

    def reject(self, identity: bytes, reason: str, failed: list) -> None:
        """A bad reply: log it, hand the worker's request to another worker."""
        self.stats["rejected_replies"] += 1
        request_id = self.busy.pop(identity, None)
        log.error("bad reply from reward worker %s: %s", identity.hex(), reason)
        if request_id is not None:
            self.retry(self.assigned.pop(request_id), reason, failed)
        if identity in self.workers:
            self.mark_ready(identity)

    def retry(self, request: Request, reason: str, failed: list) -> None:
        request.worker = None
        if request.attempts >= self.max_attempts:
            failed.append((request.request_id, f"reward worker: {reason}"))
            return
        self.stats["retries"] += 1
        self.waiting.appendleft(request)

    def expire(self, failed: list) -> None:
        now = time.monotonic()
        for request in [r for r in self.assigned.values() if r.deadline < now]:
            log.error("reward worker %s missed the %.0f s deadline for request %s; "
                      "sending it elsewhere", request.worker.hex(), self.timeout_s, request.request_id)
            self.forget(request.worker)
            del self.assigned[request.request_id]
            self.retry(request, "deadline missed", failed)

    def forget(self, identity: bytes) -> None:
        self.workers.pop(identity, None)
        self.busy.pop(identity, None)
        if identity in self.ready:
            self.ready.remove(identity)

    def mark_ready(self, identity: bytes) -> None:
        if identity not in self.known:
            log.error("ignored a peer on the reward socket that never said hello")
            return
        if identity not in self.workers:
            # A worker we gave up on (deadline) that turns out alive: take it back.
            self.workers[identity] = {"role": "reward_worker", "pid": -1}
        if identity not in self.ready and identity not in self.busy:
            self.ready.append(identity)

    def dispatch(self) -> None:
        while self.waiting and self.ready:
            identity = self.ready.popleft()
            request = self.waiting.popleft()
            request.attempts += 1
            request.worker = identity
            request.deadline = time.monotonic() + self.timeout_s
            self.assigned[request.request_id] = request
            self.busy[identity] = request.request_id
            self.send(identity, protocol.SCORE, {"request_id": request.request_id, **request.header})

    def send(self, identity: bytes, kind: str, header: dict) -> None:
        self.sock.send_multipart([identity, *protocol.encode(kind, header)])

    def close(self) -> None:
        for identity in list(self.workers):
            self.send(identity, protocol.STOP, {"reason": "run finished"})
        self.sock.close()

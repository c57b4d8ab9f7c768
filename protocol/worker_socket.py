"""A worker socket: requests handed to worker processes that attach to it.

Two sockets work this way (PROTOCOL.md): the reward socket, owned by the learner (or
`actor sample`), where reward workers take `score` requests; and the environment
socket, owned by the actor, where environment workers take `reset` and `step` requests.

The owner binds a ROUTER socket; workers connect a DEALER, say hello, then `ready`, and
send a heartbeat every second. Each worker holds at most one request at a time; a reply
makes it ready again.

A worker is *lost* when it says `stop`, falls silent (no heartbeat for
WORKER_TIMEOUT_S; while it works, only if it promised to beat while working), misses
a deadline, sends a reply that cannot be used, or says hello again. The owner then
forgets it: its request goes to another worker (after `max_attempts` a request fails
with a reason), and whatever it holds is given up. If it speaks again it is a stranger,
greeted as one (protocol.connection): it drops all it held and attaches afresh. So a
worker's state and the owner's never disagree, and a late reply is never counted.

A request may be *pinned* to one attachment of a worker (`Attachment`: its identity and the
session its hello began): an environment's `step` must reach the worker that holds the
episode. A pinned request is never handed on; when its worker is lost it fails at once,
and the episode's owner starts the episode again elsewhere.

Every socket owner has an `instance` id, sent in its hello. A peer that speaks without
having said hello to this instance (a worker of an owner that was restarted, or one it
lost) is answered with our hello marked `attached: false`, and attaches with hello +
ready.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import protocol
from protocol import sockets
from protocol.connection import HEARTBEAT_S, WORKER_TIMEOUT_S, Peers, heartbeat, owner_hello
from protocol.wire import MAX_HEADER_BYTES
from transport import Transport

log = logging.getLogger("workers")

# While requests wait with no worker ready, say so this often.
STARVED_SAY_S = 30.0

# What a reply must also satisfy, beyond its kind's wire checks: the problem, or None.
ReplyCheck = Callable[[dict], "str | None"]
# One attachment of a worker: its identity and the session its hello began.
Attachment = tuple[bytes, int]

_sessions = itertools.count(1)


@dataclass
class Request:
    request_id: str
    frames: list  # the request as sent: encoded once, whatever worker takes it
    check: ReplyCheck | None = None
    pinned: Attachment | None = None  # only this attachment of a worker may take it
    attempts: int = 0
    worker: bytes | None = None  # who holds it: the one assignment table is `assigned`
    deadline: float = 0.0


def worker_of(request: Request) -> bytes:
    """The worker holding an assigned request (every request in `assigned` has one)."""
    if request.worker is None:
        raise RuntimeError(f"request {request.request_id} is assigned to no worker")
    return request.worker


# A pool's worker role: the socket it serves (endpoints.json's name) and what logs call it.
POOLS = {"reward_worker": ("reward", "reward worker"), "env_worker": ("env", "env worker")}


@dataclass
class Worker:
    pid: int
    beats_while_working: bool  # promised a heartbeat every second even while working
    session: int  # this attachment's: a request pinned to another one is not for it


@dataclass
class Reply:
    request_id: str
    worker: Attachment
    pid: int
    header: dict


class WorkerPool:
    def __init__(
        self,
        net: Transport,
        endpoint: str,
        role: str,
        reply_kind: str,
        timeout_s: float,
        max_attempts: int,
        instance: str | None = None,
        owner_role: str = "learner",
        keys: Path | None = None,
    ) -> None:
        """`role`: the hello role workers must have; `reply_kind`: the kind they answer
        with; `owner_role`: the role this side's hello carries; `keys`: the run's CURVE
        key directory, for TCP."""
        socket, self.name = POOLS[role]
        self.sock = sockets.listen(net, endpoint, keys, socket)
        self.endpoint = endpoint
        self.role, self.reply_kind, self.owner_role = role, reply_kind, owner_role
        self.instance = instance or uuid.uuid4().hex[:12]
        self.timeout_s, self.max_attempts = timeout_s, max_attempts
        self.workers: dict[bytes, Worker] = {}  # the attached workers
        self.peers = Peers(WORKER_TIMEOUT_S)  # when each was last heard from; strangers greeted
        self.ready: collections.deque[bytes] = collections.deque()
        self.waiting: collections.deque[Request] = collections.deque()
        self.assigned: dict[str, Request] = {}
        self.stats: collections.Counter[str] = collections.Counter()
        self.last_beat = 0.0
        self.starved_since: float | None = None  # since when requests wait with no worker ready
        self.said_starved = 0.0
        # What this poll found, returned by it: replies, and requests that failed (id, why).
        self.done: list[Reply] = []
        self.failed: list[tuple[str, str]] = []

    @property
    def n_workers(self) -> int:
        return len(self.workers)

    @property
    def pending(self) -> int:
        return len(self.waiting) + len(self.assigned)

    def hello(self, attached: bool) -> dict:
        """`attached` tells a worker whether this answers its hello, or greets a stranger
        that must say hello (PROTOCOL.md, "Liveness"); `timeout_s` is the deadline for a
        reply."""
        return owner_hello(
            self.owner_role,
            attached,
            instance=self.instance,
            heartbeat_s=HEARTBEAT_S,
            timeout_s=self.timeout_s,
        )

    def submit(
        self,
        request_id: str,
        header: dict,
        kind: str = protocol.SCORE,
        check: ReplyCheck | None = None,
        pinned: Attachment | None = None,
    ) -> None:
        frames = protocol.encode(kind, {"request_id": request_id, **header})
        self.waiting.append(Request(request_id, frames, check, pinned))

    def holds(self, holder: Attachment) -> bool:
        """Whether that attachment of a worker is still attached."""
        w = self.workers.get(holder[0])
        return w is not None and w.session == holder[1]

    def notify(self, holder: Attachment, kind: str, header: dict) -> None:
        """A message that wants no reply (an environment's `end`), to that attachment of a
        worker; one lost since has dropped everything already."""
        if self.holds(holder):
            self.send(holder[0], kind, header)

    def poll(self, timeout_ms: int = 0) -> tuple[list[Reply], list[tuple[str, str]]]:
        """Handle worker messages, deadlines, silence and dispatch. Returns (replies, failures)."""
        for incoming in sockets.incoming(self.sock, timeout_ms):
            self.peers.heard(incoming.peer)
            if incoming.msg is None:
                if incoming.peer in self.workers:
                    self.reject(incoming.peer, f"malformed message: {incoming.error}")
                continue
            self.handle(incoming.peer, incoming.msg)
        self.check_workers()
        self.dispatch()
        self.say_if_starved()
        self.beat()
        done, failed, self.done, self.failed = self.done, self.failed, [], []
        return done, failed

    def handle(self, identity: bytes, msg: protocol.Message) -> None:
        if msg.kind == protocol.HELLO:
            self.attach(identity, msg)
            return
        worker = self.workers.get(identity)
        if worker is None:
            self.greet(identity, msg)
            return
        if msg.kind == protocol.READY:
            self.mark_ready(identity)
        elif msg.kind == self.reply_kind:
            self.take_reply(identity, msg)
        elif msg.kind == protocol.STOP:
            log.info("%s pid %d leaves: %s", self.name, worker.pid, msg["reason"])
            self.lose(identity, "the worker left")
        # A heartbeat is only for last_seen; other kinds mean nothing here.

    def attach(self, identity: bytes, msg: protocol.Message) -> None:
        if msg["role"] != self.role:
            log.error("refused a %s on the %s socket", msg["role"], self.name)
            self.send(identity, protocol.STOP, {"reason": f"only {self.name}s attach here", "final": True})
            return
        if identity in self.workers:  # said hello again: it forgot what it held
            self.lose(identity, "the worker said hello again")
        # beats_while_scoring: the reward socket's older name for the same promise.
        promise = msg.header.get("beats_while_working", msg.header.get("beats_while_scoring"))
        self.workers[identity] = Worker(msg["pid"], promise is True, next(_sessions))
        self.peers.attach(identity)
        log.info("%s pid %s attached (%d attached)", self.name, msg["pid"], self.n_workers)
        self.send(identity, protocol.HELLO, self.hello(attached=True))

    def greet(self, identity: bytes, msg: protocol.Message) -> None:
        """A peer that is not attached to this instance: a worker of an owner that was
        restarted, or one we lost. Tell it, once, that it is not attached; it drops what
        it holds and answers with hello and ready."""
        if msg.kind == self.reply_kind:
            self.stats["late_replies"] += 1  # to a request it lost, or of a previous instance
        if self.peers.greet(identity):
            log.info(
                "a peer not attached to this %s sent %r; sending it our hello", self.owner_role, msg.kind
            )
            self.send(identity, protocol.HELLO, self.hello(attached=False))

    def take_reply(self, identity: bytes, msg: protocol.Message) -> None:
        request = self.assigned.get(msg["request_id"])
        if request is None or request.worker != identity:
            held = self.holding(identity)
            if held is not None:
                self.reject(
                    identity,
                    f"reply names request {msg['request_id']!r}, the worker holds {held.request_id!r}",
                )
                return
            self.stats["late_replies"] += 1
            log.warning("ignored a reply to request %s: it was never that worker's", msg["request_id"])
            return
        problem = request.check(msg.header) if request.check is not None else None
        if problem is not None:
            self.reject(identity, problem)
            return
        del self.assigned[request.request_id]
        self.mark_ready(identity)
        worker = self.workers[identity]
        self.done.append(Reply(request.request_id, (identity, worker.session), worker.pid, msg.header))

    def holding(self, identity: bytes) -> Request | None:
        return next((r for r in self.assigned.values() if r.worker == identity), None)

    def reject(self, identity: bytes, reason: str) -> None:
        """A reply that cannot be used: log it and lose the worker (what it holds may be
        anything now)."""
        self.stats["rejected_replies"] += 1
        log.error("bad reply from %s pid %d: %s", self.name, self.workers[identity].pid, reason)
        self.lose(identity, f"bad reply: {reason}")

    def lose(self, identity: bytes, why: str) -> None:
        """Forget the worker: hand on the request it holds, fail those pinned to it. If it
        speaks again it is greeted as a stranger."""
        del self.workers[identity]
        self.peers.lose(identity)
        self.stats["lost_workers"] += 1
        if identity in self.ready:
            self.ready.remove(identity)
        self.requeue(identity, why)
        for request in [r for r in self.waiting if r.pinned is not None and r.pinned[0] == identity]:
            self.waiting.remove(request)
            self.failed.append((request.request_id, f"{self.name}: {why}"))

    def requeue(self, identity: bytes, reason: str) -> None:
        request = self.holding(identity)
        if request is None:
            return
        del self.assigned[request.request_id]
        request.worker = None
        if request.pinned is not None or request.attempts >= self.max_attempts:
            self.failed.append((request.request_id, f"{self.name}: {reason}"))
            return
        self.stats["retries"] += 1
        self.waiting.appendleft(request)

    def check_workers(self) -> None:
        now = time.monotonic()
        for request in [r for r in self.assigned.values() if r.deadline < now]:
            worker = worker_of(request)
            log.error(
                "%s pid %d missed the %.0f s deadline for request %s; sending it elsewhere",
                self.name,
                self.workers[worker].pid,
                self.timeout_s,
                request.request_id,
            )
            self.lose(worker, "deadline missed")
        for identity, silent in self.peers.silent():
            w = self.workers[identity]
            held = self.holding(identity)
            if held is None or w.beats_while_working:
                log.error(
                    "%s pid %d sent nothing for %.1f s: taking it for gone%s",
                    self.name,
                    w.pid,
                    silent,
                    f"; request {held.request_id} goes elsewhere" if held else "",
                )
                self.lose(identity, "the worker fell silent")

    def mark_ready(self, identity: bytes) -> None:
        if identity not in self.ready and self.holding(identity) is None:
            self.ready.append(identity)

    def dispatch(self) -> None:
        """Give waiting requests to ready workers, in order; a pinned request waits for its
        own worker, and fails when that worker is gone."""
        for request in list(self.waiting):
            if request.pinned is not None and not self.holds(request.pinned):
                self.waiting.remove(request)
                self.failed.append((request.request_id, f"{self.name}: the worker holding it is gone"))
                continue
            if len(request.frames[0]) > MAX_HEADER_BYTES:  # workers refuse it unread
                self.waiting.remove(request)
                size = len(request.frames[0])
                self.failed.append(
                    (
                        request.request_id,
                        f"{self.name}: the request's {size} bytes exceed "
                        f"the protocol's limit of {MAX_HEADER_BYTES}",
                    )
                )
                continue
            if request.pinned is None and self.ready:
                identity = self.ready.popleft()
            elif request.pinned is not None and request.pinned[0] in self.ready:
                identity = request.pinned[0]
                self.ready.remove(identity)
            else:
                continue
            self.waiting.remove(request)
            request.attempts += 1
            request.worker = identity
            request.deadline = time.monotonic() + self.timeout_s
            self.assigned[request.request_id] = request
            self.sock.send([identity, *request.frames])

    def say_if_starved(self) -> None:
        """Every STARVED_SAY_S while requests wait and no worker is ready: say what for."""
        if not self.waiting or self.ready:
            self.starved_since = None
            return
        now = time.monotonic()
        if self.starved_since is None:
            self.starved_since = self.said_starved = now
        if now - self.said_starved < STARVED_SAY_S:
            return
        self.said_starved = now
        held = "".join(
            f"; pid {self.workers[worker_of(r)].pid} holds {r.request_id} (deadline in "
            f"{r.deadline - now:.0f} s)"
            for r in self.assigned.values()
        )
        log.warning(
            "no %s has been ready for %.0f s: %d request(s) wait, %d worker(s) attached%s",
            self.name,
            now - self.starved_since,
            len(self.waiting),
            self.n_workers,
            held,
        )

    def beat(self) -> None:
        """Heartbeats to the attached workers, while this process's loop runs."""
        if time.monotonic() - self.last_beat < HEARTBEAT_S:
            return
        self.last_beat = time.monotonic()
        for identity in self.workers:
            self.send(identity, protocol.HEARTBEAT, heartbeat(self.owner_role))

    def send(self, identity: bytes, kind: str, header: dict) -> None:
        self.sock.send([identity, *protocol.encode(kind, header)])

    def close(self, reason: str = "run finished", final: bool = True) -> None:
        """`final`: the run is over and workers exit; else this owner only goes away (it is
        restarted, or a resume will start it) and workers wait to attach again."""
        for identity in self.workers:
            self.send(identity, protocol.STOP, {"reason": reason, "final": final})
        self.sock.close()

"""A connection's life between a socket's owner and its peers, and its timeouts.

Every socket of a run has one owner, which binds it, and peers, which connect: the
learner owns the rollout socket (peers: actors) and the reward socket (reward workers);
the actor owns the env socket (env workers). Each connection lives the same life
(PROTOCOL.md, `hello`, `heartbeat`, "Liveness"):

1. **hello**: the peer says hello; the owner checks it and answers with its own hello,
   `attached: true`.
2. **attached**: both sides work; the peer beats every HEARTBEAT_S.
3. **lost**: the owner hears nothing from a peer for its timeout (ACTOR_TIMEOUT_S,
   WORKER_TIMEOUT_S), takes it for gone and forgets it: what it held goes to the others.
4. **greeted again**: a peer the owner does not know (lost, or one of a restarted owner,
   or a connection that came back under a new identity) is told so, once, with the
   owner's hello, `attached: false`; it drops what it holds and says hello again.

Forgetting and greeting again is what keeps the two sides from ever disagreeing: neither
tries to repair a connection's state, the peer starts over, so a late reply is never
counted and a restarted owner needs no word from its predecessor.

The owner's side is `Peers`; a peer's side is `Link`, whose `State` says where it is.
A peer gives up (`Link.check`, in this order) when the owner refuses its connection for
good (a CURVE key: exit 4, a restart would be refused again), when the run it was
attached to with `--run-dir` has ended, or when the owner has been unreachable for
LEARNER_TIMEOUT_S: long enough for a supervisor to restart a learner that loads a large
model. Silence alone is no sign of a dead owner: the learner does not beat during a long
optimizer step.

No MLX, no sockets here: only the rules; the processes send and receive.
"""

from __future__ import annotations

import enum
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from protocol.wire import HELLO, INCOMPATIBLE, STOP, Message

if TYPE_CHECKING:
    from transport import Watch as ConnectionWatch

# Every peer beats this often when it has nothing else to say, and so does the owner of a
# worker socket to its workers (`heartbeat_s`, fixed in protocol version 1).
HEARTBEAT_S = 1.0
# A reward or env worker silent this long is taken for gone: a dead worker costs 3 s.
WORKER_TIMEOUT_S = 3.0
# An actor silent this long (dead, frozen, its machine or link gone) is taken for gone: its
# share of the batch goes to the others. A slot whose actor has not attached this long
# after the learner starts stops counting as live (the actor is loading meanwhile).
ACTOR_TIMEOUT_S = 10.0
# A peer whose owner has been unreachable this long stops waiting for it.
LEARNER_TIMEOUT_S = 120.0
# A peer attached with --run-dir looks whether its run is over after this long without a
# connection: a restart's gap is not the end of a run.
RUN_OVER_CHECK_S = 1.0


def owner_hello(role: str, attached: bool, **fields: object) -> dict:
    """The owner's hello: `attached` true answers a peer's hello; false greets a peer the
    owner does not know, which must say hello again."""
    return {"role": role, "pid": os.getpid(), **fields, "attached": attached}


def heartbeat(role: str, **fields: object) -> dict:
    """A heartbeat's header: who beats, and when."""
    return {"role": role, "time": time.time(), **fields}


class Peers:
    """The owner's side: which peers are attached and when each was last heard from, and
    which strangers were told, once, that they are not attached. What the owner keeps of
    each peer (an actor's hello, a worker's request) is its own business."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.last_seen: dict[bytes, float] = {}  # the attached peers
        self.greeted: set[bytes] = set()  # strangers told they are not attached

    def __contains__(self, peer: bytes) -> bool:
        return peer in self.last_seen

    def heard(self, peer: bytes) -> None:
        """Any message is a sign of life, a malformed one too."""
        if peer in self.last_seen:
            self.last_seen[peer] = time.monotonic()

    def attach(self, peer: bytes) -> None:
        self.last_seen[peer] = time.monotonic()
        self.greeted.discard(peer)

    def lose(self, peer: bytes) -> None:
        """Forget the peer: if it speaks again it is a stranger."""
        del self.last_seen[peer]

    def greet(self, peer: bytes) -> bool:
        """Whether to tell this stranger it is not attached: once, until it says hello."""
        if peer in self.greeted:
            return False
        self.greeted.add(peer)
        return True

    def silent(self) -> list[tuple[bytes, float]]:
        """The attached peers silent for longer than the timeout, with their silence."""
        now = time.monotonic()
        return [(p, now - seen) for p, seen in self.last_seen.items() if now - seen > self.timeout_s]


class State(enum.Enum):
    """Where a peer's connection is (`Link.state`). CONNECTING -> HELLO_SENT (we say
    hello) -> ATTACHED (the owner's hello). From any of these: STRANGER (`attached: false`)
    or AWAY (a `stop` that is not final), and back to HELLO_SENT when we say hello again,
    as on a new connection. The last four end the peer, for good."""

    CONNECTING = "connecting"  # no hello has gone out (the start, or it could not be sent)
    HELLO_SENT = "hello sent"  # on connection `Link.hello_on`; the owner's answer is due
    ATTACHED = "attached"  # the owner answered our hello
    STRANGER = "stranger"  # the owner does not know us (took us for gone, restarted): hello again
    AWAY = "away"  # the owner goes away and comes back (a restart, a resume): drop what we hold
    STOPPED = "stopped"  # the owner said stop, or the run has ended: exit
    INCOMPATIBLE = "incompatible"  # the owner refused our hello (another model): exit 4
    REFUSED = "refused"  # the connection is refused for good (a CURVE key): exit 4
    LOST = "lost"  # the owner has been unreachable for the timeout: exit 1


ENDED = (State.STOPPED, State.INCOMPATIBLE, State.REFUSED, State.LOST)


class Link:
    """A peer's side: its connection to the socket's owner, and what the owner said.
    `owner` names it in logs ("learner", "actor"), `where` too where it tells more ("learner
    on tcp://..."); `log` is the process's logger; `run_dir`: the run a peer attached with
    --run-dir looks at (None: by endpoint alone)."""

    def __init__(
        self,
        watch: ConnectionWatch,
        owner: str,
        log: logging.Logger,
        timeout_s: float = LEARNER_TIMEOUT_S,
        run_dir: Path | None = None,
        where: str | None = None,
    ) -> None:
        self.watch, self.owner, self.log = watch, owner, log
        self.timeout_s, self.run_dir = timeout_s, run_dir
        self.where = where or owner
        self.state = State.CONNECTING
        self.hello_on = 0  # the connection our hello went on (ConnectionWatch.connections)

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    def check(self) -> State:
        """Look at the connection: refused for good, the run over, the owner gone too long."""
        down = self.watch.down_for()
        if down and self.watch.refused:
            self.log.error("cannot connect to the %s: %s", self.where, self.watch.refused)
            self.state = State.REFUSED
        elif self.run_has_ended(down):
            self.state = State.STOPPED
        elif down > self.timeout_s:
            self.log.error("no %s for %.0f s; it is gone, stopping", self.where, down)
            self.state = State.LOST
        return self.state

    def run_has_ended(self, down: float) -> bool:
        if self.run_dir is None or down <= RUN_OVER_CHECK_S:
            return False
        # Here, not at the top: lifecycle imports this module's timeouts.
        from runtime.lifecycle import run_is_over

        if not run_is_over(self.run_dir):
            return False
        self.log.info(
            "the run in %s has ended (its orchestrator stopped it for good); stopping", self.run_dir
        )
        return True

    def saying_hello(self) -> None:
        """Our hello goes out now: on the newest connection, or the first to come."""
        self.state = State.HELLO_SENT
        self.hello_on = max(self.watch.connections, 1)

    def hello_failed(self) -> None:
        """It could not go: say it on the next connection (`check` says if it is refused)."""
        self.state = State.CONNECTING
        self.hello_on = 0

    def hello_due(self) -> str | None:
        """Why the owner does not know us, when it does not: say hello again."""
        if self.state is State.STRANGER:
            return "it took us for gone"
        if self.watch.connections > self.hello_on:
            # A new connection is a new identity to the owner; what was on the wire is lost.
            return "the connection dropped and came back"
        return None

    def take(self, msg: Message) -> State:
        """The owner's `hello` or `stop`: where it leaves us. An ended link stays ended."""
        if self.ended:
            return self.state
        if msg.kind == STOP and msg.header.get("final") is False:
            self.log.info("the %s goes away (%s); waiting for it to come back", self.owner, msg["reason"])
            self.state = State.AWAY
        elif msg.kind == STOP:
            self.state = State.INCOMPATIBLE if msg.header.get("code") == INCOMPATIBLE else State.STOPPED
        elif msg.kind == HELLO and msg.header.get("attached") is False:
            self.state = State.STRANGER
        elif msg.kind == HELLO and self.state is not State.STRANGER:  # one until it says hello
            self.state = State.ATTACHED
        return self.state

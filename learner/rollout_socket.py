"""The rollout socket: actors attach, stream groups in, get weights and credit back.

A ZeroMQ ROUTER, so several actors can attach. An actor's hello is checked against what
the learner runs (model, tokenizer, LoRA config); one that matches gets the learner's
hello and the current weights before it may sample. Every rollout that arrives is
counted in the ledger as received, and becomes a Group or is dropped with a reason;
a message that fails validation is logged and dropped, never raised.

Actors beat every second. One silent for ACTOR_TIMEOUT_S (dead, frozen, its machine or
link gone) is taken for gone, and the batch is shared among the live ones: each actor's
credit says its window, the groups it may keep in flight, ceil((k + 1) * B / live). For
ACTOR_TIMEOUT_S after the learner starts, a slot that has not attached yet counts as
live (its actor is loading), so the first actor does not take whole batches meanwhile. An
actor the learner does not know (taken for gone, or a connection that came back under a
new identity) is greeted with `hello`, `attached: false`, and says hello again
(protocol.connection).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

import protocol
from learner.ahead import PARTIAL_TOKENS, ReferenceAhead
from learner.groups import Group, data_span
from learner.ledger import Ledger
from protocol import sockets
from protocol.connection import ACTOR_TIMEOUT_S, Peers, owner_hello
from protocol.messages import HELLO_MODEL_FIELDS, Hello, Partial, Rollout
from runtime.config import credit_window
from transport import Transport

log = logging.getLogger("learner")

MB = 1 << 20


class RolloutSocket:
    def __init__(
        self,
        net: Transport,
        endpoint: str,
        ledger: Ledger,
        identity: dict[str, Any],
        check_group: Callable[[bytes, protocol.Message], Group],
        weights: Callable[[], dict],
        keys: Path | None = None,
        actor_count: int = 1,
        max_frame: int = sockets.MAX_HEADER_BYTES,
        max_staleness: int = 0,
        batch_size: int = 1,
        partials: ReferenceAhead | None = None,
    ) -> None:
        """`identity`: what this learner runs (model, tokenizer, lora, instance), sent in
        its hello and checked in actors'. `check_group` turns a rollout into a Group or
        raises ValueError with the drop reason. `weights()` gives the adapter arrays. `keys`:
        the run's CURVE key directory, for TCP (transport.keys). `actor_count`: the run's
        actor slots. `max_frame`: the largest frame a rollout of the run carries.
        `max_staleness`, `batch_size`: k and B of the credit window (config.credit_window).
        `partials`: where the groups' partials go, when the learner asks actors for them."""
        self.actor_count, self.max_staleness, self.batch_size = actor_count, max_staleness, batch_size
        self.sock = sockets.listen(net, endpoint, keys, "rollout", max_frame)
        self.ledger = ledger
        self.identity = identity
        self.check_group = check_group
        self.weights = weights
        self.actors: dict[bytes, dict] = {}  # their hellos
        self.peers = Peers(ACTOR_TIMEOUT_S)  # when each was last heard from; strangers greeted
        self.windows: dict[bytes, int] = {}  # the window each actor was last told
        self.decoding: dict[bytes, list[int]] = {}  # each actor's last `in_flight`: groups it samples
        self.attached_slots: set[int] = set()  # slots that have had an actor
        self.started = time.monotonic()
        # `actor serve --run-dir`: gets every weights version, sends nothing, has no credit.
        self.observers: dict[bytes, dict] = {}
        self.weight_sync: dict[str, float] = {}  # the newest publish's size and serialize time
        self.partials = partials or ReferenceAhead(None)

    def send(self, actor: bytes, kind: str, header: dict | None = None) -> None:
        self.sock.send([actor, *protocol.encode(kind, header)])

    def receive(self, timeout_ms: int, policy_version: int) -> list[Group]:
        """The groups that arrive within `timeout_ms`. An actor that attaches gets weights
        of `policy_version`, and where its slot's data continues."""
        groups = []
        for incoming in sockets.incoming(self.sock, timeout_ms):
            actor, msg = incoming.peer, incoming.msg
            self.peers.heard(actor)
            if msg is None:
                self.ledger.reject_message()
                log.error("dropped a malformed message from %s: %s", actor.hex(), incoming.error)
                if actor in self.actors and _looks_like_rollout(incoming.frames):
                    # An attached actor counts this group as in flight; consume it so the
                    # actor is not left waiting for credit that would never come.
                    self.ledger.receive(actor)
                    self.ledger.drop("malformed", actor)
                continue
            if msg.kind == protocol.HELLO:
                self.attach(actor, msg, policy_version)
            elif msg.kind == protocol.ROLLOUT:
                group = self.take_rollout(actor, msg)
                if group is not None:
                    groups.append(group)
                else:  # dropped: its partials' work is of no use
                    self.partials.discard((actor, msg["group_id"]))
            elif msg.kind == protocol.PARTIAL and actor in self.actors:
                self.partials.offer(actor, Partial.read(msg))
            elif msg.kind == protocol.STOP:
                log.info("peer asked to stop: %s", msg["reason"])
            elif msg.kind == protocol.HEARTBEAT and msg["role"] == "actor" and actor not in self.actors:
                self.greet(actor)
            # Other kinds have no meaning for the learner.
        self.check_actors()
        self.send_credits()
        return groups

    def greet(self, actor: bytes) -> None:
        """An actor we do not know (taken for gone, or a connection that came back): tell
        it, once, to say hello again."""
        if self.peers.greet(actor):
            log.info("an actor that is not attached beats; sending it our hello")
            self.send(actor, protocol.HELLO, owner_hello("learner", False, **self.identity))

    def check_actors(self) -> None:
        """Take an actor that has been silent for ACTOR_TIMEOUT_S for gone: its share of the
        batch goes to the others (their windows grow) until it, or another, takes its slot."""
        for actor, _ in self.peers.silent():
            header = self.actors.pop(actor)
            self.decoding.pop(actor, None)
            self.partials.forget(actor)
            self.peers.lose(actor)
            log.warning(
                "actor pid %s (slot %d) sent nothing for %.0f s: taking it for gone; %d actor(s) "
                "share the batch",
                header["pid"],
                header.get("slot", 0),
                ACTOR_TIMEOUT_S,
                len(self.actors),
            )

    def window(self) -> int:
        """The groups each live actor may keep in flight: (k + 1) * B shared among them."""
        loading = self.actor_count - len(self.attached_slots)
        if time.monotonic() - self.started > ACTOR_TIMEOUT_S:
            loading = 0  # an actor that never came is not waited for
        return credit_window(self.max_staleness, self.batch_size, len(self.actors) + loading)

    def attach(self, actor: bytes, msg: protocol.Message, policy_version: int) -> None:
        problem = self.incompatibility(msg)
        if problem:
            log.error("refused %s (pid %s): %s", msg["role"], msg["pid"], problem)
            self.send(
                actor, protocol.STOP, {"reason": f"incompatible: {problem}", "code": protocol.INCOMPATIBLE}
            )
            return
        role, slot = msg["role"], msg.header.get("slot", 0)
        hello = owner_hello("learner", True, **self.identity)
        if role == "observer":
            self.observers[actor] = msg.header
        else:
            for old in [a for a, header in self.actors.items() if header.get("slot", 0) == slot]:
                # Its slot is taken by a new actor (a restart): the old one is gone, and
                # what it had not sent is sampled again from the slot's cursor.
                log.info("slot %d was actor pid %s's; that actor is gone", slot, self.actors.pop(old)["pid"])
                self.decoding.pop(old, None)
                self.partials.forget(old)
                self.peers.lose(old)
            self.actors[actor] = msg.header
            self.decoding.pop(actor, None)  # a hello forgets the groups in flight
            self.partials.forget(actor)
            self.attached_slots.add(slot)
            self.peers.attach(actor)
            self.ledger.attach(actor, slot)
            hello["data_cursor"], hello["data_skip"] = self.ledger.cursor_for(slot)
            # An actor started by hand (`--connect`) reads its own copy of the config.
            hello["max_staleness"] = self.max_staleness
            if self.partials.budget > 0:
                hello["partials"] = PARTIAL_TOKENS
        log.info(
            "%s pid %s attached%s; sending weights of version %d",
            role,
            msg["pid"],
            f" as slot {slot}" if role == "actor" else "",
            policy_version,
        )
        self.send(actor, protocol.HELLO, hello)
        self.publish(policy_version, [actor])

    def incompatibility(self, msg: protocol.Message) -> str | None:
        if msg["role"] not in ("actor", "observer"):
            return f"role {msg['role']!r} cannot attach to the rollout socket"
        slot = msg.header.get("slot", 0)
        if msg["role"] == "actor" and not (type(slot) is int and 0 <= slot < self.actor_count):
            n = self.actor_count
            return f"slot {slot!r}: this run has actor.count = {n} (slots 0 to {n - 1})"
        hello = Hello.read(msg)
        missing = [name for name in HELLO_MODEL_FIELDS if getattr(hello, name) is None]
        if missing:
            return f"an {msg['role']}'s hello needs {', '.join(map(repr, missing))} (PROTOCOL.md, hello)"
        if msg["tokenizer"] != self.identity["tokenizer"]:
            return "tokenizer fingerprint differs"
        if msg["lora"] != self.identity["lora"]:
            return f"LoRA config {msg['lora']} differs from {self.identity['lora']}"
        if msg["model"] != self.identity["model"]:
            return f"model {msg['model']!r} differs from {self.identity['model']!r}"
        return None

    def take_rollout(self, actor: bytes, msg: protocol.Message) -> Group | None:
        self.ledger.receive(actor)
        if actor not in self.actors:
            self.ledger.drop("no handshake", actor, group_id=msg["group_id"])
            return None
        rollout = Rollout.read(msg)
        if isinstance(rollout.in_flight, list):
            self.decoding[actor] = [v for v in rollout.in_flight if type(v) is int]
        else:  # unknown now: no places kept for this actor's groups (PROTOCOL.md)
            self.decoding.pop(actor, None)
        try:
            cursor, start = data_span(rollout)
        except ValueError as e:  # its place in the data unknown: its prompt is sampled again
            self.ledger.drop(str(e), actor, group_id=msg["group_id"])
            return None
        # Held from here on, trained or dropped: a restarted actor skips its prompt.
        self.ledger.received_group(actor, cursor, start)
        try:
            return self.check_group(actor, msg)
        except ValueError as e:
            self.ledger.drop(str(e), actor, cursor, msg["group_id"], start)
            return None

    def sampling(self, version: int) -> int:
        """How many groups the live actors said they are still sampling whose oldest token
        is of `version` (PROTOCOL.md, `in_flight`). An actor that leaves `actors` (taken
        for gone, its slot taken over) leaves `decoding` with it."""
        return sum(vs.count(version) for vs in self.decoding.values())

    def publish(self, policy_version: int, actors: list[bytes] | None = None) -> None:
        """Send the adapter weights, as `policy_version`, to `actors` (default: every attached
        actor and observer), serialised once."""
        t0 = time.perf_counter()
        frames = protocol.encode(
            protocol.WEIGHTS, {"version": policy_version, "sent_at": time.time()}, self.weights()
        )
        self.weight_sync = {
            "weights_mb": sum(len(f) for f in frames) / MB,
            "weights_serialize_s": time.perf_counter() - t0,
        }
        for actor in [*self.actors, *self.observers] if actors is None else actors:
            self.sock.send([actor, *frames])

    def send_credits(self) -> None:
        """Tell each attached actor how many of its groups are consumed and its window, when
        either changed."""
        window = self.window()
        due = dict(self.ledger.credits_due(list(self.actors)))
        for actor in self.actors:
            if actor in due or self.windows.get(actor) != window:
                self.windows[actor] = window
                self.send(
                    actor, protocol.CREDIT, {"groups_consumed": self.ledger.consumed[actor], "window": window}
                )

    def close(self, reason: str, final: bool = True) -> None:
        for actor in [*self.actors, *self.observers]:
            self.send(actor, protocol.STOP, {"reason": reason, "final": final})
        self.sock.close()


def _looks_like_rollout(frames: list) -> bool:
    try:
        head = msgpack.unpackb(bytes(frames[0]), raw=False)
    except Exception:
        return False
    return isinstance(head, dict) and head.get("kind") == protocol.ROLLOUT

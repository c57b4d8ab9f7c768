"""The rollout socket: actors attach, stream groups in, get weights and credit back.

A ZeroMQ ROUTER, so several actors can attach. An actor's hello is checked against what
the learner runs (model, tokenizer, LoRA config); one that matches gets the learner's
hello and the current weights before it may sample. Every rollout that arrives is
counted in the ledger as received, and becomes a Group or is dropped with a reason;
a message that fails validation is logged and dropped, never raised.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import zmq

import protocol
from learner.groups import Group
from learner.ledger import Ledger
from protocol import sockets
from protocol.wire import HELLO_MODEL_FIELDS

log = logging.getLogger("learner")

MB = 1 << 20


class RolloutSocket:
    def __init__(self, ctx: zmq.Context, endpoint: str, ledger: Ledger, identity: dict[str, Any],
                 check_group: Callable[[bytes, protocol.Message], Group],
                 weights: Callable[[], dict], keys: Path | None = None, actor_count: int = 1,
                 max_frame: int = sockets.MAX_HEADER_BYTES) -> None:
        """`identity`: what this learner runs (model, tokenizer, lora, instance), sent in
        its hello and checked in actors'. `check_group` turns a rollout into a Group or
        raises ValueError with the drop reason. `weights()` gives the adapter arrays. `keys`:
        the run's CURVE key directory, for TCP (protocol.keys). `actor_count`: the run's
        actor slots. `max_frame`: the largest frame a rollout of the run carries."""
        self.actor_count = actor_count
        self.sock = sockets.listen(ctx, endpoint, keys, "rollout", max_frame)
        self.ledger = ledger
        self.identity = identity
        self.check_group = check_group
        self.weights = weights
        self.actors: dict[bytes, dict] = {}
        # `actor serve --run-dir`: gets every weights version, sends nothing, has no credit.
        self.observers: dict[bytes, dict] = {}
        self.weight_sync: dict[str, float] = {}  # the newest publish's size and serialize time

    def send(self, actor: bytes, kind: str, header: dict | None = None) -> None:
        self.sock.send_multipart([actor, *protocol.encode(kind, header)], copy=False)

    def receive(self, timeout_ms: int, version: int) -> list[Group]:
        """The groups that arrive within `timeout_ms`. An actor that attaches gets weights
        of `version`, and where its slot's data continues."""
        groups = []
        for incoming in sockets.incoming(self.sock, timeout_ms):
            actor, msg = incoming.peer, incoming.msg
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
                self.attach(actor, msg, version)
            elif msg.kind == protocol.ROLLOUT:
                group = self.take_rollout(actor, msg)
                if group is not None:
                    groups.append(group)
            elif msg.kind == protocol.STOP:
                log.info("peer asked to stop: %s", msg["reason"])
            # Heartbeats need no answer; other kinds have no meaning for the learner.
        self.send_credits()
        return groups

    def attach(self, actor: bytes, msg: protocol.Message, version: int) -> None:
        problem = self.incompatibility(msg)
        if problem:
            log.error("refused %s (pid %s): %s", msg["role"], msg["pid"], problem)
            self.send(actor, protocol.STOP, {"reason": f"incompatible: {problem}"})
            return
        role, slot = msg["role"], msg.header.get("slot", 0)
        hello = {"role": "learner", "pid": os.getpid(), **self.identity}
        if role == "observer":
            self.observers[actor] = msg.header
        else:
            for old in [a for a, header in self.actors.items() if header.get("slot", 0) == slot]:
                # Its slot is taken by a new actor (a restart): the old one is gone, and
                # what it had not sent is sampled again from the slot's cursor.
                log.info("slot %d was actor pid %s's; that actor is gone", slot, self.actors.pop(old)["pid"])
            self.actors[actor] = msg.header
            self.ledger.attach(actor, slot)
            hello["data_cursor"] = self.ledger.cursor_for(slot)
        log.info("%s pid %s attached%s; sending weights of version %d", role, msg["pid"],
                 f" as slot {slot}" if role == "actor" else "", version)
        self.send(actor, protocol.HELLO, hello)
        self.publish(version, [actor])

    def incompatibility(self, msg: protocol.Message) -> str | None:
        if msg["role"] not in ("actor", "observer"):
            return f"role {msg['role']!r} cannot attach to the rollout socket"
        slot = msg.header.get("slot", 0)
        if msg["role"] == "actor" and not (type(slot) is int and 0 <= slot < self.actor_count):
            n = self.actor_count
            return f"slot {slot!r}: this run has actor.count = {n} (slots 0 to {n - 1})"
        missing = [name for name, typ in HELLO_MODEL_FIELDS.items()
                   if not isinstance(msg.header.get(name), typ)]
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
        try:
            group = self.check_group(actor, msg)
        except ValueError as e:
            self.ledger.drop(str(e), actor, group_id=msg["group_id"])
            return None
        self.ledger.received_group(actor, group.cursor)
        return group

    def publish(self, version: int, actors: list[bytes] | None = None) -> None:
        """Send the adapter weights, as `version`, to `actors` (default: every attached
        actor and observer), serialised once."""
        t0 = time.perf_counter()
        frames = protocol.encode(protocol.WEIGHTS, {"version": version, "sent_at": time.time()},
                                 self.weights())
        self.weight_sync = {"weights_mb": sum(len(f) for f in frames) / MB,
                            "weights_serialize_s": time.perf_counter() - t0}
        for actor in [*self.actors, *self.observers] if actors is None else actors:
            self.sock.send_multipart([actor, *frames], copy=False)

    def send_credits(self) -> None:
        """Tell each attached actor how many of its groups are consumed, when that changed."""
        for actor, n in self.ledger.credits_due(list(self.actors)):
            self.send(actor, protocol.CREDIT, {"groups_consumed": n})

    def close(self, reason: str) -> None:
        for actor in [*self.actors, *self.observers]:
            self.send(actor, protocol.STOP, {"reason": reason})
        self.sock.close()


def _looks_like_rollout(frames: list) -> bool:
    try:
        head = msgpack.unpackb(bytes(frames[0]), raw=False)
    except Exception:
        return False
    return isinstance(head, dict) and head.get("kind") == protocol.ROLLOUT

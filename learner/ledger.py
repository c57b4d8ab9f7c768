"""Where every rollout group is: the learner's book of what nothing may lose.

Every group received is trained on, dropped with a reason, or still queued:
`received == trained + dropped + queued` at every step (the queue lives with the learner,
which passes its length in). The ledger also holds what follows from that book: each
actor's credit (its groups consumed, trained or dropped, which lets it sample more) and
the data cursors a resumed run continues from (just after the newest consumed prompt),
one per actor slot (`actor.count` actors share the data, each its own part of the stream).
"""

from __future__ import annotations

import collections
import logging
from typing import Any

log = logging.getLogger("learner")

# Drops an algorithm or the staleness bound makes as a matter of course: counted, and said
# once a step. Any other drop is said with its group.
ROUTINE_DROPS = ("filtered: equal rewards", "stale")


class Ledger:
    def __init__(self) -> None:
        self.received = 0
        self.trained = 0
        self.dropped: collections.Counter[str] = collections.Counter()
        self.rejected = 0  # messages that failed validation (not groups)
        self.consumed: collections.Counter[bytes] = collections.Counter()  # per actor
        self.credited: dict[bytes, int] = {}  # the consumed count each actor was last told
        self.data_cursor: list[int] | None = None  # the newest consumed of any slot
        self.slots: dict[bytes, int] = {}  # actor -> its slot
        self.slot_cursors: dict[int, list[int]] = {}  # newest consumed, per slot (checkpointed)
        self.slot_received: dict[int, list[int]] = {}  # newest received, per slot
        self.received_by_slot: collections.Counter[int] = collections.Counter()
        self.unsaid: collections.Counter[str] = collections.Counter()  # routine drops since `say_drops`

    def attach(self, actor: bytes, slot: int) -> None:
        """An actor's hello: its credit counts from 0 (what it sent before, under this
        identity, was dropped as without a handshake, and is sampled again)."""
        self.slots[actor] = slot
        self.consumed[actor] = 0
        self.credited.pop(actor, None)

    def receive(self, sender: bytes | None = None) -> None:
        self.received += 1
        if sender in self.slots:
            self.received_by_slot[self.slots[sender]] += 1

    def received_group(self, sender: bytes, cursor: list[int] | None) -> None:
        """A well-formed group from `sender` came in with `cursor`."""
        if cursor is not None:
            self._advance(self.slot_received, sender, cursor)

    def cursor_for(self, slot: int) -> list[int] | None:
        """Where an attaching actor of `slot` starts in the data: after the newest group of
        its slot that the learner holds (received; a checkpoint knows only the consumed
        ones), else after the newest consumed of any slot."""
        return self.slot_received.get(slot) or self.slot_cursors.get(slot) or self.data_cursor

    def reject_message(self) -> None:
        self.rejected += 1

    def drop(self, reason: str, sender: bytes, cursor: list[int] | None = None, group_id: str = "?") -> None:
        self.dropped[reason] += 1
        self.consume(sender, cursor)
        if reason in ROUTINE_DROPS:  # said once a step (`say_drops`): DAPO drops most groups
            self.unsaid[reason] += 1
            log.debug("dropped group %s: %s", group_id, reason)
        else:
            log.warning("dropped group %s: %s", group_id, reason)

    def say_drops(self, step: int) -> None:
        """One log line for the routine drops since the last call, if any."""
        if self.unsaid:
            counts = ", ".join(f"{reason} {n}" for reason, n in sorted(self.unsaid.items()))
            log.info("step %d: dropped %d groups (%s)", step, sum(self.unsaid.values()), counts)
            self.unsaid.clear()

    def train(self, senders_and_cursors: list[tuple[bytes, list[int] | None]]) -> None:
        self.trained += len(senders_and_cursors)
        for sender, cursor in senders_and_cursors:
            self.consume(sender, cursor)

    def consume(self, sender: bytes, cursor: list[int] | None) -> None:
        self.consumed[sender] += 1
        if cursor is None:
            return
        if self.data_cursor is None or list(cursor) > self.data_cursor:
            self.data_cursor = list(cursor)
        self._advance(self.slot_cursors, sender, cursor)

    def _advance(self, cursors: dict[int, list[int]], sender: bytes, cursor: list[int]) -> None:
        """Move the sender's slot's cursor in `cursors` forward to `cursor` (never back)."""
        slot = self.slots.get(sender)
        if slot is not None and list(cursor) > cursors.get(slot, []):
            cursors[slot] = list(cursor)

    def credits_due(self, actors: list[bytes]) -> list[tuple[bytes, int]]:
        """(actor, groups consumed) for each actor whose count changed since it was told;
        marks them told."""
        due = [(a, self.consumed[a]) for a in actors if self.credited.get(a) != self.consumed[a]]
        self.credited.update(due)
        return due

    def counts(self, queued: int) -> dict[str, Any]:
        """The group accounting in metrics, given how many groups the learner holds."""
        return {
            "groups_received": self.received,
            "groups_trained": self.trained,
            "groups_queued": queued,
            "groups_dropped": sum(self.dropped.values()),
            "dropped_reasons": dict(self.dropped),
            "messages_rejected": self.rejected,
            "groups_received_by_actor": {str(s): n for s, n in sorted(self.received_by_slot.items())},
        }

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps. Queued groups are not in it: a resumed actor rewinds to
        the data cursor and samples their prompts again, so they count as not received."""
        return {"data_cursor": self.data_cursor,
                "slot_cursors": {str(s): c for s, c in self.slot_cursors.items()},
                "counts": {"groups_trained": self.trained, "messages_rejected": self.rejected,
                           "groups_received": self.trained + sum(self.dropped.values())},
                "dropped": dict(self.dropped)}

    def restore(self, state: dict[str, Any]) -> None:
        """Take a checkpoint's book (`state()`) at start-up, in place: the intake and the
        rollout socket hold this ledger. The groups that were queued count as not received:
        a resumed actor samples their prompts again."""
        if self.received:
            raise RuntimeError("a ledger is restored before any group arrives")
        counts = state["counts"]
        self.received = counts["groups_received"]
        self.trained = counts["groups_trained"]
        self.rejected = counts.get("messages_rejected", 0)
        self.dropped.update(state["dropped"])
        self.data_cursor = state["data_cursor"]
        self.slot_cursors = {int(s): c for s, c in state.get("slot_cursors", {}).items()}

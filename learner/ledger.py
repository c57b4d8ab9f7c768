"""Where every rollout group is: the learner's book of what nothing may lose.

Every group received is trained on, dropped with a reason, or still queued:
`received == trained + dropped + queued` at every step (the queue lives with the learner,
which passes its length in). The ledger also holds what follows from that book: each
actor's credit (its groups consumed, trained or dropped, which lets it sample more) and
where each actor slot's data continues (`actor.count` actors share the data, each its own
part of the stream): a restarted actor after the groups of its slot the learner holds, a
resumed run after the consumed ones. Groups arrive in the order they finish, not the order
of the data, so that place is a cursor and the spans beyond it already covered
(`Progress`): the actor samples the holes again and skips the rest.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

log = logging.getLogger("learner")

# Drops an algorithm or the staleness bound makes as a matter of course: counted, and said
# once a step. Any other drop is said with its group.
ROUTINE_DROPS = ("filtered: equal rewards", "stale")


Cursor = list[int]  # [epoch, position] in the data stream (policy/data.py::PromptStream)


class Progress:
    """How much of one slot's data stream is covered: every prompt up to the cursor `upto`
    (None: the stream's start), and beyond it the prompts whose groups came early, as
    spans (the cursor before the prompt -> the cursor after it)."""

    def __init__(
        self, upto: Cursor | None = None, ahead: dict[tuple[int, ...], Cursor] | None = None
    ) -> None:
        self.upto = upto
        self.ahead = dict(ahead or {})

    def add(self, start: Cursor | None, end: Cursor) -> None:
        """The prompt between `start` and `end` is covered. A group without `start` comes
        from a peer that sends in data order: everything before its `end` is covered."""
        before = self.upto
        if start is None or list(start) == (self.upto or [0, 0]):  # None: the data's start
            if self.upto is None or list(end) > self.upto:
                self.upto = list(end)
        elif self.upto is None or list(end) > self.upto:
            self.ahead[tuple(start)] = list(end)
        while self.upto is not None and tuple(self.upto) in self.ahead:  # a hole filled
            self.upto = self.ahead.pop(tuple(self.upto))
        if self.upto != before and self.upto is not None:  # spans a jump passed (no `start`)
            self.ahead = {s: e for s, e in self.ahead.items() if e > self.upto}

    def skip(self) -> list[Cursor]:
        """The cursors just after the prompts covered beyond `upto` (the hello's `data_skip`)."""
        return sorted(self.ahead.values())

    def copy(self) -> Progress:
        return Progress(self.upto, self.ahead)


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
        self.slot_consumed: dict[int, Progress] = {}  # per slot (checkpointed)
        self.slot_received: dict[int, Progress] = {}  # per slot, since this learner started
        self.received_by_slot: collections.Counter[int] = collections.Counter()
        self.unsaid: collections.Counter[str] = collections.Counter()  # routine drops since `say_drops`

    def attach(self, actor: bytes, slot: int) -> None:
        """An actor's hello: its credit counts from 0 (what it sent before, under this
        identity, was dropped as without a handshake, and is sampled again)."""
        self.slots[actor] = slot
        self.consumed[actor] = 0
        self.credited.pop(actor, None)
        if slot not in self.slot_consumed:  # a slot never seen starts after the newest consumed of any
            self.slot_consumed[slot] = Progress(self.data_cursor)
        if slot not in self.slot_received:
            self.slot_received[slot] = self.slot_consumed[slot].copy()

    def receive(self, sender: bytes | None = None) -> None:
        self.received += 1
        if sender in self.slots:
            self.received_by_slot[self.slots[sender]] += 1

    def received_group(self, sender: bytes, cursor: Cursor | None, start: Cursor | None = None) -> None:
        """A well-formed group from `sender` came in for the prompt between `start` and `cursor`."""
        self._cover(self.slot_received, sender, cursor, start)

    def cursor_for(self, slot: int) -> tuple[Cursor | None, list[Cursor]]:
        """Where an attaching actor of `slot` continues in the data, and the prompts beyond
        it to skip: after the groups of its slot that the learner holds (received; a
        checkpoint knows only the consumed ones), else after the newest consumed of any slot."""
        for books in (self.slot_received, self.slot_consumed):
            if slot in books:
                return books[slot].upto, books[slot].skip()
        return self.data_cursor, []

    def reject_message(self) -> None:
        self.rejected += 1

    def drop(
        self,
        reason: str,
        sender: bytes,
        cursor: Cursor | None = None,
        group_id: str = "?",
        start: Cursor | None = None,
    ) -> None:
        self.dropped[reason] += 1
        self.consume(sender, cursor, start)
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

    def train(self, groups: list[tuple[bytes, Cursor | None, Cursor | None]]) -> None:
        """(sender, cursor, start) of each group trained on."""
        self.trained += len(groups)
        for sender, cursor, start in groups:
            self.consume(sender, cursor, start)

    def consume(self, sender: bytes, cursor: Cursor | None, start: Cursor | None = None) -> None:
        self.consumed[sender] += 1
        if cursor is not None and (self.data_cursor is None or list(cursor) > self.data_cursor):
            self.data_cursor = list(cursor)
        self._cover(self.slot_consumed, sender, cursor, start)

    def _cover(
        self, books: dict[int, Progress], sender: bytes, cursor: Cursor | None, start: Cursor | None
    ) -> None:
        slot = self.slots.get(sender)
        if slot is not None and cursor is not None:
            books.setdefault(slot, Progress()).add(start, cursor)

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
        # "slot_cursors": the name checkpoints had when they kept one cursor a slot. Every
        # slot goes in, one with nothing consumed too (null: the data's start), or a resumed
        # run would start it after another slot's newest.
        return {
            "data_cursor": self.data_cursor,
            "slot_cursors": {str(s): p.upto for s, p in self.slot_consumed.items()},
            "slot_ahead": {
                str(s): [[list(a), e] for a, e in p.ahead.items()]
                for s, p in self.slot_consumed.items()
                if p.ahead
            },
            "counts": {
                "groups_trained": self.trained,
                "messages_rejected": self.rejected,
                "groups_received": self.trained + sum(self.dropped.values()),
            },
            "dropped": dict(self.dropped),
        }

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
        ahead = state.get("slot_ahead", {})
        self.slot_consumed = {
            int(s): Progress(state.get("slot_cursors", {}).get(s), {tuple(a): e for a, e in ahead.get(s, [])})
            for s in {*state.get("slot_cursors", {}), *ahead}
        }

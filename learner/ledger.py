"""Where every rollout group is: the learner's book of what nothing may lose.

Every group received is trained on, dropped with a reason, or still queued:
`received == trained + dropped + queued` at every step (the queue lives with the learner,
which passes its length in). The ledger also holds what follows from that book: each
actor's credit (its groups consumed, trained or dropped, which lets it sample more) and
the data cursor a resumed run continues from (just after the newest consumed prompt).
"""

from __future__ import annotations

import collections
import logging
from typing import Any

log = logging.getLogger("learner")


class Ledger:
    def __init__(self) -> None:
        self.received = 0
        self.trained = 0
        self.dropped: collections.Counter[str] = collections.Counter()
        self.rejected = 0  # messages that failed validation (not groups)
        self.consumed: collections.Counter[bytes] = collections.Counter()  # per actor
        self.credited: dict[bytes, int] = {}  # the consumed count each actor was last told
        self.data_cursor: list[int] | None = None

    def receive(self) -> None:
        self.received += 1

    def reject_message(self) -> None:
        self.rejected += 1

    def drop(self, reason: str, sender: bytes, cursor: list[int] | None = None, group_id: str = "?") -> None:
        self.dropped[reason] += 1
        self.consume(sender, cursor)
        log.warning("dropped group %s: %s", group_id, reason)

    def train(self, senders_and_cursors: list[tuple[bytes, list[int] | None]]) -> None:
        self.trained += len(senders_and_cursors)
        for sender, cursor in senders_and_cursors:
            self.consume(sender, cursor)

    def consume(self, sender: bytes, cursor: list[int] | None) -> None:
        self.consumed[sender] += 1
        if cursor is not None and (self.data_cursor is None or list(cursor) > self.data_cursor):
            self.data_cursor = list(cursor)

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
        }

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps. Queued groups are not in it: a resumed actor rewinds to
        the data cursor and samples their prompts again, so they count as not received."""
        return {"data_cursor": self.data_cursor,
                "counts": {"groups_trained": self.trained, "messages_rejected": self.rejected,
                           "groups_received": self.trained + sum(self.dropped.values())},
                "dropped": dict(self.dropped)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Ledger:
        ledger = cls()
        counts = state["counts"]
        ledger.received = counts["groups_received"]
        ledger.trained = counts["groups_trained"]
        ledger.rejected = counts.get("messages_rejected", 0)
        ledger.dropped.update(state["dropped"])
        ledger.data_cursor = state["data_cursor"]
        return ledger

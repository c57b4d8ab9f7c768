"""Groups on their way from the rollout socket to a batch: scored by the reward
functions (in-process at once, external workers when they answer), kept or filtered by
the algorithm (DAPO drops equal-reward groups), queued, and taken `batch_size` at a time,
dropping those too stale to train on: as they come, `batch_size` in all, while the
learner builds a batch's gradient group by group. With max_staleness >= 1 versions differ:
groups that can join no later batch go first, and younger ones leave room for those the
actors say they still sample (their `in_flight`). Every group leaves through the ledger.

The queue keeps the order the groups arrived in, whatever order their rewards come back
in (several reward workers): a batch's rows, and so its update, do not depend on which
worker was quicker (to the last bit with `train.stream_groups = false`; learning the
groups as they come cuts them into takes as the timing has it, the same to float rounding).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable
from typing import NoReturn

import numpy as np

from learner.groups import Group
from learner.ledger import Ledger
from rewards.functions import RewardError
from rewards.scorer import Scored, Scorer


class Intake:
    def __init__(self, scorer: Scorer, keep_group: Callable[[np.ndarray], bool], ledger: Ledger) -> None:
        self.scorer = scorer
        self.keep_group = keep_group
        self.ledger = ledger
        self.unscored: list[Group] = []  # received, not yet sent to the rewards
        self.awaiting: dict[str, Group] = {}  # waiting for an external reward
        self.queue: list[tuple[int, Group]] = []  # scored and kept, by arrival
        self.taken: list[tuple[int, Group]] = []  # the batch being built and trained
        self.arrival: dict[int, int] = {}  # id(group) -> its place in the order of arrival
        self.counter = itertools.count()

    @property
    def queued(self) -> int:
        """Groups received and neither trained nor dropped yet (the batch being built's too)."""
        return len(self.queue) + len(self.taken) + len(self.unscored) + len(self.awaiting)

    def add(self, groups: list[Group]) -> None:
        for g in groups:
            self.arrival[id(g)] = next(self.counter)
        self.unscored += groups

    def score(self) -> None:
        """Send new groups to the rewards and take in those whose rewards are complete.
        Raises RewardError (the group counted as dropped) when a reward function fails."""
        while self.unscored:
            g = self.unscored.pop(0)
            key = f"{g.sender.hex()}/{g.group_id}"
            try:
                scored = self.scorer.submit(
                    key, g.prompt, g.texts, g.completion_ids, g.columns, g.turns, g.env_rewards
                )
            except RewardError as e:
                self.reward_failed(g, e)  # raises: the run ends
            if scored is None:
                self.awaiting[key] = g
            else:
                self.accept(g, scored)
        self.take(*self.scorer.poll(0))

    def take(self, done: list[Scored], failed: list[tuple[str, str]], errors: list[tuple[str, str]]) -> None:
        """Groups whose external rewards came back (or failed), as `Scorer.poll` gives them."""
        for scored in done:
            self.accept(self.awaiting.pop(scored.key), scored)
        for key, reason in failed:
            self.drop(self.awaiting.pop(key), reason)
        for key, error in errors:
            self.reward_failed(self.awaiting.pop(key), RewardError(error))

    def next_groups(
        self, policy_version: int, most: int, least: int, max_staleness: int, reserve: int = 0
    ) -> list[Group]:
        """Up to `most` groups to train policy `policy_version` on, dropping those more
        than `max_staleness` versions old; none until `least` can be taken. Groups in their
        last version (`policy_version - max_staleness`) go first, then the younger ones by
        arrival: a long group that can join no later batch is not crowded out of this one by
        a younger group that can (under long-tailed lengths the younger, short groups of the
        next cohort often arrive first). `reserve`: groups in their last version that the
        actors are still sampling; the younger ones leave them room, and room for those of
        the last version still being scored. Returned in their
        order of arrival, they stay taken, part of the batch being built, until it is
        trained (`settle`) or put back."""
        for entry in [e for e in self.queue if policy_version - e[1].policy_version > max_staleness]:
            self.queue.remove(entry)
            self.drop(entry[1], "stale")
        last = policy_version - max_staleness
        scoring = [*self.unscored, *self.awaiting.values()]  # here, their rewards not yet back
        reserve += sum(g.policy_version == last for g in scoring)
        oldest_first = sorted(self.queue, key=lambda entry: (entry[1].policy_version, entry[0]))
        ending = [e for e in oldest_first if e[1].policy_version <= last][:most]
        room = max(most - len(ending) - reserve, 0)
        got = ending + [e for e in oldest_first if e[1].policy_version > last][:room]
        if len(got) < max(least, 1):
            return []
        got.sort(key=lambda entry: entry[0])
        chosen = {id(e) for e in got}
        self.queue = [e for e in self.queue if id(e) not in chosen]
        self.taken += got
        return [g for _, g in got]

    def next_ahead(self, oldest: int) -> Group | None:
        """While a batch is begun and waits for its other groups: a group a later take can
        train (of version `oldest` or younger) whose reference logprobs are not taken yet,
        the queued ones first, by arrival, then those whose rewards are awaited
        (learner/ahead.py::reference_ahead). None between batches: then the queued
        groups are the next batch's, taken at once."""
        if not self.taken:
            return None
        for g in [*(g for _, g in self.queue), *self.awaiting.values()]:
            if g.reference is None and g.policy_version >= oldest:
                return g
        return None

    def settle(self) -> None:
        """The batch taken so far is trained: its groups are the ledger's now."""
        self.taken = []

    def put_back(self) -> None:
        """The batch taken so far was not trained (a stop in the middle of it): its groups
        are queued again, in their order of arrival."""
        self.queue = sorted(self.taken + self.queue, key=lambda entry: entry[0])
        self.taken = []

    def accept(self, g: Group, scored: Scored) -> None:
        if self.keep_group(scored.total):
            g.rewards, g.rewards_by_function = scored.total, scored.by_function
            bisect.insort(self.queue, (self.arrival.pop(id(g)), g), key=lambda entry: entry[0])
        else:
            self.drop(g, "filtered: equal rewards")

    def reward_failed(self, g: Group, error: RewardError) -> NoReturn:
        """A reward function that raises (or returns garbage) on a group will do so again:
        count the group as dropped and end the run, naming the function and the row."""
        self.drop(g, "reward error")
        where = f"data row {g.row}" if g.row is not None else f"group {g.group_id}"
        raise RewardError(f"{error} (on {where}, prompt {str(g.prompt)[:80]!r})") from error

    def drop(self, g: Group, reason: str) -> None:
        self.arrival.pop(id(g), None)
        self.ledger.drop(reason, g.sender, g.cursor, g.group_id, g.start_cursor)

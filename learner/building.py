"""The batch being built as its groups arrive: each group's rows prepared (old-policy and
reference logprobs) and through forward and backward at once, on every learner rank's
share, while the batch's other groups are still being sampled. The learner's step
(learner/service.py) takes its optimizer steps once the batch is complete.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from learner.advantages import Advantages, advantages
from learner.algorithms import Algorithm
from learner.batching import TrainRow, batch_mask, make_batch
from learner.groups import Group
from learner.ranks import Ranks, RankShare
from learner.trainer import Trainer
from runtime import spans
from runtime.config import Config


def streams(cfg: Config, algorithm: Algorithm, ranks: int) -> bool:
    """Whether the learner learns a batch's groups as they arrive: asked for
    (`train.stream_groups`), each group's advantages its own (Algorithm.group_local), and
    every learner rank sure of a row in every take (a group's `group_size` rows, or more,
    shared among the ranks). With more ranks than that a small take would leave some rank
    with nothing to add to the step; the whole batch has a row for each (config checks).
    A loss's claim to be group_local was checked before the model loaded
    (learner/ranks.py::check_loss)."""
    return cfg.train.stream_groups and algorithm.group_local and ranks <= cfg.sampling.group_size


@dataclass
class Building:
    """A batch's groups so far, this rank's share of their rows (with the first step's
    gradient as it grows), and the learner's time on it."""

    share: RankShare
    groups: list[Group] = field(default_factory=list)
    busy_s: float = 0.0
    started: float | None = None  # time.time() of its first take

    @classmethod
    def new(cls, trainer: Trainer, ranks: Ranks) -> Building:
        return cls(RankShare(trainer, ranks))

    def take(self, groups: list[Group], cfg: Config, pad_id: int) -> None:
        """These groups' rows into the batch: sent to the other ranks, and this rank's
        share through its old-policy and reference passes and the first step's forward and
        backward. A group's advantages are its own rewards' (Algorithm.group_local), so
        they are the same whether it comes alone or with the whole batch.

        Groups whose reference logprobs were taken ahead (learner/ahead.py) go in a
        take of their own: in a micro-batch with other rows they would be run again."""
        ahead = [g for g in groups if g.reference is not None]
        for part in (ahead, [g for g in groups if g.reference is None]):
            if part:
                self._take(part, cfg, pad_id)
        self.groups += groups

    def _take(self, groups: list[Group], cfg: Config, pad_id: int) -> None:
        self.started = self.started or time.time()
        with spans.span("learn groups", groups=len(groups)):
            t0 = time.perf_counter()  # inside: the span's time, not its writing
            samples = [sample for g in groups for sample in g.samples()]
            batch = make_batch(samples, pad_id)
            a = advantages(groups, samples, cfg, self.share.trainer.algorithm)
            self.share.ranks.share_rows(batch, a.trained)
            self.share.take(batch, a.trained)
            self.busy_s += time.perf_counter() - t0

    def complete(self, cfg: Config) -> tuple[list[TrainRow], Advantages, float]:
        """The whole batch's rows, advantages (for its metrics) and loss normaliser."""
        samples = [sample for g in self.groups for sample in g.samples()]
        algorithm = self.share.trainer.algorithm
        return (
            samples,
            advantages(self.groups, samples, cfg, algorithm),
            algorithm.normalizer(batch_mask(samples)),
        )

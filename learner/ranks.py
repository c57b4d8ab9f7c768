"""Data-parallel learner ranks on MLX's own distributed engine (`mlx.core.distributed`).

Started by `mlx.launch` around `python -m learner` (the ring backend over TCP or
Thunderbolt; JACCL and MPI alike), K learner processes train one adapter. Rank 0 is the
learner the rest of the project knows: it owns the sockets, the ledger, the metrics, the
published weights and the checkpoints. The other ranks own a model and an optimizer and
nothing else: rank 0 sends them the rows of each batch as its groups arrive (tokens, masks,
behavior logprobs, advantages), every rank takes its share of them through forward and
backward at once, and once the batch is complete every optimizer step adds the ranks'
gradients (`all_sum`) before the same clip and update on every rank. Each row's loss is
divided by the *whole* batch's normaliser (RankShare), so the summed gradient is the
one-rank gradient of the whole batch, to float rounding.

Everything between ranks is an MLX collective; "rank 0 sends" is an `all_sum` to which
the others add zeros. Before each collective rank 0 says what follows (Command): rows,
a step, or the end. A stop on rank 0 between two of them leaves no rank waiting in one:
the others end at the STOP that rank 0's close sends.
"""

from __future__ import annotations

import enum
import logging
import os
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from learner.algorithms import check_group_local, load_algorithm
from learner.batching import Batch, Prepared
from learner.trainer import Gradient, Trainer, combine_stats
from policy.memory import apply_memory_share
from policy.model import dequantizes, load_policy
from runtime import lifecycle, spans
from runtime.config import Config, read_run_config
from runtime.heartbeat import learner_name, start_heartbeat

log = logging.getLogger("learner")


class Command(enum.IntEnum):
    """What rank 0 tells the other ranks before each collective they take part in."""

    STOP = 0  # the run is over: end
    GO = 1  # the batch is complete: an optimizer step on it (its normaliser follows)
    COUNT = 2  # a tree of this many arrays follows (start-up)
    ROWS = 3  # rows of the batch being built follow (their number, length, advantages' rank)


@dataclass
class Ranks:
    """This process's place among the learner ranks (`group` None: a learner alone)."""

    group: mx.distributed.Group | None = None

    @classmethod
    def join(cls) -> Ranks:
        """The ranks `mlx.launch` started this process among; alone when it did not."""
        if not mx.distributed.is_available():
            return cls()
        group = mx.distributed.init()
        return cls(group if group.size() > 1 else None)

    @property
    def rank(self) -> int:
        return 0 if self.group is None else self.group.rank()

    @property
    def size(self) -> int:
        return 1 if self.group is None else self.group.size()

    def all_sum(self, tree):
        """Every rank's `tree`, added up (only among several ranks)."""
        return tree_map(lambda x: mx.distributed.all_sum(x, group=self.group), tree)

    def from_rank0(self, tree):
        """Rank 0's `tree` on every rank (the others pass one of the same shapes)."""
        if self.group is None:
            return tree
        out = self.all_sum(tree if self.rank == 0 else tree_map(mx.zeros_like, tree))
        mx.eval(out)
        return out

    def tree_from_rank0(self, tree: dict) -> dict:
        """Rank 0's nested dict of arrays on every rank, leaf by leaf in the order of their
        sorted names (a tree loaded from a checkpoint lists them in another order than a
        freshly initialised one); the key sets must match."""
        leaves = dict(tree_flatten(tree))
        names = sorted(leaves)
        if self.broadcast(Command.COUNT, len(names))[1] != len(names):
            raise RuntimeError(
                f"rank {self.rank} holds {len(names)} arrays where rank 0 holds another "
                "number: the ranks run different models or LoRA configs"
            )
        return tree_unflatten(list(zip(names, self.from_rank0([leaves[n] for n in names]))))

    def broadcast(
        self, command: Command = Command.STOP, a: int = 0, b: int = 0, c: int = 0
    ) -> tuple[Command, int, int, int]:
        """Rank 0's command and its three numbers (a batch's rows, length and advantages'
        rank, or a count) on every rank; the others pass nothing."""
        got = self.from_rank0(mx.array([command, a, b, c], dtype=mx.int32))
        code, a, b, c = (int(v) for v in np.array(got))
        return Command(code), a, b, c

    def share_rows(self, batch: Batch, advantages: np.ndarray) -> None:
        """Rank 0: send rows of the batch being built (their advantages [B], or [B, T] per
        token laid out as their mask) to the other ranks."""
        if self.group is not None:
            rows, length = batch.tokens.shape
            self.broadcast(Command.ROWS, rows, length, advantages.ndim)
            adv = mx.array(advantages.astype(np.float32))
            lengths = [mx.array(batch.lengths, mx.int32), mx.array(batch.prompt_lengths, mx.int32)]
            self.from_rank0([batch.tokens, batch.mask, batch.behavior, adv, *lengths])

    def receive_rows(self, rows: int, length: int, adv_ndim: int) -> tuple[Batch, np.ndarray]:
        """A rank above 0, told ROWS: the rows rank 0 sends, and their advantages."""
        tokens, mask, behavior, adv, lengths, prompt_lengths = self.from_rank0(
            [
                mx.zeros((rows, length), mx.int32),
                mx.zeros((rows, length - 1)),
                mx.zeros((rows, length - 1)),
                mx.zeros((rows,) if adv_ndim == 1 else (rows, length - 1)),
                mx.zeros((rows,), mx.int32),
                mx.zeros((rows,), mx.int32),
            ]
        )
        return Batch(tokens, mask, behavior, np.array(lengths), np.array(prompt_lengths)), np.array(adv)

    def share_norm(self, norm: float = 0.0) -> float:
        """Rank 0's loss normaliser of the batch on every rank (rank 0 passes it), in the
        float32 every rank divides by alike."""
        return float(np.array(self.from_rank0(mx.array([norm], dtype=mx.float32)))[0])

    def combine(
        self, stats: dict[str, float], weight: tuple[float, float], per_completion: frozenset[str]
    ) -> dict[str, float]:
        """Every rank's metrics of a step as the whole batch's (learner.trainer.combine_stats);
        `weight`: this rank's completion tokens and completions."""
        if self.group is None:
            return stats
        keys = sorted(stats)
        mine = mx.array([[*weight, *(stats[k] for k in keys)]], dtype=mx.float32)
        every = np.array(mx.distributed.all_gather(mine, group=self.group))
        return combine_stats(
            [({k: float(v) for k, v in zip(keys, row[2:])}, (float(row[0]), float(row[1]))) for row in every],
            per_completion,
        )

    def sync_state(self, trainer: Trainer) -> None:
        """Rank 0's adapter weights and optimizer state on every rank: at the start (after
        rank 0 resumed from a checkpoint, if it did)."""
        if self.group is None:
            return
        model, optimizer = trainer.model, trainer.optimizer
        model.update(self.tree_from_rank0(model.trainable_parameters()))
        optimizer.init(model.trainable_parameters())  # adds what is missing, keeps what is loaded
        optimizer.state = self.tree_from_rank0(optimizer.state)
        mx.eval(model.parameters(), optimizer.state)
        log.info("rank %d of %d: adapter weights and optimizer state as rank 0's", self.rank, self.size)


def rows_of_rank(n: int, rank: int, size: int, take: int) -> np.ndarray:
    """Which of a take's `n` rows a rank trains: a contiguous share (a group's rows stay
    together, so their prompt is shared), every row on one rank. Which ranks get a row
    more turns with `take`, the take's number in its batch (the same on every rank), so
    takes smaller than the ranks spread over them."""
    place = (rank + take) % size
    return np.arange(place * n // size, (place + 1) * n // size)


class RankShare:
    """This rank's rows of a batch, taken as the batch's groups arrive (`take`), and its
    optimizer steps once the batch is complete (`step`).

    The first step's gradient is built as the rows come, each micro-batch's loss summed
    unnormalised, and divided by the whole batch's normaliser when the batch is complete:
    the normaliser of a loss (completions, tokens, Dr. GRPO's constant) is known only then,
    and dividing a sum once is the same as dividing each term. Later iterations
    (num_iterations > 1) go over the kept micro-batches again, the normaliser known."""

    def __init__(self, trainer: Trainer, ranks: Ranks) -> None:
        self.trainer, self.ranks = trainer, ranks
        self.parts: list[tuple[Prepared, np.ndarray]] = []  # this rank's rows, as taken
        self.first = Gradient()  # the first step's, unnormalised
        self.takes, self.steps = 0, 0
        self.stats: dict[str, float] = {}  # the old-policy pass's (this rank's), once complete

    def take(self, batch: Batch, advantages: np.ndarray) -> None:
        """Some rows of the batch (every rank gets the same): this rank's share of them
        (rows_of_rank) prepared and, for the first step, through forward and backward."""
        rows = rows_of_rank(batch.tokens.shape[0], self.ranks.rank, self.ranks.size, self.takes)
        self.takes += 1
        if len(rows) == 0:
            return
        with spans.span("old and reference logprobs", rows=len(rows)) as args:
            prepared = self.trainer.prepare(batch.take(rows), norm=1.0)
            args["ahead"] = sum(m.ref_ahead for m in prepared.micro)  # micro-batches that skipped it
        self.trainer.accumulate(self.first, prepared, advantages[rows], 1.0)
        self.parts.append((prepared, advantages[rows]))

    def step(self, norm: float) -> dict[str, float]:
        """One optimizer step on every rank, the batch complete and `norm` its loss
        normaliser; the whole batch's metrics (the old-policy pass's too)."""
        if self.steps == 0:
            gradient = self.first
            gradient.normalize(norm)
            self.stats = self.trainer.prepared_stats([p for p, _ in self.parts])
        else:
            gradient = Gradient()
            for prepared, advantages in self.parts:
                self.trainer.accumulate(gradient, prepared, advantages, norm)
        self.steps += 1
        stats = self.trainer.update(gradient, self.ranks.all_sum if self.ranks.size > 1 else None)
        return self.ranks.combine({**self.stats, **stats}, self.weight, self.trainer.per_completion)

    @property
    def weight(self) -> tuple[float, float]:
        """This rank's completion tokens and completions: what its metrics average over."""
        return sum(p.weight[0] for p, _ in self.parts), sum(p.weight[1] for p, _ in self.parts)


def follow(trainer: Trainer, ranks: Ranks) -> None:
    """A rank above 0: take its share of the rows rank 0 sends and step when it says the
    batch is complete, until it says stop. Rows after a step begin the next batch."""
    ranks.sync_state(trainer)
    share = RankShare(trainer, ranks)
    while (said := ranks.broadcast())[0] != Command.STOP:
        command, rows, length, adv_ndim = said
        if command == Command.ROWS:
            share = share if share.steps == 0 else RankShare(trainer, ranks)
            share.take(*ranks.receive_rows(rows, length, adv_ndim))
        elif command == Command.GO:
            share.step(ranks.share_norm())


def check_loss(cfg: Config) -> None:
    """The run's loss, built as the Trainer will build it: a user's fails here, before the
    model loads, on its import, its settings, or its claim that each group's advantages
    are its own, which learning groups as they arrive relies on (check_group_local)."""
    algorithm = load_algorithm(cfg.algorithm, cfg.max_completion_tokens, cfg.reward.search_path)
    if cfg.train.stream_groups and algorithm.group_local:
        check_group_local(algorithm, cfg.algorithm.name, cfg.sampling.group_size)


def load_trainer(cfg: Config) -> tuple[nn.Module, Any, dict, Trainer]:
    """The policy with its adapters, ready to train, its tokenizer, its adapter config, and
    its Trainer: the same on every rank."""
    mx.random.seed(cfg.train.seed)
    check_loss(cfg)  # a user's loss fails before the model loads
    log.info("loading %s", cfg.model.path)
    model, tokenizer, adapter_config = load_policy(
        cfg.model.path, cfg.lora, dequantize=dequantizes(cfg.model.dequantize_on_cpu)
    )
    model.train()
    if cfg.train.grad_checkpoint:
        from mlx_lm.tuner.trainer import grad_checkpoint

        grad_checkpoint(model.layers[0])
    trainer = Trainer(
        model,
        cfg.algorithm,
        cfg.train,
        cfg.sampling,
        cfg.max_completion_tokens,
        search_path=cfg.reward.search_path,
    )
    return model, tokenizer, adapter_config, trainer


def follower_main(run_dir: str, ranks: Ranks) -> int:
    """A learner rank above 0: no sockets, files or checkpoints; only its rows of each batch."""
    signals = lifecycle.StopSignals().install()
    lifecycle.watch_lifeline()
    start_heartbeat(run_dir, learner_name(ranks.rank))
    apply_memory_share()
    _, _, _, trainer = load_trainer(read_run_config(run_dir))
    log.info(
        "learner rank %d of %d (pid %d): training its rows of rank 0's batches",
        ranks.rank,
        ranks.size,
        os.getpid(),
    )
    follow(trainer, ranks)
    log.info("learner rank %d: rank 0 says stop", ranks.rank)
    return signals.exit_code()

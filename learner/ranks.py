"""Data-parallel learner ranks on MLX's own distributed engine (`mlx.core.distributed`).

Started by `mlx.launch` around `python -m learner` (the ring backend over TCP or
Thunderbolt; JACCL and MPI alike), K learner processes train one adapter. Rank 0 is the
learner the rest of the project knows: it owns the sockets, the ledger, the metrics, the
published weights and the checkpoints. The other ranks own a model and an optimizer and
nothing else: rank 0 sends them each batch (tokens, masks, behavior logprobs, advantages),
every rank takes its rows, and every optimizer step adds the ranks' gradients (`all_sum`)
before the same clip and update on every rank. Each row's loss is divided by the *whole*
batch's normaliser (as micro-batches are, `learner.trainer`), so the summed gradient is the
one-rank gradient of the whole batch, to float rounding.

Everything between ranks is an MLX collective; "rank 0 sends" is an `all_sum` to which
the others add zeros. Before each batch and each optimizer step rank 0 says whether one
follows, so a stop between steps never leaves a rank waiting in a collective.
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

from learner.algorithms import algorithm_class
from learner.batching import Batch, Prepared
from learner.trainer import Trainer, combine_stats
from policy.memory import apply_memory_share
from policy.model import dequantizes, load_policy
from runtime import lifecycle
from runtime.config import Config, read_run_config
from runtime.heartbeat import learner_name, start_heartbeat

log = logging.getLogger("learner")


class Command(enum.IntEnum):
    """What rank 0 tells the other ranks before each collective they take part in."""

    STOP = 0  # no more batches (or iterations): end
    GO = 1  # a batch follows (with its rows and length), or the next iteration of one
    COUNT = 2  # a tree of this many arrays follows (start-up)


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

    def share_batch(self, batch: Batch, advantages: np.ndarray) -> None:
        """Rank 0: send the batch to the other ranks (advantages [B], or [B, T] per token
        laid out as the batch's mask)."""
        if self.group is not None:
            rows, length = batch.tokens.shape
            self.broadcast(Command.GO, rows, length, advantages.ndim)
            adv = mx.array(advantages.astype(np.float32))
            lengths = [mx.array(batch.lengths, mx.int32), mx.array(batch.prompt_lengths, mx.int32)]
            self.from_rank0([batch.tokens, batch.mask, batch.behavior, adv, *lengths])

    def receive_batch(self) -> tuple[Batch, np.ndarray] | None:
        """A rank above 0: the next batch from rank 0, or None when it says stop."""
        command, rows, length, adv_ndim = self.broadcast()
        if command == Command.STOP:
            return None
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


class RankShare:
    """This rank's rows of a batch, ready for its optimizer steps."""

    def __init__(self, trainer: Trainer, ranks: Ranks, batch: Batch, advantages: np.ndarray) -> None:
        """`advantages`: [B], or [B, T] per token laid out as the batch's mask: its rows
        are this rank's as the batch's are (the part's batch may be shorter: a row's
        positions keep their columns)."""
        n = batch.tokens.shape[0]
        rows = np.arange(ranks.rank * n // ranks.size, (ranks.rank + 1) * n // ranks.size)
        self.trainer, self.ranks = trainer, ranks
        norm = trainer.algorithm.normalizer(np.array(batch.mask))  # the whole batch's
        self.prepared: Prepared = trainer.prepare(batch.take(rows), norm)
        self.advantages = advantages[rows]
        self.stats = self.combine(self.prepared.stats)  # the whole batch's

    def step(self) -> dict[str, float]:
        """One optimizer step on every rank; the whole batch's metrics."""
        all_sum = self.ranks.all_sum if self.ranks.size > 1 else None
        return self.combine(self.trainer.step(self.prepared, self.advantages, all_sum))

    def combine(self, stats: dict[str, float]) -> dict[str, float]:
        return self.ranks.combine(stats, self.prepared.weight, self.trainer.per_completion)


def follow(trainer: Trainer, ranks: Ranks) -> None:
    """A rank above 0: train on its rows of every batch rank 0 sends, until it says stop."""
    ranks.sync_state(trainer)
    while (got := ranks.receive_batch()) is not None:
        part = RankShare(trainer, ranks, *got)
        for _ in range(trainer.num_iterations):
            if ranks.broadcast()[0] == Command.STOP:
                break
            part.step()


def load_trainer(cfg: Config) -> tuple[nn.Module, Any, dict, Trainer]:
    """The policy with its adapters, ready to train, its tokenizer, its adapter config, and
    its Trainer: the same on every rank."""
    mx.random.seed(cfg.train.seed)
    algorithm_class(cfg.algorithm.name, cfg.reward.search_path)  # a user's loss fails before the model loads
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

"""What the learner keeps in the run directory: its checkpoints, and the files that say how
the run goes (status.json for `up`, metrics.jsonl and the `log.report_to` backends,
completions.jsonl).

They go together on resume: the learner takes the newest checkpoint back, and the metrics
and completions files drop the lines of the steps after it, so that a step never appears
twice. Kept apart from the learner's loop (learner/service.py), which says when.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from learner.checkpoint import load_checkpoint, save_checkpoint
from learner.groups import Group
from learner.intake import Intake
from learner.ledger import Ledger
from learner.metrics import CompletionsFile, MetricsFile, StatusFile, plan_shares
from learner.reporters import open_reporters
from learner.rollout_socket import MB, RolloutSocket
from learner.trainer import Trainer
from rewards.scorer import Scorer
from runtime import spans
from runtime.config import Config
from runtime.rundir import Phase, latest_checkpoint

log = logging.getLogger("learner")


class Checkpoints:
    """A learner's checkpoints (learner/checkpoint.py): the adapters and the optimizer, with
    the step, the ledger's book, the reward workers' counters and the config. One is
    written for a step at most once; the newest is taken back on resume."""

    def __init__(
        self,
        run_dir: Path,
        cfg: Config,
        trainer: Trainer,
        adapter_config: dict,
        ledger: Ledger,
        scorer: Scorer,
    ) -> None:
        self.run_dir, self.cfg, self.trainer, self.adapter_config = run_dir, cfg, trainer, adapter_config
        self.ledger, self.scorer = ledger, scorer
        self.step: int | None = None  # the step of the newest checkpoint written or loaded
        self.num_tokens = 0  # the tokens trained on up to it

    def resume(self) -> None:
        """Take the newest checkpoint back, if the run has one: the adapters, the optimizer,
        the ledger's book and the reward counters (and its step and `num_tokens`)."""
        path = latest_checkpoint(self.run_dir)
        if path is None:
            log.info("no checkpoint to resume from; starting at step 0")
            return
        state = load_checkpoint(path, self.trainer.model, self.trainer.optimizer)
        self.step, self.num_tokens = state["step"], state.get("num_tokens", 0)
        self.ledger.restore(state)
        self.scorer.restore_stats(state.get("reward_stats", {}))
        log.info("resumed from %s: step %d, adapters %s", path.name, self.step, state["adapters_digest"])

    def write(self, step: int, num_tokens: int) -> None:
        """The checkpoint of `step`, unless it is the newest already (the last step's, or
        one that nothing followed)."""
        if self.step == step:
            return
        state = {
            "step": step,
            "version": step,
            "num_tokens": num_tokens,
            **self.ledger.state(),
            "reward_stats": self.scorer.worker_stats(),
            "config": self.cfg.to_dict(),
        }
        with spans.span("checkpoint", step=step):
            path = save_checkpoint(
                self.run_dir,
                self.trainer.model,
                self.trainer.optimizer,
                self.adapter_config,
                state,
                self.cfg.train.keep_checkpoints,
            )
        self.step, self.num_tokens = step, num_tokens
        log.info("wrote checkpoint %s (pid %d)", path.name, os.getpid())


class Reports:
    """What the learner says as the run goes: status.json (its phase, for `up`), a
    metrics line for each optimizer step and evaluation (metrics.jsonl and the
    `log.report_to` backends), and the completions of some batches (completions.jsonl,
    when `log.completions_every` asks). The group counts and the phase come from the
    sockets and the intake."""

    def __init__(
        self,
        run_dir: Path,
        cfg: Config,
        resumed_at: int | None,
        scorer: Scorer,
        intake: Intake,
        rollouts: RolloutSocket,
    ) -> None:
        """`resumed_at`: the step a resumed learner starts at (later lines are dropped)."""
        self.steps, self.scorer, self.intake, self.rollouts = cfg.train.steps, scorer, intake, rollouts
        self.status = StatusFile(run_dir / "status.json")
        self.metrics = MetricsFile(run_dir / "metrics.jsonl", resumed_at, open_reporters(run_dir, cfg))
        log_cfg = cfg.log
        self.completions = (
            CompletionsFile(
                run_dir / "completions.jsonl",
                log_cfg.completions_every,
                log_cfg.completions_groups,
                resumed_at,
                log_cfg.completions_tokens,
            )
            if log_cfg.completions_every
            else None
        )
        self.shares = plan_shares(run_dir)  # the memory plan's, in every step's line
        self.status_at = 0.0  # when the phase was last written

    def counts(self) -> dict:
        return {**self.intake.ledger.counts(self.intake.queued), **self.scorer.worker_stats()}

    def phase(self) -> Phase:
        if not self.rollouts.actors:
            return Phase.WAITING_FOR_ACTOR
        if self.scorer.waiting_for_workers:
            return Phase.WAITING_FOR_REWARD_WORKER
        return Phase.TRAINING

    def write_phase(self, step: int, at_once: bool) -> None:
        """The phase the sockets say, twice a second at most unless `at_once`."""
        if time.time() - self.status_at > 0.5 or at_once:
            self.write_status(self.phase(), step)
            self.status_at = time.time()

    def write_status(self, phase: Phase, step: int, **extra: object) -> None:
        """status.json: the phase (and `extra`, e.g. an evaluation's progress) for `up`."""
        self.status.write(
            {
                "phase": phase,
                "step": step,
                "steps": self.steps,
                "actors": len(self.rollouts.actors),
                "time": time.time(),
                **self.counts(),
                **extra,
            }
        )

    def write_batch(
        self, first_step: int, iterations: int, groups: list[Group], advantages: np.ndarray
    ) -> None:
        """The completions of a batch that trains `first_step` and the steps after it."""
        if self.completions is not None:
            self.completions.write_batch(first_step, iterations, groups, advantages, self.scorer.metric_name)

    def write_step(self, step: int, iteration: int, metrics: dict[str, Any], step_s: float) -> None:
        """An optimizer step's line: its batch's `metrics`, the weights' sync, the memory."""
        self.metrics.write(
            {
                "step": step,
                "policy_version": step,
                "iteration": iteration,
                **metrics,
                "step_s": step_s,
                **self.rollouts.weight_sync,
                "learner_peak_mb": mx.get_peak_memory() / MB,
                **self.shares,
                **self.counts(),
            }
        )

    def close(self) -> None:
        self.metrics.close()
        if self.completions is not None:
            self.completions.close()

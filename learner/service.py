"""The learner process: intake -> rewards -> advantages -> step -> publish weights.

Its loop (`run`) reads as what it does: take in the rollouts that arrived (the rollout
socket), score them and queue those kept (the intake), train on every `batch_size` of
them (`learn`: `num_iterations` optimizer steps, each published at once and written to
the metrics), checkpoint every `checkpoint_every` steps, and keep each actor's credit
flowing. The ledger knows where every group is: trained, dropped with a reason, or queued.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path
from typing import cast

import mlx.core as mx
import numpy as np

import protocol
import transport
from learner.batching import make_batch
from learner.checkpoint import load_checkpoint, save_checkpoint
from learner.evaluation import Evaluator
from learner.gigpo import batch_advantages
from learner.groups import Group, group_from_message
from learner.intake import Intake
from learner.ledger import Ledger
from learner.metrics import CompletionsFile, MetricsFile, StatusFile, batch_metrics, batch_tokens, plan_shares
from learner.ranks import Command, Part, Ranks, follower_main, load_trainer
from learner.reporters import open_reporters
from learner.rollouts import MB, RolloutSocket
from policy.memory import apply_memory_share
from policy.model import adapter_weights_numpy, tokenizer_fingerprint
from protocol import sockets
from rewards.functions import RewardError
from rewards.scorer import Scorer
from runtime import lifecycle, spans
from runtime.config import as_dict, read_run_config
from runtime.heartbeat import start_heartbeat
from runtime.rundir import Phase, latest_checkpoint
from transport import Transport
from transport.keys import run_key_dir

log = logging.getLogger("learner")


class Learner:
    def __init__(
        self,
        run_dir: Path,
        resume: bool = False,
        signals: lifecycle.StopSignals | None = None,
        ranks: Ranks | None = None,
        net: Transport | None = None,
    ) -> None:
        """`ranks`: the learner ranks this one is rank 0 of (learner.ranks), if any;
        `net`: the transport (default: ZeroMQ)."""
        self.run_dir = Path(run_dir)
        self.ranks = ranks or Ranks()
        self.cfg = cfg = read_run_config(run_dir)
        self.signals = signals or lifecycle.StopSignals()
        endpoints = protocol.read_endpoints(run_dir)
        self.net = net or transport.default()
        # A new id per process: a reward worker that sees it change knows the learner
        # restarted and attaches again (PROTOCOL.md, "Liveness").
        instance = uuid.uuid4().hex[:12]
        # Reward functions load (and fail) before the model does.
        keys = run_key_dir(run_dir, endpoints["learner"], cfg.run.insecure)  # TCP: CURVE
        self.scorer = Scorer(cfg.reward, self.net, endpoints["reward"], instance, keys)
        self.model, tokenizer, self.adapter_config, self.trainer = load_trainer(cfg)
        # Episodes and agent sessions are evaluated by `up`, before and after (actor eval).
        multi_turn = cfg.agent.enabled or cfg.env.environment is not None
        self.evaluator = Evaluator(cfg, tokenizer) if cfg.eval.prompts and not multi_turn else None
        vocab_size = self.model.args.vocab_size if hasattr(self.model, "args") else len(tokenizer.get_vocab())
        self.pad_id = tokenizer.pad_token_id or 0
        self.step = 0  # optimizer steps taken: also the version of the weights (policy_version)
        self.num_tokens = 0  # prompt and completion tokens trained on (TRL's num_tokens)
        self.checkpointed: int | None = None  # the step of the newest checkpoint written or loaded
        self.ledger = Ledger()
        self.status = StatusFile(self.run_dir / "status.json")
        if resume:
            self.resume()
        self.ranks.sync_state(self.trainer)
        self.metrics = MetricsFile(
            self.run_dir / "metrics.jsonl", self.step if resume else None, open_reporters(self.run_dir, cfg)
        )
        self.completions = (
            CompletionsFile(
                self.run_dir / "completions.jsonl",
                cfg.log.completions_every,
                cfg.log.completions_groups,
                self.step if resume else None,
                cfg.log.completions_tokens,
            )
            if cfg.log.completions_every
            else None
        )
        self.intake = Intake(self.scorer, self.trainer.algorithm.keep_group, self.ledger)
        identity = {
            "model": cfg.model.path,
            "tokenizer": tokenizer_fingerprint(tokenizer),
            "lora": as_dict(cfg.lora),
            "instance": instance,
        }
        group_size = cfg.sampling.group_size
        self.rollouts = RolloutSocket(
            self.net,
            endpoints["learner"],
            self.ledger,
            identity,
            lambda actor, msg: group_from_message(actor, msg, vocab_size, group_size),
            lambda: adapter_weights_numpy(self.model),
            keys,
            cfg.actor.count,
            sockets.frame_limit(cfg.rollout_array_bytes),
            max_staleness=cfg.train.max_staleness,
            batch_size=cfg.train.batch_size,
        )
        self.shares = plan_shares(self.run_dir)

    def resume(self) -> None:
        """Continue from the newest checkpoint (the metrics file then drops later steps)."""
        path = latest_checkpoint(self.run_dir)
        if path is None:
            log.info("no checkpoint to resume from; starting at step 0")
            return
        state = load_checkpoint(path, self.model, self.trainer.optimizer)
        self.step = self.checkpointed = state["step"]
        self.ledger.restore(state)
        self.num_tokens = state.get("num_tokens", 0)
        self.scorer.restore_stats(state.get("reward_stats", {}))
        log.info("resumed from %s: step %d, adapters %s", path.name, self.step, state["adapters_digest"])

    def run(self) -> None:
        """Train until the last step or a stop signal, then checkpoint. A user error
        (RewardError) checkpoints too, so the run resumes once it is fixed."""
        train = self.cfg.train
        self.write_status(Phase.WAITING_FOR_ACTOR)
        last_status = 0.0
        try:
            if self.step == 0:
                self.evaluate()  # the base of comparison; a resumed run has it already
            while self.step < train.steps and not self.signals.requested:
                with spans.span("wait for groups", spans.WAIT):
                    arrived = self.rollouts.receive(100, self.step)
                with spans.span("score", groups=len(arrived)):
                    self.intake.add(arrived)
                    self.intake.score()
                batch = self.intake.next_batch(self.step, train.batch_size, train.max_staleness)
                if batch is not None:
                    self.learn(batch)
                self.rollouts.send_credits()
                if time.time() - last_status > 0.5 or batch is not None:
                    self.write_status(self.phase())
                    last_status = time.time()
            if self.step >= train.steps:
                self.evaluate()  # a run resumed at its last step; otherwise done already
        except RewardError:
            self.checkpoint()
            self.write_status(Phase.FAILED)
            raise
        self.checkpoint()
        self.write_status(Phase.DONE if self.step >= train.steps else Phase.STOPPED)

    def learn(self, groups: list[Group]) -> None:
        """Train on one batch: `num_iterations` optimizer steps, each published at once."""
        t0, started = time.perf_counter(), time.time()
        train = self.cfg.train
        self.write_status(Phase.STEPPING, since=time.time())  # a stop signal now waits for the step
        size = self.cfg.sampling.group_size
        rewards = np.stack([g.session_rewards(size) for g in groups])  # a batch's groups are scored
        by_session = self.trainer.algorithm.advantages(rewards).reshape(len(groups), size)
        advantages = np.concatenate([g.row_advantages(a) for g, a in zip(groups, by_session)])
        samples = [sample for g in groups for sample in g.samples()]
        batch = make_batch(samples, self.pad_id)
        trained, gigpo_stats = advantages, cast(dict[str, float], {})  # [B]; with GiGPO, [B, T] per token
        if (algorithm := self.cfg.algorithm).gigpo_omega > 0:
            trained, gigpo_stats = batch_advantages(
                groups,
                samples,
                advantages,
                gamma=algorithm.gigpo_gamma,
                omega=algorithm.gigpo_omega,
                scale_rewards=self.trainer.algorithm.scale_rewards,
            )
        self.ranks.share_batch(batch, trained)
        with spans.span("old and reference logprobs", groups=len(groups)):
            part = Part(self.trainer, self.ranks, batch, trained)  # this rank's rows: all, alone
        self.num_tokens += batch_tokens(samples)
        if self.completions is not None:
            self.completions.write_batch(
                self.step + 1, self.trainer.num_iterations, groups, advantages, self.scorer.metric_name
            )
        shared = {
            **batch_metrics(groups, samples, rewards, advantages, self.step, self.scorer.metric_name),
            **part.stats,
            **gigpo_stats,
            "num_tokens": self.num_tokens,
        }
        for iteration in range(self.trainer.num_iterations):
            go = iteration == 0 or not (self.step >= train.steps or self.signals.requested)
            self.ranks.broadcast(Command.GO if go else Command.STOP)  # the other ranks step (or not) with us
            if not go:
                break
            with spans.span("optimizer step", iteration=iteration):
                stats = part.step()
            self.step += 1
            with spans.span("publish weights"):
                self.rollouts.publish(self.step)
            if iteration == 0:
                self.ledger.train([(g.sender, g.cursor, g.start_cursor) for g in groups])
            line = {
                "step": self.step,
                "policy_version": self.step,
                "iteration": iteration,
                **shared,
                **stats,
                "step_s": (step_s := time.perf_counter() - t0),
                **self.rollouts.weight_sync,
                "learner_peak_mb": mx.get_peak_memory() / MB,
                **self.shares,
                **self.group_counts(),
            }
            spans.record("step", started, step_s, step=self.step)  # what step_s measures
            spans.mark("step", step=self.step)
            self.metrics.write(line)
            self.ledger.say_drops(self.step)
            if train.checkpoint_every and self.step % train.checkpoint_every == 0:
                self.checkpoint()
            self.evaluate()
            t0, started = time.perf_counter(), time.time()

    def evaluate(self) -> None:
        """Evaluate on the held-out prompts when [eval] says this step is due."""
        if self.evaluator is None or not self.evaluator.due(self.step):
            return
        self.write_status(Phase.EVALUATING)
        with spans.span("evaluation", spans.WAIT, step=self.step):  # the actor samples it
            line = self.evaluator.run(
                self.model,
                self.step,
                self.scorer,
                self.intake.take,
                lambda: self.signals.requested,
                lambda tally: self.write_status(Phase.EVALUATING, eval=tally.summary()),
            )
        if line is not None:
            self.metrics.write(line)

    def checkpoint(self) -> None:
        if self.checkpointed == self.step:  # the last step's, or one that nothing followed
            return
        state = {
            "step": self.step,
            "version": self.step,
            "num_tokens": self.num_tokens,
            **self.ledger.state(),
            "reward_stats": self.scorer.worker_stats(),
            "config": self.cfg.to_dict(),
        }
        with spans.span("checkpoint", step=self.step):
            path = save_checkpoint(
                self.run_dir,
                self.model,
                self.trainer.optimizer,
                self.adapter_config,
                state,
                self.cfg.train.keep_checkpoints,
            )
        self.checkpointed = self.step
        log.info("wrote checkpoint %s (pid %d)", path.name, os.getpid())

    def group_counts(self) -> dict:
        return {**self.ledger.counts(self.intake.queued), **self.scorer.worker_stats()}

    def phase(self) -> Phase:
        if not self.rollouts.actors:
            return Phase.WAITING_FOR_ACTOR
        if self.scorer.waiting_for_workers:
            return Phase.WAITING_FOR_REWARD_WORKER
        return Phase.TRAINING

    def write_status(self, phase: Phase, **extra: object) -> None:
        """status.json: the phase (and `extra`, e.g. an evaluation's progress) for `up`."""
        self.status.write(
            {
                "phase": phase,
                "step": self.step,
                "steps": self.cfg.train.steps,
                "actors": len(self.rollouts.actors),
                "time": time.time(),
                **self.group_counts(),
                **extra,
            }
        )

    def close(self, reason: str = "training finished", final: bool = True) -> None:
        """Stop the ranks and the sockets; `final`: the run is over, so actors and reward
        workers exit (else they wait for this learner to come back)."""
        self.ranks.broadcast(Command.STOP)  # the other ranks, waiting for a batch, end
        self.rollouts.close(reason, final)
        self.metrics.close()
        if self.completions is not None:
            self.completions.close()
        self.scorer.close(reason, final)
        self.net.close()


def main(run_dir: str, resume: bool = False) -> int:
    """Run the learner to the end; returns the exit code (runtime.lifecycle)."""
    ranks = Ranks.join()  # more than one under `mlx.launch` (learner/ranks.py)
    if ranks.rank > 0:
        return follower_main(run_dir, ranks)
    signals = lifecycle.StopSignals().install()
    lifecycle.watch_lifeline()
    lifecycle.hold_run_lock(run_dir)  # before the heartbeat: a refused learner touches nothing
    start_heartbeat(run_dir, "learner")
    apply_memory_share()
    learner = Learner(Path(run_dir), resume, signals, ranks)
    spans.start(run_dir, "learner", learner.cfg.log.timeline)
    # A crash is restarted: the workers wait for the new learner; so they do when only this
    # process is stopped (a restart, or its orchestrator died: a resume comes).
    reason, final = "the learner failed", False
    try:
        learner.run()
        if signals.requested:
            reason, final = f"learner stopped by {signals.name}", lifecycle.stop_is_final(run_dir)
        else:
            reason, final = "training finished", True
    except RewardError:
        reason, final = "a reward function failed", True  # a user error: the run is over
        raise
    finally:
        learner.close(reason, final)
    log.info(
        "%s at step %d; adapters in %s",
        "stopped" if signals.requested else "finished",
        learner.step,
        learner.run_dir / "adapters",
    )
    return signals.exit_code()

"""The learner process: intake -> rewards -> advantages -> step -> publish weights.

Its loop (`run`) reads as what it does: take in the rollouts that arrived (the rollout
socket), score them and queue those kept (the intake), learn each group as it comes
(`learn`: its forward and backward while the batch's other groups are still sampled,
learner/building.py) and, once `batch_size` groups are in, take `num_iterations`
optimizer steps, each published at once and written to the metrics; checkpoint every
`checkpoint_every` steps, and keep each actor's credit flowing. The ledger knows where
every group is: trained, dropped with a reason, or queued.
`Learner.from_run_dir` builds it, and its parts, from the run directory.
"""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path

import protocol
import transport
from learner.ahead import ReferenceAhead
from learner.building import Building, streams
from learner.evaluator import Evaluator
from learner.groups import group_from_message
from learner.intake import Intake
from learner.ledger import Ledger
from learner.metrics import batch_metrics, batch_tokens
from learner.ranks import Command, Ranks, load_trainer
from learner.records import Checkpoints, Reports
from learner.rollout_socket import RolloutSocket
from learner.trainer import StepStopped, Trainer
from policy.model import adapter_weights_numpy, tokenizer_fingerprint
from protocol import sockets
from rewards.functions import RewardError
from rewards.scorer import Scorer
from runtime import lifecycle, spans
from runtime.config import Config, as_dict, read_run_config
from runtime.rundir import Phase
from transport import Transport
from transport.keys import run_key_dir

log = logging.getLogger("learner")


class Learner:
    def __init__(
        self,
        cfg: Config,
        trainer: Trainer,
        pad_id: int,
        scorer: Scorer,
        intake: Intake,
        rollouts: RolloutSocket,
        evaluator: Evaluator | None,
        checkpoints: Checkpoints,
        reports: Reports,
        signals: lifecycle.StopSignals,
        ranks: Ranks,
        net: Transport,
    ) -> None:
        """A learner of its parts; it goes on from the checkpoint `checkpoints` took back, if any."""
        self.cfg, self.trainer, self.model, self.pad_id = cfg, trainer, trainer.model, pad_id
        self.scorer, self.intake, self.rollouts, self.ledger = scorer, intake, rollouts, intake.ledger
        self.evaluator, self.checkpoints, self.reports = evaluator, checkpoints, reports
        self.signals, self.ranks, self.net = signals, ranks, net
        if ranks.size == 1:  # ranks end a step together; a learner alone stops between micro-batches
            trainer.stopping = lambda: signals.requested
        self.building = Building.new(trainer, ranks)
        self.streams = streams(cfg, trainer.algorithm, ranks.size)
        self.step = checkpoints.step or 0  # optimizer steps taken: the weights' version (policy_version)
        self.num_tokens = checkpoints.num_tokens  # prompt and completion tokens trained on (TRL's num_tokens)

    @classmethod
    def from_run_dir(
        cls,
        run_dir: Path,
        resume: bool = False,
        signals: lifecycle.StopSignals | None = None,
        ranks: Ranks | None = None,
        net: Transport | None = None,
    ) -> Learner:
        """The run's learner, its reward functions and model loaded, resumed from the newest
        checkpoint if `resume`. `ranks`: the learner ranks this one is rank 0 of
        (learner.ranks), if any; `net`: the transport (default: ZeroMQ)."""
        run_dir, ranks, net = Path(run_dir), ranks or Ranks(), net or transport.default()
        cfg = read_run_config(run_dir)
        endpoints = protocol.read_endpoints(run_dir)
        instance = uuid.uuid4().hex[:12]  # new each process: reward workers see a restart (PROTOCOL.md)
        # Reward functions load (and fail) before the model does.
        keys = run_key_dir(run_dir, endpoints["learner"], cfg.run.insecure)  # TCP: CURVE
        scorer = Scorer(cfg.reward, net, endpoints["reward"], instance, keys)
        model, tokenizer, adapter_config, trainer = load_trainer(cfg)
        # Episodes and agent sessions are evaluated by `up`, before and after (actor eval).
        multi_turn = cfg.agent.enabled or cfg.env.environment is not None
        evaluator = Evaluator(cfg, tokenizer) if cfg.eval.prompts and not multi_turn else None
        vocab_size = model.args.vocab_size if hasattr(model, "args") else len(tokenizer.get_vocab())
        ledger = Ledger()
        checkpoints = Checkpoints(run_dir, cfg, trainer, adapter_config, ledger, scorer)
        if resume:
            checkpoints.resume()
        ranks.sync_state(trainer)
        intake = Intake(scorer, trainer.algorithm.keep_group, ledger)
        lora, fingerprint = as_dict(cfg.lora), tokenizer_fingerprint(tokenizer)
        identity = dict(model=cfg.model.path, tokenizer=fingerprint, lora=lora, instance=instance)
        rollouts = RolloutSocket(
            net,
            endpoints["learner"],
            ledger,
            identity,
            lambda actor, msg: group_from_message(actor, msg, vocab_size, cfg.sampling.group_size),
            lambda: adapter_weights_numpy(model),
            keys,
            cfg.actor.count,
            sockets.frame_limit(cfg.rollout_array_bytes),
            max_staleness=cfg.train.max_staleness,
            batch_size=cfg.train.batch_size,
            partials=ReferenceAhead.of(cfg, trainer, ranks.size, vocab_size),
        )
        resumed_at = (checkpoints.step or 0) if resume else None  # the metrics files drop later steps
        reports = Reports(run_dir, cfg, resumed_at, scorer, intake, rollouts)
        pad, signals = tokenizer.pad_token_id or 0, signals or lifecycle.StopSignals()
        return cls(
            cfg, trainer, pad, scorer, intake, rollouts, evaluator, checkpoints, reports, signals, ranks, net
        )

    def run(self) -> None:
        """Train until the last step or a stop signal, then checkpoint. A user error
        (RewardError) checkpoints too, so the run resumes once it is fixed."""
        train = self.cfg.train
        self.write_status(Phase.WAITING_FOR_ACTOR)
        try:
            if self.step == 0:
                self.evaluate()  # the base of comparison; a resumed run has it already
            took = True  # so that groups at hand are learned before any work ahead (the batch's last too)
            while self.step < train.steps and not self.signals.requested:
                ahead = not took and self.rollouts.partials.work(self.intake, self.step - train.max_staleness)
                with spans.span("wait for groups", spans.WAIT):
                    arrived = self.rollouts.receive(0 if ahead or took else 100, self.step)
                self.rollouts.partials.take(arrived)
                with spans.span("score", groups=len(arrived)):
                    self.intake.add(arrived)
                    self.intake.score()
                step, took = self.step, self.learn()
                self.rollouts.send_credits()
                self.reports.write_phase(self.step, at_once=self.step > step)
            self.intake.put_back()  # a batch begun, not complete at a stop: queued again
            if self.step >= train.steps:
                self.evaluate()  # a run resumed at its last step; otherwise done already
        except RewardError:
            self.intake.put_back()  # the batch begun: queued, as the checkpoint counts it
            self.checkpoints.write(self.step, self.num_tokens)
            self.write_status(Phase.FAILED)
            raise
        self.checkpoints.write(self.step, self.num_tokens)
        self.write_status(Phase.DONE if self.step >= train.steps else Phase.STOPPED)

    def learn(self) -> bool:
        """Take the groups at hand into the batch being built, through forward and backward
        at once (all at once when its advantages need the whole batch, or with
        `train.stream_groups = false`), and train the batch once it is complete:
        `num_iterations` optimizer steps, each published at once. True when it took groups.

        A stop between two micro-batches ends the batch unfinished: its groups go back to
        the queue if its first step was not taken (a checkpoint counts queued groups as not
        received: a resumed actor samples their prompts again), and the step's partial
        work is thrown away."""
        train, first_step, k = self.cfg.train, self.step, self.cfg.train.max_staleness
        want = train.batch_size - len(self.building.groups)
        # Room for the groups the actors still sample that can join no later batch.
        reserve = self.rollouts.sampling(self.step - k)
        groups = self.intake.next_groups(self.step, want, 1 if self.streams else want, k, reserve)
        if not groups:
            return False
        # Before every take: a stop now waits for what cannot be cut short (supervisor).
        self.write_status(Phase.STEPPING, since=self.building.started or time.time())
        try:
            self.building.take(groups, self.cfg, self.pad_id)
            if len(self.building.groups) == train.batch_size:
                self.train_batch()
        except StepStopped:
            if self.step == first_step:
                self.intake.put_back()
            self.building = Building.new(self.trainer, self.ranks)
            log.info("stopped in the middle of step %d: nothing of it was applied", self.step + 1)
        return True

    def train_batch(self) -> None:
        """The complete batch's optimizer steps, its metrics and its completions."""
        t0, started = time.perf_counter(), time.time()
        groups, share = self.building.groups, self.building.share
        samples, a, norm = self.building.complete(self.cfg)
        num_tokens = self.num_tokens + batch_tokens(samples)
        self.reports.write_batch(self.step + 1, self.trainer.num_iterations, groups, a.rows)
        batch_stats = batch_metrics(groups, samples, a.rewards, a.rows, self.step, self.scorer.metric_name)
        shared, busy_s = {**batch_stats, **a.stats, "num_tokens": num_tokens}, self.building.busy_s
        for iteration in range(self.trainer.num_iterations):
            if iteration and (self.step >= self.cfg.train.steps or self.signals.requested):
                break
            self.ranks.broadcast(Command.GO)  # the other ranks step with us
            with spans.span("optimizer step", iteration=iteration):
                stats = share.step(self.ranks.share_norm(norm))
            self.step += 1
            with spans.span("publish weights"):
                self.rollouts.publish(self.step)
            if iteration == 0:
                self.num_tokens = num_tokens
                self.ledger.train([(g.sender, g.cursor, g.start_cursor) for g in groups])
                self.intake.settle()
            final_s = time.perf_counter() - t0
            spans.record("step", started, final_s, step=self.step)  # since the batch was complete
            spans.mark("step", step=self.step)
            step_s = busy_s + final_s  # the learner's time on it, as its groups came too
            self.reports.write_step(self.step, iteration, {**shared, **stats}, step_s)
            self.ledger.say_drops(self.step)
            if (every := self.cfg.train.checkpoint_every) and self.step % every == 0:
                self.checkpoints.write(self.step, self.num_tokens)
            self.evaluate()
            t0, started, busy_s = time.perf_counter(), time.time(), 0.0
        self.building = Building.new(self.trainer, self.ranks)

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
            self.reports.metrics.write(line)

    def write_status(self, phase: Phase, **extra: object) -> None:
        """status.json: the phase (and `extra`, e.g. an evaluation's progress) for `up`."""
        self.reports.write_status(phase, self.step, **extra)

    def close(self, reason: str = "training finished", final: bool = True) -> None:
        """Stop the ranks and the sockets; `final`: the run is over, so actors and reward
        workers exit (else they wait for this learner to come back)."""
        self.ranks.broadcast(Command.STOP)  # the other ranks, waiting for a batch, end
        self.rollouts.close(reason, final)
        self.reports.close()
        self.scorer.close(reason, final)
        self.net.close()

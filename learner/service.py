"""The learner process: intake -> rewards -> advantages -> step -> publish weights.

It binds the socket that actors connect to (a ZeroMQ ROUTER, so several actors can
attach), trains on every `batch_size` groups it receives, and sends the new adapter
weights to every actor after each optimizer step. Every group that arrives is trained on,
dropped with a counted reason, or still queued when the run ends.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time
import uuid
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import msgpack
import numpy as np
import zmq

import protocol
from learner.algorithms import make_algorithm
from learner.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from learner.groups import Group, group_from_message
from learner.step import Correction, Sample, make_batch, optimizer_step, prepare
from policy.memory import apply_memory_share
from policy.model import adapter_weights_numpy, load_policy, tokenizer_fingerprint
from protocol import lifecycle
from protocol.config import read_run_config
from protocol.heartbeat import start_heartbeat
from rewards.functions import RewardError
from rewards.scorer import Scored, Scorer

log = logging.getLogger("learner")

MB = 1 << 20


class Learner:
    def __init__(self, run_dir: Path, resume: bool = False,
                 signals: lifecycle.StopSignals | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.cfg = read_run_config(run_dir)
        train = self.cfg["train"]
        endpoints = protocol.read_endpoints(run_dir)
        self.ctx = zmq.Context()
        # A new id per process: a reward worker that sees it change knows the learner
        # restarted and attaches again (PROTOCOL.md, "Liveness").
        self.instance = uuid.uuid4().hex[:12]
        # Reward functions load (and fail) before the model does.
        self.scorer = Scorer(self.cfg["reward"], self.ctx, endpoints["reward"], self.instance)
        self.awaiting: dict[str, Group] = {}  # waiting for an external reward
        algo = self.cfg["algorithm"]
        self.algorithm = make_algorithm(
            algo["name"], beta=algo["beta"], epsilon=algo["epsilon"], epsilon_high=algo["epsilon_high"],
            scale_rewards=algo["scale_rewards"], max_tokens=self.cfg["sampling"]["max_tokens"])
        self.correction = Correction(algo["is_correction"], algo["is_level"], algo["is_cap"])
        mx.random.seed(train["seed"])
        log.info("loading %s", self.cfg["model"]["path"])
        self.model, self.tokenizer, self.adapter_config = load_policy(
            self.cfg["model"]["path"], self.cfg["lora"])
        self.model.train()
        if train["grad_checkpoint"]:
            from mlx_lm.tuner.trainer import grad_checkpoint

            grad_checkpoint(self.model.layers[0])
        self.optimizer = optim.Adam(learning_rate=train["learning_rate"])
        self.fingerprint = tokenizer_fingerprint(self.tokenizer)
        self.vocab_size = self.model.args.vocab_size if hasattr(self.model, "args") else len(
            self.tokenizer.get_vocab())
        self.pad_id = self.tokenizer.pad_token_id or 0
        self.step = 0
        self.version = 0
        self.actors: dict[bytes, dict] = {}
        self.unscored: list[Group] = []  # received, waiting for rewards
        self.queue: collections.deque[Group] = collections.deque()  # scored, kept, waiting for a batch
        self.counts = collections.Counter()
        self.dropped = collections.Counter()
        # Groups trained or dropped, per actor: the credit that lets an actor sample more.
        self.consumed: collections.Counter[bytes] = collections.Counter()
        self.credited: dict[bytes, int] = {}
        self.signals = signals or lifecycle.StopSignals()
        self.weight_sync: dict[str, float] = {}

        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.bind(endpoints["learner"])
        plan = self.run_dir / "plan.json"
        shares = json.loads(plan.read_text())["shares_mb"] if plan.exists() else {}
        self.shares = {f"{k}_share_mb": v for k, v in shares.items()}
        self.data_cursor: list[int] | None = None  # after the newest consumed group's prompt
        if resume:
            self.resume()
        self.metrics_file = open(self.run_dir / "metrics.jsonl", "a")

    def resume(self) -> None:
        """Continue from the newest checkpoint; metrics of later steps are discarded, so
        no step number ever appears twice."""
        path = latest_checkpoint(self.run_dir)
        if path is None:
            log.info("no checkpoint to resume from; starting at step 0")
            keep_metrics_until(self.run_dir / "metrics.jsonl", 0)
            return
        state = load_checkpoint(path, self.model, self.optimizer)
        self.step, self.version = state["step"], state["version"]
        self.data_cursor = state["data_cursor"]
        self.counts.update(state["counts"])
        self.dropped.update(state["dropped"])
        self.scorer.restore_stats(state.get("reward_stats", {}))
        keep_metrics_until(self.run_dir / "metrics.jsonl", self.step)
        log.info("resumed from %s: step %d, adapters %s", path.name, self.step, state["adapters_digest"])

    # -- messages ---------------------------------------------------------------------

    def hello(self) -> dict:
        return {"role": "learner", "model": self.cfg["model"]["path"], "instance": self.instance,
                "tokenizer": self.fingerprint, "lora": self.cfg["lora"], "pid": os.getpid(),
                "data_cursor": self.data_cursor}

    def send(self, identity: bytes, kind: str, header: dict | None = None,
             arrays: dict | None = None) -> None:
        self.sock.send_multipart([identity, *protocol.encode(kind, header, arrays)], copy=False)

    def publish_weights(self, identities: list[bytes]) -> None:
        t0 = time.perf_counter()
        weights = adapter_weights_numpy(self.model)
        frames = protocol.encode(protocol.WEIGHTS, {"version": self.version, "sent_at": time.time()},
                                 weights)
        self.weight_sync = {"weights_mb": sum(len(f) for f in frames) / MB,
                            "weights_serialize_s": time.perf_counter() - t0}
        for identity in identities:
            self.sock.send_multipart([identity, *frames], copy=False)

    def receive(self, timeout_ms: int) -> None:
        """Handle every message that arrives within `timeout_ms`; never raise on bad input."""
        while self.sock.poll(timeout_ms):
            timeout_ms = 0
            identity, *frames = (f.buffer for f in self.sock.recv_multipart(copy=False))
            identity = bytes(identity)
            try:
                msg = protocol.decode(frames)
            except protocol.ProtocolError as e:
                self.counts["messages_rejected"] += 1
                log.error("dropped a malformed message from %s: %s", identity.hex(), e)
                if identity in self.actors and _looks_like_rollout(frames):
                    # An attached actor counts this group as in flight; consume it so the
                    # actor is not left waiting for credit that would never come.
                    self.counts["groups_received"] += 1
                    self.drop("malformed", "?", identity)
                continue
            self.handle(identity, msg)
        self.send_credits()

    def handle(self, identity: bytes, msg: protocol.Message) -> None:
        if msg.kind == protocol.HELLO:
            problem = self.incompatibility(msg)
            if problem:
                log.error("refused %s (pid %s): %s", msg["role"], msg["pid"], problem)
                self.send(identity, protocol.STOP, {"reason": f"incompatible: {problem}"})
                return
            self.actors[identity] = msg.header
            log.info("actor pid %s attached; sending weights of version %d", msg["pid"], self.version)
            self.send(identity, protocol.HELLO, self.hello())
            self.publish_weights([identity])
        elif msg.kind == protocol.ROLLOUT:
            self.counts["groups_received"] += 1
            if identity not in self.actors:
                self.drop("no handshake", msg["group_id"], identity)
                return
            try:
                group = group_from_message(identity, msg, self.vocab_size,
                                           self.cfg["sampling"]["group_size"])
            except ValueError as e:
                self.drop(str(e), msg["group_id"], identity)
                return
            self.unscored.append(group)
        elif msg.kind == protocol.STOP:
            log.info("peer asked to stop: %s", msg["reason"])
        # Heartbeats need no answer; other kinds have no meaning for the learner.

    def incompatibility(self, msg: protocol.Message) -> str | None:
        if msg["role"] != "actor":
            return f"role {msg['role']!r} cannot attach to the rollout socket"
        if msg["tokenizer"] != self.fingerprint:
            return "tokenizer fingerprint differs"
        if msg["lora"] != self.cfg["lora"]:
            return f"LoRA config {msg['lora']} differs from {self.cfg['lora']}"
        if msg["model"] != self.cfg["model"]["path"]:
            return f"model {msg['model']!r} differs from {self.cfg['model']['path']!r}"
        return None

    def drop(self, reason: str, group_id: str, sender: bytes, cursor: list | None = None) -> None:
        self.dropped[reason] += 1
        self.consumed[sender] += 1
        self.advance_cursor(cursor)
        log.warning("dropped group %s: %s", group_id, reason)

    def advance_cursor(self, cursor: list | None) -> None:
        if cursor is not None and (self.data_cursor is None or list(cursor) > list(self.data_cursor)):
            self.data_cursor = list(cursor)

    def send_credits(self) -> None:
        """Tell each attached actor how many of its groups are consumed, when that changed."""
        for identity in self.actors:
            n = self.consumed[identity]
            if self.credited.get(identity) != n:
                self.send(identity, protocol.CREDIT, {"groups_consumed": n})
                self.credited[identity] = n

    # -- training ---------------------------------------------------------------------

    def next_batch(self) -> list[Group] | None:
        """Take `batch_size` groups, dropping those too stale to train on."""
        train = self.cfg["train"]
        while self.queue and self.version - self.queue[0].policy_version > train["max_staleness"]:
            g = self.queue.popleft()
            self.drop("stale", g.group_id, g.sender, g.cursor)
        if len(self.queue) < train["batch_size"]:
            return None
        return [self.queue.popleft() for _ in range(train["batch_size"])]

    def intake(self) -> None:
        """Send every new group to the rewards, and take in the groups whose rewards are
        complete; keep those the algorithm wants (DAPO filters equal-reward groups)."""
        while self.unscored:
            g = self.unscored.pop(0)
            key = f"{g.sender.hex()}/{g.group_id}"
            try:
                scored = self.scorer.submit(key, g.prompt, g.texts, g.completion_ids, g.columns)
            except RewardError as e:
                self.reward_failed(g, e)
            if scored is None:
                self.awaiting[key] = g
            else:
                self.accept(g, scored)
        done, failed, errors = self.scorer.poll(0)
        for scored in done:
            self.accept(self.awaiting.pop(scored.key), scored)
        for key, reason in failed:
            g = self.awaiting.pop(key)
            self.drop(reason, g.group_id, g.sender, g.cursor)
        for key, error in errors:
            self.reward_failed(self.awaiting.pop(key), RewardError(error))

    def reward_failed(self, g: Group, error: RewardError) -> None:
        """A reward function that raises (or returns garbage) on a group will do so again:
        count the group as dropped and end the run, naming the function and the row."""
        self.drop("reward error", g.group_id, g.sender, g.cursor)
        where = f"data row {g.row}" if g.row is not None else f"group {g.group_id}"
        raise RewardError(f"{error} (on {where}, prompt {str(g.prompt)[:80]!r})") from error

    def accept(self, g: Group, scored: Scored) -> None:
        if self.algorithm.keep_group(scored.total):
            g.rewards, g.rewards_by_function = scored.total, scored.by_function
            self.queue.append(g)
        else:
            self.drop("filtered: equal rewards", g.group_id, g.sender, g.cursor)

    def learn(self, groups: list[Group]) -> None:
        """Train on one batch: `num_iterations` optimizer steps, each published at once."""
        t0 = time.perf_counter()
        rewards = np.stack([g.rewards for g in groups])
        advantages = self.algorithm.advantages(rewards)
        samples = [Sample(g.prompt_ids, ids, lp, fr) for g in groups
                   for ids, lp, fr in zip(g.completion_ids, g.logprobs, g.finish_reasons)]
        train, sampling = self.cfg["train"], self.cfg["sampling"]
        batch = make_batch(samples, self.pad_id)
        prepared = prepare(self.model, batch, sampling["temperature"], self.cfg["algorithm"]["beta"],
                           self.correction, train["micro_batch_size"])
        lens = [len(s.completion_ids) for s in samples]
        gen_s = sum(g.gen_s for g in groups)
        actor_peaks = [g.actor_peak_mb for g in groups if g.actor_peak_mb is not None]
        shared = {
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            **reward_means(groups, self.scorer.metric_name),
            "advantage_mean": float(advantages.mean()),
            "advantage_std": float(advantages.std()),
            **prepared.stats,
            "completion_len_mean": float(np.mean(lens)),
            "completion_len_max": int(max(lens)),
            "truncated_frac": float(np.mean([s.finish_reason == "length" for s in samples])),
            "version_lag_mean": float(np.mean([self.version - g.policy_version for g in groups])),
            "rollout_tokens_per_s": sum(lens) / gen_s if gen_s > 0 else None,
            # as the actor measured them for the weights it sampled this batch with
            "weights_transfer_s": newest(groups, "weights_transfer_s"),
            "weights_apply_s": newest(groups, "weights_apply_s"),
            "actor_peak_mb": max(actor_peaks) if actor_peaks else None,
        }
        for iteration in range(self.cfg["algorithm"]["num_iterations"]):
            stats = optimizer_step(self.model, self.optimizer, self.algorithm, batch, prepared,
                                   advantages, sampling["temperature"], train["max_grad_norm"],
                                   train["micro_batch_size"])
            self.step += 1
            self.version += 1
            self.publish_weights(list(self.actors))
            if iteration == 0:
                self.counts["groups_trained"] += len(groups)
                self.consumed.update(g.sender for g in groups)
                for g in groups:
                    self.advance_cursor(g.cursor)
            self.write_metrics({
                "step": self.step, "policy_version": self.version, "iteration": iteration,
                **shared, **stats,
                "step_s": time.perf_counter() - t0,
                **self.weight_sync,
                "learner_peak_mb": mx.get_peak_memory() / MB,
                **self.shares,
                **self.group_counts(),
            })
            t0 = time.perf_counter()
            if self.step >= train["steps"] or self.signals.requested:
                break

    def write_metrics(self, metrics: dict) -> None:
        self.metrics_file.write(json.dumps(metrics) + "\n")
        self.metrics_file.flush()
        every = self.cfg["train"]["checkpoint_every"]
        if every and self.step % every == 0:
            self.checkpoint()

    def group_counts(self) -> dict:
        return {
            "groups_received": self.counts["groups_received"],
            "groups_trained": self.counts["groups_trained"],
            "groups_queued": len(self.queue) + len(self.unscored) + len(self.awaiting),
            "groups_dropped": sum(self.dropped.values()),
            "dropped_reasons": dict(self.dropped),
            "messages_rejected": self.counts["messages_rejected"],
            **self.scorer.worker_stats(),
        }

    def phase(self) -> str:
        if not self.actors:
            return "waiting_for_actor"
        if self.scorer.waiting_for_workers:
            return "waiting_for_reward_worker"
        return "training"

    def write_status(self, phase: str) -> None:
        status = {"phase": phase, "step": self.step, "steps": self.cfg["train"]["steps"],
                  "actors": len(self.actors), "time": time.time(), **self.group_counts()}
        lifecycle.write_atomic(self.run_dir / "status.json", json.dumps(status) + "\n")

    def checkpoint(self) -> None:
        # Groups still queued are not in the checkpoint: after a restart the actor rewinds
        # to data_cursor and samples those prompts again.
        state = {"step": self.step, "version": self.version, "data_cursor": self.data_cursor,
                 "counts": {k: self.counts[k] for k in ("groups_trained", "messages_rejected")},
                 "dropped": dict(self.dropped), "reward_stats": self.scorer.worker_stats(),
                 "config": self.cfg}
        state["counts"]["groups_received"] = state["counts"]["groups_trained"] + sum(self.dropped.values())
        save_checkpoint(self.run_dir, self.model, self.optimizer, self.adapter_config, state,
                        self.cfg["train"]["keep_checkpoints"])

    def run(self) -> None:
        """Train until the last step or a stop signal, then checkpoint. A user error
        (RewardError) checkpoints too, so the run resumes once it is fixed."""
        steps = self.cfg["train"]["steps"]
        self.write_status("waiting_for_actor")
        last_status = 0.0
        try:
            while self.step < steps and not self.signals.requested:
                self.receive(100)
                self.intake()
                batch = self.next_batch()
                if batch is not None:
                    self.learn(batch)
                self.send_credits()
                if time.time() - last_status > 0.5 or batch is not None:
                    self.write_status(self.phase())
                    last_status = time.time()
        except RewardError:
            self.checkpoint()
            self.write_status("failed")
            raise
        self.checkpoint()
        self.write_status("done" if self.step >= steps else "stopped")

    def close(self, reason: str = "training finished") -> None:
        for identity in self.actors:
            self.send(identity, protocol.STOP, {"reason": reason})
        self.metrics_file.close()
        self.scorer.close(reason)
        self.sock.close()
        self.ctx.term()


def newest(groups: list[Group], key: str) -> float | None:
    values = [g.timings.get(key) for g in groups if g.timings.get(key) is not None]
    return values[-1] if values else None


def reward_means(groups: list[Group], metric_name) -> dict[str, float | None]:
    """Each reward function's mean over the batch, None values left out."""
    out = {}
    for key in groups[0].rewards_by_function:
        values = [v for g in groups for v in g.rewards_by_function.get(key, []) if v is not None]
        out[f"reward/{metric_name(key)}"] = float(np.mean(values)) if values else None
    return out


def _step_of(line: str) -> int | None:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return None


def _looks_like_rollout(frames: list[bytes]) -> bool:
    try:
        head = msgpack.unpackb(bytes(frames[0]), raw=False)
    except Exception:
        return False
    return isinstance(head, dict) and head.get("kind") == protocol.ROLLOUT


def keep_metrics_until(path: Path, step: int) -> None:
    """Drop metrics lines of steps after `step` (written after the checkpoint we resume),
    and a last line cut short by a kill mid-write."""
    if not path.exists():
        return
    lines = [line for line in path.read_text().splitlines(keepends=True)
             if line.endswith("\n") and _step_of(line) is not None and _step_of(line) <= step]
    lifecycle.write_atomic(path, "".join(lines))


def main(run_dir: str, resume: bool = False) -> int:
    """Run the learner to the end; returns the exit code (protocol.lifecycle)."""
    signals = lifecycle.StopSignals().install()
    lifecycle.watch_lifeline()
    lifecycle.hold_run_lock(run_dir)  # before the heartbeat: a refused learner touches nothing
    start_heartbeat(run_dir, "learner")
    apply_memory_share()
    learner = Learner(Path(run_dir), resume, signals)
    reason = "the learner failed"
    try:
        learner.run()
        reason = f"learner stopped by {signals.name}" if signals.requested else "training finished"
    finally:
        learner.close(reason)
    log.info("%s at step %d; adapters in %s", "stopped" if signals.requested else "finished",
             learner.step, learner.run_dir / "adapters")
    return lifecycle.signal_exit_code(signals.signum) if signals.requested else lifecycle.EXIT_OK

"""Scoring a group: every configured reward, in-process or external, then their weighted sum.

In-process functions run at once; a `"worker"` entry waits for the reward socket. As in
TRL, a None reward is left out of the weighted sum, a completion that no function scores
has the total NaN (unscorable: left out of its group's statistics, advantage 0), and each
function's mean is reported on its own.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import protocol
from protocol.worker_socket import WorkerPool
from rewards.functions import ENV, WORKER, RewardError, call_reward, load_reward_function, reward_inputs
from runtime.config import RewardConfig
from transport import Transport


@dataclass
class Scored:
    key: str
    total: np.ndarray  # [G] weighted sum; NaN where every function returned None
    by_function: dict[str, list[float | None]] = field(default_factory=dict)


def rewards_of(scored: Scored | None) -> list[float | None] | None:
    """A prompt's total rewards (None where unscored), or None when the prompt is unscored."""
    if scored is None:
        return None
    return [None if np.isnan(r) else float(r) for r in scored.total]


def rewards_by_prompt(scores: dict[str, Scored]) -> dict[str, list[float | None]]:
    """Each scored prompt's total rewards, keyed as `scores` is (policy.evaluation.summarize)."""
    return {key: rewards for key, scored in scores.items() if (rewards := rewards_of(scored)) is not None}


WORKER_STATS = ("retries", "rejected_replies", "late_replies", "lost_workers")


def short_names(specs: list[str]) -> dict[str, str]:
    """Each spec's name in metrics: the function's name, or the whole `module:function`
    where two modules have a function of that name (their scores must not merge)."""
    counts = Counter(s.partition(":")[2] for s in specs if s not in (WORKER, ENV))
    return {
        s: s if s in (WORKER, ENV) or counts[s.partition(":")[2]] > 1 else s.partition(":")[2] for s in specs
    }


class Scorer:
    def __init__(
        self,
        reward: RewardConfig,
        net: Transport | None = None,
        endpoint: str | None = None,
        instance: str | None = None,
        keys: Path | None = None,
    ) -> None:
        specs = list(reward.functions)
        weights = reward.weights or [1.0] * len(specs)
        # Keyed by the whole `module:function`: two modules may both have a `correct`.
        self.entries = [
            (s, None if s in (WORKER, ENV) else load_reward_function(s, reward.search_path), w)
            for s, w in zip(specs, weights)
        ]
        self.names = short_names(specs)
        self.pool = None
        if WORKER in specs:
            if net is None or endpoint is None:
                raise ValueError("a 'worker' reward needs a reward socket")
            self.pool = WorkerPool(
                net,
                endpoint,
                "reward_worker",
                protocol.SCORE_REPLY,
                reward.timeout_s,
                reward.max_attempts,
                instance,
                keys=keys,
            )
        self.partial: dict[str, dict[str, list]] = {}

    def metric_name(self, key: str) -> str:
        """`reward/<this>` in metrics; names a worker reports (`worker:NAME`) pass through."""
        return self.names.get(key, key)

    @property
    def waiting_for_workers(self) -> bool:
        d = self.pool
        return d is not None and d.pending > 0 and d.n_workers == 0

    def worker_stats(self) -> dict[str, int]:
        """The reward socket's counters for the metrics: retries, rejected and late
        replies, workers taken for gone."""
        if self.pool is None:
            return {}
        stats = self.pool.stats
        return {f"reward_{k}": stats[k] for k in WORKER_STATS}

    def restore_stats(self, saved: dict[str, int]) -> None:
        """Continue the counters of a checkpoint (a restarted learner's metrics go on)."""
        if self.pool is not None:
            self.pool.stats.update({k: saved.get(f"reward_{k}", 0) for k in WORKER_STATS})

    def submit(
        self,
        key: str,
        prompt: Any,
        texts: list[str],
        completion_ids: list,
        columns: dict[str, Any],
        turns: list[list[dict]] | None = None,
        env_rewards: list[float | None] | None = None,
    ) -> Scored | None:
        """Score in-process at once; returns None while an external score is awaited.
        Episodes bring their `turns` (chat completions) and the rewards their environment
        returned (the `"env"` entry). Raises RewardError if an in-process function fails."""
        inputs = reward_inputs(prompt, texts, completion_ids, columns, turns)
        by_fn = {name: call_reward(fn, inputs, name) for name, fn, _ in self.entries if fn is not None}
        if any(name == ENV for name, _, _ in self.entries):
            by_fn[ENV] = list(env_rewards) if env_rewards is not None else [None] * len(texts)
        if self.pool is None:
            return self.combine(key, by_fn)
        self.partial[key] = by_fn
        self.pool.submit(key, inputs_for_wire(inputs), protocol.SCORE, reply_check(len(texts)))
        return None

    def poll(self, timeout_ms: int = 0) -> tuple[list[Scored], list[tuple[str, str]], list[tuple[str, str]]]:
        """External replies that completed a group; groups that could not be scored (key,
        reason: drop them); groups whose worker's function failed (key, error: a user
        error, as when an in-process function raises)."""
        if self.pool is None:
            return [], [], []
        replies, failures = self.pool.poll(timeout_ms)
        done, errors = [], []
        for r in replies:
            by_fn = self.partial.pop(r.request_id)
            if r.header.get("error") is not None:
                errors.append((r.request_id, f"reward worker pid {r.pid}: {r.header['error']}"))
                continue
            by_fn[WORKER] = r.header["rewards"]
            by_fn.update({f"{WORKER}:{k}": v for k, v in (r.header.get("rewards_by_function") or {}).items()})
            done.append(self.combine(r.request_id, by_fn))
        for key, _ in failures:
            self.partial.pop(key, None)
        return done, failures, errors

    def combine(self, key: str, by_fn: dict[str, list]) -> Scored:
        n = len(next(iter(by_fn.values())))
        total, scored = np.zeros(n), np.zeros(n, dtype=bool)
        for name, _, weight in self.entries:
            values = np.array([np.nan if v is None else v for v in by_fn[name]], dtype=np.float64)
            total += np.nan_to_num(weight * values, nan=0.0)
            scored |= ~np.isnan(values)
        return Scored(key, np.where(scored, total, np.nan), by_fn)

    def close(self, reason: str = "run finished", final: bool = True) -> None:
        """Tell attached workers why the socket closes, and whether to exit (`final`) or to
        wait for the learner to come back; close the reward socket."""
        if self.pool is not None:
            self.pool.close(reason, final)


def reply_check(n: int):
    """A `score_reply` must have one reward per completion (unless it reports an error)."""

    def check(header: dict) -> str | None:
        if header.get("error") is None and len(header["rewards"]) != n:
            return f"{len(header['rewards'])} rewards for {n} completions"
        return None

    return check


def inputs_for_wire(inputs: dict[str, list]) -> dict:
    """The score request's fields: TRL's arguments, with the columns under their own key."""
    fixed = ("prompts", "completions", "completion_ids")
    return {**{k: inputs[k] for k in fixed}, "columns": {k: v for k, v in inputs.items() if k not in fixed}}


__all__ = ["RewardError", "Scored", "Scorer"]

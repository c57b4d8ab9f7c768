"""What the learner reports: one JSON line per optimizer step in `RUN/metrics.jsonl`
(README, "What a run leaves behind", lists every key)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from learner.groups import Group
from learner.step import Sample
from protocol.lifecycle import write_atomic


def batch_metrics(groups: list[Group], samples: list[Sample], rewards: np.ndarray, advantages: np.ndarray,
                  step: int, metric_name: Callable[[str], str]) -> dict[str, Any]:
    """What a batch says before any optimizer step: its rewards, advantages and
    completions, how stale it was at `step`, and what the actor measured sampling it."""
    lens = [len(s.completion_ids) for s in samples]
    gen_s = sum(g.gen_s for g in groups)
    actor_peaks = [g.actor_peak_mb for g in groups if g.actor_peak_mb is not None]
    return {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        **reward_means(groups, metric_name),
        "advantage_mean": float(advantages.mean()),
        "advantage_std": float(advantages.std()),
        "completion_len_mean": float(np.mean(lens)),
        "completion_len_max": int(max(lens)),
        "truncated_frac": float(np.mean([s.finish_reason == "length" for s in samples])),
        "version_lag_mean": float(np.mean([step - g.policy_version for g in groups])),
        "rollout_tokens_per_s": sum(lens) / gen_s if gen_s > 0 else None,
        # as the actor measured them for the weights it sampled this batch with
        "weights_transfer_s": newest(groups, "weights_transfer_s"),
        "weights_apply_s": newest(groups, "weights_apply_s"),
        "actor_peak_mb": max(actor_peaks) if actor_peaks else None,
    }


def newest(groups: list[Group], key: str) -> float | None:
    values = [g.timings.get(key) for g in groups if g.timings.get(key) is not None]
    return values[-1] if values else None


def reward_means(groups: list[Group], metric_name: Callable[[str], str]) -> dict[str, float | None]:
    """Each reward function's mean over the batch, None values left out."""
    out = {}
    for key in groups[0].rewards_by_function:
        values = [v for g in groups for v in g.rewards_by_function.get(key, []) if v is not None]
        out[f"reward/{metric_name(key)}"] = float(np.mean(values)) if values else None
    return out


class MetricsFile:
    """`metrics.jsonl`, appended a line per step. A learner that resumes from the
    checkpoint of step N first drops the lines of later steps, so that a step number never
    appears twice."""

    def __init__(self, path: Path, resume_at: int | None = None) -> None:
        if resume_at is not None:
            keep_metrics_until(path, resume_at)
        self.file = open(path, "a")

    def write(self, metrics: dict[str, Any]) -> None:
        self.file.write(json.dumps(metrics) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def keep_metrics_until(path: Path, step: int) -> None:
    """Drop metrics lines of steps after `step`, and a last line cut short by a kill."""
    if not path.exists():
        return
    lines = [line for line in path.read_text().splitlines(keepends=True)
             if line.endswith("\n") and (n := _step_of(line)) is not None and n <= step]
    write_atomic(path, "".join(lines))


def _step_of(line: str) -> int | None:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return None

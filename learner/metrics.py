"""What the learner reports: one JSON line per optimizer step in `RUN/metrics.jsonl`
(docs/run-directory.md lists every key)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from learner.batching import TrainRow
from learner.groups import Group
from runtime.rundir import write_atomic

log = logging.getLogger("learner")


def batch_metrics(
    groups: list[Group],
    samples: list[TrainRow],
    rewards: np.ndarray,
    advantages: np.ndarray,
    step: int,
    metric_name: Callable[[str], str],
) -> dict[str, Any]:
    """What a batch says before any optimizer step, under TRL's names where TRL has the
    metric (docs/run-directory.md, "Metrics"): its rewards, completions and how stale it was at `step`,
    and what the actor measured sampling it.

    As in TRL, a completion that every reward function left unscored (its reward NaN, as
    the scorer marks it) is left out of `reward` and `reward_std`, and a function's None
    values out of its own statistics; standard deviations are the sample ones (n - 1)."""
    lens = np.array([s.trained_tokens for s in samples])  # an episode's: the model's tokens
    stopped = np.array([s.finish_reason != "length" for s in samples])  # TRL: not truncated
    scored = rewards.astype(np.float64)
    # A group with fewer than two scored completions has no std (TRL: NaN, not close to 0).
    group_std = np.array([np.nan if (std := nanstd(row)) is None else std for row in scored])
    gen_s = sum(g.gen_s for g in groups)
    actor_peaks = [g.actor_peak_mb for g in groups if g.actor_peak_mb is not None]
    terminated = lens[stopped] if stopped.any() else np.zeros(1)
    return {
        "reward": nanmean(scored.ravel()),
        "reward_std": nanstd(scored.ravel()),
        # The range the rewards took: `orchestrator plot` keeps the ± std band inside it.
        "reward_min": nanmin(scored.ravel()),
        "reward_max": nanmax(scored.ravel()),
        **function_rewards(groups, metric_name),
        # TRL: is the group's std close to 0 (torch.isclose), per completion, i.e. per group here
        "frac_reward_zero_std": float(np.mean(np.isclose(group_std, 0.0))),
        "completions/mean_length": float(lens.mean()),
        "completions/min_length": float(lens.min()),
        "completions/max_length": float(lens.max()),
        "completions/clipped_ratio": float(np.mean(~stopped)),
        "completions/mean_terminated_length": float(terminated.mean()),
        "completions/min_terminated_length": float(terminated.min()),
        "completions/max_terminated_length": float(terminated.max()),
        "advantage_mean": float(advantages.mean()),
        "advantage_std": float(advantages.std()),
        "version_lag_mean": float(np.mean([step - g.policy_version for g in groups])),
        "rollout_tokens_per_s": float(lens.sum()) / gen_s if gen_s > 0 else None,
        "rollout_gen_s": gen_s,  # the actors' sampling seconds for this batch, summed
        # as the actor measured them for the weights it sampled this batch with
        "weights_transfer_s": newest(groups, "weights_transfer_s"),
        "weights_apply_s": newest(groups, "weights_apply_s"),
        "actor_peak_mb": max(actor_peaks) if actor_peaks else None,
        **episode_metrics(groups),
    }


def episode_metrics(groups: list[Group]) -> dict[str, float]:
    """For episodes: model turns per episode, how episodes ended (a fraction per finish
    reason), and how many the actor had to start again so far."""
    if groups[0].turns is None:
        return {}
    turns = [sum(m["role"] == "assistant" for m in t) for g in groups for t in g.turns or []]
    reasons = [r for g in groups for r in g.finish_reasons]
    out = {
        "episodes/mean_model_turns": float(np.mean(turns)),
        "env_retries": max(g.env_retries or 0 for g in groups),
    }
    if any(g.agent_splits is not None for g in groups):
        out["agent/splits"] = max(g.agent_splits or 0 for g in groups)
    for reason in sorted(set(reasons)):
        out[f"episodes/finish/{reason}"] = reasons.count(reason) / len(reasons)
    return out


def batch_tokens(samples: list[TrainRow]) -> int:
    """Prompt and completion tokens of a batch: what TRL's `num_tokens` adds up."""
    return sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)


def nanmean(x: np.ndarray) -> float | None:
    x = x[~np.isnan(x)]
    return float(x.mean()) if x.size else None


def nanmin(x: np.ndarray) -> float | None:
    x = x[~np.isnan(x)]
    return float(x.min()) if x.size else None


def nanmax(x: np.ndarray) -> float | None:
    x = x[~np.isnan(x)]
    return float(x.max()) if x.size else None


def nanstd(x: np.ndarray) -> float | None:
    """The sample standard deviation (n - 1) of the values that are not NaN, as TRL's
    `nanstd`; None (TRL: NaN) with fewer than two."""
    x = x[~np.isnan(x)]
    return float(x.std(ddof=1)) if x.size > 1 else None


def newest(groups: list[Group], key: str) -> float | None:
    values = [g.timings.get(key) for g in groups if g.timings.get(key) is not None]
    return values[-1] if values else None


def function_rewards(groups: list[Group], metric_name: Callable[[str], str]) -> dict[str, float | None]:
    """`rewards/<name>/mean` and `/std` of each reward function's own (unweighted) scores
    over the batch, its None values left out."""
    out = {}
    for key in groups[0].rewards_by_function:
        scores = [v for g in groups for v in g.rewards_by_function.get(key, [])]
        values = np.array([np.nan if v is None else v for v in scores], dtype=np.float64)
        out[f"rewards/{metric_name(key)}/mean"] = nanmean(values)
        out[f"rewards/{metric_name(key)}/std"] = nanstd(values)
    return out


def completion_rows(
    step: int,
    groups: list[Group],
    advantages: np.ndarray,
    metric_name: Callable[[str], str],
    tokens: bool = False,
) -> list[dict[str, Any]]:
    """`completions.jsonl` lines for `groups`, trained at `step`: one per completion, with
    what a user needs to judge it (docs/run-directory.md); with `tokens`, the prompt's and
    the completion's token ids, the loss mask and the behavior logprobs as trained."""
    rows, first = [], 0  # first: the group's first completion's place in `advantages`
    for g in groups:
        assert g.rewards is not None  # a batch's groups are scored
        for i, text in enumerate(g.texts):
            rows.append(
                {
                    "step": step,
                    "policy_version": g.policy_version,
                    "group_id": g.group_id,
                    "index": i,
                    "prompt": g.prompt,
                    "completion": text,
                    "finish_reason": g.finish_reasons[i],
                    "tokens": len(g.completion_ids[i]),
                    **({} if g.turns is None else {"turns": g.turns[i]}),
                    "reward": None if np.isnan(g.rewards[i]) else float(g.rewards[i]),  # NaN: unscored
                    "rewards": {metric_name(k): v[i] for k, v in g.rewards_by_function.items()},
                    "advantage": float(advantages[first + i]),
                    **(token_fields(g, i) if tokens else {}),
                }
            )
        first += len(g.texts)
    return rows


def token_fields(g: Group, i: int) -> dict[str, Any]:
    mask = g.loss_masks[i] if g.loss_masks is not None else np.ones(len(g.completion_ids[i]), dtype=np.uint8)
    return {
        "prompt_ids": g.prompt_ids.tolist(),
        "completion_ids": g.completion_ids[i].tolist(),
        "loss_mask": mask.tolist(),
        "logprobs": g.logprobs[i].tolist(),
    }


class MetricsFile:
    """A JSON-lines file of the run (`metrics.jsonl`, `completions.jsonl`), appended. A
    learner that resumes from the checkpoint of step N first drops the lines of later
    steps, so that a step never appears twice."""

    def __init__(self, path: Path, resume_at: int | None = None, reporters: list | None = None) -> None:
        """`reporters`: the `log.report_to` backends, which get every line too."""
        if resume_at is not None:
            keep_metrics_until(path, resume_at)
        self.file = open(path, "a")
        self.reporters = reporters or []

    def write(self, metrics: dict[str, Any]) -> None:
        self.file.write(json.dumps(metrics) + "\n")
        self.file.flush()
        for reporter in self.reporters:
            reporter.write(metrics)

    def close(self) -> None:
        self.file.close()
        for reporter in self.reporters:
            reporter.close()


class CompletionsFile(MetricsFile):
    """`completions.jsonl`: the first `groups` groups of a batch, when one of the steps it
    trains is a multiple of `every` (log.completions_every)."""

    def __init__(
        self, path: Path, every: int, groups: int, resume_at: int | None = None, tokens: bool = False
    ) -> None:
        super().__init__(path, resume_at)
        self.every, self.groups, self.tokens = every, groups, tokens

    def write_batch(
        self,
        first_step: int,
        iterations: int,
        groups: list[Group],
        advantages: np.ndarray,
        metric_name: Callable[[str], str],
    ) -> None:
        if any(s % self.every == 0 for s in range(first_step, first_step + iterations)):
            rows = completion_rows(first_step, groups[: self.groups], advantages, metric_name, self.tokens)
            for row in rows:
                self.write(row)


class StatusFile:
    """`status.json`: where the learner stands, for `up` and other watchers. A write that
    fails (no descriptor left in a flood, a full disk) is said once; the next may succeed."""

    def __init__(self, path: Path) -> None:
        self.path, self.failing = path, False

    def write(self, status: dict[str, Any]) -> None:
        try:
            write_atomic(self.path, json.dumps(status) + "\n")
            self.failing = False
        except OSError as e:
            if not self.failing:
                log.error("cannot write status.json: %s; trying again with the next status", e)
            self.failing = True


def plan_shares(run_dir: Path) -> dict[str, float]:
    """The memory plan's share of each process (`up` writes plan.json), as metrics."""
    plan = run_dir / "plan.json"
    shares = json.loads(plan.read_text())["shares_mb"] if plan.exists() else {}
    return {f"{k}_share_mb": v for k, v in shares.items()}


def keep_metrics_until(path: Path, step: int) -> None:
    """Drop metrics lines of steps after `step`, and a last line cut short by a kill."""
    if not path.exists():
        return
    lines = [
        line
        for line in path.read_text().splitlines(keepends=True)
        if line.endswith("\n") and (n := _step_of(line)) is not None and n <= step
    ]
    write_atomic(path, "".join(lines))


def _step_of(line: str) -> int | None:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return None

"""Evaluation both processes do: sample n completions of each prompt, and summarise their
scores as pass@k (the unbiased estimator) and the eval/* metrics. The learner evaluates
during training ([eval], learner/evaluator.py); `actor sample` and `actor eval` run alone.
Scoring is the caller's (a Scorer): the learner shares its reward socket with training.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import IO

import numpy as np

from policy.data import Prompt, load_prompts
from policy.engine import sample_groups
from policy.sampler import Completion, Stopped
from runtime.config import Config, SamplingConfig


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of k completions, drawn without replacement from n of
    which c pass, passes: 1 - C(n-c, k) / C(n, k), the unbiased estimator of Chen et al.
    (2021, "Evaluating Large Language Models Trained on Code")."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_ks(n: int) -> list[int]:
    """The k reported for n samples a prompt: 1, 2, 4, ... below n, and n."""
    return sorted({2**i for i in range(n.bit_length()) if 2**i < n} | {n})


def eval_metrics(
    rewards: list[list[float | None]], lengths: list[int], threshold: float, prefix: str = "eval/"
) -> dict[str, float | int | None]:
    """Summary of scored samples, one list of total rewards per prompt (None: unscored).
    A completion passes when its reward is at least `threshold`; an unscored one fails.
    pass@k is averaged over the prompts."""
    flat = [r for row in rewards for r in row if r is not None]
    n = min((len(row) for row in rewards), default=0)
    passed = [sum(r is not None and r >= threshold for r in row[:n]) for row in rewards]
    out: dict[str, float | int | None] = {
        f"{prefix}reward_mean": float(np.mean(flat)) if flat else None,
        f"{prefix}reward_std": float(np.std(flat)) if flat else None,
    }
    for k in pass_ks(n) if n else []:
        out[f"{prefix}pass@{k}"] = float(np.mean([pass_at_k(n, c, k) for c in passed]))
    out[f"{prefix}completions/mean_length"] = float(np.mean(lengths)) if lengths else None
    out[f"{prefix}prompts"] = len(rewards)
    return out


@dataclass
class Sampled:
    """One prompt's completions, decoded."""

    prompt: Prompt
    completions: list[Completion]
    texts: list[str]


@dataclass
class Tally:
    """How far a sampling pass has come: prompts done, and the batch under way counted by
    its decode steps (each at most max_tokens), for a fraction done and a time left."""

    total: int
    max_tokens: int
    done: int = 0
    tokens: int = 0
    batch: int = 0  # prompts in the batch under way
    steps: int = 0  # its decode steps so far
    start: float = dataclasses.field(default_factory=time.perf_counter)

    def fraction(self) -> float:
        under_way = self.batch * min(1.0, self.steps / max(1, self.max_tokens))
        return min(1.0, (self.done + under_way) / max(1, self.total))

    def summary(self) -> dict[str, float | int | None]:
        elapsed, f = time.perf_counter() - self.start, self.fraction()
        return {
            "done": self.done,
            "total": self.total,
            "tokens_per_s": self.tokens / elapsed if elapsed else 0.0,
            "elapsed_s": elapsed,
            "eta_s": elapsed * (1 - f) / f if f > 0 else None,
        }


Report = Callable[[Tally], None]


class Progress:
    """ "sampling N/M prompts": rewritten in place on a terminal; into a file or a pipe, a
    line every PROGRESS_EVERY_S and the last one (no carriage returns in a log)."""

    EVERY_S = 10.0

    def __init__(self, err: IO[str] | None, total: int) -> None:
        self.err, self.total = err, total
        self.tty = err is not None and hasattr(err, "isatty") and err.isatty()
        self.last, self.pending = time.monotonic(), ""

    def show(self, done: int, rate: float) -> None:
        if self.err is None:
            return
        text = f"sampling {done}/{self.total} prompts  {rate:.0f} tok/s"
        if self.tty:
            print(f"\r{text}", end="", file=self.err, flush=True)
        elif time.monotonic() - self.last >= self.EVERY_S or done == self.total:
            print(text, file=self.err, flush=True)
            self.last = time.monotonic()

    def close(self) -> None:
        if self.tty:
            print(file=self.err)


def sample_prompts(
    model,
    tok,
    prompts: list[Prompt],
    num_samples: int,
    params: SamplingConfig,
    seed: int,
    err: IO[str] | None = None,
    stopping: Callable[[], bool] | None = None,
    report: Report | None = None,
    report_every_s: float = 1.0,
) -> tuple[list[Sampled], float]:
    """`num_samples` completions of each prompt, about 64 rows decoding as one batch; and
    the tokens per second. Row ids follow the prompt's position, so a prompt's samples
    depend only on the seed and the model. `stopping` is asked after every decode step
    (True: raise Stopped); `report` gets the tally at the start, then at most every
    `report_every_s` and at the end."""
    rows: list[Sampled] = []
    per_batch = max(1, 64 // num_samples)
    progress = Progress(err, len(prompts))
    tally = Tally(len(prompts), params.max_tokens)
    last = time.monotonic()

    def watch(live: int) -> None:
        nonlocal last
        tally.tokens, tally.steps = tally.tokens + live, tally.steps + 1
        if stopping is not None and stopping():
            raise Stopped
        if report is not None and time.monotonic() - last >= report_every_s:
            report(tally)
            last = time.monotonic()

    if report is not None:
        report(tally)
    for start in range(0, len(prompts), per_batch):
        batch = prompts[start : start + per_batch]
        tally.batch, tally.steps = len(batch), 0
        groups = sample_groups(
            model,
            [p.prompt_ids for p in batch],
            num_samples,
            params,
            set(tok.eos_token_ids),
            seed=seed,
            noise_offset=start * num_samples,
            watch=watch,
        )
        for p, completions in zip(batch, groups):
            texts = [tok.decode(c.token_ids, skip_special_tokens=True) for c in completions]
            rows.append(Sampled(p, completions, texts))
        tally.done, tally.batch = len(rows), 0
        tally.tokens = sum(len(c.token_ids) for r in rows for c in r.completions)  # exact, past the EOS steps
        progress.show(len(rows), tally.summary()["tokens_per_s"] or 0.0)
    progress.close()
    if report is not None:
        report(tally)
    elapsed = time.perf_counter() - tally.start
    return rows, tally.tokens / elapsed if elapsed > 0 else 0.0


def summarize(
    rows: list[Sampled], rewards_by_prompt: Mapping[str, list[float | None]], threshold: float, prefix: str
) -> dict:
    """eval_metrics over the scored prompts (their rewards keyed by prompt index; the
    caller scored them, rewards/scorer.py), and how many could not be scored."""
    rewards = [r for row in rows if (r := rewards_by_prompt.get(str(row.prompt.index))) is not None]
    lengths = [len(c.token_ids) for row in rows for c in row.completions]
    unscored = len(rows) - len(rewards)
    return {**eval_metrics(rewards, lengths, threshold, prefix), f"{prefix}unscored_prompts": unscored}


def eval_sampling(cfg: Config) -> SamplingConfig:
    """The run's sampling settings with [eval]'s temperature, length and seed."""
    e = cfg.eval
    return dataclasses.replace(
        cfg.sampling,
        temperature=e.temperature or cfg.sampling.temperature,
        max_tokens=e.max_tokens or cfg.sampling.max_tokens,
        seed=e.seed,
    )


def load_eval_prompts(cfg: Config, tok) -> list[Prompt]:
    if cfg.eval.prompts is None:
        raise ValueError("the config has no eval.prompts")
    prompts = load_prompts(
        cfg.eval.prompts, tok, cfg.sampling.max_prompt_tokens, cfg.data.split, cfg.data.prompt_column
    )
    return prompts[: cfg.eval.limit or None]

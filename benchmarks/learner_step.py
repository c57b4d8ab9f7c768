"""Row 2: learner seconds per optimizer step on the tiny default's shape.

The batch is built from real samples of the tiny model (batch_size groups x G completions,
max_tokens from examples/tiny.toml), scored with the default task's reward, and then
`prepare` + `optimizer_step` are timed together, as the learner runs them once per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from benchmarks.common import log, median, timed, tiny_config
from runtime.config import Config


@dataclass
class LearnerResult:
    batch_size: int
    group_size: int
    max_tokens: int
    reps: int
    step_s: float  # median of prepare + optimizer_step
    prepare_s: float
    optimizer_step_s: float
    tokens: int  # completion tokens in the batch
    raw: dict = field(default_factory=dict)


def _real_batch(model, tokenizer, cfg: Config):
    """Sample batch_size groups with our sampler and score them: (samples, rewards)."""

    from learner.batching import TrainRow
    from policy.data import load_prompts
    from policy.engine import sample_groups
    from rewards.scorer import Scorer

    s = cfg.sampling
    d = cfg.data
    prompts = load_prompts(d.prompts, tokenizer, s.max_prompt_tokens, d.split, d.prompt_column)
    prompts = prompts[: cfg.train.batch_size]
    scorer = Scorer(cfg.reward)  # the config's rewards, scored as the learner scores them
    eos_ids = set(tokenizer.eos_token_ids)
    groups = sample_groups(model, [p.prompt_ids for p in prompts], s.group_size, s, eos_ids, s.seed)
    samples, rewards = [], []
    for p, group in zip(prompts, groups):
        ids = [c.token_ids for c in group]
        texts = [tokenizer.decode(t, skip_special_tokens=True) for t in ids]
        rewards.append(scorer.submit(str(p.index), p.prompt, texts, ids, p.columns).total)
        samples += [
            TrainRow(
                np.array(p.prompt_ids, np.int32),
                np.array(c.token_ids, np.int32),
                np.array(c.logprobs, np.float32),
                c.finish_reason,
            )
            for c in group
        ]
    return samples, np.array(rewards, dtype=np.float64)


def run(reps: int) -> LearnerResult:
    from learner.batching import make_batch
    from learner.trainer import Trainer
    from policy.model import load_policy

    cfg = tiny_config()
    s, t = cfg.sampling, cfg.train
    model, tokenizer, _ = load_policy(cfg.model.path, cfg.lora)
    samples, rewards = _real_batch(model, tokenizer, cfg)
    model.train()
    trainer = Trainer(model, cfg.algorithm, t, s)
    advantages = trainer.algorithm.advantages(rewards)
    batch = make_batch(samples, tokenizer.pad_token_id or 0)
    log(f"learner step: {t.batch_size} groups x G {s.group_size}, {reps} timed steps")
    prep_times, step_times = [], []
    for i in range(reps + 1):  # the first step is a warm-up (allocations, optimizer state)
        prepared, prep_s = timed(lambda: trainer.prepare(batch))
        _, opt_s = timed(lambda p=prepared: trainer.step(p, advantages))
        if i > 0:
            prep_times.append(prep_s)
            step_times.append(opt_s)
    totals = [p + o for p, o in zip(prep_times, step_times)]
    return LearnerResult(
        t.batch_size,
        s.group_size,
        s.max_tokens,
        reps,
        median(totals),
        median(prep_times),
        median(step_times),
        sum(len(x.completion_ids) for x in samples),
        raw={"step_s": totals, "prepare_s": prep_times, "optimizer_step_s": step_times},
    )

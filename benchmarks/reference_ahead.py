"""The learner's reference logprobs of groups still being sampled (learner/ahead.py): what
the work of one batch costs the learner, run as it does now (each forward takes the new
tokens of every row still sampled, batched), as it did before (a forward a group), and as
the step's own reference pass (Trainer.reference_logprobs of each whole group).

    python -m benchmarks.reference_ahead           # e2e_lengths' first-shape model, 21 M
    python -m benchmarks.reference_ahead --quick   # a small shape: checks the harness

The workload is a batch as an overlapped actor samples it: 8 groups x G 4, completions
geometric (mean 74, max 512), the groups starting 24 decode steps apart (rows join as
others end), a `partial` of every group still decoding every 16 decode steps, and each
group's rollout the step its longest row ends. The learner runs all the work there is at
each partial (as a learner that would otherwise wait) and each rollout's tail when it
arrives. One BLAS thread, as the learner has in an overlapped run on a 2-core CPU. The
batched logprobs are checked against the step's own pass.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks.common import harness, write_results
from benchmarks.learner_lengths import QUICK_SHAPE, SMALL_SHAPE, long_tail_lengths, samples_for
from benchmarks.learner_takes import one_blas_thread
from benchmarks.real_shape import flat_model

GROUPS, GROUP_SIZE, MEAN, MAX_TOKENS, PROMPT = 8, 4, 74, 512, 12
EVERY, APART = 16, 24  # decode steps between partials, and between two groups' starts
ACTOR = b"actor"
MODES = ("batched (now)", "a forward a group (before)", "the step's own pass")


def partial(rows: list, name: str, tokens: int):
    from protocol.messages import Partial

    return Partial.of(name, rows[0].prompt_ids, [r.completion_ids[:tokens] for r in rows])


def ahead(trainer, groups: list[list], batched: bool) -> tuple[float, list]:
    """Seconds of the learner's work for the batch's reference logprobs from partials,
    and each group's. Not batched: a ReferenceAhead a group, so a forward takes one
    group's rows."""
    from learner.ahead import ReferenceAhead
    from learner.groups import Group

    def one() -> ReferenceAhead:
        return ReferenceAhead(trainer, budget_mb=256, max_tokens=MAX_TOKENS)

    holders = [one()] * len(groups) if batched else [one() for _ in groups]
    ends = [APART * i + max(len(r.completion_ids) for r in g) for i, g in enumerate(groups)]
    arrived: list = [None] * len(groups)
    seconds = 0.0
    for step in range(EVERY, max(ends) + EVERY, EVERY):
        t0 = time.perf_counter()
        for i, g in enumerate(groups):
            if APART * i < step < ends[i]:
                holders[i].offer(ACTOR, partial(g, str(i), step - APART * i))
        for h in set(holders):
            while h.run_one():
                pass
        for i, g in enumerate(groups):  # rollouts whose longest row ended by now
            if arrived[i] is None and ends[i] <= step:
                arrived[i] = Group.of_rows(ACTOR, str(i), g)
                holders[i].take([arrived[i]])
        seconds += time.perf_counter() - t0
    return seconds, [g.reference for g in arrived]


def measure(model_path: Path, shape: dict, repeats: int, seed: int) -> dict[str, list[float]]:
    from learner.trainer import Trainer
    from policy.model import load_policy
    from runtime.config import AlgorithmConfig, LoraConfig, SamplingConfig, TrainConfig

    one_blas_thread()
    model, _, _ = load_policy(str(model_path), LoraConfig(rank=8))
    sampling = SamplingConfig(temperature=0.7, max_tokens=MAX_TOKENS)
    trainer = Trainer(model, AlgorithmConfig(beta=0.04), TrainConfig(), sampling)
    out: dict[str, list[float]] = {m: [] for m in MODES}
    for rep in range(repeats + 1):  # the first: a warm-up
        lengths = long_tail_lengths(GROUPS * GROUP_SIZE, MEAN, MAX_TOKENS, seed + rep)
        rows = samples_for(lengths, GROUPS, PROMPT, shape["vocab_size"], seed + rep)
        groups = [rows[i * GROUP_SIZE : (i + 1) * GROUP_SIZE] for i in range(GROUPS)]
        batched, got = ahead(trainer, groups, batched=True)
        apart, _ = ahead(trainer, groups, batched=False)
        t0 = time.perf_counter()
        own = [trainer.reference_logprobs(g) for g in groups]
        whole = time.perf_counter() - t0
        for mine, theirs in zip(got, own):  # the same logprobs, or the timing means nothing
            for a, b in zip(mine, theirs):
                assert np.abs(a - b).max() < 1e-3, np.abs(a - b).max()
        if rep:
            for mode, s in zip(MODES, (batched, apart, whole)):
                out[mode].append(s)
    return out


def main(argv: list[str] | None = None) -> int:
    a = harness(__doc__).parse_args(argv)
    shape = QUICK_SHAPE if a.quick else SMALL_SHAPE
    repeats = 1 if a.quick else a.repeats
    model = flat_model(a.models_dir, shape)
    runs = measure(model, shape, repeats, seed=0)
    base = statistics.median(runs[MODES[0]])
    lines = [
        f"Reference logprobs of one batch from partials, {model.name}: {GROUPS} groups x G "
        f"{GROUP_SIZE}, geometric lengths (mean {MEAN}, max {MAX_TOKENS}), groups {APART} decode "
        f"steps apart, a partial every {EVERY}; one BLAS thread; medians of {repeats} repeats\n",
        "| run | learner's seconds | vs batched |",
        "|---|---|---|",
        *(
            f"| {m} | {statistics.median(s):.2f} | {statistics.median(s) / base:.2f}x |"
            for m, s in runs.items()
        ),
    ]
    stem = "reference_ahead_quick" if a.quick else "reference_ahead"
    write_results(a.results_dir, stem, {"model": str(model), "runs": runs}, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

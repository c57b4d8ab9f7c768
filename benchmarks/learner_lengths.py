"""The learner's step on real lengths, each way of forming its forwards side by side:

- padded: the whole batch padded to its longest row, every row with its own prompt (as
  before 0.3: `train.sort_by_length = false`, `train.share_prompts = false`);
- by length: micro-batches of rows of similar length, each padded to its own longest;
- shared prompts: by length, and each group's prompt run once (the default).

    python -m benchmarks.learner_lengths            # Qwen3-shaped, small: 16,384 vocab, 512 x 4
    python -m benchmarks.learner_lengths --quick    # smaller and one repeat: checks the harness
    python -m benchmarks.learner_lengths --only agent-like    # one workload (3 minutes)

Three workloads (issue 23). Long tail: 8 prompts of 32 tokens x G 8, completion lengths
geometric with mean 64 and cut at 512 (reasoning traces). Prompt-heavy: 4 prompts of 512
tokens x G 8, 64-token completions (an agent's system prompt and tools). Agent-like: the
prompt-heavy prompts with the long tail's completion lengths (a group's rows then go to
several micro-batches, its prompt run once for all of them). Each batch is
drawn once; every mode runs the same Trainer (beta 0.04: the reference forward too; one
step per batch: the old-policy logprobs fused), interleaved repeat by repeat on one model,
the first repeat a warm-up. It prints medians (min-max), the speed against padded,
`learner/padding_ratio` and the peak memory of each, and writes
`benchmarks/results/learner_lengths[_quick][_<workload>].json` and `.md`.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import harness, log, write_results
from benchmarks.real_shape import LOGIT_SCALE, build_model, parameters

SMALL_SHAPE = dict(
    hidden_size=512,
    num_hidden_layers=4,
    intermediate_size=1536,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    vocab_size=16384,
)
QUICK_SHAPE = dict(
    hidden_size=128,
    num_hidden_layers=2,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=4096,
)
MODES = {
    "padded": dict(sort_by_length=False, share_prompts=False),
    "by length": dict(sort_by_length=True, share_prompts=False),
    "shared prompts": dict(sort_by_length=True, share_prompts=True),
}


def long_tail_lengths(rows: int, mean: float, cap: int, seed: int) -> np.ndarray:
    """Geometric completion lengths with `mean`, cut at `cap`."""
    return np.minimum(np.random.default_rng(seed).geometric(1 / mean, rows), cap)


def samples_for(lengths: np.ndarray, groups: int, prompt_tokens: int, vocab: int, seed: int) -> list:
    """Rows of random ids: one prompt per group, the given completion lengths."""
    from learner.batching import TrainRow

    rng = np.random.default_rng(seed)
    g = len(lengths) // groups
    prompts = [rng.integers(2, vocab, prompt_tokens) for _ in range(groups)]
    return [
        TrainRow(prompts[i // g], rng.integers(2, vocab, n), np.full(n, -2.0, np.float32), "stop")
        for i, n in enumerate(lengths)
    ]


def measure(
    model_path: Path, samples: list, rewards: np.ndarray, repeats: int, modes: dict[str, dict]
) -> dict[str, dict]:
    """Each mode's step seconds (prepare + optimizer step), padding ratio and peak MB."""
    import mlx.core as mx

    from learner.batching import make_batch
    from learner.trainer import Trainer
    from policy.model import load_policy
    from runtime.config import AlgorithmConfig, LoraConfig, SamplingConfig, TrainConfig

    mx.random.seed(0)
    model, _, _ = load_policy(str(model_path), LoraConfig(rank=8))
    model.train()
    batch = make_batch(samples, 0)
    sampling = SamplingConfig(temperature=0.7, max_tokens=int(batch.lengths.max()))
    trainers = {
        name: Trainer(model, AlgorithmConfig(beta=0.04), TrainConfig(**settings), sampling)
        for name, settings in modes.items()
    }
    out: dict[str, dict] = {name: {"step_s": [], "peak_mb": []} for name in modes}
    for rep in range(repeats + 1):  # the first: a warm-up
        for name, trainer in trainers.items():
            mx.clear_cache()
            mx.reset_peak_memory()
            t0 = time.perf_counter()
            prepared = trainer.prepare(batch)
            trainer.step(prepared, trainer.algorithm.advantages(rewards))
            seconds = time.perf_counter() - t0
            log(f"  {name}: {seconds:.2f} s ({len(prepared.micro)} micro-batches)")
            out[name]["padding_ratio"] = prepared.stats["learner/padding_ratio"]
            out[name]["micro_batches"] = len(prepared.micro)
            if rep:
                out[name]["step_s"].append(seconds)
                out[name]["peak_mb"].append(mx.get_peak_memory() / 2**20)
    return out


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def table(runs: dict[str, dict]) -> str:
    """Each mode's row; speeds against the first mode."""
    first = next(iter(runs))
    base = statistics.median(runs[first]["step_s"])
    lines = [
        f"| learner step | s, median (min-max) | speed vs {first} | padding_ratio | micro-batches "
        "| peak MB |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        speed = base / statistics.median(r["step_s"])
        lines.append(
            f"| {name} | {spread(r['step_s'])} | {speed:.2f}x | {r['padding_ratio']:.2f} | "
            f"{r['micro_batches']} | {statistics.median(r['peak_mb']):.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = harness(__doc__)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--mean", type=float, default=64, help="mean completion length (geometric)")
    p.add_argument("--max-tokens", type=int, default=512, help="the longest completion")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", help="one workload by name, e.g. 'agent-like' (results *_<name>.md)")
    a = p.parse_args(argv)
    shape = QUICK_SHAPE if a.quick else SMALL_SHAPE
    if a.quick:
        a.repeats, a.groups, a.group_size, a.max_tokens = 1, 4, 4, 256
    name = (
        f"qwen3-{shape['vocab_size']}-{shape['hidden_size']}x{shape['num_hidden_layers']}-float32-"
        f"x{LOGIT_SCALE:g}"
    )
    model = build_model(a.models_dir / name, shape, None, "float32")
    rows = a.groups * a.group_size
    heavy_groups, heavy_prompt = (2, 128) if a.quick else (4, 512)
    tail = long_tail_lengths(rows, a.mean, a.max_tokens, a.seed)
    workloads = {
        "long tail": (a.groups, a.prompt_tokens, tail, MODES),
        "prompt-heavy": (
            heavy_groups,
            heavy_prompt,
            np.full(heavy_groups * a.group_size, 64),
            {k: v for k, v in MODES.items() if k != "padded"},
        ),
        # An agent's long system prompt and a long tail of answers: a group's rows go to
        # several micro-batches by length, and its prompt runs once for all of them.
        "agent-like": (
            heavy_groups,
            heavy_prompt,
            long_tail_lengths(heavy_groups * a.group_size, a.mean, a.max_tokens, a.seed),
            {k: v for k, v in MODES.items() if k != "padded"},
        ),
    }
    if a.only:
        if a.only not in workloads:
            p.error(f"--only: no workload {a.only!r}; there are {', '.join(map(repr, workloads))}")
        workloads = {a.only: workloads[a.only]}
    started, out = time.time(), {"shape": shape, "args": {k: str(v) for k, v in vars(a).items()}, "runs": {}}
    report = [
        f"Learner step, Qwen3-shaped model of {parameters(shape) / 1e6:.0f} M parameters (vocabulary "
        f"{shape['vocab_size']}), float32, beta 0.04, G {a.group_size}; medians of {a.repeats} repeats "
        f"after a warm-up\n"
    ]
    for workload, (groups, prompt_tokens, lengths, modes) in workloads.items():
        samples = samples_for(lengths, groups, prompt_tokens, shape["vocab_size"], a.seed)
        rewards = np.random.default_rng(a.seed).random((groups, a.group_size))
        what = (
            f"{groups} prompts of {prompt_tokens} tokens x G {a.group_size}, completions mean "
            f"{lengths.mean():.0f}, median {np.median(lengths):.0f}, max {lengths.max()}"
        )
        log(f"{workload}: {what}")
        runs = measure(model, samples, rewards, a.repeats, modes)
        out["runs"][workload] = {"lengths": lengths.tolist(), "prompt_tokens": prompt_tokens, **runs}
        report += [f"\n### {workload}: {what}\n\n", table(runs)]
    out["wall_s"] = time.time() - started
    stem = "learner_lengths_quick" if a.quick else "learner_lengths"
    stem += f"_{a.only.replace('-', '_')}" if a.only else ""
    write_results(a.results_dir, stem, out, "".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

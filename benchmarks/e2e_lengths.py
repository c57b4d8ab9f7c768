"""Whole runs under long-tailed completion lengths: this project against mlxrl, against
its own paths before the continuous engine, and against the same run at uniform lengths.

    python -m benchmarks.e2e_lengths            # Qwen3-shaped, 16,384 vocabulary
    python -m benchmarks.e2e_lengths --quick    # smaller, one repeat: checks the harness
    python -m benchmarks.e2e_lengths --pair --shape flat --mean 59 --max-tokens 256
        # long tail and uniform at max_staleness 1 only, on a flat 101 M model, V = 512
    python -m benchmarks.e2e_lengths --pair --staleness 2    # the pair at max_staleness 2

The model is built offline with random weights and a nearly flat next-token distribution,
in two copies that differ only in config.json's `eos_token_id` (every system here reads
its EOS set from there, mlxrl included):

- long tail: V/64 EOS ids, so completion lengths are geometric, cut at 512, as reasoning
  traces are. Their mean comes out longer than 64 (74 here; 101 on the flat shape at
  `--mean 59`, where it grows as the run learns): under these random weights, temperature
  and top-p, the EOS ids are drawn less often than their V/64 share;
- uniform: one EOS (a 1/V chance a step) and `max_tokens` = the mean completion length the
  same repeat's long-tail run measured: nearly every completion at the long tail's mean, so
  that the two runs' tokens/s compare the same tokens a completion.

Each repeat runs, interleaved, `orchestrator up` (real processes) with a batch of 8
prompts x G 4 a step, temperature 0.7, top-p 0.95, beta 0.04, LoRA rank 8:

- long tail at `max_staleness` 0, 1 and 2 (the defaults: continuous engine, micro-batches
  by length, each prompt once);
- long tail at `max_staleness` 1 "before": `actor.engine = "static"`,
  `train.sort_by_length = false`, `train.share_prompts = false` (the paths this project
  had when issue 22 was filed);
- uniform at `max_staleness` 1;
- mlxrl 0.2.4's loop on its best path (prefix-cached rollout, compiled decode step), the
  same 8 prompts a step, on the long-tail model (skipped when mlxrl is not installed).

The first step of every run is a warm-up and is left out. Reported: it/s, completion
tokens/s, the long tail's over uniform's, and where each run's time went (the timeline's
busy and waiting shares of the learner and the actor).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import harness, log, timeline_table, write_results
from benchmarks.learner_lengths import QUICK_SHAPE, SMALL_SHAPE
from benchmarks.real_shape import (
    flat_model,
    have_mlxrl,
    long_tail_copy,
    parameters,
    run_mlxrl,
    run_ours,
)

# A flat random model of 101 M parameters under a 512-token vocabulary: nearly all of its
# cost is in the blocks, none in the logits (the other shape's case is the opposite).
FLAT_SHAPE = dict(
    hidden_size=1024,
    num_hidden_layers=8,
    intermediate_size=3072,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=512,
)
BEFORE = ("actor.engine=static", "train.sort_by_length=false", "train.share_prompts=false")
WHOLE_BATCHES = ("train.stream_groups=false",)  # --pair: the learner waits for each whole batch


def table(runs: dict[str, list[dict]], k: int = 1) -> str:
    """it/s and completion tokens/s of each run; the long tail's over uniform's at `k`."""
    med = {
        name: {k: statistics.median(r[k] for r in rs) for k in ("it_s", "completion_tok_s")}
        for name, rs in runs.items()
        if rs
    }
    base = med.get("mlxrl")
    lines = [
        "| run | it/s | completion tok/s | it/s vs mlxrl | it/s vs before | groups dropped as stale |",
        "|---|---|---|---|---|---|",
    ]
    for name, m in med.items():
        vs_mlxrl = f"{m['it_s'] / base['it_s']:.2f}x" if base else "-"
        before = med.get("long tail, k=1, before")
        vs_before = f"{m['it_s'] / before['it_s']:.2f}x" if before else "-"
        stale = "-"
        if all("dropped_stale" in r for r in runs[name]):  # summed over repeats
            dropped, received = (
                sum(r[key] for r in runs[name]) for key in ("dropped_stale", "groups_received")
            )
            stale = f"{dropped} of {received}"
        lines.append(
            f"| {name} | {m['it_s']:.3f} | {m['completion_tok_s']:.0f} | {vs_mlxrl} | {vs_before} | {stale} |"
        )
    lengths = "; ".join(
        f"{name}: {statistics.mean(r['mean_length'] for r in rs):.0f}"
        for name, rs in runs.items()
        if rs and all("mean_length" in r for r in rs)
    )
    tail, uniform = med[f"long tail, k={k}"], med[f"uniform, k={k}"]
    lines.append("")
    text = (
        f"Long tail against uniform lengths, completion tokens/s at k={k}: "
        f"{tail['completion_tok_s'] / uniform['completion_tok_s']:.2f}x"
    )
    if (whole := med.get(f"long tail, k={k}, whole batches")) is not None:
        gain = tail["it_s"] / whole["it_s"]
        text += f"; learning groups as they arrive against whole batches: {gain:.2f}x it/s"
    if "long tail, k=1, before" in med:
        text += f"; it/s at k=1 against before: {tail['it_s'] / med['long tail, k=1, before']['it_s']:.2f}x"
    lines.append(text + ".")
    lines.append(f"\nMean completion length (tokens): {lengths}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = harness(__doc__)
    p.add_argument("--steps", type=int, default=6, help="steps a run, the first a warm-up")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--mean", type=int, default=64, help="V/mean EOS ids: odds of about 1/mean a step to stop")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument(
        "--pair",
        action="store_true",
        help="only the long tail and uniform runs at max_staleness 1 (no mlxrl), and the long tail "
        "with the learner waiting for whole batches (train.stream_groups = false)",
    )
    p.add_argument("--staleness", type=int, default=1, help="--pair: at this max_staleness")
    p.add_argument("--shape", choices=["small", "flat"], default="small", help="flat: FLAT_SHAPE, 101 M")
    a = p.parse_args(argv)
    shape = QUICK_SHAPE if a.quick else FLAT_SHAPE if a.shape == "flat" else SMALL_SHAPE
    if a.quick:
        a.repeats, a.steps, a.batch_size, a.group_size, a.max_tokens, a.mean = 1, 3, 2, 2, 64, 16
    uniform = flat_model(a.models_dir, shape)
    tail = long_tail_copy(uniform, a.mean)
    started = time.time()
    names = [
        "mlxrl",
        "long tail, k=0",
        "long tail, k=1",
        "long tail, k=2",
        "long tail, k=1, before",
        "uniform, k=1",
    ]
    k_pair = a.staleness if a.pair else 1
    if a.pair:
        names = [f"long tail, k={k_pair}", f"long tail, k={k_pair}, whole batches", f"uniform, k={k_pair}"]
    runs: dict[str, list[dict]] = {name: [] for name in names}
    bs = a.batch_size
    with tempfile.TemporaryDirectory(prefix="e2el") as tmp:
        work = Path(tmp)
        for r in range(a.repeats):
            if have_mlxrl() and not a.pair:
                runs["mlxrl"].append(run_mlxrl(tail, work, f"mlxrl{r}", a, "best", bs))
            for k in (k_pair,) if a.pair else (0, 1, 2):
                runs[f"long tail, k={k}"].append(run_ours(tail, work, f"k{k}r{r}", k, a, batch_size=bs))
            if a.pair:  # the learner waiting for each whole batch, as before it learned groups as they came
                whole = run_ours(tail, work, f"w{r}", k_pair, a, batch_size=bs, sets=WHOLE_BATCHES)
                runs[f"long tail, k={k_pair}, whole batches"].append(whole)
            else:
                before = run_ours(tail, work, f"b{r}", 1, a, batch_size=bs, sets=BEFORE)
                runs["long tail, k=1, before"].append(before)
            # Uniform at the mean the long tail measured, not at --mean: see the docstring.
            mean = round(runs[f"long tail, k={k_pair}"][-1]["mean_length"])
            uniform_args = _ns({**vars(a), "max_tokens": mean})
            runs[f"uniform, k={k_pair}"].append(
                run_ours(uniform, work, f"u{r}", k_pair, uniform_args, batch_size=bs)
            )
            log(f"repeat {r + 1} of {a.repeats} done")
    report = (
        f"End to end, Qwen3-shaped model of {parameters(shape) / 1e6:.0f} M parameters (vocabulary "
        f"{shape['vocab_size']}), float32, LoRA rank 8; {bs} prompts x G {a.group_size} a step, "
        f"completions geometric (EOS odds 1/{a.mean} a step, max {a.max_tokens}; uniform: every one "
        f"the long tail's measured mean); "
        f"{a.steps - 1} timed steps a run, medians of {a.repeats} repeats\n\n" + table(runs, k_pair)
    )
    report += (
        "\nWhere the time went (orchestrator timeline, shares of the timed steps):\n\n" + timeline_table(runs)
    )
    out = {
        "shape": shape,
        "args": {k: str(v) for k, v in vars(a).items()},
        "runs": runs,
        "wall_s": time.time() - started,
    }
    stem = "e2e_lengths_quick" if a.quick else "e2e_lengths" + ("_flat" if a.shape == "flat" else "")
    pair = ("_pair" if k_pair == 1 else f"_pair_k{k_pair}") if a.pair else ""
    write_results(a.results_dir, stem + pair, out, report)
    return 0


def _ns(values: dict):
    import argparse

    return argparse.Namespace(**values)


if __name__ == "__main__":
    sys.exit(main())

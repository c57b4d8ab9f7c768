"""What recording the timeline costs a run (log.timeline, on by default).

    python -m benchmarks.timeline_overhead            # examples/tiny.toml, 12 steps
    python -m benchmarks.timeline_overhead --quick    # 4 steps: checks the harness

Two measurements, in one run:
1. The cost of one span: `Timeline.span` around an empty block, timed over many spans
   writing to a real file (the same buffered writes a process makes).
2. A real run (`orchestrator up`, examples/tiny.toml: the smallest model, so the most
   spans per second of work): how many spans each process records per learner step.
The overhead is spans per step x cost per span, over the run's seconds per step: the
share of a step the recording takes. A whole run with the timeline on and off is also
timed, interleaved, as a check; on a shared machine its noise is larger than the effect.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import TINY_TOML, harness, log, write_results
from benchmarks.end_to_end import watch_up
from runtime.spans import Timeline


def span_cost(n: int = 100_000) -> float:
    """Seconds per recorded span (enter, exit, one JSON line)."""
    with tempfile.TemporaryDirectory() as tmp:
        tl = Timeline(Path(tmp) / "t.jsonl")
        t0 = time.perf_counter()
        for i in range(n):
            with tl.span("decode step", rows=i):
                pass
        cost = (time.perf_counter() - t0) / n
        tl.close()
    return cost


def run(work: Path, tag: str, steps: int, on: bool) -> dict:
    run_dir = work / tag
    args = ["--config", str(TINY_TOML), "--run-dir", str(run_dir), "--steps", str(steps)]
    args += ["--set", f"log.timeline={str(on).lower()}"]
    r = watch_up(args, run_dir, work / f"{tag}.out", 1, steps)
    if r.exit_code != 0:
        raise RuntimeError((work / f"{tag}.out").read_text()[-2000:])
    spans = (
        {p.stem: sum(1 for _ in p.open()) for p in sorted((run_dir / "timeline").glob("*.jsonl"))}
        if on
        else {}
    )
    return {"wall_s": r.wall_s, "s_per_step": (r.arrivals[-1] - r.arrivals[0]) / (steps - 1), "spans": spans}


def main(argv: list[str] | None = None) -> int:
    p = harness(__doc__)
    p.add_argument("--steps", type=int, default=12)
    a = p.parse_args(argv)
    if a.quick:
        a.repeats, a.steps = 1, 4
    cost = span_cost(20_000 if a.quick else 200_000)
    log(f"one span: {cost * 1e6:.2f} us")
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory(prefix="tl-") as tmp:
        for r in range(a.repeats):
            for on in (True, False):
                runs["on" if on else "off"].append(run(Path(tmp), f"{'on' if on else 'off'}{r}", a.steps, on))
    per_step = {
        k: statistics.median(x["spans"][k] / a.steps for x in runs["on"]) for k in runs["on"][0]["spans"]
    }
    s_per_step = statistics.median(x["s_per_step"] for x in runs["on"])
    overhead = {k: n * cost / s_per_step for k, n in per_step.items()}
    wall = statistics.median(x["wall_s"] for x in runs["on"]) / statistics.median(
        x["wall_s"] for x in runs["off"]
    )
    lines = [
        f"examples/tiny.toml, {a.steps} steps, {a.repeats} repeats; one span costs {cost * 1e6:.2f} us; "
        f"a step takes {s_per_step * 1e3:.0f} ms\n",
        "| process | spans per step | share of a step |",
        "|---|---|---|",
        *(f"| {k} | {per_step[k]:.0f} | {overhead[k]:.3%} |" for k in per_step),
        f"\nWhole run, timeline on / off (wall time, interleaved; noisy): {wall:.3f}x\n",
    ]
    out = {"span_cost_s": cost, "spans_per_step": per_step, "s_per_step": s_per_step, "overhead": overhead}
    out |= {"wall_on_over_off": wall, "runs": runs}
    write_results(
        a.results_dir, "timeline_overhead_quick" if a.quick else "timeline_overhead", out, "\n".join(lines)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

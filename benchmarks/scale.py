"""Scale-out on one machine: 1 vs 2 actors, 1 vs 2 learner ranks (issue 13).

    python -m benchmarks.scale              # 30 steps a run, 2 repeats: ~2 min on 2 cores
    python -m benchmarks.scale --quick      # 8 steps, 1 repeat: checks the harness works

Each run is `orchestrator up` on examples/tiny.toml (on-policy, batch 8 x 8), as it is,
with `actor.count = 2`, or with `learner.ranks = 2`; runs are interleaved so drift on a
shared machine spreads over all of them. The first step of every run is a warm-up and is
left out. The point at this shape is the mechanism and its overheads, not the speed-up:
this machine's cores are shared by every process, so two actors or two ranks compete for
them. Per configuration it prints the median steps/s and its ratio to one actor and one
rank, the learner's step time and (with ranks) the gradients' all-reduce time, the weight
fan-out (serialize once, transfer to each actor, apply), and how much of the wall time
the learner and (on average) each actor were busy. Everything goes to `benchmarks/results/scale[_quick].json`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from benchmarks.common import ROOT, TINY_TOML, log
from benchmarks.end_to_end import E2ERun, watch_up

CONFIGS = {
    "1 actor, 1 rank": [],
    "2 actors, 1 rank": ["--set", "actor.count=2"],
    "1 actor, 2 ranks": ["--set", "learner.ranks=2"],
}
RESULTS = ROOT / "benchmarks" / "results"


def median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(runs: list[E2ERun], actors: int) -> dict:
    """Medians over the repeats of one configuration (warm-up step left out)."""
    each = []
    for r in runs:
        m, measured = r.metrics[1:], r.arrivals[-1] - r.arrivals[0] if len(r.arrivals) > 1 else None
        each.append(
            {
                "steps_per_s": r.steps_per_s,
                "step_ms": median([1e3 * x["step_s"] for x in m]),
                "allreduce_ms": median([1e3 * x["allreduce_s"] for x in m if "allreduce_s" in x]),
                "weights_serialize_ms": median([1e3 * x["weights_serialize_s"] for x in m]),
                "weights_transfer_ms": median([1e3 * x.get("weights_transfer_s", 0) for x in m]),
                "weights_apply_ms": median([1e3 * x.get("weights_apply_s", 0) for x in m]),
                "learner_busy": sum(x["step_s"] for x in m) / measured if measured else None,
                # Sampling seconds of every group, over the wall time of every actor.
                "actor_busy": (
                    sum(x.get("rollout_gen_s", 0) for x in m) / (measured * actors) if measured else None
                ),
                "exit_code": r.exit_code,
            }
        )
    return {key: median([e[key] for e in each]) for key in each[0]} | {"runs": each}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    steps = args.steps or (8 if args.quick else 30)
    repeats = args.repeats or (1 if args.quick else 2)
    runs: dict[str, list[E2ERun]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="scale-") as work:
        for r in range(repeats):
            for i, (name, extra) in enumerate(CONFIGS.items()):
                run_dir = Path(work) / f"c{i}r{r}"
                log(f"{name} (repeat {r + 1}/{repeats}): {steps} steps")
                run = watch_up(
                    ["--config", str(TINY_TOML), "--steps", str(steps), "--run-dir", str(run_dir), *extra],
                    run_dir,
                    Path(work) / f"c{i}r{r}.out",
                    0,
                    steps,
                )
                if run.exit_code != 0:
                    log((Path(work) / f"c{i}r{r}.out").read_text()[-2000:])
                runs[name].append(run)
    results = {name: summarize(rs, 2 if "2 actors" in name else 1) for name, rs in runs.items()}
    base = results["1 actor, 1 rank"]["steps_per_s"]
    print(
        f"\n{steps} steps a run, {repeats} repeat(s), medians; examples/tiny.toml (batch 8 x 8, on-policy)\n"
    )
    print(
        "| configuration | steps/s | vs 1 actor, 1 rank | learner step ms | all-reduce ms | weights "
        "serialize / transfer / apply ms | learner busy | actor busy (each) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        ratio = r["steps_per_s"] / base if r["steps_per_s"] and base else None
        print(
            f"| {name} | {fmt(r['steps_per_s'], 3)} | {fmt(ratio, 2)}x | {fmt(r['step_ms'], 0)} | "
            f"{fmt(r['allreduce_ms'], 1)} | {fmt(r['weights_serialize_ms'], 2)} / "
            f"{fmt(r['weights_transfer_ms'], 2)} / {fmt(r['weights_apply_ms'], 2)} | "
            f"{fmt(r['learner_busy'], 2)} | {fmt(r['actor_busy'], 2)} |"
        )
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / ("scale_quick.json" if args.quick else "scale.json")
    out.write_text(json.dumps({"steps": steps, "repeats": repeats, "results": results}, indent=1) + "\n")
    print(f"\nwrote {out}")


def fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


if __name__ == "__main__":
    main()

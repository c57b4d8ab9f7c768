"""Rows 3 and 5: end-to-end steps/s for several train.max_staleness, and peak memory.

Each run is the real thing: `python -m orchestrator up` as a subprocess, which starts the
learner and the actor as their own processes talking over ipc:// sockets. The learner
appends one JSON line per optimizer step to RUN/metrics.jsonl; we watch that file and
note when each line appears. Steps/s is measured from the first line to the last, so
model loading, the handshake and the first (warm-up) step are left out.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import ROOT, TINY_TOML, log
from runtime.lifecycle import child_env

POLL_S = 0.01  # resolution of the line arrival times; runs last tens of seconds


@dataclass
class E2ERun:
    staleness: int
    steps: int
    exit_code: int
    wall_s: float  # the whole command, model loading included
    arrivals: list[float] = field(default_factory=list)  # perf_counter() per metrics line
    metrics: list[dict] = field(default_factory=list)

    @property
    def steps_per_s(self) -> float | None:
        if len(self.arrivals) < 2 or self.arrivals[-1] <= self.arrivals[0]:
            return None
        return (len(self.arrivals) - 1) / (self.arrivals[-1] - self.arrivals[0])

    def summary(self) -> dict:
        m = self.metrics
        last = m[-1] if m else {}
        step_s = [x["step_s"] for x in m[1:] if x.get("step_s") is not None]
        measured = self.arrivals[-1] - self.arrivals[0] if len(self.arrivals) > 1 else None
        return {
            "staleness": self.staleness,
            "steps": self.steps,
            "exit_code": self.exit_code,
            "wall_s": self.wall_s,
            "metrics_lines": len(m),
            "measured_s": measured,
            "steps_per_s": self.steps_per_s,
            # How much of the measured wall time the learner spent in its step (the rest
            # it waited for rollouts); tells whether overlap had anything to hide.
            "learner_busy_frac": sum(step_s) / measured if measured else None,
            "version_lag_mean": _mean([x.get("version_lag_mean") for x in m]),
            "groups_dropped": last.get("groups_dropped"),
            "dropped_reasons": last.get("dropped_reasons", {}),
            "learner_peak_mb": _max([x.get("learner_peak_mb") for x in m]),
            "actor_peak_mb": _max([x.get("actor_peak_mb") for x in m]),
            # The run's own weight-sync metrics (absent from older learners): the message
            # size, serialize on the learner, send -> decoded and apply on the actor.
            "weights_mb": last.get("weights_mb"),
            **{
                f"weights_{part}_ms": _median_ms([x.get(f"weights_{part}_s") for x in m[1:]])
                for part in ("serialize", "transfer", "apply")
            },
            "reward_first": m[0].get("reward") if m else None,
            "reward_last": last.get("reward"),
        }


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _median_ms(values: list) -> float | None:
    values = sorted(v for v in values if v is not None)
    return 1e3 * values[len(values) // 2] if values else None


def _max(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return max(values) if values else None


def _watch(proc: subprocess.Popen, metrics_path: Path, run: E2ERun) -> None:
    """Record the arrival time of every complete metrics line until the process exits."""
    offset = 0
    while True:
        alive = proc.poll() is None
        if metrics_path.exists():
            with open(metrics_path) as f:
                f.seek(offset)
                while (line := f.readline()).endswith("\n"):
                    offset = f.tell()
                    run.arrivals.append(time.perf_counter())
                    run.metrics.append(json.loads(line))
        if not alive:
            return
        time.sleep(POLL_S)


def watch_up(args: list[str], run_dir: Path, out_path: Path, staleness: int, steps: int) -> E2ERun:
    """Run `orchestrator up ARGS` (output to `out_path`) and record its metrics lines as
    they arrive in `run_dir`."""
    with open(out_path, "w") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator", "up", *args],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=child_env(),
        )
        run = E2ERun(staleness, steps, -1, 0.0)
        try:
            _watch(proc, run_dir / "metrics.jsonl", run)
        finally:
            if proc.poll() is None:  # interrupted: stop the run we started, and only it
                proc.terminate()
                proc.wait()
        run.exit_code, run.wall_s = proc.returncode, time.perf_counter() - t0
    return run


def run_once(staleness: int, steps: int, work_dir: Path, tag: str) -> E2ERun:
    run_dir = work_dir / f"k{staleness}-{tag}"  # short: ipc socket paths must stay < 100 bytes
    out = work_dir / f"k{staleness}-{tag}.out"
    log(f"end-to-end max_staleness={staleness} ({tag}): {steps} steps")
    run = watch_up(
        [
            "--config",
            str(TINY_TOML),
            "--steps",
            str(steps),
            "--run-dir",
            str(run_dir),
            "--set",
            f"train.max_staleness={staleness}",
        ],
        run_dir,
        out,
        staleness,
        steps,
    )
    if run.exit_code != 0:
        log(f"  run failed with exit code {run.exit_code}; see {out}:\n" + out.read_text()[-2000:])
    return run


def run(staleness_values: tuple[int, ...], steps: int, repeats: int, work_dir: Path) -> list[E2ERun]:
    """Interleave the values (0, 1, 2, 0, 1, 2, ...) so slow drift on a shared machine
    spreads over all of them instead of biasing one."""
    return [run_once(k, steps, work_dir, f"r{r}") for r in range(repeats) for k in staleness_values]


def aggregate(runs: list[E2ERun], staleness: int) -> dict:
    """One value per max_staleness over its repeats: mean steps/s, mean lag, total drops,
    peak memory."""
    mine = [r.summary() for r in runs if r.staleness == staleness]
    reasons: dict[str, int] = {}
    for s in mine:
        for reason, n in (s["dropped_reasons"] or {}).items():
            reasons[reason] = reasons.get(reason, 0) + n
    return {
        "staleness": staleness,
        "runs": len(mine),
        "failed_runs": sum(s["exit_code"] != 0 for s in mine),
        "steps_per_s": _mean([s["steps_per_s"] for s in mine]),
        "steps_per_s_each": [s["steps_per_s"] for s in mine],
        "learner_busy_frac": _mean([s["learner_busy_frac"] for s in mine]),
        "version_lag_mean": _mean([s["version_lag_mean"] for s in mine]),
        "groups_dropped": sum(s["groups_dropped"] or 0 for s in mine),
        "dropped_reasons": reasons,
        "learner_peak_mb": _max([s["learner_peak_mb"] for s in mine]),
        "actor_peak_mb": _max([s["actor_peak_mb"] for s in mine]),
        "weights_mb": _max([s["weights_mb"] for s in mine]),
        **{
            key: _mean([s[key] for s in mine])
            for key in ("weights_serialize_ms", "weights_transfer_ms", "weights_apply_ms")
        },
    }

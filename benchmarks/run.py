"""`python -m benchmarks.run [--quick]`: measure, print one table, write it to results/.

Every speed target is a ratio against a baseline measured in the same run on the same
machine, and is reported (PASS / MISS with the number), never asserted: a benchmark that
fails CI on a noisy shared runner teaches nothing. See benchmarks/README.md.

This module holds the settings, the record of the environment, the measuring and the
writing; the table, its targets and the markdown page are in benchmarks/run_report.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from importlib import metadata
from pathlib import Path

from benchmarks import end_to_end, learner_step, rollout, transport
from benchmarks.common import ROOT, tiny_config
from benchmarks.run_report import markdown, report, rows
from runtime.config import Config

RESULTS = Path(__file__).resolve().parent / "results"
SECTIONS = ("rollout", "learner", "e2e", "transport")


@dataclass(frozen=True)
class Settings:
    rollout_prompts: int
    rollout_reps: int
    rollout_max_tokens: int
    group_sizes: tuple[int, ...]
    learner_reps: int
    e2e_steps: int
    e2e_repeats: int
    staleness: tuple[int, ...]
    rollout_messages: int
    weight_reps: int


# Full: ~8 min on a 2-core x86 CPU (~3 min with OpenBLAS preloaded); quick: ~1 min (CI smoke).
FULL = Settings(
    rollout_prompts=16,
    rollout_reps=10,
    rollout_max_tokens=32,
    group_sizes=(4, 8),
    learner_reps=30,
    e2e_steps=60,
    e2e_repeats=3,
    staleness=(0, 1, 2),
    rollout_messages=5000,
    weight_reps=30,
)
QUICK = Settings(
    rollout_prompts=8,
    rollout_reps=2,
    rollout_max_tokens=32,
    group_sizes=(4, 8),
    learner_reps=5,
    e2e_steps=10,
    e2e_repeats=1,
    staleness=(0, 1, 2),
    rollout_messages=500,
    weight_reps=5,
)


# -- the environment the numbers were taken in ---------------------------------------------


def command_line() -> str:
    preload = os.environ.get("LD_PRELOAD")
    prefix = f"LD_PRELOAD={preload} " if preload else ""
    return prefix + shlex.join(["python", "-m", "benchmarks.run", *sys.argv[1:]])


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _memory_gb() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
        return round(kb / 1e6, 1)
    except (OSError, StopIteration):
        return None


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _openblas_loaded() -> bool:
    """Whether a system OpenBLAS is mapped into this process (LD_PRELOAD took effect); the
    run's subprocesses inherit the same environment. numpy's wheel bundles its own
    OpenBLAS (libscipy_openblas), which MLX does not use, so that one does not count."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return False
    return any("libopenblas" in line and "scipy_openblas" not in line for line in maps)


def environment() -> dict:
    import zmq

    u = platform.uname()
    dirty = _git("status", "--porcelain")
    return {
        "date": datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command_line(),
        "versions": {
            "python": platform.python_version(),
            "mlx": _version("mlx"),
            "mlx-lm": _version("mlx-lm"),
            "pyzmq": _version("pyzmq"),
            "libzmq": zmq.zmq_version(),
            "numpy": _version("numpy"),
            "msgpack": _version("msgpack"),
        },
        "machine": {
            "uname": " ".join([u.system, u.node, u.release, u.version, u.machine]),
            "cores": os.cpu_count(),
            "memory_gb": _memory_gb(),
        },
        "blas": {"LD_PRELOAD": os.environ.get("LD_PRELOAD"), "openblas_loaded": _openblas_loaded()},
        # Other work on a shared machine shows up here; compare before and after.
        "load_average_start": list(os.getloadavg()),
        # Developers edit the tree while benchmarks run: say exactly what was measured.
        "git": {"commit": _git("rev-parse", "HEAD"), "modified": dirty.splitlines() if dirty else []},
    }


# -- running the sections -------------------------------------------------------------------


def measure(s: Settings, sections: set[str]) -> dict:
    cfg = tiny_config()
    out: dict = {}
    if "transport" in sections:
        apply, tiny_shapes = transport.apply_ms(s.weight_reps)
        qwen = transport.qwen3_0_6b_lora_shapes(rank=8)
        out["transport"] = dataclasses.asdict(
            transport.run(
                s.rollout_messages,
                cfg.sampling.group_size,
                cfg.sampling.max_tokens,
                {"tiny": tiny_shapes, "qwen3-0.6b": qwen},
                s.weight_reps,
            )
        )
        out["transport"]["apply_tiny_ms"] = apply
    if "rollout" in sections:
        out["rollout"] = [
            dataclasses.asdict(r) | {"ratio": r.ratio}
            for r in rollout.run(s.rollout_prompts, s.group_sizes, s.rollout_max_tokens, s.rollout_reps)
        ]
    if "learner" in sections:
        out["learner"] = dataclasses.asdict(learner_step.run(s.learner_reps))
    if "e2e" in sections:
        with tempfile.TemporaryDirectory(prefix="mlxrl-e2e-") as tmp:
            runs = end_to_end.run(s.staleness, s.e2e_steps, s.e2e_repeats, Path(tmp))
        out["e2e"] = {
            "runs": [r.summary() for r in runs],
            "by_staleness": [end_to_end.aggregate(runs, k) for k in s.staleness],
        }
    out["overhead"] = overhead(out, cfg)
    return out


def overhead(out: dict, cfg: Config) -> dict:
    """Transport + weight sync as a share of one optimizer step.

    Per step the actor sends batch_size rollouts and receives one weights message. The
    tiny default's cost (weight sync of its real adapter + applying it) is set against
    its measured end-to-end step period at max_staleness 0 (the learner step of row 2
    if the end-to-end runs were skipped); the Qwen3-0.6B-sized adapter's sync (no model
    here, so no apply) against row 2's learner step, the only step time measured here.
    A third figure puts the K = 0 runs' own weight-sync metrics in place of row 4's.
    """
    t = out.get("transport")
    if not t:
        return {}
    batch = cfg.train.batch_size
    rollouts_ms = batch * 1e3 / t["rollout_msgs_per_s"]
    k0 = next((a for a in out.get("e2e", {}).get("by_staleness", []) if a["staleness"] == 0), None)
    learner_ms = out["learner"]["step_s"] * 1e3 if out.get("learner") else None
    result = {}
    if k0 and k0["steps_per_s"]:
        tiny_step_ms, tiny_basis = 1e3 / k0["steps_per_s"], "tiny end-to-end step at max_staleness=0 (row 3)"
    else:
        tiny_step_ms, tiny_basis = learner_ms, "tiny learner step (row 2)"
    tiny_ms = rollouts_ms + t["weights"]["tiny"]["sync_ms"] + t["apply_tiny_ms"]
    qwen_ms = rollouts_ms + t["weights"]["qwen3-0.6b"]["sync_ms"]
    cases = [
        ("tiny", tiny_ms, tiny_step_ms, tiny_basis),
        ("qwen3-0.6b", qwen_ms, learner_ms, "tiny learner step (row 2)"),
    ]
    if k0 and k0["steps_per_s"] and k0.get("weights_transfer_ms") is not None:
        # The same share from the K = 0 runs' own weight-sync metrics, in place of row 4's
        # isolated sync: what a real step paid.
        in_run = sum(k0[f"weights_{p}_ms"] or 0.0 for p in ("serialize", "transfer", "apply"))
        cases.append(("tiny, in-run metrics", rollouts_ms + in_run, tiny_step_ms, tiny_basis))
    for label, cost, step_ms, basis in cases:
        result[label] = {
            "transport_ms": cost,
            "rollouts": batch,
            "rollouts_ms": rollouts_ms,
            "step_ms": step_ms,
            "step_basis": basis,
            "percent": 100 * cost / step_ms if step_ms else None,
        }
    return result


def write(
    results_dir: Path,
    env: dict,
    settings: Settings,
    out: dict,
    table: list[list[str]],
    text: str,
    quick: bool,
) -> list[Path]:
    results_dir.mkdir(parents=True, exist_ok=True)
    raw = (
        json.dumps(
            {"environment": env, "settings": dataclasses.asdict(settings), "results": out, "table": table},
            indent=2,
        )
        + "\n"
    )
    # Quick runs are smoke tests: they never replace the full run's latest results.
    names = ["quick"] if quick else ["latest", datetime.now().strftime("%Y-%m-%d_%H%M%S")]
    written = []
    for name in names:
        for suffix, content in ((".md", text), (".json", raw)):
            path = results_dir / f"{name}{suffix}"
            path.write_text(content)
            written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small repetition counts (< 2 min), for CI")
    parser.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}"
    )
    parser.add_argument("--results-dir", type=Path, default=RESULTS, help="where to write the results")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    if not sections <= set(SECTIONS):
        parser.error(f"--sections: unknown {sorted(sections - set(SECTIONS))}")
    settings = QUICK if args.quick else FULL
    t0 = time.perf_counter()
    env = environment()
    out = measure(settings, sections)
    env["load_average_end"] = list(os.getloadavg())
    wall_s = time.perf_counter() - t0
    env["wall_s"] = wall_s
    table = rows(out, settings)
    text = report(env, markdown(table), wall_s, args.quick)
    written = write(args.results_dir, env, settings, out, table, text, args.quick)
    print(text)
    print(
        "written: "
        + ", ".join(str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p) for p in written)
    )


if __name__ == "__main__":
    main()

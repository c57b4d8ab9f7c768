"""`python -m benchmarks.run [--quick]`: measure, print one table, write it to results/.

Every speed target is a ratio against a baseline measured in the same run on the same
machine, and is reported (PASS / MISS with the number), never asserted: a benchmark that
fails CI on a noisy shared runner teaches nothing. See benchmarks/README.md.
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
from protocol.config import Config

RESULTS = Path(__file__).resolve().parent / "results"
SECTIONS = ("rollout", "learner", "e2e", "transport")

# Targets from the project plan; reported against, never asserted.
ROLLOUT_TARGET = 1.0  # our sampler vs batch_generate at G = 8
OVERLAP_TARGET = 1.3  # steps/s at max_staleness = 1 vs 0
TRANSPORT_TARGET_PCT = 2.0  # transport + weight sync, % of a step


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


# -- the table ------------------------------------------------------------------------------


def _f(value, fmt: str, unit: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{unit}"


def verdict(value: float | None, target: float, at_least: bool, fmt: str, unit: str) -> str:
    """PASS / MISS with the number, e.g. 'MISS (0.82x < 1.00x)'."""
    if value is None:
        return "not measured"
    ok = value >= target if at_least else value < target
    sign = (">=" if ok else "<") if at_least else ("<" if ok else ">=")
    return f"{'PASS' if ok else 'MISS'} ({value:{fmt}}{unit} {sign} {target:{fmt}}{unit})"


def rows(out: dict, s: Settings) -> list[list[str]]:
    table = []
    for r in out.get("rollout", []):
        target = verdict(r["ratio"], ROLLOUT_TARGET, True, ".2f", "x") if r["group_size"] == 8 else ""
        default_ratio = r["ours_tok_s"] / r["theirs_default_tok_s"] if r["theirs_default_tok_s"] else None
        table.append(
            [
                "1",
                f"rollout tok/s, G={r['group_size']}, {r['num_prompts']} prompts, "
                f"max_tokens {r['max_tokens']} (ours: {r['sampler']})",
                _f(r["ours_tok_s"], ".0f"),
                f"batch_generate {_f(r['theirs_tok_s'], '.0f')} (mlx-lm defaults: "
                f"{_f(r['theirs_default_tok_s'], '.0f')}, ours/that {_f(default_ratio, '.2f', 'x')})",
                _f(r["ratio"], ".2f", "x"),
                target,
            ]
        )
    if learner := out.get("learner"):
        table.append(
            [
                "2",
                f"learner s/step ({learner['batch_size']} groups x G {learner['group_size']}, "
                f"max_tokens {learner['max_tokens']}; median of {learner['reps']})",
                f"{learner['step_s']:.3f} s (prepare {learner['prepare_s']:.3f} + "
                f"optimizer_step {learner['optimizer_step_s']:.3f})",
                "",
                "",
                "",
            ]
        )
    table += _e2e_rows(out.get("e2e"), s)
    table += _transport_rows(out.get("transport"))
    table += _inrun_sync_rows(out.get("e2e"))
    table += _memory_rows(out.get("e2e"))
    table += _overhead_rows(out.get("overhead", {}))
    return table


def _e2e_rows(e2e: dict | None, s: Settings) -> list[list[str]]:
    if not e2e:
        return []
    by_k = {a["staleness"]: a for a in e2e["by_staleness"]}
    base = by_k.get(0, {}).get("steps_per_s")
    table = []
    for k, a in by_k.items():
        ratio = a["steps_per_s"] / base if base and a["steps_per_s"] else None
        reasons = ", ".join(f"{n} {why}" for why, n in a["dropped_reasons"].items())
        failed = f"; {a['failed_runs']} run(s) FAILED" if a["failed_runs"] else ""
        busy = a["learner_busy_frac"] and 100 * a["learner_busy_frac"]
        table.append(
            [
                "3",
                f"end-to-end steps/s, max_staleness={k} ({a['runs']} x {s.e2e_steps} steps)",
                f"{_f(a['steps_per_s'], '.2f')} (lag {_f(a['version_lag_mean'], '.2f')}, dropped "
                f"{a['groups_dropped']}{' (' + reasons + ')' if reasons else ''}, learner busy "
                f"{_f(busy, '.0f', '%')}{failed})",
                "max_staleness=0" if k else "",
                _f(ratio, ".2f", "x"),
                verdict(ratio, OVERLAP_TARGET, True, ".2f", "x") if k == 1 else "",
            ]
        )
    return table


def _inrun_sync_rows(e2e: dict | None) -> list[list[str]]:
    """The weight sync the K = 0 runs measured themselves (metrics.jsonl), as a check on
    row 4's isolated figure. Only K = 0: with K > 0 the actor is busy sampling when the
    weights arrive, so its send -> decoded time includes waiting for it to look."""
    a = next((a for a in (e2e or {}).get("by_staleness", []) if a["staleness"] == 0), None)
    if not a or a["weights_mb"] is None:
        return []
    return [
        [
            "4",
            f"in-run weight sync, max_staleness=0, from metrics.jsonl ({a['weights_mb']:.3f} MB "
            "message; medians)",
            f"serialize {_f(a['weights_serialize_ms'], '.2f', ' ms')} + send->decoded "
            f"{_f(a['weights_transfer_ms'], '.2f', ' ms')} + "
            f"apply {_f(a['weights_apply_ms'], '.2f', ' ms')}",
            "",
            "",
            "",
        ]
    ]


def _memory_rows(e2e: dict | None) -> list[list[str]]:
    return [
        [
            "5",
            f"peak memory, max_staleness={a['staleness']}",
            f"learner {_f(a['learner_peak_mb'], '.1f', ' MB')}, actor {_f(a['actor_peak_mb'], '.1f', ' MB')}",
            "",
            "",
            "",
        ]
        for a in (e2e or {}).get("by_staleness", [])
    ]


def _transport_rows(t: dict | None) -> list[list[str]]:
    if not t:
        return []
    table = [
        [
            "4",
            f"rollout messages over ipc DEALER->ROUTER, 2 processes "
            f"({t['rollout_message_bytes']} B each, encode+decode)",
            f"{t['rollout_msgs_per_s']:.0f} msg/s, {t['rollout_mb_per_s']:.1f} MB/s",
            "",
            "",
            "",
        ]
    ]
    for label, w in t["weights"].items():
        table.append(
            [
                "4",
                f"weight sync '{label}': {w['parameters']:,} float32 params, {w['bytes'] / 1e6:.2f} MB, "
                f"{w['arrays']} arrays (encode+send+recv+decode+ack)",
                f"{w['sync_ms']:.2f} ms",
                f"numpy copy {w['copy_ms']:.3f} ms",
                _f(w["sync_ms"] / w["copy_ms"] if w["copy_ms"] else None, ".1f", "x"),
                "",
            ]
        )
    table.append(
        [
            "4",
            "apply weights on the tiny model (set_adapter_weights)",
            f"{t['apply_tiny_ms']:.2f} ms",
            "",
            "",
            "",
        ]
    )
    return table


def _overhead_rows(over: dict) -> list[list[str]]:
    table = []
    for label, o in over.items():
        what = f"{o['rollouts']} rollouts + weight sync" + ("" if label == "qwen3-0.6b" else " + apply")
        table.append(
            [
                "%",
                f"transport + weight sync, % of a step, '{label}' ({what} = "
                f"{o['transport_ms']:.2f} ms; step = {o['step_basis']}, {_f(o['step_ms'], '.1f', ' ms')})",
                _f(o["percent"], ".2f", "%"),
                "",
                "",
                verdict(o["percent"], TRANSPORT_TARGET_PCT, False, ".2f", "%"),
            ]
        )
    return table


def markdown(table: list[list[str]]) -> str:
    head = ["row", "measurement", "result", "baseline (same run)", "ratio", "target"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in r) + " |" for r in table]
    return "\n".join(lines) + "\n"


def report(env: dict, table: str, wall_s: float, quick: bool) -> str:
    v, m = env["versions"], env["machine"]
    return (
        f"# Benchmark results{' (quick)' if quick else ''}\n\n"
        f"- command: `{env['command']}`\n- date: {env['date']}, wall time {wall_s:.0f} s\n"
        f"- machine: {m['uname']}; {m['cores']} cores, {m['memory_gb']} GB; load average "
        f"{env['load_average_start'][0]:.2f} at start, {env['load_average_end'][0]:.2f} at end\n"
        f"- versions: python {v['python']}, mlx {v['mlx']}, mlx-lm {v['mlx-lm']}, pyzmq {v['pyzmq']} "
        f"(libzmq {v['libzmq']}), numpy {v['numpy']}, msgpack {v['msgpack']}\n"
        f"- OpenBLAS preloaded: {env['blas']['openblas_loaded']}\n"
        f"- git: {env['git']['commit']}, {len(env['git']['modified'])} modified paths in the tree\n\n" + table
    )


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

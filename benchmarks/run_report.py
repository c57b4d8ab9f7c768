"""The table and the results page of `python -m benchmarks.run`: one row per measurement,
each speed target's verdict (PASS / MISS with the number, never asserted), and the
markdown page around it (command, date, machine, versions, git). benchmarks/run.py measures
and writes; this module only formats what it measured.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.run import Settings

# Targets from the project plan; reported against, never asserted.
ROLLOUT_TARGET = 1.0  # our sampler vs batch_generate at G = 8
OVERLAP_TARGET = 1.3  # steps/s at max_staleness = 1 vs 0
TRANSPORT_TARGET_PCT = 2.0  # transport + weight sync, % of a step


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

"""Paths, the tiny default's settings and small timing helpers shared by the sections."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runtime.config import Config, LoraConfig, load_config

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
MODEL_DIR = EXAMPLES / "tiny-model"
PROMPTS = EXAMPLES / "tiny_prompts.jsonl"
TINY_TOML = EXAMPLES / "tiny.toml"
# The LoRA settings of the rollout comparison (also tiny.toml's).
LORA = LoraConfig(rank=8, scale=20.0)


def log(text: str) -> None:
    """Progress goes to stderr, so stdout holds only the final table."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t0


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def harness(doc: str | None) -> argparse.ArgumentParser:
    """The command line every shape benchmark shares: --quick, --repeats, where the models
    it builds are cached, and where its results go."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a small shape, 1 repeat: checks the harness")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--models-dir", type=Path, default=Path(tempfile.gettempdir()) / "mlxrl-ipc-models")
    p.add_argument("--results-dir", type=Path, default=ROOT / "benchmarks" / "results")
    return p


def write_results(results_dir: Path, stem: str, out: dict, report: str) -> None:
    """Print the report, and keep it with every number: `stem`.md and `stem`.json."""
    import json

    print(report)
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / f"{stem}.json").write_text(json.dumps(out, indent=2) + "\n")
    (results_dir / f"{stem}.md").write_text(report)


def tiny_config() -> Config:
    """examples/tiny.toml, validated exactly as `orchestrator up` reads it, so the
    benchmark follows the default shape if the file changes."""
    return load_config(TINY_TOML)


def timeline_summary(run_dir: Path, steps: int) -> dict:
    """Each process's busy share and waits (shares of the window) over steps 2..steps,
    from the run's timeline (orchestrator timeline)."""
    from orchestrator.timeline import clipped, longest_decoding, read_events, summarize, window

    events = read_events(run_dir)
    t0, t1 = window(events, (2, steps))
    out: dict = {
        s.process: {"busy": s.busy_s / s.wall_s, "waits": {k: v / s.wall_s for k, v in s.waits.items()}}
        for s in summarize(events, t0, t1)
    }
    if "learner" in out and (chain := longest_decoding(events, t0, t1)) is not None:
        out["learner"]["wall_step_s"], out["learner"]["longest_group_s"] = chain
    for process, rows in events.items():
        mine = [e for e in clipped(rows, t0, t1) if e["tid"] == 0 and e.get("ph") == "X"]
        spans: dict[str, float] = {}
        for e in mine:  # seconds a timed step in each span, nested ones too
            spans[e["name"]] = spans.get(e["name"], 0.0) + e["dur"] / 1e6 / (steps - 1)
        out[process]["spans"] = spans
        decode = [e["args"]["rows"] for e in mine if e["name"] == "decode step" and "args" in e]
        if decode:
            out[process]["decode_steps"] = len(decode) / (steps - 1)
            out[process]["rows_per_decode_step"] = sum(decode) / len(decode)
        reads = [e["args"] for e in mine if e["name"] == "decode step" and "cache" in e.get("args", {})]
        if read := sum(r["batch"] * r["cache"] for r in reads):
            # Of the keys and values the decode steps' attention read, the live rows' own
            # (the rest: left padding and dead rows).
            out[process]["cache_read_own"] = sum(r["own"] for r in reads) / read
            out[process]["batch_per_decode_step"] = sum(r["batch"] for r in reads) / len(reads)
        if (per := ms_per_position(mine)) is not None:
            out[process]["forward_backward_ms_per_position"] = per
    return out


def ms_per_position(events: list[dict]) -> float | None:
    """Milliseconds the learner's forwards and backwards took a position they computed
    (their spans' `positions`): what a position costs, whatever the batch's shape."""
    spans = [e for e in events if e["name"] == "forward and backward" and "positions" in e.get("args", {})]
    positions = sum(e["args"]["positions"] for e in spans)
    return sum(e["dur"] for e in spans) / 1e3 / positions if positions else None


def of_process(summary: dict, process: str) -> dict:
    """A timeline summary's entry for `process` ("learner", "actor"; an actor's name has
    its slot after it)."""
    return next(v for k, v in summary.items() if k.startswith(process))


def timeline_table(runs: dict[str, list[dict]]) -> str:
    """Where the learner's and the actor's time went in each run of this project (medians
    over repeats of the shares of steps 2..N; waits by what they waited on)."""

    def cells(summaries: list[dict], process: str) -> list[str]:
        mine = [of_process(s, process) for s in summaries]
        names = sorted({w for m in mine for w in m["waits"]})
        waits = ", ".join(f"{w} {statistics.median(m['waits'].get(w, 0) for m in mine):.0%}" for w in names)
        return [f"{statistics.median(m['busy'] for m in mine):.0%}", waits or "-"]

    rows = [
        "| run | learner busy | learner waited on | actor busy | actor waited on |",
        "|---|---|---|---|---|",
    ]
    for name, rs in runs.items():
        summaries = [r["timeline"] for r in rs if r.get("timeline")]
        if summaries:
            rows.append(f"| {name} | {' | '.join(cells(summaries, 'learner') + cells(summaries, 'actor'))} |")
    return "\n".join(rows) + "\n" + work_table(runs)


def learner_step_s(timeline: dict) -> float | None:
    """A learner step's seconds: its takes of groups as they arrived ("learn groups") and
    what followed once its batch was complete ("step")."""
    spans = timeline.get("spans", {})
    if "step" not in spans:
        return None
    return spans["step"] + spans.get("learn groups", 0.0)


def work_table(runs: dict[str, list[dict]]) -> str:
    """What each timed step cost the learner and the actor, by the timeline's spans
    (medians over repeats): the learner's forwards and backwards (and what they took a
    position), the actor's decode steps, and how many rows a decode step held on average;
    a step's wall time, and the longest decoding of a group sent in it
    (orchestrator/timeline.py::longest_decoding: under max_staleness k, k + 1 steps take
    at least that)."""

    def value(rs: list[dict], process: str, get, form: str = "{:.1f}") -> str:
        found = [get(of_process(r["timeline"], process)) for r in rs]
        found = [f for f in found if f is not None]
        return form.format(statistics.median(found)) if found else "-"

    rows = [
        "| run | learner: forward and backward, s | learner: ms a position | learner: step, s | "
        "actor: decode steps, s | decode steps | rows a decode step | rows in its batch, dead too | "
        "cache read that is the live rows' own | a step, wall s | longest group's decoding, s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, rs in runs.items():
        rs = [r for r in rs if r.get("timeline")]
        if not rs:
            continue
        cells = [
            value(rs, "learner", lambda t: t.get("spans", {}).get("forward and backward")),
            value(rs, "learner", lambda t: t.get("forward_backward_ms_per_position"), "{:.2f}"),
            value(rs, "learner", learner_step_s),
            value(rs, "actor", lambda t: t.get("spans", {}).get("decode step")),
            value(rs, "actor", lambda t: t.get("decode_steps")),
            value(rs, "actor", lambda t: t.get("rows_per_decode_step")),
            value(rs, "actor", lambda t: t.get("batch_per_decode_step")),
            value(rs, "actor", lambda t: t.get("cache_read_own"), "{:.0%}"),
            value(rs, "learner", lambda t: t.get("wall_step_s")),
            value(rs, "learner", lambda t: t.get("longest_group_s")),
        ]
        rows.append(f"| {name} | {' | '.join(cells)} |")
    return "\nSeconds a timed step, by the timeline's spans:\n\n" + "\n".join(rows) + "\n"

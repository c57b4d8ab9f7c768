"""`orchestrator timeline`: one trace of every process, and where each one's time went.

Reads the spans each process recorded (runtime/spans.py, RUN/timeline/*.jsonl) and
writes one Chrome trace (`{"traceEvents": [...]}`) that Perfetto (ui.perfetto.dev) and
chrome://tracing open: a track per process, a row per thread, the learner's step ends as
marks. Times start at 0 at the window's start. The summary gives each process's busy
share of the window and what its waits waited on; what is neither is time no span
covers (start-up, bookkeeping between spans).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from runtime.spans import BUSY, WAIT, timeline_dir

# Tracks in this order, then by name: the learner on top, then the actors, then workers.
ORDER = ("learner", "actor", "reward-worker", "env-worker")


def read_events(run_dir: str | Path) -> dict[str, list[dict]]:
    """Every process's events, by process name (its file's stem). A line cut short by a
    crash is skipped."""
    events: dict[str, list[dict]] = {}
    for path in sorted(timeline_dir(run_dir).glob("*.jsonl")):
        rows = []
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        events[path.stem] = sorted(rows, key=lambda e: (e["ts"], -e.get("dur", 0)))
    return dict(sorted(events.items(), key=lambda kv: (_rank(kv[0]), kv[0])))


def _rank(process: str) -> int:
    return next((i for i, p in enumerate(ORDER) if process.startswith(p)), len(ORDER))


def step_ends(events: dict[str, list[dict]]) -> dict[int, int]:
    """The learner's step marks: step -> when it ended (µs)."""
    return {
        e["args"]["step"]: e["ts"]
        for e in events.get("learner", [])
        if e["ph"] == "i" and e["name"] == "step"
    }


def window(events: dict[str, list[dict]], steps: tuple[int, int] | None) -> tuple[int, int]:
    """The µs interval of steps A..B: from step A-1's end (the first event, for step 1)
    to step B's end. None: everything recorded."""
    every = [e["ts"] for rows in events.values() for e in rows]
    ends = [e["ts"] + e.get("dur", 0) for rows in events.values() for e in rows]
    if not every:
        raise ValueError("no timeline recorded (log.timeline = false, or the run never started)")
    if steps is None:
        return min(every), max(ends)
    marks = step_ends(events)
    a, b = steps
    if b not in marks:
        have = f"steps {min(marks)}..{max(marks)}" if marks else "no step"
        raise ValueError(f"--steps {a}:{b}: the timeline has {have}")
    return marks.get(a - 1, min(every)), marks[b]


def clipped(events: list[dict], t0: int, t1: int) -> list[dict]:
    """The events that overlap [t0, t1], cut to it."""
    out = []
    for e in events:
        start, end = e["ts"], e["ts"] + e.get("dur", 0)
        if end < t0 or start > t1 or (e["ph"] == "i" and start == t0):  # t0's mark: the step before
            continue
        e = dict(e)
        if e["ph"] == "X":
            e["ts"], e["dur"] = max(start, t0), min(end, t1) - max(start, t0)
        out.append(e)
    return out


def top_level(events: list[dict]) -> list[dict]:
    """The spans no other span of their thread contains (spans nest, never cross)."""
    out: list[dict] = []
    open_until: dict[int, int] = {}
    for e in events:
        if e["ph"] != "X":
            continue
        if e["ts"] >= open_until.get(e["tid"], -1):
            out.append(e)
            open_until[e["tid"]] = e["ts"] + e["dur"]
    return out


@dataclass
class Share:
    process: str
    wall_s: float
    busy_s: float = 0.0
    waits: dict[str, float] = field(default_factory=dict)

    @property
    def other_s(self) -> float:
        return max(0.0, self.wall_s - self.busy_s - sum(self.waits.values()))


def summarize(events: dict[str, list[dict]], t0: int, t1: int) -> list[Share]:
    """Each process's busy and waiting seconds in [t0, t1], from its main thread's
    top-level spans (thread 0: the one that records first)."""
    shares = []
    for process, rows in events.items():
        share = Share(process, (t1 - t0) / 1e6)
        for e in top_level(clipped(rows, t0, t1)):
            if e["tid"] != 0:
                continue
            if e["cat"] == BUSY:
                share.busy_s += e["dur"] / 1e6
            elif e["cat"] == WAIT:
                share.waits[e["name"]] = share.waits.get(e["name"], 0.0) + e["dur"] / 1e6
        shares.append(share)
    return shares


def render(shares: list[Share]) -> str:
    lines = [f"{'process':<16} {'busy':>6} {'waiting':>8}  waited on"]
    for s in shares:
        wall = s.wall_s or 1.0
        waits = ", ".join(f"{k} {v / wall:.0%}" for k, v in sorted(s.waits.items(), key=lambda kv: -kv[1]))
        waited = sum(s.waits.values())
        lines.append(f"{s.process:<16} {s.busy_s / wall:>6.0%} {waited / wall:>8.0%}  {waits or '-'}")
    return "\n".join(lines)


def longest_decoding(events: dict[str, list[dict]], t0: int, t1: int) -> tuple[float, float] | None:
    """Over the learner's steps that end in [t0, t1] after the first of them: a step's
    seconds, and the longest decoding of a group any actor sent in the step (its `send`
    span's `decoding_s`), averaged over the steps that sent one. A group is trained within
    max_staleness + 1 steps of the weights it started under, so that many steps take at
    least that: when they take little more, the longest completions bound the run. None
    without two steps, or without `decoding_s` (a static engine, episodes, agents)."""
    marks = sorted(ts for ts in step_ends(events).values() if t0 <= ts <= t1)
    sent = [
        (e["ts"], e["args"]["decoding_s"])
        for rows in events.values()
        for e in rows
        if e["name"] == "send" and "decoding_s" in e.get("args", {})
    ]
    longest = [max((d for ts, d in sent if a <= ts < b), default=None) for a, b in zip(marks, marks[1:])]
    found = [d for d in longest if d is not None]
    if not found:
        return None
    return (marks[-1] - marks[0]) / 1e6 / (len(marks) - 1), sum(found) / len(found)


def trace(events: dict[str, list[dict]], t0: int, t1: int) -> dict:
    """The Chrome trace of [t0, t1]: a pid per process, named; times from t0."""
    out: list[dict] = []
    for pid, (process, rows) in enumerate(events.items(), start=1):
        out.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": process}})
        out.append(
            {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}}
        )
        for e in clipped(rows, t0, t1):
            out.append({**e, "pid": pid, "ts": e["ts"] - t0})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def parse_steps(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"--steps {text!r}: expected A:B, e.g. 3:10") from None
    if not 1 <= a <= b:
        raise ValueError(f"--steps {text!r}: expected 1 <= A <= B")
    return a, b


# Colours of the picture: what a span is, by its name's first word.
COLOURS = {"wait": "#d9d9d9", "evaluation": "#d9d9d9", "decode": "#4c72b0", "prefill": "#8172b2"}
BUSY_COLOUR = "#dd8452"


def draw(events: dict[str, list[dict]], t0: int, t1: int, out: Path) -> Path:
    """A PNG of the main thread's top-level spans, a row per process (matplotlib, the `plot`
    extra): waits grey, the actor's decoding blue, its prefills purple, the rest (the
    learner's steps, scoring, sending) orange; the learner's step ends as lines."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("drawing needs matplotlib: pip install 'mlx-rl-ipc[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(events)
    fig, ax = plt.subplots(figsize=(14, 0.6 * len(names) + 1.2), constrained_layout=True)
    for row, process in enumerate(names):
        spans = [e for e in top_level(clipped(events[process], t0, t1)) if e["tid"] == 0]
        for e in spans:
            colour = COLOURS.get(e["name"].split()[0], BUSY_COLOUR)
            ax.broken_barh([((e["ts"] - t0) / 1e6, e["dur"] / 1e6)], (row - 0.4, 0.8), color=colour, lw=0)
    for step, ts in step_ends(events).items():
        if t0 < ts <= t1:
            ax.axvline((ts - t0) / 1e6, color="black", lw=0.6)
            ax.text((ts - t0) / 1e6, len(names) - 0.45, f"step {step}", fontsize=7, ha="right")
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlim(0, (t1 - t0) / 1e6)
    ax.set_xlabel("seconds")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def write_timeline(
    run_dir: str | Path,
    out: str | Path | None = None,
    steps: str | None = None,
    png: str | Path | None = None,
) -> str:
    """Write the trace (default RUN/timeline.json), and with `png` a picture of it; return
    the summary text."""
    events = read_events(run_dir)
    t0, t1 = window(events, parse_steps(steps))
    path = Path(out) if out else Path(run_dir) / "timeline.json"
    path.write_text(json.dumps(trace(events, t0, t1)))
    text = f"trace: {path} (open it in ui.perfetto.dev or chrome://tracing)\n"
    if png:
        text += f"picture: {draw(events, t0, t1, Path(png))}\n"
    text += f"{(t1 - t0) / 1e6:.1f} s\n" + render(summarize(events, t0, t1))
    if (chain := longest_decoding(events, t0, t1)) is not None:
        text += f"\na step: {chain[0]:.2f} s; its longest group decoded for {chain[1]:.2f} s (on average)"
    return text

"""`orchestrator show`: a run's files, for a person at a terminal."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from orchestrator.progress import is_eval
from runtime.rundir import checkpoint_step, latest_checkpoint


def read_lines(path: Path) -> list[dict]:
    """A run's JSON-lines file; a last line cut short by a kill is skipped."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def one_line(text: str, width: int) -> str:
    text = text.replace("\n", " ⏎ ")
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


class NotLogged(LookupError):
    """What was asked for is not in the run's files; the message says what is."""


def line_order(m: dict) -> tuple[int, bool]:
    """Where a metrics line falls: a step's evaluation comes after its training line."""
    return m["step"], is_eval(m)


class MetricsFollower:
    """The lines of a run's metrics.jsonl not given yet, in order, for whoever watches the
    run (`up`'s display, `orchestrator.start`'s `metrics()`). A resumed run's lines up to
    its checkpoint were given by the run it continues. A restarted learner trims the file
    back to its checkpoint, so the file is re-read rather than tailed, and the steps it
    trains again are given again."""

    def __init__(self, run_dir: Path, resume: bool) -> None:
        self.run_dir = run_dir
        newest = latest_checkpoint(run_dir) if resume else None
        self.resumed_at = checkpoint_step(newest) if newest else 0
        self.last = (self.resumed_at, True) if newest else (0, False)
        self.went_back: int | None = None  # the step a restarted learner went back to, at the last `new`

    def new(self) -> list[dict]:
        """Whole lines past the last one given."""
        path = self.run_dir / "metrics.jsonl"
        self.went_back = None
        if not path.exists() or not (self.run_dir / "status.json").exists():
            return []  # the learner has not started: a resumed run's file is not trimmed yet
        rows = read_lines(path)  # a line being written does not parse yet: skipped
        if rows and rows[-1]["step"] < self.last[0]:
            self.went_back = rows[-1]["step"]
            self.last = line_order(rows[-1])
        new = [m for m in rows if line_order(m) > self.last]
        if new:
            self.last = line_order(new[-1])
        return new


def completions_table(rows: list[dict], step: int | None, width: int | None = None) -> str:
    """The logged completions of `step` (default: the last logged step) as a table per
    group: its prompt, then one line per completion. NotLogged if that step is not logged."""
    if not rows:
        raise NotLogged("no completions logged yet (log.completions_every sets how often)")
    steps = sorted({r["step"] for r in rows})
    step = steps[-1] if step is None else step
    if step not in steps:
        raise NotLogged(f"no completions logged at step {step}; logged steps: {', '.join(map(str, steps))}")
    width = width or shutil.get_terminal_size((120, 20)).columns
    out = [f"step {step}"]
    names = sorted({k for r in rows if r["step"] == step for k in r["rewards"]})
    widths = [max(len(n), 7) + 2 for n in names]  # a reward's whole name: they tell functions apart
    head = (
        f"{'#':>2}  {'reward':>7}  {'adv':>7}  "
        + "".join(f"{n:>{w}}" for n, w in zip(names, widths))
        + f"  {'finish':<6}  {'tok':>4}  completion"
    )
    for group_id in dict.fromkeys(r["group_id"] for r in rows if r["step"] == step):
        group = [r for r in rows if r["step"] == step and r["group_id"] == group_id]
        prompt = group[0]["prompt"]
        prompt = prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False)
        title = f"group {group_id} (policy version {group[0]['policy_version']}): {prompt}"
        out += ["", one_line(title, width), head]
        for r in group:
            reward = "-" if r["reward"] is None else f"{r['reward']:.3f}"
            scores = "".join(
                f"{'-' if r['rewards'].get(n) is None else format(r['rewards'][n], '.3f'):>{w}}"
                for n, w in zip(names, widths)
            )
            cells = (
                f"{r['index']:>2}  {reward:>7}  {r['advantage']:>+7.3f}  {scores}  "
                f"{r['finish_reason']:<6}  {r['tokens']:>4}  "
            )
            out.append(cells + one_line(r["completion"], width - len(cells)))
    return "\n".join(out)


def reward_change(rows: list[dict], window: int = 10) -> str:
    """The mean reward of the first and of the last `window` training steps, and the change."""
    steps = [m for m in rows if m.get("reward") is not None and not any(k.startswith("eval/") for k in m)]
    if len(steps) < 2:
        return "fewer than two steps with a reward in metrics.jsonl"
    n = min(window, len(steps) // 2)
    first, last = (sum(m["reward"] for m in part) / n for part in (steps[:n], steps[-n:]))
    return (
        f"reward: first {n} steps {first:.3f}, last {n} steps {last:.3f} ({last - first:+.3f}; "
        f"steps {steps[0]['step']}-{steps[n - 1]['step']} and {steps[-n]['step']}-{steps[-1]['step']})"
    )


# The curves `orchestrator plot` draws: (title, metric, its std for a band, if any).
CURVES = [
    ("reward", "reward", "reward_std"),
    ("KL to the reference", "kl", None),
    ("completion length", "completions/mean_length", None),
    ("clipped fraction", "clip_ratio/region_mean", None),
    ("entropy", "entropy", None),
    ("rollout tokens/s", "rollout_tokens_per_s", None),
    ("held-out pass@1 ([eval])", "eval/pass@1", None),
    ("held-out reward ([eval])", "eval/reward_mean", "eval/reward_std"),
]


def band(rows: list[dict], key: str, std: str) -> tuple[list[float], list[float]]:
    """Mean ± std at each step, kept inside the range the values took where it is logged
    (`reward_min`, `reward_max`): rewards in [0, 1] never draw a band past 1."""
    low, high = [], []
    for r in rows:
        lo, hi = r[key] - r[std], r[key] + r[std]
        floor, ceiling = r.get(f"{key}_min"), r.get(f"{key}_max")
        low.append(lo if floor is None else max(lo, floor))
        high.append(hi if ceiling is None else min(hi, ceiling))
    return low, high


def plot_metrics(rows: list[dict], out: Path, title: str) -> Path:
    """A PNG of the main curves against the step (matplotlib, the `plot` extra)."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("plotting needs matplotlib: pip install 'mlx-rl-ipc[plot]'") from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(17, 6.5), constrained_layout=True)
    for ax, (name, key, std) in zip(axes.flat, CURVES):
        points = [r for r in rows if r.get(key) is not None]
        if points:
            steps, values = [r["step"] for r in points], [r[key] for r in points]
            ax.plot(steps, values, lw=1.5)
            if std and all(r.get(std) is not None for r in points):
                ax.fill_between(steps, *band(points, key, std), alpha=0.2)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out

"""What `orchestrator up` shows while a run trains.

One line per step and per evaluation, always: they are the record a user scrolls back
through or greps in a log. On a terminal a live bar stays under them (rich): step / total,
elapsed and remaining time, reward, rollout tokens/s, staleness (how many versions behind
the trained samples were) and each process's peak memory against its share. When stdout
is not a terminal (a file, a pipe, CI) nothing is redrawn: only the lines are written.
"""

from __future__ import annotations

import os
import time
from typing import IO


def is_eval(m: dict) -> bool:
    return any(k.startswith("eval/") for k in m)


CLIPPED = "clip_ratio/region_mean"  # cispo logs its own, cispo_clip_ratio; sapo clips nothing


def _f(m: dict, key: str, fmt: str) -> str:
    v = m.get(key)
    return "-" if v is None else format(v, fmt)


def format_step(m: dict, steps: int) -> str:
    """A step's line: what says a run is healthy (GRPO's loss is ~0 by design, so it is not
    shown): reward and its spread, KL, clipping, length, speed."""
    return (
        f"step {m['step']:>4}/{steps}  reward {_f(m, 'reward', '.3f')} ± {_f(m, 'reward_std', '.3f')}  "
        f"kl {_f(m, 'kl', '.4f')}  clip {_f(m, CLIPPED if CLIPPED in m else 'cispo_clip_ratio', '.3f')}  "
        f"len {_f(m, 'completions/mean_length', '.0f')}  "
        f"rollout {_f(m, 'rollout_tokens_per_s', '.0f')} tok/s  {_f(m, 'step_s', '.2f')} s/step"
    )


def format_eval(m: dict) -> str:
    """An evaluation's line: pass@k on the held-out prompts, and their mean reward."""
    passes = "  ".join(
        f"{k.removeprefix('eval/')} {v:.3f}"
        for k, v in m.items()
        if k.startswith("eval/pass@") and v is not None
    )
    return (
        f"eval at step {m['step']}: {passes}  reward {_f(m, 'eval/reward_mean', '.3f')}  "
        f"({m.get('eval/prompts', 0)} prompts, {m.get('eval/runtime_s', 0):.1f} s)"
    )


def format_eval_progress(step: int, e: dict) -> str:
    """An evaluation under way (status.json's `eval`): prompts done, speed, time left."""
    eta = e.get("eta_s")
    left = f"~{eta:.0f} s left" if eta is not None else "time left unknown yet"
    speed = f"{e.get('tokens_per_s', 0):.0f} tok/s"
    return f"evaluating at step {step}: {e['done']}/{e['total']} prompts  {speed}  {left}"


def health(m: dict) -> str:
    """The live bar's figures from the newest step."""
    memory = "  ".join(
        f"{name} {m[f'{name}_peak_mb']:.0f}/{m[f'{name}_share_mb']:.0f} MB"
        for name in ("learner", "actor")
        if m.get(f"{name}_peak_mb") is not None and m.get(f"{name}_share_mb") is not None
    )
    return (
        f"reward {_f(m, 'reward', '.3f')}  {_f(m, 'rollout_tokens_per_s', '.0f')} tok/s  "
        f"staleness {_f(m, 'version_lag_mean', '.1f')}  {memory}"
    ).rstrip()


class Lines:
    """Plain lines, for anything that is not a terminal. An evaluation under way gets a
    line when it starts and one every EVAL_EVERY_S."""

    EVAL_EVERY_S = 10.0

    def __init__(self, out: IO[str], steps: int) -> None:
        self.out, self.steps = out, steps
        self.eval_said: tuple[int, float] | None = None  # (step, when) of the last progress line

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def metrics(self, m: dict) -> None:
        self.say(format_eval(m) if is_eval(m) else format_step(m, self.steps))

    def eval_progress(self, step: int, e: dict) -> None:
        now = time.monotonic()
        said = self.eval_said
        if said is None or said[0] != step or now - said[1] >= self.EVAL_EVERY_S:
            self.say(format_eval_progress(step, e))
            self.eval_said = (step, now)

    def close(self) -> None:
        pass


class Live(Lines):
    """The same lines, printed above a live bar that rich redraws in place."""

    def __init__(self, out: IO[str], steps: int) -> None:
        super().__init__(out, steps)
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.console = Console(file=out, force_terminal=True, highlight=False)
        self.bar = Progress(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(bar_width=24),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[health]}"),
            console=self.console,
        )
        self.task = self.bar.add_task("train", total=steps, health="starting")
        # What the step, bar, elapsed and eta columns take; the health text gets the rest,
        # cut short, so that a narrow terminal keeps the bar whole rather than its left side.
        self.room = self.console.width - (48 + 2 * len(str(steps)) + 2 * len("0:00:00"))
        self.bar.start()

    def say(self, text: str) -> None:
        self.console.print(text, markup=False)

    def eval_progress(self, step: int, e: dict) -> None:
        """On the bar, redrawn in place (the finished evaluation's line is printed above)."""
        self.bar.update(self.task, health=self.fit(format_eval_progress(step, e)))

    def fit(self, figures: str) -> str:
        return figures if len(figures) <= self.room else figures[: max(self.room - 1, 0)] + "…"

    def metrics(self, m: dict) -> None:
        super().metrics(m)
        if not is_eval(m):
            self.bar.update(self.task, completed=m["step"], health=self.fit(health(m)))

    def close(self) -> None:
        self.bar.stop()


def display_for(out: IO[str], steps: int) -> Lines:
    """A live bar on a terminal (unless TERM=dumb), plain lines elsewhere."""
    tty = hasattr(out, "isatty") and out.isatty() and os.environ.get("TERM") != "dumb"
    return Live(out, steps) if tty else Lines(out, steps)

"""What a run directory holds once a run has trained in it, for every process that reads it.

The learner writes `metrics.jsonl` (and `completions.jsonl`), checkpoints in
`checkpoints/step_NNNNNN/` (adapters, optimizer state, `state.json` written last) and the
newest adapters in `adapters/`. `orchestrator up` refuses to start a new run over these
unless asked (`--overwrite`), a resume continues from the newest checkpoint, and `actor
serve --run-dir` serves it. No MLX here.
"""

from __future__ import annotations

import json
import os
import shutil
from enum import StrEnum
from pathlib import Path

# What a run's training leaves (docs/run-directory.md); `--overwrite` deletes it.
RESULTS = (
    "metrics.jsonl",
    "completions.jsonl",
    "checkpoints",
    "adapters",
    "tensorboard",
    "trackio",
    "wandb",
    "curves.png",
)


class Phase(StrEnum):
    """Where the learner stands: status.json's `phase`, written by the learner, read by
    `up` (docs/run-directory.md lists them with the file's other fields)."""

    WAITING_FOR_ACTOR = "waiting_for_actor"  # no actor has said hello yet
    WAITING_FOR_REWARD_WORKER = "waiting_for_reward_worker"  # a "worker" reward has no worker
    TRAINING = "training"  # gathering and scoring groups for the next batch
    STEPPING = "stepping"  # an optimizer step under way (`since`: when it began): a stop waits for it
    EVALUATING = "evaluating"  # held-out evaluation (`eval`: its progress)
    DONE = "done"  # every step trained
    STOPPED = "stopped"  # stopped by a signal, checkpointed
    FAILED = "failed"  # a reward function failed; checkpointed, resumable once fixed


class RunExists(RuntimeError):
    """A new run would overwrite the results of another in its directory."""


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint, `RUN/checkpoints/step_NNNNNN/`, or None."""
    steps = sorted(p for p in (Path(run_dir) / "checkpoints").glob("step_*") if (p / "state.json").exists())
    return steps[-1] if steps else None


def checkpoint_step(path: Path) -> int:
    return json.loads((path / "state.json").read_text())["step"]


def trained(run_dir: str | Path) -> list[str]:
    """What of a run's results `run_dir` holds (empty: nothing would be lost)."""
    run_dir = Path(run_dir)
    found = [name for name in RESULTS if (run_dir / name).exists() and not _empty(run_dir / name)]
    newest = latest_checkpoint(run_dir)
    return [
        f"checkpoints up to step {checkpoint_step(newest)}" if name == "checkpoints" and newest else name
        for name in found
    ]


def _empty(path: Path) -> bool:
    return not any(path.iterdir()) if path.is_dir() else path.stat().st_size == 0


def refuse_to_overwrite(run_dir: str | Path) -> None:
    """Raise RunExists when `run_dir` holds another run's results, naming the two ways on."""
    found = trained(run_dir)
    if found:
        raise RunExists(
            f"{run_dir} holds a run ({', '.join(found)}): continue it with `orchestrator up "
            f"--resume {run_dir}`, or start over with --overwrite, which deletes those"
        )


def clear_results(run_dir: str | Path) -> None:
    """Delete a run's results and logs (`--overwrite`); its keys stay, so peers on other
    machines keep theirs."""
    run_dir = Path(run_dir)
    for name in RESULTS:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    for log in run_dir.glob("*.log"):
        log.unlink()


def write_atomic(path: str | Path, text: str) -> None:
    """Write a file that readers (and a resume after a kill) see whole or not at all: write
    a temporary file beside it, then rename it over (atomic within a file system)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)

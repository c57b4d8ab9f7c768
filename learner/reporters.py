"""Where else the metrics go (`log.report_to`, TRL's name): TensorBoard, trackio, Weights &
Biases. metrics.jsonl stays the record; each reporter gets every line the learner writes
there, training steps under TRL's `train/` prefix and evaluations under their `eval/` one.

Each backend is an optional extra, imported only when named. trackio keeps its database
in RUN/trackio and W&B runs offline in RUN/wandb unless the user says otherwise
(TRACKIO_DIR, WANDB_MODE=online), so a run never needs the network to log.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from runtime.config import Config
from runtime.config_sections import missing_backends


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """A metrics line's numbers under the names dashboards show (step excluded)."""
    return {
        (key if key.startswith("eval/") else f"train/{key}"): value
        for key, value in metrics.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step"
    }


class TensorBoard:
    def __init__(self, run_dir: Path, cfg: Config) -> None:
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def write(self, metrics: dict[str, Any]) -> None:
        for name, value in scalars(metrics).items():
            self.writer.add_scalar(name, value, metrics["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class Trackio:
    def __init__(self, run_dir: Path, cfg: Config) -> None:
        os.environ.setdefault("TRACKIO_DIR", str(run_dir / "trackio"))  # read when trackio is imported
        import trackio

        self.trackio = trackio
        trackio.init(project=cfg.log.project, name=run_dir.name, config=cfg.to_dict(), resume="allow")

    def write(self, metrics: dict[str, Any]) -> None:
        self.trackio.log(scalars(metrics), step=metrics["step"])

    def close(self) -> None:
        self.trackio.finish()


class WandB:
    def __init__(self, run_dir: Path, cfg: Config) -> None:
        import wandb

        self.run = wandb.init(
            project=cfg.log.project,
            name=run_dir.name,
            dir=str(run_dir),
            mode=os.environ.get("WANDB_MODE", "offline"),  # type: ignore[arg-type]
            config=cfg.to_dict(),
        )

    def write(self, metrics: dict[str, Any]) -> None:
        self.run.log(scalars(metrics), step=metrics["step"])

    def close(self) -> None:
        self.run.finish()


CLASSES = {"tensorboard": TensorBoard, "trackio": Trackio, "wandb": WandB}


def open_reporters(run_dir: Path, cfg: Config) -> list:
    """One reporter per `log.report_to` entry; RuntimeError naming the extra if one is missing."""
    missing = missing_backends(cfg.log.report_to)
    if missing:
        raise RuntimeError("; ".join(missing))
    return [CLASSES[name](run_dir, cfg) for name in cfg.log.report_to]

"""log.report_to: TensorBoard, trackio and W&B get every metrics line of a real run (each
test skipped when its extra is not installed), and a missing extra is named up front."""

from __future__ import annotations

import importlib.util
import json
import re
import sqlite3
import struct
from pathlib import Path

import numpy as np
import pytest

from learner.reporters import scalars
from runtime.config_sections import REPORT_BACKENDS as BACKENDS
from runtime.config_sections import missing_backends
from tests.helpers import held_out_config, orchestrator, read_metrics, run_up, write_config

INSTALLED = [name for name, (module, _) in BACKENDS.items() if importlib.util.find_spec(module)]
CHECKED = ("reward", "reward_std", "kl", "completions/mean_length", "num_tokens", "learning_rate")


@pytest.fixture(scope="module")
def reported_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    """One run of 3 steps, evaluated at steps 0, 2 and 3, reporting to every installed backend."""
    if not INSTALLED:
        pytest.skip("no logging backend installed (extras tensorboard, trackio, wandb)")
    tmp = tmp_path_factory.mktemp("reported")
    cfg = held_out_config(tmp, f'[log]\nreport_to = {json.dumps(INSTALLED)}\nproject = "tests"', steps=3)
    code, out = run_up(cfg)
    assert code == 0, out
    return tmp / "run", read_metrics(tmp / "run")


def expected(metrics: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """What a dashboard should hold: each line's scalars by name, with their step."""
    series: dict[str, list[tuple[int, float]]] = {}
    for m in metrics:
        for name, value in scalars(m).items():
            series.setdefault(name, []).append((m["step"], value))
    return series


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of a TensorBoard event file, read back from its records (length,
    length CRC, an Event protobuf, its CRC) with tensorboardX's protobuf classes."""
    from tensorboardX.proto import event_pb2

    found: dict[str, list[tuple[int, float]]] = {}
    for path in log_dir.glob("events.out.tfevents.*"):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            for v in event.summary.value:
                found.setdefault(v.tag, []).append((event.step, v.simple_value))
    return found


@pytest.mark.slow
def test_tensorboard_gets_every_line(reported_run):
    pytest.importorskip("tensorboardX")
    run, metrics = reported_run
    found, want = read_scalars(run / "tensorboard"), expected(metrics)
    # TensorBoard's tag rules turn what is not a letter, digit, _ . - or / into _: pass@1 is pass_1.
    for name in [f"train/{k}" for k in CHECKED] + ["eval/pass@1", "eval/reward_mean"]:
        tag = re.sub(r"[^\w./-]", "_", name)
        assert [s for s, _ in found[tag]] == [s for s, _ in want[name]], name
        np.testing.assert_allclose([v for _, v in found[tag]], [v for _, v in want[name]], rtol=1e-6)
    assert [s for s, _ in found["train/reward"]] == [1, 2, 3]
    assert [s for s, _ in found["eval/pass_1"]] == [0, 2, 3]


def test_trackio_stores_every_line_in_the_run_directory(reported_run):
    pytest.importorskip("trackio")
    run, metrics = reported_run
    db = run / "trackio" / "tests.db"
    assert db.exists(), list((run / "trackio").iterdir())
    with sqlite3.connect(db) as con:
        rows = con.execute(
            "SELECT step, metrics FROM metrics WHERE run_name = ? ORDER BY id", (run.name,)
        ).fetchall()
    logged = [(step, json.loads(values)) for step, values in rows]
    assert [step for step, _ in logged] == [m["step"] for m in metrics]
    for (_, values), m in zip(logged, metrics):
        assert values.keys() == scalars(m).keys()
        for name, value in scalars(m).items():
            assert values[name] == pytest.approx(value, rel=1e-6)


def test_wandb_writes_an_offline_run(reported_run):
    pytest.importorskip("wandb")
    run, _ = reported_run
    offline = list((run / "wandb").glob("offline-run-*"))
    assert len(offline) == 1, list((run / "wandb").iterdir())
    (record,) = offline[0].glob("run-*.wandb")
    data = record.read_bytes()
    for name in [f"train/{k}" for k in CHECKED] + ["eval/pass@1"]:
        assert name.encode() in data, name


def test_a_missing_backend_is_named_before_the_run_starts(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    assert missing_backends(("tensorboard", "wandb")) == [
        "log.report_to 'wandb' needs wandb: pip install 'mlx-rl-ipc[wandb]'"
    ]
    # The orchestrator refuses the same way (exit 2) when the library is really absent:
    # a sitecustomize that hides it stands in for an environment without the extra.
    (tmp_path / "hide").mkdir()
    (tmp_path / "hide" / "sitecustomize.py").write_text(
        "import importlib.util as u\n_f = u.find_spec\n"
        "u.find_spec = lambda n, *a: None if n == 'tensorboardX' else _f(n, *a)\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "hide"))
    proc = orchestrator("up", "--config", str(write_config(tmp_path, '[log]\nreport_to = ["tensorboard"]')))
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert "log.report_to 'tensorboard' needs tensorboardX: pip install 'mlx-rl-ipc[tensorboard]'" in out
    assert not (tmp_path / "run" / "metrics.jsonl").exists()

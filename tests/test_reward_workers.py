"""External reward workers on the reward socket, with real processes end to end."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import protocol
from tests.conftest import ROOT, write_config
from tests.test_e2e import orchestrator, read_metrics, wait_for

PLAIN_WORKER = Path(__file__).parent / "workers" / "plain_worker.py"
WORKER_CONFIG = "[reward]\ntimeout_s = 3.0\nmax_attempts = 10"


def start_worker(run: Path, *args: str, stdout=subprocess.DEVNULL) -> subprocess.Popen:
    wait_for(run / "endpoints.json")
    endpoint = protocol.read_endpoints(run)["reward"]
    return subprocess.Popen([sys.executable, str(PLAIN_WORKER), endpoint, *args], text=True,
                            stdout=stdout, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, workers: list[subprocess.Popen]) -> str:
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
            w.wait()
    assert proc.returncode == 0, out
    return out


def assert_nothing_lost(metrics: list[dict], steps: int, batch: int) -> None:
    last = metrics[-1]
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert last["groups_trained"] == steps * batch
    for m in metrics:
        assert m["groups_received"] == m["groups_trained"] + m["groups_dropped"] + m["groups_queued"]


def test_a_worker_from_protocol_md_alone_trains_a_run(tmp_path):
    cfg = write_config(tmp_path, WORKER_CONFIG, steps=4, reward="worker")
    proc = orchestrator("up", "--config", str(cfg))
    run = tmp_path / "run"
    worker = start_worker(run)
    finish(proc, [worker])
    metrics = read_metrics(run)
    assert_nothing_lost(metrics, 4, 2)
    assert metrics[-1]["groups_dropped"] == 0
    assert metrics[-1]["reward_rejected_replies"] == 0
    for m in metrics:
        assert m["reward/worker"] == pytest.approx(m["reward_mean"])
        assert m["reward/worker:digits"] == pytest.approx(m["reward_mean"])


def test_progress_says_when_no_worker_is_attached(tmp_path):
    cfg = write_config(tmp_path, WORKER_CONFIG, steps=2, reward="worker")
    proc = orchestrator("up", "--config", str(cfg))
    run = tmp_path / "run"
    deadline = time.monotonic() + 60
    while True:
        status = json.loads((run / "status.json").read_text()) if (run / "status.json").exists() else {}
        if status.get("phase") == "waiting_for_reward_worker":
            break
        assert time.monotonic() < deadline, status
        time.sleep(0.2)
    worker = start_worker(run)
    out = finish(proc, [worker])
    assert "waiting for a reward worker on ipc://" in out
    assert "orchestrator reward-worker module:function" in out


def test_a_killed_worker_loses_no_group(tmp_path):
    steps, batch = 8, 2
    cfg = write_config(tmp_path, WORKER_CONFIG, steps=steps, reward="worker")
    proc = orchestrator("up", "--config", str(cfg))
    run = tmp_path / "run"
    # The doomed worker answers one request, takes the next and dies holding it.
    doomed = start_worker(run, "--hang-after", "1", stdout=subprocess.PIPE)
    survivor = start_worker(run)
    ready, _, _ = select.select([doomed.stdout], [], [], 120)
    assert ready, "the doomed worker never took a second request"
    assert doomed.stdout.readline().startswith("holding request")
    doomed.send_signal(signal.SIGKILL)
    finish(proc, [doomed, survivor])
    metrics = read_metrics(run)
    assert_nothing_lost(metrics, steps, batch)
    assert metrics[-1]["groups_dropped"] == 0  # its request went to the survivor
    assert "missed the 3 s deadline" in (run / "learner.log").read_text()


def test_garbage_replies_are_logged_and_survived(tmp_path):
    cfg = write_config(tmp_path, WORKER_CONFIG, steps=3, reward="worker")
    proc = orchestrator("up", "--config", str(cfg))
    run = tmp_path / "run"
    worker = start_worker(run, "--garbage", "4")
    finish(proc, [worker])
    metrics = read_metrics(run)
    assert_nothing_lost(metrics, 3, 2)
    # four broken replies, each rejected and its request sent out again
    assert metrics[-1]["reward_rejected_replies"] == 4 and metrics[-1]["reward_retries"] == 4
    log = (run / "learner.log").read_text()
    assert "bad reply from reward worker" in log
    assert "not valid msgpack" in log
    assert "reply names request 'no-such-request'" in log
    assert "rewards for 4 completions" in log
    assert "every reward must be a finite number" in log


def test_python_reward_worker_command(tmp_path):
    """`orchestrator reward-worker module:function --run-dir RUN` serves a TRL-style function."""
    cfg = write_config(tmp_path, WORKER_CONFIG, steps=3, reward="worker")
    proc = orchestrator("up", "--config", str(cfg))
    run = tmp_path / "run"
    wait_for(run / "endpoints.json")
    worker = subprocess.Popen([sys.executable, "-m", "orchestrator", "reward-worker", "tiny_task:reward",
                               "--run-dir", str(run)], cwd=tmp_path, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    finish(proc, [])
    out, _ = worker.communicate(timeout=30)
    assert worker.returncode == 0, out
    assert "stopping: run finished" in out
    assert_nothing_lost(read_metrics(run), 3, 2)

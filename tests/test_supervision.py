"""Supervision, checkpoints and resume with real processes: kill one, the run goes on."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import protocol
from tests.helpers import (
    assert_steps_once_and_nothing_lost,
    orchestrator,
    pid_of,
    read_metrics,
    wait_for,
    wait_for_step,
    write_config,
)

pytestmark = pytest.mark.slow  # real processes end to end: left out of the fast subset

CHECKPOINTS = "[train]\ncheckpoint_every = 2\nkeep_checkpoints = 100\n[run]\nhang_timeout_s = 60.0"


def kill_mid_run(tmp_path: Path, role: str, at_step: int, steps: int) -> tuple[Path, str]:
    """Start a run, SIGKILL `role` once `at_step` is done, and let the run finish."""
    proc = orchestrator("up", "--config", str(write_config(tmp_path, CHECKPOINTS, steps=steps)))
    run = tmp_path / "run"
    wait_for_step(run, at_step, proc)
    os.kill(pid_of(run, role), signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    return run, out


def test_a_killed_actor_is_restarted_and_the_run_completes(tmp_path):
    steps = 8
    run, out = kill_mid_run(tmp_path, "actor", 2, steps)
    assert "actor exited with code -9; restarting it (1/3)" in out
    metrics = read_metrics(run)
    assert_steps_once_and_nothing_lost(metrics, steps)
    # the learner kept its state: its policy version never went back
    assert [m["policy_version"] for m in metrics] == list(range(1, steps + 1))
    assert "data cursor from the learner" in (run / "actor.log").read_text()


def test_a_killed_learner_resumes_from_its_checkpoint(tmp_path):
    steps = 8
    run, out = kill_mid_run(tmp_path, "learner", 5, steps)
    assert "learner exited with code -9; restarting it (1/3)" in out
    log = (run / "learner.log").read_text()
    resumed = re.search(r"resumed from (step_\d+): step (\d+), adapters (\w+)", log)
    assert resumed, log
    checkpoint, step, digest = resumed.group(1), int(resumed.group(2)), resumed.group(3)
    assert step >= 4 and step % 2 == 0
    # the restarted learner holds exactly the checkpoint's adapters
    state = json.loads((run / "checkpoints" / checkpoint / "state.json").read_text())
    assert state["adapters_digest"] == digest
    assert_steps_once_and_nothing_lost(read_metrics(run), steps)


def test_restarts_are_bounded(tmp_path):
    (tmp_path / "crash.py").write_text("import os\ndef reward(**kw):\n    os._exit(7)\n")
    cfg = write_config(tmp_path, "[run]\nmax_restarts = 1", steps=3, reward="crash:reward")
    proc = orchestrator("up", "--config", str(cfg))
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1
    assert "learner exited with code 7; restarting it (1/1)" in out
    assert "learner exited with code 7, and it was restarted 1 times already" in out


def test_a_resumed_run_repeats_the_uninterrupted_run(tmp_path):
    """Run A trains 4 steps; run B trains 2, stops, and is resumed to 4. B's steps 3 and 4
    equal A's: the same adapters (to float rounding), rewards and loss within 1e-6."""
    import mlx.core as mx

    extra = "[train]\ncheckpoint_every = 2\nkeep_checkpoints = 100"
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    # A and B's first part are independent: side by side, they share the cores' idle time.
    first = [
        orchestrator("up", "--config", str(write_config(a, extra, steps=4))),
        orchestrator("up", "--config", str(write_config(b, extra, steps=2))),
    ]
    assert [p.wait(300) for p in first] == [0, 0]
    proc = orchestrator("up", "--resume", str(b / "run"), "--steps", "4")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    # It says where it goes on from, and shows only the steps it trains.
    assert "resuming from the checkpoint of step 2 of 4" in out
    assert [int(n) for n in re.findall(r"^step +(\d+)/4", out, re.M)] == [3, 4], out
    ma, mb = read_metrics(a / "run"), read_metrics(b / "run")
    assert [m["step"] for m in mb] == [1, 2, 3, 4]
    for x, y in zip(ma, mb):
        for key in ("reward", "loss", "kl", "mismatch_kl", "completions/mean_length", "num_tokens"):
            assert y[key] == pytest.approx(x[key], abs=1e-6), (x["step"], key)
    # The same adapters, to float rounding: each run learns a batch's groups as they
    # arrive, cut into takes as the timing has it (tests/test_streamed_step.py).
    ends = [
        mx.load(str(r / "run" / "checkpoints" / "step_000004" / "adapters" / "adapters.safetensors"))
        for r in (a, b)
    ]
    start = mx.load(str(b / "run" / "checkpoints" / "step_000002" / "adapters" / "adapters.safetensors"))
    moved = max(float(mx.abs(ends[0][k] - start[k]).max()) for k in start)
    assert moved > 1e-4
    for k in start:
        np.testing.assert_allclose(
            np.array(ends[1][k]), np.array(ends[0][k]), rtol=1e-3, atol=1e-3 * moved, err_msg=k
        )
    assert np.isfinite([m["loss"] for m in mb]).all()


def test_a_metrics_line_cut_short_by_a_kill_is_dropped_on_resume(tmp_path):
    from learner.metrics import keep_metrics_until

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "los')
    keep_metrics_until(path, 2)
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    path.write_text('{"step": 1}\n{"step": 2, "los')
    keep_metrics_until(path, 5)
    assert path.read_text() == '{"step": 1}\n'


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc/PID/environ (Linux)")
@pytest.mark.parametrize("staleness", [0, 1, "user's"])
def test_blas_threads_follow_whether_the_processes_take_turns(tmp_path, staleness):
    """CPU backend: taking turns (max_staleness 0) each process gets every core's BLAS
    thread; overlapped they share the cores; a user's OPENBLAS_NUM_THREADS is kept."""
    cfg = write_config(tmp_path, f"[train]\nmax_staleness = {1 if staleness == 1 else 0}", steps=40)
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    if staleness == "user's":
        env["OPENBLAS_NUM_THREADS"] = "7"
    proc = orchestrator("up", "--config", str(cfg), env=env)
    run = tmp_path / "run"
    try:
        wait_for_step(run, 1, proc)
        cores = os.cpu_count()
        want = {0: str(cores), 1: str(max(1, cores // 2)), "user's": "7"}[staleness]
        for role in ("actor", "learner"):
            env = Path(f"/proc/{pid_of(run, role)}/environ").read_bytes().split(b"\0")
            assert f"OPENBLAS_NUM_THREADS={want}".encode() in env, role
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)


EXTERNAL_WORKERS = """
[reward]
functions = ["env", "worker"]
[env]
environment = "socket"
max_turns = 3
max_episode_tokens = 64
timeout_s = 10.0
[train]
checkpoint_every = 2
"""


def external_workers(run: Path) -> list[subprocess.Popen]:
    """A reward worker (this project's) and an env worker written from PROTOCOL.md alone,
    started by hand: nothing restarts them."""
    from tests.helpers import raw_worker

    reward = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "reward-worker", "tiny_task:reward", "--run-dir", str(run)],
        cwd=run.parent,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    return [reward, raw_worker(protocol.read_endpoints(run)["env"])]


def test_workers_outlive_a_killed_orchestrator_and_serve_the_resumed_run(tmp_path):
    """SIGKILL `orchestrator up` mid-run: its learner and actor stop on their own (the
    lifeline) and tell the workers to wait, not to exit; `up --resume` brings the run
    back, and the same two workers, never restarted, serve it to the end, which tells them
    to exit."""
    from tests.helpers import Lines

    steps = 6
    proc = orchestrator("up", "--config", str(write_config(tmp_path, EXTERNAL_WORKERS, steps=steps)))
    run = tmp_path / "run"
    wait_for(run / "endpoints.json")
    workers = external_workers(run)
    lines = [Lines(w) for w in workers]
    resumed = None
    try:
        wait_for_step(run, 3, proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        t0 = time.monotonic()
        resumed = orchestrator("up", "--resume", str(run))
        out, _ = resumed.communicate(timeout=240)
        assert resumed.returncode == 0, out
        assert time.monotonic() - t0 < 90
        for w in workers:
            assert w.wait(timeout=30) == 0
    finally:
        for p in (proc, resumed, *workers):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    assert_steps_once_and_nothing_lost(read_metrics(run), steps)
    env_said = [line for _, line in lines[1].lines]
    assert any(line.startswith("waiting: ") for line in env_said), env_said
    assert env_said[-1] == "stopped: the run is over", env_said
    reward_said = "\n".join(line for _, line in lines[0].lines)
    assert "the learner goes away" in reward_said and "the learner restarted (instance" in reward_said

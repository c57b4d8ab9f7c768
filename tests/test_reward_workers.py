"""External reward workers on the reward socket, with real processes end to end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import protocol
from tests.helpers import (
    ROOT,
    WORKER_CONFIG,
    Lines,
    assert_nothing_lost,
    finish,
    orchestrator,
    pid_of,
    read_metrics,
    start_worker,
    wait_for,
    wait_for_step,
    write_config,
)

pytestmark = pytest.mark.slow  # real processes end to end: left out of the fast subset

CONFORMANCE_WORKER = Path(__file__).parent / "workers" / "conformance_worker.py"


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
        assert m["rewards/worker/mean"] == pytest.approx(m["reward"])
        assert m["rewards/worker:digits/mean"] == pytest.approx(m["reward"])


def test_progress_says_when_no_worker_is_attached(tmp_path):
    cfg = write_config(tmp_path, WORKER_CONFIG, steps=2, reward="worker")
    proc = orchestrator("up", "--config", str(cfg))
    run = tmp_path / "run"
    progress = Lines(proc)
    _, said = progress.wait_for("waiting for a reward worker on ipc://", timeout=60)
    assert "orchestrator reward-worker module:function" in said
    worker = start_worker(run)
    proc.wait(300)
    worker.wait(30)
    assert proc.returncode == 0, progress.lines


def test_a_hung_worker_s_request_goes_elsewhere_after_the_deadline(tmp_path):
    """A worker that is alive (it beats) but never answers: its request waits out the
    deadline, then the other worker scores it. Nothing is lost."""
    steps, batch = 8, 2
    cfg = write_config(tmp_path, WORKER_CONFIG, steps=steps, reward="worker")
    proc = orchestrator("up", "--config", str(cfg))
    run = tmp_path / "run"
    hung = start_worker(run, "--hang-after", "1")
    survivor = start_worker(run)
    finish(proc, [hung, survivor])
    metrics = read_metrics(run)
    assert_nothing_lost(metrics, steps, batch)
    assert metrics[-1]["groups_dropped"] == 0  # its request went to the survivor
    assert "missed the 3 s deadline" in (run / "learner.log").read_text()


def test_a_killed_worker_s_request_is_scored_by_the_other_within_5_s(tmp_path):
    """Default deadline (60 s): the learner notices the dead worker by its missing
    heartbeats, not by the deadline."""
    cfg = write_config(tmp_path, steps=6, reward="worker")
    proc = orchestrator("up", "--config", str(cfg))
    run = tmp_path / "run"
    doomed = start_worker(run, "--hang-after", "1", stdout=subprocess.PIPE)
    survivor = start_worker(run, stdout=subprocess.PIPE)
    doomed_lines, survivor_lines = Lines(doomed), Lines(survivor)
    _, held = doomed_lines.wait_for("holding request")
    request_id = held.split()[-1]
    doomed.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    scored_at, _ = survivor_lines.wait_for(f"scored {request_id}", timeout=30)
    print(f"re-scored {scored_at - killed_at:.2f} s after the kill")
    assert scored_at - killed_at < 5
    finish(proc, [doomed, survivor])
    metrics = read_metrics(run)
    assert_nothing_lost(metrics, 6, 2)
    assert metrics[-1]["groups_dropped"] == 0 and metrics[-1]["reward_lost_workers"] >= 1
    assert "sent nothing for" in (run / "learner.log").read_text()


def train_through_a_learner_kill(tmp_path: Path, worker_args: list[str], steps: int = 8) -> tuple[Path, str]:
    """A run scored by one external worker (`python WORKER_ARGS`, started from tmp_path),
    whose learner is SIGKILLed after step 3. Returns the run directory and the worker's
    output once the run and the worker have ended; asserts both ended well."""
    cfg = write_config(
        tmp_path, "[train]\ncheckpoint_every = 2\nkeep_checkpoints = 100", steps=steps, reward="worker"
    )
    proc = orchestrator("up", "--config", str(cfg))
    run = tmp_path / "run"
    wait_for(run / "endpoints.json")
    worker = subprocess.Popen(
        [sys.executable, *worker_args, "--run-dir", str(run)],
        cwd=tmp_path,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        wait_for_step(run, 3, proc)
        os.kill(pid_of(run, "learner"), signal.SIGKILL)
        out = finish(proc, [])
        worker_out, _ = worker.communicate(timeout=30)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert "learner exited with code -9; restarting it (1/3)" in out
    assert worker.returncode == 0, worker_out
    metrics = read_metrics(run)
    assert_nothing_lost(metrics, steps, 2)
    assert metrics[-1]["groups_dropped"] == 0
    return run, worker_out


def test_a_restarted_learner_keeps_its_reward_worker(tmp_path):
    """SIGKILL the learner with an `orchestrator reward-worker` attached: the restarted
    learner trains to the end with that same worker, which attaches again by itself and
    exits when the run ends."""
    command = ["-m", "orchestrator", "reward-worker", "tiny_task:reward"]
    run, out = train_through_a_learner_kill(tmp_path, command)
    assert "the learner restarted" in out and "attaching again" in out
    assert "stopping: training finished" in out
    assert "malformed" not in out  # the learner's hello is what PROTOCOL.md says
    assert out.count("serving tiny_task:reward") == 1  # the same worker throughout
    # the socket's counters go on across the restart (restored from the checkpoint)
    metrics = read_metrics(run)
    for key in ("reward_retries", "reward_late_replies", "reward_lost_workers"):
        values = [m[key] for m in metrics]
        assert values == sorted(values), (key, values)


def test_a_minimal_worker_from_the_conformance_section_survives_a_learner_restart(tmp_path):
    """tests/workers/conformance_worker.py was written from PROTOCOL.md's conformance
    section alone (pyzmq + msgpack, nothing of ours). It trains a run whose learner is
    SIGKILLed mid-run: it attaches again by itself and is told to stop at the end."""
    _, out = train_through_a_learner_kill(tmp_path, [str(CONFORMANCE_WORKER)])
    assert "reattached" in out and "stopped: training finished" in out


def test_a_worker_exits_when_its_learner_is_gone_for_good(tmp_path):
    """No stop ever comes (the learner was SIGKILLed and nothing restarts it): the worker
    waits out --learner-timeout, then exits with an error."""
    import zmq

    endpoint = f"ipc://{tmp_path}/reward.sock"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(endpoint)
    (tmp_path / "r.py").write_text("def reward(completions, **kw):\n    return [0.0] * len(completions)\n")
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "orchestrator",
            "reward-worker",
            "r:reward",
            "--connect",
            endpoint,
            "--learner-timeout",
            "2",
        ],
        cwd=tmp_path,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert router.poll(30_000), "the worker never said hello"
        assert protocol.decode(router.recv_multipart()[1:]).kind == protocol.HELLO
        router.close(linger=0)  # the learner is gone, without a word
        gone_at = time.monotonic()
        out, _ = worker.communicate(timeout=30)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        ctx.term()
    assert worker.returncode == 1, out
    assert "it is gone, stopping" in out
    assert 2 <= time.monotonic() - gone_at < 10


def hello_from_worker(tmp_path: Path, *args: str, cwd: Path) -> tuple[bool, str]:
    """Start `orchestrator reward-worker ARGS` against a bare socket in `cwd`: whether it
    said hello within 30 s, and what it printed."""
    import zmq

    endpoint = f"ipc://{tmp_path}/reward.sock"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(endpoint)
    command = [sys.executable, "-m", "orchestrator", "reward-worker", *args, "--connect", endpoint]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    worker = subprocess.Popen(
        command, cwd=cwd, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
    )
    try:
        said_hello = False
        deadline = time.monotonic() + 30
        while worker.poll() is None and time.monotonic() < deadline and not said_hello:
            said_hello = bool(router.poll(200))
    finally:
        if worker.poll() is None:
            worker.terminate()
        out, _ = worker.communicate(timeout=30)
        router.close(linger=0)
        ctx.term()
    return said_hello, out


def test_a_reward_worker_imports_its_module_from_search_path(tmp_path):
    """The module lives in the user's task folder; the worker is started from elsewhere.
    Without --search-path it says which module it could not import; with it, it attaches."""
    task = tmp_path / "task"
    task.mkdir()
    (task / "my_reward.py").write_text("def score(completions, **kw):\n    return [1.0] * len(completions)\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    attached, out = hello_from_worker(tmp_path, "my_reward:score", cwd=elsewhere)
    assert not attached and "my_reward" in out, out
    attached, out = hello_from_worker(tmp_path, "my_reward:score", "--search-path", str(task), cwd=elsewhere)
    assert attached, out


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
    worker = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "reward-worker", "tiny_task:reward", "--run-dir", str(run)],
        cwd=tmp_path,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    finish(proc, [])
    out, _ = worker.communicate(timeout=30)
    assert worker.returncode == 0, out
    assert "stopping: training finished" in out
    assert_nothing_lost(read_metrics(run), 3, 2)

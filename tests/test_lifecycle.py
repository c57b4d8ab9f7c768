"""Lifecycle with real processes: stop signals, a killed orchestrator, a busy run
directory, and which exits are restarted (crashes) or end the run (user errors)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from protocol import connection
from runtime import lifecycle
from tests.helpers import ROOT, alive, orchestrator, pid_of, read_metrics, run_up, wait_for_step, write_config

pytestmark = pytest.mark.slow  # real processes end to end: left out of the fast subset

ENDLESS = 100000


def start_endless_run(tmp_path: Path, **popen) -> tuple[subprocess.Popen, Path, list[int]]:
    """`orchestrator up` on a run that would train for hours, past its second step;
    returns it with the learner's and the actor's pids."""
    cfg = write_config(tmp_path, "[train]\ncheckpoint_every = 0", steps=ENDLESS)
    proc = orchestrator("up", "--config", str(cfg), start_new_session=True, **popen)
    run = tmp_path / "run"
    wait_for_step(run, 2, proc)
    return proc, run, [pid_of(run, "learner"), pid_of(run, "actor")]


def wait_until_dead(pids: list[int], timeout: float) -> float:
    t0 = time.monotonic()
    while any(alive(p) for p in pids):
        left = [p for p in pids if alive(p)]
        assert time.monotonic() - t0 < timeout, f"still alive after {timeout} s: {left}"
        time.sleep(0.1)
    return time.monotonic() - t0


def ignore_sigint() -> None:
    # What a shell does to a background job of a script (`orchestrator up &`).
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def hangup_as_a_terminal_leaves_it() -> None:
    # A run started from a terminal: SIGHUP at its default, even if this suite itself runs
    # under nohup (whose ignored SIGHUP the orchestrator keeps, by design).
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


@pytest.mark.parametrize(
    "sig, preexec",
    [(signal.SIGTERM, None), (signal.SIGHUP, hangup_as_a_terminal_leaves_it), (signal.SIGINT, ignore_sigint)],
    ids=["SIGTERM", "SIGHUP", "SIGINT-inherited-ignored"],
)
def test_a_stop_signal_checkpoints_and_leaves_no_child(tmp_path, sig, preexec):
    proc, run, children = start_endless_run(tmp_path, preexec_fn=preexec)
    t0 = time.monotonic()
    os.kill(proc.pid, sig)  # the orchestrator alone, as `kill`, systemd or a scheduler would
    out, _ = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 40, out
    assert proc.returncode == 128 + sig, out
    assert not any(alive(p) for p in children)
    assert f"{signal.Signals(sig).name}: asking the learner to checkpoint" in out
    # checkpoint_every = 0: the only checkpoint is the one the signal asked for
    checkpoints = sorted((run / "checkpoints").glob("step_*"))
    assert checkpoints, out + (run / "learner.log").read_text()
    state = json.loads((checkpoints[-1] / "state.json").read_text())
    assert state["step"] == read_metrics(run)[-1]["step"] >= 2
    assert json.loads((run / "status.json").read_text())["phase"] == "stopped"
    assert "restarting" not in out


def test_a_second_signal_kills_at_once(tmp_path):
    proc, run, children = start_endless_run(tmp_path)
    os.kill(proc.pid, signal.SIGTERM)
    os.kill(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, out
    wait_until_dead(children, 5)


def test_sigkill_of_the_orchestrator_leaves_no_child(tmp_path):
    proc, run, children = start_endless_run(tmp_path)
    proc.kill()
    proc.communicate()
    took = wait_until_dead(children, 15)
    assert took < 15
    # they stopped cleanly: the learner wrote a checkpoint as on SIGTERM
    assert "the orchestrator is gone; stopping" in (run / "learner.log").read_text()
    assert sorted((run / "checkpoints").glob("step_*"))


def test_a_live_run_directory_refuses_a_second_learner_and_a_second_orchestrator(tmp_path):
    proc, run, children = start_endless_run(tmp_path)
    try:
        second = subprocess.run(
            [sys.executable, "-m", "learner", "--run-dir", str(run)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode == lifecycle.EXIT_BUSY, second.stderr
        assert f"is in use by pid {proc.pid}" in second.stderr
        code, out = run_up(tmp_path / "run.toml", timeout=60)
        assert code == lifecycle.EXIT_BUSY, out
        assert f"run directory {run} is in use by pid {proc.pid}" in out
        # the live run's files were not touched: its metrics start at step 1 and go on
        assert read_metrics(run)[0]["step"] == 1
        assert alive(children[0])
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=60)


def test_a_failing_reward_function_ends_the_run_at_once_naming_it(tmp_path):
    (tmp_path / "bad_reward.py").write_text(
        "def reward(prompts, completions, **kw):\n    raise KeyError('no such column: answer')\n"
    )
    code, out = run_up(write_config(tmp_path, steps=3, reward="bad_reward:reward"))
    assert code == lifecycle.EXIT_USER_ERROR, out
    assert "learner stopped the run (user error, exit code 4)" in out
    assert "reward function bad_reward:reward raised KeyError" in out
    assert "no such column: answer" in out and "on data row" in out
    assert "restarting" not in out  # a user error is never replayed


def test_a_data_file_that_does_not_parse_stops_the_run_before_it_starts(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "repeat 1", "target": "1"}\n{"prompt": \n')
    code, out = run_up(write_config(tmp_path, f'[data]\nprompts = "{bad}"', steps=2))
    assert code == lifecycle.EXIT_USER_ERROR, out
    assert f"data error: {bad}:2: not valid JSON" in out
    assert "started learner" not in out


def test_a_prompt_longer_than_the_context_stops_the_run_naming_the_row(tmp_path):
    long = tmp_path / "long.jsonl"
    long.write_text('{"prompt": "repeat 1", "target": "1"}\n{"prompt": "%s", "target": "2"}\n' % ("2" * 600))
    cfg = write_config(tmp_path, f'[data]\nprompts = "{long}"\n[sampling]\nmax_prompt_tokens = 1000', steps=2)
    code, out = run_up(cfg)
    assert code == lifecycle.EXIT_USER_ERROR, out
    assert "data row 1: 600 prompt tokens + sampling.max_tokens 6 exceed the model's context of 512" in out


def test_the_actor_stops_the_run_on_a_data_error_instead_of_being_restarted(tmp_path):
    """The data file changes between the plan and the actor's start (or the actor runs
    without the plan): the actor ends the run with exit 4 and is not replayed."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "repeat 1", "target": "1"}\n')
    cfg = write_config(tmp_path, f'[data]\nprompts = "{prompts}"', steps=2)
    proc = orchestrator("up", "--config", str(cfg))
    run = tmp_path / "run"
    deadline = time.monotonic() + 60
    while not (run / "actor.log").exists():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    prompts.write_text('{"prompt": "repeat 1", "target": "1"}\n{"prompt": \n')
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == lifecycle.EXIT_USER_ERROR, out
    assert "actor stopped the run (user error, exit code 4)" in out
    assert f"{prompts}:2: not valid JSON" in out
    assert "restarting" not in out


def test_only_crashes_are_restarted(tmp_path):
    """The supervisor's verdict on each kind of exit, with real exited processes."""
    from orchestrator.launch import Child
    from orchestrator.supervisor import RunFailed, Supervisor
    from runtime.config import load_config

    sup = Supervisor(load_config(write_config(tmp_path, steps=2)), out=open(os.devnull, "w"))

    def exited_with(code: int) -> None:
        proc = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])
        proc.wait()
        sup.children["actor"] = Child("actor", proc, tmp_path / "actor.log")

    try:
        exited_with(0)
        assert sup.failure("actor") is None  # told to stop by the learner: not restarted
        exited_with(7)
        assert sup.failure("actor") == "exited with code 7"
        for code in (lifecycle.EXIT_USER_ERROR, lifecycle.EXIT_BUSY):
            exited_with(code)
            with pytest.raises(RunFailed) as e:
                sup.failure("actor")
            assert e.value.code == code
    finally:
        sup.close()


def test_a_heartbeat_file_is_never_seen_half_written(tmp_path):
    # A process beating as fast as it can; this test reads the file meanwhile, as the
    # supervisor's readers and users' scripts do. A truncate-then-write would show "".
    beat_fast = (
        "import time, runtime.heartbeat as h; h.INTERVAL_S = 0; "
        f"h.start_heartbeat({str(tmp_path)!r}, 'actor'); time.sleep(3)"
    )
    proc = subprocess.Popen([sys.executable, "-c", beat_fast], cwd=ROOT)
    try:
        path, reads = tmp_path / "heartbeat.actor", 0
        while proc.poll() is None:
            try:
                text = path.read_text()
            except FileNotFoundError:
                continue  # not yet written
            pid, beat_time = text.split()
            assert int(pid) == proc.pid and float(beat_time) > 0
            reads += 1
        assert reads > 100
    finally:
        proc.kill()
        proc.wait()


OUT_OF_DESCRIPTORS = """
import os, resource, sys, time
from runtime.heartbeat import heartbeat_path, start_heartbeat
run = sys.argv[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
start_heartbeat(run, "x")
time.sleep(1.5)
taken = []
try:
    while True:
        taken.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
time.sleep(2.5)  # every beat meanwhile fails
for fd in taken:
    os.close(fd)
since = time.time()
time.sleep(2.5)
print("beating" if os.stat(heartbeat_path(run, "x")).st_mtime > since else "stopped")
"""


def test_the_heartbeat_outlives_a_moment_without_descriptors(tmp_path):
    """A flood of connections can take every descriptor for a moment; a heartbeat that
    stopped for good would have the orchestrator kill a healthy process. It beats again
    once descriptors are free, and says once that it could not."""
    done = subprocess.run(
        [sys.executable, "-c", OUT_OF_DESCRIPTORS, str(tmp_path)],
        cwd=ROOT,
        env=lifecycle.child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.strip() == "beating", done.stdout + done.stderr
    assert done.stderr.count("cannot write the heartbeat") == 1, done.stderr


def test_a_second_run_in_a_run_directory_is_refused_unless_asked_to_overwrite(tmp_path):
    """`up` over a directory that holds a run's results refuses, naming `--resume` and
    `--overwrite`, and touches nothing; with `--overwrite` it starts over."""
    cfg = write_config(tmp_path, "[train]\ncheckpoint_every = 2", steps=2)
    run = tmp_path / "run"
    code, out = run_up(cfg)
    assert code == 0, out
    results = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.suffix not in (".log", ".lock")}
    assert (run / "learner.log").read_text().count("wrote checkpoint step_000002") == 1  # not again at end
    code, out = run_up(cfg)
    assert code == lifecycle.EXIT_CONFIG, out
    assert (
        f"error: {run} holds a run (metrics.jsonl, checkpoints up to step 2, adapters): continue it with "
        f"`orchestrator up --resume {run}`, or start over with --overwrite"
    ) in out
    assert {p: p.read_bytes() for p in results} == results
    code, out = run_up(cfg, "--overwrite", "--steps", "1")
    assert code == 0, out
    assert [m["step"] for m in read_metrics(run)] == [1]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001"]


def test_peers_started_by_hand_exit_when_their_run_has_ended(tmp_path):
    """A remote actor or a worker started (or restarted) a moment after a run's last step
    never hears the learner's stop: it finds the run's final-stop mark with no process
    holding the run lock, and exits 0 at once, instead of waiting minutes for a learner
    that will never come back. Without the mark (a learner restarting) they wait."""
    cfg = write_config(tmp_path)
    run = tmp_path / "run"
    subprocess.run(
        [sys.executable, "-m", "orchestrator", "prepare", "--config", str(cfg)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    logs = {name: tmp_path / f"{name}.log" for name in ("actor", "reward-worker")}
    commands = {
        "actor": ["-m", "actor", "run"],
        "reward-worker": ["-m", "orchestrator", "reward-worker", "tiny_task:reward"],
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, *command, "--run-dir", str(run)],
            cwd=tmp_path,
            stdout=logs[name].open("w"),
            stderr=subprocess.STDOUT,
        )
        for name, command in commands.items()
    }
    try:
        time.sleep(4 * connection.RUN_OVER_CHECK_S + 2)  # no learner yet, and no mark: they wait
        assert {n: p.poll() for n, p in procs.items()} == {"actor": None, "reward-worker": None}
        lifecycle.mark_final_stop(run)
        codes = {n: p.wait(30) for n, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == {"actor": 0, "reward-worker": 0}, {n: logs[n].read_text()[-2000:] for n in logs}
    for path in logs.values():
        assert "has ended" in path.read_text(), path.read_text()

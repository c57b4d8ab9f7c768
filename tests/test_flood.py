"""A run bound to every interface holds against strangers: a flood of idle connections and
of oversized frames at each of its TCP endpoints (rollout, reward and env sockets) ends
nothing, restarts nothing and costs the learner no memory to speak of."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from orchestrator.launch import free_ports
from tests.helpers import (
    EXAMPLES,
    Lines,
    assert_nothing_lost,
    orchestrator,
    pid_of,
    read_metrics,
    wait_for,
    write_config,
)

pytestmark = pytest.mark.slow  # real processes end to end: left out of the fast subset

FLOOD = Path(__file__).parent / "flood.py"
STEPS, BATCH = 8, 2


def episode_run(tmp_path: Path, port: int) -> Path:
    """The digits environment's task over CURVE TCP on every interface; its rewards come
    from a reward worker, so no step is taken before the test starts one."""
    (tmp_path / "digits_env.py").write_text((EXAMPLES / "digits_env.py").read_text())
    (tmp_path / "flat.py").write_text(
        "def reward(completions, **columns):\n    return [float(len(c) > 0) for c in completions]\n"
    )
    return write_config(
        tmp_path,
        f"""
[data]
prompts = "{EXAMPLES / "digits_prompts.jsonl"}"
[train]
checkpoint_every = 4
[env]
environment = "digits_env:DigitsEnv"
max_turns = 3
max_episode_tokens = 64
[run]
transport = "tcp"
host = "0.0.0.0"
port = {port}
""",
        steps=STEPS,
        reward="worker",
    )


class PeakRSS:
    """The learner's largest resident set while its run goes, from `ps` every 0.2 s."""

    def __init__(self, run: Path) -> None:
        self.run, self.peak_mb, self.done = run, 0.0, False
        threading.Thread(target=self.watch, daemon=True).start()

    def watch(self) -> None:
        while not self.done:
            try:
                out = subprocess.run(
                    ["ps", "-o", "rss=", "-p", str(pid_of(self.run, "learner"))],
                    capture_output=True,
                    text=True,
                ).stdout.strip()
                self.peak_mb = max(self.peak_mb, int(out) / 1024 if out else 0.0)
            except (OSError, ValueError, IndexError):
                pass  # not started yet
            time.sleep(0.2)


def test_a_flood_of_idle_connections_and_oversized_frames_ends_nothing(tmp_path):
    """Two identical runs side by side; strangers flood one. At each of its three TCP
    endpoints: 5,000 idle connections (two processes of 2,500) and 100 frames claiming
    256 MB, in every ZMTP greeting. Both runs train every step with nothing lost and no
    restart, and the flooded learner's peak memory stays within 64 MB of the other's."""
    quiet = flooded = free_ports(1)[0]
    while abs(flooded - quiet) < 3:  # each run takes three ports from its own
        flooded = free_ports(1)[0]
    runs, ups, peaks = [], [], []
    for name, base in (("quiet", quiet), ("flooded", flooded)):
        (tmp_path / name).mkdir()
        cfg = episode_run(tmp_path / name, base)
        runs.append(tmp_path / name / "run")
        ups.append(orchestrator("up", "--config", str(cfg)))
        peaks.append(PeakRSS(runs[-1]))
    lines = [Lines(up) for up in ups]
    flooders, workers = [], []
    try:
        for lines_of_run in lines:
            lines_of_run.wait_for("waiting for a reward worker", timeout=180)
        for port in (flooded, flooded + 1, flooded + 2):  # rollout, reward and env sockets
            for _ in range(2):
                flooders.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            str(FLOOD),
                            "127.0.0.1",
                            str(port),
                            "--idle",
                            "2500",
                            "--oversized",
                            "50",
                            "--hold",
                            "120",
                        ],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                )
        reports = [Lines(f) for f in flooders]
        for report in reports:
            report.wait_for("holding", timeout=180)
        # The strangers hold their connections while both runs train.
        for run in runs:
            wait_for(run / "endpoints.json")
            workers.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "orchestrator",
                        "reward-worker",
                        "flat:reward",
                        "--run-dir",
                        str(run),
                    ],
                    cwd=run.parent,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.STDOUT,
                )
            )
        codes = [up.wait(timeout=300) for up in ups]
    finally:
        for peak in peaks:
            peak.done = True
        for proc in (*flooders, *workers, *ups):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    outs = [[line for _, line in lines_of_run.lines] for lines_of_run in lines]
    assert codes == [0, 0], outs
    idle = [int(line.split()[1]) for report in reports for _, line in report.lines if line.startswith("idle")]
    assert len(idle) == 6 and sum(idle) >= 3 * 5000, idle
    for run, out in zip(runs, outs):
        assert_nothing_lost(read_metrics(run), STEPS, BATCH)
        assert not [line for line in out if "restarting it" in line], out
    quiet, flooded_run = peaks
    print("PEAKS", quiet.peak_mb, flooded_run.peak_mb)
    assert flooded_run.peak_mb < quiet.peak_mb + 64, (quiet.peak_mb, flooded_run.peak_mb)
    # `up` said once what the run exposes and how it is protected.
    exposed = [line for line in outs[1] if line.startswith("exposed on 0.0.0.0")]
    assert len(exposed) == 1 and "protected by CURVE" in exposed[0], outs[1]
    log = (runs[1] / "learner.log").read_text()
    assert "socket is over its cap of 128 connections: closed" in log

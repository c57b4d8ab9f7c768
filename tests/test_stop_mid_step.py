"""Ctrl-C during a long learner step acts in seconds (issue 42): the learner checks for a
stop between micro-batches, throws the unfinished step away, and a resumed run trains on
from the last complete step with nothing trained twice or lost.

The step is made long on purpose, and only it: a loss of the user's own (`algorithm.name
= "slow_loss:SlowGRPO"`, beside the config) that is GRPO after a pause of SLOW_S in each
micro-batch's forward, with one completion per micro-batch."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from tests.helpers import assert_nothing_lost, orchestrator, read_metrics, write_config

pytestmark = pytest.mark.slow  # steps long on purpose

SLOW_S = 1.3
SLOW_LOSS = f"""
import time
from dataclasses import dataclass

from learner.algorithms import GRPO


@dataclass(frozen=True)
class SlowGRPO(GRPO):
    def surrogate(self, x):
        time.sleep({SLOW_S})  # each micro-batch's forward: a long step of a real model, on purpose
        return super().surrogate(x)
"""


def status(run: Path) -> dict:
    try:
        return json.loads((run / "status.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def test_ctrl_c_in_a_long_learner_step_stops_within_5_s_and_resume_goes_on(tmp_path):
    (tmp_path / "slow_loss.py").write_text(SLOW_LOSS)
    extra = '[algorithm]\nname = "slow_loss:SlowGRPO"\n[train]\nmicro_batch_size = 1\ncheckpoint_every = 1\n'
    config = write_config(tmp_path, extra, steps=2)  # 2 groups of 4: 8 micro-batches a step
    run = tmp_path / "run"
    proc = orchestrator("up", "--config", str(config))
    try:
        deadline = time.monotonic() + 300
        while not (status(run).get("phase") == "stepping" and status(run).get("step") == 1):
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, status(run)
            time.sleep(0.05)
        time.sleep(3.0)  # inside step 2, a few micro-batches in
        proc.send_signal(signal.SIGINT)
        asked = time.monotonic()
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - asked
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    metrics = read_metrics(run)
    steps = {m["step"]: m["step_s"] for m in metrics}
    assert sorted(steps) == [1], out  # the stopped step left nothing
    assert min(steps.values()) >= 10, f"the premise: learner steps of at least 10 s: {steps}"
    assert took < 5, f"up took {took:.1f} s to stop after Ctrl-C\n{out}"
    assert proc.returncode == 130, out
    stopped = status(run)
    assert stopped["phase"] == "stopped" and stopped["step"] == 1, stopped
    counts = ("groups_trained", "groups_dropped", "groups_queued")
    assert stopped["groups_received"] == sum(stopped[c] for c in counts), stopped
    assert stopped["groups_trained"] == 2  # the stopped batch's groups are queued, not trained
    assert (run / "checkpoints" / "step_000001" / "state.json").exists()
    assert not (run / "checkpoints" / "step_000002").exists()

    resumed = orchestrator("up", "--resume", str(run))
    try:
        out, _ = resumed.communicate(timeout=300)
    finally:
        if resumed.poll() is None:
            resumed.kill()
            resumed.wait()
    assert resumed.returncode == 0, out
    assert_nothing_lost(read_metrics(run), 2, 2)  # steps 1 and 2 once each, 4 groups trained

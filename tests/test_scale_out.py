"""Scale-out with real processes: several actors feeding one learner."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.conftest import write_config
from tests.test_e2e import orchestrator, read_metrics
from tests.test_supervision import assert_steps_once_and_nothing_lost, pid_of, wait_for_step


def test_two_actors_share_the_data_and_a_killed_one_rejoins(tmp_path):
    """actor.count = 2: each actor samples its half of the data stream; SIGKILL one
    mid-run: it is restarted, takes its slot back from its own cursor, and the run
    finishes with every step once and the ledger whole on every line."""
    steps = 10
    cfg = write_config(tmp_path, "[actor]\ncount = 2", steps=steps)
    proc = orchestrator("up", "--config", str(cfg))
    run = tmp_path / "run"
    wait_for_step(run, 3, proc)
    before = json.loads((run / "status.json").read_text())["groups_received_by_actor"]
    os.kill(pid_of(run, "actor-1"), signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert "actor-1 exited with code -9; restarting it (1/3)" in out
    metrics = read_metrics(run)
    assert_steps_once_and_nothing_lost(metrics, steps)
    assert metrics[-1]["groups_dropped"] == 0
    by_actor = metrics[-1]["groups_received_by_actor"]
    assert set(by_actor) == {"0", "1"} and by_actor["1"] > before["1"]  # the restarted actor fed it
    # On-policy with 2 actors and batch 2: each batch is one group of each actor's half.
    assert by_actor["0"] + by_actor["1"] == steps * 2
    log = (run / "learner.log").read_text()
    assert "attached as slot 0" in log and log.count("attached as slot 1") == 2
    assert "slot 1 was actor pid" in log
    restarted = (run / "actor-1.log").read_text()
    assert "data cursor from the learner" in restarted


def test_an_actor_from_another_machine_joins_over_curve_tcp(tmp_path):
    """The two-Macs recipe on one machine: the run has actor.count = 2 with one remote
    slot; the "other Mac" has a directory holding only a copy of the run's config, and
    a key directory from `orchestrator keys add-peer`; it connects with --connect. The
    run needs its share of every batch, so finishing proves it trained."""
    import subprocess
    import sys
    import time

    from orchestrator.supervisor import free_ports
    from protocol.config import load_config, write_run_config
    from tests.conftest import ROOT

    port = free_ports(1)[0]
    cfg = write_config(tmp_path, f"[actor]\ncount = 2\nremote = 1\n[run]\ntransport = \"tcp\"\nport = {port}",
                       steps=4)
    run, other = tmp_path / "run", tmp_path / "other-mac"
    other.mkdir()
    write_run_config(other, load_config(cfg))
    up = orchestrator("up", "--config", str(cfg))
    try:
        while not (run / "keys" / "server.key").exists():
            assert up.poll() is None, up.communicate()[0]
            time.sleep(0.05)
        added = subprocess.run([sys.executable, "-m", "orchestrator", "keys", "add-peer", "macb", "--run-dir",
                                str(run)], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert added.returncode == 0, added.stderr
        peer_keys = run / "keys" / "peers" / "macb"
        remote = subprocess.Popen([sys.executable, "-m", "actor", "run", "--run-dir", str(other), "--connect",
                                   f"tcp://127.0.0.1:{port}", "--key-dir", str(peer_keys), "--slot", "1"],
                                  cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            out, _ = up.communicate(timeout=300)
            remote_out, _ = remote.communicate(timeout=60)
        finally:
            remote.kill()
            remote.wait()
    finally:
        up.kill()
        up.wait()
    assert up.returncode == 0, out
    assert remote.returncode == 0, remote_out
    assert "learner says stop: training finished" in remote_out
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert metrics[-1]["groups_received_by_actor"] == {"0": 4, "1": 4}
    assert "actor-1" not in out  # `up` started only slot 0


def test_two_learner_ranks_under_mlx_launch_train_the_adapter_one_rank_trains(tmp_path):
    """The same run twice (`orchestrator prepare`, then the learner and an actor started by
    hand), from the same rollouts: a learner alone, and two learner ranks started by
    `mlx.launch --backend ring` on localhost, each training half of every batch
    of 2 groups x 4 completions. After 3 steps the adapters agree to float tolerance, the
    metrics agree, and every checkpoint was written by rank 0."""
    import re
    import subprocess
    import sys

    import mlx.core as mx
    import numpy as np

    from orchestrator.supervisor import free_ports
    from tests.conftest import ROOT

    def start(name: str, learner: list[str]) -> tuple[Path, list]:
        (tmp_path / name).mkdir()
        extra = "[train]\ncheckpoint_every = 1\nkeep_checkpoints = 5\n[lora]\ndropout = 0.0"
        cfg = write_config(tmp_path / name, extra, steps=3)
        run = tmp_path / name / "run"
        prepared = subprocess.run([sys.executable, "-m", "orchestrator", "prepare", "--config", str(cfg)],
                                  cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert prepared.returncode == 0 and f"wrote {run}" in prepared.stdout, prepared.stderr
        procs = [subprocess.Popen([*learner, "-m", "learner", "--run-dir", str(run)], cwd=ROOT, text=True,
                                  stdout=open(run / "learner.log", "w"), stderr=subprocess.STDOUT),
                 subprocess.Popen([sys.executable, "-m", "actor", "run", "--run-dir", str(run)], cwd=ROOT,
                                  stdout=open(run / "actor.log", "w"), stderr=subprocess.STDOUT)]
        return run, procs

    launch = [str(Path(sys.executable).parent / "mlx.launch"), "--backend", "ring", "-n", "2",
              "--starting-port", str(free_ports(1)[0]), "--", sys.executable]
    runs = [start("alone", [sys.executable]), start("ranks", launch)]
    try:
        for _, procs in runs:
            for proc in procs:
                assert proc.wait(timeout=300) == 0
    finally:
        for _, procs in runs:
            for proc in procs:
                proc.kill()
                proc.wait()
    (alone, _), (ranked, _) = runs
    log = (ranked / "learner.log").read_text()
    (follower,) = re.findall(r"learner rank 1 of 2 \(pid (\d+)\)", log)
    written = re.findall(r"wrote checkpoint (step_\d+) \(pid (\d+)\)", log)
    # Steps 1-3, and step 3 again at the end of the run; all of them by one process, rank 0.
    assert sorted({name for name, _ in written}) == ["step_000001", "step_000002", "step_000003"]
    assert len({pid for _, pid in written}) == 1 and follower not in {pid for _, pid in written}
    assert "learner rank 1: rank 0 says stop" in log
    a = mx.load(str(alone / "adapters" / "adapters.safetensors"))
    b = mx.load(str(ranked / "adapters" / "adapters.safetensors"))
    assert a.keys() == b.keys()
    # Adam divides by sqrt(v): where a gradient is near 0, float rounding of the summed
    # gradient shows (seen: 4e-6). A wrong gradient is off by about a step (3e-3).
    for k in a:
        np.testing.assert_allclose(np.array(b[k]), np.array(a[k]), rtol=1e-3, atol=3e-5, err_msg=k)
    changed = max(float(mx.abs(a[k] - mx.load(str(alone / "checkpoints" / "step_000001" / "adapters" /
                                                      "adapters.safetensors"))[k]).max()) for k in a)
    assert changed > 1e-4  # the adapters moved in steps 2 and 3: the comparison means something
    for x, y in zip(read_metrics(alone), read_metrics(ranked)):
        for key in ("loss", "grad_norm", "reward", "kl", "entropy", "clip_ratio/region_mean"):
            if key in x:
                assert y[key] == pytest.approx(x[key], rel=1e-3, abs=1e-6), key


def test_up_runs_two_learner_ranks_and_restarts_them_together(tmp_path):
    """learner.ranks = 2 under `up`: both ranks are the orchestrator's own children (the
    ring backend's environment, a port each); SIGKILL rank 1 mid-run: both ranks start
    again from the newest checkpoint, and the run ends with every step once and nothing
    lost."""
    steps = 6
    cfg = write_config(tmp_path, "[learner]\nranks = 2\n[train]\ncheckpoint_every = 2\n"
                                 "[run]\nhang_timeout_s = 60.0", steps=steps)
    proc = orchestrator("up", "--config", str(cfg))
    run = tmp_path / "run"
    wait_for_step(run, 2, proc)
    os.kill(pid_of(run, "learner-1"), signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert "learner-1 exited with code -9; restarting it (1/3)" in out
    assert_steps_once_and_nothing_lost(read_metrics(run), steps)
    log = (run / "learner-1.log").read_text()
    assert log.count("learner rank 1 of 2") == 2 and "rank 0 says stop" in log
    assert json.loads((run / "ranks.json").read_text())[1][0].startswith("127.0.0.1:")

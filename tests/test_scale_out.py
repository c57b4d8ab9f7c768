"""Scale-out with real processes: several actors feeding one learner."""

from __future__ import annotations

import json
import os
import signal

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

    from protocol.config import load_config, write_run_config
    from tests.conftest import ROOT
    from tests.test_e2e import free_port_run

    port = free_port_run()
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

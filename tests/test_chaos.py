"""The chaos command, short: one SIGKILL of each kind in each of its runs (episodes with
external env and reward workers; two actors, one remote), then its checks (README, "Chaos").
One test per scenario, so that the suite runs them side by side."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow  # real processes end to end: left out of the fast subset

KINDS = {"episodes": ("actor", "learner", "reward-worker", "env-worker", "orchestrator"),
         "actors": ("actor", "remote-actor", "learner", "reward-worker", "orchestrator")}


@pytest.mark.parametrize("scenario", list(KINDS))
def test_chaos_loses_nothing_and_stalls_nothing_with_one_kill_of_each_kind(tmp_path, scenario):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.chaos", "--kills", "1", "--seed", "1",
                           "--scenario", scenario, "--work-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    assert f"chaos, {scenario}:" in out, out
    for kind in KINDS[scenario]:
        assert f"| {kind} | 1 |" in out, out
    for check in ("every step exactly once", "ledger on every line", "no stall over 30 s",
                  "workers and remote actor stayed to the end", "final adapters load",
                  "resume twice, identical adapters", "no process left"):
        assert f"| {check} | PASS |" in out, out

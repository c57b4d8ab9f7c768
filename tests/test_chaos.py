"""The chaos command, short: one SIGKILL of each kind (actor, learner, reward worker,
orchestrator) in a real run, then its checks (README, "Chaos")."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT


def test_chaos_loses_nothing_with_one_kill_of_each_kind(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.chaos", "--kills", "1", "--seed", "1",
                           "--work-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    out = proc.stdout
    for kind in ("actor", "learner", "worker", "orchestrator"):
        assert f"| {kind} | 1 |" in out, out
    for check in ("every step exactly once", "ledger on every line", "final adapters load",
                  "resume twice, identical adapters", "no process left"):
        assert f"| {check} | PASS |" in out, out

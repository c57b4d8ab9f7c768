"""The OpenEnv adapter against a real OpenEnv server: openenv-core's `create_app` under
uvicorn, in its own process (skipped without the `openenv` extra)."""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import assert_nothing_lost, read_metrics, run_up, write_config

# Looked up, not imported: openenv-core imports gradio and more, seconds this process never needs.
NO_OPENENV = importlib.util.find_spec("openenv") is None
pytestmark = [pytest.mark.slow, pytest.mark.skipif(NO_OPENENV, reason="needs the openenv extra")]

SERVER = Path(__file__).parent / "workers" / "openenv_echo.py"


@pytest.fixture
def openenv_server(tmp_path):
    """The echo server's URL, once its /health answers; stopped after the test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "openenv.log", "w")
    proc = subprocess.Popen([sys.executable, str(SERVER), str(port)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "openenv.log").read_text()
        time.sleep(0.2)
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_a_run_trains_against_a_real_openenv_server(tmp_path, openenv_server):
    """Every episode is an OpenEnv session: the server's reset text is the first turn, it
    echoes each model turn back, and its rewards are the episode's."""
    cfg = write_config(
        tmp_path,
        f"""
[env]
environment = "openenv"
openenv_url = "{openenv_server}"
openenv_observation_field = "echoed_message"
max_turns = 4
max_episode_tokens = 96
[log]
completions_every = 1
completions_groups = 2
""",
        steps=2,
        reward="env",
    )
    code, out = run_up(cfg)
    assert code == 0, out
    run = tmp_path / "run"
    metrics = read_metrics(run)
    assert_nothing_lost(metrics, 2, 2)
    assert metrics[-1]["groups_dropped"] == 0
    assert metrics[-1]["episodes/finish/env_done"] == 1.0  # the server ends an episode after 2 steps
    assert metrics[-1]["episodes/mean_model_turns"] == 2.0
    rows = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 2 * 4
    for r in rows:
        turns = r["turns"]
        assert turns[0] == {"role": "user", "content": "say 7"}  # the server's reset observation
        said = [t["content"] for t in turns if t["role"] == "assistant"]
        echoed = [t["content"] for t in turns[1:] if t["role"] == "user"]
        assert echoed == [s for s in said[:-1] if s]  # the last answer ends the episode unseen
        expected = sum(s.count("7") / max(len(s), 1) for s in said)
        assert r["rewards"]["env"] == pytest.approx(expected)

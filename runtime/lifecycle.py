"""How the processes of a run live and die: exit codes, stop signals, the lifeline that
ties a child to its orchestrator, and the lock that gives a run directory one owner.

- **Exit codes** say what kind of end it was, so the orchestrator restarts only crashes:
  a user error (a reward function that raises, a data file that does not parse) would
  only happen again.
- **Stop signals**: SIGINT, SIGTERM and SIGHUP all mean "stop cleanly"; a second one
  forces the stop. Handlers are installed explicitly, so a process started with SIGINT
  ignored (a background job of a script) still stops on it. An *inherited ignored*
  SIGHUP is kept: that is what `nohup` asks for.
- **Lifeline**: the orchestrator holds the write end of a pipe and never writes; each
  child holds the read end. When the orchestrator dies, by any means including SIGKILL,
  the kernel closes the write end and the child reads EOF. That works on macOS and Linux
  alike (no `PR_SET_PDEATHSIG`, no polling of the parent pid).
- **Run lock**: `RUN/run.lock` is `flock`ed by the orchestrator and handed to its
  children as an open descriptor. The lock lives while any of them is alive, so a second
  orchestrator, or a learner started by hand, cannot take a run whose processes still
  run, and a resumed run waits for the orphans of a killed one to go.

No MLX here: reward workers and the orchestrator use it too.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

from runtime.config import ConfigError

log = logging.getLogger("lifecycle")

EXIT_OK = 0
EXIT_CRASH = 1  # an unexpected exception: the orchestrator restarts the process
EXIT_CONFIG = 2  # a bad config or command line
EXIT_NO_FIT = 3  # the memory plan does not fit
EXIT_USER_ERROR = 4  # a reward function, data row or prompt that will fail again
EXIT_BUSY = 5  # the run directory belongs to live processes of another run

# Exit codes a restart cannot fix.
FINAL_EXITS = {EXIT_USER_ERROR: "user error", EXIT_BUSY: "run directory in use"}

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

LIFELINE_ENV = "MLXRL_LIFELINE_FD"
RUN_LOCK_ENV = "MLXRL_RUN_LOCK_FD"
# After the orchestrator is gone a child stops cleanly (checkpoint included); past this
# many seconds it exits anyway, so nothing of a dead run lingers.
LIFELINE_GRACE_S = 10.0
_supervised = False  # this process was started by an orchestrator (it handed us a lifeline)


# The checkout that holds our packages: a child started with it on PYTHONPATH imports them
# whether or not the project is installed.
SOURCE_ROOT = Path(__file__).resolve().parent.parent


def python_module(*args: str) -> list[str]:
    """The command line that runs `python -m ARGS` in a child of ours. `-P` keeps the
    working directory off sys.path: a user's folder holding `rewards.py` or `learner.py`
    (beside their config, where docs/data-and-rewards.md puts reward modules) would
    otherwise be imported in place of our packages. Their modules are loaded by path
    instead (rewards.functions)."""
    return [sys.executable, "-P", "-m", *args]


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a child process of ours: this one's, our packages importable,
    output unbuffered (logs show what happened up to a kill), plus `extra`."""
    path = os.pathsep.join(p for p in (str(SOURCE_ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **extra}


def raise_fd_limit() -> None:
    """Let this process open as many descriptors as its hard limit allows. Importing mlx_lm
    sets 2048 (hard 4096), macOS starts programs at 256; a bound TCP socket's connections
    each take one (transport.zeromq caps them)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # macOS refuses more than its per-process maximum, whatever the hard limit says.
    for target in ([] if hard == resource.RLIM_INFINITY else [hard]) + [65536, 10240]:
        if soft >= target or (hard != resource.RLIM_INFINITY and target > hard):
            continue
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return
        except (ValueError, OSError):
            continue


def fail(message: str, code: int = EXIT_CONFIG) -> NoReturn:
    """End a command: `message` on stderr, and exit `code` (default: a bad command line or
    config)."""
    print(message, file=sys.stderr, flush=True)
    raise SystemExit(code)


@contextlib.contextmanager
def config_errors(*also: type[Exception]) -> Iterator[None]:
    """In a command: a bad config (ConfigError, or `also`) ends it with `config error: ...`
    on stderr and exit code 2 (EXIT_CONFIG)."""
    try:
        yield
    except (ConfigError, *also) as e:  # type: ignore[misc]  # mypy cannot see a tuple of classes
        fail(f"config error: {e}")


def signal_exit_code(signum: int) -> int:
    """The shell's convention for "ended by signal N": 128 + N (130 for SIGINT)."""
    return 128 + signum


class ForcedStop(BaseException):
    """A second stop signal: stop now, skipping the clean-up that the first one started."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """Turns the first SIGINT/SIGTERM/SIGHUP into a request (`requested`, `signum`) that the
    process's loop acts on, and a second one into ForcedStop in the main thread."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def install(self) -> StopSignals:
        for sig in STOP_SIGNALS:
            if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
                continue  # started under nohup: the user asked to outlive the terminal
            signal.signal(sig, self._handle)
        return self

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def exit_code(self) -> int:
        """128 + N after stop signal N, else EXIT_OK."""
        return signal_exit_code(self.signum) if self.signum is not None else EXIT_OK

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum is not None:
            raise ForcedStop(signum)
        self.signum = signum


def exit_with(
    main: Callable[[], int], log: logging.Logger, user_errors: tuple[type[Exception], ...] = ()
) -> NoReturn:
    """Run a process's `main` and exit with the code that says what kind of end it was:
    its own code, EXIT_USER_ERROR for `user_errors` (logged: they are not retried),
    EXIT_BUSY, or 128 + N after a second stop signal."""
    try:
        sys.exit(main())
    except user_errors as e:
        log.error("user error, not retried: %s", e)
        sys.exit(EXIT_USER_ERROR)
    except RunBusy as e:
        log.error("%s", e)
        sys.exit(EXIT_BUSY)
    except ForcedStop as e:
        log.error("%s again: stopping now", e)
        sys.exit(signal_exit_code(e.signum))


# -- the lifeline ---------------------------------------------------------------------


class Lifeline:
    """The orchestrator's end: a pipe whose read end every child inherits. Keep this
    object (and so the write end) alive as long as the children should live."""

    def __init__(self) -> None:
        # os.pipe() descriptors are not inherited by default; only pass_fds hands the
        # read end to a child, so no child ever holds a write end.
        self.read_fd, self.write_fd = os.pipe()

    def child_env(self) -> dict[str, str]:
        return {LIFELINE_ENV: str(self.read_fd)}

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            try:
                os.close(fd)
            except OSError:
                pass


def watch_lifeline(grace_s: float = LIFELINE_GRACE_S) -> None:
    """In a child: when the orchestrator that started this process dies, stop cleanly
    (as on SIGTERM), and exit after `grace_s` whatever happens. Nothing to watch in a
    process started by hand."""
    global _supervised
    value = os.environ.pop(LIFELINE_ENV, None)  # not for our own children
    if value is None:
        return
    _supervised = True
    fd = int(value)

    def watch() -> None:
        while True:
            try:
                if not os.read(fd, 1):
                    break
            except InterruptedError:
                continue
            except OSError:
                break
        log.error("the orchestrator is gone; stopping (exit within %.0f s)", grace_s)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        log.error("still running %.0f s after the orchestrator died; exiting now", grace_s)
        os._exit(EXIT_CRASH)

    threading.Thread(target=watch, name="lifeline", daemon=True).start()


# -- a stop that ends the run ---------------------------------------------------------

FINAL_STOP = "stop.final"


def mark_final_stop(run_dir: str | Path) -> None:
    """The orchestrator, before it stops its processes because the run is over (the last
    step, a stop signal, a failure it will not restart): they tell their peers so."""
    (Path(run_dir) / FINAL_STOP).touch()


def stop_is_final(run_dir: str | Path) -> bool:
    """Whether a process stopped by a signal ends the run for its peers (workers then exit)
    or only goes away (it is being restarted, or its orchestrator died and a resume will
    start it again: workers wait for it). A process started by hand is stopped by its user:
    final."""
    return not _supervised or (Path(run_dir) / FINAL_STOP).exists()


def run_is_over(run_dir: str | Path) -> bool:
    """Whether the run in `run_dir` has ended for good: its orchestrator marked the final
    stop and no process of it holds the run lock. A peer started by hand that finds its
    run over (started, or restarted, a moment after the last step) exits at once instead of
    waiting for a learner that will never come back. A resume takes the lock before it
    clears the mark, so a run about to start again is never taken for over."""
    return (Path(run_dir) / FINAL_STOP).exists() and not _alive(_holder(run_dir))


# -- the run lock ---------------------------------------------------------------------


class RunBusy(RuntimeError):
    """The run directory is held by live processes of another run."""


def lock_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "run.lock"


def _holder(run_dir: str | Path) -> int | None:
    try:
        return int(lock_path(run_dir).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def acquire_run_lock(run_dir: str | Path, wait_s: float = 0.0, say=None) -> int:
    """Take `RUN/run.lock` for this process and return its descriptor (inheritable, to be
    passed to children). If the process that took it is dead but its children still hold
    it (orphans stopping after a crash), wait up to `wait_s` for them. Raise RunBusy."""
    path = lock_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + wait_s
    announced = False
    while not _try_lock(fd):
        holder = _holder(run_dir)
        if _alive(holder) or time.monotonic() >= deadline:
            os.close(fd)
            who = f"pid {holder}" if holder else "another process"
            raise RunBusy(
                f"run directory {Path(run_dir)} is in use by {who} and its processes "
                f"({path} is locked); stop that run first, or use another run directory"
            )
        if not announced and say is not None:
            say(
                f"waiting for the processes of an earlier run in {Path(run_dir)} to exit "
                f"(started by pid {holder}, now gone)"
            )
            announced = True
        time.sleep(0.2)
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    os.set_inheritable(fd, True)
    return fd


def hold_run_lock(run_dir: str | Path) -> int:
    """In a learner: keep the lock inherited from the orchestrator, or take it when
    started by hand. Raise RunBusy when another run's processes hold it."""
    inherited = os.environ.pop(RUN_LOCK_ENV, None)
    if inherited is not None and _try_lock(int(inherited)):
        return int(inherited)  # our own orchestrator's lock: already ours
    return acquire_run_lock(run_dir)

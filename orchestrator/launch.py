"""Launching a run's processes: the run directory they start in (`prepare_run_dir`),
which processes `up` starts for a config (`child_specs`), and starting one of them
holding the lifeline and the run lock (`spawn`), with its memory share and threads.

Apart from orchestrator/supervisor.py, which decides when to start, restart and stop
them: here only how one is started.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import protocol
from orchestrator.plan import thread_count
from runtime import lifecycle
from runtime.config import MEMORY_SHARE_ENV, Config, write_run_config
from runtime.env_workers import env_worker_args
from runtime.heartbeat import actor_name, learner_name
from runtime.rundir import clear_results, refuse_to_overwrite
from transport.keys import create_run_keys


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: Path

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def prepare_run_dir(cfg: Config, resume: bool = False, overwrite: bool = False) -> Path:
    """Create the run directory. A new run refuses one that holds another run's results
    (RunExists) unless told to `overwrite` them; a resumed one keeps them (the learner
    trims metrics to its checkpoint)."""
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if overwrite:
        clear_results(run_dir)
    elif not resume:
        refuse_to_overwrite(run_dir)
    for name in ("status.json", lifecycle.FINAL_STOP):
        (run_dir / name).unlink(missing_ok=True)
    r = cfg.run
    protocol.write_endpoints(run_dir, protocol.make_endpoints(run_dir, r.transport, r.host, r.port))
    if r.transport == "tcp" and not r.insecure:
        create_run_keys(run_dir)  # CURVE: encrypted, and only peers with the run's keys get in
    write_run_config(run_dir, cfg)
    return run_dir


def share_env(share_mb: float) -> str:
    """A memory share as the child reads it (policy/memory.py): whole MB, rounded down,
    so a process is never allowed more than its share (MLX uses what its limit allows)."""
    return str(max(1, math.floor(share_mb)))


def spawn(
    name: str,
    args: list[str],
    run_dir: Path,
    lifeline: lifecycle.Lifeline,
    lock_fd: int,
    share_mb: float | None = None,
    threads: int | None = None,
    extra_env: dict[str, str] | None = None,
) -> Child:
    """Start `python -m ARGS --run-dir RUN` holding the lifeline and the run lock. It runs
    in a session of its own, so a terminal's Ctrl-C reaches only the orchestrator, which
    then stops the children in order (learner checkpoint first). `threads`: its BLAS
    threads on Linux (the CPU backend; Apple GPUs are not affected), unless the user set
    OPENBLAS_NUM_THREADS."""
    log_path = run_dir / f"{name}.log"
    env = lifecycle.child_env(
        **lifeline.child_env(), **{lifecycle.RUN_LOCK_ENV: str(lock_fd)}, **(extra_env or {})
    )
    if share_mb is not None:
        env[MEMORY_SHARE_ENV] = share_env(share_mb)
    if threads is not None and sys.platform.startswith("linux") and "OPENBLAS_NUM_THREADS" not in os.environ:
        # (A user who set OPENBLAS_NUM_THREADS, e.g. to run several runs at once, keeps it.)
        env.update(OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    with open(log_path, "a") as log_file:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            [*lifecycle.python_module(*args), "--run-dir", str(run_dir)],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            pass_fds=(lifeline.read_fd, lock_fd),
        )
    return Child(name, proc, log_path)


# Below the systems' ephemeral ranges (Linux 32768-60999, macOS 49152-65535): a port found
# free here is not taken a moment later by some process's outgoing connection.
FREE_PORT_RANGE = (20000, 32000)


def free_ports(n: int) -> list[int]:
    """`n` TCP ports free on loopback right now, each with the next two free too (a run's
    sockets take port, port + 1 and port + 2)."""
    import random
    import socket

    found: list[int] = []
    while len(found) < n:
        port = random.randrange(*FREE_PORT_RANGE)
        socks = [socket.socket() for _ in range(3)]
        try:
            for i, s in enumerate(socks):
                s.bind(("127.0.0.1", port + i))
            if port not in found:
                found.append(port)
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    return found


@dataclass(frozen=True)
class ChildSpec:
    """How `up` starts one process of the run."""

    kind: str  # "learner", "actor" or "env-worker"
    args: list[str]  # after `python -m`
    share: str  # its key in the memory plan's shares
    threads: int  # BLAS threads (Linux CPU backend)


def child_specs(cfg: Config) -> dict[str, ChildSpec]:
    """Every process `up` starts for `cfg`, by name: the learner (or its ranks), the local
    actors (the first count - remote slots: remote ones come last), and the env workers of
    an `env.environment = "module:Class"` or `"openenv"`."""
    threads = thread_count(cfg.train.max_staleness > 0)
    ranks = cfg.learner.ranks
    specs = {
        learner_name(r): ChildSpec("learner", ["learner"], "learner", max(1, threads // ranks))
        for r in range(ranks)
    }  # the ranks compute at the same time: they share the threads
    for slot in range(cfg.actor.count - cfg.actor.remote):
        specs[actor_name(slot, cfg.actor.count)] = ChildSpec(
            "actor", ["actor", "run", "--slot", str(slot)], "actor", threads
        )
    env = cfg.env
    if env.environment and env.environment != "socket":
        for i in range(env.num_workers):
            specs[f"env-worker-{i}"] = ChildSpec("env-worker", env_worker_args(cfg), f"env-worker-{i}", 1)
    return specs

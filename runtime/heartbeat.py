"""Liveness between the orchestrator and its processes: a heartbeat file per process.

Each process touches `RUN/heartbeat.ROLE` every second from a daemon thread. MLX releases
the GIL while it computes, so the beat goes on through long steps; it stops when the
process hangs in Python or dies. The orchestrator restarts a process whose beat is older
than `run.hang_timeout_s`. Files, not sockets: the orchestrator never has to be reachable
by a process that is busy or broken.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from runtime.rundir import write_atomic

log = logging.getLogger("heartbeat")

INTERVAL_S = 1.0  # as often as peers beat on their sockets (protocol.connection.HEARTBEAT_S)


def actor_name(slot: int, count: int) -> str:
    """What an actor's heartbeat file and log are named: "actor" in a run of one, else
    "actor-SLOT"."""
    return "actor" if count == 1 else f"actor-{slot}"


def learner_name(rank: int) -> str:
    """What a learner rank's heartbeat file and log are named: rank 0 is "the learner"."""
    return "learner" if rank == 0 else f"learner-{rank}"


def heartbeat_path(run_dir: str | Path, role: str) -> Path:
    return Path(run_dir) / f"heartbeat.{role}"


def start_heartbeat(run_dir: str | Path, role: str) -> threading.Thread:
    path = heartbeat_path(run_dir, role)

    def beat() -> None:
        failing = False
        while True:
            try:
                # Whole or not at all: a reader (a test, a user's script) must never see the
                # empty file that a truncating write leaves for a moment.
                write_atomic(path, f"{os.getpid()} {time.time():.3f}\n")
                failing = False
            except OSError as e:  # out of descriptors in a flood, a full disk: beat again later
                if not failing:
                    log.error("cannot write the heartbeat %s: %s; trying every second", path, e)
                failing = True
            time.sleep(INTERVAL_S)

    thread = threading.Thread(target=beat, name=f"heartbeat-{role}", daemon=True)
    thread.start()
    return thread


def seconds_since_beat(run_dir: str | Path, role: str) -> float | None:
    """Age of the newest beat, or None if the process has not beaten yet."""
    try:
        return time.time() - heartbeat_path(run_dir, role).stat().st_mtime
    except FileNotFoundError:
        return None

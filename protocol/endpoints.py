"""Where the sockets live. Private by default: ipc:// files in an owner-only directory."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from protocol.lifecycle import write_atomic

# sockaddr_un.sun_path is 108 bytes on Linux and 104 on macOS, including the NUL.
_MAX_IPC_PATH = 100

# The env socket is bound by the actor, and only in a run with an environment.
NAMES = ("learner", "reward", "env")


def make_endpoints(run_dir: Path, transport: str = "ipc", host: str = "127.0.0.1",
                   base_port: int = 5555) -> dict[str, str]:
    """Choose an address for every socket of the run, and create their directory."""
    if transport == "tcp":
        return {name: f"tcp://{host}:{base_port + i}" for i, name in enumerate(NAMES)}
    if transport != "ipc":
        raise ValueError(f"transport must be 'ipc' or 'tcp', got {transport!r}")
    sock_dir = Path(run_dir).resolve() / "sockets"
    if len(str(sock_dir)) + 16 > _MAX_IPC_PATH:
        # A deep run directory would overflow the socket path; keep the sockets private
        # in a short temporary directory instead.
        sock_dir = Path(tempfile.mkdtemp(prefix="mlxrl-"))
    sock_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(sock_dir, 0o700)
    return {name: f"ipc://{sock_dir}/{name}.sock" for name in NAMES}


def write_endpoints(run_dir: Path, endpoints: dict[str, str]) -> None:
    write_atomic(Path(run_dir) / "endpoints.json", json.dumps(endpoints, indent=2) + "\n")


def read_endpoints(run_dir: Path) -> dict[str, str]:
    return json.loads((Path(run_dir) / "endpoints.json").read_text())

"""Where the sockets live. Private by default: ipc:// files in an owner-only directory."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from runtime.rundir import write_atomic

# sockaddr_un.sun_path is 108 bytes on Linux and 104 on macOS, including the NUL.
_MAX_IPC_PATH = 100

# The env socket is bound by the actor, and only in a run with an environment.
NAMES = ("learner", "reward", "env")


def make_endpoints(
    run_dir: Path, transport: str = "ipc", host: str = "127.0.0.1", base_port: int = 5555
) -> dict[str, str]:
    """Choose an address for every socket of the run, and create their directory."""
    if transport == "tcp":
        return {name: f"tcp://{host}:{base_port + i}" for i, name in enumerate(NAMES)}
    if transport != "ipc":
        raise ValueError(f"transport must be 'ipc' or 'tcp', got {transport!r}")
    sock_dir = Path(run_dir).resolve() / "sockets"
    if len(str(sock_dir)) + 16 > _MAX_IPC_PATH:
        sock_dir = _short_socket_dir(Path(run_dir).resolve())
    sock_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(sock_dir, 0o700)
    return {name: f"ipc://{sock_dir}/{name}.sock" for name in NAMES}


def _short_socket_dir(run_dir: Path) -> Path:
    """A deep run directory would overflow the socket path, so its sockets live in a short
    directory under the temporary directory, named after the run directory: a resumed run
    binds the same addresses, and workers that outlived the orchestrator find it there.
    A directory of that name that is not ours (another user made it first) is not used."""
    name = "mlxrl-" + hashlib.sha256(str(run_dir).encode()).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / name
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != os.getuid():
        return Path(tempfile.mkdtemp(prefix="mlxrl-"))
    return path


def write_endpoints(run_dir: Path, endpoints: dict[str, str]) -> None:
    write_atomic(Path(run_dir) / "endpoints.json", json.dumps(endpoints, indent=2) + "\n")


def read_endpoints(run_dir: Path) -> dict[str, str]:
    return json.loads((Path(run_dir) / "endpoints.json").read_text())

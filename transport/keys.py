"""CURVE keys: how a run over TCP encrypts its sockets and lets in only its own peers.

ZeroMQ's CURVE (built into libzmq) encrypts every connection and authenticates both ends
by public keys. A run's keys live in `RUN/keys`, owner-only, created by `orchestrator up`:

    RUN/keys/server.key, server.key_secret   the binding side (learner; the actor's env socket)
    RUN/keys/client.key, client.key_secret   the run's own local peers
    RUN/keys/authorized/*.key                 the client public keys let in (the allow-list)
    RUN/keys/peers/NAME/                      a key directory for another machine

A *key directory* for connecting holds `server.key` (the server's public key) and the
peer's own `client.key`/`client.key_secret`; `RUN/keys` is one for the local peers, and
`orchestrator keys add-peer NAME` makes one per remote machine (copy it there, pass
`--key-dir`). The binding side checks each client key against `authorized/` through a ZAP
handler, re-reading the directory when it changes, and logs every refusal.

No MLX here.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import weakref
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

log = logging.getLogger("keys")

SERVER, CLIENT = "server", "client"
AUTHORIZED = "authorized"


class KeysError(ValueError):
    """Missing or unreadable keys, or TCP without keys and without `insecure`."""


def run_keys(run_dir: str | Path) -> Path:
    return Path(run_dir) / "keys"


def create_run_keys(run_dir: str | Path) -> Path:
    """The run's key directory, created on first use (a resumed run keeps its keys, so
    remote peers need no new ones)."""
    keys = run_keys(run_dir)
    if (keys / f"{SERVER}.key_secret").exists():
        return keys
    keys.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(keys, 0o700)
    (keys / AUTHORIZED).mkdir(mode=0o700, exist_ok=True)
    _new_pair(keys, CLIENT)
    _install(keys / f"{CLIENT}.key", keys / AUTHORIZED / "local.key")
    _new_pair(keys, SERVER)  # last: its secret key says the directory is complete
    _owner_only(keys)
    return keys


def add_peer(run_dir: str | Path, name: str) -> Path:
    """A new key directory for a peer on another machine, its key let in."""
    if not name or "/" in name or name.startswith("."):
        raise KeysError(f"peer name {name!r}: use letters, digits, '-' or '_'")
    keys = create_run_keys(run_dir)
    out = keys / "peers" / name
    if out.exists():
        raise KeysError(f"{out} exists already; remove it first to make new keys for {name!r}")
    out.parent.mkdir(mode=0o700, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out.parent))
    _new_pair(tmp, CLIENT)
    _install(keys / f"{SERVER}.key", tmp / f"{SERVER}.key")
    os.replace(tmp, out)  # the peer's directory appears whole
    _install(out / f"{CLIENT}.key", keys / AUTHORIZED / f"{name}.key")
    _owner_only(keys)
    return out


def _new_pair(directory: Path, name: str) -> None:
    """NAME.key and NAME.key_secret in `directory`, each written whole or not at all."""
    with tempfile.TemporaryDirectory(prefix=".new-", dir=directory) as tmp:
        zmq.auth.create_certificates(tmp, name)
        for suffix in (".key", ".key_secret"):
            _install(Path(tmp) / f"{name}{suffix}", directory / f"{name}{suffix}")


def _install(source: Path, target: Path) -> None:
    """Copy `source` to `target` by a rename, so no reader (the allow-list) ever sees half
    a key; owner-only from the start."""
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.copyfile(source, tmp)
    os.chmod(tmp, 0o600)
    os.replace(tmp, target)


def _owner_only(directory: Path) -> None:
    for path in [directory, *directory.rglob("*")]:
        os.chmod(path, 0o700 if path.is_dir() else 0o600)


def _load(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise KeysError(f"cannot read the CURVE key {path}: {e}") from None
    if secret and secret_key is None:
        raise KeysError(f"{path} holds no secret key")
    return public, secret_key


def secure_client(sock: zmq.Socket, key_dir: Path) -> None:
    """Make `sock` a CURVE client with the keys in `key_dir` (before it connects)."""
    server_public, _ = _load(key_dir / f"{SERVER}.key", secret=False)
    public, secret = _load(key_dir / f"{CLIENT}.key_secret", secret=True)
    sock.curve_serverkey = server_public
    sock.curve_publickey = public
    sock.curve_secretkey = secret


def secure_server(sock: zmq.Socket, key_dir: Path, name: str) -> None:
    """Make `sock` a CURVE server (before it binds) that lets in only the clients in
    `key_dir/authorized`; refusals are logged, naming `name` (the socket)."""
    public, secret = _load(key_dir / f"{SERVER}.key_secret", secret=True)
    _authenticator(sock.context).configure_curve_callback(name, AllowList(key_dir / AUTHORIZED))
    sock.curve_server = True
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.zap_domain = name.encode()


class AllowList:
    """The ZAP callback: a client key is let in if a `*.key` file in `directory` holds it.
    Re-read when a file there changes, so a peer added while the run goes is let in. A
    file that is not a public key is skipped, and said once; the callback never raises,
    since an exception would end the ZAP thread and with it every later handshake.

    Refusals are logged once a minute per key, and at most REFUSALS_PER_MINUTE lines a
    minute for the socket: strangers with fresh keys must not fill the log."""

    REFUSALS_PER_MINUTE = 10

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.stamp: tuple | None = None
        self.keys: set[bytes] = set()
        self.warned: dict[bytes, float] = {}  # key -> when its refusal was last logged
        self.minute: tuple[float, int, int] = (-60.0, 0, 0)  # (start, lines logged, refusals not)

    def callback(self, domain: str, client_key: bytes) -> bool:
        try:
            self.refresh()
            if client_key in self.keys:
                return True
            self.log_refusal(domain, client_key)
        except Exception:  # fail closed, and keep the ZAP thread alive
            log.exception("refused a connection to the %s socket: the allow-list could not be read", domain)
        return False

    def refresh(self) -> None:
        try:
            files = sorted(self.directory.glob("*.key"))
            stamp = tuple((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in files)
        except OSError:  # the directory is gone, or out of descriptors: keep what we had
            return
        if stamp == self.stamp:
            return
        self.stamp, self.keys = stamp, set()
        for path in files:
            try:
                public = zmq.auth.load_certificate(path)[0]
                if len(z85.decode(public)) != 32:
                    raise ValueError(f"{public[:20]!r}... is no 40-character Z85 key")
                self.keys.add(public)
            except Exception as e:  # pyzmq raises OSError, ValueError or others on a bad file
                log.error("skipped %s in the allow-list: not a CURVE public key file (%s)", path, e)

    def log_refusal(self, domain: str, client_key: bytes) -> None:
        now = time.monotonic()
        start, logged, quiet = self.minute
        if now - start >= 60:
            if quiet:
                log.warning(
                    "refused %d more connections to the %s socket in the last minute (not logged one by one)",
                    quiet,
                    domain,
                )
            start, logged, quiet = now, 0, 0
        # A refused client retries every second: once a minute per key is enough.
        if now - self.warned.get(client_key, -60.0) < 60.0:
            self.minute = (start, logged, quiet)
            return
        if logged >= self.REFUSALS_PER_MINUTE:
            self.minute = (start, logged, quiet + 1)
            return
        self.warned[client_key] = now
        if len(self.warned) > 4096:  # fresh keys without end: forget those a minute old
            self.warned = {k: t for k, t in self.warned.items() if now - t < 60.0}
        self.minute = (start, logged + 1, quiet)
        log.warning(
            "refused a connection to the %s socket: its client key %s is not in %s",
            domain,
            client_key.decode(errors="replace"),
            self.directory,
        )


# By context (not by id(): a new context may take a closed one's id).
_authenticators: weakref.WeakKeyDictionary[zmq.Context, ThreadAuthenticator] = weakref.WeakKeyDictionary()


def _authenticator(ctx: zmq.Context) -> ThreadAuthenticator:
    """One ZAP handler per context (process), started with its first CURVE server socket;
    each socket's name is a ZAP domain of its own."""
    if ctx not in _authenticators:
        auth = ThreadAuthenticator(ctx, log=logging.getLogger("keys.zap"))
        auth.start()
        _authenticators[ctx] = auth
    return _authenticators[ctx]


def stop_authenticator(ctx: zmq.Context) -> None:
    """Stop the context's ZAP handler, if any: its socket would keep `ctx.term()` waiting."""
    auth = _authenticators.pop(ctx, None)
    if auth is not None:
        auth.stop()


def run_key_dir(run_dir: str | Path, endpoint: str, insecure: bool) -> Path | None:
    """The key directory a run's own process uses for `endpoint` (RUN/keys). A secure TCP
    run without them is an error: never plain TCP by accident."""
    keys = run_keys(run_dir)
    if endpoint.startswith("tcp://") and not insecure and not (keys / f"{SERVER}.key").exists():
        raise KeysError(
            f"{endpoint} is TCP and the run is secure (run.insecure is false), but {keys} holds "
            "no CURVE keys. On the run's machine `orchestrator up` makes them; on another "
            "machine, make a key directory there with `orchestrator keys add-peer NAME --run-dir "
            "RUN`, copy it here and pass --key-dir"
        )
    return key_dir_for(endpoint, keys if (keys / f"{SERVER}.key").exists() else None, insecure)


def key_dir_for(endpoint: str, key_dir: str | Path | None, insecure: bool) -> Path | None:
    """The key directory a socket on `endpoint` uses: None for `ipc://` (private files)
    and for TCP the user declared insecure; an error for TCP without keys."""
    if not endpoint.startswith("tcp://"):
        return None
    if insecure:
        log.warning("%s is plain TCP: no encryption, no authentication (insecure)", endpoint)
        return None
    if key_dir is None:
        raise KeysError(
            f"{endpoint} is TCP: give a CURVE key directory (--key-dir; `orchestrator keys "
            "add-peer` makes one), or accept plain TCP with --insecure"
        )
    key_dir = Path(key_dir)
    if not (key_dir / f"{SERVER}.key").exists():
        raise KeysError(f"{key_dir} is not a key directory: it has no {SERVER}.key")
    return key_dir

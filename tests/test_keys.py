"""CURVE keys (transport.keys) over real TCP sockets on localhost: who gets in, who is
refused, and that TCP without keys needs an explicit `insecure`."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq
import zmq.auth

import protocol
from orchestrator.launch import free_ports
from protocol import sockets
from runtime.config import load_config, write_run_config
from tests.helpers import EXAMPLES, ROOT, write_config
from transport import Socket, Watch, zeromq
from transport.keys import KeysError, add_peer, create_run_keys, key_dir_for, secure_client
from transport.zeromq import ZeroMQ


def delivered(router: Socket, dealer: Socket, watch: Watch) -> bool:
    """Whether a message from `dealer` reaches `router` within 2 s."""
    dealer.send([b"hello"])
    return bool(router.poll(2000)) and bytes(router.recv()[-1]) == b"hello"


def close_all(router: Socket, opened: list[tuple[Socket, Watch]]) -> None:
    for sock, watch in opened:
        watch.close()
        sock.close(linger=0)
    router.close(linger=0)


@pytest.fixture
def net():
    transport = ZeroMQ()
    yield transport
    transport.close()


@pytest.mark.slow
def test_run_keys_are_owner_only_and_peers_get_in_while_strangers_are_refused(tmp_path, net, caplog):
    run = tmp_path / "run"
    keys = create_run_keys(run)
    assert create_run_keys(run) == keys  # a resumed run keeps its keys
    for path in [keys, *keys.rglob("*")]:
        assert path.stat().st_mode & 0o077 == 0, path
    endpoint = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    router = sockets.listen(net, endpoint, keys, "rollout")
    opened = []

    def dealer(key_dir):
        sock, watch = sockets.connect(net, endpoint, key_dir)
        opened.append((sock, watch))
        return sock, watch

    try:
        # The run's own peers.
        assert delivered(router, *dealer(keys))
        # A stranger: the server's public key, a client key nobody listed.
        stranger = tmp_path / "stranger"
        stranger.mkdir()
        zmq.auth.create_certificates(stranger, "client")
        shutil.copy(keys / "server.key", stranger / "server.key")
        sock, watch = dealer(stranger)
        with caplog.at_level("WARNING", logger="keys"):
            assert not delivered(router, sock, watch)
        assert watch.down_for() > 0 and watch.refused.startswith("it refused our CURVE key")
        assert "refused a connection to the rollout socket: its client key" in caplog.text
        # A peer added while the socket is up gets in at once (the allow-list is re-read).
        time.sleep(0.01)  # a new mtime for the authorized directory
        peer = add_peer(run, "macb")
        assert sorted(p.name for p in peer.iterdir()) == ["client.key", "client.key_secret", "server.key"]
        assert delivered(router, *dealer(peer))
        # A client with another server's key never connects, and is told so.
        zmq.auth.create_certificates(stranger, "server")  # a different server key
        sock, watch = dealer(stranger)
        assert not delivered(router, sock, watch)
        deadline = time.monotonic() + zeromq.WRONG_KEY_S + 5
        while watch.down_for() > 0 and not watch.refused and time.monotonic() < deadline:
            time.sleep(0.1)
        assert watch.refused.startswith(
            f"every CURVE handshake failed for {zeromq.WRONG_KEY_S:.0f} s: the "
            "key directory's server.key is not this run's"
        )
    finally:
        close_all(router, opened)


def test_add_peer_refuses_a_bad_name_and_an_existing_peer(tmp_path):
    with pytest.raises(KeysError, match="peer name '../x'"):
        add_peer(tmp_path, "../x")
    add_peer(tmp_path, "macb")
    with pytest.raises(KeysError, match="exists already"):
        add_peer(tmp_path, "macb")


def test_tcp_without_keys_needs_insecure(tmp_path):
    assert key_dir_for("ipc:///tmp/x.sock", None, insecure=False) is None
    assert key_dir_for("tcp://127.0.0.1:5555", None, insecure=True) is None
    with pytest.raises(
        KeysError, match="give a CURVE key directory .--key-dir.*or accept plain TCP with --insecure"
    ):
        key_dir_for("tcp://127.0.0.1:5555", None, insecure=False)
    with pytest.raises(KeysError, match="is not a key directory: it has no server.key"):
        key_dir_for("tcp://127.0.0.1:5555", tmp_path, insecure=False)
    keys = create_run_keys(tmp_path)
    assert key_dir_for("tcp://127.0.0.1:5555", keys, insecure=False) == keys


@pytest.mark.slow
def test_a_worker_refuses_tcp_without_keys_or_insecure_and_add_peer_writes_a_key_dir(tmp_path):
    cmd = [sys.executable, "-m", "orchestrator"]
    done = subprocess.run(
        [*cmd, "reward-worker", "tiny_task:reward", "--connect", "tcp://127.0.0.1:1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "is TCP: give a CURVE key directory (--key-dir" in done.stderr
    done = subprocess.run(
        [*cmd, "keys", "add-peer", "macb", "--run-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert f"wrote {tmp_path / 'keys' / 'peers' / 'macb'}" in done.stdout
    assert (tmp_path / "keys" / "authorized" / "macb.key").exists()


def test_a_bad_file_in_the_allow_list_is_skipped_and_said_and_the_others_still_get_in(tmp_path, net, caplog):
    """A file in keys/authorized that is no public key (a truncated copy, a stray note)
    would end the ZAP thread if it raised, and with it every later handshake: it is
    skipped with a log line naming it, the run's own key still gets in, and so does a
    peer added after it."""
    run = tmp_path / "run"
    keys = create_run_keys(run)
    (keys / "authorized" / "broken.key").write_bytes(b"\x00\xff no key here\n")
    (keys / "authorized" / "short.key").write_text('public-key = "tooshort"\n')
    endpoint = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    router = sockets.listen(net, endpoint, keys, "rollout")
    opened = []
    try:
        with caplog.at_level("ERROR", logger="keys"):
            for key_dir in (keys, None):
                time.sleep(0.01)  # a new mtime for the authorized directory
                key_dir = key_dir or add_peer(run, "macb")
                sock, watch = sockets.connect(net, endpoint, key_dir)
                opened.append((sock, watch))
                assert delivered(router, sock, watch)
        for name in ("broken.key", "short.key"):
            assert f"skipped {keys / 'authorized' / name} in the allow-list" in caplog.text
    finally:
        close_all(router, opened)


@pytest.mark.slow
def test_keys_are_written_whole(tmp_path):
    """A reader of keys/authorized (the ZAP handler, at any handshake) never finds a key
    file half written: every key lands by a rename."""
    keys = create_run_keys(tmp_path)
    seen_bad, stop = [], threading.Event()

    def read() -> None:
        while not stop.is_set():
            for path in (keys / "authorized").glob("*.key"):
                try:
                    zmq.auth.load_certificate(path)
                except FileNotFoundError:
                    pass
                except Exception as e:  # read while being written
                    seen_bad.append((path.name, e))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(150):
            add_peer(tmp_path, f"peer{i}")
    finally:
        stop.set()
        reader.join()
    assert seen_bad == []
    assert len(list((keys / "authorized").glob("*.key"))) == 151
    assert not [p for p in keys.rglob("*") if p.name.startswith(".")]  # no temporary left over


@pytest.mark.slow
def test_a_refused_key_sees_one_failure_and_no_retry(tmp_path, net):
    """What PROTOCOL.md tells a peer: with libzmq 4.3 a refused key gets one
    HANDSHAKE_FAILED_AUTH (ZAP status 400) and its connection is never tried again."""
    from zmq.utils.monitor import recv_monitor_message

    keys = create_run_keys(tmp_path / "run")
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    zmq.auth.create_certificates(stranger, "client")
    shutil.copy(keys / "server.key", stranger / "server.key")
    endpoint = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    router = sockets.listen(net, endpoint, keys, "rollout")
    sock = net.ctx.socket(zmq.DEALER)
    secure_client(sock, stranger)
    monitor = zeromq.monitor_socket(sock, zmq.EVENT_ALL)
    sock.connect(endpoint)
    events, deadline = [], time.monotonic() + 3
    while time.monotonic() < deadline:
        if monitor.poll(100):
            message = recv_monitor_message(monitor)
            events.append((message["event"], message["value"]))
    sock.disable_monitor()
    monitor.close(linger=0)
    sock.close(linger=0)
    router.close(linger=0)
    assert events.count((zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400)) == 1, events
    after = events[[e for e, _ in events].index(zmq.EVENT_HANDSHAKE_FAILED_AUTH) :]
    assert not [e for e, _ in after if e in (zmq.EVENT_CONNECT_RETRIED, zmq.EVENT_CONNECTED)], events


def refusal(watch: zeromq.ConnectionWatch, seconds: float) -> None:
    """Read the watch's events until it says why it was refused, or `seconds` pass."""
    deadline = time.monotonic() + seconds
    while not watch.refused and time.monotonic() < deadline:
        watch.down_for()
        time.sleep(0.05)


@pytest.mark.parametrize("server_curve", [True, False])
def test_one_end_with_curve_and_the_other_without_is_told_at_once(tmp_path, net, server_curve):
    """A plain-TCP peer facing a CURVE socket (or the reverse) fails its handshake once and
    libzmq never retries: the watch says so at once, naming the setting to change. Under
    load libzmq may lose that word (the other end closed before its greeting was read,
    PROTOCOL.md): the watch then says it after WRONG_KEY_S of silent failures, naming the
    setting too."""
    keys = create_run_keys(tmp_path / "run")
    endpoint = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    router = sockets.listen(net, endpoint, keys if server_curve else None, "rollout")
    sock, watch = sockets.connect(net, endpoint, None if server_curve else keys)
    try:
        refusal(watch, zeromq.WRONG_KEY_S + 3)
        told, silent = (
            (
                "the other end uses CURVE and we connected in plain TCP",
                "in plain TCP: the other end most likely uses CURVE",
            )
            if server_curve
            else (
                "the other end is plain TCP and we use CURVE",
                "(or the other end does not use CURVE: see run.insecure)",
            )
        )
        refused = watch.refused or ""
        assert refused.startswith(told) or silent in refused, refused
    finally:
        watch.close()
        sock.close(linger=0)
        router.close(linger=0)


def test_a_plain_peer_whose_handshakes_all_fail_silently_is_told_to_use_the_run_s_keys(net):
    """An end that closes every connection before its greeting is read: how a CURVE socket
    can look to a plain-TCP peer when its protocol error is lost. The plain peer has no
    server.key, so the refusal must not blame one; it names run.insecure and --key-dir."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    stop = threading.Event()

    def close_each() -> None:
        while not stop.is_set():
            try:
                server.accept()[0].close()
            except OSError:
                pass

    thread = threading.Thread(target=close_each, daemon=True)
    thread.start()
    sock, watch = sockets.connect(net, f"tcp://127.0.0.1:{server.getsockname()[1]}", None)
    try:
        refusal(watch, zeromq.WRONG_KEY_S + 5)
        assert (watch.refused or "").startswith(
            f"every handshake failed for {zeromq.WRONG_KEY_S:.0f} s in plain TCP"
        ), watch.refused
        assert "server.key" not in watch.refused
        assert "not --insecure or run.insecure = true" in watch.refused
    finally:
        watch.close()
        sock.close(linger=0)
        stop.set()
        thread.join()
        server.close()


def test_refusals_are_logged_at_most_ten_a_minute_per_socket(tmp_path, caplog, monkeypatch):
    """Strangers with fresh keys each time: ten refusals are logged one by one, the rest
    counted in one line once the minute is over; a key let in is never logged."""
    import transport.keys as keys_module

    keys = create_run_keys(tmp_path)
    allow = keys_module.AllowList(keys / "authorized")
    clock = [1000.0]
    monkeypatch.setattr(keys_module.time, "monotonic", lambda: clock[0])
    with caplog.at_level("WARNING", logger="keys"):
        for _ in range(50):
            public, _ = zmq.curve_keypair()
            assert allow.callback("rollout", public) is False
        assert allow.callback("rollout", (keys / "client.key").read_bytes().split(b'"')[1]) is True
        one_by_one = [r for r in caplog.records if "its client key" in r.getMessage()]
        assert len(one_by_one) == 10
        clock[0] += 61
        allow.callback("rollout", zmq.curve_keypair()[0])
    assert "refused 40 more connections to the rollout socket in the last minute" in caplog.text


def stranger_keys(tmp_path, keys) -> Path:
    """A key directory with the run's server key and a client key nobody let in."""
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    zmq.auth.create_certificates(stranger, "client")
    shutil.copy(keys / "server.key", stranger / "server.key")
    return stranger


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind,spec",
    [
        ("reward-worker", ["tiny_task:reward"]),
        ("env-worker", ["digits_env:DigitsEnv", "--search-path", str(EXAMPLES)]),
    ],
)
def test_a_refused_worker_exits_4_within_10_s_saying_why(tmp_path, net, kind, spec):
    """libzmq drops a refused connection for good, so a send would wait forever: the
    worker checks before it sends, and says why it stops."""
    keys = create_run_keys(tmp_path / "run")
    endpoint = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    router = sockets.listen(net, endpoint, keys, kind.split("-")[0])
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "orchestrator",
                kind,
                *spec,
                "--connect",
                endpoint,
                "--key-dir",
                str(stranger_keys(tmp_path, keys)),
            ],
            cwd=EXAMPLES,
            capture_output=True,
            text=True,
            timeout=10,
        )
    finally:
        router.close(linger=0)
    assert done.returncode == 4, done.stderr
    assert "it refused our CURVE key" in done.stderr


@pytest.mark.slow
def test_a_worker_of_a_secure_tcp_run_without_its_keys_refuses_to_connect(tmp_path):
    """A copy of a secure TCP run's directory without keys/ (the README's "Mac B" before the
    key directory is copied): the worker never falls back to plain TCP; it stops, naming
    the fix."""
    cfg = load_config(write_config(tmp_path, '[run]\ntransport = "tcp"\nport = 5599'))
    run = tmp_path / "copy"
    run.mkdir()
    write_run_config(run, cfg)
    protocol.write_endpoints(run, protocol.make_endpoints(run, "tcp", "127.0.0.1", 5599))
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", "reward-worker", "tiny_task:reward", "--run-dir", str(run)],
        cwd=EXAMPLES,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2, done.stderr
    assert "the run is secure (run.insecure is false)" in done.stderr
    assert "orchestrator keys add-peer NAME --run-dir RUN" in done.stderr


@pytest.mark.slow
def test_an_actor_set_insecure_facing_a_curve_learner_exits_4_saying_why(tmp_path, net):
    """The actor's copy of the config says run.insecure = true, the learner uses CURVE: one
    failed handshake, which libzmq never retries. The actor stops at once (not after its
    120 s), exit 4, naming the setting."""
    port = free_ports(1)[0]
    cfg = load_config(write_config(tmp_path, f'[run]\ntransport = "tcp"\nport = {port}'))
    endpoints = protocol.make_endpoints(tmp_path, "tcp", "127.0.0.1", port)
    keys = create_run_keys(tmp_path / "run")
    router = sockets.listen(net, endpoints["learner"], keys, "rollout")  # the learner's socket
    actor_dir = tmp_path / "actor"
    actor_dir.mkdir()
    write_run_config(actor_dir, cfg.replace(run={"insecure": True}))
    protocol.write_endpoints(actor_dir, endpoints)
    t0 = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "actor", "run", "--run-dir", str(actor_dir)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=90,
        )
    finally:
        router.close(linger=0)
    assert done.returncode == 4, done.stderr
    # Told at once (a protocol error) or, when libzmq loses that word under load, after
    # WRONG_KEY_S of silent failures: either way the actor names the setting to change.
    assert "the other end uses CURVE and we connected in plain TCP" in done.stderr or (
        "in plain TCP: the other end most likely uses CURVE" in done.stderr
    ), done.stderr
    assert "not --insecure or run.insecure = true" in done.stderr
    # Well short of the 120 s a connect waits: a loaded 2-core CI spends 10 to 15 s of this
    # importing MLX alone, so a tighter bound measures the machine, not the actor.
    assert time.monotonic() - t0 < 60

"""CURVE keys (protocol.keys) over real TCP sockets on localhost: who gets in, who is
refused, and that TCP without keys needs an explicit `insecure`."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import pytest
import zmq
import zmq.auth

from orchestrator.supervisor import free_ports
from protocol import sockets
from protocol.keys import KeysError, add_peer, create_run_keys, key_dir_for
from tests.conftest import ROOT


def delivered(router: zmq.Socket, dealer: zmq.Socket, watch: sockets.ConnectionWatch) -> bool:
    """Whether a message from `dealer` reaches `router` within 2 s."""
    dealer.send(b"hello")
    return bool(router.poll(2000)) and router.recv_multipart()[-1] == b"hello"


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    sockets.close_context(context)


def test_run_keys_are_owner_only_and_peers_get_in_while_strangers_are_refused(tmp_path, ctx, caplog):
    run = tmp_path / "run"
    keys = create_run_keys(run)
    assert create_run_keys(run) == keys  # a resumed run keeps its keys
    for path in [keys, *keys.rglob("*")]:
        assert path.stat().st_mode & 0o077 == 0, path
    endpoint = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    router = sockets.listen(ctx, endpoint, keys, "rollout")
    opened = []

    def dealer(key_dir):
        sock, watch = sockets.connect(ctx, endpoint, key_dir)
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
        assert watch.down_for() > 0
        assert watch.refused.startswith("the CURVE handshake failed 3 times: the key directory's server.key")
    finally:
        for sock, watch in opened:
            watch.close()
            sock.close(linger=0)
        router.close(linger=0)


def test_add_peer_refuses_a_bad_name_and_an_existing_peer(tmp_path):
    with pytest.raises(KeysError, match="peer name '../x'"):
        add_peer(tmp_path, "../x")
    add_peer(tmp_path, "macb")
    with pytest.raises(KeysError, match="exists already"):
        add_peer(tmp_path, "macb")


def test_tcp_without_keys_needs_insecure(tmp_path):
    assert key_dir_for("ipc:///tmp/x.sock", None, insecure=False) is None
    assert key_dir_for("tcp://127.0.0.1:5555", None, insecure=True) is None
    with pytest.raises(KeysError, match="give a CURVE key directory .--key-dir.*or accept plain TCP with "
                                        "--insecure"):
        key_dir_for("tcp://127.0.0.1:5555", None, insecure=False)
    with pytest.raises(KeysError, match="is not a key directory: it has no server.key"):
        key_dir_for("tcp://127.0.0.1:5555", tmp_path, insecure=False)
    keys = create_run_keys(tmp_path)
    assert key_dir_for("tcp://127.0.0.1:5555", keys, insecure=False) == keys


def test_a_worker_refuses_tcp_without_keys_or_insecure_and_add_peer_writes_a_key_dir(tmp_path):
    cmd = [sys.executable, "-m", "orchestrator"]
    done = subprocess.run([*cmd, "reward-worker", "tiny_task:reward", "--connect", "tcp://127.0.0.1:1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "is TCP: give a CURVE key directory (--key-dir" in done.stderr
    done = subprocess.run([*cmd, "keys", "add-peer", "macb", "--run-dir", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"wrote {tmp_path / 'keys' / 'peers' / 'macb'}" in done.stdout
    assert (tmp_path / "keys" / "authorized" / "macb.key").exists()

"""The transport seam (transport/): a whole run over the in-process fake, with ZeroMQ out
of reach, and the fake's own promises (the ones the protocol relies on)."""

from __future__ import annotations

import json
import threading

import pytest
import zmq

from actor.service import Actor
from learner.service import Learner
from orchestrator.launch import prepare_run_dir
from runtime.config import load_config
from tests.helpers import write_config
from transport import TransportError
from transport.fake import Fake


def test_a_run_trains_over_the_fake_transport_with_zeromq_out_of_reach(tmp_path, monkeypatch):
    """The learner and an actor, as threads of this process, talk only through the seam:
    any ZeroMQ socket made behind its back fails the run. Every step trains its batch, the
    actor ends on the learner's stop holding the last weights, and no socket file exists."""

    def no_zeromq(*args, **kwargs):
        raise AssertionError("ZeroMQ used behind the transport seam")

    monkeypatch.setattr(zmq, "Context", no_zeromq)
    cfg = load_config(write_config(tmp_path, steps=3))
    run = prepare_run_dir(cfg)
    net = Fake()
    learner = Learner.from_run_dir(run, net=net)
    actor = Actor.from_run_dir(run, net=net)
    failed: list[BaseException] = []

    def act() -> None:
        try:
            actor.run()
        except BaseException as e:  # the test reports it below
            failed.append(e)

    thread = threading.Thread(target=act, daemon=True)
    thread.start()
    try:
        learner.run()
    finally:
        learner.close()
        thread.join(60)
        actor.close()
    assert not failed and not thread.is_alive()
    status = json.loads((run / "status.json").read_text())
    assert status["phase"] == "done" and status["step"] == 3
    assert status["groups_trained"] == 3 * cfg.train.batch_size == status["groups_received"]
    assert actor.policy_version is not None and actor.policy_version >= 2  # weights came back
    assert not list((run / "sockets").glob("*")) if (run / "sockets").exists() else True


def test_the_fake_keeps_order_and_identity_and_queues_until_its_owner_listens():
    net = Fake()
    peer, watch = net.connect("x", None, 0)
    assert watch.down_for() > 0 or watch.connections == 0  # nobody listens yet
    peer.send([b"one"])
    peer.send([b"two", memoryview(b"2")])
    owner = net.listen("x", None, "x", 0)
    assert watch.down_for() == 0.0 and watch.connections == 1
    got = []
    while owner.poll(0):
        got.append([bytes(f) for f in owner.recv()])
    assert got == [[peer.identity, b"one"], [peer.identity, b"two", b"2"]]
    owner.send([peer.identity, b"back"])
    assert peer.poll(1000) and [bytes(f) for f in peer.recv()] == [b"back"]
    assert not peer.poll(10)
    owner.close()
    assert watch.down_for() >= 0  # the owner is gone: down from now on
    with pytest.raises(TransportError):
        net.listen("x", None, "x", 0) and net.listen("x", None, "x", 0)


def test_a_sent_array_is_copied_as_a_process_boundary_would():
    net = Fake()
    owner = net.listen("y", None, "y", 0)
    peer, _ = net.connect("y", None, 0)
    data = bytearray(b"abc")
    peer.send([memoryview(data)])
    data[0] = ord("z")
    assert owner.poll(0) and bytes(owner.recv()[1]) == b"abc"

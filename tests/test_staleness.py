"""The staleness bound: the real learner process, with this test playing the actor."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

import protocol
from orchestrator.launch import prepare_run_dir
from policy.model import tokenizer_fingerprint
from runtime.config import as_dict, load_config
from tests.helpers import peer, read_metrics, run_up, write_config

pytestmark = pytest.mark.slow  # real processes end to end: left out of the fast subset


class Actor:
    """This test as an actor on the real learner's rollout socket: it says hello, sends
    groups of 4 completions of 3 tokens sampled by the versions it names, and waits for
    what the learner sends."""

    def __init__(self, sock, cfg, tok) -> None:
        self.sock, self.tok, self.rng = sock, tok, np.random.default_rng(0)
        hello = {
            "role": "actor",
            "model": cfg.model.path,
            "tokenizer": tokenizer_fingerprint(tok),
            "lora": as_dict(cfg.lora),
            "pid": os.getpid(),
        }
        sock.send_multipart(protocol.encode(protocol.HELLO, hello))
        self.learner_hello = self.expect(protocol.HELLO).header
        self.expect(protocol.WEIGHTS, version=0)

    def send_group(
        self,
        version: int,
        name: str,
        versions: list[int] | None = None,
        ids: np.ndarray | None = None,
        **header,
    ) -> None:
        """`ids`: the 4 completions' 12 token IDs (default: drawn at random)."""
        ids = self.rng.integers(5, 40, 4 * 3).astype(np.int32) if ids is None else ids
        per_token = {} if versions is None else {"policy_versions": np.array(versions, np.int32)}
        fields = {
            "group_id": name,
            "policy_version": version,
            "prompt": "repeat 1",
            "columns": {"target": "1"},
            "texts": ["111", "123", "abc", "1a1"],
            "finish_reasons": ["length"] * 4,
            **header,
        }
        arrays = {
            "prompt_ids": np.array(self.tok.encode("repeat 1"), np.int32),
            "completion_ids": ids,
            "completion_lens": np.array([3, 3, 3, 3], np.int32),
            "logprobs": np.full(12, -3.0, np.float32),
            **per_token,
        }
        self.sock.send_multipart(protocol.encode(protocol.ROLLOUT, fields, arrays))

    def expect(self, kind: str, **fields) -> protocol.Message:
        while True:
            assert self.sock.poll(120_000), f"no {kind} from the learner"
            msg = protocol.decode(self.sock.recv_multipart())
            if msg.kind == kind and all(msg.header.get(k) == v for k, v in fields.items()):
                return msg


def test_learner_drops_groups_older_than_max_staleness(tmp_path, tiny):
    _, tok = tiny
    cfg = load_config(write_config(tmp_path, steps=3))  # max_staleness = 0, batch 2, G 4
    run = prepare_run_dir(cfg)
    with peer(run, "learner") as (learner, sock):
        actor = Actor(sock, cfg, tok)
        for version in (0, 1):  # two on-policy batches: steps 1 and 2
            actor.send_group(version, f"v{version}-0")
            actor.send_group(version, f"v{version}-1")
            actor.expect(protocol.WEIGHTS, version=version + 1)
        actor.send_group(0, "v0-2")  # two versions behind at version 2: stale
        # Sampled across weight updates (the continuous engine): as old as its oldest token.
        actor.send_group(2, "v2-3", versions=[0] * 6 + [2] * 6)
        actor.expect(protocol.CREDIT, groups_consumed=6)  # dropped groups are consumed, too
        actor.send_group(2, "v2-4")
        actor.send_group(2, "v2-5")
        actor.expect(protocol.STOP)
        assert learner.wait(60) == 0
    last = read_metrics(run)[-1]
    assert last["step"] == 3 and last["groups_trained"] == 6
    assert last["dropped_reasons"] == {"stale": 2}
    log = (run / "learner.log").read_text()
    assert "step 3: dropped 2 groups (stale 2)" in log and "dropped group v0-2" not in log


def test_the_learner_keeps_room_for_a_group_the_actor_still_samples_in_its_last_version(tmp_path, tiny):
    """max_staleness 1, batch 2. At version 1 the actor sends two groups of version 1 while
    it still samples one of version 0 (`in_flight`), which only the batch trained at version
    1 can take. The learner takes one young group and keeps the other place for it: the
    group of version 0 is trained, not dropped as stale, and the other young group goes into
    the next batch. Without `in_flight` the two young groups would fill the batch.

    With beta > 0 the learner, waiting for the last group, takes the reference logprobs of
    the young group queued for the next batch meanwhile (learner/ahead.py::reference_ahead)."""
    _, tok = tiny
    extra = "[train]\nmax_staleness = 1\n[algorithm]\nbeta = 0.04\n[log]\ncompletions_every = 1"
    cfg = load_config(write_config(tmp_path, extra, steps=3))
    run = prepare_run_dir(cfg)
    with peer(run, "learner") as (learner, sock):
        actor = Actor(sock, cfg, tok)
        actor.send_group(0, "a", in_flight=[0, 0])
        actor.send_group(0, "b", in_flight=[0])
        actor.expect(protocol.WEIGHTS, version=1)
        actor.send_group(1, "young-1", in_flight=[0])
        actor.send_group(1, "young-2", in_flight=[0, 1])
        # "last" arrives after both young groups are at hand (the learner looks every 0.1 s;
        # arriving together, it would go first anyway, the oldest first).
        time.sleep(2)
        actor.send_group(0, "last", in_flight=[1])
        actor.expect(protocol.WEIGHTS, version=2)
        actor.send_group(1, "c", in_flight=[])
        actor.send_group(2, "d", in_flight=[])
        actor.expect(protocol.STOP)
        assert learner.wait(60) == 0
    last = read_metrics(run)[-1]
    assert last["step"] == 3 and last["groups_trained"] == 6, last
    assert "stale" not in last.get("dropped_reasons", {}), last
    trained = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    batches = [sorted({r["group_id"] for r in trained if r["step"] == step}) for step in (1, 2, 3)]
    assert batches == [["a", "b"], ["last", "young-1"], ["c", "young-2"]], batches  # "d" waits
    spans = [json.loads(line) for line in (run / "timeline" / "learner.jsonl").read_text().splitlines()]
    ahead = [e for e in spans if e["name"] == "reference logprobs ahead"]
    assert [e["args"]["rows"] for e in ahead] == [4], ahead  # young-2, once
    takes = [e["args"] for e in spans if e["name"] == "old and reference logprobs"]
    assert [t["ahead"] for t in takes].count(1) == 1, takes  # young-2's take used them


def test_actor_runs_ahead_with_max_staleness_one(tmp_path):
    code, out = run_up(write_config(tmp_path, "[train]\nmax_staleness = 1", steps=6))
    assert code == 0, out
    metrics = read_metrics(tmp_path / "run")
    lags = [m["version_lag_mean"] for m in metrics]
    assert all(0 <= lag <= 1 for lag in lags)
    assert any(lag > 0 for lag in lags)  # some batches were sampled a version behind
    assert metrics[-1]["groups_received"] == (
        metrics[-1]["groups_trained"] + metrics[-1]["groups_dropped"] + metrics[-1]["groups_queued"]
    )
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["max_staleness"] == 1

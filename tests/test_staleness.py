"""The staleness bound: the real learner process, with this test playing the actor."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import protocol
from orchestrator.launch import prepare_run_dir
from policy.model import tokenizer_fingerprint
from runtime.config import as_dict, load_config
from tests.helpers import peer, read_metrics, run_up, write_config

pytestmark = pytest.mark.slow  # real processes end to end: left out of the fast subset


def test_learner_drops_groups_older_than_max_staleness(tmp_path, tiny):
    _, tok = tiny
    cfg = load_config(write_config(tmp_path, steps=3))  # max_staleness = 0, batch 2, G 4
    run = prepare_run_dir(cfg)
    rng = np.random.default_rng(0)

    with peer(run, "learner") as (learner, sock):

        def send_group(version: int, n: int, versions: list[int] | None = None) -> None:
            ids = rng.integers(5, 40, 4 * 3).astype(np.int32)
            per_token = {} if versions is None else {"policy_versions": np.array(versions, np.int32)}
            sock.send_multipart(
                protocol.encode(
                    protocol.ROLLOUT,
                    {
                        "group_id": f"v{version}-{n}",
                        "policy_version": version,
                        "prompt": "repeat 1",
                        "columns": {"target": "1"},
                        "texts": ["111", "123", "abc", "1a1"],
                        "finish_reasons": ["length"] * 4,
                    },
                    {
                        "prompt_ids": np.array(tok.encode("repeat 1"), np.int32),
                        "completion_ids": ids,
                        "completion_lens": np.array([3, 3, 3, 3], np.int32),
                        "logprobs": np.full(12, -3.0, np.float32),
                        **per_token,
                    },
                )
            )

        def expect(kind: str, **fields) -> protocol.Message:
            while True:
                assert sock.poll(120_000), f"no {kind} from the learner"
                msg = protocol.decode(sock.recv_multipart())
                if msg.kind == kind and all(msg.header.get(k) == v for k, v in fields.items()):
                    return msg

        sock.send_multipart(
            protocol.encode(
                protocol.HELLO,
                {
                    "role": "actor",
                    "model": cfg.model.path,
                    "tokenizer": tokenizer_fingerprint(tok),
                    "lora": as_dict(cfg.lora),
                    "pid": os.getpid(),
                },
            )
        )
        expect(protocol.WEIGHTS, version=0)
        for version in (0, 1):  # two on-policy batches: steps 1 and 2
            send_group(version, 0)
            send_group(version, 1)
            expect(protocol.WEIGHTS, version=version + 1)
        send_group(0, 2)  # two versions behind at version 2: stale
        # Sampled across weight updates (the continuous engine): as old as its oldest token.
        send_group(2, 3, versions=[0] * 6 + [2] * 6)
        expect(protocol.CREDIT, groups_consumed=6)  # dropped groups are consumed, too
        send_group(2, 4)
        send_group(2, 5)
        expect(protocol.STOP)
        assert learner.wait(60) == 0
    last = read_metrics(run)[-1]
    assert last["step"] == 3 and last["groups_trained"] == 6
    assert last["dropped_reasons"] == {"stale": 2}
    log = (run / "learner.log").read_text()
    assert "step 3: dropped 2 groups (stale 2)" in log and "dropped group v0-2" not in log


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

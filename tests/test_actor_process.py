"""The real actor process, with this test playing the learner on a real ROUTER socket.

This is how we see that weights are *applied*, not just received: the behavior logprobs
the actor reports must be those of the weights we sent, version by version.
"""

from __future__ import annotations

import os
import time

import mlx.core as mx
import numpy as np
import pytest

import protocol
from orchestrator.launch import prepare_run_dir
from policy.logprobs import sequence_logprobs
from policy.model import adapter_weights_numpy, load_policy, set_adapter_weights, tokenizer_fingerprint
from runtime import lifecycle
from runtime.config import as_dict, load_config
from tests.helpers import peer, write_config

pytestmark = pytest.mark.slow  # real processes end to end: left out of the fast subset


def recv(sock, timeout_s: float = 60) -> tuple[bytes, protocol.Message]:
    """The actor's next message other than a heartbeat (it beats every second)."""
    deadline = time.monotonic() + timeout_s
    while sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
        identity, *frames = sock.recv_multipart()
        msg = protocol.decode(frames)
        if msg.kind != protocol.HEARTBEAT:
            return identity, msg
    raise AssertionError("the actor sent nothing")


def heartbeats_only(sock, seconds: float) -> int:
    """How many heartbeats the actor sent in `seconds`; fails on anything else."""
    beats, deadline = 0, time.monotonic() + seconds
    while sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
        msg = protocol.decode(sock.recv_multipart()[1:])
        assert msg.kind == protocol.HEARTBEAT, msg.kind
        beats += 1
    return beats


def group_logprobs(model, msg: protocol.Message, temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """(reported behavior logprobs, logprobs of the same IDs under `model`) for a group."""
    prompt = msg.arrays["prompt_ids"].tolist()
    ids, lens = msg.arrays["completion_ids"].tolist(), msg.arrays["completion_lens"].tolist()
    ours, start = [], 0
    for n in lens:
        row = prompt + ids[start : start + n]
        ours.append(np.array(sequence_logprobs(model, mx.array([row]), temperature))[0, len(prompt) - 1 :])
        start += n
    return msg.arrays["logprobs"], np.concatenate(ours)


def greet(sock, cfg, model, **extra):
    """As the learner: take the actor's hello, answer it (`extra`: e.g. max_staleness) and
    send version 0's weights. Returns `send(kind, header, arrays=None)` to that actor."""
    identity, hello = recv(sock)

    def send(kind, header, arrays=None):
        sock.send_multipart([identity, *protocol.encode(kind, header, arrays)])

    send(protocol.HELLO, learner_hello(cfg, hello, **extra))
    send(protocol.WEIGHTS, {"version": 0}, adapter_weights_numpy(model))
    return send


def learner_hello(cfg, actor_hello: protocol.Message, **extra) -> dict:
    """The `hello` a learner answers the actor's with (`extra`: e.g. where its data goes on)."""
    return {
        "role": "learner",
        "model": cfg.model.path,
        "tokenizer": actor_hello["tokenizer"],
        "lora": as_dict(cfg.lora),
        "pid": os.getpid(),
        **extra,
    }


@pytest.mark.parametrize("engine", ["continuous", "static"])
def test_actor_applies_each_weight_version_it_receives(tmp_path, engine):
    """Either engine setting; a static batch's rollouts carry no per-token versions (one
    version, the header's)."""
    extra = f'[sampling]\ntemperature = 0.7\ntop_p = 0.9\n[actor]\nengine = "{engine}"'
    cfg = load_config(write_config(tmp_path, extra))
    run = prepare_run_dir(cfg)
    with peer(run, "actor") as (actor, sock):
        model, tok, _ = load_policy(cfg.model.path, cfg.lora)
        identity, hello = recv(sock)
        assert hello.kind == protocol.HELLO and hello["role"] == "actor"
        assert hello["tokenizer"] == tokenizer_fingerprint(tok) and hello["lora"] == as_dict(cfg.lora)

        def send(kind, header, arrays=None):
            sock.send_multipart([identity, *protocol.encode(kind, header, arrays)])

        # Garbage first: the actor must log it, drop it and carry on.
        sock.send_multipart([identity, b"\x00garbage"])
        send(protocol.HELLO, learner_hello(cfg, hello))
        v0 = adapter_weights_numpy(model)
        send(protocol.WEIGHTS, {"version": 0}, v0)
        batch = cfg.train.batch_size
        first = [recv(sock)[1] for _ in range(batch)]
        assert all(m.kind == protocol.ROLLOUT and m["policy_version"] == 0 for m in first)
        assert all(("policy_versions" in m.arrays) == (engine == "continuous") for m in first)
        for m in first:
            reported, ours = group_logprobs(model, m, 0.7)
            np.testing.assert_allclose(reported, ours, atol=1e-4)

        # Version 1: different LoRA weights, then credit for the first batch. Not much
        # larger (at 0.3, attention scores reached ~3000: float32 rounding in the order of
        # the sums then moved a logprob by up to 0.017 between cached and full forwards).
        rng = np.random.default_rng(0)
        v1 = {k: v + rng.normal(0, 0.05, v.shape).astype(np.float32) for k, v in v0.items()}
        send(protocol.WEIGHTS, {"version": 1}, v1)
        send(protocol.CREDIT, {"groups_consumed": batch})
        second = [recv(sock)[1] for _ in range(batch)]
        assert all(m["policy_version"] == 1 for m in second)
        # Every token under version 1: with max_staleness = 0 no group straddles the switch.
        assert all(set(m.arrays.get("policy_versions", np.array([1])).tolist()) == {1} for m in second)
        old_model_gap = 0.0
        for m in second:
            reported, under_v0 = group_logprobs(model, m, 0.7)
            old_model_gap = max(old_model_gap, float(np.abs(reported - under_v0).max()))
        set_adapter_weights(model, v1)
        for m in second:
            reported, under_v1 = group_logprobs(model, m, 0.7)
            # Batched cached decoding and this full forward sum in different orders: v1's
            # random LoRA weights make that differ by up to ~5e-5 (seen in 2000 draws).
            np.testing.assert_allclose(reported, under_v1, atol=1e-3)
        # The same sampled IDs score differently under the weights the actor replaced.
        assert old_model_gap > 1e-2

        # Without credit for the second batch, max_staleness = 0 keeps the actor waiting:
        # heartbeats (one a second; 3 s leaves room for a loaded machine), no rollout.
        assert heartbeats_only(sock, 3.0) >= 1
        send(protocol.STOP, {"reason": "test over"})
        assert actor.wait(30) == 0
    log = (run / "actor.log").read_text()
    assert "dropped a malformed message" in log


def test_actor_waits_for_weights_before_sampling(tmp_path):
    """A (re)started actor samples nothing until it holds the learner's weights."""
    cfg = load_config(write_config(tmp_path))
    run = prepare_run_dir(cfg)
    with peer(run, "actor") as (actor, sock):
        identity, hello = recv(sock)
        assert hello.kind == protocol.HELLO
        # It beats (every second, so the learner knows it lives) and samples nothing.
        assert heartbeats_only(sock, 3.5) >= 2
        sock.send_multipart([identity, *protocol.encode(protocol.STOP, {"reason": "done"})])
        assert actor.wait(30) == 0


def test_an_actor_refused_by_its_stop_s_code_exits_4_and_a_stop_s_text_is_only_text(tmp_path):
    """The actor acts on `code`, not on the words of `reason` (which are for logs)."""
    cfg = load_config(write_config(tmp_path))
    run = prepare_run_dir(cfg)
    for header, code in (
        ({"reason": "incompatible: another model", "code": protocol.INCOMPATIBLE}, lifecycle.EXIT_USER_ERROR),
        ({"reason": "incompatible words, but the run is over"}, lifecycle.EXIT_OK),
    ):
        with peer(run, "actor") as (actor, sock):
            identity, hello = recv(sock)
            assert hello.kind == protocol.HELLO
            sock.send_multipart([identity, *protocol.encode(protocol.STOP, header)])
            assert actor.wait(30) == code, header


def many_eos_model(tmp_path) -> str:
    """The tiny model with a fifth of its vocabulary as EOS: completions end at many lengths."""
    import json
    import shutil

    from tests.helpers import TINY_MODEL

    path = tmp_path / "many-eos-model"
    shutil.copytree(TINY_MODEL, path)
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = list(range(1, config["vocab_size"], 5))
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_groups_go_out_as_they_finish_and_a_restarted_actor_samples_what_the_learner_lacks(tmp_path):
    """Each group reaches the learner the step its last row ends, out of data order (the
    short before the long). SIGKILLed with some groups sent, a restarted actor gets the
    learner's cursor and the spans it holds beyond it (a real Ledger), and samples
    exactly the holes and what follows: nothing skipped, nothing twice."""
    import signal
    import subprocess
    import sys

    from learner.ledger import Ledger
    from policy.data import PromptStream, load_prompts
    from tests.helpers import ROOT

    extra = "[sampling]\ngroup_size = 2\nmax_tokens = 24\n[train]\nbatch_size = 6"
    cfg = load_config(write_config(tmp_path, f'[model]\npath = "{many_eos_model(tmp_path)}"\n{extra}'))
    run = prepare_run_dir(cfg)
    ledger, received = Ledger(), []
    model, tok, _ = load_policy(cfg.model.path, cfg.lora)

    def send(identity: bytes, kind: str, header: dict, arrays: dict | None = None) -> None:
        sock.send_multipart([identity, *protocol.encode(kind, header, arrays)])

    def attach() -> bytes:
        identity, hello = recv(sock)
        assert hello.kind == protocol.HELLO
        ledger.attach(identity, 0)
        cursor, skip = ledger.cursor_for(0)
        send(identity, protocol.HELLO, learner_hello(cfg, hello, data_cursor=cursor, data_skip=skip))
        send(identity, protocol.WEIGHTS, {"version": 0}, adapter_weights_numpy(model))
        return identity

    def take(identity: bytes, msg: protocol.Message) -> protocol.Message:
        assert msg.kind == protocol.ROLLOUT
        ledger.receive(identity)
        ledger.received_group(identity, msg["cursor"], msg["start_cursor"])
        received.append(msg)
        return msg

    with peer(run, "actor") as (actor, sock):
        first = attach()
        arrived = [take(*recv(sock)) for _ in range(6)]
        cursors = [m["cursor"] for m in arrived]
        longest = [int(m.arrays["completion_lens"].max()) for m in arrived]
        assert cursors != sorted(cursors), cursors  # out of data order...
        assert longest == sorted(longest), longest  # ...as each went out when its last row ended

        # Its window is full (max_staleness 0: a batch of 6 in flight): nothing more until
        # credit comes. Credit for those six: it samples six more, and is SIGKILLed. The
        # learner has the first of them to arrive, up to one that overtook another: the
        # rest died unsent with the actor. (Killing it after a number of arrivals instead
        # raced its last short groups: sometimes all six were out before the kill.)
        assert heartbeats_only(sock, 2.0) >= 1
        send(first, protocol.CREDIT, {"groups_consumed": 6})
        second_batch = [recv(sock) for _ in range(6)]
        actor.send_signal(signal.SIGKILL)
        actor.wait(30)
        for identity, msg in second_batch:
            take(identity, msg)
            if ledger.cursor_for(0)[1]:
                break
        assert ledger.cursor_for(0)[1], "no hole: the test needs groups that overtook others"

        restarted = subprocess.Popen(
            [sys.executable, "-m", "actor", "run", "--run-dir", str(run)],
            cwd=ROOT,
            stdout=open(run / "actor2.log", "w"),
            stderr=subprocess.STDOUT,
        )
        try:
            second = attach()
            for _ in range(6):
                take(*recv(sock))
            send(second, protocol.STOP, {"reason": "test over"})
            assert restarted.wait(30) == 0
        finally:
            if restarted.poll() is None:
                restarted.kill()
                restarted.wait()
    seen = [tuple(m["cursor"]) for m in received]
    assert len(seen) == len(set(seen)), "a prompt sampled twice"
    stream = PromptStream(load_prompts(cfg.data.prompts, tok, 1024), False, 0)
    assert sorted(seen) == [(next(stream), stream.cursor)[1] for _ in seen]  # and none skipped


@pytest.mark.parametrize("own", [1, 3], ids=["its-config-s", "the-learner-s"])
def test_a_group_certain_to_be_stale_stops_decoding_and_goes_out_as_dropped(tmp_path, own):
    """max_staleness 1, a batch of one group, two groups decoding together under version 0.
    The first comes back; the test sends version 2 while the other still decodes: that
    one can no longer be trained (its oldest tokens are 2 versions old), so the actor
    stops it and sends it at once with `error: "stale"` and its place in the data, well
    before its rows would have ended. With credit for both, the next two groups are
    version 2's, and the four cursors chain: nothing skipped, nothing twice.

    k = 1 is the learner's, said in its hello: an actor whose own config says 3 (started
    by hand with another copy of it) keeps to the learner's, and says so."""
    import json
    import shutil

    from tests.helpers import TINY_MODEL

    path = tmp_path / "long-model"
    shutil.copytree(TINY_MODEL, path)
    config = json.loads((path / "config.json").read_text())
    # Rarely sampled: rows end far apart. Here the first group ends at 65 tokens, and the
    # other would run to max_tokens, 400: it is stopped long before.
    config["eos_token_id"] = [5, 9]
    (path / "config.json").write_text(json.dumps(config))
    extra = (
        f'[model]\npath = "{path}"\n[sampling]\ngroup_size = 2\nmax_tokens = 400\ntemperature = 1.5\n'
        f"[train]\nbatch_size = 1\nmax_staleness = {own}\n[actor]\nmax_rows = 4"
    )
    cfg = load_config(write_config(tmp_path, extra))
    run = prepare_run_dir(cfg)
    with peer(run, "actor") as (actor, sock):
        model, tok, _ = load_policy(cfg.model.path, cfg.lora)
        send = greet(sock, cfg, model, max_staleness=1)
        # As the learner: credit after the weights, the window under its k, (1 + 1) * B. Until
        # it arrives the actor's own window must already be the learner's k's.
        send(protocol.CREDIT, {"groups_consumed": 0, "window": 2})
        first = recv(sock)[1]
        send(protocol.WEIGHTS, {"version": 2}, adapter_weights_numpy(model))
        gave_up = recv(sock)[1]
        send(protocol.CREDIT, {"groups_consumed": 2})
        later = [recv(sock)[1] for _ in range(2)]
        send(protocol.STOP, {"reason": "test over"})
        assert actor.wait(30) == 0
    assert first.header.get("error") is None and first["policy_version"] == 0
    assert gave_up.header["error"] == "stale" and gave_up.arrays["completion_lens"].tolist() == [0, 0]
    assert all(m.header.get("error") is None and m["policy_version"] == 2 for m in later)
    spans = sorted((m["start_cursor"], m["cursor"]) for m in (first, gave_up, *later))
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), spans
    log = (run / "actor.log").read_text()
    assert "stopped sampling its group, stale under weights version 2 (max_staleness 1)" in log
    told = "the learner's max_staleness is 1, this actor's config says 3: keeping to 1 (a window of 2 groups"
    assert (told in log) == (own == 3)


def test_with_max_staleness_1_the_groups_of_the_window_decode_together(tmp_path):
    """max_staleness 1, a batch of one group of 2 and no actor.max_rows: the actor's
    window is 2 groups, and both decode in one batch (4 rows) rather than the second
    queueing behind the first's slowest row: with one prompt a step, that queue left the
    actor decoding one group at a time. The timeline's decode steps say how many rows
    each left live: more than one group's."""
    from orchestrator.timeline import read_events

    extra = (
        "[sampling]\ngroup_size = 2\nmax_tokens = 24\n"
        "[train]\nbatch_size = 1\nmax_staleness = 1\n[log]\ntimeline = true"
    )
    cfg = load_config(write_config(tmp_path, extra))
    assert cfg.decode_rows == 4
    run = prepare_run_dir(cfg)
    with peer(run, "actor") as (actor, sock):
        model, tok, _ = load_policy(cfg.model.path, cfg.lora)
        send = greet(sock, cfg, model, max_staleness=1)
        send(protocol.CREDIT, {"groups_consumed": 0, "window": 2})
        groups = [recv(sock)[1] for _ in range(2)]
        send(protocol.STOP, {"reason": "test over"})
        assert actor.wait(30) == 0
    assert all(m.header.get("error") is None for m in groups)
    rows = [e["args"]["rows"] for e in read_events(run)["actor"] if e["name"] == "decode step"]
    assert max(rows) > 2, rows
    # Each rollout says which groups are still decoding, by their oldest token's version.
    # Both began together: when the first is sent the second still decodes, unless its
    # longest row is as long (they end in the same step); when the second is sent, none.
    first, second = (m.header["in_flight"] for m in groups)
    longest = [int(m.arrays["completion_lens"].max()) for m in groups]
    assert first == ([0] if longest[0] != longest[1] else []) and second == [], (first, second, longest)


def test_asked_for_partials_the_actor_sends_each_group_s_tokens_so_far_before_its_rollout(tmp_path):
    """A learner whose hello says `partials: 2` gets, every 2 decode steps, each decoding
    group's completions so far (PROTOCOL.md, `partial`): under the group_id its rollout
    then carries, the same prompt, each completion a prefix of the rollout's, growing
    from one partial to the next."""
    cfg = load_config(write_config(tmp_path, "[sampling]\ntemperature = 0.7\nmax_tokens = 6"))
    run = prepare_run_dir(cfg)
    with peer(run, "actor") as (actor, sock):
        model, _, _ = load_policy(cfg.model.path, cfg.lora)
        send = greet(sock, cfg, model, partials=2)
        partials: dict[str, list[protocol.Message]] = {}
        rollouts: dict[str, protocol.Message] = {}
        while len(rollouts) < cfg.train.batch_size:
            msg = recv(sock)[1]
            assert msg.kind in (protocol.PARTIAL, protocol.ROLLOUT), msg.kind
            if msg.kind == protocol.PARTIAL:
                assert msg["group_id"] not in rollouts  # none after its rollout
                partials.setdefault(msg["group_id"], []).append(msg)
            else:
                rollouts[msg["group_id"]] = msg
        send(protocol.STOP, {"reason": "test over"})
        assert actor.wait(30) == 0
    assert set(partials) == set(rollouts), (set(partials), set(rollouts))

    def rows(m: protocol.Message) -> list[list[int]]:
        ids, lens = m.arrays["completion_ids"].tolist(), m.arrays["completion_lens"].tolist()
        return [ids[sum(lens[:i]) : sum(lens[: i + 1])] for i in range(len(lens))]

    for group_id, sent in partials.items():
        final = rows(rollouts[group_id])
        assert [max(len(r) for r in rows(p)) for p in sent] == [2 * (i + 1) for i in range(len(sent))]
        for p in sent:
            assert p.arrays["prompt_ids"].tolist() == rollouts[group_id].arrays["prompt_ids"].tolist()
            assert all(f[: len(r)] == r for r, f in zip(rows(p), final, strict=True))

"""`actor serve`: the OpenAI Python client against the real server process, alone with an
adapter and following a training run's versions."""

from __future__ import annotations

import collections
import json
import random
import re
import signal
import socket
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from tests.helpers import EXAMPLES, TINY_MODEL, orchestrator, start_server, stop, wait_for, write_config

pytestmark = pytest.mark.slow  # real processes end to end: left out of the fast subset

openai = pytest.importorskip("openai")


def reference_logprobs(adapter: Path, prompt_ids: list[int], ids: list[int]) -> np.ndarray:
    """Each sampled token's logprob from mlx-lm's own loading of the same adapter."""
    from mlx_lm import load

    model, _ = load(str(TINY_MODEL), adapter_path=str(adapter))
    full = mx.array([prompt_ids + ids])
    logits = model(full)[0, len(prompt_ids) - 1 : -1].astype(mx.float32)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return np.array(lp[mx.arange(len(ids)), mx.array(ids)])


@pytest.fixture
def served(default_run):
    """A server of the default run's adapter, for one test (the suite's leak guard reaps
    whatever outlives a test)."""
    adapter = default_run / "adapters"
    proc, url = start_server("--config", str(EXAMPLES / "tiny.toml"), "--adapter", str(adapter))
    yield openai.OpenAI(base_url=url, api_key="unused", max_retries=0), adapter
    assert stop(proc) == 128 + signal.SIGTERM


def test_models_and_a_text_completion_with_token_ids_and_logprobs(served):
    client, adapter = served
    assert [m.id for m in client.models.list().data] == ["tiny-model"]
    out = client.completions.create(
        model="tiny-model", prompt="repeat 3", max_tokens=8, temperature=0, logprobs=1
    )
    choice = out.choices[0]
    assert choice.text == "33333333" and choice.finish_reason == "length"  # what the trained adapter says
    assert out.policy_version is None  # a fixed adapter has no version
    assert len(choice.token_ids) == len(choice.token_logprobs) == out.usage.completion_tokens == 8
    assert choice.logprobs.token_logprobs == choice.token_logprobs
    assert "".join(choice.logprobs.tokens) == choice.text
    np.testing.assert_allclose(
        choice.token_logprobs, reference_logprobs(adapter, out.prompt_token_ids, choice.token_ids), atol=1e-4
    )


def test_chat_completions_sample_n_choices_reproducibly_by_seed(served):
    client, adapter = served
    ask = dict(
        model="tiny-model",
        messages=[{"role": "user", "content": "repeat 5"}],
        max_tokens=6,
        n=3,
        seed=7,
        logprobs=True,
    )
    a, b = client.chat.completions.create(**ask), client.chat.completions.create(**ask)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len(a.choices) == 3 and all(c.message.role == "assistant" for c in a.choices)
    for c in a.choices:
        assert [t.logprob for t in c.logprobs.content] == c.token_logprobs
        reference = reference_logprobs(adapter, a.prompt_token_ids, c.token_ids)
        np.testing.assert_allclose(c.token_logprobs, reference, atol=1e-4)
    other = client.chat.completions.create(**{**ask, "seed": 8})
    assert [c.token_ids for c in other.choices] != [c.token_ids for c in a.choices]


def test_stop_strings_and_bad_requests(served):
    client, _ = served
    out = client.completions.create(
        model="tiny-model", prompt="repeat 3", max_tokens=8, temperature=0, stop=["333"]
    )
    assert out.choices[0].text == "" and out.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError, match="temperature must be between 0.0 and 2.0"):
        client.completions.create(model="tiny-model", prompt="x", temperature=5)
    with pytest.raises(openai.BadRequestError, match="exceed the model's context of 512"):
        client.completions.create(model="tiny-model", prompt="x", max_tokens=5000)
    with pytest.raises(openai.BadRequestError, match="messages must be"):
        client.chat.completions.create(model="tiny-model", messages=[])


def test_following_a_training_run_serves_each_new_version(tmp_path):
    """Attached to a run, the server's policy_version rises as the learner trains, and the
    server stops by itself when the run ends."""
    up = orchestrator("up", "--config", str(write_config(tmp_path, steps=400)))
    run = tmp_path / "run"
    wait_for(run / "endpoints.json")
    server, url = start_server("--run-dir", str(run))
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    seen, deadline = [], time.monotonic() + 120
    try:
        while time.monotonic() < deadline and len({v for v in seen if v is not None}) < 3:
            try:
                out = client.completions.create(model="tiny-model", prompt="repeat 1", max_tokens=4)
                seen.append(out.policy_version)
            except openai.APIStatusError as e:  # before the learner's first weights: nothing to serve
                assert e.status_code == 503 and "has no adapters yet" in str(e), e
                assert not [v for v in seen if v is not None]
            time.sleep(0.2)
        versions = [v for v in seen if v is not None]
        assert len(set(versions)) >= 3 and versions == sorted(versions), seen
    finally:
        up.send_signal(signal.SIGTERM)
        up.communicate(timeout=120)
    assert server.wait(timeout=30) == 0  # told to stop by the learner as the run ended


def http(port: int, raw: bytes, timeout: float = 30) -> tuple[int, bytes]:
    """Send `raw` as the whole request on a new connection; the status and body that come
    back (status 0 if the server closed without answering)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
        try:
            conn.sendall(raw)
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server answered and closed before reading it all (a body over the limit)
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = re.match(rb"HTTP/1\.[01] (\d{3})", head)
    return (int(status.group(1)) if status else 0), body


def post(path: str, body: bytes, headers: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{headers}\r\n"
    ).encode() + body


WRONG_VALUES = [
    None,
    True,
    -1,
    0,
    1.5,
    10**30,
    -(10**30),
    1e308,
    "x",
    "",
    [],
    {},
    [1, "a"],
    {"a": []},
    [[1]],
    2**63,
    -(2**63),
    "\ud800",
]
FIELDS = [
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "seed",
    "stop",
    "logprobs",
    "tools",
    "stream",
]
BAD_MESSAGES = [
    [{"role": 1, "content": "x"}],
    [{"content": "x"}],
    ["x"],
    [{"role": "user", "content": None}],
    [{"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{x"}}]}],
    [{"role": "user", "content": {"a": 1}}],
]
NOT_HTTP = [
    b"GET /nowhere HTTP/1.1\r\n\r\n",
    b"DELETE /v1/completions HTTP/1.1\r\n\r\n",
    b"POST\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nContent-Length: abc\r\n\r\n{}",
    b"GET /v1/models HTTP/1.1\r\n" + b"X: y\r\n" * 200 + b"\r\n",
]


def malformed_requests(rng: random.Random, n: int):
    """`n` requests a client should never send, of every kind the server must survive, as
    (kind, bytes); kind 7 is not HTTP at all."""
    paths = ["/v1/completions", "/v1/chat/completions"]
    good = json.dumps({"prompt": "repeat 1", "max_tokens": 2}).encode()
    for i in range(n):
        kind, path = i % 10, rng.choice(paths)
        if kind == 0:  # not JSON, or cut short
            broken = [good[: rng.randrange(len(good))], rng.randbytes(rng.randrange(1, 64))]
            yield (
                kind,
                post(path, rng.choice([*broken, b"[" * 5000, b"{" * 100000, b"NaN", b'{"prompt": NaN}'])),
            )
        elif kind == 1:  # fields of a wrong type, or out of range
            body = {"prompt": "repeat 1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            for field in rng.sample(FIELDS, rng.randrange(1, 4)):
                body[field] = rng.choice(WRONG_VALUES)
            yield kind, post(path, json.dumps(body).encode())
        elif kind == 2:  # token ids outside the vocabulary (57), or not ids at all
            ids = [
                rng.choice([-1, -(2**40), 57, 58, 999999, 2**31, 2**63 - 1, 3, True])
                for _ in range(rng.randrange(1, 6))
            ]
            yield kind, post("/v1/completions", json.dumps({"prompt": ids, "max_tokens": 2}).encode())
        elif kind == 3:  # huge max_tokens, n or top_k
            body = {"prompt": "repeat 2", "messages": [{"role": "user", "content": "a"}], "stop": ["x"]}
            body[rng.choice(["max_tokens", "n", "top_k"])] = rng.choice([10**9, 10**18, 65, 10**5])
            yield kind, post(path, json.dumps(body).encode())
        elif kind == 4:  # a body that is not UTF-8
            yield kind, post(path, b'{"prompt": "' + rng.randbytes(32).replace(b'"', b"x") + b'"}')
        elif kind == 5:  # a Content-Length over the limit, or negative; the body never comes whole
            length = rng.choice([17 << 20, 2**62, -5])
            yield (
                kind,
                post(path, b'{"prompt": "' + b"a" * 1000).replace(
                    b"Content-Length: 1012", f"Content-Length: {length}".encode()
                ),
            )
        elif kind == 6:  # long but legal: a very long prompt, long messages
            body = {
                "prompt": "repeat 1 " * rng.randrange(100, 2000),
                "messages": [{"role": "user", "content": "x" * 5000}] * 3,
            }
            yield kind, post(path, json.dumps(body).encode())
        elif kind == 7:  # not HTTP, or HTTP the server does not serve
            yield kind, rng.choice([rng.randbytes(rng.randrange(1, 200)), *NOT_HTTP])
        elif kind == 8:  # messages and tools of every wrong shape
            body = {"messages": rng.choice(BAD_MESSAGES), "tools": rng.choice([None, "x", [1], [{}]])}
            yield kind, post("/v1/chat/completions", json.dumps(body).encode())
        else:  # JSON that is not an object
            yield kind, post(path, json.dumps(rng.choice([[], [1, 2], "s", 3, None, True])).encode())


def test_thousands_of_malformed_requests_never_end_the_server(tmp_path):
    """A fuzz of 4,000 requests no client should send, 400 of each of ten kinds (broken
    and non-UTF-8 JSON, wrong types, out-of-range and out-of-vocabulary ids, huge
    max_tokens and bodies, non-HTTP bytes), and a client that stalls: every one is
    answered with an error naming what is wrong (never a 500, and never a body that is
    not JSON), the server stays up, and a good request made before is answered the same
    after."""
    proc, url = start_server("--config", str(EXAMPLES / "tiny.toml"))
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    good = post(
        "/v1/completions",
        json.dumps({"prompt": "repeat 3", "max_tokens": 6, "seed": 5, "logprobs": 1}).encode(),
    )
    try:
        status, before = http(port, good)
        assert status == 200
        statuses = collections.Counter()
        for kind, raw in malformed_requests(random.Random(0), 4_000):
            status, body = http(port, raw)
            statuses[status] += 1
            if status == 0 and kind == 7:
                continue  # bytes that are not HTTP: the server may just close
            assert status in (200, 400, 404, 405, 408, 413, 431, 501), (status, raw[:200], body[:200])
            assert json.loads(body)  # JSON even for errors; strict: NaN would fail
        slow = socket.create_connection(("127.0.0.1", port))
        # A request line, then nothing: dropped after the client timeout (CLIENT_TIMEOUT_S).
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{")
        status, after = http(port, good, timeout=60)
        slow.close()
        assert proc.poll() is None
        assert status == 200 and json.loads(after)["choices"] == json.loads(before)["choices"]
        assert statuses[400] > 2000, statuses  # most are refused as bad requests
    finally:
        stop(proc)


def test_token_ids_outside_the_vocabulary_are_a_400_naming_the_field(served):
    """They would make MLX read past the embedding table (a crash, or NaN logprobs)."""
    client, _ = served
    for ids in ([999999, 3], [57], [-1, 2]):
        with pytest.raises(
            openai.BadRequestError,
            match=r"prompt: token id -?\d+ is outside the vocabulary "
            r"\(0 to 56\)",
        ):
            client.completions.create(model="tiny-model", prompt=ids, max_tokens=4)
    assert client.completions.create(model="tiny-model", prompt=[56, 3], max_tokens=2).choices


def test_max_tokens_defaults_to_what_the_context_leaves(tmp_path):
    """The arithmetic model's context is 64 tokens: a request without max_tokens gets what
    fits (not 256, which would be a 400)."""
    proc, url = start_server("--config", str(EXAMPLES / "arithmetic.toml"))
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    try:
        out = client.completions.create(model="arithmetic-model", prompt="what is 2 + 2?")
        assert out.usage.prompt_tokens + out.usage.completion_tokens <= 64
        assert out.choices[0].finish_reason == "length" or out.usage.completion_tokens < 64
    finally:
        stop(proc)


def test_a_finished_run_is_served_with_its_last_adapters(default_run):
    """`--run-dir` on a run that has ended: its newest checkpoint's adapters, as the policy
    version that trained them, not the base model."""
    proc, url = start_server("--run-dir", str(default_run))
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    try:
        out = client.completions.create(model="tiny-model", prompt="repeat 3", max_tokens=8, temperature=0)
        assert out.policy_version == 60 and out.choices[0].text == "33333333"
    finally:
        stop(proc)


def test_a_follower_serves_the_learner_s_weights_also_when_a_restart_goes_back(tmp_path, tiny):
    """A learner that restarts from a checkpoint sends an older version: that is the run's
    policy now, and the server takes it (it kept serving the discarded newer one)."""
    import zmq

    import protocol
    from actor.completions import Policy
    from actor.serve import Follower
    from orchestrator.launch import prepare_run_dir
    from policy.model import adapter_weights_numpy
    from runtime.config import load_config

    model, tok = tiny
    cfg = load_config(write_config(tmp_path))
    run = prepare_run_dir(cfg)
    ctx = zmq.Context()
    learner = ctx.socket(zmq.ROUTER)
    learner.bind(protocol.read_endpoints(run)["learner"])
    follower = Follower(str(run), cfg, Policy(model, tok, "tiny", cfg.sampling, None))
    try:
        identity, *hello = learner.recv_multipart()
        assert protocol.decode(hello)["role"] == "observer"
        weights = adapter_weights_numpy(model)
        for version in (3, 1):
            message = protocol.encode(protocol.WEIGHTS, {"version": version}, weights)
            learner.send_multipart([identity, *message])
            deadline = time.monotonic() + 10
            while follower.policy.policy_version != version and time.monotonic() < deadline:
                follower.poll()
                time.sleep(0.02)
            assert follower.policy.policy_version == version
    finally:
        follower.close()
        learner.close(linger=0)
        ctx.term()

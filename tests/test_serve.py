"""`actor serve`: the OpenAI Python client against the real server process, alone with an
adapter and following a training run's versions."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from tests.conftest import EXAMPLES, ROOT, TINY_MODEL, write_config
from tests.test_e2e import orchestrator, wait_for

openai = pytest.importorskip("openai")


def start_server(*args: str) -> tuple[subprocess.Popen, str]:
    """`actor serve ... --port 0`, and its base URL once it listens."""
    proc = subprocess.Popen([sys.executable, "-m", "actor", "serve", "--port", "0", *args], cwd=ROOT,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    line = proc.stdout.readline()
    found = re.search(r"on (http://\S+/v1)", line)
    if not found:
        proc.kill()
        raise AssertionError(f"no address: {line!r}")
    return proc, found.group(1)


def stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=30)


def reference_logprobs(adapter: Path, prompt_ids: list[int], ids: list[int]) -> np.ndarray:
    """Each sampled token's logprob from mlx-lm's own loading of the same adapter."""
    from mlx_lm import load

    model, _ = load(str(TINY_MODEL), adapter_path=str(adapter))
    full = mx.array([prompt_ids + ids])
    logits = model(full)[0, len(prompt_ids) - 1:-1].astype(mx.float32)
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
    out = client.completions.create(model="tiny-model", prompt="repeat 3", max_tokens=8, temperature=0,
                                    logprobs=1)
    choice = out.choices[0]
    assert choice.text == "33333333" and choice.finish_reason == "length"  # what the trained adapter says
    assert out.policy_version is None  # a fixed adapter has no version
    assert len(choice.token_ids) == len(choice.token_logprobs) == out.usage.completion_tokens == 8
    assert choice.logprobs.token_logprobs == choice.token_logprobs
    assert "".join(choice.logprobs.tokens) == choice.text
    np.testing.assert_allclose(choice.token_logprobs,
                               reference_logprobs(adapter, out.prompt_token_ids, choice.token_ids), atol=1e-4)


def test_chat_completions_sample_n_choices_reproducibly_by_seed(served):
    client, adapter = served
    ask = dict(model="tiny-model", messages=[{"role": "user", "content": "repeat 5"}], max_tokens=6, n=3,
               seed=7, logprobs=True)
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
    out = client.completions.create(model="tiny-model", prompt="repeat 3", max_tokens=8, temperature=0,
                                    stop=["333"])
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
            out = client.completions.create(model="tiny-model", prompt="repeat 1", max_tokens=4)
            seen.append(out.policy_version)
            time.sleep(0.2)
        versions = [v for v in seen if v is not None]
        assert len(set(versions)) >= 3 and versions == sorted(versions), seen
    finally:
        up.send_signal(signal.SIGTERM)
        up.communicate(timeout=120)
    assert server.wait(timeout=30) == 0  # told to stop by the learner as the run ended

"""Sampling: truncation rules by hand, and behavior logprobs against a full forward."""

import math

import mlx.core as mx
import numpy as np
import pytest

from actor.sampler import SamplingParams, sample_group, truncate
from policy.logprobs import sequence_logprobs

PROBS = np.array([0.5, 0.25, 0.15, 0.07, 0.03])
LOGPROBS = mx.array(np.log(PROBS), dtype=mx.float32)[None]


def kept(params: SamplingParams) -> list[bool]:
    return np.isfinite(np.array(truncate(LOGPROBS, params))[0]).tolist()


def test_no_truncation_keeps_everything():
    assert kept(SamplingParams()) == [True] * 5


def test_top_k_keeps_the_k_most_likely():
    assert kept(SamplingParams(top_k=2)) == [True, True, False, False, False]


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # Mass before each token: 0, .5, .75, .90, .97. top_p=0.8 keeps tokens whose prefix < .8.
    assert kept(SamplingParams(top_p=0.8)) == [True, True, True, False, False]
    assert kept(SamplingParams(top_p=0.5)) == [True, False, False, False, False]


def test_min_p_keeps_tokens_above_a_fraction_of_the_best():
    # min_p=0.29 -> floor 0.145: keeps .5, .25 and .15.
    assert kept(SamplingParams(min_p=0.29)) == [True, True, True, False, False]


def test_truncation_keeps_kept_logprobs_unchanged():
    out = np.array(truncate(LOGPROBS, SamplingParams(top_k=3)))[0]
    np.testing.assert_allclose(out[:3], np.log(PROBS[:3]), rtol=1e-6)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_behavior_logprobs_equal_a_full_forward(tiny, temperature, top_p):
    """At equal weights the learner's recomputation (a full forward, no cache) gives the
    actor's behavior logprobs: the importance ratio is 1 at step 0. Tolerance 1e-4."""
    model, tok = tiny
    mx.random.seed(3)
    prompt = tok.encode("repeat 5")
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=10)
    completions = sample_group(model, prompt, 4, params, set(tok.eos_token_ids))
    for c in completions:
        assert len(c.token_ids) == len(c.logprobs) >= 1
        full = sequence_logprobs(model, mx.array([prompt + c.token_ids]), temperature)
        recomputed = np.array(full[0, len(prompt) - 1:])
        ratio = np.exp(recomputed - np.array(c.logprobs))
        np.testing.assert_allclose(ratio, 1.0, atol=1e-4)


def test_sampling_stops_at_eos_and_reports_why(tiny):
    model, tok = tiny
    eos = set(tok.eos_token_ids)
    mx.random.seed(0)
    # Every token counts as EOS: each row stops after its first token, finish reason "stop".
    every = set(range(len(tok.get_vocab())))
    stopped = sample_group(model, tok.encode("repeat 1"), 3, SamplingParams(max_tokens=5), every)
    assert [len(c.token_ids) for c in stopped] == [1, 1, 1]
    assert {c.finish_reason for c in stopped} == {"stop"}
    long = sample_group(model, tok.encode("repeat 1"), 3, SamplingParams(max_tokens=4), eos)
    for c in long:
        assert c.finish_reason == ("stop" if c.token_ids[-1] in eos else "length")
        assert len(c.token_ids) <= 4


def test_top_k_one_is_greedy(tiny):
    model, tok = tiny
    prompt = tok.encode("repeat 2")
    rows = sample_group(model, prompt, 3, SamplingParams(top_k=1, max_tokens=5), set())
    assert rows[0].token_ids == rows[1].token_ids == rows[2].token_ids
    logits = model(mx.array([prompt]))[0, -1]
    assert rows[0].token_ids[0] == int(mx.argmax(logits).item())
    assert math.isfinite(rows[0].logprobs[0]) and rows[0].logprobs[0] <= 0

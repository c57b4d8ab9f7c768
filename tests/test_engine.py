"""The continuous engine: rows that refill a batch as others end still get exactly the
reference sampler's tokens, and groups come back as they complete, not in batch order."""

import pytest

from policy.engine import Engine
from policy.sampler import reference_sample
from protocol.config import SamplingConfig
from tests.test_sampler import TEXTS, assert_same, policy  # noqa: F401  (policy: a fixture)

G = 3


def run_engine(model, prompts, params, eos, seed, max_rows, reverse=False):
    """Every group through the engine (group i: prompts[i], noise ids i*G .. i*G+G-1,
    added last to first if `reverse`); returns the groups by key, the order they came
    back in, and each group's first and last step with live rows."""
    engine = Engine(model, params, eos, seed, max_rows)
    for i in reversed(range(len(prompts))) if reverse else range(len(prompts)):
        engine.add(i, prompts[i], [i * G + j for j in range(G)])
    out, order, first, last = {}, [], {}, {}
    step = 0
    while engine.busy:
        finished = engine.step()
        for group, _ in engine.live:
            first.setdefault(group.key, step)
            last[group.key] = step
        for key, completions in finished:
            out[key] = completions
            order.append(key)
        step += 1
        assert step < 10_000
    return out, order, first, last


@pytest.mark.parametrize("max_rows", [1, 7, 100])
def test_refill_gives_every_row_the_reference_sampler_s_tokens(policy, max_rows):  # noqa: F811
    model, tok = policy
    prompts = [tok.encode(t) for t in TEXTS + ["repeat 777", "ab"]]
    eos = {*tok.eos_token_ids, tok.encode("f")[0], tok.encode("3")[0]}  # rows end at many lengths
    params = SamplingConfig(temperature=0.7, top_p=0.9, max_tokens=12)
    out, order, first, last = run_engine(model, prompts, params, eos, 7, max_rows)
    assert sorted(out) == list(range(len(prompts)))
    for i, p in enumerate(prompts):
        assert_same(out[i], reference_sample(model, p, G, params, eos, 7, noise_offset=i * G))
    lengths = {len(c.token_ids) for group in out.values() for c in group}
    assert len(lengths) > 3  # a ragged batch, or nothing was refilled
    if max_rows == 7:  # refill: a group joined while an earlier one was still decoding
        assert any(first[b] > first[a] and first[b] <= last[a] for a in out for b in out)


def test_a_group_comes_back_when_its_last_row_ends(policy):  # noqa: F811
    """Group 0's rows are the shortest (4 tokens at most, the others reach 12): added
    last, it still comes back first, and the rest in the order their rows end."""
    model, tok = policy
    prompts = [tok.encode(t) for t in TEXTS + ["repeat 777", "ab"]]
    eos = {*tok.eos_token_ids, tok.encode("f")[0], tok.encode("3")[0]}
    params = SamplingConfig(temperature=0.7, top_p=0.9, max_tokens=12)
    out, order, _, last = run_engine(model, prompts, params, eos, 7, max_rows=100, reverse=True)
    assert max(len(c.token_ids) for c in out[0]) < min(max(len(c.token_ids) for c in out[k]) for k in out if k)
    assert order[0] == 0
    assert [last[k] for k in order] == sorted(last[k] for k in order)


def test_a_group_larger_than_the_batch_runs_alone(policy):  # noqa: F811
    model, tok = policy
    params = SamplingConfig(max_tokens=5)
    eos = set(tok.eos_token_ids)
    out, _, _, _ = run_engine(model, [tok.encode("hi")], params, eos, 1, max_rows=2)
    assert_same(out[0], reference_sample(model, tok.encode("hi"), G, params, eos, 1))

"""The engine: rows that refill a batch as others end (continuous) or decode a batch at a
time (static, on every cache type) still get exactly the reference sampler's tokens, and
groups come back as they complete, not in batch order."""

import mlx.core as mx
import numpy as np
import pytest

from policy.engine import Engine
from policy.model import adapter_weights_numpy, set_adapter_weights
from policy.sampler import reference_sample
from runtime.config import SamplingConfig
from tests.test_sampler import TEXTS, assert_same, policy  # noqa: F401  (policy: a fixture)

G = 3


def run_engine(model, prompts, params, eos, seed, max_rows, reverse=False, static=False):
    """Every group through the engine (group i: prompts[i], noise ids i*G .. i*G+G-1,
    added last to first if `reverse`); returns the groups by key, the order they came
    back in, and each group's first and last step with live rows."""
    engine = Engine(model, params, eos, seed, max_rows, static=static)
    for i in reversed(range(len(prompts))) if reverse else range(len(prompts)):
        engine.add(i, prompts[i], [i * G + j for j in range(G)])
    out, order, first, last = {}, [], {}, {}
    step = 0
    while engine.busy:
        finished = engine.step()
        for group, _ in filter(None, engine.live):
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
    longest = {k: max(len(c.token_ids) for c in group) for k, group in out.items()}
    assert longest[0] < min(longest[k] for k in out if k)
    assert order[0] == 0
    assert [last[k] for k in order] == sorted(last[k] for k in order)


def test_a_group_larger_than_the_batch_runs_alone(policy):  # noqa: F811
    model, tok = policy
    params = SamplingConfig(max_tokens=5)
    eos = set(tok.eos_token_ids)
    out, _, _, _ = run_engine(model, [tok.encode("hi")], params, eos, 1, max_rows=2)
    assert_same(out[0], reference_sample(model, tok.encode("hi"), G, params, eos, 1))


def other_caches(kind, model):
    """The model's caches made of another kind: mergeable but not plain KVCache (a rotating
    window longer than any sequence here, so the same attention), or not mergeable."""
    from mlx_lm.models.cache import ConcatenateKVCache, RotatingKVCache

    if kind == "rotating":
        return lambda: [RotatingKVCache(max_size=256) for _ in model.layers]
    return lambda: [ConcatenateKVCache() for _ in model.layers]


@pytest.mark.parametrize("kind", ["rotating", "unmergeable"])
def test_static_batches_of_caches_that_are_not_plain_give_the_reference_sampler_s_tokens(
    policy,  # noqa: F811
    kind,
    monkeypatch,
):
    """A batch at a time (7 rows: two groups of 3 when the caches merge, one when they
    cannot), rows ending at many lengths: every row is the reference sampler's, no group
    joins a batch that is decoding, and one version per row leaves `versions` unset (a
    static rollout carries no per-token versions)."""
    from policy.logprobs import plain_caches

    model, tok = policy
    monkeypatch.setattr(model, "make_cache", other_caches(kind, model))
    assert not plain_caches(model)
    with pytest.raises(ValueError, match="plain KVCache"):
        Engine(model, SamplingConfig(), set(), 0, max_rows=7)
    prompts = [tok.encode(t) for t in TEXTS + ["repeat 777", "ab"]]
    eos = {*tok.eos_token_ids, tok.encode("f")[0], tok.encode("3")[0]}
    params = SamplingConfig(temperature=0.7, top_p=0.9, max_tokens=12)
    out, _, first, last = run_engine(model, prompts, params, eos, 7, max_rows=7, static=True)
    for i, p in enumerate(prompts):
        assert_same(out[i], reference_sample(model, p, G, params, eos, 7, noise_offset=i * G))
        assert all(c.versions is None for c in out[i])
    assert len({len(c.token_ids) for group in out.values() for c in group}) > 3  # ragged
    starts = sorted(set(first.values()))
    for a in out:  # a batch's groups start together; no other group starts while they decode
        assert not any(first[a] < first[b] <= last[a] for b in out)
    per_batch = [sum(first[k] == s for k in out) for s in starts]
    assert per_batch == ([2, 2, 2] if kind == "rotating" else [1] * len(prompts))


def test_a_static_engine_admits_no_group_into_a_running_batch(policy):  # noqa: F811
    """Room for every row, yet a group added while a batch decodes waits for its end;
    the continuous engine takes it at the next step."""
    model, tok = policy
    params, eos = SamplingConfig(max_tokens=6), set()  # every row runs the 6 steps
    for static in (True, False):
        engine = Engine(model, params, eos, 0, max_rows=100, static=static)
        engine.add("first", tok.encode("hi"), list(range(G)))
        engine.step()
        engine.add("second", tok.encode("x"), list(range(G, 2 * G)))
        steps, joined = 1, None
        while engine.busy:
            done = dict(engine.step())
            steps += 1
            if joined is None and any(g.key == "second" for g, _ in filter(None, engine.live)):
                joined = steps
            if "first" in done:
                assert steps == 6
        assert joined == (7 if static else 2), static


def test_weights_that_change_between_steps_are_recorded_token_by_token(policy):  # noqa: F811
    """New weights set between two steps: the tokens sampled from logits queued before
    carry the old version, the rest the new one. A row's tokens up to the change are the
    old weights' (reference sampler); a group that joins after it is the new weights'."""
    model, tok = policy
    params, eos = SamplingConfig(temperature=0.7, top_p=0.9, max_tokens=10), set(tok.eos_token_ids)
    prompts = [tok.encode(t) for t in ("repeat 5", "hi", "x")]
    old = adapter_weights_numpy(model)
    rng = np.random.default_rng(1)
    new = {k: rng.normal(0, 0.05, v.shape).astype(np.float32) for k, v in old.items()}
    before = reference_sample(model, prompts[0], G, params, eos, 3)
    engine = Engine(model, params, eos, 3, max_rows=G)  # one group at a time
    for i, p in enumerate(prompts):
        engine.add(i, p, [i * G + j for j in range(G)])
    out, version, steps = {}, 0, 0
    try:
        while engine.busy:
            if steps == 3:
                set_adapter_weights(model, new)
                version = 1
            out.update(engine.step(version))
            steps += 1
        after = [
            reference_sample(model, p, G, params, eos, 3, noise_offset=i * G) for i, p in enumerate(prompts)
        ]
    finally:
        set_adapter_weights(model, old)
    for row, ref in zip(out[0], before):
        # Tokens 0-3 come from logits queued before the change (token 3's in the step
        # before it), token 4 on from the new weights.
        assert row.versions == [0] * min(4, len(row.versions)) + [1] * max(0, len(row.versions) - 4)
        assert row.token_ids[:4] == ref.token_ids[:4]
        np.testing.assert_allclose(row.logprobs[:4], ref.logprobs[:4], atol=1e-4)
    assert any(len(row.versions) > 4 for row in out[0])  # the group spans the change
    for i in (1, 2):  # joined after the change
        assert_same(out[i], after[i])
        assert all(set(row.versions) == {1} for row in out[i])


def test_a_group_that_joins_at_a_weight_change_is_the_new_weights_from_its_first_token(policy):  # noqa: F811
    """Weights set the very step a group joins: its prefill and first token are the new
    version's. The engine, cleared, starts again empty."""
    model, tok = policy
    params, eos = SamplingConfig(max_tokens=4), set(tok.eos_token_ids)
    old = adapter_weights_numpy(model)
    new = {k: np.random.default_rng(2).normal(0, 0.05, v.shape).astype(np.float32) for k, v in old.items()}
    engine = Engine(model, params, eos, 5, max_rows=G)
    engine.add("first", tok.encode("hi"), list(range(G)))
    engine.add("second", tok.encode("x"), list(range(G, 2 * G)))
    out, version = {}, 0
    try:
        while engine.busy:
            if "first" in out and version == 0:  # the second joins at the next step
                set_adapter_weights(model, new)
                version = 1
            out.update(engine.step(version))
        second = reference_sample(model, tok.encode("x"), G, params, eos, 5, noise_offset=G)
        engine.add("again", tok.encode("x"), list(range(G, 2 * G)))
        engine.clear()
        assert not engine.busy and engine.step(1) == []
    finally:
        set_adapter_weights(model, old)
    assert all(set(row.versions) == {0} for row in out["first"])
    assert all(set(row.versions) == {1} for row in out["second"])
    assert_same(out["second"], second)


def test_episodes_keep_their_kv_cache_across_turns_and_prefill_only_what_the_environment_adds(policy):  # noqa: F811
    """Three episodes of three turns, at most two rows live: each turn is added the moment
    the previous one ends (no lockstep), continuing its kept cache with the environment's
    tokens. Every turn equals the reference sampler on the whole context (a full forward
    every step): its tokens exactly, its logprobs to 1e-5 (float32). The learner's
    full-context forward gives the same logprobs. The prefill is each context once:
    prompts and environment tokens, never a model turn again."""
    from policy.logprobs import sequence_logprobs

    model, tok = policy
    eos = {*tok.eos_token_ids, tok.encode("f")[0], tok.encode("3")[0]}
    params = SamplingConfig(temperature=0.7, top_p=0.9, max_tokens=8)
    prompts = {k: tok.encode(t) for k, t in enumerate(["repeat 5", "hi", "repeat 12345 please"])}
    observations = [tok.encode(t) for t in ("ok 1", "no", "try again 77")]
    engine = Engine(model, params, eos, 0, max_rows=2)
    context = {k: list(p) for k, p in prompts.items()}
    model_tokens: dict[int, list[tuple[int, float]]] = {k: [] for k in prompts}  # (position, logprob)
    turn = dict.fromkeys(prompts, 0)
    for k in prompts:
        engine.add(k, context[k], [k], seed=100, keep=True)
    while engine.busy:
        for k, (c,) in engine.step():
            (ref,) = reference_sample(model, context[k], 1, params, eos, 100 + turn[k], noise_offset=k)
            assert c.token_ids == ref.token_ids, (k, turn[k])
            np.testing.assert_allclose(c.logprobs, ref.logprobs, atol=1e-5)
            model_tokens[k] += [(len(context[k]) + i, lp) for i, lp in enumerate(c.logprobs)]
            context[k] += c.token_ids
            turn[k] += 1
            if turn[k] == 3:
                engine.release(k)
                continue
            context[k] += observations[(k + turn[k]) % 3]  # the environment's answer
            engine.add(k, context[k], [k], seed=100 + turn[k], keep=True)
    assert not engine.kept
    added = sum(len(observations[(k + t) % 3]) for k in prompts for t in (1, 2))
    assert engine.prefilled == sum(map(len, prompts.values())) + added
    for k in prompts:  # the learner's recompute: one forward over the whole episode
        full = np.array(sequence_logprobs(model, mx.array([context[k]]), params.temperature))[0]
        positions, logprobs = zip(*model_tokens[k])
        np.testing.assert_allclose(full[np.array(positions) - 1], logprobs, atol=1e-5)


def test_a_kept_cache_holds_its_own_row_not_the_batch_s(policy):  # noqa: F811
    """An episode's turn ends with 31 other rows live: what it keeps while it waits for its
    environment is its own row's keys and values, not (through a lazy slice) the whole
    batch's cache."""
    import gc

    model, tok = policy
    params, eos = SamplingConfig(max_tokens=6), set(tok.eos_token_ids)
    engine = Engine(model, params, eos, 0, max_rows=32)
    engine.add("episode", tok.encode("hi"), [0], keep=True)
    for i in range(31):
        engine.add(i, tok.encode("repeat 12345 please " * 8), [i + 1])
    while "episode" not in engine.kept:
        engine.step()
    kept = engine.kept.pop("episode")
    engine.clear()
    gc.collect()
    own = sum(c.keys.nbytes + c.values.nbytes for c in kept.cache)
    before = mx.get_active_memory()
    del kept
    gc.collect()
    assert before - mx.get_active_memory() < 4 * own


def test_a_group_given_up_never_comes_back_and_the_others_are_as_sampled_without_it(policy):  # noqa: F811
    """Three groups decode together under version 0, a fourth waits for room; at step 3
    version 2 arrives. `started_before(1)` names the three (not the waiting one, which has
    no tokens yet); cancelling the first lets the fourth join in its rows, and every group
    but the first comes back with the reference sampler's tokens: a row's noise is its own.
    A group cancelled while waiting never joins; cancelling the last live group empties
    the engine."""
    model, tok = policy
    params = SamplingConfig(temperature=0.7, top_p=0.9, max_tokens=12)
    eos = set(tok.eos_token_ids)
    prompts = [tok.encode(t) for t in ("repeat 5", "hi", "x", "ab", "repeat 777")]
    engine = Engine(model, params, eos, 4, max_rows=3 * G)
    for i, p in enumerate(prompts):
        engine.add(i, p, [i * G + j for j in range(G)])
    engine.cancel(4)  # waiting: never joins
    out: dict = {}
    for _ in range(3):
        out.update(engine.step(0))
    assert not out and sorted(engine.started_before(1)) == [0, 1, 2] and engine.started_before(0) == []
    engine.cancel(0)
    out.update(engine.step(2))
    live = {group.key for group, _ in filter(None, engine.live)}
    assert live == {1, 2, 3}, live  # the fourth took the first's rows while the others decode
    while engine.busy:
        out.update(engine.step(2))
        assert 0 not in engine.started_before(3)
    assert sorted(out) == [1, 2, 3]
    for i in (1, 2, 3):
        assert_same(out[i], reference_sample(model, prompts[i], G, params, eos, 4, noise_offset=i * G))
    assert all(set(row.versions) == {2} for row in out[3])  # joined after the change

    engine.add("alone", prompts[0], list(range(G)))
    engine.step(5)
    assert engine.started_before(6) == ["alone"]
    engine.cancel("alone")
    assert not engine.busy and engine.step(6) == []


def test_a_decode_step_says_what_its_forward_read_of_the_cache(policy):  # noqa: F811
    """A row 9 positions in (a 4-token prompt, 5 tokens) and a group of 2 rows with a
    2-token prompt that joins it: the joining rows are left-padded to the first's length,
    so the next forward reads 3 rows x 10 positions, of which 10 + 3 + 3 are the rows' own
    (the timeline's decode step spans carry these; benchmarks/common.py sums them)."""
    model, _ = policy
    engine = Engine(model, SamplingConfig(max_tokens=20), set(), 0, max_rows=8)
    engine.add("a", [1, 2, 3, 4], [0])
    engine.step()
    assert engine.read == {"batch": 1, "cache": 5, "own": 5}
    for _ in range(4):
        engine.step()
    engine.add("b", [5, 6], [1, 2])
    engine.step()
    assert engine.read == {"batch": 3, "cache": 10, "own": 16}

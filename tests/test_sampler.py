"""Sampling: truncation rules by hand, behavior logprobs against a full forward, and the
batched sampler against the plain reference sampler."""

import math

import mlx.core as mx
import numpy as np
import pytest

from policy.engine import sample_groups
from policy.logprobs import sequence_logprobs, token_logprobs
from policy.model import adapter_weights_numpy, load_policy, set_adapter_weights
from policy.sampler import Softmax, noise_keys, reference_sample, sample_tokens, truncate
from runtime.config import LoraConfig, SamplingConfig
from tests.helpers import TINY_MODEL

PROBS = np.array([0.5, 0.25, 0.15, 0.07, 0.03])
LOGPROBS = mx.array(np.log(PROBS), dtype=mx.float32)[None]


def kept(params: SamplingConfig) -> list[bool]:
    return np.isfinite(np.array(truncate(LOGPROBS, params))[0]).tolist()


def test_no_truncation_keeps_everything():
    assert kept(SamplingConfig()) == [True] * 5


def test_top_k_keeps_the_k_most_likely():
    assert kept(SamplingConfig(top_k=2)) == [True, True, False, False, False]


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # Mass before each token: 0, .5, .75, .90, .97. top_p=0.8 keeps tokens whose prefix < .8.
    assert kept(SamplingConfig(top_p=0.8)) == [True, True, True, False, False]
    assert kept(SamplingConfig(top_p=0.5)) == [True, False, False, False, False]


def test_min_p_keeps_tokens_above_a_fraction_of_the_best():
    # min_p=0.29 -> floor 0.145: keeps .5, .25 and .15.
    assert kept(SamplingConfig(min_p=0.29)) == [True, True, True, False, False]


def test_tied_tokens_are_kept_or_cut_together():
    # .3 .3 .3 .1: top_p=0.5 reaches p inside the tie, so all three tied tokens stay;
    # top_k=2 keeps the k-th's ties too.
    tied = mx.array(np.log([[0.3, 0.1, 0.3, 0.3]]), dtype=mx.float32)
    for params in (SamplingConfig(top_p=0.5), SamplingConfig(top_k=2)):
        assert np.isfinite(np.array(truncate(tied, params))[0]).tolist() == [True, False, True, True]


def test_truncation_keeps_kept_logprobs_unchanged():
    out = np.array(truncate(LOGPROBS, SamplingConfig(top_k=3)))[0]
    np.testing.assert_allclose(out[:3], np.log(PROBS[:3]), rtol=1e-6)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
@pytest.mark.parametrize(
    "mode", [{}, {"top_k": 5}, {"top_p": 0.7}, {"min_p": 0.1}, {"top_k": 20, "top_p": 0.9, "min_p": 0.02}]
)
def test_sampler_and_learner_logprobs_agree_on_the_same_logits(temperature, mode):
    """The two sides' one definition: whatever the truncation, the logprob the sampler
    reports for the token it drew is the learner's `token_logprobs` of that token."""
    rng = np.random.default_rng(7)
    logits = mx.array((rng.standard_normal((6, 300)) * 4).astype(np.float32)).astype(mx.bfloat16)
    params = SamplingConfig(temperature=temperature, **mode)
    tokens, sampled = sample_tokens(logits, noise_keys(0, list(range(6))), 0, params)
    learner = token_logprobs(logits, tokens, temperature)
    np.testing.assert_allclose(np.array(sampled), np.array(learner), rtol=0, atol=1e-6)
    # ...and both are the untruncated log-softmax, computed independently in float64.
    x = np.array(logits.astype(mx.float32), dtype=np.float64) / temperature
    top = x.max(-1, keepdims=True)
    ref = x - top - np.log(np.exp(x - top).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.array(learner), ref[np.arange(6), np.array(tokens)], atol=1e-5)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_behavior_logprobs_equal_a_full_forward(tiny, temperature, top_p):
    """At equal weights the learner's recomputation (a full forward, no cache) gives the
    actor's behavior logprobs: the importance ratio is 1 at step 0. Tolerance 1e-4."""
    model, tok = tiny
    prompt = tok.encode("repeat 5")
    params = SamplingConfig(temperature=temperature, top_p=top_p, max_tokens=10)
    (completions,) = sample_groups(model, [prompt], 4, params, set(tok.eos_token_ids), seed=3)
    for c in completions:
        assert len(c.token_ids) == len(c.logprobs) >= 1
        full = sequence_logprobs(model, mx.array([prompt + c.token_ids]), temperature)
        recomputed = np.array(full[0, len(prompt) - 1 :])
        ratio = np.exp(recomputed - np.array(c.logprobs))
        np.testing.assert_allclose(ratio, 1.0, atol=1e-4)


def test_sampling_stops_at_eos_and_reports_why(tiny):
    model, tok = tiny
    eos = set(tok.eos_token_ids)
    # Every token counts as EOS: each row stops after its first token, finish reason "stop".
    every = set(range(len(tok.get_vocab())))
    prompt = tok.encode("repeat 1")
    (stopped,) = sample_groups(model, [prompt], 3, SamplingConfig(max_tokens=5), every, seed=0)
    assert [len(c.token_ids) for c in stopped] == [1, 1, 1]
    assert {c.finish_reason for c in stopped} == {"stop"}
    (long,) = sample_groups(model, [prompt], 3, SamplingConfig(max_tokens=4), eos, seed=0)
    for c in long:
        assert c.finish_reason == ("stop" if c.token_ids[-1] in eos else "length")
        assert len(c.token_ids) <= 4


def test_top_k_one_is_greedy(tiny):
    model, tok = tiny
    prompt = tok.encode("repeat 2")
    (rows,) = sample_groups(model, [prompt], 3, SamplingConfig(top_k=1, max_tokens=5), set(), seed=0)
    assert rows[0].token_ids == rows[1].token_ids == rows[2].token_ids
    logits = model(mx.array([prompt]))[0, -1]
    assert rows[0].token_ids[0] == int(mx.argmax(logits).item())
    assert math.isfinite(rows[0].logprobs[0]) and rows[0].logprobs[0] <= 0


# Different lengths, so the batch needs left padding.
TEXTS = ["repeat 5", "hi", "repeat 12345 please", "x"]


@pytest.fixture(scope="module")
def policy(tiny):
    """Its own tiny model with non-zero LoRA weights: a less trivial policy than the base,
    and the session's shared model stays untouched."""
    _, tok = tiny
    model, _, _ = load_policy(str(TINY_MODEL), LoraConfig())
    rng = np.random.default_rng(0)
    set_adapter_weights(
        model,
        {k: rng.normal(0, 0.05, v.shape).astype(np.float32) for k, v in adapter_weights_numpy(model).items()},
    )
    return model, tok


def assert_same(batched, reference):
    for a, b in zip(batched, reference, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)


def assert_matches_reference(model, prompts, g, params, eos, seed):
    groups = sample_groups(model, prompts, g, params, eos, seed)
    assert len(groups) == len(prompts)
    for i, (prompt, group) in enumerate(zip(prompts, groups)):
        assert_same(group, reference_sample(model, prompt, g, params, eos, seed, noise_offset=i * g))
    return groups


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_batched_sampling_equals_the_reference_sampler(policy, temperature, top_p):
    model, tok = policy
    params = SamplingConfig(temperature=temperature, top_p=top_p, max_tokens=12)
    groups = assert_matches_reference(
        model, [tok.encode(t) for t in TEXTS], 3, params, set(tok.eos_token_ids), seed=7
    )
    assert len({tuple(c.token_ids) for group in groups for c in group}) > 1


def test_rows_do_not_depend_on_the_rest_of_the_batch(policy):
    model, tok = policy
    prompts = [tok.encode(t) for t in TEXTS]
    params, eos = SamplingConfig(temperature=0.7, top_p=0.9, max_tokens=10), set(tok.eos_token_ids)
    batch = sample_groups(model, prompts, 4, params, eos, seed=3)
    # The same noise ids alone, or among fewer or other prompts, give the same tokens.
    assert_same(sample_groups(model, [prompts[0]], 4, params, eos, seed=3)[0], batch[0])
    assert_same(sample_groups(model, prompts[2:3], 4, params, eos, seed=3, noise_offset=8)[0], batch[2])
    others = sample_groups(
        model, [prompts[1], tok.encode("repeat 9"), prompts[3]], 4, params, eos, seed=3, noise_offset=4
    )
    assert_same(others[0], batch[1])
    assert_same(sample_groups(model, prompts, 4, params, eos, seed=3)[3], batch[3])
    tokens = [c.token_ids for group in batch for c in group]
    assert tokens != [
        c.token_ids for group in sample_groups(model, prompts, 4, params, eos, seed=4) for c in group
    ]


def test_each_row_stops_at_its_first_eos(policy):
    model, tok = policy
    eos = {*tok.eos_token_ids, tok.encode("f")[0]}  # a common letter: several rows stop early
    params = SamplingConfig(temperature=0.7, top_p=0.9, max_tokens=12)
    # Rows finishing at different steps leave the batch; the rest must not notice.
    groups = assert_matches_reference(model, [tok.encode(t) for t in TEXTS], 3, params, eos, seed=7)
    rows = [c for group in groups for c in group]
    for c in rows:
        stops = [k for k, t in enumerate(c.token_ids) if t in eos]
        if c.finish_reason == "stop":
            assert stops == [len(c.token_ids) - 1]
        else:
            assert c.finish_reason == "length" and not stops and len(c.token_ids) == 12
    assert {c.finish_reason for c in rows} == {"stop", "length"}
    assert len({len(c.token_ids) for c in rows if c.finish_reason == "stop"}) > 1


def test_caches_that_cannot_batch_decode_per_prompt(policy, monkeypatch):
    """A cache type without mlx-lm's merge (ConcatenateKVCache here) still samples the same."""
    from mlx_lm.models.cache import ConcatenateKVCache

    model, tok = policy
    monkeypatch.setattr(model, "make_cache", lambda: [ConcatenateKVCache() for _ in model.layers])
    eos = {*tok.eos_token_ids, tok.encode("f")[0]}
    assert_matches_reference(
        model, [tok.encode(t) for t in TEXTS], 3, SamplingConfig(max_tokens=8), eos, seed=1
    )


def test_caches_that_merge_but_are_not_plain_kv_caches_sample_the_same(policy, monkeypatch):
    """Other mergeable caches (a KVCache subclass here) prefill per prompt and merge."""
    from mlx_lm.models.cache import KVCache

    class OtherKVCache(KVCache):
        pass

    model, tok = policy
    monkeypatch.setattr(model, "make_cache", lambda: [OtherKVCache() for _ in model.layers])
    eos = {*tok.eos_token_ids, tok.encode("f")[0]}
    assert_matches_reference(
        model, [tok.encode(t) for t in TEXTS], 3, SamplingConfig(max_tokens=8), eos, seed=2
    )


@pytest.mark.parametrize("params", [SamplingConfig(), SamplingConfig(temperature=0.7, top_p=0.8)])
def test_gumbel_sampling_draws_from_the_truncated_distribution(params):
    """20,000 rows, one step: token frequencies match the tempered, truncated, renormalised
    distribution within 4 standard errors, and the reported logprobs are the untruncated."""
    probs = np.array([0.5, 0.25, 0.15, 0.07, 0.03])
    n = 20_000
    logits = mx.broadcast_to(mx.array(np.log(probs), dtype=mx.float32), (n, 5))
    tokens, picked = sample_tokens(logits, noise_keys(7, list(range(n))), 0, params)
    tempered = probs ** (1 / params.temperature)
    tempered /= tempered.sum()
    keep = np.array(truncate(mx.log(mx.array(tempered, dtype=mx.float32))[None], params))[0] > -np.inf
    expected = np.where(keep, tempered, 0) / tempered[keep].sum()
    freq = np.bincount(np.array(tokens), minlength=5) / n
    np.testing.assert_allclose(freq, expected, atol=4 * np.sqrt(0.25 / n))
    np.testing.assert_allclose(np.array(picked), np.log(tempered)[np.array(tokens)], atol=1e-5)


def full_sort_definition(logprobs: np.ndarray, p: SamplingConfig) -> np.ndarray:
    """Which tokens top-k, min-p and top-p keep, written independently in numpy (float64
    masses): kept if among the k largest values (ties included), within log(min_p) of the
    best, and if the mass of kept tokens strictly more likely is below top_p."""
    keep = np.ones_like(logprobs, dtype=bool)
    for r, row in enumerate(logprobs.astype(np.float64)):
        if p.top_k:
            keep[r] &= row >= np.sort(row)[::-1][p.top_k - 1]
        if p.min_p:
            keep[r] &= row >= row.max() + np.log(p.min_p)
        if p.top_p < 1:
            desc = np.sort(np.where(keep[r], row, -np.inf))[::-1]
            probs = np.exp(desc)
            before = np.concatenate([[0.0], np.cumsum(probs)[:-1]])
            first = np.searchsorted(-desc, -row, side="left")  # where a value's ties begin
            keep[r] &= before[first] < p.top_p
    return keep


def random_logits(rows: int, vocab: int, spread: float, ties: bool, seed: int) -> mx.array:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, vocab)) * spread
    if ties:  # coarse values: many exact ties, also among the most likely tokens
        x = np.round(x * 2) / 2
    return mx.array(x.astype(np.float32))


@pytest.mark.parametrize(
    "params",
    [
        SamplingConfig(temperature=0.7, top_p=0.95),
        SamplingConfig(top_p=1.0),
        SamplingConfig(top_k=50),
        SamplingConfig(min_p=0.05),
        SamplingConfig(temperature=1.3, top_k=40, top_p=0.9, min_p=0.01),
        SamplingConfig(top_p=0.3),
        SamplingConfig(top_k=2000, top_p=0.99),
    ],
    ids=["top_p", "p=1", "top_k", "min_p", "all", "small_p", "large_k"],
)
@pytest.mark.parametrize(
    "spread,ties", [(6.0, False), (6.0, True), (0.5, False)], ids=["peaked", "peaked-ties", "flat"]
)
def test_candidate_sampling_equals_the_full_sort_definition(params, spread, ties, monkeypatch):
    """At a vocabulary larger than the candidates, the sampler draws the very token (and
    logprob) that the definition (whole-vocabulary sort, noise for every token) draws, on
    peaked logits (the cut inside the candidates), with ties, and on flat ones (it falls
    back). The definition's kept set is checked against an independent numpy one."""
    import policy.sampler as sampler

    vocab, rows = 6000, 8
    logits = random_logits(rows, vocab, spread, ties, seed=3)
    calls = []
    full = sampler._sample_all
    monkeypatch.setattr(sampler, "_sample_all", lambda *a: calls.append(1) or full(*a))
    for t in range(5):
        keys = noise_keys(11, list(range(rows)))
        tokens, lps = sample_tokens(logits, keys, t, params)
        scaled = logits / params.temperature
        ref_tokens, ref_lps = full(Softmax.of(scaled), keys, t, params)
        assert np.array(tokens).tolist() == np.array(ref_tokens).tolist()
        np.testing.assert_array_equal(np.array(lps), np.array(ref_lps))
    logprobs = logits / params.temperature
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    kept = np.isfinite(np.array(truncate(logprobs, params)))
    np.testing.assert_array_equal(kept, full_sort_definition(np.array(logprobs), params))
    truncates = params.top_k or params.min_p or params.top_p < 1
    if spread > 1 and truncates and params.top_k != 2000:
        assert not calls  # the cut was among the candidates every time: no sort of the vocabulary
    if spread < 1 and truncates and not params.top_k:
        assert not calls  # a flat distribution under top-p and min-p: drawn by mass, no sort
    if not truncates:
        assert len(calls) == 5  # no truncation: noise for every token, as the definition draws


@pytest.mark.parametrize(
    "params",
    [
        SamplingConfig(temperature=0.7, top_p=0.95),
        SamplingConfig(top_p=0.5),
        SamplingConfig(top_p=0.05),
        SamplingConfig(temperature=1.3, top_p=0.8, min_p=0.2),
    ],
    ids=["p=0.95", "p=0.5", "p=0.05", "min_p"],
)
@pytest.mark.parametrize("per_row_steps", [False, True], ids=["one-step", "row-steps"])
def test_a_flat_distribution_is_drawn_by_mass_as_the_definition_draws(params, per_row_steps, monkeypatch):
    """Nearly flat logits at a vocabulary larger than the candidates: the sampler draws
    without a sort (the Gumbel-max over every token, then again above it where top-p cuts
    it), the very tokens and logprobs of the definition. At top_p 0.5 about half the first
    draws are cut, so a sampler that kept them would differ on most steps."""
    import policy.sampler as sampler

    vocab, rows = 6000, 16
    logits = random_logits(rows, vocab, 0.5, False, seed=5)
    full = sampler._sample_all
    sorted_rows = []
    monkeypatch.setattr(sampler, "_sample_all", lambda *a: sorted_rows.append(len(a[0].lse)) or full(*a))
    redrawn = 0
    for t in range(6):
        keys = noise_keys(3, list(range(rows)))
        steps = mx.array([t + 7 * r for r in range(rows)], dtype=mx.uint32) if per_row_steps else t
        tokens, lps = sample_tokens(logits, keys, steps, params)
        scaled = logits / params.temperature
        ref_tokens, ref_lps = full(Softmax.of(scaled), keys, steps, params)
        assert np.array(tokens).tolist() == np.array(ref_tokens).tolist()
        np.testing.assert_array_equal(np.array(lps), np.array(ref_lps))
        untruncated = SamplingConfig(temperature=params.temperature, min_p=params.min_p)
        first, _ = full(Softmax.of(scaled), keys, steps, untruncated)  # the draw before top-p's check
        redrawn += int((np.array(first) != np.array(tokens)).sum())
    assert not sorted_rows  # no row needed the sort
    if params.top_p <= 0.5:
        assert redrawn > rows  # top-p cut many first draws, which were drawn again


@pytest.mark.parametrize("margin", [0.2, 2.0], ids=["some-rows", "every-row"])
def test_rows_whose_mass_is_too_close_to_top_p_are_drawn_by_the_definition(margin, monkeypatch):
    """With a margin made wide, the rows whose mass above the drawn token is within it of
    top_p go through the sort (some rows, or every row), each with its own step, and the
    batch's tokens are still the definition's."""
    import policy.sampler as sampler

    vocab, rows, params = 6000, 16, SamplingConfig(top_p=0.5)
    logits = random_logits(rows, vocab, 0.5, False, seed=9)
    full = sampler._sample_all
    sorted_rows = []
    monkeypatch.setattr(sampler, "_sample_all", lambda *a: sorted_rows.append(len(a[0].lse)) or full(*a))
    monkeypatch.setattr(sampler, "mass_margin", lambda vocab: margin)
    keys = noise_keys(5, list(range(rows)))
    steps = mx.array(list(range(rows)), dtype=mx.uint32)
    tokens, _ = sample_tokens(logits, keys, steps, params)
    ref_tokens, _ = full(Softmax.of(logits), keys, steps, params)
    assert np.array(tokens).tolist() == np.array(ref_tokens).tolist()
    assert sorted_rows == [rows] if margin > 1 else 0 < sorted_rows[0] < rows


def test_one_exponential_gives_the_logsumexp_and_the_probabilities():
    """Softmax's logsumexp is mx.logsumexp's (bit for bit on this backend, the CPU), and
    its probabilities are exp(logprob) to float32 rounding and sum to 1: the top-p masses
    the sampler sums are the distribution's."""
    for rows, vocab, spread in ((3, 7, 1.0), (8, 6000, 0.5), (4, 50_000, 6.0)):
        scaled = random_logits(rows, vocab, spread, False, seed=rows)
        sm = Softmax.of(scaled)
        reference = mx.logsumexp(scaled, axis=-1)
        if mx.default_device() == mx.cpu:
            np.testing.assert_array_equal(np.array(sm.lse), np.array(reference))
        np.testing.assert_allclose(np.array(sm.lse), np.array(reference), rtol=1e-6)
        probs = np.array(sm.probs())
        np.testing.assert_allclose(
            probs, np.exp(np.array(scaled - reference[:, None])), rtol=1e-5, atol=1e-12
        )
        # To the float32 sum's rounding (MLX adds 50,000 terms in float32: about 3e-5 here).
        np.testing.assert_allclose(probs.astype(np.float64).sum(-1), 1.0, rtol=1e-4)
        ids = mx.array(np.argsort(-np.array(scaled), axis=-1)[:, :5].astype(np.int32))
        np.testing.assert_array_equal(
            np.array(sm.probs(ids)), np.take_along_axis(probs, np.array(ids), axis=-1)
        )


def test_a_flat_row_whose_top_token_is_far_above_the_average_skips_the_candidates(monkeypatch):
    """At 6,000 tokens of spread 0.5 the most likely token is so far above the average that
    k times its probability exceeds top_p, yet the 1,024 most likely hold far less than
    0.95: the mass bound tells, and the sampler draws by mass without partitioning the
    vocabulary, the definition's tokens. A row with one dominant token keeps the
    candidates' path."""
    import policy.sampler as sampler

    params = SamplingConfig(temperature=0.7, top_p=0.95)
    logits = random_logits(8, 6000, 0.5, False, seed=4)
    sm = Softmax.of(logits / params.temperature)
    assert (
        sampler.CANDIDATES * np.array(sm.probs()).max(-1) > params.top_p
    ).all()  # the old bound would not tell
    partitions = []
    real = mx.argpartition
    monkeypatch.setattr(sampler.mx, "argpartition", lambda *a, **k: partitions.append(1) or real(*a, **k))
    keys = noise_keys(2, list(range(8)))
    tokens, _ = sample_tokens(logits, keys, 0, params)
    assert not partitions
    assert np.array(tokens).tolist() == np.array(sampler._sample_all(sm, keys, 0, params)[0]).tolist()
    peaked = mx.concatenate([logits[:7], mx.array(np.eye(1, 6000, 17, dtype=np.float32) * 30.0)])
    sample_tokens(peaked, keys, 0, params)
    assert partitions  # a row the candidates hold: the batch looks among them


def test_near_ties_are_summed_in_the_definition_s_order_whatever_order_the_partition_gives(monkeypatch):
    """Logits a few units of float32 apart round to one logprob (the logsumexp is larger
    than they are) yet keep distinct probabilities, so top-p's sums depend on the order of
    ties. With the partition handing its candidates back reversed (any order is a valid
    partition), the sampler still draws the definition's token at every top_p that falls
    on one of the definition's partial sums."""
    import policy.sampler as sampler

    rng = np.random.default_rng(0)
    row = np.full(6000, -20.0, np.float32)
    near = rng.choice(6000, 200, replace=False)
    row[near] = np.float32(0.3) + rng.integers(0, 64, 200).astype(np.float32) * np.spacing(np.float32(0.3))
    logits = mx.array(row[None])
    sm = Softmax.of(logits)
    logprobs, probs = np.array(sm.logprobs())[0], np.array(sm.probs())[0]
    assert len(set(logprobs[near])) < len(set(probs[near]))  # ties in logprob, not in probability
    real = mx.argpartition
    monkeypatch.setattr(
        sampler.mx,
        "argpartition",
        lambda a, kth, axis: mx.concatenate(
            [real(a, kth, axis=axis)[:, kth::-1], real(a, kth, axis=axis)[:, kth + 1 :]], axis=-1
        ),
    )
    order = np.argsort(-logprobs, kind="stable")
    sums = np.cumsum(probs[order], dtype=np.float32)
    keys, differ = noise_keys(1, [0]), 0
    for top_p in sums[1:199]:
        params = SamplingConfig(top_p=float(top_p))
        for t in range(8):
            drawn = sample_tokens(logits, keys, t, params)[0]
            differ += int(np.array(drawn)[0] != np.array(sampler._sample_all(sm, keys, t, params)[0])[0])
    assert differ == 0

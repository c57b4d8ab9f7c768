"""Optimizer steps on the real tiny model: ratio 1 on-policy, exact gradient accumulation,
frozen old-policy logprobs across iterations, and the behavior-policy correction."""

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten

from learner import batching
from learner import trainer as trainer_module
from learner.algorithms import ALGORITHMS
from learner.batching import WHOLE, Logits, TrainRow, logits_plan, make_batch
from learner.correction import Correction, correction_weights
from learner.trainer import Trainer
from policy.engine import sample_groups
from policy.logprobs import output_head
from policy.model import adapter_weights_numpy, load_policy, set_adapter_weights
from runtime.config import AlgorithmConfig, LoraConfig, SamplingConfig, TrainConfig
from tests.helpers import TINY_MODEL, trainer_for

LORA = LoraConfig(rank=4, scale=10.0)


def model_with(weights=None):
    mx.random.seed(0)  # the LoRA init, so every test starts from the same adapters
    model, tok, _ = load_policy(str(TINY_MODEL), LORA)
    if weights is not None:
        set_adapter_weights(model, weights)
    return model, tok


def perturbed(weights, seed, sd=0.3):
    rng = np.random.default_rng(seed)
    return {k: v + rng.normal(0, sd, v.shape).astype(np.float32) for k, v in weights.items()}


# Ragged completions: each row's first n sampled tokens (a prefix keeps its behavior logprobs).
CUTS = [12, 3, 7, 1, 12, 5, 9, 2]


def sampled_batch(model, tok, groups=2, g=4, temperature=1.0, seed=0, episodes=False):
    """8 sampled completions of CUTS lengths; `episodes`: with loss masks that leave out
    every third token, as an episode's environment tokens."""
    prompts = [tok.encode("repeat " + "12345"[: 2 * i + 1]) for i in range(groups)]  # of other lengths
    sampled = sample_groups(
        model,
        prompts,
        g,
        SamplingConfig(temperature=temperature, max_tokens=12),
        set(tok.eos_token_ids),
        seed=seed,
    )
    samples = []
    for i, (p, c) in enumerate((p, c) for p, group in zip(prompts, sampled) for c in group):
        n = min(CUTS[i], len(c.token_ids))
        mask = (np.arange(n) % 3 != 1).astype(np.float32) if episodes else None
        samples.append(
            TrainRow(np.array(p), np.array(c.token_ids[:n]), np.array(c.logprobs[:n]), c.finish_reason, mask)
        )
    return make_batch(samples, 0)


CAP = 1.05


@pytest.fixture(autouse=True)
def free_forwards(monkeypatch):
    """A forward costs nothing beyond its positions, so these small ragged batches are cut
    into several micro-batches of their own shapes: what the exactness tests are about."""
    monkeypatch.setattr(batching, "FORWARD_POSITIONS", 0)


REWARDS = np.array([[1.0, 0.0, 0.5, 0.0], [0.0, 0.2, 1.0, 1.0]])


def test_first_iteration_ratio_is_exactly_one_and_later_ones_are_not():
    model, tok = model_with()
    batch = sampled_batch(model, tok)
    trainer = trainer_for(model)
    prepared = trainer.prepare(batch)
    assert len(prepared.micro) > 1  # ragged: micro-batches by length, each with its own shape
    advantages = trainer.algorithm.advantages(REWARDS)
    first = trainer.step(prepared, advantages)
    assert first["ratio_min"] == 1.0 and first["ratio_max"] == 1.0 and first["clip_ratio/region_mean"] == 0.0
    second = trainer.step(prepared, advantages)
    # old-policy logprobs stay frozen: after an update the ratio moves away from 1
    assert second["ratio_max"] > 1.0 or second["ratio_min"] < 1.0


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_micro_batched_accumulation_is_exact(name):
    """One SGD step on the whole batch and one accumulated over micro-batches of 3 rows
    (8 rows: 3 + 3 + 2) move the adapters identically."""
    model, tok = model_with()
    start = perturbed(adapter_weights_numpy(model), 1, 0.01)
    batch = sampled_batch(model, tok)
    results = []
    for micro in (0, 3):
        m, _ = model_with(start)
        trainer = trainer_for(
            m,
            name,
            beta=0.04,
            micro=micro,
            optimizer=optim.SGD(learning_rate=1.0),
            max_grad_norm=1e9,
            sort_by_length=False,
        )
        stats = trainer.step(trainer.prepare(batch), trainer.algorithm.advantages(REWARDS))
        delta = {k: v - start[k] for k, v in adapter_weights_numpy(m).items()}
        results.append((stats, delta))
    (full, d_full), (acc, d_acc) = results
    # CISPO's loss sums -w * A * logp: large terms that cancel, so float32 rounding shows at 1e-6.
    assert acc["loss"] == pytest.approx(full["loss"], rel=1e-5, abs=1e-7)
    assert acc["kl"] == pytest.approx(full["kl"], rel=1e-6, abs=1e-7)
    assert max(np.abs(d).max() for d in d_full.values()) > 1e-4  # the step did something
    assert acc["ratio_min"] == 1.0 == acc["ratio_max"]  # same micro-batches in both passes
    # Float32 GEMMs of other shapes sum in another order (OpenBLAS blocks by shape): allow
    # rounding relative to the update's size; a lost or doubled micro-batch is O(1) of it.
    scale = max(np.abs(d).max() for d in d_full.values())
    for k in d_full:
        np.testing.assert_allclose(d_acc[k], d_full[k], rtol=1e-5, atol=1e-5 * scale)


def test_correction_weights_by_hand():
    old = mx.log(mx.array([[3.0, 0.25, 1.0]]))
    behavior = mx.zeros((1, 3))
    mask = mx.ones((1, 3))
    w, s = correction_weights(old, behavior, mask, Correction("truncate", "token", 2.0))
    np.testing.assert_allclose(w, [[2.0, 0.25, 1.0]])
    assert s["is_cut_frac"].item() == pytest.approx(1 / 3) and s["is_ratio_max"].item() == pytest.approx(3.0)
    w, s = correction_weights(old, behavior, mask, Correction("mask", "token", 2.0))
    np.testing.assert_allclose(w, [[0.0, 0.0, 1.0]])
    assert s["is_cut_frac"].item() == pytest.approx(2 / 3)
    # sequence level: one weight, the product 3 * 0.25 * 1 = 0.75, inside [0.5, 2]
    w, s = correction_weights(old, behavior, mask, Correction("mask", "sequence", 2.0))
    np.testing.assert_allclose(w, [[0.75, 0.75, 0.75]], rtol=1e-6)
    assert s["is_cut_frac"].item() == 0.0
    w, _ = correction_weights(old, behavior, mask, Correction())
    np.testing.assert_allclose(w, [[1.0, 1.0, 1.0]])


@pytest.mark.parametrize(
    "mode,level", [("truncate", "token"), ("mask", "token"), ("truncate", "sequence"), ("mask", "sequence")]
)
def test_a_stale_actor_is_corrected(mode, level):
    """The actor samples with old weights W0 while the learner already holds W1."""
    model, tok = model_with()
    batch = sampled_batch(model, tok, temperature=0.7)  # behavior logprobs under W0
    trainer = trainer_for(model, temperature=0.7, optimizer=optim.Adam(learning_rate=1e-4))
    for _ in range(3):  # the learner moves on by three steps; the actor's batch is now stale
        trainer.step(trainer.prepare(batch), trainer.algorithm.advantages(REWARDS))
    off = trainer.prepare(batch)
    assert off.stats["mismatch_kl"] > 1e-3 and off.stats["is_cut_frac"] == 0.0  # gap shown, not cut
    corrected = trainer_for(model, temperature=0.7, correction=Correction(mode, level, CAP))
    on = corrected.prepare(batch)
    assert on.stats["is_cut_frac"] > 0
    w = np.concatenate([np.array(m.is_weight)[np.array(m.mask) > 0] for m in on.micro])
    if mode == "truncate":
        assert w.max() <= CAP + 1e-6
    else:
        assert 0 < (w == 0).sum() < w.size or level == "sequence"
        kept = w[w > 0]
        assert kept.size == 0 or (kept.min() >= 1 / CAP - 1e-6 and kept.max() <= CAP + 1e-6)
    stats = corrected.step(on, corrected.algorithm.advantages(REWARDS))
    assert np.isfinite(stats["loss"]) and np.isfinite(stats["grad_norm"])


def test_entropy_matches_a_numpy_computation():
    model, tok = model_with()
    batch = sampled_batch(model, tok, temperature=0.7)
    entropy = trainer_for(model, temperature=0.7).prepare(batch).stats["entropy"]
    logits = np.array(model(batch.tokens[:, :-1]), dtype=np.float64) / 0.7
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    per_position = -(np.exp(logp) * logp).sum(-1)
    mask = np.array(batch.mask)
    assert entropy == pytest.approx((per_position * mask).sum() / mask.sum(), rel=1e-5)
    assert 0 < entropy < np.log(len(tok.get_vocab()))


def test_trainer_runs_the_step_with_the_run_settings():
    """The Trainer is the step with the config's sections: the objective with its knobs,
    the correction, Adam at train.learning_rate, the temperature and micro-batches. It
    must move the adapters exactly as the step functions called by hand with them."""
    algorithm = AlgorithmConfig(name="dapo", epsilon=0.1, beta=0.04, is_correction="truncate", is_cap=CAP)
    train = TrainConfig(learning_rate=1e-2, max_grad_norm=0.5, micro_batch_size=3)
    sampling = SamplingConfig(temperature=0.7, max_tokens=6)
    model, tok = model_with()
    start = adapter_weights_numpy(model)
    batch = sampled_batch(model, tok, temperature=0.7)
    trainer = Trainer(model, algorithm, train, sampling)
    assert (trainer.algorithm.epsilon_low, trainer.algorithm.epsilon_high) == (0.1, 0.28)
    assert trainer.correction == Correction("truncate", "token", CAP)
    assert trainer.num_iterations == 1 and trainer.optimizer.learning_rate.item() == pytest.approx(1e-2)
    assert trainer.fused  # one step per batch: the old-policy pass is fused (train.fuse_old_logprobs)
    assert not Trainer(model, algorithm, TrainConfig(fuse_old_logprobs=False), sampling).fused
    assert not Trainer(model, AlgorithmConfig(num_iterations=2), train, sampling).fused
    advantages = trainer.algorithm.advantages(REWARDS)
    ours = trainer.step(trainer.prepare(batch), advantages)

    by_hand, _ = model_with(start)
    assert trainer.logits.head is not None  # train.logit_chunk_mb: 64 MB of logits of 57 tokens each
    assert trainer.logits.chunk == 64 * 2**20 // (4 * 57)
    logits = Logits(output_head(by_hand), trainer.logits.chunk)  # one chunk holds the batch: whole
    again = trainer_for(
        by_hand,
        "dapo",
        epsilon=0.1,
        beta=0.04,
        micro=3,
        fused=True,
        correction=Correction("truncate", "token", CAP),
        logits=logits,
        temperature=0.7,
        max_grad_norm=0.5,
    )
    theirs = again.step(again.prepare(batch), advantages)
    assert ours == theirs
    moved = adapter_weights_numpy(model)
    for k, v in adapter_weights_numpy(by_hand).items():
        np.testing.assert_array_equal(moved[k], v)
    assert max(np.abs(moved[k] - start[k]).max() for k in start) > 1e-4


@pytest.mark.parametrize(
    "name,mode,level,beta,micro",
    [
        ("grpo", "none", "token", 0.0, 0),
        ("dapo", "truncate", "token", 0.04, 3),
        ("gspo", "truncate", "sequence", 0.0, 3),
        ("dr_grpo", "mask", "token", 0.04, 0),
    ],
)
def test_fused_old_logprobs_give_the_same_update(name, mode, level, beta, micro):
    """With one step per batch the old-policy logprobs can come from the training forward
    (stop-gradient) instead of a pass of their own: the same update and the same metrics."""
    model, tok = model_with()
    start = perturbed(adapter_weights_numpy(model), 2, 0.01)  # a stale actor: the correction acts
    batch = sampled_batch(model, tok, temperature=0.7)
    correction = Correction(mode, level, CAP)
    results = []
    for fused in (False, True):
        m, _ = model_with(start)
        trainer = trainer_for(
            m,
            name,
            beta=beta,
            correction=correction,
            micro=micro,
            fused=fused,
            optimizer=optim.SGD(learning_rate=1.0),
            temperature=0.7,
            max_grad_norm=1e9,
            epsilon=0.1 if name == "gspo" else None,
        )
        prepared = trainer.prepare(batch)
        stats = trainer.step(prepared, trainer.algorithm.advantages(REWARDS))
        results.append(({**prepared.stats, **stats}, adapter_weights_numpy(m)))
    (sep, w_sep), (fus, w_fus) = results
    assert sep["mismatch_kl"] > 1e-4 and abs(sep["is_ratio_mean"] - 1.0) > 1e-3  # the weights act
    assert_same_update([sep], w_sep, [fus], w_fus, start, 1e-5)


def assert_same_update(
    stats_a: list[dict], weights_a: dict, stats_b: list[dict], weights_b: dict, start: dict, rel: float
) -> None:
    """Two ways of taking the same steps: the same metrics and adapters, to `rel`, and
    the adapters moved (so that the comparison means something)."""
    for a, b in zip(stats_a, stats_b, strict=True):
        assert set(a) == set(b)
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=rel, abs=1e-6), key
    moved = max(np.abs(weights_a[k] - start[k]).max() for k in start)
    assert moved > 1e-4
    for k in weights_a:
        np.testing.assert_allclose(weights_b[k], weights_a[k], rtol=rel, atol=rel * moved)


@pytest.mark.parametrize(
    "name,mode,level,beta,micro,fused,chunk",
    [
        ("grpo", "none", "token", 0.0, 0, True, 7),
        ("dapo", "truncate", "token", 0.04, 3, True, 16),
        ("gspo", "truncate", "sequence", 0.04, 3, False, 5),
        ("dr_grpo", "mask", "token", 0.04, 0, False, 1000),
    ],
)
def test_chunked_logits_give_the_same_updates(name, mode, level, beta, micro, fused, chunk):
    """Logits formed `chunk` positions at a time, the gradient taken through the jacobian
    into the last hidden states: the same metrics and adapters as with the whole logits in
    one differentiated forward, over two steps on the batch (the second off-policy)."""
    model, tok = model_with()
    start = perturbed(adapter_weights_numpy(model), 2, 0.01)
    batch = sampled_batch(model, tok, temperature=0.7)
    correction = Correction(mode, level, CAP)
    results = []
    for chunked in (False, True):
        m, _ = model_with(start)
        logits = Logits(output_head(m), chunk) if chunked else WHOLE
        assert logits.head is not None or not chunked
        trainer = trainer_for(
            m,
            name,
            beta=beta,
            correction=correction,
            micro=micro,
            fused=fused,
            logits=logits,
            temperature=0.7,
            max_grad_norm=1e9,
            optimizer=optim.SGD(learning_rate=1.0),  # the update is the gradient
            epsilon=0.1 if name == "gspo" else None,
        )
        prepared = trainer.prepare(batch)
        advantages = trainer.algorithm.advantages(REWARDS)
        steps = [trainer.step(prepared, advantages) for _ in range(1 if fused else 2)]
        results.append(([{**prepared.stats, **st} for st in steps], adapter_weights_numpy(m)))
    (whole, w_whole), (chunked, w_chunked) = results
    assert_same_update(whole, w_whole, chunked, w_chunked, start, 1e-4)


def test_logits_are_formed_whole_where_chunks_would_be_wrong():
    """A head with LoRA on it, or a random forward (dropout while training), has no
    chunked path: the trainer falls back to the whole logits rather than a wrong gradient."""
    model, _ = model_with()
    assert logits_plan(model, 64).head is not None and logits_plan(model, 0) is WHOLE
    assert Logits(output_head(model), 40).chunked(58) and not Logits(None, 40).chunked(58)
    assert not Logits(output_head(model), 58).chunked(58)
    mx.random.seed(0)
    trained_head, _ = model_with()
    trained_head.model.embed_tokens.unfreeze()  # tied: the output layer is the embedding
    assert logits_plan(trained_head, 64) is WHOLE
    dropout, _, _ = load_policy(str(TINY_MODEL), LoraConfig(rank=4, dropout=0.5))
    dropout.train()
    assert logits_plan(dropout, 64) is WHOLE
    dropout.eval()
    assert logits_plan(dropout, 64).head is not None


def test_micro_batch_rows_by_length_by_hand(monkeypatch):
    """Longest first, cut where the micro-batches cost least: their padded positions,
    each distinct prompt once, and FORWARD_POSITIONS (here 64) a forward; at most `size`
    rows."""
    from learner.batching import micro_batch_rows

    monkeypatch.setattr(batching, "FORWARD_POSITIONS", 64)
    positions = np.array([10, 2, 9, 1, 10, 30])
    # 30 alone (30 + 64), the rest together (5 * 10 + 64): 208. One micro-batch: 6 * 30 + 64
    # = 244; 30 | 10 10 9 | 2 1: 94 + 94 + 68 = 256.
    assert [r.tolist() for r in micro_batch_rows(positions, 0)] == [[5], [0, 1, 2, 3, 4]]
    # Two at most: 30 10 | 10 9 | 2 1 = 124 + 84 + 68 = 276; 30 | 10 10 | 9 2 | 1 = 325.
    assert [r.tolist() for r in micro_batch_rows(positions, 2)] == [[0, 5], [2, 4], [1, 3]]
    assert [r.tolist() for r in micro_batch_rows(positions, 4, by_length=False)] == [[0, 1, 2, 3], [4, 5]]
    assert [r.tolist() for r in micro_batch_rows(np.full(5, 7), 0)] == [[0, 1, 2, 3, 4]]
    # A shared prompt runs once per micro-batch that holds its rows: apart, 100 and 10 cost
    # (100 + 64) + (10 + 64) = 238 < 2 * 100 + 64; with one 50-token prompt, apart costs
    # 338 and together 2 * 100 + 50 + 64 = 314.
    assert [r.tolist() for r in micro_batch_rows(np.array([100, 10]), 0)] == [[0], [1]]
    shared = [(b"p", 50), (b"p", 50)]
    assert [r.tolist() for r in micro_batch_rows(np.array([100, 10]), 0, prompts=shared)] == [[0, 1]]


def test_micro_batch_rows_is_the_cheapest_cut_of_the_sorted_rows(monkeypatch):
    """Against every way to cut the sorted rows into runs (an independent reference)."""
    import itertools

    from learner.batching import micro_batch_rows

    monkeypatch.setattr(batching, "FORWARD_POSITIONS", 64)

    def cost(cuts, positions, prompts):
        return sum(len(c) * positions[c].max() + sum(dict(prompts[i] for i in c).values()) + 64 for c in cuts)

    rng = np.random.default_rng(0)
    for trial in range(40):
        n = int(rng.integers(1, 8))
        positions = np.minimum(rng.geometric(1 / 40, n), 300)
        prompts = [(bytes([int(k)]), 30 + 10 * int(k)) for k in rng.integers(0, 3, n)]
        size = int(rng.integers(0, n + 1))
        cap = size if 0 < size < n else n
        order = np.argsort(-positions, kind="stable")
        cheapest = min(
            cost([order[a:b] for a, b in zip((0, *ends), (*ends, n))], positions, prompts)
            for r in range(n)
            for ends in itertools.combinations(range(1, n), r)
            if all(b - a <= cap for a, b in zip((0, *ends), (*ends, n)))
        )
        cuts = micro_batch_rows(positions, size, prompts=prompts)
        assert sorted(np.concatenate(cuts).tolist()) == list(range(n))
        assert all(len(c) <= cap for c in cuts)
        assert cost(cuts, positions, prompts) == cheapest, (trial, positions, prompts, size)


MODES = {
    "padded": dict(sort_by_length=False, share_prompts=False),
    "by length": dict(sort_by_length=True, share_prompts=False),
    "shared prompts": dict(sort_by_length=True, share_prompts=True),
    "shared prompts, rows in order": dict(sort_by_length=False, share_prompts=True),
}


@pytest.mark.parametrize(
    "name,mode,level,beta,fused,micro",
    [
        ("grpo", "none", "token", 0.0, True, 0),
        ("dapo", "truncate", "token", 0.04, False, 3),
        ("gspo", "truncate", "sequence", 0.04, False, 0),
        ("dr_grpo", "mask", "token", 0.04, True, 2),
        ("cispo", "none", "token", 0.04, False, 0),
        ("sapo", "truncate", "token", 0.0, False, 3),
    ],
)
def test_micro_batches_by_length_and_shared_prompts_give_the_padded_update(
    name, mode, level, beta, fused, micro
):
    """Rows of similar length in micro-batches padded only to their own longest, and each
    group's prompt run once with its completions after it (a KV cache): the same metrics
    and adapters as the whole batch padded to its longest row, over two steps (the second
    off-policy), with episodes' loss masks and prompts of different lengths. The first
    step's ratio is exactly 1 in every mode."""
    model, tok = model_with()
    start = perturbed(adapter_weights_numpy(model), 3, 0.01)
    batch = sampled_batch(model, tok, temperature=0.7, episodes=True)
    assert len(set(batch.prompt_lengths.tolist())) == 2
    results = {}
    for label, settings in MODES.items():
        m, _ = model_with(start)
        trainer = trainer_for(
            m,
            name,
            beta=beta,
            correction=Correction(mode, level, CAP),
            fused=fused,
            optimizer=optim.SGD(learning_rate=0.1),
            temperature=0.7,
            max_grad_norm=1e9,
            epsilon=0.1 if name == "gspo" else None,
            max_tokens=12,
            micro=0 if label == "padded" else micro,
            **settings,
        )
        prepared = trainer.prepare(batch)
        advantages = trainer.algorithm.advantages(REWARDS)
        steps = [trainer.step(prepared, advantages) for _ in range(1 if fused else 2)]
        assert steps[0]["ratio_min"] == 1.0 == steps[0]["ratio_max"], label
        stats = [{**prepared.stats, **st} for st in steps]
        results[label] = (stats, adapter_weights_numpy(m), prepared, stats[0].pop("learner/padding_ratio"))
        for st in stats[1:]:
            st.pop("learner/padding_ratio", None)
    padded, w_padded, p_padded, ratio_padded = results["padded"]
    # The padding ratio by hand: computed positions over real ones (a row of n tokens: n - 1).
    real = sum(int(n) - 1 for n in batch.lengths)
    assert len(p_padded.micro) == 1 and ratio_padded == pytest.approx(8 * (batch.lengths.max() - 1) / real)
    assert ratio_padded > 1.4
    _, _, by_length, ratio = results["by length"]
    assert len(by_length.micro) > 2 and 1.0 <= ratio <= 1.1
    assert ratio == pytest.approx(sum(len(m.index) * (m.mask.shape[1]) for m in by_length.micro) / real)
    # Shared: each distinct prompt runs once, in its micro-batch or, when its rows went to
    # several, carried across them; then n x (C - 1) positions a micro-batch.
    _, _, shared, ratio = results["shared prompts"]
    prompts = {int(p) for p in batch.prompt_lengths}
    computed = sum(prompts) + sum(len(m.index) * (m.mask.shape[1] - 1) for m in shared.micro)
    assert ratio == pytest.approx(computed / real) and len(prompts) == 2
    assert shared.carried  # some group's rows went to several micro-batches
    assert ratio < 1.0
    for label in MODES:
        stats, weights, _, _ = results[label]
        # 2e-5: a sequence-level weight exponentiates a sum over the whole completion, and an
        # optimized BLAS (OpenBLAS) sums micro-batches in another order than the padded batch.
        assert_same_update(padded, w_padded, stats, weights, start, 2e-5)


def test_prompts_are_carried_across_micro_batches_only_where_forwards_repeat():
    """A group's rows cut apart by length: its prompt runs once for all its micro-batches
    (carried), but under LoRA dropout, where the state taken once and the differentiated
    forward after would draw two masks, every micro-batch runs its own prompts."""
    model, tok = model_with()
    batch = sampled_batch(model, tok)
    carried = trainer_for(model, "grpo").prepare(batch)
    assert carried.carried and any(m.carried for m in carried.micro)
    mx.random.seed(0)
    noisy, _, _ = load_policy(str(TINY_MODEL), LoraConfig(rank=4, scale=10.0, dropout=0.2))
    noisy.train()
    own = trainer_for(noisy, "grpo").prepare(batch)
    assert len(own.micro) > 1 and not own.carried and not any(m.carried for m in own.micro)
    prompts = sum(len(p) for m in own.micro for p in m.rows.prompts)
    assert prompts > sum(int(n) for n in set(batch.prompt_lengths.tolist()))  # some prompt runs twice


def test_carried_prompts_through_a_model_without_a_plain_head(monkeypatch):
    """A model whose output layer trains (or is not a plain projection) runs prompts
    through the whole model: a carried prompt's state then holds logits, not hidden
    states, and the update is still the one of every row with its own prompt."""
    monkeypatch.setattr(trainer_module, "output_head", lambda model: None)
    model, tok = model_with()
    start = perturbed(adapter_weights_numpy(model), 3, 0.01)
    batch = sampled_batch(model, tok)
    updates = {}
    for share in (False, True):
        m, _ = model_with(start)
        sgd = optim.SGD(learning_rate=1.0)
        trainer = trainer_for(m, "grpo", beta=0.04, optimizer=sgd, max_grad_norm=1e9, share_prompts=share)
        prepared = trainer.prepare(batch)
        assert trainer.head is None and bool(prepared.carried) == share
        trainer.step(prepared, trainer.algorithm.advantages(REWARDS))
        updates[share] = {k: v - start[k] for k, v in adapter_weights_numpy(m).items()}
    for k in start:
        scale = np.abs(updates[False][k]).max()
        np.testing.assert_allclose(updates[True][k], updates[False][k], atol=1e-5 * scale)
    assert max(np.abs(u).max() for u in updates[False].values()) > 0


def test_gspo_clip_fractions_are_merged_per_completion():
    """GSPO clips whole completions: clip_ratio/* are fractions of completions (TRL), so
    micro-batches of different token counts merge them by completions, and any cut of the
    batch gives the whole batch's fractions."""
    model, tok = model_with()
    start = perturbed(adapter_weights_numpy(model), 4, 0.01)
    batch = sampled_batch(model, tok, temperature=0.7)
    seen = []
    for micro, by_length in ((0, False), (3, False), (0, True), (2, True)):
        m, _ = model_with(start)
        trainer = trainer_for(
            m,
            "gspo",
            micro=micro,
            sort_by_length=by_length,
            temperature=0.7,
            optimizer=optim.SGD(learning_rate=1.0),
            max_grad_norm=1e9,
        )
        prepared = trainer.prepare(batch)
        advantages = trainer.algorithm.advantages(REWARDS)
        trainer.step(prepared, advantages)
        second = trainer.step(prepared, advantages)  # off the old policy: completions are clipped
        seen.append({k: v for k, v in second.items() if k.startswith("clip_ratio/")})
    assert 0 < seen[0]["clip_ratio/region_mean"] < 1
    for other in seen[1:]:
        for key, value in seen[0].items():
            assert other[key] == pytest.approx(value, abs=1e-6), key


def test_a_stop_between_micro_batches_ends_the_step_and_changes_nothing():
    """Trainer.stopping is asked before each micro-batch: asked to stop after the first, the
    step raises StepStopped, and the adapters and the optimizer state are as before it."""
    from learner.trainer import StepStopped

    model, tok = model_with()
    batch = sampled_batch(model, tok)
    trainer = trainer_for(model)
    prepared = trainer.prepare(batch)
    assert len(prepared.micro) > 1
    trainer.step(prepared, np.ones(len(batch.lengths), np.float32))  # the optimizer has state now
    before = adapter_weights_numpy(model)
    state = {k: np.array(v) for k, v in tree_flatten(trainer.optimizer.state)}
    asked = []
    trainer.stopping = lambda: asked.append(1) or len(asked) > 1
    with pytest.raises(StepStopped):
        trainer.step(prepared, np.ones(len(batch.lengths), np.float32))
    assert len(asked) == 2  # the first micro-batch ran, the second was never started
    after = adapter_weights_numpy(model)
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert all(
        np.array_equal(v, np.array(dict(tree_flatten(trainer.optimizer.state))[k])) for k, v in state.items()
    )
    trainer.stopping = lambda: True
    with pytest.raises(StepStopped):
        trainer.prepare(batch)  # the old-policy passes stop too

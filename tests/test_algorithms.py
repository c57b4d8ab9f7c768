"""GRPO: hand-computed toy cases and an independent NumPy reference."""

import mlx.core as mx
import numpy as np
import pytest

from learner.algorithms import GRPO, LossInputs, make_algorithm


def loss_and_grad(alg, logp, old, ref, adv, mask):
    def f(lp):
        return alg.loss(LossInputs(lp, mx.array(old), None if ref is None else mx.array(ref),
                                   mx.array(adv), mx.array(mask)))[0]
    loss, grad = mx.value_and_grad(f)(mx.array(logp))
    return float(loss.item()), np.array(grad)


def test_grpo_advantages_by_hand():
    # Group [1, 0, 0, 1]: mean .5, sample std sqrt(1/3); group [2, 2, 2, 2]: all equal.
    adv = GRPO().advantages(np.array([[1.0, 0, 0, 1], [2.0, 2, 2, 2]]))
    a = 0.5 / (np.sqrt(1 / 3) + 1e-4)
    np.testing.assert_allclose(adv, [a, -a, -a, a, 0, 0, 0, 0], rtol=1e-6)


def test_uniform_rewards_give_zero_advantage_and_zero_gradient():
    alg = GRPO()
    adv = alg.advantages(np.full((2, 4), 0.7))
    assert np.all(adv == 0) and np.all(np.isfinite(adv))
    logp = np.log(np.full((8, 3), 0.3, dtype=np.float32))
    loss, grad = loss_and_grad(alg, logp, logp, None, adv.astype(np.float32), np.ones((8, 3), np.float32))
    assert loss == 0.0 and np.all(grad == 0)


def test_grpo_loss_and_gradient_by_hand():
    """Two completions, epsilon 0.2. Row 0: A=+1, ratios 1.5 (clipped) and 0.9. Row 1:
    A=-1, ratio 0.5 (clipped), second token masked out.
    per-token loss: row 0 [-1.2, -0.9] -> mean -1.05; row 1 [0.8] -> 0.8; loss -0.125.
    d loss / d logp: only row 0 token 1 is unclipped: -A*r / len / B = -0.9 / 2 / 2."""
    old = np.zeros((2, 2), np.float32)
    logp = np.log(np.array([[1.5, 0.9], [0.5, 1.1]], np.float32))
    mask = np.array([[1, 1], [1, 0]], np.float32)
    alg = GRPO(epsilon=0.2)
    loss, grad = loss_and_grad(alg, logp, old, None, np.array([1.0, -1.0], np.float32), mask)
    assert loss == pytest.approx(-0.125, abs=1e-6)
    np.testing.assert_allclose(grad, [[0, -0.225], [0, 0]], atol=1e-6)
    _, extra = alg.loss(LossInputs(mx.array(logp), mx.array(old), None,
                                   mx.array([1.0, -1.0]), mx.array(mask)))
    assert float(extra["clip_frac"].item()) == pytest.approx(2 / 3)


def test_k3_kl_by_hand():
    """ref - logp = log 2 on every token: k3 = 2 - log 2 - 1 = 0.30685; with beta 0.5 and
    zero advantages the loss is 0.5 * 0.30685."""
    logp = np.log(np.full((1, 2), 0.25, np.float32))
    ref = np.log(np.full((1, 2), 0.5, np.float32))
    alg = GRPO(beta=0.5)
    loss, grad = loss_and_grad(alg, logp, logp, ref, np.zeros(1, np.float32), np.ones((1, 2), np.float32))
    assert loss == pytest.approx(0.5 * (1 - np.log(2)), abs=1e-6)
    # d k3 / d logp = 1 - exp(ref - logp) = -1, times beta and 1/len(2).
    np.testing.assert_allclose(grad, [[-0.25, -0.25]], atol=1e-6)


def numpy_grpo(logp, old, ref, adv, mask, eps, beta):
    """GRPO (TRL) written from the formulas, with its analytic gradient."""
    r = np.exp(logp - old)
    a = adv[:, None]
    unclipped = r * a
    clipped = np.clip(r, 1 - eps, 1 + eps) * a
    per_token = -np.minimum(unclipped, clipped)
    d_per_token = np.where(unclipped <= clipped, -unclipped, 0.0)  # d/dlogp of -r*a is -r*a
    if beta:
        d = ref - logp
        per_token = per_token + beta * (np.exp(d) - d - 1)
        d_per_token = d_per_token + beta * (1 - np.exp(d))
    lens = np.maximum(mask.sum(1, keepdims=True), 1)
    b = len(logp)
    loss = ((per_token * mask).sum(1) / lens[:, 0]).mean()
    return loss, d_per_token * mask / lens / b


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_grpo_matches_numpy_reference_on_ragged_batches(beta):
    rng = np.random.default_rng(0)
    for _ in range(5):
        b, t = 6, 7
        old = rng.normal(-2, 0.5, (b, t)).astype(np.float32)
        logp = (old + rng.normal(0, 0.3, (b, t))).astype(np.float32)
        ref = (old + rng.normal(0, 0.3, (b, t))).astype(np.float32)
        lens = rng.integers(1, t + 1, b)
        mask = (np.arange(t)[None] < lens[:, None]).astype(np.float32)
        adv = GRPO().advantages(rng.random((2, 3))).astype(np.float32)
        alg = make_algorithm("grpo", epsilon=0.2, beta=beta)
        loss, grad = loss_and_grad(alg, logp, old, ref if beta else None, adv, mask)
        ref_loss, ref_grad = numpy_grpo(logp.astype(np.float64), old, ref, adv, mask, 0.2, beta)
        assert loss == pytest.approx(ref_loss, abs=1e-5)
        np.testing.assert_allclose(grad, ref_grad, atol=1e-5)


def test_unknown_algorithm_is_named():
    with pytest.raises(ValueError, match="unknown algorithm 'ppo'"):
        make_algorithm("ppo", 0.2, 0.0)

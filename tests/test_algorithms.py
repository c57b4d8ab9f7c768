"""The GRPO family: hand-computed toy cases, degenerate cases, and an independent NumPy
reference written from the published formulas (gradients by finite differences)."""

import mlx.core as mx
import numpy as np
import pytest

from learner.algorithms import ALGORITHMS, GRPO, LossInputs, algorithms_table, make_algorithm
from runtime.config import ALGORITHM_NAMES, AlgorithmConfig
from tests.helpers import ROOT


def loss_and_grad(alg, logp, old, adv, mask, ref=None, is_weight=None):
    """The loss as the learner computes it (sum / whole-batch normaliser) and d loss/d logp."""
    norm = alg.normalizer(np.asarray(mask))
    w = np.ones_like(logp) if is_weight is None else is_weight

    def f(lp):
        x = LossInputs(
            lp,
            mx.array(old),
            None if ref is None else mx.array(ref),
            mx.array(adv),
            mx.array(mask),
            mx.array(w),
        )
        return alg.loss_sum(x)[0] / norm

    loss, grad = mx.value_and_grad(f)(mx.array(logp))
    return float(loss.item()), np.array(grad)


def diagnostics(alg, logp, old, adv, mask):
    x = LossInputs(mx.array(logp), mx.array(old), None, mx.array(adv), mx.array(mask), mx.ones(logp.shape))
    return {k: float(v.item()) for k, v in alg.loss_sum(x)[1].items()}


def SIG(z):
    return 1 / (1 + np.exp(-z))


def DSIG(z):
    return SIG(z) * (1 - SIG(z))


# The toy batch: two completions. Row 0: A = +1, ratios 1.5 and 0.9. Row 1: A = -1,
# ratio 0.5, its second position is padding.
OLD = np.zeros((2, 2), np.float32)
LOGP = np.log(np.array([[1.5, 0.9], [0.5, 1.1]], np.float32))
MASK = np.array([[1, 1], [1, 0]], np.float32)
ADV = np.array([1.0, -1.0], np.float32)


@pytest.mark.parametrize(
    "name,kwargs,loss,grad",
    [
        # per-token: row 0 [-1.2 (clipped), -0.9], row 1 [+0.8 (clipped)]
        ("grpo", {}, (-1.05 + 0.8) / 2, [[0, -0.9 / 2 / 2], [0, 0]]),  # mean per row, then rows
        ("bnpo", {}, (-1.2 - 0.9 + 0.8) / 3, [[0, -0.9 / 3], [0, 0]]),  # over the batch's 3 tokens
        ("dapo", {}, (-1.28 - 0.9 + 0.8) / 3, [[0, -0.9 / 3], [0, 0]]),  # upper clip at 1.28
        ("dr_grpo", {"max_tokens": 4}, (-1.2 - 0.9 + 0.8) / 8, [[0, -0.9 / 8], [0, 0]]),  # 2 rows x 4
        ("rloo", {}, (-1.05 + 0.8) / 2, [[0, -0.9 / 2 / 2], [0, 0]]),  # GRPO's loss, own advantages
        # sequence ratio s0 = sqrt(1.5 * 0.9) = 1.16190 (inside [0.8, 1.2]), s1 = 0.5 (clipped):
        # loss (-s0 + 0.8) / 2; d/dlogp_t of -s0 = -s0 / 2 per token, then / 2 rows.
        (
            "gspo",
            {"epsilon": 0.2},
            (-np.sqrt(1.35) + 0.8) / 2,
            [[-np.sqrt(1.35) / 4, -np.sqrt(1.35) / 4], [0, 0]],
        ),
        # CISPO: -sg(min(r, eh)) * A * logp over the batch's 3 tokens; eh 5 caps nothing, the
        # gradient is -w * A / 3 (the weight is detached).
        (
            "cispo",
            {},
            (-1.5 * np.log(1.5) - 0.9 * np.log(0.9) + 0.5 * np.log(0.5)) / 3,
            [[-1.5 / 3, -0.9 / 3], [0.5 / 3, 0]],
        ),
        # eh 1.2 caps row 0's first weight at 1.2.
        (
            "cispo",
            {"epsilon_high": 1.2},
            (-1.2 * np.log(1.5) - 0.9 * np.log(0.9) + 0.5 * np.log(0.5)) / 3,
            [[-1.2 / 3, -0.9 / 3], [0.5 / 3, 0]],
        ),
        # SAPO: -sigmoid(tau (r - 1)) 4 / tau * A, tau 1 (A > 0), 1.05 (A < 0); mean per row, then
        # rows. Its slope in logp: -4 sigmoid'(tau (r - 1)) r A.
        (
            "sapo",
            {},
            ((-4 * SIG(0.5) - 4 * SIG(-0.1)) / 2 + 4 / 1.05 * SIG(-0.525)) / 2,
            [[-4 * DSIG(0.5) * 1.5 / 4, -4 * DSIG(-0.1) * 0.9 / 4], [4 * DSIG(-0.525) * 0.5 / 2, 0]],
        ),
    ],
)
def test_toy_loss_and_gradient_by_hand(name, kwargs, loss, grad):
    alg = make_algorithm(name, **{"epsilon": None, **kwargs})
    got_loss, got_grad = loss_and_grad(alg, LOGP, OLD, ADV, MASK)
    assert got_loss == pytest.approx(loss, abs=1e-6)
    np.testing.assert_allclose(got_grad, grad, atol=1e-6)


def test_clip_fractions_low_and_high_by_hand():
    d = diagnostics(make_algorithm("grpo"), LOGP, OLD, ADV, MASK)
    # row 0 token 0: ratio 1.5 > 1.2 with A > 0 (high); row 1: 0.5 < 0.8 with A < 0 (low)
    assert d["clip_ratio/high_mean"] == pytest.approx(1 / 3)
    assert d["clip_ratio/low_mean"] == pytest.approx(1 / 3)
    assert d["clip_ratio/region_mean"] == pytest.approx(2 / 3)
    # per completion: high-clipped 1/2 (row 0) and 0 (row 1); low-clipped 0 and 1
    assert d["clip_ratio/high_max"] == pytest.approx(1 / 2) and d["clip_ratio/low_min"] == 0.0
    assert d["ratio_max"] == pytest.approx(1.5) and d["ratio_min"] == pytest.approx(0.5)


def test_cispo_clip_ratio_by_hand():
    # TRL's cispo_clip_ratio: tokens with A > 0 whose ratio passed eh. At 1.2: row 0's 1.5.
    capped = diagnostics(make_algorithm("cispo", epsilon_high=1.2), LOGP, OLD, ADV, MASK)
    assert capped["cispo_clip_ratio"] == pytest.approx(1 / 3)
    assert diagnostics(make_algorithm("cispo"), LOGP, OLD, ADV, MASK)["cispo_clip_ratio"] == 0.0
    assert make_algorithm("cispo", epsilon=0.1).epsilon_high == 5.0  # ScaleRL's cap, as TRL recommends
    sapo = make_algorithm("sapo", sapo_temperatures=(0.5, 2.0))
    assert (sapo.temperature_pos, sapo.temperature_neg) == (0.5, 2.0)


def test_sequence_level_clip_fractions_count_completions_as_trl_does():
    # GSPO, epsilon 0.2: s0 = sqrt(1.35) = 1.16 is inside, s1 = 0.5 < 0.8 with A < 0 is
    # clipped below: one completion of two (TRL's region_mean for a sequence-level ratio),
    # not one token of three.
    d = diagnostics(make_algorithm("gspo", epsilon=0.2), LOGP, OLD, ADV, MASK)
    assert d["clip_ratio/low_mean"] == pytest.approx(1 / 2) == d["clip_ratio/region_mean"]
    assert d["clip_ratio/high_mean"] == 0.0 and d["clip_ratio/low_min"] == 0.0


@pytest.mark.parametrize("name", ["grpo", "dapo", "dr_grpo"])
def test_an_unscorable_completion_follows_trl_s_rule(name):
    """Rewards [1, 0, unscorable, 1]: TRL leaves the unscorable one out of the group's
    mean (2/3) and sample std (sqrt(1/3)) and gives it advantage 0. By hand."""
    alg = make_algorithm(name)
    got = alg.advantages(np.array([[1.0, 0.0, np.nan, 1.0], [0.0, 0.0, 1.0, 1.0]]))
    std = np.sqrt(1 / 3) + 1e-4 if alg.scale_rewards == "group" else 1.0
    np.testing.assert_allclose(got[:4], [1 / 3 / std, -2 / 3 / std, 0.0, 1 / 3 / std], rtol=1e-6)
    assert alg.keep_group(np.array([1.0, 0.0, np.nan, 1.0]))
    # one scored completion: no signal (advantage 0), and dynamic sampling drops the group
    np.testing.assert_array_equal(alg.advantages(np.array([[np.nan, 1.0, np.nan, np.nan]])), 0.0)
    assert alg.keep_group(np.array([np.nan, 1.0, np.nan, np.nan])) == (name != "dapo")


def test_k3_kl_by_hand():
    """ref - logp = log 2 on every token: k3 = 2 - log 2 - 1; beta 0.5, zero advantages."""
    logp = np.log(np.full((1, 2), 0.25, np.float32))
    ref = np.log(np.full((1, 2), 0.5, np.float32))
    loss, grad = loss_and_grad(
        GRPO(beta=0.5), logp, logp, np.zeros(1, np.float32), np.ones((1, 2), np.float32), ref=ref
    )
    assert loss == pytest.approx(0.5 * (1 - np.log(2)), abs=1e-6)
    # d k3 / d logp = 1 - exp(ref - logp) = -1, times beta and 1/len(2).
    np.testing.assert_allclose(grad, [[-0.25, -0.25]], atol=1e-6)


def test_advantages_by_hand():
    rewards = np.array([[1.0, 0, 0, 1], [2.0, 2, 2, 3]])
    # group 1: mean .5, sample std sqrt(1/3); group 2: mean 2.25, sample std 0.5
    a, s2 = 0.5 / (np.sqrt(1 / 3) + 1e-4), 0.5 + 1e-4
    np.testing.assert_allclose(
        make_algorithm("grpo").advantages(rewards),
        [a, -a, -a, a, -0.25 / s2, -0.25 / s2, -0.25 / s2, 0.75 / s2],
        rtol=1e-6,
    )
    # RLOO: r_i minus the mean of the other three: 1 - 1/3, 0 - 2/3, ...; 2 - 7/3, 3 - 2
    np.testing.assert_allclose(
        make_algorithm("rloo").advantages(rewards),
        [2 / 3, -2 / 3, -2 / 3, 2 / 3, -1 / 3, -1 / 3, -1 / 3, 1],
        rtol=1e-6,
    )
    batch_std = rewards.std(ddof=1)
    centered = rewards - rewards.mean(axis=1, keepdims=True)
    np.testing.assert_allclose(
        make_algorithm("grpo", scale_rewards="batch").advantages(rewards),
        (centered / (batch_std + 1e-4)).reshape(-1),
        rtol=1e-6,
    )


def test_grpo_without_scaling_equals_dr_grpo_advantages():
    rewards = np.random.default_rng(1).random((3, 5))
    np.testing.assert_array_equal(
        make_algorithm("grpo", scale_rewards="none").advantages(rewards),
        make_algorithm("dr_grpo").advantages(rewards),
    )


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_uniform_rewards_give_zero_advantages_and_zero_gradient(name):
    alg = make_algorithm(name, max_tokens=3)
    adv = alg.advantages(np.full((2, 4), 0.7))
    assert np.all(adv == 0) and np.all(np.isfinite(adv))
    logp = np.log(np.full((8, 3), 0.3, np.float32))
    loss, grad = loss_and_grad(alg, logp, logp - 0.01, adv.astype(np.float32), np.ones((8, 3), np.float32))
    # row 0: W = e^20, phi = e^(3 + 40 - 3 e^20) = 0; row 1: W = 1e-8 (the floor), phi ~ e^-53
    assert abs(loss) < 1e-20 and np.all(np.isfinite(grad)) and np.abs(grad).max() < 1e-20


def test_dapo_filters_groups_without_reward_variance():
    dapo, grpo = make_algorithm("dapo"), make_algorithm("grpo")
    assert not dapo.keep_group(np.array([1.0, 1.0, 1.0]))
    assert dapo.keep_group(np.array([1.0, 0.0, 1.0]))
    assert grpo.keep_group(np.array([1.0, 1.0, 1.0]))


def test_epsilon_defaults_and_overrides():
    assert (make_algorithm("dapo").epsilon_low, make_algorithm("dapo").epsilon_high) == (0.2, 0.28)
    assert make_algorithm("dapo", epsilon=0.1).epsilon_high == 0.28  # asymmetric by design
    assert make_algorithm("grpo", epsilon=0.1).epsilon_high == 0.1
    assert make_algorithm("gspo").epsilon_low == 3e-4
    assert make_algorithm("grpo", epsilon_high=0.5).epsilon_high == 0.5


def numpy_loss(name, logp, old, ref, adv, mask, el, eh, beta, max_tokens, w, frozen=None):
    """The objectives from their papers / TRL's docs, in float64 NumPy. `frozen`: the
    logprobs CISPO's and VESPO's detached weights are taken at (default `logp`)."""
    lens = mask.sum(1, keepdims=True)
    if name in ("gspo", "luspo"):
        r = np.exp(((logp - old) * mask).sum(1, keepdims=True) / lens) * np.ones_like(logp)
    else:
        r = np.exp(logp - old)
    a = adv[:, None]
    if name == "cispo":
        weight = np.minimum(np.exp((logp if frozen is None else frozen) - old), eh)
        per_token = -weight * a * logp * w
    elif name == "vespo":  # VESPO's detached phi of the sequence ratio, the behavior weights inside
        at = logp if frozen is None else frozen
        floor = np.log(1e-8)
        log_w = (np.clip(at - old, -20, 20) * mask).sum(1, keepdims=True)
        log_w = np.clip(log_w + (np.clip(np.log(w), floor, 20) * mask).sum(1, keepdims=True), floor, 20)
        k, lam = np.where(a >= 0, 2.0, 3.0), np.where(a >= 0, 3.0, 2.0)
        per_token = -np.exp(lam + k * log_w - lam * np.exp(log_w)) * a * logp
    elif name == "sapo":
        tau = np.where(a > 0, 1.0, 1.05)
        per_token = -SIG(tau * (r - 1)) * 4 / tau * a * w
    else:
        per_token = -np.minimum(r * a, np.clip(r, 1 - el, 1 + eh) * a) * w
    if beta:
        per_token = per_token + beta * (np.exp(ref - logp) - (ref - logp) - 1)
    if name in ("grpo", "rloo", "gspo", "sapo"):
        return ((per_token * mask).sum(1) / lens[:, 0]).mean()
    if name in ("bnpo", "dapo", "cispo", "vespo"):
        return (per_token * mask).sum() / mask.sum()
    if name == "luspo":  # each completion's mean times its length, over completions
        return ((per_token * mask).sum(1) / lens[:, 0] * lens[:, 0]).mean()
    return (per_token * mask).sum() / (len(logp) * max_tokens)  # dr_grpo


def numeric_grad(f, x, h=1e-6):
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[i] = h
        g[i] = (f(x + e) - f(x - e)) / (2 * h)
    return g


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_matches_numpy_reference_on_ragged_batches(name, beta):
    # A seed per case that is the same in every process (hash() of a str is salted).
    rng = np.random.default_rng([sorted(ALGORITHMS).index(name), int(beta * 100)])
    for _ in range(3):
        b, t = 6, 7
        old = rng.normal(-2, 0.5, (b, t))
        logp = old + rng.normal(0, 0.15, (b, t))
        ref = old + rng.normal(0, 0.3, (b, t))
        w = rng.uniform(0.5, 1.5, (b, t))
        lens = rng.integers(1, t + 1, b)
        mask = (np.arange(t)[None] < lens[:, None]).astype(np.float64)
        alg = make_algorithm(name, beta=beta, max_tokens=t, epsilon=0.1 if name == "gspo" else None)
        adv = alg.advantages(rng.random((2, 3)))
        loss, grad = loss_and_grad(
            alg,
            logp.astype(np.float32),
            old.astype(np.float32),
            adv.astype(np.float32),
            mask.astype(np.float32),
            ref=ref.astype(np.float32) if beta else None,
            is_weight=w.astype(np.float32),
        )
        args = (old, ref, adv, mask, alg.epsilon_low, alg.epsilon_high, beta, t, w)
        assert loss == pytest.approx(numpy_loss(name, logp, *args), abs=1e-5)
        ref_grad = numeric_grad(lambda lp, args=args, at=logp: numpy_loss(name, lp, *args, frozen=at), logp)
        np.testing.assert_allclose(grad, ref_grad, atol=1e-5)


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="unknown algorithm 'ppo'"):
        make_algorithm("ppo")
    with pytest.raises(ValueError, match="scale_rewards"):
        make_algorithm("grpo", scale_rewards="sometimes")


# -- luspo and vespo, TRL's `loss_type`s of those names ------------------------------------------


def test_luspo_by_hand():
    """LUSPO, clip 0.2 as in the GSPO case above: sequence ratios s0 = sqrt(1.5 * 0.9) =
    sqrt(1.35) (inside [0.8, 1.2]) and s1 = 0.5 (clipped, A < 0: its term is 0.8). Each
    completion's term times its length (2 and 1), over the 2 completions:
    (2 * -s0 + 1 * 0.8) / 2. d/dlogp_t of -2 s0 / 2 = -s0 / 2 (ds0/dlogp_t = s0 / 2); row 1
    is clipped, no gradient."""
    alg = make_algorithm("luspo", epsilon=0.2)
    assert alg.normalizer(MASK) == 2.0  # completions, not tokens
    loss, grad = loss_and_grad(alg, LOGP, OLD, ADV, MASK)
    s0 = np.sqrt(1.35)
    assert loss == pytest.approx((-2 * s0 + 0.8) / 2, abs=1e-6)
    np.testing.assert_allclose(grad, [[-s0 / 2, -s0 / 2], [0, 0]], atol=1e-6)
    # Its default clip range, the paper's 2e-3 / 2.5e-3: both completions clipped, so
    # (2 * -1.0025 + 1 * 0.998) / 2 and no gradient at all.
    default = make_algorithm("luspo")
    assert (default.epsilon_low, default.epsilon_high) == (2e-3, 2.5e-3)
    loss, grad = loss_and_grad(default, LOGP, OLD, ADV, MASK)
    assert loss == pytest.approx((-2 * 1.0025 + 0.998) / 2, abs=1e-6)
    assert np.all(grad == 0)
    d = diagnostics(alg, LOGP, OLD, ADV, MASK)  # GSPO's clip fractions: of completions
    assert d["clip_ratio/low_mean"] == pytest.approx(1 / 2) and d["clip_ratio/high_mean"] == 0.0


def test_luspo_is_gspo_times_the_length_when_completions_are_equally_long():
    rng = np.random.default_rng(3)
    old = rng.normal(-2, 0.5, (4, 5)).astype(np.float32)
    logp = (old + rng.normal(0, 0.05, old.shape)).astype(np.float32)
    mask, adv = np.ones((4, 5), np.float32), np.array([1.0, -0.5, 2.0, -1.5], np.float32)
    gspo, _ = loss_and_grad(make_algorithm("gspo", epsilon=0.1), logp, old, adv, mask)
    luspo, _ = loss_and_grad(make_algorithm("luspo", epsilon=0.1), logp, old, adv, mask)
    assert luspo == pytest.approx(5 * gspo, rel=1e-6)


def vespo_phi(w, k, lam):
    return w**k * np.exp(lam * (1 - w))


def test_vespo_by_hand():
    """VESPO: W is the product of a completion's token ratios (not GSPO's mean): W0 = 1.5 *
    0.9 = 1.35 with A = +1 (k 2, lambda 3), W1 = 0.5 with A = -1 (k 3, lambda 2).
    phi(W) = W^k e^(lambda (1 - W)): phi0 = 1.35^2 e^(-1.05) = 0.637762, phi1 = 0.125 e =
    0.339785. The loss -phi * A * logp over the batch's 3 tokens:
    (-phi0 (log 1.5 + log 0.9) + phi1 log 0.5) / 3 = -0.142305; phi is detached, so the
    gradient is -phi * A / 3 on each token: no clip takes a token out."""
    alg = make_algorithm("vespo")
    assert alg.normalizer(MASK) == 3.0  # tokens, as BNPO / DAPO
    phi0, phi1 = vespo_phi(1.35, 2, 3), vespo_phi(0.5, 3, 2)
    assert phi0 == pytest.approx(0.637762, abs=1e-6) and phi1 == pytest.approx(0.339785, abs=1e-6)
    loss, grad = loss_and_grad(alg, LOGP, OLD, ADV, MASK)
    assert loss == pytest.approx(-0.142305, abs=1e-6)
    assert loss == pytest.approx((-phi0 * np.log(1.35) + phi1 * np.log(0.5)) / 3, abs=1e-6)
    np.testing.assert_allclose(grad, [[-phi0 / 3, -phi0 / 3], [phi1 / 3, 0]], atol=1e-6)
    d = diagnostics(alg, LOGP, OLD, ADV, MASK)
    assert d["vespo/phi_seq_mean"] == pytest.approx((phi0 + phi1) / 2, abs=1e-6)  # over completions
    assert d["ratio_max"] == pytest.approx(1.5)  # the token ratios, as for cispo and sapo
    assert "clip_ratio/region_mean" not in d  # nothing is clipped


def test_vespo_settings_and_the_sign_rule():
    """k and lambda from the [algorithm] keys, TRL's names; A = 0 takes the positive pair
    (TRL: A >= 0). Row 0 with A = 0 and k_pos 1, lambda_pos 0.5: phi = 1.35 e^(-0.175)."""
    alg = make_algorithm(
        "vespo", vespo_k_pos=1.0, vespo_lambda_pos=0.5, vespo_k_neg=4.0, vespo_lambda_neg=1.0
    )
    assert (alg.k_pos, alg.lambda_pos, alg.k_neg, alg.lambda_neg) == (1.0, 0.5, 4.0, 1.0)
    default = make_algorithm("vespo")
    assert (default.k_pos, default.lambda_pos, default.k_neg, default.lambda_neg) == (2.0, 3.0, 3.0, 2.0)
    d = diagnostics(alg, LOGP, OLD, np.array([0.0, -1.0], np.float32), MASK)
    phi0, phi1 = 1.35 * np.exp(-0.175), 0.5**4 * np.exp(0.5)
    assert d["vespo/phi_seq_mean"] == pytest.approx((phi0 + phi1) / 2, abs=1e-6)


def test_vespo_takes_the_behavior_weights_into_its_sequence_ratio():
    """The correction weights pi_old / pi_behavior are not a factor of VESPO's terms (TRL:
    `loss_type != "vespo"`) but go into W. Per token [[2, 0.5], [0.25, pad]]: W0 = 1.35 *
    2 * 0.5 = 1.35 (phi0 unchanged), W1 = 0.5 * 0.25 = 0.125 (phi1 = 0.125^3 e^1.75).
    Per completion (`is_level = "sequence"`, one weight repeated on its tokens) [[1.2, 1.2],
    [0.5, pad]]: W0 = 1.35 * 1.2 (once, not per token), W1 = 0.5 * 0.5."""
    token = np.array([[2.0, 0.5], [0.25, 0.0]], np.float32)
    loss, grad = loss_and_grad(make_algorithm("vespo"), LOGP, OLD, ADV, MASK, is_weight=token)
    phi0, phi1 = vespo_phi(1.35, 2, 3), vespo_phi(0.125, 3, 2)
    assert loss == pytest.approx((-phi0 * np.log(1.35) + phi1 * np.log(0.5)) / 3, abs=1e-6)
    np.testing.assert_allclose(grad, [[-phi0 / 3, -phi0 / 3], [phi1 / 3, 0]], atol=1e-6)

    sequence = np.array([[1.2, 1.2], [0.5, 0.0]], np.float32)
    alg = make_algorithm("vespo", is_level="sequence")
    loss, grad = loss_and_grad(alg, LOGP, OLD, ADV, MASK, is_weight=sequence)
    phi0, phi1 = vespo_phi(1.35 * 1.2, 2, 3), vespo_phi(0.25, 3, 2)
    assert loss == pytest.approx((-phi0 * np.log(1.35) + phi1 * np.log(0.5)) / 3, abs=1e-6)
    np.testing.assert_allclose(grad, [[-phi0 / 3, -phi0 / 3], [phi1 / 3, 0]], atol=1e-6)


def test_vespo_masked_and_extreme_ratios_give_a_weight_of_nothing_not_nan():
    """A token the `mask` correction dropped (weight 0) floors its log weight at log 1e-8, as
    TRL does: W ~ 5e-9, phi ~ 0, the completion drops out. Ratios of e^50 and e^-50 are
    capped at e^+-20: phi underflows to 0, never inf or NaN."""
    masked = np.array([[1.0, 1.0], [0.0, 0.0]], np.float32)
    loss, grad = loss_and_grad(make_algorithm("vespo"), LOGP, OLD, ADV, MASK, is_weight=masked)
    phi0 = vespo_phi(1.35, 2, 3)
    assert loss == pytest.approx(-phi0 * np.log(1.35) / 3, abs=1e-6)
    assert abs(grad[1, 0]) < 1e-12
    far = np.array([[50.0, 0.0], [-50.0, 0.0]], np.float32) - 3.0
    loss, grad = loss_and_grad(make_algorithm("vespo"), far, np.full_like(far, -3.0), ADV, MASK)
    # row 0: W = e^20, phi = e^(3 + 40 - 3 e^20) = 0; row 1: W = 1e-8 (the floor), phi ~ e^-53
    assert abs(loss) < 1e-20 and np.all(np.isfinite(grad)) and np.abs(grad).max() < 1e-20


@pytest.mark.parametrize("name", ["luspo", "vespo"])
def test_new_losses_match_the_numpy_reference_with_a_live_clip(name):
    """The ragged-batch reference above, for the two with a clip range set where it acts
    on some completions and not others (LUSPO's default clips nearly all here)."""
    rng = np.random.default_rng(8)  # two of six completions clipped at 0.05
    b, t = 6, 7
    old = rng.normal(-2, 0.5, (b, t))
    logp = old + rng.normal(0, 0.1, (b, t))
    ref = old + rng.normal(0, 0.3, (b, t))
    w = rng.uniform(0.8, 1.2, (b, t))
    mask = (np.arange(t)[None] < rng.integers(1, t + 1, b)[:, None]).astype(np.float64)
    alg = make_algorithm(name, beta=0.04, epsilon=0.05)
    adv = alg.advantages(rng.random((2, 3)))
    loss, grad = loss_and_grad(
        alg, *(a.astype(np.float32) for a in (logp, old, adv, mask)), ref=ref.astype(np.float32), is_weight=w
    )
    args = (old, ref, adv, mask, 0.05, 0.05, 0.04, t, w)
    assert loss == pytest.approx(numpy_loss(name, logp, *args), abs=1e-5)
    ref_grad = numeric_grad(lambda lp: numpy_loss(name, lp, *args, frozen=logp), logp)
    np.testing.assert_allclose(grad, ref_grad, atol=1e-5)
    if name == "luspo":  # the clip acts: on some completions, not all
        clipped = diagnostics(alg, *(a.astype(np.float32) for a in (logp, old, adv, mask)))
        assert 0 < clipped["clip_ratio/region_mean"] < 1


@pytest.mark.parametrize("name", ["luspo", "vespo"])
def test_new_losses_accumulate_exactly_over_micro_batches(name):
    """The loss is a sum over completions / a constant of the whole batch (LUSPO: its
    completions, VESPO: its tokens), so micro-batches of 1, 2 and 3 rows, each divided by
    the whole batch's normaliser, add up to the whole batch's loss and gradient."""
    rng = np.random.default_rng(11)
    b, t = 6, 5
    old = rng.normal(-2, 0.5, (b, t)).astype(np.float32)
    logp = (old + rng.normal(0, 0.1, (b, t))).astype(np.float32)
    ref = (old + rng.normal(0, 0.3, (b, t))).astype(np.float32)
    mask = (np.arange(t)[None] < np.array([5, 1, 3, 4, 2, 5])[:, None]).astype(np.float32)
    adv = rng.normal(0, 1, b).astype(np.float32)
    alg = make_algorithm(name, beta=0.04, epsilon=0.05)
    norm = alg.normalizer(mask)
    assert norm == (6.0 if name == "luspo" else mask.sum())

    def part_loss(rows):
        def f(lp):
            x = LossInputs(
                lp,
                mx.array(old[rows]),
                mx.array(ref[rows]),
                mx.array(adv[rows]),
                mx.array(mask[rows]),
                mx.ones(lp.shape),
            )
            return alg.loss_sum(x)[0] / norm

        loss, grad = mx.value_and_grad(f)(mx.array(logp[rows]))
        return float(loss.item()), np.array(grad)

    whole_loss, whole_grad = part_loss(np.arange(6))
    parts = [np.array([0]), np.array([1, 2]), np.array([3, 4, 5])]
    results = [part_loss(rows) for rows in parts]
    assert sum(r[0] for r in results) == pytest.approx(whole_loss, rel=1e-6, abs=1e-7)
    np.testing.assert_allclose(np.concatenate([r[1] for r in results]), whole_grad, rtol=1e-6, atol=1e-8)


# -- the registry ---------------------------------------------------------------------------------


def test_the_registry_the_config_and_the_docs_name_the_same_objectives():
    """The config knows the built-ins by name alone (runtime/config_sections.py, no MLX
    there); the classes register themselves; docs/algorithms.md's table is generated from
    them. A new built-in missing from any of the three fails here."""
    assert tuple(ALGORITHMS) == ALGORITHM_NAMES
    page = (ROOT / "docs" / "algorithms.md").read_text()
    assert algorithms_table() in page, (
        "docs/algorithms.md's table is stale: paste `python -m learner.algorithms`"
    )
    doc = AlgorithmConfig.__dataclass_fields__["name"].metadata["doc"]
    assert all(f"`{name}`" in doc for name in ALGORITHM_NAMES) and "module:Class" in doc
    for name, cls in ALGORITHMS.items():
        alg = make_algorithm(name)
        assert type(alg) is cls and alg.scale_rewards in ("group", "none")

"""The GRPO family: advantages from grouped rewards, an optional group filter, and a loss.

This is the one interface the learner's loop knows; it never branches on an algorithm's
name. Shapes: rewards [groups, G]; logprobs and masks [B, T] (B = groups * G completions,
T completion positions); advantages [B], or [B, T] per token (GiGPO).

Every loss is written as (sum of per-completion terms) / (a constant of the whole batch).
That makes micro-batched gradient accumulation exact for all of them: the learner splits
the rows, divides each micro-batch's sum by the *whole* batch's normaliser, and adds up.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import ClassVar, Protocol, get_args

import mlx.core as mx
import numpy as np

from runtime.config import ALGORITHM_NAMES, AlgorithmName, ScaleRewards

STD_EPS = 1e-4
SCALE_REWARDS: tuple[str, ...] = get_args(ScaleRewards)


@dataclass(frozen=True)
class LossInputs:
    logp: mx.array  # current policy [B, T]; carries the gradient
    old_logp: mx.array  # the policy the batch is measured against (frozen)
    ref_logp: mx.array | None  # adapters off; None when beta == 0
    advantages: mx.array  # [B], or [B, T] per token (GiGPO's, learner/gigpo.py)
    mask: mx.array  # [B, T], 1 on completion tokens
    is_weight: mx.array  # [B, T] behavior-policy correction pi_old / pi_behavior (1 = none)


class Algorithm(Protocol):
    per_completion: ClassVar[frozenset[str]]  # diagnostics averaged over completions, not tokens

    @property
    def scale_rewards(self) -> str:
        """How advantages are scaled: "group", "batch" or "none" (GiGPO's step groups too)."""

    def advantages(self, rewards: np.ndarray) -> np.ndarray:
        """[groups, G] rewards -> [groups * G] advantages."""

    def keep_group(self, rewards: np.ndarray) -> bool:
        """False drops the group before it takes a place in a batch (counted as filtered)."""

    def normalizer(self, mask: np.ndarray) -> float:
        """The whole batch's denominator, from its [B, T] completion mask."""

    def loss_sum(self, x: LossInputs) -> tuple[mx.array, dict[str, mx.array]]:
        """Sum over the rows of x of their loss terms, and token-mean diagnostics."""


def token_advantages(x: LossInputs) -> mx.array:
    """The advantages as the [B, T] terms use them: [B, 1] (one per completion), or the
    per-token [B, T] as they are."""
    return x.advantages if x.advantages.ndim == 2 else x.advantages[:, None]


def k3_kl(logp: mx.array, ref_logp: mx.array) -> mx.array:
    """Per-token k3 estimator of KL(pi || ref): exp(r - p) - (r - p) - 1, >= 0."""
    d = ref_logp - logp
    return mx.exp(d) - d - 1


def masked_mean(x: mx.array, mask: mx.array) -> mx.array:
    return (x * mask).sum() / mx.maximum(mask.sum(), 1.0)


def row_mean(x: mx.array, mask: mx.array) -> mx.array:
    """[B]: each row's mean over its masked tokens."""
    return (x * mask).sum(-1) / mx.maximum(mask.sum(-1), 1.0)


def ratio_stats(ratio: mx.array, mask: mx.array) -> dict[str, mx.array]:
    """The policy ratio's token mean and extremes."""
    return {
        "ratio_mean": masked_mean(ratio, mask),
        "ratio_max": mx.max(mx.where(mask > 0, ratio, -mx.inf)),
        "ratio_min": mx.min(mx.where(mask > 0, ratio, mx.inf)),
    }


def scale(centered: np.ndarray, rewards: np.ndarray, how: str) -> np.ndarray:
    """Divide centred rewards by the group's or the batch's sample std, or not at all."""
    if how == "none":
        return centered
    with warnings.catch_warnings():  # a group of one scored completion: NaN, then 0
        warnings.simplefilter("ignore", RuntimeWarning)
        if how == "group":
            std = np.nanstd(rewards, axis=1, ddof=1, keepdims=True)
        else:
            std = np.nanstd(rewards, ddof=1) if rewards.size > 1 else 0.0
    return centered / (std + STD_EPS)


def nanmean_rows(rewards: np.ndarray) -> np.ndarray:
    """Each group's mean over its scored completions ([groups, 1]; NaN if none is)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(rewards, axis=1, keepdims=True)


@dataclass(frozen=True)
class GRPO:
    """TRL's GRPO: group-normalised advantages, token-level clipped surrogate, loss
    averaged over each completion's tokens and then over completions."""

    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0
    scale_rewards: str = "group"
    max_tokens: int = 1
    # Whether epsilon_high keeps its own default when only epsilon is set.
    asymmetric: ClassVar[bool] = False
    # Diagnostics that are averages over completions, not tokens (see combine_stats).
    per_completion: ClassVar[frozenset[str]] = frozenset()

    def advantages(self, rewards: np.ndarray) -> np.ndarray:
        """[groups * G] from [groups, G] rewards. NaN (unscorable, as TRL marks a completion
        no reward function scored) is left out of the group's mean and std, and its own
        advantage is 0: no signal."""
        centered = rewards - nanmean_rows(rewards)
        return np.nan_to_num(scale(centered, rewards, self.scale_rewards), nan=0.0).reshape(-1)

    def keep_group(self, rewards: np.ndarray) -> bool:
        return True

    def normalizer(self, mask: np.ndarray) -> float:
        return float(mask.shape[0])  # completions

    def row_loss(self, per_token: mx.array, mask: mx.array) -> mx.array:
        return ((per_token * mask).sum(-1) / mx.maximum(mask.sum(-1), 1.0)).sum()

    def ratio(self, x: LossInputs) -> mx.array:
        return mx.exp(x.logp - x.old_logp)

    def clip_mean(self, clipped: mx.array, mask: mx.array) -> mx.array:
        return masked_mean(clipped, mask)

    def loss_sum(self, x: LossInputs) -> tuple[mx.array, dict[str, mx.array]]:
        ratio = self.ratio(x)
        adv = token_advantages(x)
        clipped = mx.clip(ratio, 1 - self.epsilon_low, 1 + self.epsilon_high)
        surrogate = -mx.minimum(ratio * adv, clipped * adv) * x.is_weight
        kl = k3_kl(x.logp, x.ref_logp) if x.ref_logp is not None else mx.zeros_like(x.logp)
        per_token = surrogate + self.beta * kl if self.beta else surrogate
        low = (ratio < 1 - self.epsilon_low) & (adv < 0)
        high = (ratio > 1 + self.epsilon_high) & (adv > 0)
        return self.row_loss(per_token, x.mask), {
            "surrogate_loss": self.row_loss(surrogate, x.mask),
            "kl": masked_mean(kl, x.mask),
            # TRL's clip_ratio/*: fractions of tokens (GSPO: of completions) clipped below,
            # above, either; and the least / most clipped completion's own fraction.
            "clip_ratio/low_mean": self.clip_mean(low, x.mask),
            "clip_ratio/high_mean": self.clip_mean(high, x.mask),
            "clip_ratio/region_mean": self.clip_mean(low | high, x.mask),
            "clip_ratio/low_min": mx.min(row_mean(low, x.mask)),
            "clip_ratio/high_max": mx.max(row_mean(high, x.mask)),
            **ratio_stats(ratio, x.mask),
        }


@dataclass(frozen=True)
class BNPO(GRPO):
    """Token-level: the loss sums over all completion tokens of the batch, divided by
    their number, so long completions weigh by their length."""

    def normalizer(self, mask: np.ndarray) -> float:
        return max(float(mask.sum()), 1.0)

    def row_loss(self, per_token: mx.array, mask: mx.array) -> mx.array:
        return (per_token * mask).sum()


@dataclass(frozen=True)
class DAPO(BNPO):
    """BNPO's token-level loss with asymmetric clipping (defaults 0.2 / 0.28) and dynamic
    sampling: groups whose rewards are all equal carry no signal and are filtered out; the
    learner fills the batch with further groups instead."""

    epsilon_high: float = 0.28
    asymmetric: ClassVar[bool] = True

    def keep_group(self, rewards: np.ndarray) -> bool:
        scored = rewards[~np.isnan(rewards)]
        return scored.size > 1 and bool(np.ptp(scored) > 0)


@dataclass(frozen=True)
class DrGRPO(BNPO):
    """Dr. GRPO: no std scaling of advantages, and a constant normaliser
    (completions x max_tokens), removing the length and difficulty biases."""

    scale_rewards: str = "none"

    def normalizer(self, mask: np.ndarray) -> float:
        return float(mask.shape[0] * self.max_tokens)


@dataclass(frozen=True)
class GSPO(GRPO):
    """GSPO: one importance ratio per completion, exp(mean_t(logp - old_logp)), clipped at
    the sequence level with its paper's far smaller range (3e-4 below, 4e-4 above)."""

    epsilon_low: float = 3e-4
    epsilon_high: float = 4e-4
    per_completion: ClassVar[frozenset[str]] = frozenset(
        {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"}
    )

    def ratio(self, x: LossInputs) -> mx.array:
        seq_log_ratio = row_mean(x.logp - x.old_logp, x.mask)[:, None]
        return mx.broadcast_to(mx.exp(seq_log_ratio), x.logp.shape)

    def clip_mean(self, clipped: mx.array, mask: mx.array) -> mx.array:
        return row_mean(clipped, mask).mean()  # one ratio per completion: a fraction of them


@dataclass(frozen=True)
class RLOO(GRPO):
    """RLOO: each completion's baseline is the mean reward of the *other* G-1 completions
    of its prompt: r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean)."""

    scale_rewards: str = "none"

    def advantages(self, rewards: np.ndarray) -> np.ndarray:
        g = (~np.isnan(rewards)).sum(axis=1, keepdims=True)  # the scored completions (G unless None)
        with np.errstate(divide="ignore", invalid="ignore"):  # one scored: 0 / 0, then 0
            centered = (rewards - nanmean_rows(rewards)) * g / (g - 1)
        return np.nan_to_num(
            scale(centered, rewards, self.scale_rewards), nan=0.0, posinf=0.0, neginf=0.0
        ).reshape(-1)


@dataclass(frozen=True)
class CISPO(BNPO):
    """CISPO (MiniMax-M1), as TRL's `loss_type="cispo"`: the importance ratio, capped at
    epsilon_high (5.0, ScaleRL's) and detached, weighs a REINFORCE term:
    -min(r, epsilon_high).detach() * A * logp. No token is clipped out of the gradient; the
    loss is token-level, as DAPO's. TRL's `cispo_clip_ratio`: the fraction of tokens with
    A > 0 whose ratio was capped."""

    epsilon_high: float = 5.0
    asymmetric: ClassVar[bool] = True

    def loss_sum(self, x: LossInputs) -> tuple[mx.array, dict[str, mx.array]]:
        ratio = mx.exp(x.logp - x.old_logp)
        adv = token_advantages(x)
        weight = mx.stop_gradient(mx.minimum(ratio, self.epsilon_high))
        surrogate = -weight * adv * x.logp * x.is_weight
        kl = k3_kl(x.logp, x.ref_logp) if x.ref_logp is not None else mx.zeros_like(x.logp)
        per_token = surrogate + self.beta * kl if self.beta else surrogate
        return self.row_loss(per_token, x.mask), {
            "surrogate_loss": self.row_loss(surrogate, x.mask),
            "kl": masked_mean(kl, x.mask),
            "cispo_clip_ratio": masked_mean((ratio > self.epsilon_high) & (adv > 0), x.mask),
            **ratio_stats(ratio, x.mask),
        }


@dataclass(frozen=True)
class SAPO(GRPO):
    """SAPO (soft adaptive policy optimization), as TRL's `loss_type="sapo"`: a sigmoid
    gate instead of the hard clip, -sigmoid(tau * (r - 1)) * 4 / tau * A, with tau
    `sapo_temperature_pos` (1.0) where A > 0 and `sapo_temperature_neg` (1.05) elsewhere.
    Its gradient at r = 1 is the plain ratio's; far from 1 it fades instead of stopping.
    Averaged per completion, then over completions, as GRPO."""

    temperature_pos: float = 1.0
    temperature_neg: float = 1.05

    def loss_sum(self, x: LossInputs) -> tuple[mx.array, dict[str, mx.array]]:
        ratio = self.ratio(x)
        adv = token_advantages(x)
        tau = mx.where(adv > 0, self.temperature_pos, self.temperature_neg)
        surrogate = -mx.sigmoid(tau * (ratio - 1)) * 4 / tau * adv * x.is_weight
        kl = k3_kl(x.logp, x.ref_logp) if x.ref_logp is not None else mx.zeros_like(x.logp)
        per_token = surrogate + self.beta * kl if self.beta else surrogate
        return self.row_loss(per_token, x.mask), {
            "surrogate_loss": self.row_loss(surrogate, x.mask),
            "kl": masked_mean(kl, x.mask),
            **ratio_stats(ratio, x.mask),
        }


ALGORITHMS: dict[AlgorithmName, type[GRPO]] = {
    "grpo": GRPO,
    "bnpo": BNPO,
    "dapo": DAPO,
    "dr_grpo": DrGRPO,
    "gspo": GSPO,
    "rloo": RLOO,
    "cispo": CISPO,
    "sapo": SAPO,
}
assert tuple(ALGORITHMS) == ALGORITHM_NAMES, "runtime/config_sections.py names the objectives"


def make_algorithm(
    name: str,
    *,
    beta: float = 0.0,
    epsilon: float | None = None,
    epsilon_high: float | None = None,
    scale_rewards: ScaleRewards | None = None,
    max_tokens: int = 1,
    sapo_temperatures: tuple[float, float] = (1.0, 1.05),
) -> Algorithm:
    """Build an objective; unset knobs keep the objective's own defaults. SAPO's gate takes
    `sapo_temperatures` (where A > 0, elsewhere)."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {sorted(ALGORITHMS)}")
    cls = ALGORITHMS[name]
    kwargs: dict = {"beta": beta, "max_tokens": max_tokens}
    if epsilon is not None:
        kwargs["epsilon_low"] = epsilon
        if not cls.asymmetric:
            kwargs["epsilon_high"] = epsilon
    if epsilon_high is not None:
        kwargs["epsilon_high"] = epsilon_high
    if scale_rewards is not None:
        if scale_rewards not in SCALE_REWARDS:
            raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
        kwargs["scale_rewards"] = scale_rewards
    if cls is SAPO:
        kwargs["temperature_pos"], kwargs["temperature_neg"] = sapo_temperatures
    return cls(**kwargs)

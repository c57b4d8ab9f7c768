"""The GRPO family: advantages from grouped rewards, an optional group filter, and a loss.

This is the one interface the learner's loop knows; it never branches on an algorithm's
name. Shapes: rewards [groups, G]; logprobs and masks [B, T] (B = groups * G completions,
T completion positions); advantages [B], or [B, T] per token (GiGPO).

Every loss is written as (sum of per-completion terms) / (a constant of the whole batch).
That makes micro-batched gradient accumulation exact for all of them: the learner splits
the rows, divides each micro-batch's sum by the *whole* batch's normaliser, and adds up.

Names. The built-in objectives register themselves (`register`): each class carries its
`name` and its row of docs/algorithms.md's table (`doc_row`; `algorithms_table`, or
`python -m learner.algorithms`, prints the table). The config may not import this MLX
code (runtime is the lowest layer), so it checks `algorithm.name` against a list of the
names alone, runtime/config_sections.py's ALGORITHM_NAMES; tests fail when that list, this
registry or the docs' table disagree. A new built-in is its class here and its name there.
`algorithm.name` may instead be `module:Class`, a user's loss, imported from beside the
config as reward functions are (`algorithm_class`).

Writing a loss: subclass GRPO (or another built-in) as a frozen dataclass and override what
differs. `surrogate` gives the per-token policy terms; `loss_sum` adds beta times the k3 KL
and reduces with `row_loss` (summed over rows), which the learner divides by `normalizer`
(a constant of the whole batch); `advantages` and `keep_group` work on rewards.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, Self, TypeVar, get_args

import mlx.core as mx
import numpy as np

from rewards.functions import import_spec
from runtime.config import AlgorithmConfig, ConfigError, ScaleRewards

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

    @property
    def group_local(self) -> bool:
        """Whether a group's advantages depend on its own rewards alone: then the learner
        trains each group as it arrives; else it waits for the whole batch."""

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


# The built-in objectives by name, filled by `register` as the classes below are defined.
ALGORITHMS: dict[str, type[GRPO]] = {}
Registered = TypeVar("Registered", bound="type[GRPO]")


def register(cls: Registered) -> Registered:
    """Add a built-in objective to ALGORITHMS under its own `name`. It must set `name` and
    `doc_row` itself (a subclass inherits both): a row of the docs' table per name."""
    name = cls.__dict__.get("name")
    if not name or "doc_row" not in cls.__dict__ or name in ALGORITHMS:
        raise TypeError(f"{cls.__name__}: a registered objective sets a name of its own and its doc_row")
    ALGORITHMS[name] = cls
    return cls


@register
@dataclass(frozen=True)
class GRPO:
    """TRL's GRPO: group-normalised advantages, token-level clipped surrogate, loss
    averaged over each completion's tokens and then over completions.

    The base of every objective: a subclass overrides `surrogate` (the policy terms),
    `row_loss` and `normalizer` (the reduction), `advantages` or `keep_group`."""

    name: ClassVar[str] = "grpo"
    # docs/algorithms.md's table: advantages, loss reduction, anything else.
    doc_row: ClassVar[tuple[str, str, str]] = (
        "`(r - mean_g) / (std_g + 1e-4)`",
        "mean over each completion's tokens, then over completions (TRL's `grpo`)",
        "",
    )
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0
    scale_rewards: str = "group"
    max_tokens: int = 1
    # Whether epsilon_high keeps its own default when only epsilon is set.
    asymmetric: ClassVar[bool] = False
    # Diagnostics that are averages over completions, not tokens (see combine_stats).
    per_completion: ClassVar[frozenset[str]] = frozenset()
    # The [algorithm] keys this objective takes beyond the shared ones: (field, key).
    settings: ClassVar[tuple[tuple[str, str], ...]] = ()

    @classmethod
    def from_config(cls, cfg: AlgorithmConfig, max_tokens: int) -> Self:
        """This objective with the [algorithm] section's settings; the unset ones keep the
        class's defaults. `max_tokens`: the longest completion (Dr. GRPO's normaliser)."""
        kwargs: dict[str, Any] = {"beta": cfg.beta, "max_tokens": max_tokens}
        if cfg.epsilon is not None:
            kwargs["epsilon_low"] = cfg.epsilon
            if not cls.asymmetric:
                kwargs["epsilon_high"] = cfg.epsilon
        if cfg.epsilon_high is not None:
            kwargs["epsilon_high"] = cfg.epsilon_high
        if cfg.scale_rewards is not None:
            if cfg.scale_rewards not in SCALE_REWARDS:
                raise ConfigError(
                    f"algorithm.scale_rewards must be one of {SCALE_REWARDS}, got {cfg.scale_rewards!r}"
                )
            kwargs["scale_rewards"] = cfg.scale_rewards
        kwargs.update({field: getattr(cfg, key) for field, key in cls.settings})
        return cls(**kwargs)

    @property
    def group_local(self) -> bool:
        """Batch-scaled advantages (`scale_rewards = "batch"`) need every group's rewards;
        group-scaled ones only the group's own. A loss of your own whose `advantages`
        looks across groups says False here."""
        return self.scale_rewards != "batch"

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
        """The shared tail of every objective: each token's policy term (`surrogate`) plus
        beta times its k3 KL, reduced by `row_loss`. Diagnostics: `surrogate_loss` (the
        policy terms alone, reduced alike), `kl` (a token mean), then the surrogate's own."""
        surrogate, diagnostics = self.surrogate(x)
        kl = k3_kl(x.logp, x.ref_logp) if x.ref_logp is not None else mx.zeros_like(x.logp)
        per_token = surrogate + self.beta * kl if self.beta else surrogate
        return self.row_loss(per_token, x.mask), {
            "surrogate_loss": self.row_loss(surrogate, x.mask),
            "kl": masked_mean(kl, x.mask),
            **diagnostics,
        }

    def surrogate(self, x: LossInputs) -> tuple[mx.array, dict[str, mx.array]]:
        """The [B, T] policy terms, before the KL penalty, and their diagnostics: here the
        clipped surrogate -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A) * w."""
        ratio = self.ratio(x)
        adv = token_advantages(x)
        clipped = mx.clip(ratio, 1 - self.epsilon_low, 1 + self.epsilon_high)
        surrogate = -mx.minimum(ratio * adv, clipped * adv) * x.is_weight
        low = (ratio < 1 - self.epsilon_low) & (adv < 0)
        high = (ratio > 1 + self.epsilon_high) & (adv > 0)
        return surrogate, {
            # TRL's clip_ratio/*: fractions of tokens (GSPO: of completions) clipped below,
            # above, either; and the least / most clipped completion's own fraction.
            "clip_ratio/low_mean": self.clip_mean(low, x.mask),
            "clip_ratio/high_mean": self.clip_mean(high, x.mask),
            "clip_ratio/region_mean": self.clip_mean(low | high, x.mask),
            "clip_ratio/low_min": mx.min(row_mean(low, x.mask)),
            "clip_ratio/high_max": mx.max(row_mean(high, x.mask)),
            **ratio_stats(ratio, x.mask),
        }


@register
@dataclass(frozen=True)
class BNPO(GRPO):
    """Token-level: the loss sums over all completion tokens of the batch, divided by
    their number, so long completions weigh by their length."""

    name: ClassVar[str] = "bnpo"
    doc_row: ClassVar[tuple[str, str, str]] = (
        "as GRPO",
        "sum over all completion tokens / their number",
        "",
    )

    def normalizer(self, mask: np.ndarray) -> float:
        return max(float(mask.sum()), 1.0)

    def row_loss(self, per_token: mx.array, mask: mx.array) -> mx.array:
        return (per_token * mask).sum()


@register
@dataclass(frozen=True)
class DAPO(BNPO):
    """BNPO's token-level loss with asymmetric clipping (defaults 0.2 / 0.28) and dynamic
    sampling: groups whose rewards are all equal carry no signal and are filtered out; the
    learner fills the batch with further groups instead."""

    name: ClassVar[str] = "dapo"
    doc_row: ClassVar[tuple[str, str, str]] = (
        "as GRPO",
        "as BNPO",
        "`epsilon_high` 0.28; groups whose rewards are all equal are filtered out (counted as "
        "`filtered: equal rewards`) and replaced",
    )
    epsilon_high: float = 0.28
    asymmetric: ClassVar[bool] = True

    def keep_group(self, rewards: np.ndarray) -> bool:
        scored = rewards[~np.isnan(rewards)]
        return scored.size > 1 and bool(np.ptp(scored) > 0)


@register
@dataclass(frozen=True)
class DrGRPO(BNPO):
    """Dr. GRPO: no std scaling of advantages, and a constant normaliser
    (completions x max_tokens), removing the length and difficulty biases."""

    name: ClassVar[str] = "dr_grpo"
    doc_row: ClassVar[tuple[str, str, str]] = (
        "`r - mean_g` (no std)",
        "sum over tokens / (completions x `max_tokens`)",
        "",
    )
    scale_rewards: str = "none"

    def normalizer(self, mask: np.ndarray) -> float:
        return float(mask.shape[0] * self.max_tokens)


@register
@dataclass(frozen=True)
class GSPO(GRPO):
    """GSPO: one importance ratio per completion, exp(mean_t(logp - old_logp)), clipped at
    the sequence level with its paper's far smaller range (3e-4 below, 4e-4 above)."""

    name: ClassVar[str] = "gspo"
    doc_row: ClassVar[tuple[str, str, str]] = (
        "as GRPO",
        "per completion, mean over completions",
        "one ratio per completion, `exp(mean_t(logp - old))`, clip range 3e-4 / 4e-4",
    )
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


@register
@dataclass(frozen=True)
class RLOO(GRPO):
    """RLOO: each completion's baseline is the mean reward of the *other* G-1 completions
    of its prompt: r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean)."""

    name: ClassVar[str] = "rloo"
    doc_row: ClassVar[tuple[str, str, str]] = ("`r_i - mean_{j != i} r_j`", "as GRPO", "")
    scale_rewards: str = "none"

    def advantages(self, rewards: np.ndarray) -> np.ndarray:
        g = (~np.isnan(rewards)).sum(axis=1, keepdims=True)  # the scored completions (G unless None)
        with np.errstate(divide="ignore", invalid="ignore"):  # one scored: 0 / 0, then 0
            centered = (rewards - nanmean_rows(rewards)) * g / (g - 1)
        return np.nan_to_num(
            scale(centered, rewards, self.scale_rewards), nan=0.0, posinf=0.0, neginf=0.0
        ).reshape(-1)


@register
@dataclass(frozen=True)
class CISPO(BNPO):
    """CISPO (MiniMax-M1), as TRL's `loss_type="cispo"`: the importance ratio, capped at
    epsilon_high (5.0, ScaleRL's) and detached, weighs a REINFORCE term:
    -min(r, epsilon_high).detach() * A * logp. No token is clipped out of the gradient; the
    loss is token-level, as DAPO's. TRL's `cispo_clip_ratio`: the fraction of tokens with
    A > 0 whose ratio was capped."""

    name: ClassVar[str] = "cispo"
    doc_row: ClassVar[tuple[str, str, str]] = (
        "as GRPO",
        "as BNPO",
        "not the clipped surrogate: `-sg(min(r, eps_high)) * A * logp * w` (MiniMax-M1, TRL's "
        "`cispo`); `epsilon_high` 5.0; no token leaves the gradient",
    )
    epsilon_high: float = 5.0
    asymmetric: ClassVar[bool] = True

    def surrogate(self, x: LossInputs) -> tuple[mx.array, dict[str, mx.array]]:
        ratio = mx.exp(x.logp - x.old_logp)
        adv = token_advantages(x)
        weight = mx.stop_gradient(mx.minimum(ratio, self.epsilon_high))
        return -weight * adv * x.logp * x.is_weight, {
            "cispo_clip_ratio": masked_mean((ratio > self.epsilon_high) & (adv > 0), x.mask),
            **ratio_stats(ratio, x.mask),
        }


@register
@dataclass(frozen=True)
class SAPO(GRPO):
    """SAPO (soft adaptive policy optimization), as TRL's `loss_type="sapo"`: a sigmoid
    gate instead of the hard clip, -sigmoid(tau * (r - 1)) * 4 / tau * A, with tau
    `sapo_temperature_pos` (1.0) where A > 0 and `sapo_temperature_neg` (1.05) elsewhere.
    Its gradient at r = 1 is the plain ratio's; far from 1 it fades instead of stopping.
    Averaged per completion, then over completions, as GRPO."""

    name: ClassVar[str] = "sapo"
    doc_row: ClassVar[tuple[str, str, str]] = (
        "as GRPO",
        "as GRPO",
        "a soft gate for the clip: `-sigmoid(tau * (r - 1)) * 4 / tau * A * w`, `tau` = "
        "`sapo_temperature_pos` (1.0) where A > 0, `sapo_temperature_neg` (1.05) elsewhere (TRL's `sapo`)",
    )
    temperature_pos: float = 1.0
    temperature_neg: float = 1.05
    settings: ClassVar[tuple[tuple[str, str], ...]] = (
        ("temperature_pos", "sapo_temperature_pos"),
        ("temperature_neg", "sapo_temperature_neg"),
    )

    def surrogate(self, x: LossInputs) -> tuple[mx.array, dict[str, mx.array]]:
        ratio = self.ratio(x)
        adv = token_advantages(x)
        tau = mx.where(adv > 0, self.temperature_pos, self.temperature_neg)
        return -mx.sigmoid(tau * (ratio - 1)) * 4 / tau * adv * x.is_weight, ratio_stats(ratio, x.mask)


@register
@dataclass(frozen=True)
class LUSPO(GSPO):
    """LUSPO (length-unbiased sequence policy optimization, arXiv 2602.05261), as TRL's
    `loss_type="luspo"` with `importance_sampling_level="sequence"` (as TRL advises): GSPO's
    sequence ratio and clip, and each completion's term weighted by its length, which
    undoes GSPO's bias against long completions: the sum over its tokens (its length times
    its mean), then over completions / their number. Default clip range 2e-3 / 2.5e-3,
    the paper's (section 5.1) that TRL's docs set."""

    name: ClassVar[str] = "luspo"
    doc_row: ClassVar[tuple[str, str, str]] = (
        "as GRPO",
        "sum over each completion's tokens (its length times its mean), then over completions / their number",
        "GSPO's sequence ratio and its clip, range 2e-3 / 2.5e-3 (LUSPO, TRL's `luspo`)",
    )
    epsilon_low: float = 2e-3
    epsilon_high: float = 2.5e-3

    def row_loss(self, per_token: mx.array, mask: mx.array) -> mx.array:
        return (per_token * mask).sum()


# VESPO's bounds on log-ratios, TRL's (after the paper's code): a token's log(pi / pi_old)
# and the sequence's sum within +-20, a weight no smaller than 1e-8.
LOG_RATIO_CAP = 20.0
LOG_MIN_WEIGHT = math.log(1e-8)


@register
@dataclass(frozen=True)
class VESPO(BNPO):
    """VESPO (variational sequence-level soft policy optimization, arXiv 2602.10693), as
    TRL's `loss_type="vespo"`: no clip. Each completion's REINFORCE term -phi * A * logp is
    weighted by phi(W) = e^lambda * W^k * e^(-lambda W) = W^k e^(lambda (1 - W)), detached,
    of its sequence ratio W = exp(sum_t(logp - old_logp)) (a sum, where GSPO takes a mean);
    phi(1) = 1, and it fades for W far from 1 on either side. (k, lambda) are
    (`vespo_k_pos`, `vespo_lambda_pos`) = (2, 3) where A >= 0, else (3, 2). Token-level loss,
    as DAPO's. The behavior correction is not a factor of the loss, as for the others, but
    goes into W in log space (TRL's `token_truncate` / `token_mask`): the sum of the
    completion's log token weights, or with `is_level = "sequence"` its one weight's log.
    Logs TRL's `vespo/phi_seq_mean`, phi's mean over completions."""

    name: ClassVar[str] = "vespo"
    doc_row: ClassVar[tuple[str, str, str]] = (
        "as GRPO",
        "as BNPO",
        "no clip: `-sg(phi(W)) * A * logp`, `phi(W) = W^k * exp(lambda * (1 - W))` of the "
        "sequence ratio `W = exp(sum_t(logp - old))` (times the behavior weights); `k`, "
        "`lambda` = `vespo_k_pos` (2), `vespo_lambda_pos` (3) where A >= 0, `vespo_k_neg` (3), "
        "`vespo_lambda_neg` (2) elsewhere (VESPO, TRL's `vespo`)",
    )
    k_pos: float = 2.0
    lambda_pos: float = 3.0
    k_neg: float = 3.0
    lambda_neg: float = 2.0
    is_level: str = "token"  # the behavior weights': one per token, or one per completion
    per_completion: ClassVar[frozenset[str]] = frozenset({"vespo/phi_seq_mean"})
    settings: ClassVar[tuple[tuple[str, str], ...]] = (
        ("k_pos", "vespo_k_pos"),
        ("lambda_pos", "vespo_lambda_pos"),
        ("k_neg", "vespo_k_neg"),
        ("lambda_neg", "vespo_lambda_neg"),
        ("is_level", "is_level"),
    )

    def surrogate(self, x: LossInputs) -> tuple[mx.array, dict[str, mx.array]]:
        log_ratio = mx.clip(x.logp - x.old_logp, -LOG_RATIO_CAP, LOG_RATIO_CAP)
        log_w = (log_ratio * x.mask).sum(-1, keepdims=True)
        # pi_old / pi_behavior: 1 without a correction, 0 where masked (so the floor, 1e-8)
        log_is = mx.clip(mx.log(x.is_weight), LOG_MIN_WEIGHT, LOG_RATIO_CAP) * x.mask
        log_w = log_w + (
            row_mean(log_is, x.mask)[:, None]
            if self.is_level == "sequence"
            else log_is.sum(-1, keepdims=True)
        )
        log_w = mx.stop_gradient(mx.clip(log_w, LOG_MIN_WEIGHT, LOG_RATIO_CAP))  # [B, 1]
        adv = token_advantages(x)
        k = mx.where(adv >= 0, self.k_pos, self.k_neg)
        lam = mx.maximum(mx.where(adv >= 0, self.lambda_pos, self.lambda_neg), 1e-4)
        phi = mx.nan_to_num(mx.exp(lam + k * log_w - lam * mx.exp(log_w)), nan=0.0, posinf=0.0, neginf=0.0)
        phi = mx.broadcast_to(phi, x.logp.shape)
        return -phi * adv * x.logp, {
            "vespo/phi_seq_mean": row_mean(phi, x.mask).mean(),
            **ratio_stats(mx.exp(x.logp - x.old_logp), x.mask),
        }


# The names a user's class must answer to; `scale_rewards` and `per_completion` too, once built.
INTERFACE = ("from_config", "advantages", "keep_group", "normalizer", "loss_sum")


def algorithm_class(name: str, search_path: str | None = None) -> type[Any]:
    """The class `algorithm.name` names: a built-in's, or a user's `module:Class`, imported
    from `search_path` (the config's folder, `reward.search_path`) first, as reward
    functions are. ConfigError naming what is wrong: an unknown name, a module that does
    not import, no such class, or a class without the loss interface."""
    if name in ALGORITHMS:
        return ALGORITHMS[name]
    if ":" not in name:
        raise ConfigError(
            f"algorithm.name: unknown algorithm {name!r}; choose one of {', '.join(ALGORITHMS)} "
            "or 'module:Class'"
        )
    try:
        module, cls_name, cls = import_spec(name, search_path, ConfigError, "algorithm.name")
    except ConfigError:
        raise
    except Exception as e:  # the module itself failed: a syntax error, an exception it raised
        raise ConfigError(f"algorithm.name {name!r}: importing it raised {type(e).__name__}: {e}") from e
    if cls is None:
        raise ConfigError(f"algorithm.name {name!r}: {module} has no class {cls_name!r}")
    if not isinstance(cls, type):
        raise ConfigError(f"algorithm.name {name!r}: {cls_name} is a {type(cls).__name__}, not a class")
    missing = [m for m in INTERFACE if not callable(getattr(cls, m, None))]
    if missing:
        raise ConfigError(
            f"algorithm.name {name!r}: {cls_name} is not a loss, it has no {', '.join(missing)} "
            "(subclass learner.algorithms.GRPO; docs/algorithms.md)"
        )
    return cls


def load_algorithm(cfg: AlgorithmConfig, max_tokens: int, search_path: str | None = None) -> Algorithm:
    """The [algorithm] section's objective, built with its settings (`from_config`).
    `max_tokens`: the longest completion; `search_path`: where a user's module is looked
    for first (`reward.search_path`)."""
    cls = algorithm_class(cfg.name, search_path)
    try:
        algorithm = cls.from_config(cfg, max_tokens)
    except TypeError as e:
        raise ConfigError(f"algorithm.name {cfg.name!r}: {cls.__name__}.from_config failed: {e}") from e
    missing = [a for a in ("scale_rewards", "per_completion", "group_local") if not hasattr(algorithm, a)]
    if missing:
        raise ConfigError(f"algorithm.name {cfg.name!r}: {cls.__name__} has no {', '.join(missing)}")
    return algorithm


def check_group_local(algorithm: Algorithm, name: str, group_size: int) -> None:
    """A loss whose `group_local` is True is trained group by group as the groups arrive,
    its advantages computed on each take alone (learner/building.py). So made-up rewards of
    three groups must give the same advantages all at once and one group at a time: a loss
    whose advantages look across groups would otherwise train on wrong ones without a word."""
    rewards = np.random.default_rng(0).random((3, group_size))
    try:
        whole = np.asarray(algorithm.advantages(rewards), dtype=np.float64).reshape(3, group_size)
        alone = np.stack([np.asarray(algorithm.advantages(r), np.float64) for r in rewards[:, None]])
        alone = alone.reshape(3, group_size)
    except Exception as e:
        raise ConfigError(
            f"algorithm.name {name!r}: its advantages failed on made-up rewards of 3 groups of {group_size} "
            f"(and of each group alone): {type(e).__name__}: {e}"
        ) from e
    if not np.allclose(whole, alone, rtol=1e-5, atol=1e-6):
        raise ConfigError(
            f"algorithm.name {name!r}: {type(algorithm).__name__}.group_local is True, but a group's "
            "advantages change with the other groups' rewards (made-up rewards of 3 groups, all at "
            "once and one at a time). The learner trains each group as it arrives: make group_local "
            "return False, and it waits for the whole batch (or set train.stream_groups = false)"
        )


def make_algorithm(
    name: str,
    *,
    beta: float = 0.0,
    epsilon: float | None = None,
    epsilon_high: float | None = None,
    scale_rewards: ScaleRewards | None = None,
    max_tokens: int = 1,
    sapo_temperatures: tuple[float, float] = (1.0, 1.05),
    search_path: str | None = None,
    **settings: Any,
) -> Algorithm:
    """Build an objective by name (or `module:Class`); unset knobs keep the objective's own
    defaults, any other [algorithm] key is a keyword (`vespo_k_pos=...`). SAPO's gate takes
    `sapo_temperatures` (where A > 0, elsewhere). For scripts and tests: the learner builds
    its own from the config (`load_algorithm`)."""
    cfg = AlgorithmConfig(
        name=name,
        beta=beta,
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        scale_rewards=scale_rewards,
        sapo_temperature_pos=sapo_temperatures[0],
        sapo_temperature_neg=sapo_temperatures[1],
        **settings,
    )
    return load_algorithm(cfg, max_tokens, search_path)


def algorithms_table() -> str:
    """docs/algorithms.md's table of the objectives, from the registry."""
    rows = ["| name | advantages | loss reduction | other |", "|---|---|---|---|"]
    rows += [
        f"| `{name}` | {' | '.join(cls.doc_row)} |".replace("|  |", "| |") for name, cls in ALGORITHMS.items()
    ]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    import sys

    sys.stdout.write(algorithms_table())

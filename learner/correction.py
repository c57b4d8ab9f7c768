"""Behavior-policy correction: the actor's behavior logprobs differ from the learner's
old-policy logprobs when the actor is stale or its numerics differ, so each token's loss can
be weighted by pi_old / pi_behavior (capped or masked), and the gap is measured at every
step. Pure functions of arrays, so the prepared old-policy pass and the fused step share them.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from learner.algorithms import masked_mean, row_mean
from runtime.config import CorrectionLevel, CorrectionMode

# exp() of a sequence's summed log-ratio overflows float32 beyond ~88.
MAX_LOG_WEIGHT = 80.0


@dataclass(frozen=True)
class Correction:
    """Behavior-policy correction: weight each token's loss by w = pi_old / pi_behavior.

    mode "truncate" uses min(w, cap); "mask" zeroes tokens with w outside [1/cap, cap];
    "none" uses 1. level "sequence" takes one w per completion (the product of its token
    ratios) instead of one per token.
    """

    mode: CorrectionMode = "none"
    level: CorrectionLevel = "token"
    cap: float = 2.0


def correction_weights(
    old: mx.array, behavior: mx.array, mask: mx.array, c: Correction
) -> tuple[mx.array, dict[str, mx.array]]:
    """Importance weights pi_old / pi_behavior per token, and how often they were cut."""
    log_w = (old - behavior) * mask
    if c.level == "sequence":
        log_w = mx.broadcast_to(log_w.sum(-1, keepdims=True), log_w.shape)
    w = mx.exp(mx.clip(log_w, -MAX_LOG_WEIGHT, MAX_LOG_WEIGHT))
    on = mask > 0
    stats = {
        "is_ratio_min": mx.min(mx.where(on, w, mx.inf)),
        "is_ratio_mean": masked_mean(w, mask),
        "is_ratio_max": mx.max(mx.where(on, w, -mx.inf)),
    }
    if c.mode == "truncate":
        cut = w > c.cap
        used = mx.minimum(w, c.cap)
    elif c.mode == "mask":
        cut = (w > c.cap) | (w < 1 / c.cap)
        used = mx.where(cut, 0.0, w)
    else:
        cut = mx.zeros_like(on)
        used = mx.ones_like(w)
    stats["is_cut_frac"] = masked_mean(cut, mask)
    weights = used * mask
    if c.mode != "none":  # TRL's names, for the weights as used (after the cap)
        if c.level == "sequence":
            used, on = row_mean(used, mask), mask.sum(-1) > 0  # one weight per completion
        stats["sampling/importance_sampling_ratio/min"] = mx.min(mx.where(on, used, mx.inf))
        stats["sampling/importance_sampling_ratio/mean"] = masked_mean(used, on)
        stats["sampling/importance_sampling_ratio/max"] = mx.max(mx.where(on, used, -mx.inf))
    return weights, stats


def mismatch_metrics(behavior: mx.array, old: mx.array, mask: mx.array) -> dict[str, mx.array]:
    """How far the actor's behavior logprobs are from the learner's recomputation."""
    diff = (old - behavior) * mask
    return {
        "mismatch_kl": masked_mean(mx.expm1(diff) - diff, mask),  # k3 estimate of KL(behavior || old)
        "sampling/sampling_logp_difference/mean": masked_mean(mx.abs(diff), mask),  # TRL's names
        "sampling/sampling_logp_difference/max": mx.max(mx.abs(diff)),
    }


def old_policy_terms(
    old: mx.array, entropy: mx.array, behavior: mx.array, mask: mx.array, c: Correction
) -> tuple[mx.array, dict[str, mx.array]]:
    """From the old-policy logprobs: the correction weights, and the diagnostics that
    compare them with the actor's (and the policy's entropy). Both paths use this."""
    weights, stats = correction_weights(old, behavior, mask, c)
    stats.update(mismatch_metrics(behavior, old, mask))
    stats["entropy"] = masked_mean(entropy, mask)
    return weights, stats

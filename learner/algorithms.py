"""Algorithms: advantages from grouped rewards, and a loss over per-token logprobs.

This is the one interface the learner's loop knows. An algorithm is plain functions over
arrays; the loop never branches on its name. Shapes: rewards [groups, G]; logprobs and
mask [B, T] with B = groups * G rows, T completion positions; advantages [B].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import numpy as np

STD_EPS = 1e-4


@dataclass(frozen=True)
class LossInputs:
    logp: mx.array  # current policy, carries the gradient
    old_logp: mx.array  # policy that the batch is measured against (frozen)
    ref_logp: mx.array | None  # adapters off; None when beta == 0
    advantages: mx.array  # [B]
    mask: mx.array  # [B, T] float, 1 on completion tokens


class Algorithm(Protocol):
    def advantages(self, rewards: np.ndarray) -> np.ndarray: ...

    def loss(self, x: LossInputs) -> tuple[mx.array, dict[str, mx.array]]: ...


def k3_kl(logp: mx.array, ref_logp: mx.array) -> mx.array:
    """Per-token k3 estimator of KL(pi || ref): exp(r - p) - (r - p) - 1, >= 0."""
    d = ref_logp - logp
    return mx.exp(d) - d - 1


def masked_mean(x: mx.array, mask: mx.array) -> mx.array:
    return (x * mask).sum() / mx.maximum(mask.sum(), 1.0)


@dataclass(frozen=True)
class GRPO:
    """GRPO as TRL defines it: group-normalised advantages, clipped surrogate, loss
    averaged over each completion's tokens and then over completions."""

    epsilon: float = 0.2
    beta: float = 0.0

    def advantages(self, rewards: np.ndarray) -> np.ndarray:
        mean = rewards.mean(axis=1, keepdims=True)
        std = rewards.std(axis=1, ddof=1, keepdims=True) if rewards.shape[1] > 1 else 0.0
        return ((rewards - mean) / (std + STD_EPS)).reshape(-1)

    def loss(self, x: LossInputs) -> tuple[mx.array, dict[str, mx.array]]:
        ratio = mx.exp(x.logp - x.old_logp)
        adv = x.advantages[:, None]
        clipped = mx.clip(ratio, 1 - self.epsilon, 1 + self.epsilon)
        per_token = -mx.minimum(ratio * adv, clipped * adv)
        kl = k3_kl(x.logp, x.ref_logp) if x.ref_logp is not None else mx.zeros_like(x.logp)
        if self.beta:
            per_token = per_token + self.beta * kl
        per_seq = (per_token * x.mask).sum(-1) / mx.maximum(x.mask.sum(-1), 1.0)
        loss = per_seq.mean()
        is_clipped = ((ratio < 1 - self.epsilon) & (adv < 0)) | ((ratio > 1 + self.epsilon) & (adv > 0))
        return loss, {"kl": masked_mean(kl, x.mask), "clip_frac": masked_mean(is_clipped, x.mask)}


def make_algorithm(name: str, epsilon: float, beta: float) -> Algorithm:
    algorithms = {"grpo": GRPO}
    if name not in algorithms:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {sorted(algorithms)}")
    return algorithms[name](epsilon=epsilon, beta=beta)

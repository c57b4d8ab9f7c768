"""One optimizer step on a batch of rollout groups: the numerical heart of the learner.

Kept free of sockets and files so tests can drive it directly with real models.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from learner.algorithms import Algorithm, LossInputs
from policy.logprobs import sequence_logprobs
from policy.model import adapters_disabled


@dataclass
class Sample:
    """One completion, as the learner trains on it: the sampled IDs, never re-encoded text."""

    prompt_ids: np.ndarray
    completion_ids: np.ndarray
    behavior_logprobs: np.ndarray
    finish_reason: str


@dataclass
class Batch:
    tokens: mx.array  # [B, L] prompt + completion, right-padded
    mask: mx.array  # [B, L-1] 1 where tokens[:, 1:] is a completion token
    behavior: mx.array  # [B, L-1] actor logprobs at the same positions, 0 elsewhere


def make_batch(samples: list[Sample], pad_id: int) -> Batch:
    """Right-pad prompt+completion rows. Causal attention means padding after a row's
    end cannot change the logprobs before it."""
    length = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    tokens = np.full((len(samples), length), pad_id, dtype=np.int32)
    mask = np.zeros((len(samples), length - 1), dtype=np.float32)
    behavior = np.zeros((len(samples), length - 1), dtype=np.float32)
    for i, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        tokens[i, :p] = s.prompt_ids
        tokens[i, p:p + c] = s.completion_ids
        # Position j predicts tokens[j + 1]: completion tokens sit at p-1 .. p+c-2.
        mask[i, p - 1:p - 1 + c] = 1.0
        behavior[i, p - 1:p - 1 + c] = s.behavior_logprobs
    return Batch(mx.array(tokens), mx.array(mask), mx.array(behavior))


def mismatch_metrics(behavior: mx.array, old: mx.array, mask: mx.array) -> dict[str, float]:
    """How far the actor's behavior logprobs are from the learner's recomputation."""
    # float64: the gaps are ~1e-7 at equal weights, where exp(d) - d - 1 underflows in float32.
    m = np.array(mask, dtype=np.float64)
    diff = (np.array(old, dtype=np.float64) - np.array(behavior, dtype=np.float64)) * m
    n = max(m.sum(), 1.0)
    k3 = (np.expm1(diff) - diff) * m  # k3 estimate of KL(behavior || old)
    return {
        "mismatch_kl": float(k3.sum() / n),
        "mismatch_abs_mean": float(np.abs(diff).sum() / n),
        "mismatch_abs_max": float(np.abs(diff).max()),
    }


def train_step(model: nn.Module, optimizer: optim.Optimizer, algorithm: Algorithm,
               batch: Batch, advantages: np.ndarray, temperature: float, beta: float,
               max_grad_norm: float) -> dict[str, float]:
    """Recompute old-policy (and reference) logprobs, then take one optimizer step."""
    old = mx.stop_gradient(sequence_logprobs(model, batch.tokens, temperature))
    ref = None
    if beta > 0:
        with adapters_disabled(model):
            ref = mx.stop_gradient(sequence_logprobs(model, batch.tokens, temperature))
    mx.eval(old, ref) if ref is not None else mx.eval(old)
    metrics = mismatch_metrics(batch.behavior, old, batch.mask)
    adv = mx.array(advantages.astype(np.float32))

    def loss_fn(model):
        logp = sequence_logprobs(model, batch.tokens, temperature)
        return algorithm.loss(LossInputs(logp, old, ref, adv, batch.mask))

    (loss, extra), grads = nn.value_and_grad(model, loss_fn)(model)
    grads, grad_norm = optim.clip_grad_norm(grads, max_grad_norm)
    optimizer.update(model, grads)
    mx.eval(model.parameters(), optimizer.state, loss, extra, grad_norm)
    metrics.update({k: float(v.item()) for k, v in extra.items()})
    metrics.update(loss=float(loss.item()), grad_norm=float(grad_norm.item()))
    return metrics

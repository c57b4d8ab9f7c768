"""Optimizer steps on a batch of rollout groups: the numerical heart of the learner.

Kept free of sockets and files so tests can drive it directly with real models. A batch is
prepared once (old-policy and reference logprobs, behavior-policy correction weights) and
then used for `num_iterations` optimizer steps, with the old-policy logprobs frozen.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_map

from learner.algorithms import Algorithm, LossInputs, make_algorithm
from policy.logprobs import sequence_logprobs, sequence_logprobs_and_entropy
from policy.model import adapters_disabled
from protocol.config import AlgorithmConfig, SamplingConfig, TrainConfig

# exp() of a sequence's summed log-ratio overflows float32 beyond ~88.
MAX_LOG_WEIGHT = 80.0


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


@dataclass(frozen=True)
class Correction:
    """Behavior-policy correction: weight each token's loss by w = pi_old / pi_behavior.

    mode "truncate" uses min(w, cap); "mask" zeroes tokens with w outside [1/cap, cap];
    "none" uses 1. level "sequence" takes one w per completion (the product of its token
    ratios) instead of one per token.
    """

    mode: str = "none"
    level: str = "token"
    cap: float = 2.0


@dataclass
class Prepared:
    old: mx.array
    ref: mx.array | None
    is_weight: mx.array
    stats: dict[str, float]


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


def correction_weights(old: np.ndarray, behavior: np.ndarray, mask: np.ndarray,
                       c: Correction) -> tuple[np.ndarray, dict[str, float]]:
    """Importance weights pi_old / pi_behavior per token, and how often they were cut.
    float64 throughout: the gaps are ~1e-7 at equal weights."""
    log_w = (old - behavior) * mask
    if c.level == "sequence":
        log_w = np.broadcast_to(log_w.sum(-1, keepdims=True), log_w.shape)
    w = np.exp(np.clip(log_w, -MAX_LOG_WEIGHT, MAX_LOG_WEIGHT))
    on = mask > 0
    stats = {"is_ratio_min": float(w[on].min()), "is_ratio_mean": float(w[on].mean()),
             "is_ratio_max": float(w[on].max())}
    if c.mode == "truncate":
        cut = w > c.cap
        used = np.minimum(w, c.cap)
    elif c.mode == "mask":
        cut = (w > c.cap) | (w < 1 / c.cap)
        used = np.where(cut, 0.0, w)
    else:
        cut = np.zeros_like(on)
        used = np.ones_like(w)
    stats["is_cut_frac"] = float(cut[on].mean())
    return (used * mask).astype(np.float32), stats


def mismatch_metrics(behavior: np.ndarray, old: np.ndarray, mask: np.ndarray) -> dict[str, float]:
    """How far the actor's behavior logprobs are from the learner's recomputation."""
    diff = (old - behavior) * mask
    n = max(mask.sum(), 1.0)
    k3 = (np.expm1(diff) - diff) * mask  # k3 estimate of KL(behavior || old)
    return {
        "mismatch_kl": float(k3.sum() / n),
        "mismatch_abs_mean": float(np.abs(diff).sum() / n),
        "mismatch_abs_max": float(np.abs(diff).max()),
    }


def row_slices(rows: int, micro_batch_size: int) -> list[slice]:
    """The micro-batches of a batch; 0 (or more than the rows) means one."""
    size = micro_batch_size if 0 < micro_batch_size < rows else rows
    return [slice(i, min(i + size, rows)) for i in range(0, rows, size)]


def prepare(model: nn.Module, batch: Batch, temperature: float, beta: float,
            correction: Correction, micro_batch_size: int = 0) -> Prepared:
    """Old-policy logprobs (full forward, current weights), reference logprobs with the
    adapters off when beta > 0, and the behavior-policy correction weights.

    Forwards run over the same micro-batches as the optimizer step: that bounds memory,
    and identical shapes make the first step's ratio exactly 1."""
    olds, entropies, refs = [], [], []
    for sl in row_slices(batch.tokens.shape[0], micro_batch_size):
        old, entropy = sequence_logprobs_and_entropy(model, batch.tokens[sl], temperature)
        mx.eval(old, entropy)
        olds.append(old)
        entropies.append(entropy)
        if beta > 0:
            with adapters_disabled(model):
                refs.append(sequence_logprobs(model, batch.tokens[sl], temperature))
            mx.eval(refs[-1])
    old, entropy = mx.concatenate(olds), mx.concatenate(entropies)
    ref = mx.concatenate(refs) if refs else None
    mask = np.array(batch.mask, dtype=np.float64)
    old64, behavior64 = np.array(old, dtype=np.float64), np.array(batch.behavior, dtype=np.float64)
    weights, stats = correction_weights(old64, behavior64, mask, correction)
    stats.update(mismatch_metrics(behavior64, old64, mask))
    stats["entropy"] = float((np.array(entropy) * mask).sum() / max(mask.sum(), 1.0))
    return Prepared(mx.stop_gradient(old), ref, mx.array(weights), stats)


def _combine(parts: list[tuple[dict, float]]) -> dict[str, float]:
    """Merge micro-batch diagnostics: extremes by max/min, the rest token-weighted."""
    total = sum(n for _, n in parts) or 1.0
    out = {}
    for key in parts[0][0]:
        values = [float(d[key].item()) for d, _ in parts]
        if key.endswith("_max"):
            out[key] = max(values)
        elif key.endswith("_min"):
            out[key] = min(values)
        elif key == "policy_loss":
            out[key] = sum(values)
        else:
            out[key] = sum(v * n for v, (_, n) in zip(values, parts)) / total
    return out


def optimizer_step(model: nn.Module, optimizer: optim.Optimizer, algorithm: Algorithm,
                   batch: Batch, prepared: Prepared, advantages: np.ndarray, temperature: float,
                   max_grad_norm: float, micro_batch_size: int = 0) -> dict[str, float]:
    """One optimizer step, accumulating gradients over micro-batches of rows.

    Each micro-batch's loss is its rows' summed terms over the whole batch's normaliser,
    so the accumulated gradient equals the full batch's exactly (up to float rounding).
    """
    norm = algorithm.normalizer(np.array(batch.mask))
    adv = mx.array(advantages.astype(np.float32))

    def loss_fn(model, sl):
        logp = sequence_logprobs(model, batch.tokens[sl], temperature)
        ref = prepared.ref[sl] if prepared.ref is not None else None
        x = LossInputs(logp, prepared.old[sl], ref, adv[sl], batch.mask[sl], prepared.is_weight[sl])
        total, diag = algorithm.loss_sum(x)
        diag["policy_loss"] = diag["policy_loss"] / norm
        return total / norm, diag

    grad_fn = nn.value_and_grad(model, loss_fn)
    loss, grads, parts = 0.0, None, []
    for sl in row_slices(batch.tokens.shape[0], micro_batch_size):
        (part_loss, diag), part_grads = grad_fn(model, sl)
        grads = part_grads if grads is None else tree_map(mx.add, grads, part_grads)
        mx.eval(part_loss, diag, grads)
        loss += float(part_loss.item())
        parts.append((diag, float(batch.mask[sl].sum().item())))
    grads, grad_norm = optim.clip_grad_norm(grads, max_grad_norm)
    optimizer.update(model, grads)
    mx.eval(model.parameters(), optimizer.state, grad_norm)
    return {"loss": loss, "grad_norm": float(grad_norm.item()), **_combine(parts)}


class Trainer:
    """The step with the run's settings, as the learner's loop and the benchmark run it:
    a batch is prepared once, then each `step` is one optimizer update and its metrics."""

    def __init__(self, model: nn.Module, algorithm: AlgorithmConfig, train: TrainConfig,
                 sampling: SamplingConfig) -> None:
        self.model = model
        self.algorithm = make_algorithm(
            algorithm.name, beta=algorithm.beta, epsilon=algorithm.epsilon,
            epsilon_high=algorithm.epsilon_high, scale_rewards=algorithm.scale_rewards,
            max_tokens=sampling.max_tokens)
        self.correction = Correction(algorithm.is_correction, algorithm.is_level, algorithm.is_cap)
        self.optimizer = optim.Adam(learning_rate=train.learning_rate)
        self.beta, self.num_iterations = algorithm.beta, algorithm.num_iterations
        self.temperature = sampling.temperature
        self.max_grad_norm, self.micro_batch_size = train.max_grad_norm, train.micro_batch_size

    def prepare(self, batch: Batch) -> Prepared:
        return prepare(self.model, batch, self.temperature, self.beta, self.correction, self.micro_batch_size)

    def step(self, batch: Batch, prepared: Prepared, advantages: np.ndarray) -> dict[str, float]:
        return optimizer_step(self.model, self.optimizer, self.algorithm, batch, prepared, advantages,
                              self.temperature, self.max_grad_norm, self.micro_batch_size)

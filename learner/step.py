"""Optimizer steps on a batch of rollout groups: the numerical heart of the learner.

Kept free of sockets and files so tests can drive it directly with real models. A batch is
prepared once (old-policy and reference logprobs, behavior-policy correction weights) and
then used for `num_iterations` optimizer steps, with the old-policy logprobs frozen.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_map

from learner.algorithms import Algorithm, LossInputs, make_algorithm, masked_mean, row_mean
from policy.logprobs import (
    chunked_sequence_terms,
    output_head,
    sequence_logprobs,
    sequence_logprobs_and_entropy,
)
from policy.model import adapters_disabled
from protocol.config import (
    AlgorithmConfig,
    CorrectionLevel,
    CorrectionMode,
    SamplingConfig,
    TrainConfig,
    logit_chunk_positions,
)

# exp() of a sequence's summed log-ratio overflows float32 beyond ~88.
MAX_LOG_WEIGHT = 80.0

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Logits:
    """How the learner forms the logits: all at once inside the differentiated forward,
    or, for a micro-batch of more than `chunk` positions, `chunk` positions at a time
    through the model's output `head` (None: always whole)."""

    head: Callable[[mx.array], mx.array] | None = None
    chunk: int = 0

    def chunked(self, tokens: mx.array) -> bool:
        """Whether the logits of `tokens` [rows, L] (L-1 positions a row) go by chunks."""
        return self.head is not None and tokens.shape[0] * (tokens.shape[1] - 1) > self.chunk


WHOLE = Logits()


@dataclass
class Sample:
    """One completion, as the learner trains on it: the sampled IDs, never re-encoded text."""

    prompt_ids: np.ndarray
    completion_ids: np.ndarray
    behavior_logprobs: np.ndarray
    finish_reason: str
    loss_mask: np.ndarray | None = None  # an episode's: 0 on the environment's tokens

    @property
    def trained_tokens(self) -> int:
        """The completion tokens the model sampled: those the loss sees."""
        return len(self.completion_ids) if self.loss_mask is None else int(self.loss_mask.sum())


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

    mode: CorrectionMode = "none"
    level: CorrectionLevel = "token"
    cap: float = 2.0


@dataclass
class Prepared:
    """What a batch's steps share. With the old-policy pass fused into the training
    forward, `old` and `is_weight` are None and the step computes them (and `stats`)."""

    old: mx.array | None
    ref: mx.array | None
    is_weight: mx.array | None
    stats: dict[str, float]
    correction: Correction

    @property
    def fused(self) -> bool:
        """The step's own forward gives the old-policy logprobs (a single step on the batch)."""
        return self.old is None


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
        # Position j predicts tokens[j + 1]: completion tokens sit at p-1 .. p+c-2. An
        # episode's environment tokens are context, never trained on: mask 0.
        mask[i, p - 1:p - 1 + c] = 1.0 if s.loss_mask is None else s.loss_mask
        behavior[i, p - 1:p - 1 + c] = s.behavior_logprobs * mask[i, p - 1:p - 1 + c]
    return Batch(mx.array(tokens), mx.array(mask), mx.array(behavior))


def correction_weights(old: mx.array, behavior: mx.array, mask: mx.array,
                       c: Correction) -> tuple[mx.array, dict[str, mx.array]]:
    """Importance weights pi_old / pi_behavior per token, and how often they were cut."""
    log_w = (old - behavior) * mask
    if c.level == "sequence":
        log_w = mx.broadcast_to(log_w.sum(-1, keepdims=True), log_w.shape)
    w = mx.exp(mx.clip(log_w, -MAX_LOG_WEIGHT, MAX_LOG_WEIGHT))
    on = mask > 0
    stats = {"is_ratio_min": mx.min(mx.where(on, w, mx.inf)), "is_ratio_mean": masked_mean(w, mask),
             "is_ratio_max": mx.max(mx.where(on, w, -mx.inf))}
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


def old_policy_terms(old: mx.array, entropy: mx.array, behavior: mx.array, mask: mx.array,
                     c: Correction) -> tuple[mx.array, dict[str, mx.array]]:
    """From the old-policy logprobs: the correction weights, and the diagnostics that
    compare them with the actor's (and the policy's entropy). Both paths use this."""
    weights, stats = correction_weights(old, behavior, mask, c)
    stats.update(mismatch_metrics(behavior, old, mask))
    stats["entropy"] = masked_mean(entropy, mask)
    return weights, stats


def row_slices(rows: int, micro_batch_size: int) -> list[slice]:
    """The micro-batches of a batch; 0 (or more than the rows) means one."""
    size = micro_batch_size if 0 < micro_batch_size < rows else rows
    return [slice(i, min(i + size, rows)) for i in range(0, rows, size)]


def prepare(model: nn.Module, batch: Batch, temperature: float, beta: float,
            correction: Correction, micro_batch_size: int = 0, fused: bool = False,
            logits: Logits = WHOLE) -> Prepared:
    """Old-policy logprobs (full forward, current weights), reference logprobs with the
    adapters off when beta > 0, and the behavior-policy correction weights.

    Forwards run over the same micro-batches as the optimizer step: that bounds memory,
    and identical shapes make the first step's ratio exactly 1. `fused` (for a single
    step on the batch) skips the old-policy forward: the step's own forward, with the
    same weights on the same tokens, gives the very same logprobs (stop-gradient)."""
    olds, entropies, refs = [], [], []
    for sl in row_slices(batch.tokens.shape[0], micro_batch_size):
        if not fused:
            old, entropy = _logprobs(model, batch.tokens[sl], temperature, logits, entropy=True)
            olds.append(old)
            entropies.append(entropy)
        if beta > 0:
            with adapters_disabled(model):
                refs.append(_logprobs(model, batch.tokens[sl], temperature, logits)[0])
    ref = mx.concatenate(refs) if refs else None
    if fused:
        return Prepared(None, ref, None, {}, correction)
    old = mx.concatenate(olds)
    weights, stats = old_policy_terms(old, mx.concatenate(cast(list[mx.array], entropies)), batch.behavior,
                                      batch.mask, correction)
    mx.eval(weights, stats)
    return Prepared(old, ref, weights, {k: scalar(v) for k, v in stats.items()}, correction)


def scalar(a: mx.array) -> float:
    """A one-element array's value as a Python float."""
    return float(cast(float, a.item()))


def _logprobs(model: nn.Module, tokens: mx.array, temperature: float, logits: Logits,
              entropy: bool = False) -> tuple[mx.array, mx.array | None]:
    """Logprobs (and entropy) without a graph, evaluated: by chunks when `logits` says."""
    if logits.chunked(tokens):
        assert logits.head is not None  # chunked() says there is one
        logp, ent, _ = chunked_sequence_terms(model, logits.head, tokens, temperature, logits.chunk, entropy)
        return logp, ent
    if entropy:
        logp, ent = sequence_logprobs_and_entropy(model, tokens, temperature)
    else:
        logp, ent = sequence_logprobs(model, tokens, temperature), None
    mx.eval(logp, *([] if ent is None else [ent]))
    return logp, ent


def combine_stats(parts: list[tuple[dict[str, float], float]]) -> dict[str, float]:
    """Merge the diagnostics of parts of a batch (micro-batches, learner ranks), each with
    its token count: extremes by max/min, each part's share of the loss summed, what every
    part has alike (the clipped grad norm, the learning rate) taken once, the rest
    token-weighted."""
    total = sum(n for _, n in parts) or 1.0
    out = {}
    for key in parts[0][0]:
        values = [d[key] for d, _ in parts]
        if key.endswith(("_max", "/max")):
            out[key] = max(values)
        elif key.endswith(("_min", "/min")):
            out[key] = min(values)
        elif key in ("loss", "surrogate_loss"):
            out[key] = sum(values)
        elif key in ("grad_norm", "learning_rate"):
            out[key] = values[0]
        else:
            out[key] = sum(v * n for v, (_, n) in zip(values, parts)) / total
    return out


def optimizer_step(model: nn.Module, optimizer: optim.Optimizer, algorithm: Algorithm,
                   batch: Batch, prepared: Prepared, advantages: np.ndarray, temperature: float,
                   max_grad_norm: float, micro_batch_size: int = 0,
                   logits: Logits = WHOLE, norm: float | None = None,
                   all_sum: Callable[[dict], dict] | None = None) -> dict[str, float]:
    """One optimizer step, accumulating gradients over micro-batches of rows.

    Each micro-batch's loss is its rows' summed terms over the whole batch's normaliser,
    so the accumulated gradient equals the full batch's exactly (up to float rounding).
    A learner rank (learner.ranks) passes its rows as `batch`, the whole batch's `norm`,
    and `all_sum`, which adds every rank's gradients before the clip and the update.
    """
    norm = algorithm.normalizer(np.array(batch.mask)) if norm is None else norm
    adv = mx.array(advantages.astype(np.float32))

    def objective(logp: mx.array, entropy: mx.array | None, sl: slice) -> tuple[mx.array, dict]:
        """The micro-batch's loss as a function of its logprobs (what is differentiated)."""
        mask, extra = batch.mask[sl], cast(dict, {})
        if prepared.old is None or prepared.is_weight is None:  # fused: this forward gives the old logprobs
            assert entropy is not None  # the fused forward computes it
            old = mx.stop_gradient(logp)
            is_weight, extra = old_policy_terms(old, mx.stop_gradient(entropy), batch.behavior[sl], mask,
                                                prepared.correction)
        else:
            old, is_weight = prepared.old[sl], prepared.is_weight[sl]
        ref = prepared.ref[sl] if prepared.ref is not None else None
        total, diag = algorithm.loss_sum(LossInputs(logp, old, ref, adv[sl], mask, is_weight))
        diag["surrogate_loss"] = diag["surrogate_loss"] / norm
        return total / norm, {**diag, **extra}

    def whole_logits(model: nn.Module, sl: slice) -> tuple[mx.array, dict]:
        if prepared.fused:
            return objective(*sequence_logprobs_and_entropy(model, batch.tokens[sl], temperature), sl)
        return objective(sequence_logprobs(model, batch.tokens[sl], temperature), None, sl)

    grad_fn = nn.value_and_grad(model, whole_logits)
    loss, grads, parts = 0.0, None, []
    for sl in row_slices(batch.tokens.shape[0], micro_batch_size):
        if not logits.chunked(batch.tokens[sl]):
            (part_loss, diag), part_grads = grad_fn(model, sl)
        else:
            (part_loss, diag), part_grads = _chunked_value_and_grad(
                model, logits, batch.tokens[sl], temperature, lambda lp, ent, sl=sl: objective(lp, ent, sl),
                entropy=prepared.fused)
        grads = part_grads if grads is None else tree_map(mx.add, grads, part_grads)
        mx.eval(part_loss, diag, grads)
        loss += scalar(part_loss)
        parts.append(({k: scalar(v) for k, v in diag.items()}, scalar(batch.mask[sl].sum())))
    assert grads is not None  # a batch has at least one row
    timing = {}
    if all_sum is not None:
        t0 = time.perf_counter()
        grads = all_sum(grads)
        mx.eval(grads)
        timing["allreduce_s"] = time.perf_counter() - t0  # with the wait for the slowest rank
    grads, grad_norm = optim.clip_grad_norm(grads, max_grad_norm)
    optimizer.update(model, grads)
    mx.eval(model.parameters(), optimizer.state, grad_norm)
    lr = scalar(mx.array(optimizer.learning_rate))
    return {"loss": loss, "grad_norm": scalar(grad_norm), "learning_rate": lr, **combine_stats(parts),
            **timing}


def _chunked_value_and_grad(model: nn.Module, logits: Logits, tokens: mx.array, temperature: float,
                            objective: Callable, entropy: bool) -> tuple[tuple[mx.array, dict], dict]:
    """The objective's value and its gradient in the adapters, never holding more than one
    chunk's logits: the chain rule taken in three evaluated pieces,

        dL/dθ = dL/dlogp · dlogp/dhidden · dhidden/dθ

    (1) logprobs and their jacobian into the last hidden states, chunk by chunk
    (chunked_terms); (2) dL/dlogp, the gradient of the objective in the [rows, tokens]
    logprobs alone; (3) the model body's backward with dL/dhidden as its cotangent, which
    runs the body's forward a second time: the price of never keeping the logits."""
    assert logits.head is not None  # only chunked logits come here
    logp, ent, jac = chunked_sequence_terms(model, logits.head, tokens, temperature, logits.chunk,
                                            entropy, jacobian=True)
    (value, diag), dlogp = mx.value_and_grad(lambda lp: objective(lp, ent))(logp)
    dhidden = dlogp[..., None] * jac
    inputs = tokens[:, :-1]
    _, grads = nn.value_and_grad(model, lambda m: (m.model(inputs) * dhidden).sum())(model)
    return (value, diag), grads


class Trainer:
    """The step with the run's settings, as the learner's loop and the benchmark run it:
    a batch is prepared once, then each `step` is one optimizer update and its metrics."""

    def __init__(self, model: nn.Module, algorithm: AlgorithmConfig, train: TrainConfig,
                 sampling: SamplingConfig, max_completion_tokens: int | None = None) -> None:
        """`max_completion_tokens`: the longest completion, Dr. GRPO's constant normaliser;
        `sampling.max_tokens` unless episodes are longer (`env.max_episode_tokens`)."""
        self.model = model
        self.algorithm = make_algorithm(
            algorithm.name, beta=algorithm.beta, epsilon=algorithm.epsilon,
            epsilon_high=algorithm.epsilon_high, scale_rewards=algorithm.scale_rewards,
            max_tokens=max_completion_tokens or sampling.max_tokens)
        self.correction = Correction(algorithm.is_correction, algorithm.is_level, algorithm.is_cap)
        self.optimizer = optim.Adam(learning_rate=train.learning_rate)
        self.beta, self.num_iterations = algorithm.beta, algorithm.num_iterations
        self.fused = algorithm.num_iterations == 1 and train.fuse_old_logprobs
        self.temperature = sampling.temperature
        self.max_grad_norm, self.micro_batch_size = train.max_grad_norm, train.micro_batch_size
        self.logits = logits_plan(model, train.logit_chunk_mb)

    def prepare(self, batch: Batch) -> Prepared:
        return prepare(self.model, batch, self.temperature, self.beta, self.correction, self.micro_batch_size,
                       self.fused, self.logits)

    def step(self, batch: Batch, prepared: Prepared, advantages: np.ndarray, norm: float | None = None,
             all_sum: Callable[[dict], dict] | None = None) -> dict[str, float]:
        return optimizer_step(self.model, self.optimizer, self.algorithm, batch, prepared, advantages,
                              self.temperature, self.max_grad_norm, self.micro_batch_size, self.logits,
                              norm, all_sum)


def logits_plan(model: nn.Module, chunk_mb: float) -> Logits:
    """Chunks of `chunk_mb` MB of logits when asked for and the model allows, else whole
    (and say why)."""
    if chunk_mb <= 0:
        return WHOLE
    head = output_head(model)
    if head is None:
        log.warning("train.logit_chunk_mb = %g is not used: this model's output layer is not a plain, "
                    "frozen projection of model.model's output (or its forward is random, e.g. LoRA "
                    "dropout); the learner forms each micro-batch's logits at once", chunk_mb)
        return WHOLE
    vocab = model(mx.array([[0]])).shape[-1]
    return Logits(head, logit_chunk_positions(chunk_mb, vocab))

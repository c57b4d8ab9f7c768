"""Optimizer steps on a batch of rollout groups: the numerical heart of the learner.

Kept free of sockets and files so tests can drive it directly with real models. A batch is
prepared once (cut into micro-batches of rows of similar length; old-policy and reference
logprobs, behavior-policy correction weights) and then used for `num_iterations` optimizer
steps, with the old-policy logprobs frozen.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import cast

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_map

from learner.algorithms import LossInputs, make_algorithm, masked_mean, row_mean
from policy.logprobs import (
    Rows,
    chunked_sequence_terms,
    output_head,
    plain_caches,
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

    def chunked(self, positions: int) -> bool:
        """Whether the logits of `positions` positions go by chunks."""
        return self.head is not None and positions > self.chunk


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
    tokens: mx.array  # [B, L] prompt + completion, right-padded to the longest row
    mask: mx.array  # [B, L-1] 1 where tokens[:, 1:] is a completion token
    behavior: mx.array  # [B, L-1] actor logprobs at the same positions, 0 elsewhere
    lengths: np.ndarray  # [B] each row's own prompt + completion tokens
    prompt_lengths: np.ndarray  # [B] each row's prompt tokens

    def take(self, rows: np.ndarray, own_length: bool = True) -> Batch:
        """These rows, padded only to their own longest (or, not `own_length`, as long as
        the batch): the padding cut away came after each row's end, which causal attention
        never lets change a logprob before it."""
        length = int(self.lengths[rows].max()) if own_length else self.tokens.shape[1]
        index = mx.array(rows.astype(np.int32))
        return Batch(
            self.tokens[index, :length],
            self.mask[index, : length - 1],
            self.behavior[index, : length - 1],
            self.lengths[rows],
            self.prompt_lengths[rows],
        )


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
class Micro:
    """A micro-batch: some of the batch's rows as one forward runs them (whole rows padded
    to their own longest, or their group's prompt once and the completions after it), and
    what every step on the batch shares about them. Arrays are [n, T], T the positions
    that predict a target. `old` and `is_weight` are None when the step's own forward gives
    them (Trainer.fused); `ref` when beta is 0."""

    index: np.ndarray  # which of the batch's rows, in the batch's numbering
    rows: Rows
    mask: mx.array  # 1 where the target is a trained completion token
    behavior: mx.array  # the actor's logprobs there, 0 elsewhere
    positions: int  # what its forward computes (each prompt's once, with shared prompts)
    old: mx.array | None = None
    is_weight: mx.array | None = None
    ref: mx.array | None = None

    @cached_property
    def weight(self) -> tuple[float, float]:
        """What its diagnostics are averaged over: its completion tokens and completions.
        Taken once: every step and every merge of its diagnostics asks for it again."""
        return scalar(self.mask.sum()), scalar((self.mask.sum(-1) > 0).sum())


@dataclass
class Prepared:
    """A batch ready for its optimizer steps: its micro-batches, the whole batch's loss
    normaliser, and the diagnostics of the old-policy pass (when fused, which has none,
    only `learner/padding_ratio`: the step gives the rest)."""

    micro: list[Micro]
    norm: float
    stats: dict[str, float]

    @property
    def weight(self) -> tuple[float, float]:
        tokens, completions = zip(*(m.weight for m in self.micro))
        return sum(tokens), sum(completions)


def make_batch(samples: list[Sample], pad_id: int) -> Batch:
    """Right-pad prompt+completion rows. Causal attention means padding after a row's
    end cannot change the logprobs before it."""
    prompt_lengths = np.array([len(s.prompt_ids) for s in samples])
    lengths = prompt_lengths + np.array([len(s.completion_ids) for s in samples])
    tokens = np.full((len(samples), lengths.max()), pad_id, dtype=np.int32)
    mask = np.zeros((len(samples), lengths.max() - 1), dtype=np.float32)
    behavior = np.zeros((len(samples), lengths.max() - 1), dtype=np.float32)
    for i, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        tokens[i, :p] = s.prompt_ids
        tokens[i, p : p + c] = s.completion_ids
        # Position j predicts tokens[j + 1]: completion tokens sit at p-1 .. p+c-2. An
        # episode's environment tokens are context, never trained on: mask 0.
        mask[i, p - 1 : p - 1 + c] = 1.0 if s.loss_mask is None else s.loss_mask
        behavior[i, p - 1 : p - 1 + c] = s.behavior_logprobs * mask[i, p - 1 : p - 1 + c]
    return Batch(mx.array(tokens), mx.array(mask), mx.array(behavior), lengths, prompt_lengths)


# A micro-batch formed by length may compute this much more than its rows' own positions.
PADDING_SLACK = 0.1


def micro_batch_rows(positions: np.ndarray, size: int, by_length: bool = True) -> list[np.ndarray]:
    """The rows of each micro-batch, at most `size` rows each (0: no limit), from the
    positions each row's forward needs (a whole row of n tokens: n - 1; a completion after
    its shared prompt: its length).

    by_length: longest rows first, and a new micro-batch whenever the next row would pad
    the current one beyond PADDING_SLACK of its real positions, so a micro-batch computes
    little but its own rows. Otherwise the rows in order (`train.sort_by_length = false`)."""
    rows = len(positions)
    cap = size if 0 < size < rows else rows
    if not by_length:
        return [np.arange(i, min(i + cap, rows)) for i in range(0, rows, cap)]
    cuts: list[list[int]] = [[]]
    for i in np.argsort(-positions, kind="stable"):
        current = cuts[-1]
        if current:
            real = sum(int(positions[j]) for j in current) + int(positions[i])
            padded = (len(current) + 1) * int(positions[current[0]])
            if len(current) == cap or padded > (1 + PADDING_SLACK) * real:
                cuts.append(current := [])
        current.append(int(i))
    return [np.sort(np.array(c)) for c in cuts]


def whole_rows(batch: Batch, index: np.ndarray, own_length: bool) -> Micro:
    """A micro-batch of whole rows (prompt + completion), padded to their own longest (or,
    not `own_length`, as long as the batch)."""
    part = batch.take(index, own_length)
    rows, length = part.tokens.shape
    return Micro(index, Rows(part.tokens), part.mask, part.behavior, rows * (length - 1))


def shared_prompt_rows(host: dict[str, np.ndarray], batch: Batch, index: np.ndarray) -> Micro:
    """A micro-batch whose rows run each distinct prompt once and then their completions
    alone, right-padded to the longest (`host`: the batch's arrays in NumPy)."""
    starts, ends = batch.prompt_lengths[index], batch.lengths[index]
    width = int((ends - starts).max())
    completions = np.zeros((len(index), width), np.int32)
    mask, behavior = np.zeros((2, len(index), width), np.float32)
    prompts: dict[bytes, int] = {}
    owner = []
    for k, (i, start, end) in enumerate(zip(index, starts, ends)):
        owner.append(prompts.setdefault(host["tokens"][i, :start].tobytes(), len(prompts)))
        completions[k, : end - start] = host["tokens"][i, start:end]
        # The batch's position j predicts token j + 1: a completion's tokens sit at start-1 .. end-2.
        mask[k, : end - start] = host["mask"][i, start - 1 : end - 1]
        behavior[k, : end - start] = host["behavior"][i, start - 1 : end - 1]
    ids = [mx.array(np.frombuffer(key, np.int32)) for key in prompts]
    positions = sum(len(p) for p in ids) + len(index) * (width - 1)
    rows = Rows(mx.array(completions), ids, owner)
    return Micro(index, rows, mx.array(mask), mx.array(behavior), positions)


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


def scalar(a: mx.array) -> float:
    """A one-element array's value as a Python float."""
    return float(cast(float, a.item()))


Head = Callable[[mx.array], mx.array] | None


def _logprobs(
    model: nn.Module, rows: Rows, temperature: float, logits: Logits, head: Head, entropy: bool = False
) -> tuple[mx.array, mx.array | None]:
    """Logprobs (and entropy) without a graph, evaluated: by chunks when `logits` says,
    else whole (through `head`, see Rows.logits)."""
    if logits.chunked(rows.targets.size):
        assert logits.head is not None  # chunked() says there is one
        logp, ent, _ = chunked_sequence_terms(model, logits.head, rows, temperature, logits.chunk, entropy)
        return logp, ent
    if entropy:
        logp, ent = sequence_logprobs_and_entropy(model, rows, temperature, head)
    else:
        logp, ent = sequence_logprobs(model, rows, temperature, head), None
    mx.eval(logp, *([] if ent is None else [ent]))
    return logp, ent


Weighted = tuple[dict[str, float], tuple[float, float]]


def combine_stats(parts: list[Weighted], per_completion: frozenset[str] = frozenset()) -> dict[str, float]:
    """Merge the diagnostics of parts of a batch (micro-batches, learner ranks), each with
    its (completion tokens, completions): extremes by max/min, each part's share of the
    loss summed, what every part has alike (the clipped grad norm, the learning rate)
    taken once, averages over completions (`per_completion`) weighted by completions, the
    rest by tokens."""
    totals = [sum(w[i] for _, w in parts) or 1.0 for i in (0, 1)]
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
            by = 1 if key in per_completion else 0
            out[key] = sum(v * w[by] for v, (_, w) in zip(values, parts)) / totals[by]
    return out


def _chunked_value_and_grad(
    model: nn.Module, logits: Logits, rows: Rows, temperature: float, objective: Callable, entropy: bool
) -> tuple[tuple[mx.array, dict], dict]:
    """The objective's value and its gradient in the adapters, never holding more than one
    chunk's logits: the chain rule taken in three evaluated pieces,

        dL/dθ = dL/dlogp · dlogp/dhidden · dhidden/dθ

    (1) logprobs and their jacobian into the last hidden states, chunk by chunk
    (chunked_terms); (2) dL/dlogp, the gradient of the objective in the [rows, tokens]
    logprobs alone; (3) the model body's backward with dL/dhidden as its cotangent, which
    runs the body's forward a second time: the price of never keeping the logits."""
    assert logits.head is not None  # only chunked logits come here
    logp, ent, jac = chunked_sequence_terms(
        model, logits.head, rows, temperature, logits.chunk, entropy, jacobian=True
    )
    (value, diag), dlogp = mx.value_and_grad(lambda lp: objective(lp, ent))(logp)
    dhidden = dlogp[..., None] * jac
    _, grads = nn.value_and_grad(model, lambda m: (rows.outputs(m.model) * dhidden).sum())(model)
    return (value, diag), grads


class Trainer:
    """The optimizer step with the run's settings, as the learner's loop and the benchmarks
    run it: a batch is prepared once, then each `step` is one optimizer update and its
    metrics.

    Its one mode, `fused` (one step per batch and `train.fuse_old_logprobs`): the old-policy
    logprobs come from the step's own forward (stop-gradient), not from a pass of their own
    in `prepare`: the same weights on the same tokens give the very same logprobs."""

    def __init__(
        self,
        model: nn.Module,
        algorithm: AlgorithmConfig,
        train: TrainConfig,
        sampling: SamplingConfig,
        max_completion_tokens: int | None = None,
        optimizer: optim.Optimizer | None = None,
    ) -> None:
        """`max_completion_tokens`: the longest completion, Dr. GRPO's constant normaliser;
        `sampling.max_tokens` unless episodes are longer (`env.max_episode_tokens`)."""
        self.model = model
        self.algorithm = make_algorithm(
            algorithm.name,
            beta=algorithm.beta,
            epsilon=algorithm.epsilon,
            epsilon_high=algorithm.epsilon_high,
            scale_rewards=algorithm.scale_rewards,
            max_tokens=max_completion_tokens or sampling.max_tokens,
            sapo_temperatures=(algorithm.sapo_temperature_pos, algorithm.sapo_temperature_neg),
        )
        self.correction = Correction(algorithm.is_correction, algorithm.is_level, algorithm.is_cap)
        self.optimizer = optimizer or optim.Adam(learning_rate=train.learning_rate)
        self.beta, self.num_iterations = algorithm.beta, algorithm.num_iterations
        self.fused = algorithm.num_iterations == 1 and train.fuse_old_logprobs
        self.temperature = sampling.temperature
        self.max_grad_norm, self.micro_batch_size = train.max_grad_norm, train.micro_batch_size
        self.sort_by_length = train.sort_by_length
        self.share_prompts = prompts_can_be_shared(model, train)
        self.logits = logits_plan(model, train.logit_chunk_mb)
        # Whole logits go through the output head where the model has a plain one: then a
        # shared prompt's positions but its last never reach it (see Rows.logits).
        self.head = output_head(model)
        # Averages over completions, not tokens: merged across micro-batches by completions.
        sequence_weights = self.correction.level == "sequence" and self.correction.mode != "none"
        self.per_completion = self.algorithm.per_completion | (
            {"sampling/importance_sampling_ratio/mean"} if sequence_weights else set()
        )

    def prepare(self, batch: Batch, norm: float | None = None) -> Prepared:
        """Cut the batch into micro-batches, and take for each its old-policy logprobs (full
        forward, current weights; unless fused), its reference logprobs with the adapters
        off (when beta > 0), and its behavior-policy correction weights.

        The old-policy forwards run over the very micro-batches the optimizer steps will:
        identical shapes make the first step's ratio exactly 1. `norm`: the whole batch's
        loss normaliser, when `batch` is one learner rank's part of it."""
        micro = self.micro_batches(batch)
        parts = [(self._take_old(m), m.weight) for m in micro] if not self.fused else []
        for m in micro:
            if self.beta > 0:
                with adapters_disabled(self.model):
                    m.ref = _logprobs(self.model, m.rows, self.temperature, self.logits, self.head)[0]
        stats = combine_stats(parts, self.per_completion) if parts else {}
        real = int(batch.lengths.sum()) - len(batch.lengths)  # a row of n tokens predicts n - 1
        stats["learner/padding_ratio"] = sum(m.positions for m in micro) / max(real, 1)
        norm = self.algorithm.normalizer(np.array(batch.mask)) if norm is None else norm
        return Prepared(micro, norm, stats)

    def micro_batches(self, batch: Batch) -> list[Micro]:
        """The batch's micro-batches (see micro_batch_rows), each with its prompts once
        when they are shared."""
        if not self.share_prompts:
            cuts = micro_batch_rows(batch.lengths - 1, self.micro_batch_size, self.sort_by_length)
            return [whole_rows(batch, index, own_length=self.sort_by_length) for index in cuts]
        host = {
            "tokens": np.array(batch.tokens),
            "mask": np.array(batch.mask),
            "behavior": np.array(batch.behavior),
        }
        completions = batch.lengths - batch.prompt_lengths
        cuts = micro_batch_rows(completions, self.micro_batch_size, self.sort_by_length)
        return [shared_prompt_rows(host, batch, index) for index in cuts]

    def _take_old(self, m: Micro) -> dict[str, float]:
        """The micro-batch's old-policy logprobs and correction weights; their diagnostics."""
        old, entropy = _logprobs(self.model, m.rows, self.temperature, self.logits, self.head, entropy=True)
        assert entropy is not None  # asked for
        m.old, (m.is_weight, stats) = old, old_policy_terms(old, entropy, m.behavior, m.mask, self.correction)
        mx.eval(m.is_weight, stats)
        return {k: scalar(v) for k, v in stats.items()}

    def step(
        self, prepared: Prepared, advantages: np.ndarray, all_sum: Callable[[dict], dict] | None = None
    ) -> dict[str, float]:
        """One optimizer step, accumulating gradients over the micro-batches.

        Each micro-batch's loss is its rows' summed terms over the whole batch's normaliser,
        so the accumulated gradient equals the full batch's exactly (up to float rounding).
        A learner rank (learner.ranks) passes `all_sum`, which adds every rank's gradients
        before the clip and the update."""
        adv = mx.array(advantages.astype(np.float32))
        grads, loss, parts = None, 0.0, []
        for m in prepared.micro:
            (part_loss, diag), part_grads = self._value_and_grad(
                m, adv[mx.array(m.index.astype(np.int32))], prepared.norm
            )
            grads = part_grads if grads is None else tree_map(mx.add, grads, part_grads)
            mx.eval(part_loss, diag, grads)
            loss += scalar(part_loss)
            parts.append(({k: scalar(v) for k, v in diag.items()}, m.weight))
        assert grads is not None  # a batch has at least one row
        timing = {}
        if all_sum is not None:
            t0 = time.perf_counter()
            grads = all_sum(grads)
            mx.eval(grads)
            timing["allreduce_s"] = time.perf_counter() - t0  # with the wait for the slowest rank
        grads, grad_norm = optim.clip_grad_norm(grads, self.max_grad_norm)
        self.optimizer.update(self.model, grads)
        mx.eval(self.model.parameters(), self.optimizer.state, grad_norm)
        lr = scalar(mx.array(self.optimizer.learning_rate))
        return {
            "loss": loss,
            "grad_norm": scalar(grad_norm),
            "learning_rate": lr,
            **combine_stats(parts, self.per_completion),
            **timing,
        }

    def _objective(
        self, m: Micro, adv: mx.array, norm: float, logp: mx.array, entropy: mx.array | None
    ) -> tuple[mx.array, dict]:
        """The micro-batch's loss as a function of its logprobs (what is differentiated)."""
        mask, extra = m.mask, cast(dict, {})
        if self.fused:  # this forward gives the old-policy logprobs
            assert entropy is not None  # the fused forward computes it
            old = mx.stop_gradient(logp)
            is_weight, extra = old_policy_terms(
                old, mx.stop_gradient(entropy), m.behavior, mask, self.correction
            )
        else:
            assert m.old is not None and m.is_weight is not None  # prepare() took them
            old, is_weight = m.old, m.is_weight
        total, diag = self.algorithm.loss_sum(LossInputs(logp, old, m.ref, adv, mask, is_weight))
        diag["surrogate_loss"] = diag["surrogate_loss"] / norm
        return total / norm, {**diag, **extra}

    def _value_and_grad(self, m: Micro, adv: mx.array, norm: float) -> tuple[tuple[mx.array, dict], dict]:
        rows, head = m.rows, self.head
        if self.logits.chunked(rows.targets.size):
            return _chunked_value_and_grad(
                self.model,
                self.logits,
                rows,
                self.temperature,
                lambda lp, ent: self._objective(m, adv, norm, lp, ent),
                self.fused,
            )

        def whole(model: nn.Module) -> tuple[mx.array, dict]:
            if self.fused:
                logp, entropy = sequence_logprobs_and_entropy(model, rows, self.temperature, head)
                return self._objective(m, adv, norm, logp, entropy)
            return self._objective(m, adv, norm, sequence_logprobs(model, rows, self.temperature, head), None)

        return nn.value_and_grad(self.model, whole)(self.model)


def prompts_can_be_shared(model: nn.Module, train: TrainConfig) -> bool:
    """Whether `train.share_prompts` can be honoured (and say why not)."""
    if not train.share_prompts:
        return False
    if train.grad_checkpoint:  # its recomputation would write each layer's KV cache twice
        log.warning("train.share_prompts is not used with train.grad_checkpoint: every row runs its prompt")
        return False
    if not plain_caches(model):
        log.warning(
            "train.share_prompts is not used: this model's KV caches are not mlx-lm's plain "
            "KVCache (rotating or quantized caches cannot be merged); every row runs its prompt"
        )
        return False
    return True


def logits_plan(model: nn.Module, chunk_mb: float) -> Logits:
    """Chunks of `chunk_mb` MB of logits when asked for and the model allows, else whole
    (and say why)."""
    if chunk_mb <= 0:
        return WHOLE
    head = output_head(model)
    if head is None:
        log.warning(
            "train.logit_chunk_mb = %g is not used: this model's output layer is not a plain, "
            "frozen projection of model.model's output (or its forward is random, e.g. LoRA "
            "dropout); the learner forms each micro-batch's logits at once",
            chunk_mb,
        )
        return WHOLE
    vocab = model(mx.array([[0]])).shape[-1]
    return Logits(head, logit_chunk_positions(chunk_mb, vocab))

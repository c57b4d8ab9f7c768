"""Optimizer steps on a batch of rollout groups: the numerical heart of the learner.

Kept free of sockets and files so tests can drive it directly with real models. A batch is
prepared once (cut into micro-batches by learner.batching; old-policy and reference
logprobs; behavior-policy correction weights from learner.correction) and then used for
`num_iterations` optimizer steps, with the old-policy logprobs frozen.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map

from learner.algorithms import LossInputs, load_algorithm
from learner.batching import (
    Batch,
    Logits,
    Micro,
    Prepared,
    TrainRow,
    carried_prompts,
    completion_values,
    logits_plan,
    make_batch,
    micro_batch_rows,
    prompt_ids,
    prompt_keys,
    prompts_can_be_shared,
    scalar,
    shared_prompt_rows,
    whole_rows,
)
from learner.correction import Correction, old_policy_terms
from policy.logprobs import (
    PromptState,
    Rows,
    chunked_sequence_terms,
    output_head,
    random_forward,
    run_prompt,
    sequence_logprobs,
    sequence_logprobs_and_entropy,
)
from policy.model import adapters_disabled
from runtime import spans
from runtime.config import AlgorithmConfig, SamplingConfig, TrainConfig

Head = Callable[[mx.array], mx.array] | None


class StepStopped(Exception):
    """A stop was asked for between two micro-batches: the step's work so far is thrown
    away and nothing is updated."""


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


# (the loss and its diagnostics), the gradient in the adapters, and in the given states.
ValueAndGrads = tuple[tuple[mx.array, dict], dict, list[PromptState]]


def _arrays(tree: list[PromptState]) -> list[mx.array]:
    """The states' arrays, in one order for every tree of the same shape."""
    return [a for _, a in cast(list[tuple[str, mx.array]], tree_flatten(tree))]


def _value_and_grads(model: nn.Module, fn: Callable, given: list[PromptState]) -> ValueAndGrads:
    """fn(given)'s value, and its gradients in the model's trainable parameters and in
    `given` (the states of prompts carried across micro-batches, Rows.given)."""

    def inner(params: dict, given: list[PromptState]) -> tuple[mx.array, dict]:
        model.update(params)
        return fn(given)

    value, (grads, dgiven) = mx.value_and_grad(inner, argnums=(0, 1))(model.trainable_parameters(), given)
    return value, grads, dgiven


def _chunked_value_and_grad(
    model: nn.Module, logits: Logits, rows: Rows, temperature: float, objective: Callable, entropy: bool
) -> ValueAndGrads:
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
    _, grads, dgiven = _value_and_grads(
        model, lambda given: (rows.with_given(given).outputs(model.model) * dhidden).sum(), rows.given
    )
    return (value, diag), grads, dgiven


@dataclass
class Gradient:
    """The loss gradient in the adapters, summed over micro-batches on its way to an
    optimizer step, with the loss and each micro-batch's diagnostics."""

    grads: dict | None = None
    loss: float = 0.0
    parts: list[Weighted] = field(default_factory=list)

    def add(self, grads: dict) -> None:
        self.grads = grads if self.grads is None else tree_map(mx.add, self.grads, grads)

    def normalize(self, norm: float) -> None:
        """Divide what was summed over `norm`, the whole batch's loss normaliser: the
        gradient, the loss and each part's share of the surrogate loss (the other
        diagnostics are averages, whatever the normaliser)."""
        assert self.grads is not None  # a batch has at least one row
        self.grads = tree_map(lambda g: g / norm, self.grads)
        self.loss /= norm
        for diag, _ in self.parts:
            diag["surrogate_loss"] /= norm


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
        search_path: str | None = None,
    ) -> None:
        """`max_completion_tokens`: the longest completion, Dr. GRPO's constant normaliser;
        `sampling.max_tokens` unless episodes are longer (`env.max_episode_tokens`).
        `search_path`: where a user's `module:Class` loss is looked for first."""
        self.model = model
        self.algorithm = load_algorithm(algorithm, max_completion_tokens or sampling.max_tokens, search_path)
        self.correction = Correction(algorithm.is_correction, algorithm.is_level, algorithm.is_cap)
        self.optimizer = optimizer or optim.Adam(learning_rate=train.learning_rate)
        self.beta, self.num_iterations = algorithm.beta, algorithm.num_iterations
        self.fused = algorithm.num_iterations == 1 and train.fuse_old_logprobs
        self.temperature = sampling.temperature
        self.max_grad_norm, self.micro_batch_size = train.max_grad_norm, train.micro_batch_size
        self.sort_by_length = train.sort_by_length
        # Asked between micro-batches: True ends the step unfinished (StepStopped). A learner
        # alone sets it to its stop signal; ranks finish a step together.
        self.stopping: Callable[[], bool] = lambda: False
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
        micro, carried = self.micro_batches(batch)
        parts = []
        if not self.fused:
            states = self.prompt_states(carried)
            parts = [(self._take_old(m, states), m.weight) for m in micro]
        if self.beta > 0:
            self._take_reference(batch, micro, carried)
        real = int(batch.lengths.sum()) - len(batch.lengths)  # a row of n tokens predicts n - 1
        norm = self.algorithm.normalizer(np.array(batch.mask)) if norm is None else norm
        prepared = Prepared(micro, norm, {}, parts, real, carried)
        prepared.stats = self.prepared_stats([prepared])
        return prepared

    def _take_reference(self, batch: Batch, micro: list[Micro], carried: list[mx.array]) -> None:
        """Each micro-batch's reference logprobs: those taken ahead when all its rows have
        them (Batch.reference), else a forward with the adapters off."""
        pending = []
        for m in micro:
            if batch.reference is not None and not np.isnan(batch.reference[m.index]).any():
                m.ref, m.ref_ahead = m.per_token(batch.reference), True
            else:
                pending.append(m)
        if pending:
            self._reference_pass(pending, carried)

    def _reference_pass(self, micro: list[Micro], carried: list[mx.array]) -> None:
        """The micro-batches' reference logprobs (`ref`): their forward with the adapters off."""
        with adapters_disabled(self.model):
            states = self.prompt_states(carried)
            for m in micro:
                self.check_stop()
                rows = m.rows_given(states)
                m.ref = _logprobs(self.model, rows, self.temperature, self.logits, self.head)[0]

    def reference_logprobs(self, samples: list[TrainRow]) -> list[np.ndarray]:
        """Each sample's completion's reference logprobs (the adapters off), as a step's
        reference pass would take them: what the learner computes for a queued group while
        it would otherwise wait (they do not depend on the adapters, so any later step can
        use them)."""
        batch = make_batch(samples, 0)  # causal: what follows a row's end changes nothing of it
        micro, carried = self.micro_batches(batch)
        self._reference_pass(micro, carried)
        out = np.zeros(batch.mask.shape, np.float32)
        for m in micro:
            m.put(np.array(m.ref), out)
        return completion_values(samples, out)

    def prepared_stats(self, parts: list[Prepared]) -> dict[str, float]:
        """The old-policy pass's diagnostics of a batch prepared in `parts` (the groups that
        were at hand each time), and its padding: what its forwards compute over what its
        rows predict."""
        old = [p for prepared in parts for p in prepared.old_parts]
        stats = combine_stats(old, self.per_completion) if old else {}
        positions = sum(prepared.positions for prepared in parts)
        stats["learner/padding_ratio"] = positions / max(sum(prepared.real for prepared in parts), 1)
        return stats

    def micro_batches(self, batch: Batch) -> tuple[list[Micro], list[mx.array]]:
        """The batch's micro-batches (see micro_batch_rows), and, when prompts are shared,
        the prompts whose rows went to several of them (Prepared.carried)."""
        if not self.share_prompts:
            cuts = micro_batch_rows(batch.lengths - 1, self.micro_batch_size, self.sort_by_length)
            return [whole_rows(batch, index, own_length=self.sort_by_length) for index in cuts], []
        host = {
            "tokens": np.array(batch.tokens),
            "mask": np.array(batch.mask),
            "behavior": np.array(batch.behavior),
        }
        completions = batch.lengths - batch.prompt_lengths
        keys = prompt_keys(host, batch)
        # A prompt read by several micro-batches runs once for all, plus a forward more
        # without a graph (prompt_states): about half what its forward and backward cost,
        # LoRA's backward costing about a forward (the base weights are frozen). So a
        # micro-batch pays half of each prompt it reads: splitting a group's rows in two
        # costs what carrying its prompt adds (in three or more, the cut overcharges).
        # Not under dropout: the states taken once and the differentiated forward after the
        # micro-batches would draw two masks, so each micro-batch runs its prompts.
        carry = not random_forward(self.model)
        costs = [(key, (length + 1) // 2) for key, length in keys] if carry else keys
        cuts = micro_batch_rows(completions, self.micro_batch_size, self.sort_by_length, costs)
        carried = carried_prompts(keys, cuts) if carry else {}
        micro = [shared_prompt_rows(host, batch, index, keys, carried) for index in cuts]
        return micro, [prompt_ids(key) for key in carried]

    def _net(self, model: nn.Module) -> nn.Module:
        """What a prompt runs through: the model's body when its logits go through the output
        head, else the model (Rows.logits, chunked_sequence_terms)."""
        return model.model if self.head is not None else model

    @property
    def body(self) -> nn.Module:
        """What prompts and rows run through before the head (see _net): the reference
        logprobs taken ahead run through it too (learner/ahead.py)."""
        return self._net(self.model)

    def prompt_states(self, prompts: list[mx.array]) -> list[PromptState]:
        """Carried prompts run at the current weights, evaluated, without a graph."""
        states = [run_prompt(self.body, p) for p in prompts]
        mx.eval(states)
        return states

    def _prompts_backward(
        self, gradient: Gradient, prompts: list[mx.array], cotangents: list[PromptState]
    ) -> None:
        """Add the carried prompts' share of the gradient: their forward again,
        differentiated, with what the micro-batches' backwards sent to their states as its
        cotangent. One prompt at a time, so that one prompt's activations are held at once."""

        def dot(model: nn.Module, prompt: mx.array, cotangent: PromptState) -> mx.array:
            pairs = zip(_arrays([run_prompt(self._net(model), prompt)]), _arrays([cotangent]))
            return sum(((a * c).sum() for a, c in pairs), mx.array(0.0))

        for prompt, cotangent in zip(prompts, cotangents):
            gradient.add(nn.value_and_grad(self.model, dot)(self.model, prompt, cotangent)[1])
            mx.eval(gradient.grads)

    def check_stop(self) -> None:
        if self.stopping():
            raise StepStopped

    def _take_old(self, m: Micro, states: list[PromptState]) -> dict[str, float]:
        """The micro-batch's old-policy logprobs and correction weights; their diagnostics.
        `states`: the carried prompts' (prompt_states)."""
        self.check_stop()
        rows = m.rows_given(states)
        old, entropy = _logprobs(self.model, rows, self.temperature, self.logits, self.head, entropy=True)
        assert entropy is not None  # asked for
        m.old, (m.is_weight, stats) = old, old_policy_terms(old, entropy, m.behavior, m.mask, self.correction)
        mx.eval(m.is_weight, stats)
        return {k: scalar(v) for k, v in stats.items()}

    def step(
        self, prepared: Prepared, advantages: np.ndarray, all_sum: Callable[[dict], dict] | None = None
    ) -> dict[str, float]:
        """One optimizer step on a whole prepared batch (see `accumulate` and `update`).
        A learner rank (learner.ranks) passes `all_sum`, which adds every rank's gradients
        before the clip and the update."""
        gradient = Gradient()
        self.accumulate(gradient, prepared, advantages, prepared.norm)
        return self.update(gradient, all_sum)

    def accumulate(self, gradient: Gradient, prepared: Prepared, advantages: np.ndarray, norm: float) -> None:
        """Add the gradient of the prepared rows' loss to `gradient`, micro-batch by micro-batch.

        Each micro-batch's loss is its rows' summed terms over `norm`: the whole batch's
        normaliser, so the accumulated gradient equals the full batch's exactly (up to
        float rounding); or 1 while the batch's groups are still arriving, and
        `Gradient.normalize` divides the sum once the batch is complete. `advantages`:
        [B], or [B, T] per token laid out as the batch's mask (GiGPO), which each
        micro-batch lays out as its own (Micro.per_token)."""
        adv = mx.array(advantages.astype(np.float32)) if advantages.ndim == 1 else None
        states = self.prompt_states(prepared.carried)
        # What the micro-batches send back to the states, summed in float32 as the gradient is.
        cotangents = tree_map(lambda a: mx.zeros(a.shape, mx.float32), states)
        for m in prepared.micro:
            self.check_stop()
            rows_adv = adv[mx.array(m.index.astype(np.int32))] if adv is not None else m.per_token(advantages)
            with spans.span("forward and backward", rows=len(m.index), positions=m.positions):
                (loss, diag), grads, dgiven = self._value_and_grad(m, m.rows_given(states), rows_adv, norm)
                gradient.add(grads)
                for i, d in zip(m.carried, dgiven):
                    cotangents[i] = tree_map(lambda c, g: c + g.astype(mx.float32), cotangents[i], d)
                mx.eval(loss, diag, gradient.grads, cotangents)
            gradient.loss += scalar(loss)
            gradient.parts.append(({k: scalar(v) for k, v in diag.items()}, m.weight))
        if prepared.carried:
            self.check_stop()
            with spans.span("forward and backward", rows=0, positions=prepared.carried_positions):
                self._prompts_backward(gradient, prepared.carried, cotangents)

    def update(self, gradient: Gradient, all_sum: Callable[[dict], dict] | None = None) -> dict[str, float]:
        """The optimizer step on an accumulated (and normalised) gradient, and its metrics.
        `all_sum` (learner ranks): adds every rank's gradients before the clip."""
        grads, timing = gradient.grads, {}
        assert grads is not None  # a batch has at least one row
        if all_sum is not None:
            t0 = time.perf_counter()
            grads = all_sum(grads)
            mx.eval(grads)
            timing["allreduce_s"] = time.perf_counter() - t0  # with the wait for the slowest rank
        with spans.span("optimizer update"):
            grads, grad_norm = optim.clip_grad_norm(grads, self.max_grad_norm)
            self.optimizer.update(self.model, grads)
            mx.eval(self.model.parameters(), self.optimizer.state, grad_norm)
        lr = scalar(mx.array(self.optimizer.learning_rate))
        return {
            "loss": gradient.loss,
            "grad_norm": scalar(grad_norm),
            "learning_rate": lr,
            **combine_stats(gradient.parts, self.per_completion),
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
        ref = m.ref
        if m.ref is not None and m.ref_ahead:  # known on the trained tokens only: no KL elsewhere
            ref = mx.where(mask > 0, m.ref, mx.stop_gradient(logp))
        total, diag = self.algorithm.loss_sum(LossInputs(logp, old, ref, adv, mask, is_weight))
        diag["surrogate_loss"] = diag["surrogate_loss"] / norm
        return total / norm, {**diag, **extra}

    def _value_and_grad(self, m: Micro, rows: Rows, adv: mx.array, norm: float) -> ValueAndGrads:
        """The micro-batch's loss and its gradients (in the adapters and in the carried
        prompts' states that `rows` is given)."""
        model, head = self.model, self.head
        if self.logits.chunked(rows.targets.size):
            return _chunked_value_and_grad(
                model,
                self.logits,
                rows,
                self.temperature,
                lambda lp, ent: self._objective(m, adv, norm, lp, ent),
                self.fused,
            )

        def whole(given: list[PromptState]) -> tuple[mx.array, dict]:
            these = rows.with_given(given)
            if self.fused:
                logp, entropy = sequence_logprobs_and_entropy(model, these, self.temperature, head)
                return self._objective(m, adv, norm, logp, entropy)
            logp = sequence_logprobs(model, these, self.temperature, head)
            return self._objective(m, adv, norm, logp, None)

        return _value_and_grads(model, whole, rows.given)

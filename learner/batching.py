"""A batch of rollout samples as the learner's forwards run it: prompt + completion rows
right-padded into one batch, cut into micro-batches of rows of similar length (each distinct
prompt run once when prompts are shared), with the logits formed whole or by chunks. Kept
apart from the optimizer step so the layout, which decides how much a step computes and
holds, can be tested on its own; free of sockets and files, like the trainer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from policy.logprobs import PromptState, Rows, output_head, plain_caches
from runtime.config import TrainConfig, logit_chunk_positions

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
class TrainRow:
    """One completion, as the learner trains on it: the sampled IDs, never re-encoded text."""

    prompt_ids: np.ndarray
    completion_ids: np.ndarray
    behavior_logprobs: np.ndarray
    finish_reason: str
    loss_mask: np.ndarray | None = None  # an episode's: 0 on the environment's tokens
    # Its completion's reference logprobs, when the learner took them while it waited
    # (Trainer.reference_logprobs); None: the step's reference pass takes them.
    reference_logprobs: np.ndarray | None = None

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
    # Reference logprobs taken ahead (TrainRow.reference_logprobs), laid out as the mask,
    # NaN on the completions of rows without; None: no row has them.
    reference: np.ndarray | None = None

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
            None if self.reference is None else self.reference[rows, : length - 1],
        )


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
    positions: int  # what its forward computes (its own prompts once, with shared prompts)
    # Which of the batch's carried prompts (Prepared.carried) its rows read, in the order
    # their states come after its own prompts (Rows.given).
    carried: list[int] = field(default_factory=list)
    old: mx.array | None = None
    is_weight: mx.array | None = None
    ref: mx.array | None = None
    # `ref` taken ahead (Batch.reference): known only where `mask` is 1 (Trainer._objective).
    ref_ahead: bool = False
    # Where each row's first position sits in the batch's [B, T] arrays (None: at 0, whole
    # rows); what lays out a per-token array of the batch as this micro-batch's (per_token).
    offsets: np.ndarray | None = None

    def rows_given(self, states: list[PromptState]) -> Rows:
        """Its rows, given the carried prompts' `states` it reads (the batch's, in order)."""
        return self.rows.with_given([states[i] for i in self.carried])

    def per_token(self, values: np.ndarray) -> mx.array:
        """This micro-batch's part of `values`, an array laid out as the batch's mask
        ([rows, T] in the numbering of `index`), laid out as its own mask is."""
        width = self.mask.shape[1]
        offsets = np.zeros(len(self.index), np.int64) if self.offsets is None else self.offsets
        # Zeros after the batch's end: a row after a shared prompt may run past it.
        padded = np.pad(values[self.index], ((0, 0), (0, width)))
        columns = offsets[:, None] + np.arange(width)
        return mx.array(np.take_along_axis(padded, columns, axis=1).astype(np.float32))

    def put(self, values: np.ndarray, out: np.ndarray) -> None:
        """The inverse of `per_token`: write `values` ([rows, T], laid out as this
        micro-batch's mask) into `out`, laid out as the batch's."""
        offsets = np.zeros(len(self.index), np.int64) if self.offsets is None else self.offsets
        for k, row in enumerate(self.index):
            columns = offsets[k] + np.arange(values.shape[1])
            inside = columns < out.shape[1]
            out[row, columns[inside]] = values[k, inside]

    @cached_property
    def weight(self) -> tuple[float, float]:
        """What its diagnostics are averaged over: its completion tokens and completions.
        Taken once: every step and every merge of its diagnostics asks for it again."""
        return scalar(self.mask.sum()), scalar((self.mask.sum(-1) > 0).sum())


@dataclass
class Prepared:
    """A batch ready for its optimizer steps: its micro-batches, the whole batch's loss
    normaliser, and the diagnostics of the old-policy pass (when fused, which has none,
    only `learner/padding_ratio`: the step gives the rest); `old_parts` and `real` are
    what those diagnostics are merged from (Trainer.prepared_stats)."""

    micro: list[Micro]
    norm: float
    stats: dict[str, float]
    old_parts: list[tuple[dict[str, float], tuple[float, float]]] = field(default_factory=list)
    real: int = 0  # the positions its rows predict (a row of n tokens: n - 1)
    # Prompts whose rows went to several micro-batches: each runs once a pass, its state
    # given to those micro-batches (Rows.given), its gradient taken once (Trainer.accumulate).
    carried: list[mx.array] = field(default_factory=list)

    @property
    def carried_positions(self) -> int:
        return sum(len(p) for p in self.carried)

    @property
    def positions(self) -> int:
        """What its forwards compute: the micro-batches' and the carried prompts' (once,
        though a training pass runs them twice: Trainer.accumulate)."""
        return sum(m.positions for m in self.micro) + self.carried_positions

    @property
    def weight(self) -> tuple[float, float]:
        tokens, completions = zip(*(m.weight for m in self.micro))
        return sum(tokens), sum(completions)


def make_batch(samples: list[TrainRow], pad_id: int) -> Batch:
    """Right-pad prompt+completion rows. Causal attention means padding after a row's
    end cannot change the logprobs before it."""
    prompt_lengths = np.array([len(s.prompt_ids) for s in samples])
    lengths = prompt_lengths + np.array([len(s.completion_ids) for s in samples])
    tokens = np.full((len(samples), lengths.max()), pad_id, dtype=np.int32)
    mask = batch_mask(samples)
    behavior = np.zeros_like(mask)
    for i, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        tokens[i, :p] = s.prompt_ids
        tokens[i, p : p + c] = s.completion_ids
        behavior[i, p - 1 : p - 1 + c] = s.behavior_logprobs * mask[i, p - 1 : p - 1 + c]
    batch = Batch(mx.array(tokens), mx.array(mask), mx.array(behavior), lengths, prompt_lengths)
    if any(s.reference_logprobs is not None for s in samples):
        nan = [np.full(len(s.completion_ids), np.nan) for s in samples]
        ahead = [n if s.reference_logprobs is None else s.reference_logprobs for s, n in zip(samples, nan)]
        batch.reference = token_rows(samples, ahead)
    return batch


def batch_mask(samples: list[TrainRow]) -> np.ndarray:
    """make_batch's mask of these rows: 1 where position j predicts a trained completion
    token (tokens[j + 1]); an episode's environment tokens are context, never trained on."""
    trained = [np.ones(len(s.completion_ids)) if s.loss_mask is None else s.loss_mask for s in samples]
    return token_rows(samples, trained)


def token_rows(samples: list[TrainRow], values: list[np.ndarray]) -> np.ndarray:
    """Per-token values of each sample's completion (e.g. GiGPO's advantages), as
    make_batch lays out its mask: [B, longest row - 1], 0 off the completions."""
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
    out = np.zeros((len(samples), max(lengths) - 1), dtype=np.float32)
    for i, (s, v) in enumerate(zip(samples, values)):
        out[i, _completion_span(s)] = v
    return out


def completion_values(samples: list[TrainRow], rows: np.ndarray) -> list[np.ndarray]:
    """Each sample's completion's values out of `rows` laid out as token_rows lays them:
    its inverse (e.g. reference logprobs taken for a group before its batch)."""
    return [rows[i, _completion_span(s)] for i, s in enumerate(samples)]


def _completion_span(s: TrainRow) -> slice:
    """Where a sample's completion sits in its row of make_batch's layout: position j
    predicts token j + 1, so the first completion token is predicted at len(prompt) - 1."""
    start = len(s.prompt_ids) - 1
    return slice(start, start + len(s.completion_ids))


# What one more forward and backward costs beyond its positions, counted in positions (a
# call per layer, smaller matrices). On a 2-core CPU the learner's step went with the
# positions it computed, whatever their number of forwards (benchmarks/learner_lengths.py):
# a small cost here only breaks ties toward fewer, larger forwards, which a GPU fills better.
FORWARD_POSITIONS = 16


def micro_batch_rows(
    positions: np.ndarray, size: int, by_length: bool = True, prompts: list[tuple[bytes, int]] | None = None
) -> list[np.ndarray]:
    """The rows of each micro-batch, at most `size` rows each (0: no limit), from the
    positions each row's forward needs (a whole row of n tokens: n - 1; a completion after
    its shared prompt: its length). `prompts`: each row's shared prompt (a key and what a
    micro-batch that reads it pays, in positions), paid once whatever rows of it it holds.

    by_length: longest rows first, cut where the micro-batches cost least in all: each
    computes its rows padded to its longest, pays for each of its distinct prompts, and
    FORWARD_POSITIONS for being a forward at all (an exact minimum over every cut of the
    sorted rows, by dynamic programming). Rows of similar length go together, and rows far
    apart in length go together too when running them apart would cost more (what their
    prompts cost again, another forward). Otherwise the rows in order (`train.sort_by_length =
    false`)."""
    rows = len(positions)
    cap = size if 0 < size < rows else rows
    if not by_length:
        return [np.arange(i, min(i + cap, rows)) for i in range(0, rows, cap)]
    order = np.argsort(-positions, kind="stable")
    width = [int(positions[i]) for i in order]  # a micro-batch starting at k is this wide
    best = [0] + [-1] * rows  # best[j]: the least cost of the first j sorted rows
    start = [0] * (rows + 1)  # where the last micro-batch of that best cut starts
    for j in range(1, rows + 1):
        seen: set[bytes] = set()
        prompt_positions = 0
        for k in range(j - 1, max(j - cap, 0) - 1, -1):  # the last micro-batch is rows k .. j-1
            if prompts is not None:
                key, length = prompts[order[k]]
                if key not in seen:
                    seen.add(key)
                    prompt_positions += length
            padded = (j - k) * width[k]
            if best[j] >= 0 and padded >= best[j]:
                break  # wider still from here on, whatever came before
            cost = best[k] + padded + prompt_positions + FORWARD_POSITIONS
            if best[j] < 0 or cost < best[j]:
                best[j], start[j] = cost, k
    cuts = []
    j = rows
    while j:
        cuts.append(np.sort(order[start[j] : j]))
        j = start[j]
    return cuts[::-1]


def whole_rows(batch: Batch, index: np.ndarray, own_length: bool) -> Micro:
    """A micro-batch of whole rows (prompt + completion), padded to their own longest (or,
    not `own_length`, as long as the batch)."""
    part = batch.take(index, own_length)
    rows, length = part.tokens.shape
    return Micro(index, Rows(part.tokens), part.mask, part.behavior, rows * (length - 1))


def prompt_keys(host: dict[str, np.ndarray], batch: Batch) -> list[tuple[bytes, int]]:
    """Each row's prompt as a key (its token ids' bytes) and its length: rows with equal
    keys share their prompt (`host`: the batch's arrays in NumPy)."""
    return [(host["tokens"][i, :n].tobytes(), int(n)) for i, n in enumerate(batch.prompt_lengths)]


def carried_prompts(keys: list[tuple[bytes, int]], cuts: list[np.ndarray]) -> dict[bytes, int]:
    """The prompts (prompt_keys) whose rows are in more than one of `cuts`, numbered: each
    runs once for all of them, not once in each."""
    reads: dict[bytes, int] = {}
    for index in cuts:
        for key in {keys[i][0] for i in index}:
            reads[key] = reads.get(key, 0) + 1
    return {key: n for n, key in enumerate(k for k, count in reads.items() if count > 1)}


def shared_prompt_rows(
    host: dict[str, np.ndarray],
    batch: Batch,
    index: np.ndarray,
    keys: list[tuple[bytes, int]],
    carried: dict[bytes, int],
) -> Micro:
    """A micro-batch whose rows run each distinct prompt once and then their completions
    alone, right-padded to the longest (`host`: the batch's arrays in NumPy; `keys`: each
    row's prompt_keys). A prompt in `carried` is not run here but given (Micro.carried)."""
    starts, ends = batch.prompt_lengths[index], batch.lengths[index]
    width = int((ends - starts).max())
    completions = np.zeros((len(index), width), np.int32)
    mask, behavior = np.zeros((2, len(index), width), np.float32)
    own = list(dict.fromkeys(keys[i][0] for i in index if keys[i][0] not in carried))
    others = list(dict.fromkeys(keys[i][0] for i in index if keys[i][0] in carried))
    reads = {key: n for n, key in enumerate(own + others)}  # Rows.owner: own prompts, then given
    owner = []
    for k, (i, start, end) in enumerate(zip(index, starts, ends)):
        owner.append(reads[keys[i][0]])
        completions[k, : end - start] = host["tokens"][i, start:end]
        # The batch's position j predicts token j + 1: a completion's tokens sit at start-1 .. end-2.
        mask[k, : end - start] = host["mask"][i, start - 1 : end - 1]
        behavior[k, : end - start] = host["behavior"][i, start - 1 : end - 1]
    ids = [prompt_ids(key) for key in own]
    positions = sum(len(p) for p in ids) + len(index) * (width - 1)
    rows = Rows(mx.array(completions), ids, owner)
    numbers = [carried[key] for key in others]
    return Micro(index, rows, mx.array(mask), mx.array(behavior), positions, numbers, offsets=starts - 1)


def prompt_ids(key: bytes) -> mx.array:
    """A prompt_keys key's token ids."""
    return mx.array(np.frombuffer(key, np.int32))


def scalar(a: mx.array) -> float:
    """A one-element array's value as a Python float."""
    return float(cast(float, a.item()))


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

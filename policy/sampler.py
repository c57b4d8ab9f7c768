"""Sampling a token, with its behavior logprob, reproducible by seed.

`sample_tokens` draws one token for every row of a batch; the decode loop around it is
policy/engine.py's, the only one (its `sample_groups` runs that engine static, all rows as
one batch, for serving, evaluation and benchmarks). The prefill the engine uses is here
too: all prompts at once, left-padded and masked in mlx-lm's BatchKVCache (the machinery of
its own batch_generate), each prompt's cache rows then repeated for its G samples.

For every sampled token we keep its logprob under the temperature-scaled, untruncated
distribution, computed as in policy/logprobs.py (which explains why untruncated).

Randomness. Sampling is Gumbel-max: token = argmax(truncate(logprobs) + g) over the tokens
that top-k/top-p/min-p keep, a draw from the truncated, renormalized distribution. The
noise g of row r at step t for token v is -log(-log(u)), u a hash of (seed, r, t, v)
(`_noise`), where r is the row's noise id (noise_offset + prompt position * group_size + sample
index). So a row's tokens depend only on (seed, r) and its own logits, never on which
other rows share the batch, and the whole batch's noise is a few array operations.

Cost at a large vocabulary. Truncation is a cut on the logprobs (`threshold`), found among
the 1,024 most likely tokens (a partition, then a sort of those few) and noise is drawn
for them alone. When the cut is not inside the candidates (a nearly flat distribution: top-p
keeps most of the vocabulary, which a bound on the candidates' mass often tells before
looking), the token is drawn without the cut (`_draw_by_mass`): the Gumbel-max over every
token, then a check of the drawn token's mass above it against top-p, and a draw again
above it if top-p cuts it. Each path takes its probabilities and the logsumexp from one
exponential of the vocabulary (`Softmax`). A full sort of the vocabulary (on a CPU, tens of ms at
151,936 tokens and 4 rows: as long as the output layer) is left for top-k cuts outside
the candidates and for the rows whose mass is too close to top-p for float32 sums to tell.
`reference_sample` draws one row at a time without a KV cache, by the definition (a sort
of the whole vocabulary, noise for every token); tests check all three give the same tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from policy.logprobs import picked_logprobs, tempered
from runtime.config import SamplingConfig

# Tokens among which a truncated step looks for its cut (see sample_tokens): a partition of the
# vocabulary picks them in one pass; a trained model's top-p 0.95 set is far smaller.
CANDIDATES = 1024


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" when an EOS token was sampled (and kept), else "length"
    # The policy version whose logits each token was sampled from, when weights can change
    # while a row decodes (policy/engine.py); None: one version for the whole row.
    versions: list[int] | None = None


@dataclass
class Softmax:
    """Tempered logits [rows, V] and what one exponential of the vocabulary gives: each
    row's logsumexp, and its probabilities exp(scaled - max) / their sum (`probs`).

    These are the probabilities top-p sums wherever it sums them (`threshold`,
    `_draw_by_mass`), so that two sums of one token's mass differ only in their order.
    The logsumexp is max + log of that sum, as `mx.logsumexp` computes it (bit for bit on
    the CPU backend, tests/test_sampler.py). One exponential, not two: on a CPU it costs
    as much as the draw."""

    scaled: mx.array
    lse: mx.array
    exp: mx.array  # exp(scaled - max): the most likely token's is exp(0) = 1
    total: mx.array  # [rows, 1]

    @classmethod
    def of(cls, scaled: mx.array) -> Softmax:
        peak = mx.max(scaled, axis=-1, keepdims=True)
        peak = mx.where(mx.isinf(peak), 0.0, peak)  # a row of -inf: lse -inf, as mx.logsumexp's
        e = mx.exp(scaled - peak)
        total = e.sum(-1, keepdims=True)
        return cls(scaled, (peak + mx.log(total))[:, 0], e, total)

    def logprobs(self) -> mx.array:
        return self.scaled - self.lse[:, None]

    def probs(self, ids: mx.array | None = None) -> mx.array:
        """Every token's probability, or those of `ids` [rows, n] (the same values)."""
        e = self.exp if ids is None else mx.take_along_axis(self.exp, ids, axis=-1)
        return e / self.total

    def rows(self, index: mx.array) -> Softmax:
        return Softmax(self.scaled[index], self.lse[index], self.exp[index], self.total[index])


def threshold(logprobs: mx.array, probs: mx.array, p: SamplingConfig) -> mx.array:
    """The smallest logprob that top-k, min-p and top-p keep, per row, from the row's
    largest logprobs ([rows, n]: all of them, or candidates that hold the cut) and their
    `Softmax` probabilities. A token is kept when its logprob is at least this.

    Tied logprobs can hold different probabilities (a logprob rounds after the logsumexp
    is subtracted, a probability does not), so the order of ties matters to top-p's sums:
    they are sorted stably (MLX's argsort is), ties in the order given, which callers make
    the vocabulary's.

    top-k keeps the k largest (and any tied with the k-th); min-p those within log(min_p)
    of the best; top-p then keeps a token if the mass of the tokens more likely than it,
    among those still kept, is below top_p (tied tokens are kept or cut together). No
    truncation gives -inf."""
    order = mx.argsort(-logprobs, axis=-1)
    desc, desc_probs = (mx.take_along_axis(a, order, axis=-1) for a in (logprobs, probs))
    cut = mx.full(desc.shape[:1], -mx.inf, dtype=desc.dtype)
    if 0 < p.top_k < desc.shape[-1]:
        cut = mx.maximum(cut, desc[:, p.top_k - 1])
    if p.min_p > 0.0:
        cut = mx.maximum(cut, desc[:, 0] + math.log(p.min_p))
    if p.top_p < 1.0:
        mass = mx.where(desc >= cut[:, None], desc_probs, 0.0)
        before = mx.cumsum(mass, axis=-1) - mass  # mass strictly before each, in order
        kept = ((before < p.top_p) & (mass > 0)).sum(-1)
        cut = mx.take_along_axis(desc, mx.maximum(kept - 1, 0)[:, None], axis=-1)[:, 0]
    return cut


def truncate(logprobs: mx.array, p: SamplingConfig, probs: mx.array | None = None) -> mx.array:
    """Mask (to -inf) the tokens that top-k, top-p and min-p exclude from sampling: the
    definition, by a sort of the whole vocabulary. The sampler finds the same cut from a
    few candidates (`sample_tokens`). `probs`: the rows' `Softmax` probabilities; by
    default those of `logprobs` taken as logits (the tests' rows of logprobs)."""
    probs = Softmax.of(logprobs).probs() if probs is None else probs
    cut = threshold(logprobs, probs, p)
    return mx.where(logprobs >= cut[:, None], logprobs, -mx.inf)


def truncating(p: SamplingConfig) -> bool:
    return p.top_k > 0 or p.min_p > 0.0 or p.top_p < 1.0


def _fmix32(h: mx.array) -> mx.array:
    """murmur3's 32-bit finalizer: a cheap bijection that scatters nearby integers."""
    h = h ^ (h >> 16)
    h = h * mx.array(0x85EBCA6B, dtype=mx.uint32)
    h = h ^ (h >> 13)
    h = h * mx.array(0xC2B2AE35, dtype=mx.uint32)
    return h ^ (h >> 16)


def noise_keys(seed: int, rows: list[int]) -> mx.array:
    """Each row's 32-bit stream id, from (seed, its noise id)."""
    u32 = mx.uint32
    return _fmix32(mx.array(rows, dtype=u32) ^ _fmix32(mx.array(seed & 0xFFFFFFFF, dtype=u32)))


def _noise(row_keys: mx.array, t: int | mx.array, token_ids: mx.array) -> mx.array:
    """Gumbel noise for the tokens `token_ids` ([rows, n], or [1, n] for every row), a pure
    function of (row key, step, token): the same value whichever tokens are asked for.
    `t`: the step, one for every row, or each row's own ([rows] uint32: rows that joined
    the batch at different steps, policy/engine.py).

    Counter-based: hashing the integers gives a uniform for every (row, token), so the
    noise of the whole batch is a few array operations (no per-row keys, no sync), and
    one row's noise does not depend on the others."""
    u32 = mx.uint32
    steps = mx.array(t, dtype=u32) if isinstance(t, int) else t.astype(u32)
    step = _fmix32(row_keys ^ _fmix32(steps + mx.array(0x9E3779B9, dtype=u32)))
    bits = _fmix32(step[:, None] ^ (token_ids.astype(u32) * mx.array(0x9E3779B1, dtype=u32)))
    u = ((bits >> 8).astype(mx.float32) + 0.5) / float(1 << 24)  # in (0, 1)
    return -mx.log(-mx.log(u))


def sample_tokens(
    logits: mx.array, row_keys: mx.array, t: int | mx.array, p: SamplingConfig
) -> tuple[mx.array, mx.array]:
    """Gumbel-max over the truncated distribution; the logprob is of the untruncated one,
    by policy/logprobs.py's definition (the learner's).

    With truncation, the cut is found among the CANDIDATES most likely tokens (a partition,
    not a sort of the vocabulary), and noise is drawn for them only. That is exact when
    the cut lies strictly inside the candidates, which a trained model's peaked
    distribution almost always gives. Otherwise (a flat distribution) top-p and min-p are
    drawn by mass (`_draw_by_mass`), and a top-k cut beyond the candidates by the
    definition, a sort of the whole vocabulary. All give the same token: the same
    logprobs plus the same noise, ties to the smallest id."""
    sm = Softmax.of(tempered(logits, p.temperature))
    if not truncating(p):
        return _sample_all(sm, row_keys, t, p)
    vocab = sm.scaled.shape[-1]
    k = max(CANDIDATES, 2 * p.top_k)
    if k < vocab and not _top_p_beyond(sm, p, k):
        # In vocabulary order, so that tied logprobs are summed in the order the definition
        # sums them (see threshold).
        ids = mx.sort(mx.argpartition(-sm.scaled, k - 1, axis=-1)[:, :k], axis=-1)
        logprobs = mx.take_along_axis(sm.scaled, ids, axis=-1) - sm.lse[:, None]
        cut = threshold(logprobs, sm.probs(ids), p)
        if mx.all(mx.min(logprobs, axis=-1) < cut).item():  # every kept token is a candidate
            score = mx.where(logprobs >= cut[:, None], logprobs + _noise(row_keys, t, ids), -mx.inf)
            best = score == mx.max(score, axis=-1, keepdims=True)
            tokens = mx.min(mx.where(best, ids, vocab), axis=-1)
            return tokens, picked_logprobs(sm.scaled, sm.lse, tokens)
    if not 0 < p.top_k < vocab:
        tokens = _draw_by_mass(sm, row_keys, t, p)
        return tokens, picked_logprobs(sm.scaled, sm.lse, tokens)
    return _sample_all(sm, row_keys, t, p)


def _top_p_beyond(sm: Softmax, p: SamplingConfig, k: int) -> bool:
    """Whether top-p alone certainly keeps more than the `k` most likely tokens in every
    row: then the candidates cannot hold the cut, and the sampler does not look among them.

    The k most likely tokens hold at most k times the most likely one's probability, and
    at most S + k * tau, S the mass of the tokens at least tau likely (the others among
    the k add less than tau each). With tau = top_p / 4k the second bound decides a nearly
    flat row whose most likely token is still far above the average (a random model's at
    16,384 tokens: S about 0.4 against 0.45 for its 1,024 most likely); it is not tried
    when a row's most likely token alone holds 3/4 of top_p (S is at least that). Only
    speed depends on the answer: the other path draws the same token."""
    if p.top_k or p.min_p > 0.0 or p.top_p >= 1.0:
        return False
    top = 1.0 / sm.total[:, 0]  # the most likely token's probability
    told = k * top < p.top_p
    if mx.all(told).item():
        return True
    if mx.any(~told & (top >= 0.75 * p.top_p)).item():
        return False
    tau = p.top_p / (4 * k)
    above = mx.sum(mx.where(sm.exp >= tau * sm.total, sm.exp, 0.0), axis=-1) / sm.total[:, 0]
    return bool(mx.all(told | (above + k * tau < p.top_p)).item())


# Rounds of `_draw_by_mass` before its rows go to the definition: a round draws again only
# where top-p cut the token drawn, which happens about (1 - top_p) of the time.
ROUNDS = 8


def mass_margin(vocab: int) -> float:
    """How far two float32 sums of up to `vocab` probabilities (totalling about 1) can be
    apart when their exact sums are equal, whatever order each adds in: each is off by at
    most (n - 1) * 2**-24 of its total (the order-free bound for sums of nonnegative terms,
    Jeannerod and Rump 2013), plus a few units for `threshold`'s subtraction."""
    return (vocab + 8) * 2.0**-23


def _draw_by_mass(sm: Softmax, row_keys: mx.array, t: int | mx.array, p: SamplingConfig) -> mx.array:
    """The definition's token under top-p and min-p, without a sort of the vocabulary.

    min-p's cut is max + log(min_p), exact without a sort. Top-p keeps a token when the mass
    of the tokens more likely than it is below top_p (`threshold`), so the kept tokens are
    the most likely ones: if the Gumbel-max over every token min-p keeps is kept by top-p,
    it is also the Gumbel-max over the kept ones (the same sums of logprob and noise, ties
    to the smallest id); if top-p cuts it, so it does every token as likely or less, and
    the draw is made again above it. The mass above a token is a masked sum here and a
    cumulative sum in sorted order in `threshold`: a row whose mass is within
    `mass_margin` of top_p could go either way, and is drawn by the definition. Both sum
    the same `Softmax` probabilities, which MLX computes alike wherever an element sits in
    its array (the margin's slack would absorb a unit of difference anyway)."""
    logprobs = sm.logprobs()
    vocab = logprobs.shape[-1]
    floor = mx.max(logprobs, axis=-1, keepdims=True) + math.log(p.min_p) if p.min_p > 0.0 else -math.inf
    above_floor = logprobs >= floor
    masses = mx.where(above_floor, sm.probs(), 0.0)
    # `threshold` keeps no token whose probability is 0 (exp underflows) when top-p cuts.
    candidates = masses > 0 if p.top_p < 1.0 else above_floor
    score = mx.where(candidates, logprobs + _noise(row_keys, t, mx.arange(vocab)[None]), -mx.inf)
    tokens = mx.argmax(score, axis=-1)
    if p.top_p >= 1.0:
        return tokens
    margin = mass_margin(vocab)
    undecided = np.ones(len(tokens), dtype=bool)
    for _ in range(ROUNDS):
        at = mx.take_along_axis(logprobs, tokens[:, None], axis=-1)
        mass = mx.sum(mx.where(logprobs > at, masses, 0.0), axis=-1)
        cut, sure = np.array(mass >= p.top_p + margin), np.array(mx.abs(mass - p.top_p) >= margin)
        undecided = cut | ~sure
        if not cut.any():
            break
        cut_rows = mx.array(cut)
        score = mx.where(cut_rows[:, None] & (logprobs <= at), -mx.inf, score)
        tokens = mx.where(cut_rows, mx.argmax(score, axis=-1), tokens)
    if not undecided.any():
        return tokens
    rows = mx.array(np.flatnonzero(undecided))
    steps = t if isinstance(t, int) else t[rows]
    drawn = np.array(tokens)
    drawn[undecided] = np.array(_sample_all(sm.rows(rows), row_keys[rows], steps, p)[0])
    return mx.array(drawn)


def _sample_all(
    sm: Softmax, row_keys: mx.array, t: int | mx.array, p: SamplingConfig
) -> tuple[mx.array, mx.array]:
    """The definition: noise for every token of the vocabulary, the cut by a full sort."""
    logprobs = sm.logprobs()
    if truncating(p):
        logprobs = truncate(logprobs, p, sm.probs())
    tokens = mx.argmax(logprobs + _noise(row_keys, t, mx.arange(logprobs.shape[-1])[None]), axis=-1)
    return tokens, picked_logprobs(sm.scaled, sm.lse, tokens)


class Stopped(Exception):
    """A `watch` callback ended sampling early (a stop signal): nothing is returned."""


# Called after every decode step with the rows still decoding (the tokens that step made);
# it may raise Stopped. Progress and Ctrl-C reach a long batch through it.
Watch = Callable[[int], None]


def prefill_logits(
    model: nn.Module, head: Callable[[mx.array], mx.array] | None, inputs: mx.array, cache: list
) -> mx.array:
    """The next-token logits after `inputs`: through the output layer (`head`, see
    policy/logprobs.py::output_head) for the last position only when the model allows (a
    prompt's other positions need none, and at a 150k vocabulary 512 of them are 300 MB a
    row)."""
    if head is None:
        return model(inputs, cache=cache)[:, -1, :]
    return head(model.model(inputs, cache=cache)[:, -1:, :])[:, -1, :]


def prefill_batch(
    model: nn.Module, head: Callable[[mx.array], mx.array] | None, prompts: list[list[int]], copies: list[int]
) -> tuple[list[BatchKVCache], mx.array]:
    """One prefill for all `prompts`, left-padded and masked as mlx-lm's batch_generate
    does it; then each prompt's cache rows and next-token logits repeated `copies[i]`
    times (its rows). Returns the batch's caches (one per layer) and logits [rows, V]."""
    pads = [max(map(len, prompts)) - len(p) for p in prompts]
    cache = [BatchKVCache(pads) for _ in make_prompt_cache(model)]
    logits = prefill_logits(model, head, mx.array([[0] * pad + p for p, pad in zip(prompts, pads)]), cache)
    repeat = mx.array([i for i, n in enumerate(copies) for _ in range(n)])
    for c in cache:
        c.filter(repeat)  # filter takes indices: a prompt's row, once per copy
    return cache, logits[repeat]


def reference_sample(
    model: nn.Module,
    prompt_ids: list[int],
    group_size: int,
    params: SamplingConfig,
    eos_ids: set[int],
    seed: int,
    noise_offset: int = 0,
) -> list[Completion]:
    """The plain sampler sample_groups must agree with: one row at a time, no KV cache (a
    full forward over prompt + generated tokens every step), the same noise per noise id."""
    out = []
    for j in range(group_size):
        ids, lps, stop = list(prompt_ids), cast(list[float], []), False
        for t in range(params.max_tokens):
            logits = model(mx.array(ids)[None])[:, -1, :]
            scaled = tempered(logits, params.temperature)
            keys = noise_keys(seed, [noise_offset + j])
            tok, lp = _sample_all(Softmax.of(scaled), keys, t, params)
            ids.append(cast(int, tok.item()))
            lps.append(cast(float, lp.item()))
            if stop := ids[-1] in eos_ids:
                break
        out.append(Completion(ids[len(prompt_ids) :], lps, "stop" if stop else "length"))
    return out

"""Batched grouped sampling with behavior logprobs, reproducible by seed.

All prompts are prefilled once, together (left-padded and masked in mlx-lm's
BatchKVCache, the machinery of its own batch_generate), and each prompt's cache rows are
repeated for its G samples. All rows then decode as one batch. Rows that sampled an EOS
are dropped from the batch (cache `filter`) so they stop costing compute. Models with
other cache types prefill each prompt alone and `merge` the caches; a model whose caches
cannot be merged (e.g. ChunkedKVCache, QuantizedKVCache) decodes one prompt's G rows at a
time.

For every sampled token we keep its logprob under the temperature-scaled, untruncated
distribution, computed as in policy/logprobs.py (which explains why untruncated).

Randomness. Sampling is Gumbel-max: token = argmax(truncate(logprobs) + g) over the tokens
that top-k/top-p/min-p keep, a draw from the truncated, renormalized distribution. The
noise g of row r at step t for token v is -log(-log(u)), u a hash of (seed, r, t, v)
(`_noise`), where r is the row's id (row_offset + prompt position * group_size + sample
index). So a row's tokens depend only on (seed, r) and its own logits, never on which
other rows share the batch, and the whole batch's noise is a few array operations.
`reference_sample` draws the same noise one row at a time without a KV cache; tests check
both give the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from policy.logprobs import picked_logprobs, tempered
from protocol.config import SamplingConfig


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" when an EOS token was sampled (and kept), else "length"


def truncate(logprobs: mx.array, p: SamplingConfig) -> mx.array:
    """Mask (to -inf) the tokens that top-k, top-p and min-p exclude from sampling."""
    neg_inf = mx.array(-float("inf"), dtype=logprobs.dtype)
    if p.top_k > 0 and p.top_k < logprobs.shape[-1]:
        kth = mx.sort(logprobs, axis=-1)[..., -p.top_k][..., None]
        logprobs = mx.where(logprobs < kth, neg_inf, logprobs)
    if p.min_p > 0.0:
        floor = mx.max(logprobs, axis=-1, keepdims=True) + mx.log(mx.array(p.min_p))
        logprobs = mx.where(logprobs < floor, neg_inf, logprobs)
    if p.top_p < 1.0:
        order = mx.argsort(-logprobs, axis=-1)
        sorted_lp = mx.take_along_axis(logprobs, order, axis=-1)
        # Keep a token if the mass strictly before it is still below top_p.
        before = mx.cumsum(mx.exp(sorted_lp), axis=-1) - mx.exp(sorted_lp)
        keep_sorted = before < p.top_p
        keep = mx.put_along_axis(mx.zeros_like(keep_sorted), order, keep_sorted, axis=-1)
        logprobs = mx.where(keep, logprobs, neg_inf)
    return logprobs


def _fmix32(h: mx.array) -> mx.array:
    """murmur3's 32-bit finalizer: a cheap bijection that scatters nearby integers."""
    h = h ^ (h >> 16)
    h = h * mx.array(0x85EBCA6B, dtype=mx.uint32)
    h = h ^ (h >> 13)
    h = h * mx.array(0xC2B2AE35, dtype=mx.uint32)
    return h ^ (h >> 16)


def _row_keys(seed: int, rows: list[int]) -> mx.array:
    """Each row's 32-bit stream id, from (seed, row id)."""
    u32 = mx.uint32
    return _fmix32(mx.array(rows, dtype=u32) ^ _fmix32(mx.array(seed & 0xFFFFFFFF, dtype=u32)))


def _noise(row_keys: mx.array, t: int, vocab: int) -> mx.array:
    """[rows, vocab] Gumbel noise, a pure function of (row key, step, token).

    Counter-based: hashing the integers gives a uniform for every (row, token), so the
    noise of the whole batch is a few array operations (no per-row keys, no sync), and
    one row's noise does not depend on the others."""
    u32 = mx.uint32
    step = _fmix32(row_keys ^ _fmix32(mx.array(t + 0x9E3779B9, dtype=u32)))
    bits = _fmix32(step[:, None] ^ (mx.arange(vocab, dtype=u32) * mx.array(0x9E3779B1, dtype=u32))[None])
    u = ((bits >> 8).astype(mx.float32) + 0.5) / float(1 << 24)  # in (0, 1)
    return -mx.log(-mx.log(u))


def _sample(logits: mx.array, noise: mx.array, p: SamplingConfig) -> tuple[mx.array, mx.array]:
    """Gumbel-max over the truncated distribution; the logprob is of the untruncated one,
    by policy/logprobs.py's definition (the learner's)."""
    scaled = tempered(logits, p.temperature)
    lse = mx.logsumexp(scaled, axis=-1)
    tokens = mx.argmax(truncate(scaled - lse[:, None], p) + noise, axis=-1)
    return tokens, picked_logprobs(scaled, lse, tokens)


def _decode(model: nn.Module, cache: list, logits: mx.array, rows: list[int],
            params: SamplingConfig, eos_ids: set[int], seed: int) -> list[Completion]:
    """Decode the batch whose next-token logits are `logits` ([len(rows), V]); row i has id
    rows[i]. Each row stops at its first EOS.

    Pipelined: the forward of step t+1 is queued (async_eval) before the tokens of step t
    are read back, so the device never waits for Python. A row that finished at step t is
    dropped from the batch (cache `filter`) after step t+1 was queued for it; that one
    extra step is ignored."""
    n = len(rows)
    tokens: list[list[int]] = [[] for _ in range(n)]
    lps: list[list[float]] = [[] for _ in range(n)]
    done = [False] * n
    live = list(range(n))  # which row each batch position holds
    can_filter = all(hasattr(c, "filter") for c in cache)
    vocab = logits.shape[-1]
    keys = _row_keys(seed, rows)  # filtered along with the batch
    sampled, picked = _sample(logits, _noise(keys, 0, vocab), params)
    mx.async_eval(sampled, picked)
    for t in range(params.max_tokens):
        last = t + 1 == params.max_tokens
        if not last:
            logits = model(sampled[:, None], cache=cache)[:, -1, :]
            nxt = _sample(logits, _noise(keys, t + 1, vocab), params)
            mx.async_eval(*nxt)
        for i, tok, lp in zip(live, sampled.tolist(), picked.tolist()):
            if not done[i]:
                tokens[i].append(tok)
                lps[i].append(lp)
                done[i] = tok in eos_ids
        if all(done) or last:
            break
        sampled, picked = nxt
        keep = [k for k, i in enumerate(live) if not done[i]]
        if can_filter and len(keep) < len(live):
            for c in cache:
                c.filter(keep)
            index = mx.array(keep)
            sampled, picked, keys = sampled[index], picked[index], keys[index]
            live = [live[k] for k in keep]
    return [Completion(ts, lp, "stop" if d else "length") for ts, lp, d in zip(tokens, lps, done)]


def sample_groups(model: nn.Module, prompts: list[list[int]], group_size: int,
                  params: SamplingConfig, eos_ids: set[int], seed: int,
                  row_offset: int = 0) -> list[list[Completion]]:
    """`group_size` completions of each prompt, all rows decoding as one batch.

    Row j of prompt i has the id row_offset + i * group_size + j: its tokens depend only on
    (seed, that id) and the model, so callers that give each group a stable offset get the
    same samples whatever the batch holds.
    """
    if not prompts:
        return []
    rows = [row_offset + r for r in range(len(prompts) * group_size)]
    layers = make_prompt_cache(model)
    if all(type(c) is KVCache for c in layers):
        # One prefill for all prompts, left-padded and masked as mlx-lm's batch_generate
        # does it; then each prompt's cache rows are repeated G times (filter takes indices).
        pads = [max(map(len, prompts)) - len(p) for p in prompts]
        cache = [BatchKVCache(pads) for _ in layers]
        padded = mx.array([[0] * pad + p for p, pad in zip(prompts, pads)])
        logits = model(padded, cache=cache)[:, -1, :]
        repeat = mx.repeat(mx.arange(len(prompts)), group_size)
        for c in cache:
            c.filter(repeat)
        flat = _decode(model, cache, logits[repeat], rows, params, eos_ids, seed)
    elif all(hasattr(c, "merge") for c in layers):
        caches, logits = [], []
        for p in prompts:
            cache = make_prompt_cache(model)
            logits.append(model(mx.array(p)[None], cache=cache)[:, -1, :])
            caches.append(cache)
        # One copy of its prompt's cache per row; merge left-pads to the longest prompt.
        batch = [layer.merge([c[i] for c in caches for _ in range(group_size)])
                 for i, layer in enumerate(caches[0])]
        logits = mx.repeat(mx.concatenate(logits), group_size, axis=0)
        flat = _decode(model, batch, logits, rows, params, eos_ids, seed)
    else:
        # Caches mlx-lm cannot batch: decode each prompt's G rows on their own, prefilled
        # as G identical rows since these caches expose no plain tensor to copy.
        flat = []
        for i, p in enumerate(prompts):
            cache = make_prompt_cache(model)
            logits = model(mx.array([p] * group_size), cache=cache)[:, -1, :]
            flat += _decode(model, cache, logits, rows[i * group_size:(i + 1) * group_size],
                            params, eos_ids, seed)
    return [flat[i:i + group_size] for i in range(0, len(flat), group_size)]


def reference_sample(model: nn.Module, prompt_ids: list[int], group_size: int,
                     params: SamplingConfig, eos_ids: set[int], seed: int,
                     row_offset: int = 0) -> list[Completion]:
    """The plain sampler sample_groups must agree with: one row at a time, no KV cache (a
    full forward over prompt + generated tokens every step), the same noise per row id."""
    out = []
    for j in range(group_size):
        ids, lps, stop = list(prompt_ids), [], False
        for t in range(params.max_tokens):
            logits = model(mx.array(ids)[None])[:, -1, :]
            noise = _noise(_row_keys(seed, [row_offset + j]), t, logits.shape[-1])
            tok, lp = _sample(logits, noise, params)
            ids.append(tok.item())
            lps.append(lp.item())
            if stop := ids[-1] in eos_ids:
                break
        out.append(Completion(ids[len(prompt_ids):], lps, "stop" if stop else "length"))
    return out

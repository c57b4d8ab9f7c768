"""Grouped sampling with behavior logprobs.

One prompt is prefilled once; its KV cache is copied to the G rows that then decode
together. For every sampled token we keep its logprob under the temperature-scaled,
untruncated distribution, computed as in policy/logprobs.py (which explains why
untruncated).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 64


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" when an EOS token was sampled (and kept), else "length"


def truncate(logprobs: mx.array, p: SamplingParams) -> mx.array:
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


def _prefill(model: nn.Module, prompt_ids: list[int], group_size: int):
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt_ids)[None], cache=cache)[:, -1, :]
    if all(type(c) is KVCache for c in cache):
        for c in cache:
            c.keys = mx.repeat(c.keys, group_size, axis=0)
            c.values = mx.repeat(c.values, group_size, axis=0)
        return mx.repeat(logits, group_size, axis=0), cache
    # Other cache types (rotating, recurrent) do not expose a plain tensor to copy:
    # prefill the G rows directly.
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt_ids] * group_size), cache=cache)[:, -1, :]
    return logits, cache


def sample_group(model: nn.Module, prompt_ids: list[int], group_size: int,
                 params: SamplingParams, eos_ids: set[int]) -> list[Completion]:
    """Sample `group_size` completions of one prompt; stop each row at its first EOS."""
    logits, cache = _prefill(model, prompt_ids, group_size)
    tokens: list[list[int]] = [[] for _ in range(group_size)]
    lps: list[list[float]] = [[] for _ in range(group_size)]
    done = [False] * group_size
    eos = mx.array(sorted(eos_ids))
    for _ in range(params.max_tokens):
        logits = logits.astype(mx.float32) / params.temperature
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        sampled = mx.random.categorical(truncate(logprobs, params))
        picked = mx.take_along_axis(logprobs, sampled[:, None], axis=-1)[:, 0]
        is_eos = mx.any(sampled[:, None] == eos[None, :], axis=-1)
        mx.eval(sampled, picked, is_eos)
        for row, (tok, lp, stop) in enumerate(zip(sampled.tolist(), picked.tolist(), is_eos.tolist())):
            if done[row]:
                continue
            tokens[row].append(tok)
            lps[row].append(lp)
            done[row] = stop
        if all(done):
            break
        logits = model(sampled[:, None], cache=cache)[:, -1, :]
    return [Completion(t, lp, "stop" if d else "length") for t, lp, d in zip(tokens, lps, done)]

"""Per-token logprobs of given token IDs: the one definition both processes share.

Both sides take logprobs from the temperature-scaled, *untruncated* distribution
`log_softmax(logits / temperature)`. Top-k / top-p / min-p only shape what the actor
samples; they are applied to neither side's logprobs, so at equal weights the learner's
recomputed logprobs equal the actor's behavior logprobs (see README, "Logprobs").
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def tempered(logits: mx.array, temperature: float) -> mx.array:
    """float32 logits / temperature: the distribution's scores, before normalising."""
    scaled = logits.astype(mx.float32)
    return scaled if temperature == 1.0 else scaled / temperature


def picked_logprobs(scaled: mx.array, lse: mx.array, tokens: mx.array) -> mx.array:
    """log p(token) = scaled[token] - logsumexp(scaled), without forming every token's
    logprob (at a 150k vocabulary that would be a second logits-sized array)."""
    return mx.take_along_axis(scaled, tokens[..., None], axis=-1)[..., 0] - lse


def token_logprobs(logits: mx.array, tokens: mx.array, temperature: float) -> mx.array:
    """logprob of each `tokens[..., i]` under `logits[..., i, :]` at `temperature`.
    The sampler computes its behavior logprobs with the same two functions."""
    scaled = tempered(logits, temperature)
    return picked_logprobs(scaled, mx.logsumexp(scaled, axis=-1), tokens)


def sequence_logprobs(model: nn.Module, tokens: mx.array, temperature: float) -> mx.array:
    """Full forward over `tokens` [B, L]; returns [B, L-1], the logprob of tokens[:, 1:]."""
    logits = model(tokens[:, :-1])
    return token_logprobs(logits, tokens[:, 1:], temperature)


def sequence_logprobs_and_entropy(model: nn.Module, tokens: mx.array,
                                  temperature: float) -> tuple[mx.array, mx.array]:
    """As sequence_logprobs (with the very same operations, so the two agree bit for bit),
    plus the entropy of each position's tempered distribution.

    Entropy as lse - sum(softmax * scaled): the same value as -sum(p * log p) with fewer
    vocabulary-sized temporaries (measured: 2 float32 copies of the logits at the peak of
    a pass that computes both, instead of 5)."""
    logits = model(tokens[:, :-1])
    scaled = tempered(logits, temperature)
    lse = mx.logsumexp(scaled, axis=-1)
    picked = picked_logprobs(scaled, lse, tokens[:, 1:])
    entropy = lse - (mx.exp(scaled - lse[..., None]) * scaled).sum(-1)
    return picked, entropy

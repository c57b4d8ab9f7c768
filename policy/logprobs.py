"""Per-token logprobs of given token IDs: the one definition both processes share.

Both sides take logprobs from the temperature-scaled, *untruncated* distribution
`log_softmax(logits / temperature)`. Top-k / top-p / min-p only shape what the actor
samples; they are applied to neither side's logprobs, so at equal weights the learner's
recomputed logprobs equal the actor's behavior logprobs (see docs/design.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache


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


# A prompt run once: its output at its last position (which predicts the first completion
# token), and every layer's keys and values. Plain tuples and lists of arrays, so that a
# gradient can be taken in them (learner/trainer.py carries them across micro-batches).
PromptState = tuple[mx.array, list[mx.array], list[mx.array]]


def run_prompt(net: nn.Module, prompt: mx.array) -> PromptState:
    """`prompt` [P] through `net` (an mlx-lm model or its body, as Rows.outputs): what the
    completions after it read."""
    cache = [_Grown() for _ in net.layers]
    last = net(prompt[None], cache=cache)[:, -1:, :]
    return last, [c.keys for c in cache], [c.values for c in cache]


def extend_states(
    net: nn.Module, states: list[PromptState], tokens: mx.array, lengths: list[int]
) -> tuple[mx.array, list[PromptState]]:
    """Row i's first lengths[i] (at least one) of `tokens` [n, m] after its state
    (run_prompt's, or this function's), every row in one forward: what a reference pass
    of completions that grow takes a few tokens at a time (learner/ahead.py). Rows further
    along than others are left-padded and masked, as a batch's (_GrownBatch); a row's
    tokens past its length are padding, which causal attention keeps its real positions
    from reading.

    Returns `net`'s outputs at the positions that predict the tokens, [n, m, ...] (row
    i's first lengths[i]; the first is its state's last output), and each row's state
    after its tokens, copied out of the forward's arrays: a slice would keep the whole
    batch's alive after the other rows move on."""
    layers = [
        _GrownBatch.of([s[1][i] for s in states], [s[2][i] for s in states], list(range(len(states))))
        for i in range(len(net.layers))
    ]
    width = layers[0]._idx
    out = net(tokens, cache=layers)
    outputs = mx.concatenate([mx.concatenate([s[0] for s in states]), out[:, :-1]], axis=1)
    after = []
    for i, (s, n) in enumerate(zip(states, lengths)):
        lo, hi = width - s[1][0].shape[2], width + n
        own = [(c.keys[i : i + 1, :, lo:hi] * 1, c.values[i : i + 1, :, lo:hi] * 1) for c in layers]
        after.append((out[i : i + 1, n - 1 : n] * 1, [k for k, _ in own], [v for _, v in own]))
    return outputs, after


@dataclass
class Rows:
    """What one forward computes logprobs for.

    Whole rows: `tokens` [n, L] (prompt + completion, right-padded); the targets are
    tokens[:, 1:]. Or each group's prompt once: every distinct prompt in `prompts` runs
    once into a KV cache, each row reads the cache of its prompt (`owner`), and `tokens`
    [n, C] are the completions alone, each its own target (the first one predicted from
    the prompt's last position). Both give the same logprobs: causal attention makes a
    row's positions depend only on what precedes them, which the cache holds.

    `given`: prompts run elsewhere, once for several forwards (their states, run_prompt's
    with the same net); `owner` counts them after `prompts`."""

    tokens: mx.array
    prompts: list[mx.array] | None = None
    owner: list[int] | None = None
    given: list[PromptState] = field(default_factory=list)

    @property
    def targets(self) -> mx.array:
        return self.tokens if self.prompts is not None else self.tokens[:, 1:]

    def with_given(self, given: list[PromptState]) -> Rows:
        """The same rows, given these states of the prompts run elsewhere."""
        return replace(self, given=given)

    def outputs(self, net: nn.Module, head: Callable[[mx.array], mx.array] | None = None) -> mx.array:
        """`net`'s output at every position that predicts a target, [n, T, ...], then
        `head`'s if given: `net` is an mlx-lm model (logits) or its body `model.model`
        (hidden states, or logits through the model's `head`, which then never sees a
        prompt's other positions). Differentiable: gradients reach the weights through
        the prompts' keys and values (and reach `given`'s arrays)."""
        out = (lambda h: h) if head is None else head
        if self.prompts is None:
            return out(net(self.tokens[:, :-1]))
        assert self.owner is not None  # given with the prompts
        states = [run_prompt(net, p) for p in self.prompts] + self.given
        first = mx.concatenate([last for last, _, _ in states])[mx.array(self.owner)]
        if self.tokens.shape[1] > 1:
            layers = [
                _GrownBatch.of([k[i] for _, k, _ in states], [v[i] for _, _, v in states], self.owner)
                for i in range(len(net.layers))
            ]
            # Joined before the head: joining logits would make one more logits-sized copy.
            first = mx.concatenate([first, net(self.tokens[:, :-1], cache=layers)], axis=1)
        return out(first)

    def logits(self, model: nn.Module, head: Callable[[mx.array], mx.array] | None = None) -> mx.array:
        """The model's logits at every position that predicts a target; through its body
        and `head` (output_head) when given, so a prompt's other positions get none."""
        return self.outputs(model) if head is None else self.outputs(model.model, head)


class _Grown(KVCache):
    """mlx-lm's KVCache grown by exactly what a forward adds: no 256-position buffer nor
    the copies that fill it (a differentiated forward keeps what it holds for the backward).
    Typed Any: mlx-lm declares its arrays as None until set."""

    keys: Any
    values: Any

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.keys is not None:
            keys = mx.concatenate([self.keys, keys], axis=2)
            values = mx.concatenate([self.values, values], axis=2)
        self.keys, self.values, self.offset = keys, values, keys.shape[2]
        return keys, values


class _GrownBatch(BatchKVCache):
    """mlx-lm's BatchKVCache (rows left-padded to the longest prompt, masked and offset per
    row), grown by exactly what a forward adds, as _Grown."""

    keys: Any
    values: Any

    @classmethod
    def of(cls, keys: list[mx.array], values: list[mx.array], owner: list[int]) -> _GrownBatch:
        """Row i continues prompt owner[i]: its keys and values (one layer's, a prompt's
        [1, heads, P, dim]), left-padded with zeros."""
        width = max(k.shape[2] for k in keys)
        pad = [width - k.shape[2] for k in keys]
        rows = mx.array(owner)

        def padded(arrays: list[mx.array]) -> mx.array:
            lefts = [mx.pad(a, [(0, 0), (0, 0), (n, 0), (0, 0)]) for a, n in zip(arrays, pad)]
            return mx.concatenate(lefts)[rows]

        cache = cls([pad[o] for o in owner])
        cache.keys, cache.values = padded(keys), padded(values)
        cache.offset += width
        cache._idx = width
        return cache

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys = mx.concatenate([self.keys, keys], axis=2)
        self.values = mx.concatenate([self.values, values], axis=2)
        self.offset += keys.shape[2]
        self._idx += keys.shape[2]
        return self.keys, self.values


def plain_caches(model: nn.Module) -> bool:
    """Whether the model's caches are mlx-lm's plain KVCache: what its BatchKVCache batches
    (left-padded, masked per row), and what Rows' shared prompts need (rotating or
    quantized caches cannot be merged that way)."""
    return all(type(c) is KVCache for c in make_prompt_cache(model))


def rows_of(tokens: mx.array | Rows) -> Rows:
    return tokens if isinstance(tokens, Rows) else Rows(tokens)


def sequence_logprobs(
    model: nn.Module,
    tokens: mx.array | Rows,
    temperature: float,
    head: Callable[[mx.array], mx.array] | None = None,
) -> mx.array:
    """Full forward over `tokens` [B, L] (or Rows); returns [B, L-1], the logprob of
    tokens[:, 1:] (Rows: of its targets). `head`: see Rows.logits."""
    rows = rows_of(tokens)
    return token_logprobs(rows.logits(model, head), rows.targets, temperature)


def sequence_logprobs_and_entropy(
    model: nn.Module,
    tokens: mx.array | Rows,
    temperature: float,
    head: Callable[[mx.array], mx.array] | None = None,
) -> tuple[mx.array, mx.array]:
    """As sequence_logprobs (with the very same operations, so the two agree bit for bit),
    plus the entropy of each position's tempered distribution.

    Entropy as lse - sum(softmax * scaled): the same value as -sum(p * log p) with fewer
    vocabulary-sized temporaries (measured: 2 float32 copies of the logits at the peak of
    a pass that computes both, instead of 5)."""
    rows = rows_of(tokens)
    scaled = tempered(rows.logits(model, head), temperature)
    lse = mx.logsumexp(scaled, axis=-1)
    picked = picked_logprobs(scaled, lse, rows.targets)
    entropy = lse - (mx.exp(scaled - lse[..., None]) * scaled).sum(-1)
    return picked, entropy


def random_forward(model: nn.Module) -> bool:
    """Whether two forwards of the same tokens may differ: dropout (LoRA's) in training."""
    return model.training and any(isinstance(m, nn.Dropout) and m._p_1 < 1 for _, m in model.named_modules())


def output_head(model: nn.Module) -> Callable[[mx.array], mx.array] | None:
    """The model's last layer (hidden states -> logits) when `model(x)` is exactly
    `head(model.model(x))`, as in mlx-lm's causal LMs (`lm_head`, or the embedding read
    backwards when tied), and the head trains nothing. None otherwise: a head with LoRA,
    a final soft-cap, another layout, or a forward that is random (dropout in training)."""
    body = getattr(model, "model", None)
    if body is None:
        return None  # not mlx-lm's layout: no body to run without the head
    if getattr(model, "lm_head", None) is not None:
        head = model.lm_head
    elif hasattr(getattr(body, "embed_tokens", None), "as_linear"):
        head = body.embed_tokens.as_linear
    else:
        return None
    owner = head if isinstance(head, nn.Module) else body.embed_tokens
    if tree_flatten(owner.trainable_parameters()):
        return None
    if random_forward(model):
        return None  # two forwards would draw two masks (invisible to the probe while LoRA B is 0)
    probe = mx.array([[0, 1, 2]])
    return head if mx.array_equal(model(probe), head(body(probe))).item() else None


def chunked_terms(
    hidden: mx.array,
    targets: mx.array,
    head: Callable[[mx.array], mx.array],
    temperature: float,
    chunk: int,
    entropy: bool = False,
    jacobian: bool = False,
) -> tuple[mx.array, mx.array | None, mx.array | None]:
    """Per-position logprob of `targets` [N] under `head(hidden)` [N, V], `chunk` positions
    at a time, each chunk evaluated before the next: the logits of one chunk exist at once,
    never the whole batch's (at a 150k vocabulary, 8 rows of 512 tokens are 2.5 GB a copy).

    Returns (logprobs [N], entropy [N] or None, jacobian [N, H] or None). The jacobian is
    d logprob[i] / d hidden[i]: each position's logprob depends on its own hidden state
    only, so the head's vector-Jacobian product with d logprob / d logits gives every row
    of it at once. A loss of the logprobs then backpropagates into the model as
    `dloss/dlogprob * jacobian` without the logits (learner/trainer.py)."""
    logps, entropies, jacobians = [], [], []
    for start in range(0, hidden.shape[0], chunk):
        logp, ent, jac = _chunk_terms(
            head,
            hidden[start : start + chunk],
            targets[start : start + chunk],
            temperature,
            entropy,
            jacobian,
        )
        logps.append(logp)
        entropies += [] if ent is None else [ent]
        jacobians += [] if jac is None else [jac]
        mx.eval(logp, *entropies[-1:], *jacobians[-1:])
    return (
        mx.concatenate(logps),
        mx.concatenate(entropies) if entropy else None,
        mx.concatenate(jacobians) if jacobian else None,
    )


def _chunk_terms(
    head: Callable[[mx.array], mx.array],
    h: mx.array,
    targets: mx.array,
    temperature: float,
    entropy: bool,
    jacobian: bool,
) -> tuple[mx.array, mx.array | None, mx.array | None]:
    """One chunk's logprobs, entropy and jacobian, from one exponential of its logits.

    The gradient is written out, not traced: d logprob / d logits = (onehot(target) -
    softmax) / temperature, with the softmax taken from the very exponential that gave
    the logsumexp. Traced, the same terms cost three vocabulary-sized exponentials (the
    logsumexp, the entropy's softmax, the logsumexp's backward): on a CPU each is as slow
    as a third of the head's matmul (docs/benchmarks.md, "Where the learner's step goes")."""
    logits = head(h)
    scaled = tempered(logits, temperature)
    if not (entropy or jacobian):
        return picked_logprobs(scaled, mx.logsumexp(scaled, axis=-1), targets), None, None
    peak = scaled.max(-1)
    e = _shifted_exp(scaled, peak)
    total = e.sum(-1)
    # The old-policy pass (entropy) and the training pass (jacobian) take the logsumexp
    # alike, so that a first step's ratio is exactly 1.
    lse = peak + mx.log(total)
    logp = picked_logprobs(scaled, lse, targets)
    inverse = 1.0 / total
    ent = lse - inverse * (e * scaled).sum(-1) if entropy else None
    jac = None
    if jacobian:
        cotangent = _logprob_cotangent(e, inverse, targets, mx.array(1.0 / temperature)).astype(logits.dtype)
        _, (jac,) = mx.vjp(head, [h], [cotangent])
    return logp, ent, jac


@mx.compile
def _shifted_exp(scaled: mx.array, peak: mx.array) -> mx.array:
    """exp(scaled - peak): the softmax's numerator, in one pass."""
    return mx.exp(scaled - peak[..., None])


@mx.compile
def _logprob_cotangent(e: mx.array, inverse: mx.array, targets: mx.array, inverse_t: mx.array) -> mx.array:
    """d log p(target) / d logits = (onehot(target) - softmax) / temperature, in one pass."""
    onehot = mx.arange(e.shape[-1])[None] == targets[:, None]
    return (onehot - e * inverse[..., None]) * inverse_t


def chunked_sequence_terms(
    model: nn.Module,
    head: Callable[[mx.array], mx.array],
    tokens: mx.array | Rows,
    temperature: float,
    chunk: int,
    entropy: bool = False,
    jacobian: bool = False,
) -> tuple[mx.array, mx.array | None, mx.array | None]:
    """sequence_logprobs (and the entropy) of `tokens` [B, L] (or Rows) by chunks of
    positions, with the jacobian into the model's last hidden states [B, T, H] if asked.
    Evaluated, not differentiable: the learner differentiates through the jacobian (see
    chunked_terms)."""
    forward = rows_of(tokens)
    hidden = forward.outputs(model.model)
    mx.eval(hidden)
    rows, length, width = hidden.shape
    logp, ent, jac = chunked_terms(
        hidden.reshape(rows * length, width),
        forward.targets.reshape(-1),
        head,
        temperature,
        chunk,
        entropy,
        jacobian,
    )
    return (
        logp.reshape(rows, length),
        None if ent is None else ent.reshape(rows, length),
        None if jac is None else jac.reshape(rows, length, width),
    )

"""Continuous decoding: rows refill as they finish, groups come out as they complete.

The static sampler (policy/sampler.py::sample_groups) decodes a batch until its longest
row ends. Under long-tailed completion lengths most of that batch is idle for most of the
time, and no group leaves before the slowest row. The engine holds up to `max_rows` live
rows in one of mlx-lm's BatchKVCaches. When rows finish, the groups waiting take their
places: their prompts are prefilled together (left-padded and masked, each prompt once,
its cache rows repeated for its G samples, as the static sampler does) and join the
batch (`BatchKVCache.extend`) at the next step. A group is handed back the step its last
row ends.

Determinism is the static sampler's: a row's token t draws the noise of (seed, the row's
noise id, t), so its tokens depend only on those and its own logits, never on what else
shares the batch or when it joined (tests check it against the reference sampler).

Weights may change between two steps (the caller sets new adapter weights and passes the
new version to `step`). Each token records the version whose logits it was sampled from,
and its behavior logprob is of those very logits. The keys and values already in a row's
cache stay as the older weights computed them: the learner's importance weights correct
for exactly that, token by token.

Only models whose caches are mlx-lm's plain KVCache can be batched this way
(policy/logprobs.py::plain_caches); the actor keeps the static sampler for the others.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import cast

import mlx.core as mx
import mlx.nn as nn

from policy.logprobs import output_head
from policy.sampler import Completion, _noise_keys, _sample, prefill_batch
from protocol.config import SamplingConfig


@dataclass
class _Row:
    noise: int  # its noise id
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the policy version of each token's logits
    stopped: bool = False  # sampled an EOS


@dataclass
class _Group:
    key: Hashable  # the caller's name for it
    prompt: list[int]
    rows: list[_Row]
    left: int = 0  # rows still decoding


class Engine:
    """Decode groups of rows continuously: `add` groups, call `step` until `busy` is
    False; each step returns the groups that completed in it, as (key, completions)."""

    def __init__(self, model: nn.Module, params: SamplingConfig, eos_ids: set[int], seed: int,
                 max_rows: int) -> None:
        self.model, self.params, self.eos_ids, self.seed = model, params, eos_ids, seed
        self.max_rows = max_rows
        self.head = output_head(model)
        self.waiting: deque[_Group] = deque()
        self.live: list[tuple[_Group, _Row]] = []  # in the batch's row order
        self.cache: list | None = None  # one BatchKVCache per layer, for the live rows
        self.logits: mx.array | None = None  # the live rows' next-token logits [rows, V]
        self.keys: mx.array | None = None  # the live rows' noise keys
        self.made_by: list[int] = []  # the policy version that computed each live row's logits

    def clear(self) -> None:
        """Forget every group, waiting or decoding."""
        self.waiting.clear()
        self._keep([])

    def add(self, key: Hashable, prompt_ids: list[int], noise_ids: list[int]) -> None:
        """A group to decode: one row per noise id, all continuing `prompt_ids`."""
        rows = [_Row(n) for n in noise_ids]
        self.waiting.append(_Group(key, list(prompt_ids), rows, len(rows)))

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.live)

    def step(self, version: int = 0) -> list[tuple[Hashable, list[Completion]]]:
        """Admit the waiting groups that fit, sample one token for every live row, queue
        the next forward, and drop the rows that ended (EOS or max_tokens). `version`:
        the policy version of the model's weights now."""
        self._admit(version)
        if not self.live:
            return []
        assert self.logits is not None and self.keys is not None and self.cache is not None  # rows are live
        t = mx.array([len(r.tokens) for _, r in self.live], dtype=mx.uint32)
        sampled, picked = _sample(self.logits, self.keys, t, self.params)
        # The next forward is queued before this step's tokens are read back, so the
        # device never waits for Python; the rows that end now waste that one step.
        self.logits = self.model(sampled[:, None], cache=self.cache)[:, -1, :]
        mx.async_eval(self.logits)
        made_by, self.made_by = self.made_by, [version] * len(self.live)
        done, keep = [], []
        tokens, logprobs = cast(list[int], sampled.tolist()), cast(list[float], picked.tolist())
        for k, ((group, row), token, logprob) in enumerate(zip(self.live, tokens, logprobs)):
            row.tokens.append(token)
            row.logprobs.append(logprob)
            row.versions.append(made_by[k])
            row.stopped = token in self.eos_ids
            if row.stopped or len(row.tokens) == self.params.max_tokens:
                group.left -= 1
                if group.left == 0:
                    done.append(group)
            else:
                keep.append(k)
        if len(keep) < len(self.live):
            self._keep(keep)
        return [(g.key, [Completion(r.tokens, r.logprobs, "stop" if r.stopped else "length", r.versions)
                         for r in g.rows]) for g in done]

    def _keep(self, keep: list[int]) -> None:
        """Only these rows (batch positions) stay."""
        if not keep:
            self.live, self.cache, self.logits, self.keys, self.made_by = [], None, None, None, []
            return
        index = mx.array(keep)
        for c in cast(list, self.cache):
            c.filter(index)
        self.logits, self.keys = cast(mx.array, self.logits)[index], cast(mx.array, self.keys)[index]
        self.live = [self.live[k] for k in keep]
        self.made_by = [self.made_by[k] for k in keep]

    def _admit(self, version: int) -> None:
        """Prefill the waiting groups that fit in the free rows (whole groups, in order;
        one larger than max_rows goes alone into an empty batch) and join them."""
        joining: list[_Group] = []
        free = self.max_rows - len(self.live)
        while self.waiting and (len(self.waiting[0].rows) <= free or not (self.live or joining)):
            joining.append(group := self.waiting.popleft())
            free -= len(group.rows)
        if not joining:
            return
        cache, logits = prefill_batch(self.model, self.head, [g.prompt for g in joining],
                                      [len(g.rows) for g in joining])
        keys = _noise_keys(self.seed, [r.noise for g in joining for r in g.rows])
        if self.cache is None:
            self.cache, self.logits, self.keys = cache, logits, keys
        else:
            for mine, theirs in zip(self.cache, cache):
                mine.extend(theirs)
            self.logits = mx.concatenate([cast(mx.array, self.logits), logits])
            self.keys = mx.concatenate([cast(mx.array, self.keys), keys])
        self.live += [(g, r) for g in joining for r in g.rows]
        self.made_by += [version] * sum(len(g.rows) for g in joining)

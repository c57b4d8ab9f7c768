"""The one decode loop: groups of rows decoded as a batch, handed back as they complete.

`add` queues a group (a prompt and one row per noise id), `step` samples one token for
every live row. The batch is one of mlx-lm's batched caches, its rows left-padded and
masked; each prompt is prefilled once and its cache rows repeated for its G samples. A
group is handed back the step its last row ends. Two settings:

- continuous (the default): rows refill the batch as others end. When rows finish, the
  waiting groups take their places: their prompts are prefilled together and join the
  batch (`BatchKVCache.extend`) at the next step. Under long-tailed completion lengths a
  static batch is mostly idle for most of its time, and no group leaves before its
  slowest row; here none waits for another. Only models whose caches are mlx-lm's plain
  KVCache can be batched this way (policy/logprobs.py::plain_caches).
- `static`: a batch at a time. Waiting groups are admitted only when no row is live
  (whole groups, up to max_rows), and the batch decodes until its longest row ends. It
  takes every cache type: plain caches as above; other mergeable ones (rotating, arrays)
  prefill each prompt alone and `merge` a copy per row; caches mlx-lm cannot merge
  decode one group per batch, prefilled as G identical rows (they expose no plain tensor
  to copy).

A row that ends stays in the batch, dead, until a group needs its place or a quarter of
the batch is dead: cutting rows out copies the whole cache, and one at a time that would
be nearly every step. Caches that cannot be cut keep their dead rows to the batch's end.

Determinism: a row's token t draws the noise of (seed, the row's noise id, t), so its
tokens depend only on those and its own logits, never on what else shares the batch or
when it joined (tests check both settings against the reference sampler).

Weights may change between two steps (the caller sets new adapter weights and passes the
new version to `step`). Each token records the version whose logits it was sampled from,
and its behavior logprob is of those very logits. The keys and values already in a row's
cache stay as the older weights computed them: the learner's importance weights correct
for exactly that, token by token. A static row sampled under one version carries none
(`versions` None): the caller's version says it, so a static rollout has no per-token
versions on the wire.

Episodes keep their KV cache across turns (continuous only): a group added with `keep`
leaves, when it ends, its row's cache behind (mlx-lm's `BatchKVCache.extract`), and when
the same key is added again with a context that continues it (the environment's answer
after the model's turn) only the new tokens are prefilled onto that cache before the row
rejoins the batch (`BatchKVCache.merge`, `extend`). An n-turn episode so prefills its
context once, not the sum of its prefixes, and waits for no other episode. A static
engine ignores `keep`: each turn prefills its whole context.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from policy.logprobs import output_head, plain_caches
from policy.sampler import Completion, Watch, noise_keys, prefill_batch, prefill_logits, sample_tokens
from runtime import spans
from runtime.config import SamplingConfig

# A row that ends stays in the batch, dead (its compute wasted), until a waiting group
# needs its place or the dead are this share of the batch: cutting rows out copies every
# live row's keys and values (mlx-lm's BatchKVCache.filter), which under long-tailed
# lengths would happen at nearly every step.
DEAD_SHARE = 0.25


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
    seed: int = 0  # of its rows' noise
    keep: bool = False  # leave its row's KV cache behind when it ends (an episode's turn)
    kept: _Kept | None = None  # the cache it continues
    max_tokens: int = 0  # its rows end at this many tokens (the sampling settings' by default)


@dataclass
class _Kept:
    """A finished single-row group's KV cache, one KVCache per layer, and its tokens."""

    cache: list[KVCache]
    tokens: list[int]


class Engine:
    """Decode groups of rows: `add` groups, call `step` until `busy` is False; each step
    returns the groups that completed in it, as (key, completions). `static`: a batch at
    a time (see the module's docstring); required for caches that are not plain KVCache."""

    def __init__(
        self,
        model: nn.Module,
        params: SamplingConfig,
        eos_ids: set[int],
        seed: int,
        max_rows: int,
        static: bool = False,
    ) -> None:
        self.plain = plain_caches(model)
        if not (static or self.plain):
            kinds = sorted({type(c).__name__ for c in make_prompt_cache(model)})
            raise ValueError(
                f"continuous decoding needs mlx-lm's plain KVCache, and this model's caches are "
                f"{', '.join(kinds)}: decode it static"
            )
        self.model, self.params, self.eos_ids, self.seed = model, params, eos_ids, seed
        self.max_rows, self.static = max_rows, static
        self.mergeable = all(hasattr(c, "merge") for c in make_prompt_cache(model))
        self.head = output_head(model)
        self.waiting: deque[_Group] = deque()
        self.live: list[tuple[_Group, _Row] | None] = []  # in the batch's row order; None: dead
        self.cache: list | None = None  # one batched cache per layer, for the live rows
        self.logits: mx.array | None = None  # the live rows' next-token logits [rows, V]
        self.keys: mx.array | None = None  # the live rows' noise keys
        self.made_by: list[int] = []  # the policy version that computed each live row's logits
        self.kept: dict[Hashable, _Kept] = {}  # the caches of finished `keep` groups, by key
        self.prefilled = 0  # tokens run through a prefill, padding not counted
        self.decoded = 0  # rows that sampled a token in the last step
        self.read: dict[str, int] = {}  # what the last step's forward read (`_reads`)

    def clear(self) -> None:
        """Forget every group, waiting or decoding, and every kept cache."""
        self.waiting.clear()
        self.kept.clear()
        self.live = [None] * len(self.live)
        self._drop_dead()

    def add(
        self,
        key: Hashable,
        prompt_ids: list[int],
        noise_ids: list[int],
        seed: int | None = None,
        keep: bool = False,
        max_tokens: int | None = None,
    ) -> None:
        """A group to decode: one row per noise id, all continuing `prompt_ids`, with the
        noise of `seed` (default: the engine's). `keep` (one row only): when it ends, keep
        its KV cache for the next `add` of `key`, which then prefills only what its prompt
        adds to that cache's tokens (a prompt that does not continue them starts afresh).
        A static engine keeps nothing. `max_tokens`: where its rows end, at most the
        sampling settings' (an agent's call asks for fewer)."""
        rows = [_Row(n) for n in noise_ids]
        if keep and len(rows) != 1:
            raise ValueError("only a single-row group can keep its KV cache")
        keep = keep and not self.static
        kept = self.kept.pop(key, None)
        if kept is not None and prompt_ids[: len(kept.tokens)] != kept.tokens:
            kept = None
        seed = self.seed if seed is None else seed
        cap = self.params.max_tokens if max_tokens is None else min(max_tokens, self.params.max_tokens)
        self.waiting.append(_Group(key, list(prompt_ids), rows, len(rows), seed, keep, kept, cap))

    def tokens(self) -> dict[Hashable, list[int]]:
        """The tokens sampled so far by each decoding single-row group, by key (what a
        streamed response sends as it goes)."""
        return {entry[0].key: entry[1].tokens for entry in self.live if entry is not None}

    def so_far(self) -> dict[Hashable, tuple[list[int], list[list[int]]]]:
        """Each decoding group's prompt and every row's tokens so far, ended rows' too, by
        key (what a `partial` sends, PROTOCOL.md)."""
        groups = {entry[0].key: entry[0] for entry in self.live if entry is not None}
        return {key: (g.prompt, [r.tokens for r in g.rows]) for key, g in groups.items()}

    def release(self, key: Hashable) -> None:
        """Drop the KV cache kept for `key` (its episode ended)."""
        self.kept.pop(key, None)

    def oldest_versions(self) -> dict[Hashable, int]:
        """Each decoding group's oldest token's policy version (a row yet to sample: the
        weights that computed its first logits), by key. Waiting groups have no tokens yet,
        and are not among them."""
        oldest: dict[Hashable, int] = {}
        for k, entry in enumerate(self.live):
            if entry is not None:
                group, row = entry
                first = row.versions[0] if row.versions else self.made_by[k]
                oldest[group.key] = min(first, oldest.get(group.key, first))
        return oldest

    def started_before(self, version: int) -> list[Hashable]:
        """The decoding groups whose oldest token came from weights older than `version`."""
        return [key for key, first in self.oldest_versions().items() if first < version]

    def cancel(self, key: Hashable) -> None:
        """Stop decoding the group `key`, waiting or live: its rows are dead, and it never
        completes. The other rows' tokens are unchanged (each row's noise is its own)."""
        self.waiting = deque(g for g in self.waiting if g.key != key)
        self.live = [None if entry is not None and entry[0].key == key else entry for entry in self.live]
        if self.live and self.live.count(None) == len(self.live):
            self._drop_dead()

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.live)

    def step(self, version: int = 0) -> list[tuple[Hashable, list[Completion]]]:
        """Admit the waiting groups that fit, sample one token for every live row, queue
        the next forward, and mark the rows that ended (EOS or max_tokens) dead. `version`:
        the policy version of the model's weights now."""
        with spans.span("decode step") as span:
            done = self._step(version)
            span["rows"] = len(self.live) - self.live.count(None)
            span.update(self.read)
            return done

    def _step(self, version: int) -> list[tuple[Hashable, list[Completion]]]:
        self._admit(version)
        if not self.live:
            return []
        assert self.logits is not None and self.keys is not None and self.cache is not None  # rows are live
        sampled, picked = self.sample_tokens()
        self.decoded = len(self.live) - self.live.count(None)
        # The next forward is queued before this step's tokens are read back, so the
        # device never waits for Python; the rows that end now waste that one step.
        self.logits = self.model(sampled[:, None], cache=self.cache)[:, -1, :]
        mx.async_eval(self.logits)
        self.read = self._reads()
        made_by, self.made_by = self.made_by, [version] * len(self.live)
        done = []
        tokens, logprobs = cast(list[int], sampled.tolist()), cast(list[float], picked.tolist())
        # The cache holds every sampled token now (the forward above): a `keep` row that
        # ends leaves it behind, its prompt and all its tokens.
        left: list[_Kept] = []  # caches that `keep` rows leave behind this step
        for k, (entry, token, logprob) in enumerate(zip(self.live, tokens, logprobs)):
            if entry is None:
                continue
            group, row = entry
            row.tokens.append(token)
            row.logprobs.append(logprob)
            row.versions.append(made_by[k])
            row.stopped = token in self.eos_ids
            if row.stopped or len(row.tokens) >= group.max_tokens:
                group.left -= 1
                if group.left == 0:
                    done.append(group)
                if group.keep:
                    self.kept[group.key] = _Kept(
                        [c.extract(k) for c in cast(list, self.cache)], group.prompt + row.tokens
                    )
                    left.append(self.kept[group.key])
                self.live[k] = None
        # Copied out now: a lazy slice would keep the whole batch's cache alive while its
        # episode waits for its environment.
        mx.eval([(c.keys, c.values) for kept in left for c in kept.cache])
        dead = self.live.count(None)
        if dead == len(self.live) or (dead >= DEAD_SHARE * len(self.live) and self._cuttable()):
            self._drop_dead()
        return [(g.key, [self._completion(r) for r in g.rows]) for g in done]

    def _reads(self) -> dict[str, int]:
        """What a forward reads of the cache: `batch` rows (dead ones included) of `cache`
        positions each, left-padded to the longest; `own` of them are the live rows' own.
        The timeline keeps them: under long tails most of what attention reads is padding
        (docs/benchmarks.md)."""
        layer = cast(list, self.cache)[0]
        if not isinstance(layer, BatchKVCache):
            return {}
        # Called once the forward is queued, before the rows take the token it ran on.
        own = sum(len(e[0].prompt) + len(e[1].tokens) + 1 for e in self.live if e is not None)
        return {"batch": len(self.live), "cache": int(layer._idx), "own": own}

    def _completion(self, row: _Row) -> Completion:
        one = self.static and len(set(row.versions)) == 1
        return Completion(
            row.tokens, row.logprobs, "stop" if row.stopped else "length", None if one else row.versions
        )

    def _cuttable(self) -> bool:
        """Whether the batch's rows can be cut out (caches mlx-lm cannot merge cannot)."""
        return all(hasattr(c, "filter") for c in cast(list, self.cache))

    def sample_tokens(self) -> tuple[mx.array, mx.array]:
        """A token and its logprob for every row in the batch: the live rows' sampled, the
        dead rows' 0 (what they compute is not read). Dead rows are left out of the
        sampling: their logits (after an EOS) can be flat, which would push the whole
        batch off the sampler's fast path."""
        logits, keys = cast(mx.array, self.logits), cast(mx.array, self.keys)
        alive = [k for k, entry in enumerate(self.live) if entry is not None]
        t = mx.array([len(cast(tuple, self.live[k])[1].tokens) for k in alive], dtype=mx.uint32)
        if len(alive) == len(self.live):
            return sample_tokens(logits, keys, t, self.params)
        index = mx.array(alive)
        tokens, logprobs = sample_tokens(logits[index], keys[index], t, self.params)
        sampled, picked = mx.zeros(len(self.live), dtype=tokens.dtype), mx.zeros(len(self.live))
        sampled[index], picked[index] = tokens, logprobs
        return sampled, picked

    def _drop_dead(self) -> None:
        """Cut the dead rows out of the batch."""
        keep = [k for k, entry in enumerate(self.live) if entry is not None]
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
        one larger than max_rows goes alone into an empty batch) and join them. Dead rows
        count as free, and are cut out before a group joins. Static: only into an empty
        batch, and one group at a time for caches mlx-lm cannot merge."""
        joining: list[_Group] = []
        alive = len(self.live) - self.live.count(None)
        if self.static and alive:
            return
        free = self.max_rows - alive
        alone = self.static and not self.mergeable
        while self.waiting and (len(self.waiting[0].rows) <= free or not (alive or joining)):
            if alone and joining:
                break
            joining.append(group := self.waiting.popleft())
            free -= len(group.rows)
        if not joining:
            return
        with spans.span("prefill", groups=len(joining)):
            self._join(joining, alive, version)

    def _join(self, joining: list[_Group], alive: int, version: int) -> None:
        if alive < len(self.live):  # they take the dead rows' places
            self._drop_dead()
        fresh = [g for g in joining if g.kept is None]
        continued = [g for g in joining if g.kept is not None]
        parts = [self._prefill(fresh)] if fresh else []
        self.prefilled += sum(len(g.prompt) for g in fresh)
        if continued:
            parts.append(self._continue(continued))
        joining = fresh + continued  # in the order of `parts`
        keys = mx.concatenate([noise_keys(g.seed, [r.noise for r in g.rows]) for g in joining])
        for cache, logits in parts:
            if self.cache is None:
                self.cache, self.logits = cache, logits
            else:
                for mine, theirs in zip(self.cache, cache):
                    mine.extend(theirs)
                self.logits = mx.concatenate([cast(mx.array, self.logits), logits])
        self.keys = keys if self.keys is None else mx.concatenate([self.keys, keys])
        self.live += [(g, r) for g in joining for r in g.rows]
        self.made_by += [version] * sum(len(g.rows) for g in joining)

    def _prefill(self, groups: list[_Group]) -> tuple[list, mx.array]:
        """The groups' prompts prefilled, each prompt's cache row and logits once per row:
        a batch's caches (one per layer) and its next-token logits [rows, V]."""
        copies = [len(g.rows) for g in groups]
        if self.plain:
            return prefill_batch(self.model, self.head, [g.prompt for g in groups], copies)
        if self.mergeable:
            # Each prompt alone into the model's own caches (a batched prefill has only
            # BatchKVCache's masking), then a copy per row; merge left-pads them.
            caches, logits = [], []
            for g in groups:
                caches.append(cache := make_prompt_cache(self.model))
                logits.append(prefill_logits(self.model, self.head, mx.array([g.prompt]), cache))
            owner = [i for i, n in enumerate(copies) for _ in range(n)]
            layers = [layer.merge([caches[i][k] for i in owner]) for k, layer in enumerate(caches[0])]
            return layers, mx.concatenate(logits)[mx.array(owner)]
        (group,) = groups  # admitted alone
        cache = make_prompt_cache(self.model)
        return cache, prefill_logits(self.model, self.head, mx.array([group.prompt] * copies[0]), cache)

    def _continue(self, groups: list[_Group]) -> tuple[list[BatchKVCache], mx.array]:
        """Prefill what each group's prompt adds to its kept cache, one row at a time (their
        caches and additions differ in length), and merge the rows into a batch."""
        logits = []
        for g in groups:
            kept = cast(_Kept, g.kept)
            new = g.prompt[len(kept.tokens) :]
            if not new:
                # Nothing added (an empty observation): the kept cache has no logits for its
                # last token, so that token runs again.
                for c in kept.cache:
                    c.trim(1)
                new = g.prompt[-1:]
            self.prefilled += len(new)
            logits.append(prefill_logits(self.model, self.head, mx.array([new]), kept.cache))
        layers = zip(*(cast(_Kept, g.kept).cache for g in groups))
        return [BatchKVCache.merge(list(layer)) for layer in layers], mx.concatenate(logits)


def sample_groups(
    model: nn.Module,
    prompts: list[list[int]],
    group_size: int,
    params: SamplingConfig,
    eos_ids: set[int],
    seed: int,
    noise_offset: int = 0,
    noise_ids: list[int] | None = None,
    watch: Watch | None = None,
) -> list[list[Completion]]:
    """`group_size` completions of each prompt, all rows decoding as one batch (a static
    Engine, which takes every cache type). `watch` sees every decode
    step (and may stop the batch by raising Stopped).

    Row j of prompt i has the noise id noise_offset + i * group_size + j (or
    noise_ids[i * group_size + j] when given): its tokens depend only on (seed, that id)
    and the model, so callers that give each group stable ids get the same samples
    whatever the batch holds.
    """
    if not prompts:
        return []
    rows = noise_ids or [noise_offset + r for r in range(len(prompts) * group_size)]
    if len(rows) != len(prompts) * group_size:
        raise ValueError(f"{len(rows)} noise ids for {len(prompts)} prompts of {group_size} rows")
    engine = Engine(model, params, eos_ids, seed, max_rows=len(rows), static=True)
    for i, p in enumerate(prompts):
        engine.add(i, p, rows[i * group_size : (i + 1) * group_size])
    done: dict[int, list[Completion]] = {}
    while engine.busy:
        done.update((cast(int, key), group) for key, group in engine.step())
        if watch is not None:
            watch(engine.decoded)
    return [done[i] for i in range(len(prompts))]

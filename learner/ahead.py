"""Reference logprobs taken while the learner would wait (`algorithm.beta > 0`).

The reference model (the base weights, adapters off) never changes, so a completion's
reference logprobs can be taken any time before its step, and the step then skips its
reference pass (Group.reference, Trainer.prepare). The learner takes them while it would
otherwise wait, for two kinds of groups:

- queued ones, while a batch begun waits for its other groups (`reference_ahead`): under
  long-tailed lengths the learner waits for a batch's last, long groups while the next
  batch's short ones queue up;
- groups still being sampled (`ReferenceAhead`): the reference logprobs of a completion's
  first n tokens are final once those n tokens are sampled. The learner's hello asks the
  actors for a `partial` of each group every PARTIAL_TOKENS tokens (PROTOCOL.md): each
  completion's tokens so far. The learner runs the new ones with the adapters off, on the
  keys and values of what it ran before. When the rollout arrives, only the tokens since
  the last partial are left: what was the step's whole reference pass, on its critical
  path (the learner waits for the group, then runs it), is mostly done.

The rollout is what is trained: where its prompt or a completion does not continue what
the partials said, their work is thrown away and the step takes the reference pass whole.
The keys and values held stay under `train.reference_ahead_mb`; a group that would go
beyond is left to its step.

Both only with groups streamed (with whole batches, `stream_groups = false`, a run stays
the same to the bit) and a learner alone (with several ranks, rank 0 would take them for
rows the other ranks run, and every step waits for the slowest rank).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import cast

import mlx.core as mx
import numpy as np

from learner.building import streams
from learner.groups import Group
from learner.intake import Intake
from learner.trainer import StepStopped, Trainer
from policy.logprobs import PromptState, extend_states, run_prompt, token_logprobs
from policy.model import adapters_disabled
from protocol.messages import Partial
from runtime import spans
from runtime.config import Config

# Tokens between two partials of a group: often enough that little is left when its
# rollout arrives, seldom enough that each forward amortises reading the weights.
PARTIAL_TOKENS = 16
# Positions (rows x tokens) one forward of partials takes at most. The learner runs them
# while it would wait, so what they cost is the wait of a group that arrives during one:
# the batch's last group is on the step's critical path, and waits for the forward.
FORWARD_POSITIONS = 128

Key = tuple[bytes, str]  # (the actor's identity, the group's id)
# Groups whose rollouts came, remembered so that a partial arriving after its rollout (a
# peer's bug) starts nothing that no rollout would ever free.
DONE_KEYS = 4096

log = logging.getLogger("learner")


def takes_reference_ahead(cfg: Config, trainer: Trainer, ranks: int) -> bool:
    """Whether the learner takes reference logprobs ahead: with the KL penalty, groups
    streamed, a learner alone (see above)."""
    return trainer.beta > 0 and streams(cfg, trainer.algorithm, ranks) and ranks == 1


def reference_ahead(trainer: Trainer, g: Group) -> None:
    """The reference logprobs of a group queued for a later take (Intake.next_ahead). One
    group at a time, so that one that arrives is taken soon. A stop abandons it between
    micro-batches; the status does not say stepping, so a stop waits at most one
    micro-batch's reference forward for it (within the supervisor's 30 s), and
    `orchestrator up` keeps saying what the learner waits for."""
    with spans.span("reference logprobs ahead", rows=len(g.texts)):
        try:
            g.reference = trainer.reference_logprobs(g.samples())
        except StepStopped:
            pass  # the learner's loop sees the stop


@dataclass
class _Row:
    state: PromptState  # the prompt and `tokens`, run with the adapters off
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # run so far
    logprobs: list[np.ndarray] = field(default_factory=list)  # theirs, in runs

    @property
    def width(self) -> int:
        """Positions its keys and values hold: the prompt and `tokens`."""
        return self.state[1][0].shape[2]

    @property
    def bytes(self) -> int:
        """What its keys and values take (not its last output: see ReferenceAhead.reserve)."""
        _, keys, values = self.state
        return sum(a.nbytes for a in (*keys, *values))

    def behind(self, newest: np.ndarray) -> bool:
        """Whether `newest` (its completion's tokens so far) holds tokens it has not run."""
        return len(newest) > len(self.tokens)


@dataclass
class _Group:
    prompt: np.ndarray
    newest: list[np.ndarray]  # each completion's tokens in the newest partial
    rows: list[_Row] | None = None  # None: its prompt is not run yet
    reserved: int = 0  # bytes its keys and values take at most (every row at max_tokens)

    def behind(self) -> bool:
        return self.rows is None or any(r.behind(t) for r, t in zip(self.rows, self.newest))


class ReferenceAhead:
    """What the learner takes ahead: queued groups' reference logprobs, and those of the
    groups being sampled as they grow."""

    def __init__(
        self,
        trainer: Trainer | None,
        queued: bool = False,
        budget_mb: float = 0.0,
        max_tokens: int = 0,
        group_size: int = 0,
        vocab_size: int = 0,
    ) -> None:
        """`queued`: take queued groups'; `budget_mb` 0: ask for no partials, hold none.
        Neither: it does nothing (`trainer` may then be None). `max_tokens`: a completion's
        most (sampling.max_tokens), what a group's keys and values are reserved for; a
        partial with more, or not `group_size` completions, or an ID outside the
        vocabulary, is ignored (0: not checked)."""
        self.trainer, self.queued, self.max_tokens = cast(Trainer, trainer), queued, max_tokens
        self.group_size, self.vocab_size = group_size, vocab_size
        self.budget = budget_mb * (1 << 20)
        self.groups: dict[Key, _Group] = {}
        self.refused: set[Key] = set()  # over the budget once: left to their steps
        self.done: OrderedDict[Key, None] = OrderedDict()  # the last DONE_KEYS groups taken
        self.per_position = 0.0  # bytes of keys and values a position, once a prompt ran
        self.last_bytes = 0  # and of a row's last output (hidden states, or logits)

    def offer(self, sender: bytes, p: Partial) -> None:
        """A partial arrived: the group's newest tokens, to run when the learner is free."""
        key = (sender, p.group_id)
        if self.budget <= 0 or key in self.refused or key in self.done:
            return
        if problem := self.problem(p):
            log.warning("ignored a partial of group %s: %s", p.group_id, problem)
            return
        rows = np.split(np.asarray(p.completion_ids), np.cumsum(p.completion_lens)[:-1])
        g = self.groups.get(key)
        if g is None or not _continues(g, p.prompt_ids, rows):
            g = self.groups[key] = _Group(np.array(p.prompt_ids), rows)
        g.newest = rows

    def problem(self, p: Partial) -> str | None:
        """What makes a partial unusable, beyond what its definition checks."""
        lens, ids = p.completion_lens, np.concatenate([p.prompt_ids, p.completion_ids])
        if self.group_size and len(lens) != self.group_size:
            return f"{len(lens)} completions, not group_size {self.group_size}"
        if self.max_tokens and lens.max() > self.max_tokens:
            return f"a completion of {lens.max()} tokens, over max_tokens {self.max_tokens}"
        if self.vocab_size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            return f"a token ID outside the vocabulary of {self.vocab_size}"
        return None

    def forget(self, sender: bytes) -> None:
        """An actor said hello again or is gone: the groups it was sampling never arrive."""
        for key in [k for k in self.groups if k[0] == sender]:
            del self.groups[key]
        self.refused = {k for k in self.refused if k[0] != sender}
        self.done = OrderedDict((k, None) for k in self.done if k[0] != sender)

    @classmethod
    def of(cls, cfg: Config, trainer: Trainer, ranks: int, vocab_size: int) -> ReferenceAhead:
        """The run's: both kinds when the learner takes reference logprobs ahead."""
        on = takes_reference_ahead(cfg, trainer, ranks)
        mb, s = cfg.partials_mb if on else 0.0, cfg.sampling
        return cls(trainer, on, mb, s.max_tokens, s.group_size, vocab_size)

    def discard(self, key: Key) -> None:
        """The group's rollout arrived (and was dropped, or is taken): its partials are done."""
        self.groups.pop(key, None)
        self.refused.discard(key)
        self.done[key] = None
        while len(self.done) > DONE_KEYS:
            self.done.popitem(last=False)

    def work(self, intake: Intake, oldest: int) -> bool:
        """Some of it, while the learner would wait: a queued group's reference logprobs,
        of version `oldest` or younger (Intake.next_ahead), else one forward of a group
        still sampled (run_one). False when there was nothing to do."""
        if self.queued and (g := intake.next_ahead(oldest)):
            reference_ahead(self.trainer, g)  # rather than wait for the batch's other groups
            return True
        return self.run_one()

    def run_one(self) -> bool:
        """One forward, so that a group that arrives meanwhile waits for no more: the
        prompt of the oldest group that has not run it, else the new tokens of every row
        behind its group's newest partial, all in one batch (the actors send their
        groups' partials together, so the rows are as many tokens behind). False when
        none is behind."""
        behind = [(k, g) for k, g in self.groups.items() if g.behind()]
        if not behind:
            return False
        key, g = next(((k, g) for k, g in behind if g.rows is None), (None, None))
        if key is None:
            rows = [(r, new) for _, g in behind for r, new in zip(g.rows or [], g.newest)]
            with spans.span("reference logprobs ahead", rows=len(rows), partial=True):
                self._forward(rows)
            return True
        assert g is not None
        if self.per_position and self.held() + self.reserve(g) > self.budget:  # before its prompt runs
            del self.groups[key]
            self.refused.add(key)
            return True
        with spans.span("reference logprobs ahead", rows=len(g.newest), partial=True):
            self._prompt(g)
        if self.held() > self.budget:  # the first group: what it takes is known only now
            del self.groups[key]
            self.refused.add(key)
        return True

    def take(self, arrived: list[Group]) -> None:
        """Groups whose rollouts arrived: each one's reference logprobs (Group.reference)
        from what its partials ran and the tokens since, when they continue them."""
        for g in arrived:
            self._take(g)

    def _take(self, g: Group) -> None:
        key = (g.sender, g.group_id)
        held = self.groups.get(key)
        self.discard(key)
        if held is None or g.loss_masks is not None or held.rows is None:
            return
        if not _continues(held, g.prompt_ids, g.completion_ids):
            return
        held.newest = [np.asarray(c) for c in g.completion_ids]
        rows = list(zip(held.rows, held.newest))
        with spans.span("reference logprobs ahead", rows=len(rows), partial=False):
            while self._forward(rows):
                pass
        if any(r.behind(new) for r, new in rows):
            return  # a stop: the learner's loop sees it; the group keeps its reference pass
        g.reference = [np.concatenate([np.zeros(0, np.float32), *r.logprobs]) for r in held.rows]

    def held(self) -> int:
        """Bytes reserved for the keys and values of the groups begun."""
        return sum(g.reserved for g in self.groups.values())

    def reserve(self, g: _Group) -> int:
        """What `g`'s keys and values take at most, and its rows' last outputs: every row
        at max_tokens."""
        positions = len(g.prompt) + self.max_tokens
        return int(len(g.newest) * (self.per_position * positions + self.last_bytes))

    def _prompt(self, g: _Group) -> None:
        """Run `g`'s prompt with the adapters off: its rows' first state, and what a
        position's keys and values take."""
        t = self.trainer
        with adapters_disabled(t.model):
            state = run_prompt(t.body, mx.array(g.prompt))
            mx.eval(state)
        g.rows = [_Row(state) for _ in g.newest]
        self.per_position = g.rows[0].bytes / len(g.prompt)
        self.last_bytes = state[0].nbytes
        g.reserved = self.reserve(g)

    def _forward(self, rows: list[tuple[_Row, np.ndarray]]) -> bool:
        """One forward of the rows' next tokens (each row's `newest` beyond what it ran),
        with the adapters off, and their logprobs kept: of the rows that fit (`_fitting`),
        as many rows and tokens as FORWARD_POSITIONS and the learner's logit chunks
        (`train.logit_chunk_mb`) hold.
        False when no row is behind, or on a stop (StepStopped: the learner's loop sees
        it)."""
        t = self.trainer
        most = min(t.logits.chunk or FORWARD_POSITIONS, FORWARD_POSITIONS)
        behind = self._fitting([(r, new) for r, new in rows if r.behind(new)])[:most]
        if not behind:
            return False
        m = max(len(new) - len(r.tokens) for r, new in behind)
        m = min(m, max(1, most // len(behind)))
        runs = [new[len(r.tokens) : len(r.tokens) + m] for r, new in behind]
        try:
            t.check_stop()
        except StepStopped:
            return False
        lengths = [len(run) for run in runs]
        padded = np.zeros((len(runs), max(lengths)), np.int32)  # right-padded
        for n, run in enumerate(runs):
            padded[n, : len(run)] = run
        ids = mx.array(padded)
        with adapters_disabled(t.model):
            outputs, after = extend_states(t.body, [r.state for r, _ in behind], ids, lengths)
            logits = outputs if t.head is None else t.head(outputs)
            logprobs = token_logprobs(logits, ids, t.temperature)
            mx.eval(logprobs, after)
        for n, ((r, _), run, state) in enumerate(zip(behind, runs, after)):
            r.state = state
            r.tokens = np.concatenate([r.tokens, run])
            r.logprobs.append(np.array(logprobs[n, : len(run)], np.float32))
        return True

    def _fitting(self, rows: list[tuple[_Row, np.ndarray]]) -> list[tuple[_Row, np.ndarray]]:
        """The shortest of `rows` whose keys and values, left-padded to the longest as one
        forward has them (twice: padded, then grown), stay within a quarter of the budget;
        at least one row. Shortest first: rows of like lengths waste the least padding."""
        rows = sorted(rows, key=lambda row: row[0].width)
        width, n = 0, 0
        for r, new in rows:
            width = max(width, r.width + len(new) - len(r.tokens))
            if n and (n + 1) * width * self.per_position > self.budget / 4:
                break
            n += 1
        return rows[:n]


def _continues(g: _Group, prompt: np.ndarray, completions: list[np.ndarray]) -> bool:
    """Whether `prompt` and `completions` continue what `g` ran (same prompt, as many
    completions, each starting with the tokens run)."""
    if not np.array_equal(g.prompt, prompt) or len(completions) != len(g.newest):
        return False
    rows = g.rows or []
    return all(np.array_equal(np.asarray(c)[: len(r.tokens)], r.tokens) for r, c in zip(rows, completions))

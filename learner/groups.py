"""Rollout groups as the learner holds them, checked beyond what the wire format checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from learner.batching import TrainRow
from protocol import Message, is_data_cursor
from protocol.messages import Rollout


@dataclass
class Group:
    sender: bytes  # ZeroMQ identity of the actor that sampled it
    group_id: str
    policy_version: int
    prompt: Any
    columns: dict[str, Any]
    prompt_ids: np.ndarray
    completion_ids: list[np.ndarray]
    logprobs: list[np.ndarray]
    texts: list[str]
    finish_reasons: list[str]
    gen_s: float
    actor_peak_mb: float | None
    cursor: list[int] | None = None  # the actor's data cursor just after this prompt
    start_cursor: list[int] | None = None  # and just before it (its slot's previous prompt's cursor)
    row: int | None = None  # the prompt's row in the data file, for error messages
    timings: dict[str, float] = field(default_factory=dict)  # the actor's weight-sync times
    loss_masks: list[np.ndarray] | None = None  # episodes: 1 where the model sampled the token
    turns: list[list[dict]] | None = None  # episodes: each completion's turns as messages
    env_rewards: list[float | None] | None = None  # episodes: what the environment returned, summed
    env_retries: int | None = None  # episodes the actor started again so far
    agent_splits: int | None = None  # agent calls that did not continue their session, so far
    turn_rewards: list[list[float]] | None = None  # episodes: a reward per model turn (GiGPO)
    # Agent sessions that split: each completion's session (0 to G-1); None: one each.
    sessions: list[int] | None = None
    rewards: np.ndarray | None = None  # [completions] weighted sum, set when scored
    rewards_by_function: dict[str, list] = field(default_factory=dict)
    # Each completion's reference logprobs, once the learner took them ahead (it would
    # have waited: learner/ahead.py::reference_ahead).
    reference: list[np.ndarray] | None = None

    def session_rewards(self, group_size: int) -> np.ndarray:
        """[G]: each session's reward (its last completion's), what advantages compare."""
        rewards = cast(np.ndarray, self.rewards)
        if self.sessions is None:
            return rewards
        out = np.full(group_size, np.nan)
        out[self.sessions] = rewards  # a session's later completions win
        return out

    def row_advantages(self, advantages: np.ndarray) -> np.ndarray:
        """Each completion's advantage: its session's, of the group's [G] `advantages`."""
        return advantages if self.sessions is None else advantages[self.sessions]

    @classmethod
    def of_rows(cls, sender: bytes, group_id: str, rows: list[TrainRow]) -> Group:
        """A group of these rows (one prompt, policy version 0), as `samples` gives them
        back: one built without a rollout message (tests, benchmarks)."""
        return cls(
            sender, group_id, 0, "", {}, rows[0].prompt_ids,
            [r.completion_ids for r in rows], [r.behavior_logprobs for r in rows],
            [""] * len(rows), [r.finish_reason for r in rows], 0.0, None,
        )  # fmt: skip

    def samples(self) -> list[TrainRow]:
        """Its completions as the step trains them: tokens, behavior logprobs, loss masks."""
        n = len(self.texts)
        masks: list[np.ndarray | None] = [*self.loss_masks] if self.loss_masks else [None] * n
        refs: list[np.ndarray | None] = [*self.reference] if self.reference else [None] * n
        rows = zip(self.completion_ids, self.logprobs, self.finish_reasons, masks, refs)
        return [TrainRow(self.prompt_ids, ids, lp, fr, mask, ref) for ids, lp, fr, mask, ref in rows]


def model_turns(loss_mask: np.ndarray | None, length: int) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s in a completion's loss mask (None: one turn, all of
    the `length` tokens)."""
    if loss_mask is None:
        return [(0, length)] if length else []
    edges = np.diff(np.concatenate([[0], (np.asarray(loss_mask) > 0).astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


def oldest_version(r: Rollout) -> int:
    """The policy version of a group's oldest sampled token: a group sampled across a
    weight update (`policy_versions`, PROTOCOL.md) is as stale as that, for the staleness
    bound. An episode's environment tokens (`loss_mask` 0) were not sampled: not counted."""
    versions = r.policy_versions
    if versions is not None and r.loss_mask is not None:
        versions = versions[r.loss_mask == 1]
    oldest = int(versions.min()) if versions is not None and versions.size else r.policy_version
    return min(r.policy_version, oldest)


def data_span(r: Rollout) -> tuple[list[int] | None, list[int] | None]:
    """A rollout's place in its actor's data: (`cursor`, `start_cursor`). A `cursor` that is
    no cursor counts as absent (the group is trained, its place unknown). A `start_cursor`
    that is given but malformed, or not before `cursor`, raises ValueError (the drop
    reason): read as absent it would say every prompt before `cursor` is held, and a
    restarted actor would skip those never sent."""
    cursor, start = r.cursor, r.start_cursor
    if start is None:
        return cursor, None
    if not is_data_cursor(start) or cursor is None or not start < cursor:
        raise ValueError(f"start_cursor {start!r} is not an [epoch, position] before cursor {cursor!r}")
    return cursor, start


def check_sizes(r: Rollout, vocab_size: int, group_size: int) -> list[np.ndarray] | None:
    """Raise ValueError (the drop reason) for a group the learner cannot train on; its
    completions' loss masks, split (None: all 1)."""
    ids = np.concatenate([r.prompt_ids, r.completion_ids])
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"token id outside the vocabulary of {vocab_size}")
    lens, sessions = r.completion_lens, r.sessions
    if sessions is not None and sorted(set(sessions)) != list(range(group_size)):
        raise ValueError(f"sessions {sorted(set(sessions))} are not the group's {group_size} sessions")
    if sessions is None and len(lens) != group_size:
        raise ValueError(f"group of {len(lens)} completions, config says {group_size}")
    masks = np.split(r.loss_mask, np.cumsum(lens)[:-1]) if r.loss_mask is not None else None
    if (lens == 0).any() or (masks is not None and not all(m.any() for m in masks)):
        # A completion without a sampled token has nothing to carry its advantage; training
        # on it would silently shrink the batch's loss.
        raise ValueError("empty completion")
    if r.turn_rewards is not None:
        each: list[np.ndarray | None] = [*masks] if masks is not None else [None] * len(lens)
        turns = [len(model_turns(m, int(n))) for m, n in zip(each, lens)]
        if [len(t) for t in r.turn_rewards] != turns:
            raise ValueError(
                f"turn_rewards has {[len(t) for t in r.turn_rewards]} rewards per completion "
                f"for {turns} model turns (runs of loss_mask 1)"
            )
    return masks


def group_from_message(sender: bytes, msg: Message, vocab_size: int, group_size: int) -> Group:
    """Build a Group; raise ValueError (the drop reason) if it cannot be trained on."""
    r = Rollout.read(msg)
    if r.error is not None:
        raise ValueError(r.error)  # the actor could not complete it (e.g. its environment failed)
    masks = check_sizes(r, vocab_size, group_size)
    cursor, start_cursor = data_span(r)
    cuts = np.cumsum(r.completion_lens)[:-1]
    timings = {"weights_transfer_s": r.weights_transfer_s, "weights_apply_s": r.weights_apply_s}
    return Group(
        sender=sender,
        group_id=r.group_id,
        policy_version=oldest_version(r),
        prompt=r.prompt,
        columns=r.columns,
        prompt_ids=r.prompt_ids,
        completion_ids=np.split(r.completion_ids, cuts),
        logprobs=np.split(r.logprobs, cuts),
        texts=r.texts,
        finish_reasons=r.finish_reasons,
        gen_s=float(r.gen_s or 0.0),
        actor_peak_mb=None if r.peak_memory_mb is None else float(r.peak_memory_mb),
        cursor=cursor,
        start_cursor=start_cursor,
        row=r.row,
        timings={k: float(v) for k, v in timings.items() if v is not None},
        loss_masks=masks,
        turns=r.turns,
        env_rewards=r.env_rewards,
        env_retries=r.env_retries,
        agent_splits=r.agent_splits,
        turn_rewards=r.turn_rewards,
        sessions=r.sessions,
    )

"""Rollout groups as the learner holds them, checked beyond what the wire format checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from learner.batching import Sample
from protocol import Message, is_data_cursor


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

    def samples(self) -> list[Sample]:
        """Its completions as the step trains them: tokens, behavior logprobs, loss masks."""
        masks: list[np.ndarray | None] = [*self.loss_masks] if self.loss_masks else [None] * len(self.texts)
        return [
            Sample(self.prompt_ids, ids, lp, fr, mask)
            for ids, lp, fr, mask in zip(self.completion_ids, self.logprobs, self.finish_reasons, masks)
        ]


def model_turns(loss_mask: np.ndarray | None, length: int) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s in a completion's loss mask (None: one turn, all of
    the `length` tokens)."""
    if loss_mask is None:
        return [(0, length)] if length else []
    edges = np.diff(np.concatenate([[0], (np.asarray(loss_mask) > 0).astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


def oldest_version(msg: Message) -> int:
    """The policy version of a group's oldest sampled token: a group sampled across a
    weight update (`policy_versions`, PROTOCOL.md) is as stale as that, for the staleness
    bound. An episode's environment tokens (`loss_mask` 0) were not sampled: not counted."""
    versions = msg.arrays.get("policy_versions")
    if versions is not None and "loss_mask" in msg.arrays:
        versions = versions[msg.arrays["loss_mask"] == 1]
    oldest = int(versions.min()) if versions is not None and versions.size else msg["policy_version"]
    return min(msg["policy_version"], oldest)


def data_span(header: dict) -> tuple[list[int] | None, list[int] | None]:
    """A rollout's place in its actor's data: (`cursor`, `start_cursor`). A `cursor` that is
    no cursor counts as absent (the group is trained, its place unknown). A `start_cursor`
    that is given but malformed, or not before `cursor`, raises ValueError (the drop
    reason): read as absent it would say every prompt before `cursor` is held, and a
    restarted actor would skip those never sent."""
    cursor = header.get("cursor")
    cursor = cursor if is_data_cursor(cursor) else None
    start = header.get("start_cursor")
    if start is None:
        return cursor, None
    if not is_data_cursor(start) or cursor is None or not start < cursor:
        raise ValueError(
            f"start_cursor {start!r} is not an [epoch, position] before cursor {header.get('cursor')!r}"
        )
    return cursor, start


def group_from_message(sender: bytes, msg: Message, vocab_size: int, group_size: int) -> Group:
    """Build a Group; raise ValueError (the drop reason) if it cannot be trained on."""
    if msg.header.get("error") is not None:
        raise ValueError(msg["error"])  # the actor could not complete it (e.g. its environment failed)
    a = msg.arrays
    ids = np.concatenate([a["prompt_ids"], a["completion_ids"]])
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"token id outside the vocabulary of {vocab_size}")
    lens = a["completion_lens"]
    sessions = msg.header.get("sessions")
    if sessions is not None and sorted(set(sessions)) != list(range(group_size)):
        raise ValueError(f"sessions {sorted(set(sessions))} are not the group's {group_size} sessions")
    if sessions is None and len(lens) != group_size:
        raise ValueError(f"group of {len(lens)} completions, config says {group_size}")
    cuts = np.cumsum(lens)[:-1]
    masks = np.split(a["loss_mask"], cuts) if "loss_mask" in a else None
    if (lens == 0).any() or (masks is not None and not all(m.any() for m in masks)):
        # A completion without a sampled token has nothing to carry its advantage; training
        # on it would silently shrink the batch's loss.
        raise ValueError("empty completion")
    turn_rewards = msg.header.get("turn_rewards")
    if turn_rewards is not None:
        each: list[np.ndarray | None] = [*masks] if masks is not None else [None] * len(lens)
        turns = [len(model_turns(m, int(n))) for m, n in zip(each, lens)]
        if [len(r) for r in turn_rewards] != turns:
            raise ValueError(
                f"turn_rewards has {[len(r) for r in turn_rewards]} rewards per completion "
                f"for {turns} model turns (runs of loss_mask 1)"
            )
    cursor, start_cursor = data_span(msg.header)
    gen_s = msg.header.get("gen_s", 0.0)
    peak = msg.header.get("peak_memory_mb")
    return Group(
        sender=sender,
        group_id=msg["group_id"],
        policy_version=oldest_version(msg),
        prompt=msg["prompt"],
        columns=msg["columns"],
        prompt_ids=a["prompt_ids"],
        completion_ids=np.split(a["completion_ids"], cuts),
        logprobs=np.split(a["logprobs"], cuts),
        texts=msg["texts"],
        finish_reasons=msg["finish_reasons"],
        gen_s=float(gen_s) if isinstance(gen_s, (int, float)) else 0.0,
        actor_peak_mb=float(peak) if isinstance(peak, (int, float)) else None,
        cursor=cursor,
        start_cursor=start_cursor,
        row=row if type(row := msg.header.get("row")) is int else None,
        timings={
            k: float(v)
            for k in ("weights_transfer_s", "weights_apply_s")
            if isinstance(v := msg.header.get(k), (int, float)) and not isinstance(v, bool)
        },
        loss_masks=masks,
        turns=msg.header.get("turns"),
        env_rewards=msg.header.get("env_rewards"),
        env_retries=v if type(v := msg.header.get("env_retries")) is int else None,
        agent_splits=v if type(v := msg.header.get("agent_splits")) is int else None,
        turn_rewards=turn_rewards,
        sessions=sessions,
    )

"""GiGPO (Group-in-Group Policy Optimization, arXiv 2505.10978): a step-level advantage
for multi-turn episodes, added to the episode-level one.

An episode's completion is one token sequence whose `loss_mask` is 1 on the model's
sampled tokens: model turn k is the k-th run of 1s. Its anchor state is what the model saw
just before it: for turn 0 the prompt and any environment tokens before the first sampled
one, for later turns the environment's tokens between turn k-1 and turn k. Steps of a
group's episodes with identical anchors (exact token match) form a step group; a step's
discounted return G_k = r_k + gamma * G_{k+1}, normalised within its step group, is its
step advantage. Every token of turn k of episode i is trained with

    A(i, k) = A_episode(i) + omega * A_step(i, k)

A_episode is the algorithm's own advantage of the episode (GRPO's group normalisation
unless the algorithm says otherwise). An unscored episode (NaN reward) carries no signal:
its advantages are 0 and its steps stay out of their step groups' mean and std.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from learner.algorithms import nanmean_rows, scale
from learner.batching import TrainRow, token_rows
from learner.groups import Group, model_turns


def anchor_states(
    prompt_ids: np.ndarray, completion_ids: np.ndarray, loss_mask: np.ndarray | None
) -> list[tuple[int, ...]]:
    """Each model turn's anchor state as token ids: turn 0's is the prompt and the
    environment tokens before the first sampled one; turn k's, the environment tokens
    between turn k-1 and turn k."""
    anchors, previous_end = [], 0
    for k, (start, end) in enumerate(model_turns(loss_mask, len(completion_ids))):
        before = tuple(np.asarray(completion_ids[previous_end:start]).tolist())
        anchors.append(tuple(np.asarray(prompt_ids).tolist()) + before if k == 0 else before)
        previous_end = end
    return anchors


def discounted_returns(step_rewards: Sequence[float], gamma: float) -> np.ndarray:
    """G_k = r_k + gamma * G_{k+1}, from the last step back."""
    returns = np.zeros(len(step_rewards))
    running = 0.0
    for k in range(len(step_rewards) - 1, -1, -1):
        running = step_rewards[k] + gamma * running
        returns[k] = running
    return returns


@dataclass(frozen=True)
class GroupAdvantages:
    """A group's GiGPO advantages: per episode, and per episode and model turn."""

    episode: np.ndarray  # [G]
    step: list[np.ndarray]  # [turns of episode i]
    combined: list[np.ndarray]  # episode + omega * step, per turn
    step_group_sizes: list[int]  # the scored steps of each step group


def gigpo_group(
    rewards: np.ndarray,
    step_rewards: Sequence[Sequence[float]] | None,
    anchors: Sequence[Sequence[Hashable]],
    *,
    gamma: float,
    omega: float,
    scale_rewards: str = "group",
    episode: np.ndarray | None = None,
) -> GroupAdvantages:
    """GiGPO over one group of G episodes. `rewards` [G] (NaN: unscored); `step_rewards`:
    per episode, one reward per model turn (None: 0 for every turn but the last, which
    has the episode's reward); `anchors`: per episode, each turn's anchor state (any
    hashable). `episode`: the episode-level advantages when the algorithm gives its own,
    else GRPO's, (R - mean) / (std + eps), no std with `scale_rewards = "none"`. The step
    groups are scaled by their own std unless `scale_rewards` is "none"."""
    rewards = np.asarray(rewards, dtype=np.float64)
    if episode is None:
        row = rewards[None, :]
        centered = row - nanmean_rows(row)
        episode = np.nan_to_num(scale(centered, row, scale_rewards), nan=0.0).reshape(-1)
    returns = []
    for i, turns in enumerate(anchors):
        if np.isnan(rewards[i]):
            returns.append(np.full(len(turns), np.nan))  # no signal: out of the step groups
            continue
        got = step_rewards[i] if step_rewards is not None else [0.0] * (len(turns) - 1) + [rewards[i]]
        if len(got) != len(turns):
            raise ValueError(f"episode {i} has {len(turns)} model turns but {len(got)} step rewards")
        returns.append(discounted_returns(got, gamma))
    members: dict[Hashable, list[tuple[int, int]]] = {}
    for i, turns in enumerate(anchors):
        for k, anchor in enumerate(turns):
            members.setdefault(anchor, []).append((i, k))
    step = [np.zeros(len(turns)) for turns in anchors]
    sizes = []
    for steps in members.values():
        values = np.array([[returns[i][k] for i, k in steps]])
        sizes.append(int((~np.isnan(values)).sum()))
        # One scored step: its own mean, so 0 (and no std: NaN, then 0).
        centered = values - nanmean_rows(values)
        scaled = np.nan_to_num(
            scale(centered, values, "none" if scale_rewards == "none" else "group"), nan=0.0
        )
        for (i, k), a in zip(steps, scaled[0]):
            step[i][k] = a
    sizes = [n for n in sizes if n]
    combined = [episode[i] + omega * s for i, s in enumerate(step)]
    return GroupAdvantages(np.asarray(episode, dtype=np.float64), step, combined, sizes)


def turn_values(loss_mask: np.ndarray | None, length: int, values: np.ndarray) -> np.ndarray:
    """A completion's per-token array: `values[k]` on the tokens of model turn k, 0 on the
    environment's."""
    out = np.zeros(length, dtype=np.float32)
    for (start, end), v in zip(model_turns(loss_mask, length), values):
        out[start:end] = v
    return out


def batch_advantages(
    groups: list[Group],
    samples: list[TrainRow],
    advantages: np.ndarray,
    *,
    gamma: float,
    omega: float,
    scale_rewards: str,
) -> tuple[np.ndarray, dict[str, float]]:
    """The batch's per-token advantages [B, T], laid out as make_batch lays out its mask
    (learner.batching.token_rows), from the algorithm's episode advantages [B] and each
    group's steps; and the step groups' metrics."""
    per_token, sizes, row = [], [], 0
    for g in groups:
        n = len(g.completion_ids)
        masks: list[np.ndarray | None] = [*g.loss_masks] if g.loss_masks else [None] * n
        anchors = [anchor_states(g.prompt_ids, ids, m) for ids, m in zip(g.completion_ids, masks)]
        assert g.rewards is not None  # a batch's groups are scored
        got = gigpo_group(
            g.rewards,
            g.turn_rewards,
            anchors,
            gamma=gamma,
            omega=omega,
            scale_rewards=scale_rewards,
            episode=advantages[row : row + n],
        )
        per_token += [turn_values(m, len(ids), c) for ids, m, c in zip(g.completion_ids, masks, got.combined)]
        sizes += got.step_group_sizes
        row += n
    stats = {
        "gigpo/step_groups": float(sum(n > 1 for n in sizes)),
        "gigpo/step_group_size_mean": float(np.mean(sizes)) if sizes else 0.0,
    }
    return token_rows(samples, per_token), stats

"""A sampled group as the `rollout` message the learner reads (PROTOCOL.md, `rollout`).

Kept apart from the actor's loop (actor/service.py) because it is pure: what a group
becomes on the wire, whichever way it was sampled (the engine, continuous or static; episodes).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import cast

import mlx.core as mx
import numpy as np

from policy.data import Prompt
from policy.sampler import Completion
from protocol.messages import Rollout
from protocol.wire import MAX_HEADER_BYTES

log = logging.getLogger("actor")


@dataclass
class PlacedPrompt:
    """A prompt drawn from the slot's data stream, until its group is sent."""

    prompt: Prompt
    start: list[int]  # the data cursor before it (the rollout's `start_cursor`)
    cursor: list[int]  # and after it (the rollout's `cursor`)
    first_noise: int  # its rows' noise ids follow from here


def completion_fields(
    prompt: Prompt, completions: list[Completion], decode: Callable[[list[int]], str]
) -> tuple[dict, dict]:
    """A single-turn group's rollout fields and arrays."""
    ids = [c.token_ids for c in completions]
    fields = {
        "texts": [decode(t) for t in ids],
        "finish_reasons": [c.finish_reason for c in completions],
    }
    arrays = {
        "prompt_ids": np.array(prompt.prompt_ids, dtype=np.int32),
        "completion_ids": np.array(sum(ids, []), dtype=np.int32),
        "completion_lens": np.array([len(t) for t in ids], dtype=np.int32),
        "logprobs": np.array(sum((c.logprobs for c in completions), []), dtype=np.float32),
    }
    # A static batch decodes under one version, which the header's policy_version says.
    if all(c.versions is not None for c in completions):
        versions = sum((c.versions or [] for c in completions), [])
        arrays["policy_versions"] = np.array(versions, dtype=np.int32)
    return fields, arrays


def rewards_per_run(mask: list[int], starts: list[int], rewards: list[float]) -> list[float]:
    """A completion's `turn_rewards` (PROTOCOL.md): one per run of `loss_mask` 1, which is
    what the learner counts as a model turn. Each model turn (its first token's place in
    the completion, and its reward) adds to the run it starts in; a turn that sampled
    nothing, or that joined its neighbour (no context between them), adds to the run
    before it."""
    runs = [k for k, m in enumerate(mask) if m and (k == 0 or not mask[k - 1])]
    out = [0.0] * len(runs)
    for start, reward in zip(starts, rewards):
        at = sum(r <= start for r in runs) - 1  # the last run that starts at or before it
        out[max(at, 0)] += reward
    return out


def rollout_message(
    drawn: PlacedPrompt,
    group_id: str,
    policy_version: int | None,
    timings: dict[str, float],
    fields: dict,
    arrays: dict,
    gen_s: float,
) -> Rollout:
    """The rollout (protocol/messages.py): where its prompt is in the data, the weights it
    was sampled with (its oldest token's, when they changed while it decoded), and the
    `fields` and `arrays` its sampling gave (named as the definition names them)."""
    versions = arrays.get("policy_versions")
    assert versions is not None or policy_version is not None, "an actor samples once it has weights"
    return Rollout(
        group_id=group_id,
        cursor=drawn.cursor,
        start_cursor=drawn.start,
        row=drawn.prompt.index,
        weights_transfer_s=timings.get("weights_transfer_s"),
        weights_apply_s=timings.get("weights_apply_s"),
        policy_version=int(versions.min()) if versions is not None else cast(int, policy_version),
        prompt=drawn.prompt.prompt,
        columns=drawn.prompt.columns,
        **fields,
        **arrays,
        gen_s=gen_s,
        peak_memory_mb=mx.get_peak_memory() / (1 << 20),
    )


def rollout_frames(rollout: Rollout) -> list:
    """The group's frames; one whose header the learner would refuse unread (over the
    protocol's limit: huge texts or data columns) goes as an `error` group instead, so the
    learner counts it as dropped, with the reason."""
    frames = rollout.frames()
    if len(frames[0]) <= MAX_HEADER_BYTES:
        return frames
    reason = f"rollout header over the protocol's limit of {MAX_HEADER_BYTES} bytes (texts, prompt, columns)"
    log.error(
        "data row %s: a rollout header of %d bytes is over the protocol's limit of %d bytes; "
        "its group is sent as dropped",
        rollout.row,
        len(frames[0]),
        MAX_HEADER_BYTES,
    )
    empty = [""] * len(rollout.texts)
    return replace(rollout, prompt="", columns={}, texts=empty, turns=None, error=reason).frames()

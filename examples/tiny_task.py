"""The default task: each prompt names a digit; say that digit as often as you can.

The untrained tiny model emits nearly uniform characters, so it starts near a reward of
1/64 and GRPO has an unambiguous signal to climb.
"""

from __future__ import annotations


def reward(prompts, completions, completion_ids, target, **columns) -> list[float]:
    """TRL-style reward: fraction of the completion's characters equal to `target`."""
    return [c.count(t) / max(len(c), 1) for c, t in zip(completions, target)]

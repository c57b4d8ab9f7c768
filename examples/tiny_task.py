"""The default task: each prompt names a digit; say that digit as often as you can.

The untrained tiny model emits nearly uniform characters, so it starts near a reward of
1/64 and GRPO has an unambiguous signal to climb.
"""

from __future__ import annotations


def reward(prompts, completions, completion_ids, target, **columns) -> list[float]:
    """TRL-style reward: fraction of the completion's characters equal to `target`."""
    return [c.count(t) / max(len(c), 1) for c, t in zip(completions, target)]


def chat_reward(prompts, completions, completion_ids, answer, **columns) -> list[float]:
    """The same task for chat prompts: completions are [{"role": "assistant", ...}] lists,
    and the digit comes from the `answer` column."""
    texts = [c[0]["content"] for c in completions]
    return [t.count(a) / max(len(t), 1) for t, a in zip(texts, answer)]

"""A multi-turn task for the tiny model: the environment shows a digit, the model answers,
the environment shows the next one. Each answer scores the fraction of its characters
that are the digit shown; the episode's reward is their mean over the row's digits (an
answer the model never gave scores 0).

`orchestrator up --config examples/digits.toml` serves this class with an env worker;
`python examples/digits_env.py` rewrites `digits_prompts.jsonl`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path


class DigitsEnv:
    """One instance per episode (PROTOCOL.md, "The env socket"; docs/environments.md)."""

    def reset(self, prompt: str, digits: str, **columns) -> str:
        self.digits, self.turn = digits, 0
        return ""  # the prompt already shows the first digit

    def step(self, action: str) -> tuple[str, float, bool]:
        digit = self.digits[self.turn]
        reward = action.count(digit) / max(len(action), 1) / len(self.digits)
        self.turn += 1
        if self.turn == len(self.digits):
            return "", reward, True
        return f"\nrepeat {self.digits[self.turn]}", reward, False


def digit_share(prompts, completions, digits, **columns) -> list[float]:
    """A TRL-style reward function for the same task (`orchestrator reward-worker
    digits_env:digit_share` serves it; benchmarks/chaos.py does): the share of each whole
    episode's characters that are the row's first digit."""
    return [c.count(d[0]) / max(len(c), 1) for c, d in zip(completions, digits)]


def write_prompts(path: Path, rows: int = 200, turns: int = 3, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            digits = "".join(rng.choice("0123456789") for _ in range(turns))
            f.write(json.dumps({"prompt": f"repeat {digits[0]}", "digits": digits}) + "\n")


if __name__ == "__main__":
    write_prompts(Path(__file__).with_name("digits_prompts.jsonl"))

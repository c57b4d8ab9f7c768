"""The arithmetic task: add or subtract two numbers from 0 to 99.

    prompt      "what is 47 + 85?"
    completion  "<answer>132</answer>"

The answer is checked exactly (`rewards.verifiable.answer_match`), so pass@1 means what
it says. The problems are drawn by a seeded RNG; the held-out problems never appear in
the training prompts nor in the warm start that built `arithmetic-model/`
(`build_arithmetic_model.py`). `python examples/arithmetic_task.py` rewrites the two
prompt files bit for bit.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).parent
TRAIN, HELDOUT = HERE / "arithmetic_train.jsonl", HERE / "arithmetic_heldout.jsonl"
SEED, N_TRAIN, N_HELDOUT = 1234, 5000, 200


def problem(rng: random.Random) -> dict:
    """One problem: operands from 0 to 99; a subtraction never goes below zero."""
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    if rng.random() < 0.5:
        return {"prompt": f"what is {a} + {b}?", "answer": str(a + b)}
    a, b = max(a, b), min(a, b)
    return {"prompt": f"what is {a} - {b}?", "answer": str(a - b)}


def completion(row: dict) -> str:
    """The completion the warm start teaches."""
    return f"<answer>{row['answer']}</answer>"


def heldout_problems() -> list[dict]:
    """The held-out split: the first N_HELDOUT distinct problems of the seeded stream."""
    rng, rows, seen = random.Random(SEED), [], set()
    while len(rows) < N_HELDOUT:
        row = problem(rng)
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            rows.append(row)
    return rows


def training_problems(seed: int) -> Iterator[dict]:
    """An endless stream of problems that are never held out."""
    held = {row["prompt"] for row in heldout_problems()}
    rng = random.Random(seed)
    while True:
        row = problem(rng)
        if row["prompt"] not in held:
            yield row


def write_prompts() -> None:
    stream = training_problems(SEED + 1)
    for path, rows in ((TRAIN, [next(stream) for _ in range(N_TRAIN)]), (HELDOUT, heldout_problems())):
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        print(f"{path}: {len(rows)} problems")


if __name__ == "__main__":
    write_prompts()

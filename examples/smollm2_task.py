"""The real-model task: single-digit arithmetic facts in chat, for SmolLM2-135M-Instruct.

    prompt      [{"role": "user", "content": "What is 7 + 5? Answer with just the number."}]
    answer      "12"   (rewards.verifiable:final_number: the reply's last number)

Sums and differences of digits and products from the times tables (2 to 9): 219
problems. 30% of the facts are held out and never trained on, both orders of a sum or a
product together (3 + 5 is held out with 5 + 3). Chosen by measurement (docs/benchmarks.md,
"A real model"): the model has a foothold here (near-greedy pass@1 about 0.5 on sums of
digits and 0.4 on products, against 0.1-0.2 on sums of two-digit numbers), but at
temperature 1 it mostly rambles, and the only reward is the right number. `python
examples/smollm2_task.py` writes the two prompt files beside this one, the same bytes
each time.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent
TRAIN, HELDOUT = HERE / "smollm2_train.jsonl", HERE / "smollm2_heldout.jsonl"
SEED, HELDOUT_SHARE = 1234, 0.3


def problems() -> list[tuple[tuple, dict]]:
    """Every problem, in a fixed order, with the fact it asks: 3 + 5 and 5 + 3 are one
    fact (held out or trained together), 5 - 3 is its own."""
    rows = [(("+", a, b), f"What is {a} + {b}?", a + b) for a in range(10) for b in range(10)]
    rows += [(("-", a, b), f"What is {a} - {b}?", a - b) for a in range(10) for b in range(a + 1)]
    rows += [(("x", a, b), f"What is {a} times {b}?", a * b) for a in range(2, 10) for b in range(2, 10)]
    out = []
    for (op, a, b), question, answer in rows:
        fact = (op, a, b) if op == "-" else (op, min(a, b), max(a, b))
        prompt = [{"role": "user", "content": f"{question} Answer with just the number."}]
        out.append((fact, {"prompt": prompt, "answer": str(answer)}))
    return out


def split() -> tuple[list[dict], list[dict]]:
    """(training, held-out) problems: every fact of a held-out problem is held out too
    (both orders of a sum or a product), a share HELDOUT_SHARE of the facts, by the seed."""
    rows = problems()
    facts = sorted({f for f, _ in rows})
    random.Random(SEED).shuffle(facts)
    held = set(facts[: round(HELDOUT_SHARE * len(facts))])
    return [r for f, r in rows if f not in held], [r for f, r in rows if f in held]


def write_prompts() -> None:
    for path, rows in zip((TRAIN, HELDOUT), split()):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    write_prompts()

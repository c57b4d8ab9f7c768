"""Reward functions for verifiable answers, with TRL's signature: name them in
`reward.functions` as `rewards.verifiable:answer_match` and so on.

Each takes the completions (strings, or `[{"role": "assistant", "content": ...}]` for chat
prompts) and the row's columns, and returns one reward per completion. Their scoring is
exact and written in each docstring; docs/data-and-rewards.md lists them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def text_of(completion: Any) -> str:
    """A completion's text: the string, or the content of a chat completion's last message."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def tagged_answer(text: str) -> str | None:
    """The content of the last `<answer>...</answer>` in `text`, stripped; None without one."""
    found = ANSWER_TAG.findall(text)
    return found[-1].strip() if found else None


def answer_format(completions: list, **kwargs) -> list[float]:
    """1.0 when the completion ends with its only `<answer>...</answer>` pair, whose content
    is not blank (any text may come before it, only whitespace after); 0.0 otherwise: no
    tag, an empty one, two answers, a stray tag, text after the answer."""
    rewards = []
    for c in completions:
        text = text_of(c).rstrip()
        found = ANSWER_TAG.findall(text)
        ok = (
            len(found) == 1
            and found[0].strip()
            and text.endswith("</answer>")
            and text.count("<answer>") == text.count("</answer>") == 1
        )
        rewards.append(1.0 if ok else 0.0)
    return rewards


def _same(given: str, expected: str) -> bool:
    """Equal as text, or as numbers when both are numbers ("7.0" is "7", "1,000" is "1000")."""
    if given == expected:
        return True
    try:
        return float(given.replace(",", "")) == float(expected.replace(",", ""))
    except ValueError:
        return False


def answer_match(completions: list, answer: list, **kwargs) -> list[float]:
    """1.0 when the last `<answer>` tag's content, stripped, equals the row's `answer` column
    (as text, or as numbers when both are numbers); 0.0 otherwise, and when there is no tag."""
    rewards = []
    for c, expected in zip(completions, answer):
        given = tagged_answer(text_of(c))
        rewards.append(1.0 if given is not None and _same(given, str(expected).strip()) else 0.0)
    return rewards


NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(completions: list, answer: list, **kwargs) -> list[float]:
    """1.0 when the last number in the completion (digits, with an optional sign, thousands
    commas and decimals) equals the row's `answer` as a number; 0.0 otherwise, and when
    the completion holds no number. For a model that answers in its own words ("7 + 5 =
    12.", "The answer is 12"): no tag to learn, and an explanation that ends on a wrong
    number fails."""
    rewards = []
    for c, expected in zip(completions, answer):
        found = NUMBER.findall(text_of(c))
        rewards.append(1.0 if found and _same(found[-1].rstrip(","), str(expected).strip()) else 0.0)
    return rewards


def math_answer(
    completions: list, solution: list | None = None, answer: list | None = None, **kwargs
) -> list[float | None]:
    """math-verify's judgement (the `math` extra), as TRL's `accuracy_reward`: the gold is the
    row's `solution` column (else `answer`), parsed as LaTeX or a plain expression; the
    completion's answer is its last `<answer>` tag's content if it has one, else the
    whole text, where a `\\boxed{}` is tried first. 1.0 when they are equivalent, 0.0 when
    not (or the completion holds no parsable answer), None when the gold itself does not
    parse (the completion is then left out, not punished)."""
    try:
        from math_verify import LatexExtractionConfig, parse, verify
    except ImportError:
        raise ImportError(
            "rewards.verifiable:math_answer needs math-verify: pip install 'mlx-rl-ipc[math]'"
        ) from None
    golds = solution if solution is not None else answer
    if golds is None:
        raise ValueError("math_answer needs a `solution` or an `answer` column")
    rewards: list[float | None] = []
    for c, gold in zip(completions, golds):
        gold_parsed = parse(str(gold))
        if not gold_parsed:
            rewards.append(None)
            continue
        text = text_of(c)
        tagged = tagged_answer(text)
        # A tag holds a bare answer ("3/4"); a free text needs its math found (boxed first).
        given = (
            parse(tagged)
            if tagged is not None
            else parse(text, extraction_config=[LatexExtractionConfig(boxed_match_priority=0)])
        )
        rewards.append(1.0 if given and verify(gold_parsed, given) else 0.0)
    return rewards


def soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> Callable[..., list[float]]:
    """DAPO's length penalty, as TRL's `get_soft_overlong_punishment`. With L = tokens in the
    completion, L_max = `max_completion_len` and L_c = `soft_punish_cache`: 0 for
    L <= L_max - L_c, (L_max - L_c - L) / L_c between, -1 beyond L_max. Make one in your
    reward module (`overlong = soft_overlong_punishment(512, 64)`) and name that."""
    if not 0 <= soft_punish_cache <= max_completion_len:
        raise ValueError("soft_punish_cache must be between 0 and max_completion_len")
    free = max_completion_len - soft_punish_cache

    def overlong(completion_ids: list, **kwargs) -> list[float]:
        return [
            0.0
            if len(ids) <= free
            else (free - len(ids)) / soft_punish_cache
            if len(ids) <= max_completion_len
            else -1.0
            for ids in completion_ids
        ]

    overlong.__name__ = "soft_overlong_punishment"
    return overlong

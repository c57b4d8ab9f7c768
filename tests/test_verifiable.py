"""rewards.verifiable: each helper's scoring, case by case, as its docstring states it."""

from __future__ import annotations

import numpy as np
import pytest

from rewards.scorer import Scorer
from rewards.verifiable import (
    answer_format,
    answer_match,
    final_number,
    math_answer,
    soft_overlong_punishment,
)
from runtime.config import RewardConfig


def chat(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def test_answer_format():
    completions = [
        "<answer>12</answer>",
        "so <answer> 3 </answer>\n",
        "<answer>12</answer>34",
        "<answer></answer>",
        "<answer> </answer>",
        "12",
        "<answer>1</answer><answer>2</answer>",
        "<answer>1</answer> <answer>",
        "<answer>1",
        chat("<answer>x</answer>"),
    ]
    assert answer_format(completions) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]


def test_final_number():
    completions = [
        "7 + 5 = 12",
        "The answer is 12.",
        "12, not 13",
        "1,200 apples",
        "-3",
        "twelve",
        "12.0",
        [{"role": "assistant", "content": "so 5 + 7 is 12"}],
        "12 + 0 = 12 or 13",
    ]
    answers = ["12", "12", "12", "1200", "-3", "12", "12", "12", "12"]
    assert final_number(completions, answers) == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    assert final_number(["it is 85."], [85]) == [1.0]  # a numeric column


def test_answer_match():
    completions = [
        "<answer>432</answer>",
        "<answer> 432 </answer>",
        "<answer>432.0</answer>",
        "<answer>431</answer>",
        "432",
        "<answer>1</answer> then <answer>432</answer>",
        "<answer>1,000</answer>",
        chat("<answer>Paris</answer>"),
        "<answer>paris</answer>",
    ]
    answers = ["432", "432", "432", "432", "432", "432", "1000", "Paris", "Paris"]
    assert answer_match(completions, answers) == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    assert answer_match(["<answer>7</answer>"], [7]) == [1.0]  # a numeric column


def test_math_answer_judges_equivalence_and_skips_an_unparsable_gold():
    pytest.importorskip("math_verify")
    completions = [
        chat(r"My answer is \boxed{\frac{1}{3}}"),
        chat(r"My answer is \boxed{\frac{1}{2}}"),
        "<answer>1/3</answer>",
        "<answer>0.5</answer>",
        "no answer here",
        "<answer>2</answer>",
    ]
    solutions = [
        r"\frac{1}{3}",
        r"\frac{1}{3}",
        r"$\frac{1}{3}$",
        r"$\frac{1}{3}$",
        r"$\frac{1}{3}$",
        "not math at all",
    ]
    assert math_answer(completions, solution=solutions) == [1.0, 0.0, 1.0, 0.0, 0.0, None]
    assert math_answer(["<answer>4</answer>"], answer=["4"]) == [1.0]  # `answer` when no `solution`


def test_soft_overlong_punishment():
    overlong = soft_overlong_punishment(max_completion_len=10, soft_punish_cache=4)
    ids = [[0] * n for n in (3, 6, 7, 8, 10, 11)]
    assert overlong(completion_ids=ids) == pytest.approx([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    # TRL's documented example
    trl = soft_overlong_punishment(100, 20)
    assert trl(completion_ids=[[1] * 50, [1] * 110]) == [0.0, -1.0]
    with pytest.raises(ValueError):
        soft_overlong_punishment(10, 11)


def test_the_helpers_load_by_name_from_a_config():
    """`rewards.verifiable:...` is importable by the scorer whatever the config's directory."""
    scorer = Scorer(
        RewardConfig(
            ("rewards.verifiable:answer_match", "rewards.verifiable:answer_format"),
            (1.0, 0.1),
            search_path="/nonexistent",
        )
    )
    texts = ["<answer>4</answer>", "<answer>5</answer>", "4"]
    scored = scorer.submit("k", "what is 2 + 2?", texts, [[1]] * 3, {"answer": "4"})
    np.testing.assert_allclose(scored.total, [1.1, 0.1, 0.0])

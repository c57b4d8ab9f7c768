"""Prompt data: JSONL rows with a `prompt` (text or chat messages) and any other columns.

Rows are rendered and tokenized once, up front, so a bad row is reported with its line
number before sampling starts. The other columns travel with every group to the rewards.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class DataError(ValueError):
    """A prompt file problem; the message names the file and line."""


@dataclass
class Prompt:
    index: int  # row number in the file, 0-based
    prompt: Any  # as written: a string or a list of chat messages
    prompt_ids: list[int]
    columns: dict[str, Any]


def _check_messages(prompt: Any, where: str) -> None:
    if not prompt or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in prompt
    ):
        raise DataError(f"{where}: a chat prompt must be a non-empty list of "
                        "{'role': str, 'content': str} messages")


def encode_prompt(tokenizer: Any, prompt: Any) -> list[int]:
    """Text is encoded as is; chat messages go through the tokenizer's chat template with
    the generation prompt added (so the model answers as the assistant)."""
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt))
    text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    # The template already holds any BOS token; do not let encode add a second one.
    return list(tokenizer.encode(text, add_special_tokens=False))


def load_prompts(path: str | Path, tokenizer: Any, max_prompt_tokens: int) -> list[Prompt]:
    """Read and tokenize every row; long prompts keep their last `max_prompt_tokens` tokens
    (the end holds the question and the generation prompt)."""
    prompts = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON: {e}") from None
            if not isinstance(row, dict) or "prompt" not in row:
                raise DataError(f"{where}: each row must be an object with a 'prompt' field")
            prompt = row.pop("prompt")
            if isinstance(prompt, list):
                _check_messages(prompt, where)
            elif not isinstance(prompt, str) or not prompt:
                raise DataError(f"{where}: 'prompt' must be a non-empty string or a message list")
            ids = encode_prompt(tokenizer, prompt)
            if not ids:
                raise DataError(f"{where}: the prompt encodes to no tokens")
            prompts.append(Prompt(len(prompts), prompt, ids[-max_prompt_tokens:], row))
    if not prompts:
        raise DataError(f"{path}: no prompts")
    return prompts


def check_context(prompts: list[Prompt], context: int | None, max_tokens: int) -> None:
    """A prompt plus `max_tokens` must fit the model's context (`max_position_embeddings`);
    past it RoPE positions are untrained and the completion is garbage. Names the row."""
    if not context:
        return
    for p in prompts:
        if len(p.prompt_ids) + max_tokens > context:
            raise DataError(f"data row {p.index}: {len(p.prompt_ids)} prompt tokens + "
                            f"sampling.max_tokens {max_tokens} exceed the model's context of "
                            f"{context}; lower sampling.max_prompt_tokens or sampling.max_tokens")


class PromptStream:
    """Endless iteration over prompts, reshuffled each epoch with a seeded RNG.

    `cursor` (epoch, position) is all a resumed run needs to continue where it stopped.
    """

    def __init__(self, prompts: list[Prompt], shuffle: bool, seed: int,
                 cursor: tuple[int, int] = (0, 0)) -> None:
        self.prompts, self.shuffle, self.seed = prompts, shuffle, seed
        self.epoch, self.position = cursor
        self._order = self._epoch_order()

    def _epoch_order(self) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    @property
    def cursor(self) -> tuple[int, int]:
        return self.epoch, self.position

    def __iter__(self) -> Iterator[Prompt]:
        return self

    def __next__(self) -> Prompt:
        if self.position >= len(self._order):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._epoch_order()
        prompt = self.prompts[self._order[self.position]]
        self.position += 1
        return prompt

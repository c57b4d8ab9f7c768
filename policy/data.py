"""Prompt data: rows with a prompt column (text or chat messages) and any other columns.

Rows come from a JSONL, JSON, CSV or parquet file, a `datasets` `save_to_disk` folder or
a dataset in the local Hugging Face cache (the last three need the `data` extra). They are
rendered and tokenized once, up front, so a bad row is reported with its file and row
before sampling starts. The other columns travel with every group to the rewards.
"""

from __future__ import annotations

import csv
import json
import os
import random
from collections.abc import Iterable, Iterator
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
        raise DataError(
            f"{where}: a chat prompt must be a non-empty list of {{'role': str, 'content': str}} messages"
        )


def encode_prompt(tokenizer: Any, prompt: Any, tools: list | None = None) -> list[int]:
    """Text is encoded as is; chat messages go through the tokenizer's chat template with
    the generation prompt added (so the model answers as the assistant), and the `tools`
    the model may call, in OpenAI's form, when given."""
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt))
    extra = {"tools": tools} if tools else {}
    text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False, **extra)
    # The template already holds any BOS token; do not let encode add a second one.
    return list(tokenizer.encode(text, add_special_tokens=False))


def load_prompts(
    source: str | Path,
    tokenizer: Any,
    max_prompt_tokens: int,
    split: str | None = None,
    prompt_column: str = "prompt",
) -> list[Prompt]:
    """Read and tokenize every row; long prompts keep their last `max_prompt_tokens` tokens
    (the end holds the question and the generation prompt)."""
    prompts: list[Prompt] = []
    for where, row in read_rows(source, split):
        if not isinstance(row, dict):
            raise DataError(f"{where}: each row must be an object with a {prompt_column!r} column")
        if prompt_column not in row:
            columns = ", ".join(map(str, row)) or "none"
            raise DataError(
                f"{where}: no column {prompt_column!r} (columns: {columns}); set data.prompt_column"
            )
        prompt = row.pop(prompt_column)
        if isinstance(prompt, list):
            _check_messages(prompt, f"{where}, column {prompt_column!r}")
        elif not isinstance(prompt, str) or not prompt:
            raise DataError(
                f"{where}, column {prompt_column!r}: must be a non-empty string or a message list"
            )
        ids = encode_prompt(tokenizer, prompt)
        if not ids:
            raise DataError(f"{where}, column {prompt_column!r}: the prompt encodes to no tokens")
        prompts.append(Prompt(len(prompts), prompt, ids[-max_prompt_tokens:], row))
    if not prompts:
        raise DataError(f"{source}: no prompts")
    return prompts


def read_rows(source: str | Path, split: str | None = None) -> Iterator[tuple[str, Any]]:
    """(where, row) for every row of `source`; `where` names the file and its line or row."""
    path = Path(source)
    if path.is_dir():
        datasets = _datasets()
        try:
            data = datasets.load_from_disk(str(path))
        except (FileNotFoundError, ValueError) as e:
            raise DataError(f"{path}: not a `datasets` save_to_disk folder ({e})") from None
        yield from _dataset_rows(data, split, str(path))
    elif not path.exists():
        yield from _cached_dataset_rows(str(source), split)
    elif path.suffix == ".csv":
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            for row in reader:
                yield f"{path}:{reader.line_num}", row
    elif path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(
                f"{path}: reading parquet needs pyarrow: pip install 'mlx-rl-ipc[data]'"
            ) from None
        for i, row in enumerate(pq.read_table(path).to_pylist()):
            yield f"{path} row {i}", row
    elif path.suffix == ".json" and (rows := _json_array(path)) is not None:
        for i, row in enumerate(rows):
            yield f"{path} row {i}", row
    else:  # JSON lines (.jsonl, or a .json file holding lines, as Hugging Face's loader allows)
        with open(path) as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield f"{path}:{lineno}", json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{path}:{lineno}: not valid JSON: {e}") from None


def _json_array(path: Path) -> list | None:
    """The rows of a .json file that holds one array of objects; None if it holds lines."""
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    if not isinstance(data, list):
        raise DataError(f"{path}: a JSON file must hold an array of rows (or one row per line)")
    return data


def _datasets():
    try:
        import datasets
    except ImportError:
        raise DataError(
            "reading a `datasets` folder or a cached dataset needs the datasets library: "
            "pip install 'mlx-rl-ipc[data]'"
        ) from None
    return datasets


def _dataset_rows(data: Any, split: str | None, name: str) -> Iterable[tuple[str, dict]]:
    if hasattr(data, "keys"):  # a DatasetDict: one of its splits
        split = split or "train"
        if split not in data:
            raise DataError(f"{name}: no split {split!r} (splits: {', '.join(data)}); set data.split")
        data = data[split]
        name = f"{name} [{split}]"
    return ((f"{name} row {i}", row) for i, row in enumerate(data))


def _cached_dataset_rows(name: str, split: str | None) -> Iterable[tuple[str, dict]]:
    """A dataset already in the local Hugging Face cache, read offline (unless the user
    set HF_HUB_OFFLINE / HF_DATASETS_OFFLINE otherwise)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    datasets = _datasets()
    try:
        data = datasets.load_dataset(name, split=split or "train")
    except Exception as e:  # the library raises many kinds; the user needs its message
        raise DataError(
            f"data.prompts {name!r} is neither a file nor a dataset in the local Hugging Face "
            f"cache: {type(e).__name__}: {e}"
        ) from None
    return _dataset_rows(data, None, f"{name} [{split or 'train'}]")


def check_context(prompts: list[Prompt], context: int | None, max_tokens: int) -> None:
    """A prompt plus `max_tokens` must fit the model's context (`max_position_embeddings`);
    past it RoPE positions are untrained and the completion is garbage. Names the row."""
    if not context:
        return
    for p in prompts:
        if len(p.prompt_ids) + max_tokens > context:
            raise DataError(
                f"data row {p.index}: {len(p.prompt_ids)} prompt tokens + "
                f"sampling.max_tokens {max_tokens} exceed the model's context of "
                f"{context}; lower sampling.max_prompt_tokens or sampling.max_tokens"
            )


class PromptStream:
    """Endless iteration over prompts, reshuffled each epoch with a seeded RNG.

    `cursor` (epoch, position), and the prompts beyond it to pass over (`skip`), are all a
    restarted actor or a resumed run needs to continue where it stopped.
    With several actors, actor `slot` of `slots` takes every slots-th prompt of the one
    stream the run reads: the i-th prompt of the stream goes to the actor of slot
    i mod slots, whatever the epoch, so actors never sample the same prompt twice.
    """

    def __init__(
        self,
        prompts: list[Prompt],
        shuffle: bool,
        seed: int,
        cursor: tuple[int, int] = (0, 0),
        slot: int = 0,
        slots: int = 1,
        skip: Iterable[tuple[int, int]] = (),
    ) -> None:
        """`skip`: the cursors just after prompts to pass over (their groups are already
        held: the learner's `data_skip`)."""
        self.prompts, self.shuffle, self.seed = prompts, shuffle, seed
        self.epoch, self.position = cursor
        self.slot, self.slots = slot, slots
        self.skip = {tuple(c) for c in skip}
        self.index = -1  # the stream index of the prompt last returned
        # The cursor before it: after the slot's previous prompt, sampled or skipped (or
        # where the stream started).
        self.start = self.cursor
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
        start = self.cursor
        while True:
            if self.position >= len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._epoch_order()
            index = self.epoch * len(self._order) + self.position
            self.position += 1
            if index % self.slots != self.slot:
                continue
            if self.cursor in self.skip:  # held already: the next prompt's span starts after it
                self.skip.discard(self.cursor)
                start = self.cursor
                continue
            self.index, self.start = index, start
            return self.prompts[self._order[self.position - 1]]

"""The real-model example's data: held out means never trained on, as a fact."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from tests.helpers import EXAMPLES


def facts(path) -> set[tuple]:
    out = set()
    for line in path.read_text().splitlines():
        question = json.loads(line)["prompt"][0]["content"]
        a, op, b = re.match(r"What is (\d+) (\+|-|times) (\d+)\?", question).groups()
        pair = (int(a), int(b)) if op == "-" else tuple(sorted((int(a), int(b))))
        out.add((op, *pair))
    return out


def test_the_held_out_facts_are_never_trained_and_the_files_are_reproducible(tmp_path):
    train, held = EXAMPLES / "smollm2_train.jsonl", EXAMPLES / "smollm2_heldout.jsonl"
    assert not facts(train) & facts(held)  # 3 + 5 held out means 5 + 3 is too
    assert abs(len(facts(held)) / len(facts(train) | facts(held)) - 0.3) < 0.01
    before = train.read_bytes(), held.read_bytes()
    script = tmp_path / "smollm2_task.py"  # a copy writes beside itself
    script.write_text((EXAMPLES / "smollm2_task.py").read_text())
    subprocess.run([sys.executable, str(script)], check=True, timeout=60)
    after = (tmp_path / "smollm2_train.jsonl").read_bytes(), (tmp_path / "smollm2_heldout.jsonl").read_bytes()
    assert after == before

"""The real task (examples/arithmetic.toml): its data, its model's build, and a short run
that raises held-out pass@1."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import EXAMPLES, ROOT, read_metrics, run_up

sys.path.insert(0, str(EXAMPLES))
import arithmetic_task  # noqa: E402

pytestmark = pytest.mark.slow  # real processes end to end: left out of the fast subset


def rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_held_out_problems_are_never_trained_on_and_the_files_are_current():
    train, held = rows(arithmetic_task.TRAIN), rows(arithmetic_task.HELDOUT)
    assert len(held) == 200 and len({r["prompt"] for r in held}) == 200
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert held == arithmetic_task.heldout_problems()  # the committed file is what the script writes
    for r in train[:50] + held[:50]:  # the answers are right
        a, op, b = r["prompt"].removeprefix("what is ").removesuffix("?").split()
        assert int(r["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b)) >= 0


def test_the_model_is_small_enough_to_commit_and_its_build_runs(tmp_path):
    size = sum(f.stat().st_size for f in (EXAMPLES / "arithmetic-model").iterdir())
    assert size <= 10 * 2**20
    build = [
        str(EXAMPLES / "build_arithmetic_model.py"),
        str(tmp_path / "m"),
        "--max-steps",
        "50",
        "--target",
        "0",
        "--batch-size",
        "8",
    ]
    proc = subprocess.run([sys.executable, *build], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step 50" in proc.stdout and "greedy validation accuracy" in proc.stdout
    from mlx_lm import load

    _, tok = load(str(tmp_path / "m"))
    assert tok.decode(tok.encode("what is 3 + 4?<answer>7</answer>")) == "what is 3 + 4?<answer>7</answer>"


def test_the_build_s_greedy_decode_through_a_cache_is_the_one_of_whole_forwards():
    """The build's validation decodes through a KV cache: its tokens are those of a
    forward over the whole row at every step (the committed model, real problems)."""
    import build_arithmetic_model as build
    import mlx.core as mx
    from mlx_lm import load

    model, _ = load(str(EXAMPLES / "arithmetic-model"))
    problems = [r for r in rows(arithmetic_task.HELDOUT) if len(r["prompt"]) == 16][:12]
    prompts = mx.array([build.encode(r["prompt"]) for r in problems])
    width = max(len(build.completion(r)) for r in problems) + 1  # the answer and its EOS
    whole = prompts
    for _ in range(width):
        whole = mx.concatenate([whole, mx.argmax(model(whole)[:, -1], axis=-1, keepdims=True)], axis=1)
    decoded = build.greedy(model, prompts, width).tolist()
    assert decoded == whole[:, 16:].tolist()
    assert any(
        build.encode(build.completion(r)) == d[: len(build.completion(r))] for r, d in zip(problems, decoded)
    )


def test_a_short_run_raises_held_out_pass_at_1(tmp_path):
    """30 steps of the README's run at half its batch: pass@1 on 100 held-out problems rises
    (+9.4 points here), and the answer format is kept all along."""
    overrides = [
        "eval.limit=100",
        "eval.every=0",
        "train.checkpoint_every=0",
        "log.completions_every=0",
        "train.batch_size=8",
    ]
    code, out = run_up(
        EXAMPLES / "arithmetic.toml",
        "--steps",
        "30",
        "--run-dir",
        str(tmp_path / "run"),
        *[arg for o in overrides for arg in ("--set", o)],
        timeout=900,
    )
    assert code == 0, out
    metrics = read_metrics(tmp_path / "run")
    before, after = [m for m in metrics if "eval/pass@1" in m]
    assert (before["step"], after["step"]) == (0, 30)
    assert after["eval/pass@1"] >= before["eval/pass@1"] + 0.05, (before, after)
    steps = [m for m in metrics if "reward" in m]
    assert np.mean([m["rewards/answer_format/mean"] for m in steps]) > 0.95

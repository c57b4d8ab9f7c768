"""Held-out evaluation ([eval]): the unbiased pass@k, eval lines at the configured steps of
a real run, `actor eval`, and evaluation with an external reward worker."""

from __future__ import annotations

import io
import itertools
import json
import re
import subprocess
import sys

import numpy as np
import pytest

from policy.evaluation import eval_metrics, pass_at_k, pass_ks
from runtime.config import ConfigError, load_config
from tests.helpers import (
    EXAMPLES,
    ROOT,
    WORKER_CONFIG,
    assert_nothing_lost,
    finish,
    held_out_config,
    orchestrator,
    read_metrics,
    run_up,
    start_worker,
    write_config,
)

pytestmark = pytest.mark.slow  # real processes end to end: left out of the fast subset


def brute_pass_at_k(n: int, c: int, k: int) -> float:
    """The share of all k-subsets of n outcomes (c of them passing) holding a pass."""
    outcomes = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)  # 1 - C(2,2)/C(4,2)
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(5, 3, 3) == 1.0
    for n in range(1, 7):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k)), (n, c, k)
    assert pass_ks(1) == [1] and pass_ks(4) == [1, 2, 4] and pass_ks(6) == [1, 2, 4, 6]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_sampling_progress_is_rewritten_on_a_terminal_and_whole_lines_elsewhere(tiny):
    """`actor eval` into a file or a pipe: lines, no carriage returns."""
    from policy.data import load_prompts
    from policy.evaluation import sample_prompts
    from runtime.config import SamplingConfig

    model, tok = tiny
    prompts = load_prompts(EXAMPLES / "tiny_prompts.jsonl", tok, 32)[:40]
    params = SamplingConfig(max_tokens=2)
    for err in (io.StringIO(), Terminal()):
        sample_prompts(model, tok, prompts, 2, params, seed=0, err=err)
        text = err.getvalue()
        if isinstance(err, Terminal):  # 32 prompts a batch: 32, then 40, in place
            assert text.count("\r") == 2 and text.endswith(
                "sampling 40/40 prompts  " + text.split()[-2] + " tok/s\n"
            )
        else:  # the first batch is under 10 s: only the last line
            assert "\r" not in text and re.fullmatch(r"sampling 40/40 prompts  \d+ tok/s\n", text), text


def test_eval_metrics_on_a_hand_built_case():
    """Four prompts of 4 samples passing 0, 1, 2 and 4 times; an unscored completion fails,
    and a reward passes at the threshold, not only at 1."""
    rewards = [[0.0, 0.0, None, 0.0], [1.0, 0.0, 0.0, 0.0], [0.9, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]
    m = eval_metrics(rewards, [3, 5], threshold=0.9)
    assert m["eval/pass@1"] == pytest.approx((0 + 1 / 4 + 2 / 4 + 1) / 4)
    assert m["eval/pass@2"] == pytest.approx((0 + 0.5 + 5 / 6 + 1) / 4)
    assert m["eval/pass@4"] == pytest.approx(3 / 4)
    flat = [r for row in rewards for r in row if r is not None]
    assert m["eval/reward_mean"] == pytest.approx(np.mean(flat))
    assert m["eval/reward_std"] == pytest.approx(np.std(flat))
    assert m["eval/completions/mean_length"] == 4.0 and m["eval/prompts"] == 4
    assert eval_metrics(rewards, [], 1.0)["eval/pass@1"] == pytest.approx((0 + 1 / 4 + 1 / 4 + 1) / 4)


def test_eval_every_needs_eval_prompts(tmp_path):
    with pytest.raises(ConfigError, match="eval.every needs eval.prompts"):
        load_config(write_config(tmp_path, "[eval]\nevery = 2"))


# Training rows have no `ok` column and are scored as the tiny task; the held-out rows say
# whether every completion of theirs passes, so pass@k is known whatever the model writes.


def eval_lines(metrics: list[dict]) -> list[dict]:
    return [m for m in metrics if "eval/pass@1" in m]


def test_a_run_evaluates_before_the_first_step_every_n_steps_and_after_the_last(tmp_path):
    code, out = run_up(held_out_config(tmp_path))
    assert code == 0, out
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics if "eval/pass@1" not in m] == [1, 2, 3, 4, 5]
    evals = eval_lines(metrics)
    assert [m["step"] for m in evals] == [0, 2, 4, 5]
    for m in evals:
        assert m["eval/pass@1"] == m["eval/pass@2"] == m["eval/pass@4"] == pytest.approx(3 / 8)
        assert m["eval/reward_mean"] == pytest.approx(3 / 8) and m["eval/prompts"] == 8
        assert m["eval/unscored_prompts"] == 0 and 1 <= m["eval/completions/mean_length"] <= 6
    assert "eval at step 0: pass@1 0.375  pass@2 0.375  pass@4 0.375" in out
    assert out.index("eval at step 4:") < out.index("step    5/5") < out.index("eval at step 5:")


def test_actor_eval_reports_the_numbers_a_run_logs(tmp_path):
    cfg = held_out_config(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "actor", "eval", "--config", str(cfg)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    shown = dict(line.split() for line in proc.stdout.splitlines() if line.strip())
    assert float(shown["eval/pass@1"]) == pytest.approx(3 / 8, abs=1e-4)
    assert float(shown["eval/pass@4"]) == pytest.approx(3 / 8, abs=1e-4)
    assert shown["eval/prompts"] == "8"
    (tmp_path / "plain").mkdir()
    without = subprocess.run(
        [sys.executable, "-m", "actor", "eval", "--config", str(write_config(tmp_path / "plain", steps=1))],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert without.returncode == 2 and "eval.prompts is not set" in without.stderr


def test_the_tiny_task_s_held_out_pass_rate_rises_with_training(tmp_path, default_run):
    """`actor eval` on the default task, the base model against the default run's adapter."""
    cfg = write_config(
        tmp_path, f'[eval]\nprompts = "{EXAMPLES / "tiny_prompts.jsonl"}"\nlimit = 16\npass_threshold = 0.75'
    )
    shown = {}
    for name, args in (("base", []), ("tuned", ["--adapter", str(default_run / "adapters")])):
        proc = subprocess.run(
            [sys.executable, "-m", "actor", "eval", "--config", str(cfg), *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        shown[name] = dict(line.split() for line in proc.stdout.splitlines() if line.strip())
    assert float(shown["tuned"]["eval/pass@1"]) > float(shown["base"]["eval/pass@1"]) + 0.3, shown


def test_evaluation_waits_for_a_reward_worker_and_training_loses_nothing(tmp_path):
    """With an external reward, evaluation's requests and training's share the worker: the
    eval lines come with their scores, and every training group is still accounted for."""
    cfg = held_out_config(tmp_path, WORKER_CONFIG, steps=4, reward="worker")
    proc = orchestrator("up", "--config", str(cfg))
    worker = start_worker(tmp_path / "run")
    finish(proc, [worker])
    metrics = read_metrics(tmp_path / "run")
    assert_nothing_lost([m for m in metrics if "eval/pass@1" not in m], 4, 2)
    evals = eval_lines(metrics)
    assert [m["step"] for m in evals] == [0, 2, 4]
    for m in evals:
        assert m["eval/prompts"] == 8 and m["eval/unscored_prompts"] == 0
        assert 0.0 <= m["eval/reward_mean"] <= 1.0


def test_the_first_evaluation_shows_progress_and_ctrl_c_stops_it_within_5_s(tmp_path):
    """A long step-0 evaluation: `up` (not a terminal) says it has started and then how far
    it is, every 10 s; SIGINT to the process group, as a terminal's Ctrl-C sends it, ends
    the run within 5 s (the learner checks after every decode step), and the run resumes."""
    import os
    import signal
    import threading
    import time

    rows = [{"prompt": f"repeat {i % 10}", "target": str(i % 10)} for i in range(400)]
    (tmp_path / "held_out.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = write_config(
        tmp_path,
        f'[eval]\nprompts = "{tmp_path / "held_out.jsonl"}"\nnum_samples = 16\n'
        "max_tokens = 400\ntemperature = 2.0",
        steps=2,
    )
    proc = orchestrator("up", "--config", str(cfg), start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 180
    progress = re.compile(r"evaluating at step 0: (\d+)/400 prompts  (\d+) tok/s  ")
    while len([x for x in lines if progress.match(x)]) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
        time.sleep(0.2)
    first, second = (progress.match(x) for x in lines if progress.match(x))
    assert int(first.group(1)) == 0 and int(second.group(2)) > 0, "".join(lines)
    assert not any(x.startswith("eval at step 0") for x in lines)  # still under way
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(timeout=60)
    stopped_in = time.monotonic() - t0
    reader.join(timeout=10)
    assert proc.returncode == 130, "".join(lines)
    assert stopped_in < 5, (stopped_in, "".join(lines))
    assert "did not stop" not in "".join(lines)
    run = tmp_path / "run"
    assert json.loads((run / "status.json").read_text())["phase"] == "stopped"
    resumed = orchestrator("up", "--resume", str(run), "--set", "eval.limit=4", "--set", "eval.max_tokens=6")
    out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, out
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics if "eval/pass@1" in m] == [0, 2]
    assert [m["step"] for m in metrics if "eval/pass@1" not in m] == [1, 2]

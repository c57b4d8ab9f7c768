"""Real models: a quantized checkpoint on the CPU, and the real SmolLM2-135M-Instruct
trained for a few steps by real processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from orchestrator.fit import plan_for
from orchestrator.plan import MB
from runtime.config import load_config
from tests.helpers import ROOT, TINY_MODEL, read_metrics, run_up, write_config

pytestmark = pytest.mark.slow  # real processes end to end


@pytest.fixture(scope="module")
def quantized_tiny(tmp_path_factory) -> Path:
    """The tiny model quantized to 4 bits (groups of 32) by mlx-lm's converter."""
    out = tmp_path_factory.mktemp("quantized") / "tiny-4bit"
    command = [
        "convert",
        "--hf-path",
        str(TINY_MODEL),
        "--mlx-path",
        str(out),
        "-q",
        "--q-bits",
        "4",
        "--q-group-size",
        "32",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "mlx_lm", *command], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == 4
    return out


def test_a_quantized_checkpoint_on_the_cpu_trains_dequantized(tmp_path, quantized_tiny):
    """Both processes load it as float32 (the run says so at start, each log too) and
    agree: step 0's mismatch is nil."""
    cfg = write_config(tmp_path, f'[model]\npath = "{quantized_tiny}"', steps=2)
    code, out = run_up(cfg)
    assert code == 0, out
    assert "load it dequantized to float32" in out
    run = tmp_path / "run"
    for log in ("learner.log", "actor.log"):
        assert "quantized layers dequantized to float32" in (run / log).read_text()
    for m in read_metrics(run):  # after an update too: both hold the same base, only LoRA trains
        assert m["mismatch_kl"] < 1e-8 and m["sampling/sampling_logp_difference/max"] < 1e-4, m


def test_a_dequantized_checkpoint_trains_only_its_adapters(quantized_tiny):
    """The float32 layers that replace the quantized ones are frozen like the rest of the
    base: the learner's gradient and the weights it sends are the LoRA matrices alone."""
    from mlx.utils import tree_flatten

    from policy.model import ADAPTER_LEAVES, load_policy
    from runtime.config import LoraConfig

    model, _, _ = load_policy(str(quantized_tiny), LoraConfig(), dequantize=True)
    assert type(model.model.layers[0].self_attn.q_proj.linear).__name__ == "Linear"
    names = [k for k, _ in tree_flatten(model.trainable_parameters())]
    assert names and all(k.rsplit(".", 1)[-1] in ADAPTER_LEAVES for k in names), names


def test_without_room_to_dequantize_it_stays_quantized_and_the_run_warns(tmp_path, quantized_tiny):
    """A budget where only the quantized weights fit: the run goes on quantized, warns how
    slow that is, and its config turns dequantizing off for the processes."""
    from orchestrator.fit import knob_choices, plan_for
    from orchestrator.plan import SAFETY, make_plan
    from runtime.config import load_config

    cfg_path = write_config(tmp_path, f'[model]\npath = "{quantized_tiny}"', steps=1)
    fitted, m = plan_for(load_config(cfg_path), 1.0)
    s = fitted.shape
    assert s.dequantize and m.bits == 4 and m.dense_bytes > m.weight_bytes

    def least(dense: bool) -> float:
        return (
            min(
                make_plan(m, c, 1, "").total
                for c, _ in knob_choices(s.__class__(**{**s.__dict__, "dequantize": dense}))
            )
            * SAFETY
        )

    quantized, dense = least(False), least(True)
    assert quantized < dense
    code, out = run_up(cfg_path, "--available-memory-gb", f"{(quantized + dense) / 2 / (1 << 30):.9f}")
    assert code == 0, out
    assert "no room to dequantize it" in out and "expect a slow run" in out
    run = tmp_path / "run"
    assert json.loads((run / "config.json").read_text())["model"]["dequantize_on_cpu"] is False
    assert "dequantized" not in (run / "learner.log").read_text()
    assert np.isfinite(read_metrics(run)[0]["loss"])


def test_the_real_model_trains_a_few_steps(tmp_path, smollm2):
    """SmolLM2-135M-Instruct, converted from its GGUF file (4-bit, loaded dequantized on
    this CPU), in chat format: the importance ratio is 1 (see below), every metric is
    finite, and mlx-lm loads the adapters it leaves. The actor's measured peak is within
    15% of its plan (a synchronous batch: no cache copies), the learner's below its plan
    (which takes every completion at max_tokens)."""
    cfg = tmp_path / "run.toml"
    (tmp_path / "prompts.jsonl").write_text(
        "".join(
            json.dumps(
                {
                    "prompt": [{"role": "user", "content": f"What is {a} + {b}? Answer with the number."}],
                    "answer": str(a + b),
                }
            )
            + "\n"
            for a, b in [(3, 4), (12, 5), (20, 22), (7, 8)]
        )
    )
    (tmp_path / "check.py").write_text(
        "def correct(prompts, completions, answer, **kw):\n"
        "    return [float(a in c[0]['content']) for c, a in zip(completions, answer)]\n"
    )
    cfg.write_text(f"""
[model]
path = "{smollm2}"
[data]
prompts = "prompts.jsonl"
[sampling]
group_size = 4
max_tokens = 16
[train]
steps = 2
batch_size = 2
learning_rate = 1e-4
checkpoint_every = 0
max_staleness = 0
[reward]
functions = ["check:correct"]
[log]
completions_every = 1
completions_tokens = true
[run]
dir = "{tmp_path / "run"}"
""")
    code, out = run_up(cfg, timeout=900)
    assert code == 0, out
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == [1, 2]
    assert metrics[0]["mismatch_kl"] < 1e-8
    assert metrics[0]["sampling/sampling_logp_difference/max"] < 1e-3
    assert_the_ratio_is_1(metrics, tmp_path / "run", smollm2)
    for m in metrics:
        assert all(np.isfinite(v) for v in m.values() if isinstance(v, float)), m
    plan = plan_for(load_config(cfg), available_gb=1024)[0].plan
    planned = {p: sum(getattr(plan, p).values()) / MB for p in ("actor", "learner")}
    actor, learner = (max(m[f"{p}_peak_mb"] for m in metrics) for p in ("actor", "learner"))
    assert abs(actor / planned["actor"] - 1) <= 0.15 and learner <= planned["learner"], (
        actor,
        learner,
        planned,
    )
    command = [
        "generate",
        "--model",
        str(smollm2),
        "--adapter-path",
        str(tmp_path / "run" / "adapters"),
        "--prompt",
        "What is 3 + 4?",
        "--max-tokens",
        "8",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "mlx_lm", *command], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr


# |log ratio| of one token: the actor's and the learner's float32 forward passes differ in
# batch shape and cache layout, so their logprobs agree to float rounding, not bit for bit.
LOG_RATIO_TOLERANCE = 1e-3


def assert_the_ratio_is_1(metrics: list[dict], run: Path, model_path: Path) -> None:
    """On-policy (max_staleness 0, one iteration per step), every ratio the loss sees is 1:
    - the importance ratio pi_old / pi_behavior (the learner's recomputation over the
      actor's sampling logprobs), whose extremes the learner logs as is_ratio_min/max:
      at step 0 both hold the base model, at step 2 the actor holds the weights of step 1;
    - the policy ratio pi_theta / pi_old of the step's own forward pass (ratio_min/max),
      taken before the update;
    - and, computed here from the actor's behavior logprobs in completions.jsonl (every
      completion of step 1, sampled by policy version 0), each token's ratio of the base
      model's probability (a plain log-softmax here) to the actor's: the actor's numbers,
      checked without the learner's code."""
    import math

    import mlx.core as mx

    from policy.model import load_policy
    from runtime.config import LoraConfig

    bound = math.exp(LOG_RATIO_TOLERANCE)
    for m in metrics:
        assert 1 / bound <= m["is_ratio_min"] <= m["is_ratio_mean"] <= m["is_ratio_max"] <= bound, m
        assert 1 / bound <= m["ratio_min"] <= m["ratio_max"] <= bound, m
    rows = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] == 1]
    assert len(rows) == 2 * 4 and all(r["policy_version"] == 0 for r in rows)  # the whole batch
    model, _, _ = load_policy(str(model_path), LoraConfig(), dequantize=True)  # as the processes do
    worst = 0.0
    for r in rows:
        prompt, completion = r["prompt_ids"], r["completion_ids"]
        assert len(r["logprobs"]) == len(completion) > 0 and all(r["loss_mask"]), r
        logits = model(mx.array([prompt + completion])[:, :-1])[0, len(prompt) - 1 :].astype(mx.float32)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # temperature 1
        ours = np.array(mx.take_along_axis(logp, mx.array(completion)[:, None], axis=-1)[:, 0])
        worst = max(worst, float(np.max(np.abs(ours - np.array(r["logprobs"])))))
    assert worst <= LOG_RATIO_TOLERANCE, f"a token's |log(pi_base / pi_behavior)| is {worst}"

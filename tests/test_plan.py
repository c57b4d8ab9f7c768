"""The memory plan: refusal with the right knob, and its estimate against measured peaks."""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest

from learner.algorithms import make_algorithm
from learner.step import Correction, Sample, make_batch, optimizer_step, prepare
from orchestrator.plan import (
    MB,
    ModelShape,
    Shape,
    actor_terms,
    learner_terms,
    make_plan,
    read_shape,
    suggestion,
)
from policy.model import load_policy
from tests.conftest import EXAMPLES, ROOT, TINY_MODEL
from tests.test_e2e import read_metrics

# Qwen3-0.6B (mlx-community 4-bit): the shape the seed's single-process trainer measured.
QWEN3_06B = ModelShape(
    weight_bytes=335_000_000, layers=28, hidden=1024, intermediate=3072, heads=16, kv_heads=8,
    head_dim=128, vocab=151936, act_bytes=2,
    lora_in_out={"self_attn.q_proj": (1024, 2048), "self_attn.k_proj": (1024, 1024),
                 "self_attn.v_proj": (1024, 1024), "self_attn.o_proj": (2048, 1024),
                 "mlp.gate_proj": (1024, 3072), "mlp.up_proj": (1024, 3072), "mlp.down_proj": (3072, 1024)})


def shape(**kw) -> Shape:
    base = dict(group_size=8, batch_size=1, prompt_tokens=16, max_tokens=48, micro_batch_size=0,
                grad_checkpoint=False, beta=0.0, lora_rank=8, lora_layers=-1, lora_keys=())
    return Shape(**{**base, **kw})


def plan_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator", "plan", "--config",
                           str(EXAMPLES / "tiny.toml"), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_plan_accepts_a_config_that_fits():
    proc = plan_cli("--available-memory-gb", "4")
    assert proc.returncode == 0, proc.stderr
    assert "learner   activations" in proc.stdout and "actor     kv_cache" in proc.stdout
    assert "fits: actor share" in proc.stdout


def test_plan_refuses_a_config_that_cannot_fit_and_names_the_knob():
    proc = plan_cli("--available-memory-gb", "0.015")
    assert proc.returncode == 3
    assert "does not fit" in proc.stderr and "Try: set train." in proc.stderr


def test_up_refuses_before_loading_any_model(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "up", "--config",
                           str(EXAMPLES / "tiny.toml"), "--run-dir", str(tmp_path / "run"),
                           "--available-memory-gb", "0.01"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3 and "does not fit" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_suggestions_follow_the_documented_order():
    m = read_shape(str(TINY_MODEL))
    s = shape(group_size=16, max_tokens=448, batch_size=4)
    full = make_plan(m, s, 1e12, "").total
    # a budget that only gradient checkpointing can meet
    checkpointed = shape(group_size=16, max_tokens=448, batch_size=4, grad_checkpoint=True)
    gc = make_plan(m, checkpointed, 1e12, "").total
    assert suggestion(m, s, gc * 1.11) == "set train.grad_checkpoint = true"
    # too small for checkpointing alone: a smaller micro-batch comes next
    assert suggestion(m, s, gc * 0.9).startswith("set train.micro_batch_size = ")
    assert full > gc


@pytest.mark.parametrize("rows,prompt,completion,checkpoint", [
    (16, 16, 48, False), (64, 16, 112, False), (32, 32, 224, False), (8, 64, 448, False),
    (32, 32, 224, True),
])
def test_learner_estimate_is_within_15_percent_of_measured_peaks(rows, prompt, completion, checkpoint):
    mx.random.seed(0)
    model, _, _ = load_policy(str(TINY_MODEL), {"rank": 8, "scale": 20.0})
    model.train()
    block = type(model.layers[0])
    original = block.__call__
    if checkpoint:
        from mlx_lm.tuner.trainer import grad_checkpoint

        grad_checkpoint(model.layers[0])  # patches the class
    try:
        rng = np.random.default_rng(0)
        samples = [Sample(rng.integers(5, 50, prompt), rng.integers(5, 50, completion),
                          np.full(completion, -4.0), "length") for _ in range(rows)]
        batch = make_batch(samples, 0)
        mx.eval(batch.tokens, batch.mask, batch.behavior)
        mx.clear_cache()
        mx.reset_peak_memory()
        alg = make_algorithm("grpo")
        prepared = prepare(model, batch, 1.0, 0.0, Correction())
        optimizer_step(model, optim.Adam(learning_rate=1e-4), alg, batch, prepared,
                       rng.normal(size=rows), 1.0, 1.0)
        measured = mx.get_peak_memory()
    finally:
        block.__call__ = original  # other tests use the same class
    est = sum(learner_terms(read_shape(str(TINY_MODEL)),
                            shape(group_size=rows, prompt_tokens=prompt, max_tokens=completion,
                                  grad_checkpoint=checkpoint)).values())
    assert abs(est / measured - 1) <= 0.15, (est / MB, measured / MB)


def test_qwen3_06b_sanity_check_against_the_seeds_measurement():
    """The seed's single-process trainer measured 6.245 GB for Qwen3-0.6B 4-bit, G=4,
    prompt ~19 tokens, 256 completion tokens. One process holds one copy of the weights:
    compare learner + actor terms minus one copy of the weights."""
    s = shape(group_size=4, prompt_tokens=19, max_tokens=256)
    learner = sum(learner_terms(QWEN3_06B, s).values())
    actor = sum(actor_terms(QWEN3_06B, s).values()) - QWEN3_06B.weight_bytes
    assert abs((learner + actor) / 6.245e9 - 1) <= 0.10, (learner + actor) / 1e9


def test_each_process_stays_under_its_share_on_the_default_run(default_run):
    metrics = read_metrics(default_run)
    shares = json.loads((default_run / "plan.json").read_text())["shares_mb"]
    assert shares["actor"] > 0 and shares["learner"] > 0
    for m in metrics:
        assert m["learner_share_mb"] == shares["learner"] and m["actor_share_mb"] == shares["actor"]
        assert 0 < m["learner_peak_mb"] < m["learner_share_mb"]
        assert 0 < m["actor_peak_mb"] < m["actor_share_mb"]


def test_up_goes_on_without_a_plan_for_a_hub_model_not_downloaded_yet(capsys):
    """`up` warns and returns no shares (mlx-lm will download the model); `plan` refuses."""
    import typer

    from orchestrator.cli import check_plan
    from protocol.config import load_config

    cfg = load_config(EXAMPLES / "tiny.toml")
    cfg["model"]["path"] = "nobody/not-a-downloaded-model"
    assert check_plan(cfg, None) == {}
    assert "warning: no memory check" in capsys.readouterr().err
    with pytest.raises(typer.Exit) as e:
        check_plan(cfg, None, show=True)
    assert e.value.exit_code == 2

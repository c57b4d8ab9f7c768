"""Speed and memory at a real model's shape, beside mlxrl in the same run (issue 11).

    python -m benchmarks.real_shape                 # Qwen3-shaped, 151,936-token vocabulary
    python -m benchmarks.real_shape --quick         # small shape: checks the harness works

The model is built offline (no hub): Qwen3's architecture and vocabulary size with random
weights, in full precision and, with `--bits 4`, quantized. Full precision is bfloat16
on a GPU and float32 on MLX's CPU backend, which has no fast bfloat16 matmul (13x slower
than float32 measured on this project's CI machine): `--dtype` chooses. It uses the tiny model's
tokenizer: ids it does not know decode to nothing, which changes no cost that matters
here (every sampled token still goes through the output projection and the sampler).

Each repeat runs, one after the other (interleaved, so drift on a shared machine spreads
over all of them): mlxrl 0.2.4 (`pip install -e '.[bench]'`; skipped when absent) through
its own training loop (benchmarks/mlxrl_driver.py) on its best path (the prefix-cached
rollout with the compiled decode step: the baseline of every ratio) and on the naive
rollout `mlxrl train` runs (a second, labelled row), then this project with
`max_staleness = 0` (synchronous) and 1 (overlapped), all on the same model, prompts,
reward and settings: one prompt a step, G completions, temperature 0.7, top-p 0.95,
beta 0.04, LoRA rank 8. The first step of every run is a warm-up and is left out. It
prints medians (min-max) over repeats and ratios against mlxrl, and writes every number
to `benchmarks/results/real_shape[_quick].json`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import EXAMPLES, PROMPTS, ROOT, harness, log, timeline_summary, write_results
from benchmarks.end_to_end import watch_up
from runtime.config import QUANT_GROUP
from runtime.lifecycle import child_env

QWEN3_SHAPE = dict(
    hidden_size=768,
    num_hidden_layers=6,
    intermediate_size=2048,
    num_attention_heads=12,
    num_key_value_heads=4,
    head_dim=64,
    vocab_size=151936,
)
QUICK_SHAPE = dict(
    hidden_size=128,
    num_hidden_layers=2,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=16384,
)
SETTINGS = dict(temperature=0.7, top_p=0.95, beta=0.04, learning_rate=1e-5, seed=0)
# Random weights give a nearly flat next-token distribution (top-p 0.95 keeps ~89,000 of
# 151,936 tokens at temperature 0.7), which no trained model has. Scaling the final norm
# by 4 gives a median entropy of 3.3 nats and top-p sets of 1 to ~250 tokens, a trained
# model's range (measured over the positions of one prompt at temperature 0.7).
LOGIT_SCALE = 4.0


def build_model(
    out: Path, shape: dict, bits: int | None, dtype: str, logit_scale: float = LOGIT_SCALE
) -> Path:
    """A Qwen3 model of `shape` with random weights, its logits scaled to a trained
    model's spread (`logit_scale`; 1: a random model's nearly flat distribution), saved in
    mlx-lm's format (cached)."""
    if (out / "config.json").exists():
        return out
    import mlx.core as mx
    from mlx_lm.models import qwen3

    from policy.model import quantize_base
    from policy.tiny import save_model

    config = {
        "model_type": "qwen3",
        **shape,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "eos_token_id": 1,
        "torch_dtype": dtype,
    }
    mx.random.seed(0)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    model.model.norm.weight = model.model.norm.weight * logit_scale
    # EOS never likely: every completion runs to max_tokens in every system alike.
    model.model.embed_tokens.weight[config["eos_token_id"]] = 0.0
    model.set_dtype(getattr(mx, dtype))
    if bits:
        quantize_base(model, bits)
        config["quantization"] = {"group_size": QUANT_GROUP, "bits": bits}
    tmp = out.with_name(out.name + ".tmp")  # a cached model is whole or absent
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(tmp, model, config).rename(out)
    return out


def flat_model(models_dir: Path, shape: dict) -> Path:
    """A float32 model of `shape` whose next-token distribution stays nearly flat (random
    weights, no logit scaling), cached: an EOS set of V/m tokens then gives completion
    lengths geometric with mean m."""
    name = f"qwen3-{shape['vocab_size']}-{shape['hidden_size']}x{shape['num_hidden_layers']}-float32-x1"
    return build_model(models_dir / name, shape, None, "float32", logit_scale=1.0)


def long_tail_copy(model: Path, mean: int) -> Path:
    """`model` with the last V/mean token ids as its EOS set: a 1/mean chance to stop a step."""
    out = model.with_name(model.name + f"-eos{mean}")
    if not out.exists():
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(model, tmp)
        config = json.loads((tmp / "config.json").read_text())
        vocab = config["vocab_size"]
        config["eos_token_id"] = list(range(vocab - vocab // mean, vocab))
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tmp.rename(out)
    return out


def parameters(shape: dict) -> int:
    h, i, d = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    per_layer = h * (2 * q + 2 * kv) + 3 * h * i
    return shape["vocab_size"] * h + shape["num_hidden_layers"] * per_layer


def run_ours(
    model: Path,
    work: Path,
    tag: str,
    staleness: int,
    a: argparse.Namespace,
    actor_bits: int = 0,
    batch_size: int = 1,
    sets: tuple[str, ...] = (),
    task: tuple[Path, str] = (PROMPTS, "tiny_task:reward"),
) -> dict:
    """`sets`: `key=value` settings on top of the run's config (`orchestrator up --set`);
    `task`: the prompts file and the reward function."""
    run_dir = work / tag  # short: ipc socket paths must stay < 100 bytes
    toml = work / f"{tag}.toml"
    toml.write_text(f"""
[model]
path = "{model}"
[data]
prompts = "{task[0]}"
[sampling]
group_size = {a.group_size}
temperature = {SETTINGS["temperature"]}
top_p = {SETTINGS["top_p"]}
max_tokens = {a.max_tokens}
[train]
steps = {a.steps}
batch_size = {batch_size}
learning_rate = {SETTINGS["learning_rate"]}
max_staleness = {staleness}
checkpoint_every = 0
[algorithm]
beta = {SETTINGS["beta"]}
[actor]
quantize_bits = {actor_bits}
[reward]
functions = ["{task[1]}"]
search_path = "{EXAMPLES}"
[run]
dir = "{run_dir}"
""")
    plan = planned(toml)
    log(f"{tag}: this project, max_staleness={staleness}, actor.quantize_bits={actor_bits}, {a.steps} steps")
    args = ["--config", str(toml), *(f"--set={kv}" for kv in sets)]
    run = watch_up(args, run_dir, work / f"{tag}.out", staleness, a.steps)
    if run.exit_code != 0:
        raise RuntimeError(f"{tag} failed ({run.exit_code}):\n" + (work / f"{tag}.out").read_text()[-3000:])
    m = run.metrics[1:]  # the first step is a warm-up
    learner = max(x["learner_peak_mb"] for x in run.metrics)
    actor = max(x["actor_peak_mb"] for x in run.metrics)
    measured = run.arrivals[-1] - run.arrivals[0]
    return {
        "it_s": run.steps_per_s,
        "completion_tok_s": (
            sum(x["completions/mean_length"] for x in m) * batch_size * a.group_size / measured
        ),
        "rollout_tok_s": statistics.median(x["rollout_tokens_per_s"] for x in m),
        # Over the timed steps, as completion_tok_s: e2e_lengths' uniform run takes this
        # length. (A long-tail run's lengths move as it learns: 38 to 140 in one run.)
        "mean_length": statistics.mean(x["completions/mean_length"] for x in m),
        "learner_step_s": statistics.median(x["step_s"] for x in m),
        "learner_peak_mb": learner,
        "actor_peak_mb": actor,
        "peak_mb": learner + actor,
        "planned_learner_mb": plan["learner"],
        "planned_actor_mb": plan["actor"],
        "reward_mean": statistics.mean(x["reward"] for x in run.metrics),
        # Over the whole run: groups sampled and then dropped as too stale to train on.
        "groups_received": run.metrics[-1]["groups_received"],
        "dropped_stale": run.metrics[-1].get("dropped_reasons", {}).get("stale", 0),
        "timeline": timeline_summary(run_dir, a.steps),
    }


def planned(toml: Path) -> dict:
    """The memory plan's estimate per process (MB), as `orchestrator plan` computes it."""
    from orchestrator.fit import plan_for
    from orchestrator.plan import MB
    from runtime.config import load_config

    plan = plan_for(load_config(toml), available_gb=1024)[0].plan
    return {"actor": sum(plan.actor.values()) / MB, "learner": sum(plan.learner.values()) / MB}


def run_mlxrl(
    model: Path,
    work: Path,
    tag: str,
    a: argparse.Namespace,
    rollout: str,
    batch_size: int = 1,
    task: tuple[Path, str] = (PROMPTS, "tiny_task:reward"),
    driver: str = "benchmarks.mlxrl_driver",
) -> dict:
    """A single-process peer's run through its `driver` (mlxrl's, or mlx-lm-lora's with
    `benchmarks.mlx_lm_lora_driver`), which prints one JSON line per step."""
    args = {
        "model": str(model),
        "prompts": str(task[0]),
        "reward": task[1],
        "search_path": str(EXAMPLES),
        "steps": a.steps,
        "group_size": a.group_size,
        "batch_size": batch_size,
        "max_tokens": a.max_tokens,
        "rollout": rollout,
        **SETTINGS,
    }
    log(f"{tag}: {driver} ({rollout} rollout), {a.steps} steps")
    proc = subprocess.run(
        [sys.executable, "-m", driver, json.dumps(args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=child_env(),
    )
    (work / f"{tag}.out").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{tag} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    steps = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    m = steps[1:]
    return {
        "it_s": len(m) / sum(x["step_s"] for x in m),
        "completion_tok_s": sum(x["completion_tokens"] for x in m) / sum(x["step_s"] for x in m),
        "rollout_tok_s": statistics.median(x["completion_tokens"] / x["rollout_s"] for x in m),
        "learner_step_s": statistics.median(x["learner_s"] for x in m),
        "peak_mb": max(x["peak_mb"] for x in steps),
        "reward_mean": statistics.mean(x["reward_mean"] for x in steps),
    }


def have_mlxrl() -> bool:
    import importlib.util

    return importlib.util.find_spec("mlxrl") is not None


def measure(a: argparse.Namespace, model: Path, work: Path, quantized: bool) -> dict[str, list[dict]]:
    """Every run of every repeat, interleaved. A model saved quantized has no separate
    quantized-actor run: its actor samples from the saved 4-bit weights already."""
    runs: dict[str, list[dict]] = {"mlxrl": [], "mlxrl, naive rollout": [], "sync": [], "overlap": []}
    if not quantized and a.actor_bits:
        runs[f"sync, actor {a.actor_bits}-bit"] = []
    for r in range(a.repeats):
        if have_mlxrl():
            runs["mlxrl"].append(run_mlxrl(model, work, f"mlxrl-r{r}", a, "best"))
            runs["mlxrl, naive rollout"].append(run_mlxrl(model, work, f"naive-r{r}", a, "naive"))
        runs["sync"].append(run_ours(model, work, f"sync-r{r}", 0, a))
        runs["overlap"].append(run_ours(model, work, f"over-r{r}", 1, a))
        if not quantized and a.actor_bits:
            name = f"sync, actor {a.actor_bits}-bit"
            # held quantized: on the CPU the actor would otherwise hold its rounded weights dense
            quantized_actor = ("model.dequantize_on_cpu=false",)
            runs[name].append(run_ours(model, work, f"q-r{r}", 0, a, a.actor_bits, sets=quantized_actor))
    return runs


def rollout_alone(model: Path, a: argparse.Namespace) -> dict:
    """This project's sampler against mlx-lm's batch_generate in one process: the same
    model object with LoRA attached, the same G rows of one prompt, temperature and top-p,
    interleaved repetitions (benchmarks/rollout.py counts the tokens alike)."""
    from benchmarks.rollout import rates, sample_ours, sample_theirs
    from policy.data import load_prompts
    from policy.model import load_policy
    from runtime.config import LoraConfig, SamplingConfig

    policy, tokenizer, _ = load_policy(str(model), LoraConfig())
    prompt_ids = [load_prompts(PROMPTS, tokenizer, 1024)[0].prompt_ids]
    params = SamplingConfig(
        temperature=SETTINGS["temperature"], top_p=SETTINGS["top_p"], max_tokens=a.max_tokens
    )
    rows = {"completion_batch_size": a.group_size, "prefill_batch_size": a.group_size}
    eos = set(tokenizer.eos_token_ids)
    log(f"rollout alone: sample_groups vs batch_generate, {a.group_size} rows, {a.repeats} repetitions")
    medians, runs = rates(
        {
            "ours": lambda s: sample_ours(policy, prompt_ids, a.group_size, params, eos, s),
            "batch_generate": lambda s: sample_theirs(
                policy,
                tokenizer,
                prompt_ids,
                a.group_size,
                a.max_tokens,
                s,
                rows,
                SETTINGS["temperature"],
                SETTINGS["top_p"],
            ),
        },
        a.repeats,
    )
    return {
        "ours_tok_s": medians["ours"],
        "batch_generate_tok_s": medians["batch_generate"],
        "ratio": medians["ours"] / medians["batch_generate"],
        "runs": runs,
    }


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.4g} ({min(values):.4g}-{max(values):.4g})"


def table(runs: dict[str, list[dict]]) -> str:
    rows = [
        "| run | it/s | rollout tok/s | learner step s | peak MB (learner + actor) "
        "| plan MB (learner, actor) |",
        "|---|---|---|---|---|---|",
    ]
    base = (
        {k: statistics.median(r[k] for r in runs["mlxrl"]) for k in ("it_s", "rollout_tok_s", "peak_mb")}
        if runs["mlxrl"]
        else None
    )
    for name, rs in runs.items():
        if not rs:
            continue
        ratio = ""
        if base and name != "mlxrl":
            x = {k: statistics.median(r[k] for r in rs) / base[k] for k in base}
            ratio = f" [{x['it_s']:.2f}x it/s, {x['rollout_tok_s']:.2f}x tok/s, {x['peak_mb']:.2f}x memory]"
        peak = spread([r["peak_mb"] for r in rs])
        plan = ""
        if "learner_peak_mb" in rs[0]:
            parts = [spread([r[k] for r in rs]) for k in ("learner_peak_mb", "actor_peak_mb")]
            peak += f" = {parts[0]} + {parts[1]}"
            plan = f"{rs[0]['planned_learner_mb']:.0f}, {rs[0]['planned_actor_mb']:.0f}"
        cells = [spread([r[k] for r in rs]) for k in ("it_s", "rollout_tok_s", "learner_step_s")]
        rows.append(f"| {name}{ratio} | {' | '.join(cells)} | {peak} | {plan} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = harness(__doc__)
    p.add_argument("--bits", type=int, nargs="*", default=[0, 4], help="0: full precision; 4, 8: quantized")
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="full precision: auto = bfloat16 on a GPU, float32 on the CPU backend",
    )
    p.add_argument("--steps", type=int, default=4, help="per run; the first is a warm-up")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument(
        "--actor-bits",
        type=int,
        default=4,
        choices=[0, 4, 8],
        help="also run synchronous with actor.quantize_bits (0: no such run)",
    )
    a = p.parse_args(argv)
    shape = QUICK_SHAPE if a.quick else QWEN3_SHAPE
    if a.dtype == "auto":
        import mlx.core as mx

        a.dtype = "bfloat16" if mx.default_device() == mx.gpu else "float32"
    if a.quick:
        a.repeats, a.steps, a.max_tokens, a.bits = 1, 3, 16, [0]
    if not have_mlxrl():
        log("mlxrl is not installed (pip install -e '.[bench]'): measuring this project alone")
    out: dict = {
        "shape": shape,
        "parameters": parameters(shape),
        "settings": SETTINGS,
        "args": {k: str(v) for k, v in vars(a).items()},
        "results": {},
    }
    text = [
        f"Qwen3-shaped model, {parameters(shape) / 1e6:.0f} M parameters, vocabulary "
        f"{shape['vocab_size']}; G={a.group_size}, {a.max_tokens} tokens, {a.repeats} repeats of "
        f"{a.steps} steps (first left out)\n"
    ]
    started = time.time()
    for bits in a.bits:
        name = (
            f"qwen3-{shape['vocab_size']}-{shape['hidden_size']}x{shape['num_hidden_layers']}-"
            f"{a.dtype}{f'-{bits}bit' if bits else ''}-x{LOGIT_SCALE:g}"
        )
        log(f"model {name}")
        model = build_model(a.models_dir / name, shape, bits or None, a.dtype)
        with tempfile.TemporaryDirectory(prefix="rs-") as tmp:
            runs = measure(a, model, Path(tmp), bool(bits))
        alone = rollout_alone(model, a)
        out["results"][name] = {**runs, "rollout_alone": alone}
        text += [
            f"\n### {name}\n",
            table(runs),
            f"\nRollout alone ({a.group_size} rows, one process): this project's sampler "
            f"{alone['ours_tok_s']:.1f} tok/s, mlx-lm batch_generate "
            f"{alone['batch_generate_tok_s']:.1f} tok/s ({alone['ratio']:.2f}x)\n",
        ]
    out["wall_s"] = time.time() - started
    write_results(a.results_dir, "real_shape_quick" if a.quick else "real_shape", out, "".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())

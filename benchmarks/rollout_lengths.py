"""Rollout under long-tailed completion lengths: each decoding engine side by side.

    python -m benchmarks.rollout_lengths            # Qwen3-shaped, 16,384 vocabulary
    python -m benchmarks.rollout_lengths --quick    # smaller and one repeat: checks the harness

The workload (issue 22): batches of 8 prompts x G 8, completion lengths geometric with
mean 64 and cut at 512, as reasoning traces are. A random model's next-token distribution
is nearly flat, so making V/64 of its tokens EOS gives each step a 1/64 chance to stop:
geometric lengths with mean 64. The same batches go through:

- continuous: this project's engine (policy/engine.py), every group queued, 64 rows live;
- static: the static sampler (`actor.engine = "static"`), one batch at a time, each until
  its longest row ends;
- BatchGenerator: mlx-lm's, every row queued, 64 rows at a time (it refills too);
- ceiling: the static sampler with no EOS and max_tokens = the mean length, every row
  live to the end: the tokens/s a batch of 64 rows makes when none is idle.

Interleaved, repeat by repeat, after a warm-up; medians of rollout tokens/s and ratios
against the ceiling and static, written to `benchmarks/results/rollout_lengths[_quick]`.
- mlxrl: mlxrl 0.2.4's best path (its prefix-cached rollout with the compiled decode
  step), batch by batch, on a copy of the model whose config lists the EOS set (mlxrl
  stops on its tokenizer's EOS ids) and prompts of the same length (text, as it takes
  them); skipped when mlxrl is not installed.
"""

from __future__ import annotations

import statistics
import sys
import time

from benchmarks.common import harness, log, write_results
from benchmarks.learner_lengths import QUICK_SHAPE, SMALL_SHAPE
from benchmarks.real_shape import flat_model, have_mlxrl, long_tail_copy, parameters


def engines(
    model,
    prompts: list[list[int]],
    batches: int,
    group_size: int,
    eos: set[int],
    max_tokens: int,
    mean: int,
    rows: int,
) -> dict:
    """Each contender: a function of the seed that decodes every batch and returns the
    tokens it produced."""
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_sampler

    from policy.engine import Engine, sample_groups
    from runtime.config import SamplingConfig

    params = SamplingConfig(temperature=1.0, max_tokens=max_tokens)
    per_batch = len(prompts) // batches

    def continuous(seed: int) -> int:
        engine = Engine(model, params, eos, seed, rows)
        for i, p in enumerate(prompts):
            engine.add(i, p, list(range(i * group_size, (i + 1) * group_size)))
        tokens = 0
        while engine.busy:
            tokens += sum(len(c.token_ids) for _, group in engine.step() for c in group)
        return tokens

    def static(seed: int, stop: set[int] = eos, sampling: SamplingConfig = params) -> int:
        tokens = 0
        for b in range(batches):
            groups = sample_groups(
                model,
                prompts[b * per_batch : (b + 1) * per_batch],
                group_size,
                sampling,
                stop,
                seed,
                noise_offset=b * per_batch * group_size,
            )
            tokens += sum(len(c.token_ids) for group in groups for c in group)
        return tokens

    def batch_generator(seed: int) -> int:
        import mlx.core as mx

        mx.random.seed(seed)
        gen = BatchGenerator(
            model,
            max_tokens=max_tokens,
            stop_tokens=[[t] for t in eos],
            sampler=make_sampler(temp=1.0),
            completion_batch_size=rows,
            prefill_batch_size=rows,
        )
        gen.insert([p for p in prompts for _ in range(group_size)])
        tokens = 0
        while responses := gen.next_generated():
            tokens += len(responses)  # one token per live row and step, its EOS included
        gen.close()
        return tokens

    def ceiling(seed: int) -> int:
        return static(seed, set(), SamplingConfig(temperature=1.0, max_tokens=mean))

    return {"continuous": continuous, "static": static, "BatchGenerator": batch_generator, "ceiling": ceiling}


def mlxrl_rollout(path, batches: int, per_batch: int, group_size: int, max_tokens: int, prompt_len: int):
    """mlxrl's best rollout path over the same batches, as a contender."""
    import random

    from mlxrl.policy.model import LoRAConfig, load_policy_with_lora
    from mlxrl.rollout.naive import SamplingConfig as MlxrlSampling
    from mlxrl.rollout.optimized import generate_prefix_cached_group_rollouts

    from policy.tiny import CHARS

    model, tokenizer, _ = load_policy_with_lora(model_id=str(path), config=LoRAConfig(rank=8, scale=20.0))
    rng = random.Random(0)
    texts = ["".join(rng.choice(CHARS[:36]) for _ in range(prompt_len)) for _ in range(batches * per_batch)]
    sampling = MlxrlSampling(max_tokens=max_tokens, temperature=1.0, top_p=1.0)

    def run(seed: int) -> int:
        tokens = 0
        for b in range(batches):
            out = generate_prefix_cached_group_rollouts(
                model=model,
                tokenizer=tokenizer,
                prompts=texts[b * per_batch : (b + 1) * per_batch],
                group_size=group_size,
                config=sampling,
                seed=seed,
                use_chat_template=False,
                compile_decode_step=True,
            )
            tokens += sum(len(c.completion_tokens) for c in out)
        return tokens

    return run


def measure(contenders: dict, repeats: int) -> dict[str, dict]:
    runs: dict[str, dict] = {name: {"tok_s": [], "tokens": []} for name in contenders}
    for rep in range(repeats + 1):  # the first: a warm-up
        for name, fn in contenders.items():
            t0 = time.perf_counter()
            tokens = fn(rep)
            seconds = time.perf_counter() - t0
            log(f"  {name}: {tokens} tokens in {seconds:.2f} s")
            if rep:
                runs[name]["tok_s"].append(tokens / seconds)
                runs[name]["tokens"].append(tokens)
    return runs


def table(runs: dict[str, dict]) -> str:
    med = {name: statistics.median(r["tok_s"]) for name, r in runs.items()}
    lines = [
        "| engine | rollout tok/s, median (min-max) | vs ceiling | vs static | tokens |",
        "|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        lines.append(
            f"| {name} | {med[name]:.0f} ({min(r['tok_s']):.0f}-{max(r['tok_s']):.0f}) | "
            f"{med[name] / med['ceiling']:.2f}x | {med[name] / med['static']:.2f}x | "
            f"{statistics.median(r['tokens']):.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = harness(__doc__)
    p.add_argument("--batches", type=int, default=4, help="batches of prompts decoded per repeat")
    p.add_argument("--prompts", type=int, default=8, help="prompts per batch")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--mean", type=int, default=64, help="mean completion length (EOS odds 1/mean a step)")
    p.add_argument("--max-tokens", type=int, default=512)
    a = p.parse_args(argv)
    shape = QUICK_SHAPE if a.quick else SMALL_SHAPE
    if a.quick:
        a.repeats, a.batches, a.prompts, a.group_size, a.max_tokens, a.mean = 1, 2, 2, 4, 64, 16
    import numpy as np

    from policy.model import load_policy
    from runtime.config import LoraConfig

    model, _, _ = load_policy(str(flat_model(a.models_dir, shape)), LoraConfig(rank=8))
    vocab = shape["vocab_size"]
    eos = set(range(vocab - vocab // a.mean, vocab))  # V / mean tokens: 1 / mean odds a step
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, vocab - vocab // a.mean, 32).tolist() for _ in range(a.batches * a.prompts)]
    rows = a.prompts * a.group_size
    log(
        f"rollout: {a.batches} batches of {a.prompts} prompts x G {a.group_size}, {rows} rows live, "
        f"lengths geometric mean {a.mean}, max {a.max_tokens}"
    )
    started = time.time()
    contenders = engines(model, prompts, a.batches, a.group_size, eos, a.max_tokens, a.mean, rows)
    if have_mlxrl():
        path = long_tail_copy(flat_model(a.models_dir, shape), a.mean)
        contenders["mlxrl"] = mlxrl_rollout(path, a.batches, a.prompts, a.group_size, a.max_tokens, 32)
    runs = measure(contenders, a.repeats)
    report = (
        f"Rollout, Qwen3-shaped model of {parameters(shape) / 1e6:.0f} M parameters (vocabulary "
        f"{vocab}), float32, LoRA rank 8; {a.batches} batches of {a.prompts} prompts x G "
        f"{a.group_size}, completions geometric (mean {a.mean}, max {a.max_tokens}; the ceiling: "
        f"every row {a.mean} tokens); medians of {a.repeats} repeats after a warm-up\n\n" + table(runs)
    )
    out = {
        "shape": shape,
        "args": {k: str(v) for k, v in vars(a).items()},
        "runs": runs,
        "wall_s": time.time() - started,
    }
    write_results(a.results_dir, "rollout_lengths_quick" if a.quick else "rollout_lengths", out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

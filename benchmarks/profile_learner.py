"""Where the learner's step goes at a real model's shape: one part switched off at a time.

    python -m benchmarks.profile_learner            # Qwen3-shaped, 151,936-token vocabulary
    python -m benchmarks.profile_learner --quick    # small shape: checks the harness

One batch of `--rows` completions of `--tokens` tokens after a 20-token prompt (one
group, as benchmarks.real_shape's step), the Trainer with the run's defaults (beta 0.04,
the old-policy pass fused, logits by 64 MB chunks), timed as the learner runs it
(prepare + optimizer step), beside the same step with one thing changed:

- beta 0: no reference forward;
- whole logits (`train.logit_chunk_mb = 0`): no second body forward, all logits at once;
- not fused: an old-policy forward of its own;
- every row its own prompt (`train.share_prompts = false`);

and the pieces alone: one forward of the body, of the output head over every position,
and the adapters' serialization into a weights message. Medians of `--repeats`
(interleaved, after a warm-up). Writes `benchmarks/results/profile_learner[_quick].{md,json}`.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from benchmarks.common import harness, log, write_results
from benchmarks.real_shape import LOGIT_SCALE, QUICK_SHAPE, QWEN3_SHAPE, build_model, parameters

VARIANTS: dict[str, tuple[dict, dict]] = {  # name: (algorithm settings, train settings)
    "the step (defaults)": ({}, {}),
    "beta 0: no reference forward": ({"beta": 0.0}, {}),
    "whole logits (logit_chunk_mb 0)": ({}, {"logit_chunk_mb": 0.0}),
    "old-policy pass not fused": ({}, {"fuse_old_logprobs": False}),
    "every row its own prompt": ({}, {"share_prompts": False}),
}


def median_s(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def profile(model_path: Path, rows: int, tokens: int, repeats: int) -> dict[str, float]:
    import mlx.core as mx

    import protocol
    from learner.batching import TrainRow, make_batch
    from learner.trainer import Trainer
    from policy.logprobs import output_head
    from policy.model import adapter_weights_numpy, load_policy
    from runtime.config import AlgorithmConfig, LoraConfig, SamplingConfig, TrainConfig

    mx.random.seed(0)
    model, _, _ = load_policy(str(model_path), LoraConfig(rank=8, scale=20.0))
    model.train()
    rng = np.random.default_rng(0)
    vocab = model.args.vocab_size
    prompt = rng.integers(2, vocab, 20)
    behavior = np.full(tokens, -2.0, np.float32)
    samples = [TrainRow(prompt, rng.integers(2, vocab, tokens), behavior, "length") for _ in range(rows)]
    batch = make_batch(samples, 0)
    advantages = rng.normal(size=rows)
    sampling = SamplingConfig(temperature=0.7, top_p=0.95, max_tokens=tokens)
    out = {}
    for name, (algorithm, train) in VARIANTS.items():
        settings = AlgorithmConfig(**{"beta": 0.04, **algorithm})
        trainer = Trainer(model, settings, TrainConfig(**train), sampling)
        log(f"  {name}")
        out[name] = median_s(lambda t=trainer: t.step(t.prepare(batch), advantages), repeats)
    head = output_head(model)
    assert head is not None  # mlx-lm's Qwen3: a tied, frozen embedding
    inputs = batch.tokens[:, :-1]
    hidden = model.model(inputs)
    mx.eval(hidden)
    out["piece: body forward, no graph"] = median_s(lambda: mx.eval(model.model(inputs)), repeats)
    out["piece: output head over every position"] = median_s(lambda: mx.eval(head(hidden)), repeats)
    out["piece: weights message (adapters to numpy, encode)"] = median_s(
        lambda: protocol.encode(protocol.WEIGHTS, {"version": 1}, adapter_weights_numpy(model)), repeats
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = harness(__doc__)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64)
    a = p.parse_args(argv)
    shape = QUICK_SHAPE if a.quick else QWEN3_SHAPE
    if a.quick:
        a.repeats, a.tokens = 1, 16
    name = (
        f"qwen3-{shape['vocab_size']}-{shape['hidden_size']}x{shape['num_hidden_layers']}-float32-"
        f"x{LOGIT_SCALE:g}"
    )
    model = build_model(a.models_dir / name, shape, None, "float32")
    log(f"{name}: {a.rows} rows of 20 + {a.tokens} tokens, {a.repeats} repeats")
    started = time.time()
    times = profile(model, a.rows, a.tokens, a.repeats)
    base = times["the step (defaults)"]
    lines = [
        f"Learner step at a Qwen3 shape ({parameters(shape) / 1e6:.0f} M parameters, vocabulary "
        f"{shape['vocab_size']}, float32), {a.rows} rows of a 20-token prompt + {a.tokens} tokens; "
        f"medians of {a.repeats}\n",
        "| what | s | against the step |",
        "|---|---|---|",
    ]
    lines += [f"| {k} | {v:.3f} | {v / base:.2f}x |" for k, v in times.items()]
    write_results(
        a.results_dir,
        "profile_learner_quick" if a.quick else "profile_learner",
        {
            "shape": shape,
            "args": {k: str(v) for k, v in vars(a).items()},
            "seconds": times,
            "wall_s": time.time() - started,
        },
        "\n".join(lines) + "\n",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

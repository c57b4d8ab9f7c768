"""The learner alone on `e2e_lengths --pair`'s batch: what it can make of a long tail of
completion lengths, against uniform lengths, in one take and a group a take.

    python -m benchmarks.learner_takes              # e2e_lengths' 21 M model, one core's BLAS
    python -m benchmarks.learner_takes --beside     # the same, the actor's engine decoding beside
    python -m benchmarks.learner_takes --cache-mb 5443    # MLX's cache as a 21 GB share once set it
    python -m benchmarks.learner_takes --quick      # a small shape, one repeat: checks the harness

The streamed learner (`train.stream_groups`) learns each group as it arrives: when the
actor keeps pace with it, a take holds one group, and its rows are cut into micro-batches
among themselves only. This times the Trainer's own passes (its `prepare` and
`accumulate`, then one optimizer update; beta 0.04, so the reference forward too) over 8
groups of G 4 with 8-token prompts, as the end-to-end pair trains them:

- uniform, one take: every completion 64 tokens, the whole batch at once (what the
  uniform run's learner does);
- long tail, one take: lengths geometric with mean 64, cut at 512, the whole batch at once
  (the best a learner that waits for whole batches could do with its forwards);
- long tail, a group a take: the same batch, one group at a time.

Each repeat draws a fresh long-tail batch; the modes run interleaved on one model, after a
warm-up. Reported: completion tokens a second and each long-tail mode's over uniform's,
the micro-batches a step, and where the step went (the reference and old-policy pass, the
forwards and backwards). `--beside` runs the actor's engine (policy/engine.py, about 12
rows, temperature 0.7, top-p 0.95) decoding in a process of its own throughout: each has
a core, and they compete for the memory's bandwidth and cache. `--cache-mb` sets MLX's
cache of freed buffers in the learner (policy/memory.py says why a large one is slow).
The learner gets one BLAS thread, as `orchestrator up` gives each process
(orchestrator/launch.py).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import harness, log, write_results
from benchmarks.learner_lengths import QUICK_SHAPE, SMALL_SHAPE, long_tail_lengths, samples_for
from benchmarks.real_shape import flat_model, long_tail_copy, parameters
from runtime.lifecycle import Lifeline, child_env, python_module, watch_lifeline

GROUPS, GROUP_SIZE, PROMPT_TOKENS, MEAN, MAX_TOKENS = 8, 4, 8, 64, 512
MODES = ("uniform, one take", "long tail, one take", "long tail, a group a take")
BESIDE_ROWS = 12  # about what the actor decodes under the long tail at max_staleness = 1


def step(trainer, samples: list, rewards: np.ndarray, per_take: int) -> tuple[float, dict]:
    """One streamed step over `samples` (groups of GROUP_SIZE rows), `per_take` groups a
    take: its seconds, and its micro-batches and passes' seconds."""
    import mlx.core as mx

    from learner.batching import make_batch
    from learner.trainer import Gradient

    advantages = trainer.algorithm.advantages(rewards).reshape(-1)
    norm = trainer.algorithm.normalizer(np.array(make_batch(samples, 0).mask))
    rows = per_take * GROUP_SIZE
    gradient, parts = Gradient(), {"micro-batches": 0, "reference s": 0.0, "forward and backward s": 0.0}
    t0 = time.perf_counter()
    for start in range(0, len(samples), rows):
        t1 = time.perf_counter()
        prepared = trainer.prepare(make_batch(samples[start : start + rows], 0), norm)
        t2 = time.perf_counter()
        trainer.accumulate(gradient, prepared, advantages[start : start + rows], norm)
        mx.eval(gradient.grads)
        parts["micro-batches"] += len(prepared.micro)
        parts["reference s"] += t2 - t1
        parts["forward and backward s"] += time.perf_counter() - t2
    trainer.update(gradient)
    return time.perf_counter() - t0, parts


def measure(model_path: Path, repeats: int, shape: dict, seed: int) -> dict[str, dict]:
    """Each mode's completion tokens, seconds and parts, repeat by repeat."""
    import mlx.core as mx

    from learner.trainer import Trainer
    from policy.model import load_policy
    from runtime.config import AlgorithmConfig, LoraConfig, SamplingConfig, TrainConfig

    mx.random.seed(0)
    model, _, _ = load_policy(str(model_path), LoraConfig(rank=8))
    model.train()
    sampling = SamplingConfig(temperature=0.7, max_tokens=MAX_TOKENS)
    trainer = Trainer(model, AlgorithmConfig(beta=0.04), TrainConfig(), sampling)
    vocab, rows = shape["vocab_size"], GROUPS * GROUP_SIZE
    out: dict[str, dict] = {name: {"tokens": [], "seconds": [], "parts": []} for name in MODES}
    for rep in range(repeats + 1):  # the first: a warm-up
        tail = long_tail_lengths(rows, MEAN, MAX_TOKENS, seed + rep)
        batches = {
            MODES[0]: (np.full(rows, MEAN), GROUPS),
            MODES[1]: (tail, GROUPS),
            MODES[2]: (tail, 1),
        }
        rewards = np.random.default_rng(seed + rep).random((GROUPS, GROUP_SIZE))
        for name, (lengths, per_take) in batches.items():
            samples = samples_for(lengths, GROUPS, PROMPT_TOKENS, vocab, seed + rep)
            mx.clear_cache()
            seconds, parts = step(trainer, samples, rewards, per_take)
            micro = parts["micro-batches"]
            log(f"  {name}: {seconds:.2f} s, {int(lengths.sum())} tokens, {micro} micro-batches")
            if rep:
                out[name]["tokens"].append(int(lengths.sum()))
                out[name]["seconds"].append(seconds)
                out[name]["parts"].append(parts)
    return out


def decoding_beside(model_path: Path, lifeline: Lifeline) -> subprocess.Popen:
    """The actor's engine decoding in a process of its own (`decode_forever`), once it has
    loaded and taken its first step; killed by the caller, and gone with this process
    (the lifeline) however it ends."""
    command = python_module("benchmarks.learner_takes", "--decode", str(model_path))
    env = child_env(OPENBLAS_NUM_THREADS="1", **lifeline.child_env())
    child = subprocess.Popen(
        command, env=env, pass_fds=(lifeline.read_fd,), stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None  # piped
    if child.stdout.readline().strip() != "ready":
        child.kill()
        child.wait()
        raise RuntimeError(f"the engine beside did not start (exit {child.returncode}); its error is above")
    return child


def decode_forever(model_path: str) -> None:
    """Keep about BESIDE_ROWS rows decoding (temperature 0.7, top-p 0.95), as the actor
    does under the long tail, until killed or the process that started it is gone."""
    import json

    from policy.engine import Engine
    from policy.model import load_policy
    from runtime.config import LoraConfig, SamplingConfig

    watch_lifeline()
    model, _, _ = load_policy(model_path, LoraConfig(rank=8))
    eos = set(json.loads((Path(model_path) / "config.json").read_text())["eos_token_id"])
    params = SamplingConfig(temperature=0.7, top_p=0.95, max_tokens=MAX_TOKENS)
    engine, key, ready = Engine(model, params, eos, 0, 4 * BESIDE_ROWS), 0, False
    while True:
        alive = len(engine.live) - engine.live.count(None)
        while GROUP_SIZE * len(engine.waiting) + alive <= BESIDE_ROWS - GROUP_SIZE:
            key += 1
            engine.add(
                key, list(range(1, PROMPT_TOKENS + 1)), list(range(GROUP_SIZE * key, GROUP_SIZE * (key + 1)))
            )
            alive += GROUP_SIZE
        engine.step(0)
        if not ready:
            print("ready", flush=True)
            ready = True


def one_blas_thread() -> None:
    """One OpenBLAS thread, where OpenBLAS is loaded (LD_PRELOAD, as in CI): it read its
    environment when the process started, so it is told at run time."""
    import ctypes

    blas = ctypes.CDLL(None)
    if hasattr(blas, "openblas_set_num_threads"):
        blas.openblas_set_num_threads(1)


def table(runs: dict[str, dict]) -> str:
    """Each mode's tokens a second (total tokens over total seconds) and parts a step."""
    speed = {name: sum(r["tokens"]) / sum(r["seconds"]) for name, r in runs.items()}
    base = speed[MODES[0]]
    lines = [
        "| learner, a step | completion tok/s | vs uniform | micro-batches | reference and old-policy s "
        "| forward and backward s |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        parts = {k: statistics.median(p[k] for p in r["parts"]) for k in r["parts"][0]}
        lines.append(
            f"| {name} | {speed[name]:.0f} | {speed[name] / base:.2f}x | {parts['micro-batches']:.0f} | "
            f"{parts['reference s']:.2f} | {parts['forward and backward s']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = harness(__doc__)
    p.add_argument("--beside", action="store_true", help="the actor's engine decoding in a process beside")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--cache-mb", type=int, help="MLX's cache of freed buffers for the learner (default: MLX's own)"
    )
    p.add_argument("--decode", metavar="MODEL", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.decode:  # the engine beside (decoding_beside)
        decode_forever(a.decode)
        return 0
    shape = QUICK_SHAPE if a.quick else SMALL_SHAPE
    if a.quick:
        a.repeats = 1
    one_blas_thread()
    if a.cache_mb is not None:
        import mlx.core as mx

        mx.set_cache_limit(a.cache_mb << 20)
    model = flat_model(a.models_dir, shape)
    lifeline = Lifeline()
    beside = decoding_beside(long_tail_copy(model, MEAN), lifeline) if a.beside else None
    try:
        started = time.time()
        runs = measure(model, a.repeats, shape, a.seed)
    finally:
        if beside is not None:
            alive = beside.poll() is None
            beside.kill()
            beside.wait()
        lifeline.close()
    if beside is not None and not alive:
        raise RuntimeError(f"the engine beside stopped during the measurement (exit {beside.returncode})")
    where = f", the actor's engine decoding about {BESIDE_ROWS} rows beside" if a.beside else ""
    where += f", MLX's cache {a.cache_mb} MB" if a.cache_mb is not None else ""
    report = (
        f"The learner alone{where}: Qwen3-shaped model of {parameters(shape) / 1e6:.0f} M parameters "
        f"(vocabulary {shape['vocab_size']}), float32, LoRA rank 8, beta 0.04; {GROUPS} prompts of "
        f"{PROMPT_TOKENS} tokens x G {GROUP_SIZE} a step, long tail geometric (mean {MEAN}, max "
        f"{MAX_TOKENS}), uniform {MEAN}; {a.repeats} timed steps after a warm-up, each a fresh long "
        "tail\n\n" + table(runs)
    )
    out = {
        "shape": shape,
        "beside": a.beside,
        "cache_mb": a.cache_mb,
        "runs": runs,
        "wall_s": time.time() - started,
    }
    stem = "learner_takes" + ("_quick" if a.quick else "") + ("_beside" if a.beside else "")
    stem += f"_cache{a.cache_mb}" if a.cache_mb is not None else ""
    write_results(a.results_dir, stem, out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

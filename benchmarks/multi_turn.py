"""Multi-turn episodes: turns in the continuous engine, KV kept, against lockstep.

    python -m benchmarks.multi_turn            # Qwen3-shaped, 16,384 vocabulary
    python -m benchmarks.multi_turn --quick    # smaller and one repeat: checks the harness

The workload (issue 22): an environment of 5 model turns whose every observation is 64
tokens, served by real env worker processes over the env socket. A random model with
V/32 of its tokens as EOS answers each turn in geometric lengths (mean 32, cut at 128).
The same episodes (prompts, noise) are played by the actor's EpisodeRunner:

- engine: each turn joins the continuous engine the moment its observation is in,
  continuing the KV cache its last turn left (only the observation is prefilled);
- lockstep: once every environment has answered, all live episodes decode one turn in a
  batch, each whole context prefilled again (`actor.engine = "static"`).

Interleaved, repeat by repeat, after a warm-up. Reported: episodes/s, prefilled tokens
per episode, and the tokens that went through the model per episode (prefilled and
sampled) over the episode's context length: 1.0x means each context ran once.
"""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import ROOT, harness, log, write_results
from benchmarks.learner_lengths import QUICK_SHAPE, SMALL_SHAPE
from benchmarks.real_shape import flat_model, parameters

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 "


class FiveTurns:
    """An environment of `turns` model turns; each observation is `observation_tokens`
    characters (a token each to the project's character tokenizer). Served by env
    workers: `orchestrator env-worker benchmarks.multi_turn:FiveTurns`."""

    turns = 5
    observation_tokens = 64

    def reset(self, prompt: str, **columns) -> str:
        self.turn, self.rng = 0, random.Random(prompt)
        return ""  # the prompt is the first observation

    def step(self, action: str) -> tuple[str, float, bool]:
        self.turn += 1
        text = "".join(self.rng.choice(ALPHABET) for _ in range(self.observation_tokens))
        return text, 0.0, self.turn >= self.turns


class QuickTurns(FiveTurns):
    turns = 3
    observation_tokens = 16


def start_workers(endpoint: str, env_class: str, n: int, lifeline) -> list[subprocess.Popen]:
    """Env worker processes, each ending with this process (the lifeline) or on SIGTERM."""
    args = [
        sys.executable,
        "-m",
        "orchestrator",
        "env-worker",
        env_class,
        "--connect",
        endpoint,
        "--search-path",
        str(ROOT),
    ]
    env = {**os.environ, **lifeline.child_env()}
    return [
        subprocess.Popen(
            args,
            cwd=ROOT,
            env=env,
            pass_fds=(lifeline.read_fd,),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(n)
    ]


def run(runner, prompts, group_size: int) -> dict:
    """One batch of episodes; what it took."""
    runner.retries = 0
    prefilled0 = runner.prefilled
    t0 = time.perf_counter()
    groups = runner.run(prompts, [i * group_size for i in range(len(prompts))])
    seconds = time.perf_counter() - t0
    episodes = [e for g in groups for e in g.episodes]
    lost = [e.lost for e in episodes if e.lost]
    if lost:
        raise RuntimeError(f"episodes lost: {lost[:3]}")
    context = sum(len(e.prompt_ids) + len(e.ids) for e in episodes)
    sampled = sum(sum(e.mask) for e in episodes)
    prefilled = runner.prefilled - prefilled0
    n = len(episodes)
    return {
        "episodes_s": n / seconds,
        "seconds": seconds,
        "sampled": sampled,
        "prefilled_per_episode": prefilled / n,
        "context_per_episode": context / n,
        "model_tokens_over_context": (prefilled + sampled) / context,
        "turns": statistics.mean(e.model_turns for e in episodes),
    }


def table(runs: dict[str, list[dict]]) -> str:
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    lines = [
        "| episodes | episodes/s, median (min-max) | vs lockstep | prefilled tokens / episode | "
        "context / episode | model tokens / context | sampled tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, rs in runs.items():
        m, rates = med[name], [r["episodes_s"] for r in rs]
        lines.append(
            f"| {name} | {m['episodes_s']:.2f} ({min(rates):.2f}-{max(rates):.2f}) | "
            f"{m['episodes_s'] / med['lockstep']['episodes_s']:.2f}x | "
            f"{m['prefilled_per_episode']:.0f} | {m['context_per_episode']:.0f} | "
            f"{m['model_tokens_over_context']:.2f}x | {m['sampled']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = harness(__doc__)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--mean", type=int, default=32, help="mean turn length (EOS odds 1/mean a step)")
    p.add_argument("--max-tokens", type=int, default=128, help="a turn's length limit")
    p.add_argument("--workers", type=int, default=2, help="env worker processes")
    a = p.parse_args(argv)
    env_type = QuickTurns if a.quick else FiveTurns
    shape, env_class = (QUICK_SHAPE if a.quick else SMALL_SHAPE), f"benchmarks.multi_turn:{env_type.__name__}"
    if a.quick:
        a.repeats, a.prompts, a.group_size, a.max_tokens, a.mean = 1, 2, 2, 32, 8
    import protocol
    from actor.episodes import EpisodeRunner
    from policy.data import Prompt
    from policy.engine import Engine
    from policy.model import load_policy
    from protocol.worker_socket import WorkerPool
    from runtime.config import EnvConfig, LoraConfig, SamplingConfig
    from runtime.lifecycle import Lifeline
    from transport.zeromq import ZeroMQ

    model, tok, _ = load_policy(str(flat_model(a.models_dir, shape)), LoraConfig(rank=8))
    vocab = shape["vocab_size"]
    eos = set(range(vocab - vocab // a.mean, vocab))
    sampling = SamplingConfig(group_size=a.group_size, temperature=1.0, max_tokens=a.max_tokens)
    turns = env_type.turns
    env = EnvConfig(
        environment=env_class, max_turns=turns, max_episode_tokens=4096, timeout_s=120.0, max_attempts=1
    )
    rng = random.Random(0)
    prompts = [Prompt(i, "".join(rng.choice(ALPHABET) for _ in range(32)), [], {}) for i in range(a.prompts)]
    net, lifeline = ZeroMQ(), Lifeline()
    workers: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp:
        endpoint = f"ipc://{Path(tmp) / 'env.sock'}"
        pool = WorkerPool(
            net,
            endpoint,
            "env_worker",
            protocol.OBSERVATION,
            env.timeout_s,
            max_attempts=1,
            owner_role="actor",
        )
        try:
            workers = start_workers(endpoint, env_class, a.workers, lifeline)
            while pool.n_workers < a.workers:
                pool.poll(100)
            rows = a.prompts * a.group_size
            runners = {
                "engine": EpisodeRunner(
                    pool, model, tok, eos, sampling, env, Engine(model, sampling, eos, sampling.seed, rows)
                ),
                "lockstep": EpisodeRunner(pool, model, tok, eos, sampling, env),
            }
            log(
                f"multi-turn: {a.prompts} prompts x G {a.group_size}, {turns} turns, observations of "
                f"{env_type.observation_tokens} tokens, turns geometric mean {a.mean}, max {a.max_tokens}; "
                f"{a.workers} env workers"
            )
            started = time.time()
            runs: dict[str, list[dict]] = {name: [] for name in runners}
            for rep in range(a.repeats + 1):  # the first: a warm-up
                for name, runner in runners.items():
                    result = run(runner, prompts, a.group_size)
                    log(
                        f"  {name}: {result['episodes_s']:.2f} episodes/s, {result['sampled']} sampled, "
                        f"{result['prefilled_per_episode']:.0f} prefilled a episode"
                    )
                    if rep:
                        runs[name].append(result)
        finally:
            pool.close("the benchmark is over")
            for w in workers:
                try:
                    w.wait(30)
                except subprocess.TimeoutExpired:
                    w.kill()
                    w.wait()
            lifeline.close()
            net.close()
    report = (
        f"Multi-turn episodes, Qwen3-shaped model of {parameters(shape) / 1e6:.0f} M parameters "
        f"(vocabulary {vocab}), float32, LoRA rank 8; {a.prompts} prompts x G {a.group_size}, {turns} "
        f"turns, turns geometric (mean {a.mean}, max {a.max_tokens}); medians of {a.repeats} repeats "
        f"after a warm-up\n\n" + table(runs)
    )
    out = {
        "shape": shape,
        "args": {k: str(v) for k, v in vars(a).items()},
        "runs": runs,
        "wall_s": time.time() - started,
    }
    write_results(a.results_dir, "multi_turn_quick" if a.quick else "multi_turn", out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

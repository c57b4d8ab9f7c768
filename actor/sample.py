"""The actor alone, for evaluation: `actor sample` samples K completions per prompt with
the base model or an adapter, scores them with the configured rewards and writes JSONL;
`actor eval` reports the held-out numbers a training run logs as eval/* (policy/evaluation.py
computes both)."""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import IO

import zmq

from actor.agents import AgentError, AgentRunner
from actor.completions import Policy
from actor.gateway import Gateway
from actor.rollout import Drawn
from policy.data import DataError, load_prompts
from policy.engine import Engine
from policy.evaluation import (
    Progress,
    Sampled,
    eval_metrics,
    eval_sampling,
    load_eval_prompts,
    rewards_of,
    sample_prompts,
    summarize,
)
from policy.model import dequantizes, load_policy
from protocol.config import Config, LoraConfig
from rewards.functions import RewardError
from rewards.scorer import Scored, Scorer

MAX_EVAL_ROWS = 64  # sessions an agent evaluation runs at once


def adapter_lora(adapter: str | Path) -> LoraConfig:
    """The [lora] settings an mlx-lm adapter directory was trained with."""
    saved = json.loads((Path(adapter) / "adapter_config.json").read_text())
    params = saved["lora_parameters"]
    return LoraConfig(
        rank=params["rank"],
        scale=float(params["scale"]),
        dropout=float(params.get("dropout", 0.0)),
        num_layers=saved.get("num_layers", -1),
        keys=tuple(params.get("keys") or ()),
    )


def wait_for_scores(scorer: Scorer, n: int, err: IO[str]) -> dict[str, Scored | RewardError]:
    """Poll the reward socket until n external scores (or failures) are back."""
    results: dict[str, Scored | RewardError] = {}
    said = False
    while len(results) < n:
        if scorer.waiting_for_workers and scorer.pool is not None and not said:
            print(
                f"\nwaiting for reward workers: orchestrator reward-worker module:function "
                f"--connect {scorer.pool.endpoint}",
                file=err,
                flush=True,
            )
            said = True
        done, failed, errors = scorer.poll(200)
        results.update({s.key: s for s in done})
        results.update({key: RewardError(reason) for key, reason in failed + errors})
    return results


def load_model(cfg: Config, adapter: str | None):
    lora = adapter_lora(adapter) if adapter else cfg.lora
    model, tok, _ = load_policy(
        cfg.model.path, lora, adapter_path=adapter, dequantize=dequantizes(cfg.model.dequantize_on_cpu)
    )
    return model, tok


def score_rows(cfg: Config, rows: list[Sampled], err: IO[str]) -> dict[str, Scored]:
    """Score every prompt's completions with the config's rewards, through a reward socket
    of our own in a temporary directory (for "worker" rewards), closed when done."""
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory(prefix="mlxrl-sample-") as sockets:
        scorer = Scorer(cfg.reward, ctx, f"ipc://{sockets}/reward.sock")
        try:
            return score_all(scorer, rows, err)
        finally:
            scorer.close()
            ctx.term()


def run_sample(
    cfg: Config,
    prompts_path: str,
    num_samples: int,
    out_path: str,
    adapter: str | None = None,
    seed: int = 0,
    limit: int | None = None,
    err: IO[str] = sys.stderr,
) -> dict:
    """`actor sample`: sample, score and write one row per sample; return the summary."""
    model, tok = load_model(cfg, adapter)
    prompts = load_prompts(
        prompts_path, tok, cfg.sampling.max_prompt_tokens, cfg.data.split, cfg.data.prompt_column
    )[:limit]
    rows, rate = sample_prompts(model, tok, prompts, num_samples, cfg.sampling, seed, err)
    scores = score_rows(cfg, rows, err)
    with open(out_path, "w") as f:
        for row in rows:
            rewards = rewards_of(scores.get(str(row.prompt.index))) or [None] * len(row.completions)
            for k, (c, text, reward) in enumerate(zip(row.completions, row.texts, rewards)):
                f.write(
                    json.dumps(
                        {
                            "prompt_index": row.prompt.index,
                            "sample": k,
                            "prompt": row.prompt.prompt,
                            "completion": text,
                            "token_ids": c.token_ids,
                            "logprobs": c.logprobs,
                            "finish_reason": c.finish_reason,
                            "reward": reward,
                        }
                    )
                    + "\n"
                )
    return {
        "samples_per_prompt": num_samples,
        **summarize(rows, scores, cfg.eval.pass_threshold, ""),
        "tokens_per_s": rate,
    }


def run_eval(cfg: Config, adapter: str | None = None, err: IO[str] = sys.stderr) -> dict:
    """`actor eval`: the numbers a training run logs as eval/*, for the base model or an adapter."""
    model, tok = load_model(cfg, adapter)
    params = eval_sampling(cfg)
    rows, rate = sample_prompts(
        model, tok, load_eval_prompts(cfg, tok), cfg.eval.num_samples, params, params.seed, err
    )
    scores = score_rows(cfg, rows, err)
    return {**summarize(rows, scores, cfg.eval.pass_threshold, "eval/"), "tokens_per_s": rate}


def run_agent_eval(cfg: Config, adapter: str | None = None, err: IO[str] = sys.stderr) -> dict:
    """`actor eval` of a config with an [agent]: each held-out row runs as
    `eval.num_samples` sessions of the agent, served from one continuous engine (at most
    MAX_EVAL_ROWS sessions at once); a session passes when its reward is at least
    `eval.pass_threshold`. A row whose sessions all failed `agent.max_attempts` times is
    counted unscored (and fails)."""
    model, tok = load_model(cfg, adapter)
    n = cfg.eval.num_samples
    params = dataclasses.replace(eval_sampling(cfg), group_size=n)
    prompts = load_eval_prompts(cfg, tok)
    eos = set(tok.eos_token_ids)
    engine = Engine(model, params, eos, params.seed, max(MAX_EVAL_ROWS, n))
    context = getattr(getattr(model, "args", None), "max_position_embeddings", None)
    try:
        runner = AgentRunner(cfg.agent, cfg.reward.search_path, engine, tok, eos, params, context)
    except AgentError as e:
        raise DataError(str(e)) from None
    gateway = Gateway(cfg.agent.host, runner, Policy(model, tok, Path(cfg.model.path).name, params, 0))
    gateway.start()
    waiting, results, lengths = deque(prompts), {}, []
    progress, t0 = Progress(err, len(prompts)), time.perf_counter()
    try:
        while waiting or runner.busy:
            while waiting and (len(runner.groups) + 1) * n <= max(MAX_EVAL_ROWS, n):
                p = waiting.popleft()
                runner.start_group(Drawn(p, [0, 0], [0, 1], p.index * n))
            for g in runner.pump(0):
                lost = g.lost is not None
                if lost:
                    print(f"\nrow {g.drawn.prompt.index}: {g.lost}", file=err)
                results[g.drawn.prompt.index] = [None if lost else s.reward for s in g.sessions]
                lengths += [sum(t.mask) for s in g.sessions for t in s.traces]
                progress.show(len(results), sum(lengths) / (time.perf_counter() - t0))
            if not engine.busy:
                time.sleep(0.002)
    finally:
        progress.close()
        gateway.stop()
        runner.close()
    rewards = [results[p.index] for p in prompts]
    unscored = sum(all(r is None for r in row) for row in rewards)
    elapsed = time.perf_counter() - t0
    return {
        **eval_metrics(rewards, lengths, cfg.eval.pass_threshold, "eval/"),
        "eval/unscored_prompts": unscored,
        "tokens_per_s": sum(lengths) / elapsed if elapsed else 0.0,
    }


def score_all(scorer: Scorer, rows: list[Sampled], err: IO[str]) -> dict[str, Scored]:
    """Score every prompt's completions; a prompt whose rewards fail stays unscored."""
    scores, waiting = {}, 0
    for row in rows:
        p = row.prompt
        try:
            scored = scorer.submit(
                str(p.index), p.prompt, row.texts, [c.token_ids for c in row.completions], p.columns
            )
        except RewardError as e:
            print(f"\nprompt {p.index}: {e}", file=err)
            continue
        if scored is None:
            waiting += 1
        else:
            scores[scored.key] = scored
    if waiting:
        for key, result in wait_for_scores(scorer, waiting, err).items():
            if isinstance(result, RewardError):
                print(f"prompt {key}: {result}", file=err)
            else:
                scores[key] = result
    return scores

"""The actor alone, for evaluation: `actor sample` samples K completions per prompt with
the base model or an adapter, scores them with the configured rewards and writes JSONL;
`actor eval` reports the held-out numbers a training run logs as eval/* (policy/evaluation.py
computes both)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import IO, cast

import numpy as np

import protocol
import transport
from actor.agents import AgentError, AgentRunner
from actor.completions import Policy
from actor.episodes import EpisodeRunner
from actor.gateway import Gateway
from actor.rollout import PlacedPrompt
from policy.data import DataError, load_prompts
from policy.engine import Engine
from policy.evaluation import (
    Progress,
    Sampled,
    eval_metrics,
    eval_sampling,
    load_eval_prompts,
    sample_prompts,
    summarize,
)
from policy.logprobs import plain_caches
from policy.model import dequantizes, load_policy
from protocol.worker_socket import WorkerPool
from rewards.functions import RewardError
from rewards.scorer import Scored, Scorer, rewards_by_prompt, rewards_of
from runtime.config import Config, LoraConfig
from runtime.env_workers import env_worker_args
from runtime.lifecycle import Lifeline, child_env, python_module
from transport import Transport

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
    net = transport.default()
    with tempfile.TemporaryDirectory(prefix="mlxrl-sample-") as sockets:
        scorer = Scorer(cfg.reward, net, f"ipc://{sockets}/reward.sock")
        try:
            return score_all(scorer, rows, err)
        finally:
            scorer.close()
            net.close()


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
        **summarize(rows, rewards_by_prompt(scores), cfg.eval.pass_threshold, ""),
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
    return {
        **summarize(rows, rewards_by_prompt(scores), cfg.eval.pass_threshold, "eval/"),
        "tokens_per_s": rate,
    }


def eval_engine(cfg: Config, adapter: str | None, lockstep_ok: bool = False):
    """What an evaluation of sessions or episodes decodes with: the model (and adapter),
    its tokenizer, [eval]'s sampling with one group per row of `eval.num_samples`, the
    held-out rows, the EOS ids, and an engine of up to MAX_EVAL_ROWS rows (static for a
    model whose caches are not plain KVCache, where `lockstep_ok`: episodes)."""
    model, tok = load_model(cfg, adapter)
    static = lockstep_ok and not plain_caches(model)
    n = cfg.eval.num_samples
    params = dataclasses.replace(eval_sampling(cfg), group_size=n)
    eos = set(tok.eos_token_ids)
    engine = Engine(model, params, eos, params.seed, max(MAX_EVAL_ROWS, n), static=static)
    return model, tok, params, load_eval_prompts(cfg, tok), eos, engine


def eval_summary(cfg: Config, rewards: list, lengths: list[int], unscored: int, seconds: float) -> dict:
    """The eval/* figures of scored sessions or episodes (`rewards`: per row, per sample)."""
    return {
        **eval_metrics(rewards, lengths, cfg.eval.pass_threshold, "eval/"),
        "eval/unscored_prompts": unscored,
        "eval/runtime_s": seconds,
        "tokens_per_s": sum(lengths) / seconds if seconds else 0.0,
    }


def run_agent_eval(cfg: Config, adapter: str | None = None, err: IO[str] = sys.stderr) -> dict:
    """`actor eval` of a config with an [agent]: each held-out row runs as
    `eval.num_samples` sessions of the agent, served from one continuous engine (at most
    MAX_EVAL_ROWS sessions at once); a session passes when its reward is at least
    `eval.pass_threshold`. A session that failed `agent.max_attempts` times fails; a row
    none of whose sessions could report is counted unscored."""
    model, tok, params, prompts, eos, engine = eval_engine(cfg, adapter)
    n = params.group_size
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
                runner.start_group(PlacedPrompt(p, [0, 0], [0, 1], p.index * n))
            for g in runner.pump(0):
                if g.lost is not None:  # its other sessions' rewards still count
                    print(f"\nrow {g.drawn.prompt.index}: {g.lost}", file=err)
                reported = [s.reward if s.done and s.failed is None else None for s in g.sessions]
                results[g.drawn.prompt.index] = reported
                lengths += [sum(t.mask) for s in g.sessions for t in s.traces]
                progress.show(len(results), sum(lengths) / (time.perf_counter() - t0))
            if not engine.busy:
                time.sleep(0.002)
    finally:
        progress.close()
        gateway.stop()
        runner.close()
    # A row none of whose sessions reported is unscored and left out of pass@k, as a
    # prompt whose rewards failed is in the other evaluations; a failed session among
    # reported ones fails.
    rows = [results[p.index] for p in prompts]
    rewards = [row for row in rows if any(r is not None for r in row)]
    return eval_summary(cfg, rewards, lengths, len(rows) - len(rewards), time.perf_counter() - t0)


def run_env_eval(cfg: Config, adapter: str | None = None, err: IO[str] = sys.stderr) -> dict:
    """`actor eval` of a config with an environment: each held-out row plays as
    `eval.num_samples` episodes (actor/episodes.py) against env workers of our own, on a
    private socket (`env.environment = "socket"`: the ones you attach to the endpoint
    said), scored with the run's rewards as training scores them."""
    model, tok, params, prompts, eos, engine = eval_engine(cfg, adapter, lockstep_ok=True)
    n = params.group_size
    net, lifeline = transport.default(), Lifeline()
    with tempfile.TemporaryDirectory(prefix="mlxrl-eval-") as tmp:
        endpoint = f"ipc://{tmp}/env.sock"
        pool = WorkerPool(
            net, endpoint, "env_worker", protocol.OBSERVATION, cfg.env.timeout_s, 1, owner_role="actor"
        )
        workers = start_env_workers(cfg, endpoint, lifeline)
        if not workers:
            print(f"waiting for env workers: attach them to {endpoint}", file=err, flush=True)
        try:
            runner = EpisodeRunner(pool, model, tok, eos, params, cfg.env, engine)
            runner.renderer.check(prompts[0].prompt)
            groups, progress, t0 = [], Progress(err, len(prompts)), time.perf_counter()
            per_batch = max(1, MAX_EVAL_ROWS // n)
            for start in range(0, len(prompts), per_batch):
                batch = prompts[start : start + per_batch]
                groups += cast(list, runner.run(batch, [p.index * n for p in batch]))
                tokens = sum(sum(e.mask) for g in groups for e in g.episodes)
                progress.show(len(groups), tokens / (time.perf_counter() - t0))
            progress.close()
            return score_episodes(cfg, net, tmp, groups, tok, err, time.perf_counter() - t0)
        finally:
            pool.close("the evaluation is over", final=True)
            for w in workers:
                w.terminate()
                w.wait()
            net.close()
            lifeline.close()


def start_env_workers(cfg: Config, endpoint: str, lifeline: Lifeline) -> list[subprocess.Popen]:
    """`env.num_workers` env workers on `endpoint`, ending with us; none for "socket"."""
    if cfg.env.environment == "socket":
        return []
    args = [*python_module(*env_worker_args(cfg)), "--connect", endpoint]
    env = child_env(**lifeline.child_env())
    return [
        subprocess.Popen(args, env=env, pass_fds=(lifeline.read_fd,), stdout=subprocess.DEVNULL)
        for _ in range(cfg.env.num_workers)
    ]


def score_episodes(
    cfg: Config, net: Transport, tmp: str, groups: list, tok, err: IO[str], seconds: float
) -> dict:
    """eval/* of played episodes, scored as training scores them (their turns, and what the
    environment returned as the "env" reward). A group whose episodes were lost is unscored."""
    scorer = Scorer(cfg.reward, net, f"ipc://{tmp}/reward.sock")
    try:
        scores, waiting = {}, 0
        for i, g in enumerate(groups):
            if g.error is not None:
                print(f"row {g.prompt.index}: {g.error}", file=err)
                continue
            fields, arrays = g.fields(lambda ids: tok.decode(ids, skip_special_tokens=True))
            lens = arrays["completion_lens"].tolist()
            ids = np.split(arrays["completion_ids"], np.cumsum(lens)[:-1])
            p = g.prompt
            scored = scorer.submit(
                str(i), p.prompt, fields["texts"], ids, p.columns, fields["turns"], fields["env_rewards"]
            )
            if scored is None:
                waiting += 1
            else:
                scores[str(i)] = scored
        if waiting:
            scores.update(
                {k: v for k, v in wait_for_scores(scorer, waiting, err).items() if isinstance(v, Scored)}
            )
    finally:
        scorer.close()
    rewards = [r for i in range(len(groups)) if (r := rewards_of(scores.get(str(i)))) is not None]
    lengths = [sum(e.mask) for g in groups for e in g.episodes]
    return eval_summary(cfg, rewards, lengths, len(groups) - len(rewards), seconds)


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

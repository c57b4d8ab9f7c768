"""The actor alone, for evaluation: `actor sample` samples K completions per prompt with
the base model or an adapter, scores them with the configured rewards and writes JSONL;
`actor eval` reports the held-out numbers a training run logs as eval/* (policy/evaluation.py
computes both)."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import IO

import zmq

from policy.data import load_prompts
from policy.evaluation import Sampled, eval_sampling, load_eval_prompts, rewards_of, sample_prompts, summarize
from policy.model import dequantizes, load_policy
from protocol.config import Config, LoraConfig
from rewards.functions import RewardError
from rewards.scorer import Scored, Scorer


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

"""`actor sample`: the actor alone, for evaluation. Samples K completions per prompt with
the base model or an adapter, scores them with the configured rewards, writes JSONL."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

import numpy as np
import zmq

from actor.data import load_prompts
from actor.sampler import sample_groups
from policy.model import load_policy
from protocol.config import Config, LoraConfig
from rewards.functions import RewardError
from rewards.scorer import Scorer


def adapter_lora(adapter: str | Path) -> LoraConfig:
    """The [lora] settings an mlx-lm adapter directory was trained with."""
    saved = json.loads((Path(adapter) / "adapter_config.json").read_text())
    params = saved["lora_parameters"]
    return LoraConfig(rank=params["rank"], scale=float(params["scale"]),
                      dropout=float(params.get("dropout", 0.0)), num_layers=saved.get("num_layers", -1),
                      keys=tuple(params.get("keys") or ()))


def pass_at_k(rewards: list[list[float]]) -> float | None:
    """Fraction of prompts with at least one reward of 1, when every reward is 0 or 1."""
    flat = [r for row in rewards for r in row if r is not None]
    if not flat or any(r not in (0.0, 1.0) for r in flat):
        return None
    return float(np.mean([max(row) == 1.0 for row in rewards]))


def wait_for_scores(scorer: Scorer, n: int, err: IO[str]) -> dict[str, object]:
    """Poll the reward socket until n external scores (or failures) are back."""
    results: dict[str, object] = {}
    said = False
    while len(results) < n:
        if scorer.waiting_for_workers and not said:
            print(f"\nwaiting for reward workers: orchestrator reward-worker module:function "
                  f"--connect {scorer.dispatcher.endpoint}", file=err, flush=True)
            said = True
        done, failed, errors = scorer.poll(200)
        results.update({s.key: s for s in done})
        results.update({key: RewardError(reason) for key, reason in failed + errors})
    return results


def run_sample(cfg: Config, prompts_path: str, num_samples: int, out_path: str,
               adapter: str | None = None, seed: int = 0, limit: int | None = None,
               err: IO[str] = sys.stderr) -> dict:
    """Sample, score and write rows; return (and print) the summary."""
    lora = adapter_lora(adapter) if adapter else cfg.lora
    model, tok, _ = load_policy(cfg.model.path, lora, adapter_path=adapter)
    prompts = load_prompts(prompts_path, tok, cfg.sampling.max_prompt_tokens, cfg.data.split,
                           cfg.data.prompt_column)[:limit]
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory(prefix="mlxrl-sample-") as sockets:  # removed when done
        scorer = Scorer(cfg.reward, ctx, f"ipc://{sockets}/reward.sock")
        try:
            return _sample_and_score(model, tok, cfg, prompts, num_samples, out_path, seed, scorer, err)
        finally:
            scorer.close()
            ctx.term()


def _sample_and_score(model, tok, cfg: Config, prompts: list, num_samples: int, out_path: str, seed: int,
                      scorer: Scorer, err: IO[str]) -> dict:
    params = cfg.sampling
    rows, rewards, tokens, t0 = [], [], 0, time.perf_counter()
    for start in range(0, len(prompts), 8):  # up to 8 prompts decode as one batch
        batch = prompts[start:start + 8]
        # Row ids follow the prompt's position, so a prompt's samples depend only on --seed.
        groups = sample_groups(model, [p.prompt_ids for p in batch], num_samples, params,
                               set(tok.eos_token_ids), seed=seed, row_offset=start * num_samples)
        for p, completions in zip(batch, groups):
            texts = [tok.decode(c.token_ids, skip_special_tokens=True) for c in completions]
            tokens += sum(len(c.token_ids) for c in completions)
            rows.append((p, completions, texts))
        rate = tokens / (time.perf_counter() - t0)
        print(f"\rsampling {len(rows)}/{len(prompts)} prompts  {rate:.0f} tok/s", end="", file=err,
              flush=True)
    gen_s = time.perf_counter() - t0
    scores = score_all(scorer, rows, err)
    with open(out_path, "w") as f:
        for p, completions, texts in rows:
            scored = scores.get(str(p.index))
            row_rewards = []
            for k, (c, text) in enumerate(zip(completions, texts)):
                reward = None if scored is None or np.isnan(scored.total[k]) else float(scored.total[k])
                row_rewards.append(reward)
                f.write(json.dumps({
                    "prompt_index": p.index, "sample": k, "prompt": p.prompt, "completion": text,
                    "token_ids": c.token_ids, "logprobs": c.logprobs, "finish_reason": c.finish_reason,
                    "reward": reward}) + "\n")
            if scored is not None:
                rewards.append(row_rewards)
    flat = [r for row in rewards for r in row if r is not None]
    summary = {
        "prompts": len(prompts), "samples_per_prompt": num_samples,
        "mean_reward": float(np.mean(flat)) if flat else None,
        f"pass@{num_samples}": pass_at_k(rewards),
        "tokens_per_s": tokens / gen_s if gen_s > 0 else None,
        "unscored_prompts": len(prompts) - len(rewards),
    }
    print(file=err)
    return summary


def score_all(scorer: Scorer, rows: list, err: IO[str]) -> dict:
    """Score every prompt's completions; a prompt whose rewards fail stays unscored."""
    scores, waiting = {}, 0
    for p, completions, texts in rows:
        try:
            scored = scorer.submit(str(p.index), p.prompt, texts, [c.token_ids for c in completions],
                                   p.columns)
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

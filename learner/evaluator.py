"""Held-out evaluation during training (the [eval] section).

The learner samples the held-out prompts with the weights of the step it just took,
scores them with the run's rewards and writes one `eval/*` line to the metrics. It is the
learner, not the actor, that evaluates, so that each figure belongs to exactly one
version of the weights (an actor holds whatever version last arrived), the last step is
always evaluated before the run ends, and no message is added to the wire. The actor
goes on sampling meanwhile, as far as `train.max_staleness` lets it. `actor eval` gives
the same figures for any adapter, from the same functions.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from policy.evaluation import Report, Sampled, eval_sampling, load_eval_prompts, sample_prompts, summarize
from policy.sampler import Stopped
from rewards.functions import RewardError
from rewards.scorer import Scored, Scorer, rewards_by_prompt
from runtime.config import Config

log = logging.getLogger("learner")

# Receives the replies `Scorer.poll` gave for training groups while evaluation waited.
PassOn = Callable[[list[Scored], list[tuple[str, str]], list[tuple[str, str]]], None]


class Evaluator:
    def __init__(self, cfg: Config, tokenizer) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.prompts = load_eval_prompts(cfg, tokenizer)
        self.params = eval_sampling(cfg)
        self.last_step: int | None = None
        self.asked: set[str] = set()  # the keys of our requests not answered yet

    def due(self, step: int) -> bool:
        """Before the first step, every `eval.every` steps, and after the last."""
        every = self.cfg.eval.every
        periodic = bool(every and step % every == 0)
        return step != self.last_step and (step in (0, self.cfg.train.steps) or periodic)

    def run(
        self,
        model,
        step: int,
        scorer: Scorer,
        pass_on: PassOn,
        stopping: Callable[[], bool],
        report: Report | None = None,
    ) -> dict | None:
        """The eval/* metrics of `model` at `step`; None if a stop came while sampling or
        scoring (checked after every decode step). `report` sees the sampling's progress."""
        t0 = time.perf_counter()
        model.eval()
        try:
            rows, rate = sample_prompts(
                model,
                self.tokenizer,
                self.prompts,
                self.cfg.eval.num_samples,
                self.params,
                self.params.seed,
                stopping=stopping,
                report=report,
            )
        except Stopped:
            log.info("evaluation at step %d stopped by a signal", step)
            return None
        finally:
            model.train()
        scores = self.score(rows, step, scorer, pass_on, stopping)
        if scores is None:
            return None
        self.last_step = step
        return {
            "step": step,
            "policy_version": step,
            **summarize(rows, rewards_by_prompt(scores), self.cfg.eval.pass_threshold, "eval/"),
            "eval/tokens_per_s": rate,
            "eval/runtime_s": time.perf_counter() - t0,
        }

    def score(
        self, rows: list[Sampled], step: int, scorer: Scorer, pass_on: PassOn, stopping: Callable[[], bool]
    ) -> dict[str, Scored] | None:
        """Each prompt's scores, keyed by its index. A reward function that fails ends the
        run, as in training; a prompt the workers could not score is left out (and logged).
        A reply is ours if its key is one we asked and were not answered yet; any other
        is training's, and passed on."""
        scores: dict[str, Scored] = {}
        waiting: dict[str, str] = {}  # request key -> prompt index
        for row in rows:
            key = f"eval/{step}/{row.prompt.index}"
            scored = scorer.submit(
                key, row.prompt.prompt, row.texts, [c.token_ids for c in row.completions], row.prompt.columns
            )
            if scored is None:
                waiting[key] = str(row.prompt.index)
                self.asked.add(key)
            else:
                scores[str(row.prompt.index)] = scored
        while waiting:
            if stopping():
                return None
            done, failed, errors = scorer.poll(200)
            keys = [s.key for s in done] + [f[0] for f in failed] + [e[0] for e in errors]
            mine = self.asked.intersection(keys)
            self.asked -= mine
            for s in done:
                if s.key in mine and s.key in waiting:
                    scores[waiting.pop(s.key)] = s
            for key, reason in failed:
                if key in mine and key in waiting:
                    log.warning("eval prompt %s unscored: %s", waiting.pop(key), reason)
            for key, error in errors:
                if key in mine and key in waiting:
                    raise RewardError(f"{error} (on eval prompt {waiting[key]})")
            pass_on(
                [s for s in done if s.key not in mine],
                [f for f in failed if f[0] not in mine],
                [e for e in errors if e[0] not in mine],
            )
        return scores

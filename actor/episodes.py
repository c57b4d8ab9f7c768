"""Multi-turn episodes: the model's turns sampled here, the environment's from env workers.

An episode's completion is one token sequence after the prompt: environment turns and
model turns, alternating. Token-in/token-out: the model's turns are the ids it sampled,
kept as they are (never decoded and encoded again), with their behavior logprobs; an
environment turn is its observation rendered into tokens by the chat template's
incremental form (`Renderer`) and carries `loss_mask` 0, so the learner trains on the
model's tokens only. For chat prompts even the generation prompt of every model turn
belongs to the environment's tokens: the prompt is rendered without it.

Model turns decode in the actor's engine (policy/engine.py). Continuous, episodes do not
wait for each other: a turn joins the decode batch the moment its observation is in,
continuing the KV cache its last turn left, so only the environment's new tokens are
prefilled and an n-turn episode prefills its context once. When the turn ends it sends
its action to the env worker that holds it (`step`) and waits, keeping its cache, while
the others decode. A static engine (`actor.engine = "static"`, or a model whose caches
are not plain KVCache) takes turns in lockstep: once every environment has answered,
the live episodes' turns go in together, each whole context prefilled again, and decode
a batch at a time. Both draw a turn's noise alike, so they sample the same tokens (in
float32, where an incremental and a full prefill agree to 1e-5; at a near-tie a lower
precision may break them differently).

The environment ends an episode with `done` (`env_done`) or an error (`env_error`); the
per-episode token budget ends it too (`length`), and so does the environment's answer to
the `env.max_turns`-th model turn (`max_turns`; that answer's reward counts).

An episode whose worker is lost (it left, fell silent, missed the deadline) starts again
from `reset` on another worker, with the same noise, up to `env.max_attempts` times;
after that its group is sent with `error` set, and the learner counts it as dropped with
that reason: never lost.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.nn as nn
import numpy as np

import protocol
from actor.rollout import rewards_per_run
from policy.data import DataError, Prompt
from policy.engine import Engine
from protocol.worker_socket import Attachment, WorkerPool
from runtime.config import EnvConfig, SamplingConfig

log = logging.getLogger("actor")

# A turn's noise differs from the last turn's: its seed is the run's plus this times the turn.
TURN_SEED_STRIDE = 1_000_003
_MARK = "\x1fmodel-turn\x1f"  # stands for a model turn's text when measuring the template
_A_TURN = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}]


class Renderer:
    """The tokens an environment turn adds to an episode: the chat template's incremental
    form for chat prompts (what the template puts between the model's last sampled token
    and the next generation prompt, the observation's message included), the observation's
    own tokens for text prompts."""

    def __init__(self, tokenizer: Any, eos_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_texts = [tokenizer.decode([i], skip_special_tokens=False) for i in sorted(eos_ids)]

    def check(self, prompt: Any) -> None:
        """Fail before the first episode, as a data error, when the chat template cannot
        render environment turns incrementally."""
        try:
            self.first_turn(prompt, {"role": "user", "content": "?"})
            self.next_turn(prompt, {"role": "user", "content": "?"}, after_eos=True)
        except ValueError as e:
            raise DataError(f"env.environment: {e}") from None

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def template(self, messages: list[dict], generation_prompt: bool, tools: list | None = None) -> str:
        extra = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=False, **extra
        )

    def continuation(
        self, before: list[dict], new: list[dict], after_eos: bool, tools: list | None
    ) -> list[int]:
        """The tokens that follow a model turn (the last message of `before`, its tokens as
        sampled) when `new` messages come after it: the rest of the turn's close and the
        template's text for `new` with the generation prompt. ValueError when the template
        does not render the longer conversation as a continuation of the shorter."""
        base = self.template(before, False, tools)
        full = self.template(before + new, True, tools)
        close = self.turn_close
        if not (full.startswith(base) and base.endswith(close)):
            raise ValueError("the chat template does not render this conversation as a continuation")
        if after_eos:
            eos = next((t for t in self.eos_texts if close.startswith(t)), "")
            close = close[len(eos) :]
        return self.encode(close + full[len(base) :])

    def prompt_ids(self, prompt: Any) -> list[int]:
        """A chat prompt without its generation prompt: that comes with the first
        environment turn, after the reset observation."""
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        return self.encode(self.template(prompt, False))

    def first_turn(self, prompt: Any, observation: dict | None) -> list[int]:
        """What follows the prompt before the model's first turn."""
        if isinstance(prompt, str):
            return self.encode(observation["content"]) if observation else []
        return self.encode(self.extension(prompt, observation))

    def next_turn(self, prompt: Any, observation: dict, after_eos: bool) -> list[int]:
        """What follows a model turn that ended with an EOS token (`after_eos`) or not."""
        if isinstance(prompt, str):
            return self.encode(observation["content"])
        close = self.turn_close
        if after_eos:  # the model sampled its turn's end itself: keep those ids, add the rest
            eos = next((t for t in self.eos_texts if close.startswith(t)), "")
            close = close[len(eos) :]
        return self.encode(close + self.extension(_A_TURN, observation))

    @functools.cached_property
    def turn_close(self) -> str:
        """What the template puts after a model turn's text to close it (the same for every
        turn; worked out on first use, as text-only tokenizers have no template)."""
        closed = self.template(_A_TURN, False)
        return closed[closed.index(_MARK) + len(_MARK) :]

    def extension(self, messages: list[dict], observation: dict | None) -> str:
        """The template's text for `observation` and the generation prompt after
        `messages`; the template must render a conversation as a prefix of its extension."""
        base = self.template(messages, False)
        full = self.template(messages + ([observation] if observation else []), True)
        if not full.startswith(base):
            raise ValueError(
                "the chat template does not render a conversation as the start of its "
                "continuation, so environment turns cannot be appended as tokens"
            )
        return full[len(base) :]


@dataclass
class Episode:
    episode_id: str
    group: int  # the group's place in the batch
    prompt: Prompt
    noise: int  # the sampler's noise id: the episode's draws
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)  # the completion: model and environment tokens
    mask: list[int] = field(default_factory=list)  # 1 where the model sampled the token
    logprobs: list[float] = field(default_factory=list)  # behavior logprobs, 0 for the environment's
    turns: list[dict] = field(default_factory=list)  # {"role", "content"} per turn after the prompt
    rewards: list[float] = field(default_factory=list)  # what the environment returned
    turn_starts: list[int] = field(default_factory=list)  # where each model turn starts in `ids`
    turn_rewards: list[float] = field(default_factory=list)  # the environment's, per model turn
    finish: str | None = None
    model_turns: int = 0
    worker: Attachment | None = None  # the env worker (its attachment) that holds the episode
    waiting: bool = False  # a request is out
    attempts: int = 0
    lost: str | None = None  # why it could not be completed: its group is dropped

    @property
    def wire_id(self) -> str:
        """The episode's id on the env socket: a new one per attempt, so a late reply to a
        lost attempt never lands in the next."""
        return f"{self.episode_id}/a{self.attempts}"

    def restart(self) -> None:
        """Back to before `reset` (only between turns: never while its turn is in the engine)."""
        self.ids, self.mask, self.logprobs, self.turns, self.rewards = [], [], [], [], []
        self.turn_starts, self.turn_rewards = [], []
        self.finish, self.model_turns, self.worker, self.waiting = None, 0, None, False

    def add(self, ids: list[int], logprobs: list[float] | None = None) -> None:
        self.ids += ids
        self.mask += [0 if logprobs is None else 1] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)


@dataclass
class EpisodeGroup:
    """One prompt's G episodes, as the rollout message carries them."""

    prompt: Prompt
    prompt_ids: list[int]
    episodes: list[Episode]

    @property
    def error(self) -> str | None:
        """Why the group cannot be trained on (sent with `error`; the learner drops it)."""
        lost = [e.lost for e in self.episodes if e.lost]
        if lost:
            return lost[0]
        if not all(any(e.mask) for e in self.episodes):
            return "an episode ended before the model's first turn"
        return None

    def fields(self, decode: Callable[[list[int]], str]) -> tuple[dict, dict]:
        """The rollout's episode header fields and arrays."""
        eps = self.episodes
        header = {
            "texts": [decode(e.ids) for e in eps],
            "finish_reasons": [e.finish for e in eps],
            "turns": [e.turns for e in eps],
            "env_rewards": [sum(e.rewards) if e.rewards else None for e in eps],
        }
        if all(e.rewards and any(e.mask) for e in eps):  # GiGPO's step rewards
            reset = [sum(e.rewards) - sum(e.turn_rewards) for e in eps]  # what `reset` returned
            header["turn_rewards"] = [
                rewards_per_run(e.mask, e.turn_starts, [e.turn_rewards[0] + r, *e.turn_rewards[1:]])
                for e, r in zip(eps, reset)
            ]
        if self.error:
            header["error"] = self.error
        arrays = {
            "prompt_ids": np.array(self.prompt_ids, dtype=np.int32),
            "completion_ids": np.array(sum((e.ids for e in eps), []), dtype=np.int32),
            "completion_lens": np.array([len(e.ids) for e in eps], dtype=np.int32),
            "logprobs": np.array(sum((e.logprobs for e in eps), []), dtype=np.float32),
            "loss_mask": np.array(sum((e.mask for e in eps), []), dtype=np.uint8),
        }
        return header, arrays


class EpisodeRunner:
    """Runs batches of episodes against the env workers of one env socket."""

    def __init__(
        self,
        pool: WorkerPool,
        model: nn.Module,
        tokenizer: Any,
        eos_ids: set[int],
        sampling: SamplingConfig,
        env: EnvConfig,
        engine: Engine | None = None,
    ) -> None:
        """`engine`: where turns decode (by default a static one, every turn of a batch
        together)."""
        self.pool, self.model, self.tokenizer = pool, model, tokenizer
        self.eos_ids, self.sampling, self.env = eos_ids, sampling, env
        rows = 1 << 30  # no bound: the lockstep batch is every live episode
        self.engine = engine or Engine(model, sampling, eos_ids, sampling.seed, rows, static=True)
        self.renderer = Renderer(tokenizer, eos_ids)
        self.retries = 0  # episodes started again because their worker was lost
        self.episodes: dict[str, Episode] = {}  # by request id
        self.in_engine: dict[str, Episode] = {}  # by episode id: those whose turn decodes (never `waiting`)
        self.counter = 0

    def run(
        self, prompts: list[Prompt], first_noise: list[int], interrupted: Callable[[], bool] = lambda: False
    ) -> list[EpisodeGroup] | None:
        """G episodes of each prompt; prompt i's episodes have noise ids first_noise[i] + j (the
        sampler's noise). None when `interrupted()` says stop before they end (nothing
        is sent then)."""
        g = self.sampling.group_size
        groups = []
        for i, prompt in enumerate(prompts):
            ids = self.renderer.prompt_ids(prompt.prompt)[-self.sampling.max_prompt_tokens :]
            eps = [Episode(f"{self.counter}-{i}-{j}", i, prompt, first_noise[i] + j, ids) for j in range(g)]
            groups.append(EpisodeGroup(prompt, ids, eps))
        self.counter += 1
        live = [e for grp in groups for e in grp.episodes]
        for e in live:
            self.start(e)
        waited = False
        while any(e.finish is None for e in live):
            if interrupted():
                self.engine.clear()
                self.in_engine.clear()
                return None
            ready = [
                e for e in live if e.finish is None and not e.waiting and e.episode_id not in self.in_engine
            ]
            for e in ready:  # between turns and its worker lost: it starts again now, not at its next step
                if e.worker and not self.pool.holds(e.worker):
                    self.retry(e, f"{self.pool.name}: the worker holding it is gone")
            ready = [e for e in ready if e.finish is None and not e.waiting]  # not those started again
            if self.engine.static and any(e.waiting for e in live):
                ready = []  # lockstep: a turn goes in once every environment has answered
            if self.decode_step(ready):
                self.handle(*self.pool.poll(0))
                continue
            if not waited and self.pool.n_workers == 0:
                log.info("waiting for an env worker on %s", self.pool.endpoint)
                waited = True
            self.handle(*self.pool.poll(100))
        return groups

    @property
    def prefilled(self) -> int:
        """Tokens prefilled so far."""
        return self.engine.prefilled

    def turn_seed(self, e: Episode) -> int:
        """A turn's noise differs from the last turn's."""
        return self.sampling.seed + TURN_SEED_STRIDE * e.model_turns

    def decode_step(self, ready: list[Episode]) -> bool:
        """The `ready` episodes' next turns join the engine (continuous: each continuing
        the cache its last turn left), then one decode step; each turn that ends goes to
        its environment. False when nothing decodes."""
        engine = self.engine
        for e in ready:
            self.in_engine[e.episode_id] = e
            engine.add(e.episode_id, e.prompt_ids + e.ids, [e.noise], self.turn_seed(e), keep=True)
        if not engine.busy:
            return False
        for key, (c,) in engine.step():
            self.model_turn(self.in_engine.pop(cast(str, key)), c.token_ids, c.logprobs)
        return True

    def start(self, e: Episode) -> None:
        e.attempts += 1
        e.waiting = True
        rid = f"{e.wire_id}/reset"
        self.episodes[rid] = e
        self.pool.submit(
            rid,
            {"episode_id": e.wire_id, "prompt": e.prompt.prompt, "columns": e.prompt.columns},
            protocol.RESET,
        )

    def model_turn(self, e: Episode, ids: list[int], logprobs: list[float]) -> None:
        """Add a sampled turn; send it to the environment unless the budget is spent. A
        turn cut by `sampling.max_tokens` goes to the environment as it is (the
        environment judges it); one cut by the episode's budget ends the episode."""
        room = self.env.max_episode_tokens - len(e.ids)
        ids, logprobs = ids[:room], logprobs[:room]
        e.turn_starts.append(len(e.ids))
        e.turn_rewards.append(0.0)  # until the environment's answer to it
        e.add(ids, logprobs)
        e.model_turns += 1
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        e.turns.append({"role": "assistant", "content": text})
        if len(e.ids) >= self.env.max_episode_tokens:
            self.finish(e, "length")
            return
        e.waiting = True
        rid = f"{e.wire_id}/t{e.model_turns}"
        self.episodes[rid] = e
        self.pool.submit(
            rid, {"episode_id": e.wire_id, "action": text, "action_ids": ids}, protocol.STEP, pinned=e.worker
        )

    def handle(self, replies: list, failures: list[tuple[str, str]]) -> None:
        for r in replies:
            e = self.episodes.pop(r.request_id)
            e.waiting = False
            e.worker = r.worker
            self.observe(e, r.header, first=r.request_id.endswith("/reset"))
        for rid, reason in failures:
            e = self.episodes.pop(rid)
            e.waiting = False
            self.retry(e, reason)

    def retry(self, e: Episode, reason: str) -> None:
        """Start an episode that lost its worker again, from `reset`, or give it up (its
        group is dropped) once it has had `env.max_attempts`."""
        self.engine.release(e.episode_id)  # its KV cache is of the context it leaves behind
        if e.attempts >= self.env.max_attempts:
            log.error(
                "episode %s: %s; %d attempts used, its group is dropped", e.episode_id, reason, e.attempts
            )
            e.lost = f"environment: {reason} ({e.attempts} attempts)"
            e.finish = "env_error"
            return
        log.warning("episode %s: %s; starting it again", e.episode_id, reason)
        self.retries += 1
        e.restart()
        self.start(e)

    def observe(self, e: Episode, reply: dict, first: bool) -> None:
        if reply.get("reward") is not None:
            e.rewards.append(float(reply["reward"]))
            if e.turn_rewards:  # the answer to a model turn (one at reset counts for the first)
                e.turn_rewards[-1] += float(reply["reward"])
        if reply.get("error") is not None:
            log.warning("episode %s: the environment says: %s", e.episode_id, reply["error"])
            if first:  # nothing to train on: the group is dropped, with the environment's words
                e.lost = f"environment error at reset: {reply['error']}"
            self.finish(e, "env_error")
            return
        if reply["done"]:
            if first:
                e.lost = "the environment ended the episode at reset"
            self.finish(e, "env_done")
            return
        if e.model_turns >= self.env.max_turns:
            self.finish(e, "max_turns")
            return
        text = reply["observation"]
        message = {"role": reply.get("role") or "user", "content": text}
        if first:
            ids = self.renderer.first_turn(e.prompt.prompt, message if text else None)
        else:
            ids = self.renderer.next_turn(e.prompt.prompt, message, e.ids[-1] in self.eos_ids)
        if len(e.ids) + len(ids) >= self.env.max_episode_tokens:
            self.finish(e, "length")  # no room left for the model to answer
            return
        e.add(ids)
        if text:
            e.turns.append(message)

    def finish(self, e: Episode, reason: str) -> None:
        e.finish = reason
        self.engine.release(e.episode_id)
        if e.worker is not None:
            self.pool.notify(e.worker, protocol.END, {"episode_id": e.wire_id})

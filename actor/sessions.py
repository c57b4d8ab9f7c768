"""Agent sessions as data: a session's traces (the token sequences its calls make), its
group, a call on its way to the engine, the reward an agent reports, and what a group of
sessions becomes on the wire (a `rollout` of episodes, PROTOCOL.md).

actor/agents.py runs the sessions (starts the agents, decodes their calls, retries them);
actor/gateway.py is the HTTP side. Here only what they share, and nothing that runs.
"""

from __future__ import annotations

import json
import math
import numbers
import queue
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from actor.rollout import PlacedPrompt, rewards_per_run

KEY_PREFIX = "sk-session-"


class CallRefused(Exception):
    """A call the gateway answers with an error: its HTTP status and message."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


@dataclass
class Trace:
    """One token sequence of a session: the first call's prompt, then context (mask 0) and
    completions (mask 1)."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    calls: int = 0
    turns: list[dict] = field(default_factory=list)  # chat: the messages after its first prompt's
    first_messages: int = 0  # chat: how many messages its first call's prompt had
    call_starts: list[int] = field(default_factory=list)  # where each call's completion starts in `ids`
    call_numbers: list[int] = field(default_factory=list)  # and which of the session's calls it is

    def add(self, ids: list[int], logprobs: list[float] | None = None, versions: list[int] | None = None):
        self.ids += ids
        self.mask += [0 if logprobs is None else 1] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.versions += versions if versions is not None else [0] * len(ids)


@dataclass
class Session:
    key: str
    group: AgentGroup
    index: int  # its place in the group
    attempt: int
    deadline: float
    lock: threading.Lock = field(default_factory=threading.Lock)  # one call at a time
    traces: list[Trace] = field(default_factory=list)
    context: list[int] = field(default_factory=list)  # the last call's prompt and completion
    messages: list[dict] | None = None  # the last chat call's messages and its reply
    tools: Any = None  # the last chat call's tools
    ended_with_eos: bool = False
    used: int = 0  # tokens added after the first call's prompt (the budget)
    finish: str = "stop"
    reward: float | None = None
    turn_rewards: list[float] | None = None  # one per call, if the agent gave them (GiGPO)
    reported: bool = False
    failed: str | None = None  # why this attempt failed
    done: bool = False  # ended (reward reported, or failed)
    calls: int = 0
    proc: subprocess.Popen | None = None

    @property
    def noise(self) -> int:
        return self.group.drawn.first_noise + self.index

    @property
    def trace(self) -> Trace:
        return self.traces[-1]


@dataclass
class AgentGroup:
    drawn: PlacedPrompt
    sessions: list[Session] = field(default_factory=list)
    lost: str | None = None  # why it cannot be trained: sent with `error`

    @property
    def complete(self) -> bool:
        return self.lost is not None or all(s.done and s.failed is None for s in self.sessions)


@dataclass
class Call:
    """A call on its way from a gateway thread to the engine and back."""

    session: Session
    prompt_ids: list[int]
    max_tokens: int
    stream: bool
    events: queue.Queue = field(default_factory=queue.Queue)  # ("tokens", ids), ("done", c), ("error", e)
    sent: int = 0


def _number(value: Any) -> bool:
    """A finite real number (NumPy's too), not a bool."""
    return (
        isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)) and math.isfinite(value)
    )


def parse_reward(value: Any) -> tuple[float, list[float] | None]:
    """A reward as an agent reports it: a number, or a map with `reward` (and, for GiGPO,
    `turn_rewards`: one number per call of the session)."""
    turns = value.get("turn_rewards") if isinstance(value, dict) else None
    reward = value.get("reward") if isinstance(value, dict) else value
    if not _number(reward):
        raise ValueError(f"a reward must be a finite number or {{'reward': number}}, got {reward!r}")
    if turns is not None and not (isinstance(turns, list) and all(_number(v) for v in turns)):
        raise ValueError(f"turn_rewards must be a list of finite numbers, one per call, got {turns!r}")
    return float(cast(float, reward)), None if turns is None else [float(v) for v in turns]


def normal_message(m: dict) -> dict:
    """What makes two messages the same turn: role, text, tool calls and their results."""
    calls = [
        (c.get("function", {}).get("name"), _arguments(c.get("function", {}).get("arguments")))
        for c in m.get("tool_calls") or []
        if isinstance(c, dict)
    ]
    return {
        "role": m.get("role"),
        "content": m.get("content") or "",
        "tool_calls": calls,
        "tool_call_id": m.get("tool_call_id"),
    }


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def session_fields(g: AgentGroup, decode: Callable[[list[int]], str], splits: int) -> tuple[dict, dict]:
    """The rollout's fields and arrays of a group: one completion per trace, each with
    its session's reward (`sessions` maps them when a session split). The group's
    prompt is what every trace starts with; the rest of a trace's first prompt is
    context, as its later calls' new tokens are."""
    rows = [(j, t) for j, s in enumerate(g.sessions) for t in s.traces] if g.lost is None else []
    if not rows:  # lost, or a session without a call: nothing to train
        rows = [(j, Trace([0])) for j in range(len(g.sessions))]
    traces = [t for _, t in rows]
    prompt = _common_prefix([t.prompt_ids for t in traces])
    heads = [t.prompt_ids[len(prompt) :] for t in traces]
    last = {j: t for j, t in rows}  # each session's last trace ends as the session did
    header: dict[str, Any] = {
        "texts": [decode([i for i, m in zip(t.ids, t.mask) if m]) for t in traces],
        "finish_reasons": [g.sessions[j].finish if last[j] is t else "stop" for j, t in rows],
        "turns": [t.turns for t in traces],
        "env_rewards": [g.sessions[j].reward for j, _ in rows],
        "agent_splits": splits,
    }
    if len(rows) != len(g.sessions):
        header["sessions"] = [j for j, _ in rows]
    if g.lost is None and all(s.turn_rewards is not None for s in g.sessions):
        header["turn_rewards"] = [
            rewards_per_run(
                [0] * len(h) + t.mask,
                [len(h) + at for at in t.call_starts],
                [cast(list, g.sessions[j].turn_rewards)[n] for n in t.call_numbers],
            )
            for (j, t), h in zip(rows, heads)
        ]
    if g.lost is not None:
        header["error"] = g.lost
    elif not all(any(t.mask) for t in traces):
        header["error"] = "a session ended before the model's first completion"
    elif not prompt:  # the learner would read a token the model never saw
        header["error"] = "the sessions' first prompts do not start with the same token"
    arrays: dict[str, np.ndarray] = {
        "prompt_ids": np.array(prompt or [0], dtype=np.int32),
        "completion_ids": np.array(sum((h + t.ids for h, t in zip(heads, traces)), []), dtype=np.int32),
        "completion_lens": np.array([len(h) + len(t.ids) for h, t in zip(heads, traces)], dtype=np.int32),
        "logprobs": np.array(
            sum(([0.0] * len(h) + t.logprobs for h, t in zip(heads, traces)), []), np.float32
        ),
        "loss_mask": np.array(sum(([0] * len(h) + t.mask for h, t in zip(heads, traces)), []), np.uint8),
        "policy_versions": np.array(
            sum(([_oldest(t)] * len(h) + _fill(t) for h, t in zip(heads, traces)), []), np.int32
        ),
    }
    if not arrays["completion_ids"].size:  # a group lost before any call: nothing sampled
        del arrays["policy_versions"]
    return header, arrays


def _oldest(t: Trace) -> int:
    return min((v for v, m in zip(t.versions, t.mask) if m), default=0)


def _fill(t: Trace) -> list[int]:
    """A trace's versions, its context tokens given its oldest sampled token's (the learner
    counts only sampled tokens' versions)."""
    oldest = _oldest(t)
    return [v if m else oldest for v, m in zip(t.versions, t.mask)]


def _common_prefix(seqs: list[list[int]]) -> list[int]:
    n = min(len(s) for s in seqs)
    first = seqs[0]
    for i in range(n):
        if any(s[i] != first[i] for s in seqs):
            return first[:i]
    return first[:n]


def turn_message(m: dict) -> dict:
    """A message as the rollout's `turns` carry it (tool calls kept)."""
    out = {"role": str(m.get("role")), "content": m.get("content") or ""}
    if m.get("tool_calls"):
        out["tool_calls"] = m["tool_calls"]
    return out

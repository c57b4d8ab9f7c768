"""Agent sessions: the user's own agent loop, trained through the served API.

An agent is the user's loop around an OpenAI client (`[agent]`): a Python function or a
program in any language. Each data row runs as G *sessions*, one group. A session is one
run of the agent with a base URL and an API key of its own (actor/gateway.py serves them);
its calls decode in the actor's continuous engine beside every other session's, and when
the agent ends it reports the session's reward.

Token-in, token-out. Every completion keeps the token ids it sampled, their behavior
logprobs and policy versions; nothing is decoded and encoded again. A chat call whose
messages are the session's last call's messages plus the reply it got, plus new ones, is
rendered as the last call's tokens (its prompt and its completion, as sampled) followed by
the chat template's tokens for the new messages: the model sees its own tokens, its KV
cache is continued, and the session stays one token sequence (one *trace*) whose model
tokens are trained and whose other tokens (template, tools, user) are context, masked out
of the loss. A call that does not continue the last one (the agent rewrote its history) is
rendered from its messages and starts a new trace of the session, with the session's
reward (`agent/splits` counts them).

A session that fails (its agent raises, exits non-zero, passes `agent.timeout_s`, or
never reports a reward) is started again whole with a new key, up to
`agent.max_attempts`; then its group is sent with `error` and the learner counts it as
dropped with the reason. Its old key answers 401 from then on.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import logging
import os
import queue
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any, cast

from actor.episodes import Renderer
from actor.rollout import PlacedPrompt
from actor.sessions import (
    KEY_PREFIX,
    AgentGroup,
    Call,
    CallRefused,
    Session,
    Trace,
    normal_message,
    parse_reward,
    session_fields,
    turn_message,
)
from policy.data import encode_prompt
from policy.engine import Engine
from policy.sampler import Completion
from rewards.functions import import_spec
from runtime.config import AgentConfig, SamplingConfig
from runtime.lifecycle import Lifeline, python_module

log = logging.getLogger("actor")

# A turn's noise differs from the last turn's: its seed is the run's plus this times the call.
CALL_SEED_STRIDE = 1_000_003
CALLS_PER_ATTEMPT = 1_000  # an attempt's calls draw apart from the attempt before
STARTED_OVER = "the actor started over: this session will start again, whole"  # a 503
NO_AGENT = "no agent to start (agent.function and agent.command unset, or the actor closed)"


class AgentError(ValueError):
    """The `[agent]` cannot be loaded or started."""


def load_agent_function(cfg: AgentConfig, search_path: str | None) -> Callable[..., Any]:
    spec = cast(str, cfg.function)
    _, name, fn = import_spec(spec, search_path, AgentError, "agent.function")
    if not callable(fn):
        raise AgentError(f"agent.function {spec!r}: the module has no function {name!r}")
    try:
        inspect.signature(fn).bind(row={}, base_url="", api_key="")
    except TypeError as e:
        raise AgentError(
            f"agent.function {spec!r} must take the keyword arguments row, base_url and api_key ({e})"
        ) from None
    except ValueError:
        pass  # no signature to read (a builtin): its first call will tell
    return fn


class AgentRunner:
    """Sessions of agent runs: started per group, their calls decoded in the actor's
    engine, their traces gathered into rollout groups."""

    def __init__(
        self,
        cfg: AgentConfig,
        search_path: str | None,
        engine: Engine,
        tokenizer: Any,
        eos_ids: set[int],
        sampling: SamplingConfig,
        context_limit: int | None,
    ) -> None:
        self.cfg, self.engine, self.tokenizer = cfg, engine, tokenizer
        self.sampling, self.eos_ids, self.context_limit = sampling, eos_ids, context_limit
        self.search_path = search_path
        self.function = load_agent_function(cfg, search_path) if cfg.function else None
        for name in ("httpx", "openai"):  # a Python agent's client: a log line per call otherwise
            logging.getLogger(name).setLevel(logging.WARNING)
        self.renderer = Renderer(tokenizer, eos_ids)
        self.lock = threading.Lock()  # the sessions' keys and ends, shared with gateway threads
        self.sessions: dict[str, Session] = {}  # live sessions by key
        self.groups: list[AgentGroup] = []  # in flight
        self.inbox: queue.Queue[Call] = queue.Queue()  # calls from the gateway
        self.decoding: dict[str, Call] = {}  # by session key
        self.base_url = ""  # set once the gateway listens
        self.lifeline = Lifeline() if cfg.command else None
        self.restarted: set[str | None] = set()  # keys of sessions the actor gave up to start over
        self.retries = 0
        self.splits = 0

    # -- the gateway's side (its threads) ---------------------------------------------

    def session(self, key: str | None) -> Session:
        """The live session of an API key; 401 for any other key."""
        with self.lock:
            s = self.sessions.get(key or "")
            if key in self.restarted:
                raise CallRefused(503, STARTED_OVER)
        if s is None or s.done:
            raise CallRefused(
                401, "unknown or expired API key: each session has its own key, valid while it runs"
            )
        return s

    def chat_prompt(self, s: Session, messages: list[dict], tools: list | None) -> list[int]:
        """A chat call's prompt: the session's last call's tokens and the template's for
        the new messages when it continues that call, else its messages rendered anew
        (a new trace). Under the session's lock."""
        normal = [normal_message(m) for m in messages]
        last = s.messages
        if last is not None and tools == s.tools and len(normal) > len(last) and normal[: len(last)] == last:
            try:
                ids = s.context + self.renderer.continuation(
                    messages[: len(last)], messages[len(last) :], s.ended_with_eos, tools
                )
                return ids
            except ValueError:
                pass  # the template renders this history otherwise: a new trace
        return encode_prompt(self.tokenizer, messages, tools)

    def submit(self, s: Session, prompt_ids: list[int], max_tokens: int | None, stream: bool) -> Call:
        """Check the call against the session's budget and the model's context, then hand
        it to the actor's loop. Nothing of the session changes until `record`: a call that
        fails leaves no trace."""
        if s.done:
            raise CallRefused(401, "the session has ended")
        if not s.traces and len(prompt_ids) > self.sampling.max_prompt_tokens:
            raise CallRefused(
                400,
                f"the session's first prompt is {len(prompt_ids)} tokens, over "
                f"sampling.max_prompt_tokens = {self.sampling.max_prompt_tokens}",
                "messages",
            )
        room = self.cfg.max_episode_tokens - s.used - self.added(s, prompt_ids)
        cap = min(max_tokens or self.sampling.max_tokens, self.sampling.max_tokens, max(room, 0))
        if self.context_limit is not None:
            cap = min(cap, self.context_limit - len(prompt_ids))
        call = Call(s, list(prompt_ids), cap, stream)
        if cap <= 0:  # the budget is spent: an empty reply, and the session's trace ends
            s.finish = "length"
            call.events.put(("done", Completion([], [], "length")))
            return call
        self.inbox.put(call)
        return call

    def added(self, s: Session, prompt_ids: list[int]) -> int:
        """What a call's prompt adds to the session's budget: the tokens after its last
        call's, or a new trace's whole prompt (a session's first prompt is free)."""
        if not s.traces:
            return 0
        return len(prompt_ids) - len(s.context) if self.continues(s, prompt_ids) else len(prompt_ids)

    @staticmethod
    def continues(s: Session, prompt_ids: list[int]) -> bool:
        return bool(s.traces) and prompt_ids[: len(s.context)] == s.context

    def record(
        self, call: Call, c: Completion, messages: list[dict] | None, reply: dict | None, tools
    ) -> None:
        """The call joins the session: its prompt's new tokens as context (or a new trace)
        and its completion (cut at its stop) as sampled. Under the session's lock, before
        the response goes out; a call that sampled nothing (the budget was spent) adds
        nothing."""
        s = call.session
        if not c.token_ids:
            return
        s.used += self.added(s, call.prompt_ids) + len(c.token_ids)
        if self.continues(s, call.prompt_ids):
            s.trace.add(call.prompt_ids[len(s.context) :])
        else:
            if s.traces:
                with self.lock:
                    self.splits += 1
            s.traces.append(Trace(list(call.prompt_ids)))
        t = s.trace
        t.call_starts.append(len(t.ids))
        t.call_numbers.append(s.calls)
        versions = c.versions or [0] * len(c.token_ids)
        t.add(c.token_ids, c.logprobs, versions[: len(c.token_ids)])
        s.messages = None  # a text call: the next continues it by its token ids alone
        if messages is not None and reply is not None:
            if t.calls == 0:
                t.first_messages = len(messages)
            t.turns = [turn_message(m) for m in messages[t.first_messages :]] + [turn_message(reply)]
            s.messages = [normal_message(m) for m in messages] + [normal_message(reply)]
            s.tools = tools
        t.calls += 1
        s.calls += 1
        s.context = call.prompt_ids + c.token_ids
        s.ended_with_eos = c.token_ids[-1] in self.eos_ids
        if c.finish_reason == "length" and s.used >= self.cfg.max_episode_tokens:
            s.finish = "length"

    def report(self, s: Session, value: Any) -> None:
        """A reward POSTed by the agent (`/v1/session/reward`)."""
        reward, turns = parse_reward(value)
        with self.lock:
            s.reward, s.turn_rewards, s.reported = reward, turns, True

    # -- the actor's side (its loop) ----------------------------------------------------

    def start_group(self, drawn: PlacedPrompt) -> None:
        group = AgentGroup(drawn)
        for j in range(self.sampling.group_size):
            group.sessions.append(self.new_session(group, j, 1))
        self.groups.append(group)
        for s in group.sessions:
            self.launch(s)

    def new_session(self, group: AgentGroup, index: int, attempt: int) -> Session:
        key = KEY_PREFIX + secrets.token_urlsafe(24)
        s = Session(key, group, index, attempt, time.monotonic() + self.cfg.timeout_s)
        with self.lock:
            self.sessions[key] = s
        return s

    def launch(self, s: Session) -> None:
        # A copy per session: an agent that appends to row["prompt"] changes only its own.
        row = copy.deepcopy({"prompt": s.group.drawn.prompt.prompt, **s.group.drawn.prompt.columns})
        if self.function is not None:
            threading.Thread(target=self.run_function, args=(s, row), name="agent", daemon=True).start()
        elif self.lifeline is not None:
            # The lifeline goes with the command: its program must die with the actor.
            args = (s, row, self.lifeline)
            threading.Thread(target=self.run_command, args=args, name="agent", daemon=True).start()
        else:  # none configured (its sessions are called from outside), or the runner closed
            self.end(s, NO_AGENT)

    def run_function(self, s: Session, row: dict) -> None:
        fn = cast(Callable[..., Any], self.function)
        try:
            result = fn(row=row, base_url=self.base_url, api_key=s.key)
            if inspect.isawaitable(result):
                result = asyncio.run(_awaited(result))
            if result is not None:
                self.report(s, result)
            self.end(s, None)
        except Exception as e:
            self.end(s, f"the agent raised {type(e).__name__}: {e}")

    def run_command(self, s: Session, row: dict, lifeline: Lifeline) -> None:
        env = {**os.environ, "OPENAI_BASE_URL": self.base_url, "OPENAI_API_KEY": s.key}
        try:
            # Its own process group, which the shim ends when we die (by any signal) and
            # we end when the session is over.
            proc = subprocess.Popen(
                [*python_module("actor.agent_shim", str(lifeline.read_fd), "--"), *self.cfg.command],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=self.search_path or None,
                env=env,
                pass_fds=(lifeline.read_fd,),
                start_new_session=True,
                text=True,
            )
        except OSError as e:
            self.end(s, f"agent.command cannot start: {e}")
            return
        s.proc = proc
        if s.done:  # it ended (timed out) while the program started
            _kill(proc)
        try:
            out, err = proc.communicate(json.dumps(row, allow_nan=False) + "\n")
        except (ValueError, OSError) as e:  # a row JSON cannot carry; a program gone
            _kill(proc)
            self.end(s, f"the row could not be given to the agent: {e}")
            return
        if proc.returncode != 0:
            tail = " | ".join(err.strip().splitlines()[-5:])
            self.end(s, f"the agent exited with code {proc.returncode}{': ' + tail if tail else ''}")
            return
        lines = [line for line in out.splitlines() if line.strip()]
        if not s.reported and lines:
            try:
                self.report(s, json.loads(lines[-1]))
            except ValueError:
                self.end(s, f"the agent's last line is no reward: {lines[-1][:200]!r}")
                return
        self.end(s, None)

    def end(self, s: Session, failure: str | None) -> None:
        with self.lock:
            if s.done:
                return
            if failure is None and not s.reported:
                failure = "the agent ended without reporting a reward"
            if failure is None and s.turn_rewards is not None and len(s.turn_rewards) != s.calls:
                failure = f"the agent gave {len(s.turn_rewards)} turn_rewards for its {s.calls} calls"
            s.failed, s.done = failure, True

    def fail_overdue(self) -> None:
        now = time.monotonic()
        for g in self.groups:
            for s in g.sessions:
                if not s.done and now > s.deadline:
                    self.end(s, f"the session passed agent.timeout_s = {self.cfg.timeout_s:g} s")
                    _kill(s.proc)

    def pump(self, version: int) -> list[AgentGroup]:
        """Take the calls that arrived, decode one step, answer the calls that ended;
        start failed sessions again; return the groups whose every session ended."""
        engine = self.engine
        while True:
            try:
                call = self.inbox.get_nowait()
            except queue.Empty:
                break
            s = call.session
            if s.done:
                restarted = s.key in self.restarted
                refused = (
                    CallRefused(503, STARTED_OVER) if restarted else CallRefused(401, "the session has ended")
                )
                call.events.put(("error", refused))
                continue
            if s.key in self.decoding:  # the gateway holds the session's lock: a bug if so
                call.events.put(("error", CallRefused(409, "a call of this session is still decoding")))
                continue
            # A session started again draws anew: a failure of the model's own doing would repeat.
            seed = self.sampling.seed + CALL_SEED_STRIDE * (s.calls + CALLS_PER_ATTEMPT * (s.attempt - 1))
            engine.add(s.key, call.prompt_ids, [s.noise], seed, keep=True, max_tokens=call.max_tokens)
            self.decoding[s.key] = call
        if engine.busy:
            for key, (c,) in engine.step(version):
                call = self.decoding.pop(cast(str, key))
                call.events.put(("done", c))
                if call.session.done:  # it ended while this call decoded: no cache to keep
                    engine.release(key)
            streaming = any(c.stream for c in self.decoding.values())
            for key, tokens in engine.tokens().items() if streaming else ():
                streamed = self.decoding.get(cast(str, key))
                if streamed is not None and streamed.stream and len(tokens) > streamed.sent:
                    streamed.events.put(("tokens", tokens[streamed.sent :]))
                    streamed.sent = len(tokens)
        self.fail_overdue()
        return self.collect()

    def collect(self) -> list[AgentGroup]:
        done = []
        for g in self.groups:
            for s in list(g.sessions):
                if s.done and s.failed is not None and g.lost is None:
                    self.retry(g, s)
            if g.complete:
                done.append(g)
        for g in done:
            self.groups.remove(g)
            for s in g.sessions:
                self.forget(s)
        return done

    def retry(self, g: AgentGroup, s: Session) -> None:
        self.forget(s)
        if s.attempt >= self.cfg.max_attempts:
            log.error(
                "session %d of data row %s: %s; %d attempts used, its group is dropped",
                s.index,
                g.drawn.prompt.index,
                s.failed,
                s.attempt,
            )
            g.lost = f"agent: {s.failed} ({s.attempt} attempts)"
            return
        log.warning(
            "session %d of data row %s: %s; starting it again", s.index, g.drawn.prompt.index, s.failed
        )
        self.retries += 1
        again = self.new_session(g, s.index, s.attempt + 1)
        g.sessions[s.index] = again
        self.launch(again)

    def forget(self, s: Session) -> None:
        """The session's key expires, and its kept KV cache goes."""
        with self.lock:
            s.done = True
            self.sessions.pop(s.key, None)
        self.engine.release(s.key)
        _kill(s.proc)

    def clear(self) -> None:
        """Forget every group in flight (the learner's data cursor moved): their sessions'
        keys expire, and their agents' calls fail from now on."""
        for g in self.groups:
            for s in g.sessions:
                self.forget(s)
                with self.lock:
                    self.restarted.add(s.key)
        self.groups.clear()
        for call in self.decoding.values():
            call.events.put(("error", CallRefused(503, STARTED_OVER)))
        self.decoding.clear()
        self.engine.clear()

    def close(self) -> None:
        self.clear()
        if self.lifeline is not None:
            self.lifeline.close()
            self.lifeline = None  # its descriptors' numbers may be reused: none to hand on

    @property
    def busy(self) -> bool:
        return bool(self.groups)

    def fields(self, g: AgentGroup, decode: Callable[[list[int]], str]) -> tuple[dict, dict]:
        """The rollout's fields and arrays of a finished (or lost) group."""
        return session_fields(g, decode, self.splits)


def _kill(proc: subprocess.Popen | None) -> None:
    """End an agent program and whatever it started (its process group)."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def _awaited(result: Any) -> Any:
    return await result

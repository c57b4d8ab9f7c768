"""The Python workers of a run's worker sockets (PROTOCOL.md): any program can do the same;
these are the Python ones.

- `orchestrator reward-worker module:function` serves a reward function on the reward
  socket. The function runs in a thread so the worker keeps beating while it scores (and
  says so in its hello).
- `orchestrator env-worker module:Class` serves an environment on the actor's env
  socket: one instance of the class per episode, `reset` and `step` called in turn.

Both follow PROTOCOL.md's conformance sections, plus what only a long-lived worker
needs: they attach again when the socket's owner restarts, and exit when it says stop or
has been unreachable for `owner_timeout_s` (protocol.connection: the connection's life).
"""

from __future__ import annotations

import collections
import inspect
import logging
import os
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import protocol
import transport
from protocol import sockets
from protocol.connection import HEARTBEAT_S, LEARNER_TIMEOUT_S, Link, State, heartbeat
from rewards.functions import RewardError, call_reward, import_spec, load_reward_function
from runtime import lifecycle, spans
from transport import Again

log = logging.getLogger("workers")


class SocketWorker:
    """What every worker does: attach, beat, reattach to a restarted owner, stop; and take
    the messages of `kinds` in arrival order, answering each request (`answer`, in a
    thread, so the worker beats meanwhile) before the next. A subclass gives `answer`,
    `reply` (how an answer is sent), `notice` (a message of `kinds` that is no request)
    and what to forget when the owner restarts (`forget`)."""

    role = ""
    owner = ""  # who binds the socket: "learner" or "actor"
    hello_fields: dict = {}
    kinds: tuple[str, ...] = ()  # the message kinds this worker takes
    requests: tuple[str, ...] = ()  # those answered by `answer`
    job: tuple[str, Future] | None = None  # (request id, answer) being worked out in a thread
    run_dir: Path | None = None  # attached with --run-dir: exit when that run has ended

    def __init__(
        self,
        endpoint: str,
        owner_timeout_s: float = LEARNER_TIMEOUT_S,
        signals: lifecycle.StopSignals | None = None,
        keys: Path | None = None,
    ) -> None:
        """`keys`: the CURVE key directory for a TCP endpoint (transport.keys)."""
        self.endpoint = endpoint
        self.signals = signals or lifecycle.StopSignals()
        self.net = transport.default()
        self.sock, self.watch = sockets.connect(self.net, endpoint, keys)
        where = f"{self.owner} on {endpoint}"
        self.link = Link(self.watch, self.owner, log, owner_timeout_s, where=where)
        self.instance: str | None = None  # the owner we are attached to
        self.last_beat = 0.0
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self.role)
        self.inbox: collections.deque[protocol.Message] = collections.deque()  # in arrival order

    def send(self, kind: str, header: dict | None = None) -> None:
        """Send, or drop the message when it cannot go now: never wait on a connection that
        is gone for good (a refused key), which the loop's watch then reports."""
        try:
            self.sock.send(protocol.encode(kind, header), wait=False)
        except Again:
            log.debug("dropped a %s: no connection to the %s", kind, self.owner)

    def attach(self) -> None:
        self.link.saying_hello()
        self.send(protocol.HELLO, {"role": self.role, "pid": os.getpid(), **self.hello_fields})
        self.send(protocol.READY)

    def run(self) -> int:
        """Serve until told to stop; returns the exit code."""
        self.link.run_dir = self.run_dir  # the command line sets it after __init__
        self.attach()
        while True:
            if self.signals.requested:
                # Tell the owner at once, so what we hold goes to another worker now.
                self.send(protocol.STOP, {"reason": f"{self.role} stopped by {self.signals.name}"})
                return self.signals.exit_code()
            state = self.link.check()
            if state is State.REFUSED:
                return lifecycle.EXIT_USER_ERROR
            if state is State.STOPPED:  # the run has ended
                return lifecycle.EXIT_OK
            if state is State.LOST:
                return lifecycle.EXIT_CRASH
            # While a job runs, wait on it rather than on the socket: its reply goes out at once.
            for incoming in sockets.incoming(self.sock, 0 if self.job is not None else 50):
                reason = self.handle(incoming)
                if reason is not None:
                    log.info("stopping: %s", reason)
                    return lifecycle.EXIT_OK
            if self.job is not None:
                wait([self.job[1]], timeout=0.05)
            self.work()
            self.beat()

    def handle(self, incoming: sockets.Incoming) -> str | None:
        """Act on one message; return the stop reason when told to stop."""
        msg = incoming.msg
        if msg is None:
            log.error("dropped a malformed message: %s", incoming.error)
            return None
        if msg.kind == protocol.STOP:
            if self.link.take(msg) is State.AWAY:
                # The owner is being restarted (or its run resumed): what we hold is its
                # predecessor's; the new one greets us with `attached: false`.
                self.forget()
                return None
            return msg["reason"]
        if msg.kind == protocol.HELLO:
            if self.link.take(msg) is State.STRANGER:
                # An owner that does not know us (restarted): what we hold belongs to the
                # old one, which will never read the answer.
                log.info(
                    "the %s restarted (instance %s -> %s); attaching again",
                    self.owner,
                    self.instance,
                    msg.header.get("instance"),
                )
                self.forget()
                self.attach()
            self.instance = msg.header.get("instance")
        else:
            self.take(msg)
        return None

    def take(self, msg: protocol.Message) -> None:
        if msg.kind in self.kinds:  # other kinds (heartbeats) need nothing
            self.inbox.append(msg)

    def work(self) -> None:
        """Send a finished answer; then take the next messages in order, up to a request."""
        if self.job is not None and self.job[1].done():
            (request_id, result), self.job = self.job, None
            self.reply(request_id, result.result())  # answer() turns every failure into a reply
        while self.job is None and self.inbox:
            msg = self.inbox.popleft()
            if msg.kind in self.requests:
                self.job = (msg["request_id"], self.pool.submit(self.timed_answer, msg))
            else:
                self.notice(msg)

    def timed_answer(self, msg: protocol.Message) -> dict:
        with spans.span(msg.kind, request=msg["request_id"]):
            return self.answer(msg)

    def answer(self, msg: protocol.Message) -> dict:
        """A request's answer (in the worker's thread); never raises."""
        raise NotImplementedError

    def reply(self, request_id: str, answer: dict) -> None:
        raise NotImplementedError

    def notice(self, msg: protocol.Message) -> None:
        """A message of `kinds` that asks for no answer."""

    def forget(self) -> None:
        """Drop what belonged to the owner before its restart."""
        self.inbox.clear()
        self.job = None

    def beat(self) -> None:
        if time.monotonic() - self.last_beat >= HEARTBEAT_S:
            self.last_beat = time.monotonic()
            self.send(protocol.HEARTBEAT, heartbeat(self.role))

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.watch.close()
        self.sock.close()
        self.net.close()


class RewardWorker(SocketWorker):
    role = "reward_worker"
    owner = "learner"
    hello_fields = {"beats_while_working": True}
    kinds = requests = (protocol.SCORE,)

    def __init__(
        self,
        spec: str,
        endpoint: str,
        search_path: str | None = None,
        owner_timeout_s: float = LEARNER_TIMEOUT_S,
        signals: lifecycle.StopSignals | None = None,
        keys: Path | None = None,
    ) -> None:
        self.spec = spec
        self.fn = load_reward_function(spec, search_path)
        super().__init__(endpoint, owner_timeout_s, signals, keys)

    def run(self) -> int:
        log.info("serving %s on %s", self.spec, self.endpoint)
        return super().run()

    def answer(self, msg: protocol.Message) -> dict:
        inputs = {
            "prompts": msg["prompts"],
            "completions": msg["completions"],
            "completion_ids": msg["completion_ids"],
            **msg["columns"],
        }
        try:
            return {"rewards": call_reward(self.fn, inputs, self.spec)}
        except RewardError as e:
            # The learner ends the run on it, as for an in-process function that raises.
            log.error("%s", e)
            return {"rewards": [], "error": str(e)}

    def reply(self, request_id: str, answer: dict) -> None:
        self.send(protocol.SCORE_REPLY, {"request_id": request_id, **answer})


class EnvError(RuntimeError):
    """An environment class that cannot be loaded."""


def load_env_class(spec: str, search_path: str | None = None) -> type:
    """Import `module:Class`, looking in `search_path` (the config's directory) first."""
    module_name, name, cls = import_spec(spec, search_path, EnvError, "environment")
    if not (
        inspect.isclass(cls)
        and callable(getattr(cls, "reset", None))
        and callable(getattr(cls, "step", None))
    ):
        raise EnvError(
            f"environment {spec!r}: {module_name} has no class {name!r} with reset and step methods"
        )
    return cls


def observation_reply(result: object) -> dict:
    """An `observation` reply's fields from what `reset` or `step` returned: a string (the
    observation), a tuple (observation, reward, done) or a dict of the reply's fields."""
    if isinstance(result, str):
        return {"observation": result, "done": False}
    if isinstance(result, tuple) and len(result) == 3:
        observation, reward, done = result
        return {"observation": observation, "reward": reward, "done": bool(done)}
    if isinstance(result, dict) and isinstance(result.get("observation"), str):
        return {**result, "done": bool(result.get("done", False))}
    raise TypeError(
        f"must return a string, an (observation, reward, done) tuple or a dict with "
        f"'observation', got {type(result).__name__}"
    )


class EnvWorker(SocketWorker):
    """One environment instance per episode, from `make_env()` (a class, or the OpenEnv
    adapter): `reset(prompt, **columns)` gives the first observation and `step(action)`
    (or `step(action, action_ids)` when its signature takes them) the next, until the
    actor ends the episode (`end`); then `close()`, if the instance has one. An exception
    in the environment is the episode's `error`, never the worker's end."""

    role = "env_worker"
    owner = "actor"
    hello_fields = {"beats_while_working": True}
    kinds = (protocol.END, protocol.RESET, protocol.STEP)
    requests = (protocol.RESET, protocol.STEP)

    def __init__(
        self,
        make_env: Callable[[], Any],
        name: str,
        endpoint: str,
        owner_timeout_s: float = LEARNER_TIMEOUT_S,
        signals: lifecycle.StopSignals | None = None,
        keys: Path | None = None,
    ) -> None:
        self.make_env, self.name = make_env, name
        super().__init__(endpoint, owner_timeout_s, signals, keys)
        # The environment runs in the worker's thread, so it keeps beating meanwhile: a
        # worker that dies in the middle of a long step is noticed in seconds.
        self.episodes: dict[str, Any] = {}

    def run(self) -> int:
        log.info("serving %s on %s", self.name, self.endpoint)
        return super().run()

    def notice(self, msg: protocol.Message) -> None:  # `end`
        self.drop(msg["episode_id"])

    def reply(self, request_id: str, answer: dict) -> None:
        try:
            self.send(protocol.OBSERVATION, {"request_id": request_id, **answer})
        except (TypeError, ValueError) as e:  # e.g. an `info` msgpack cannot carry
            self.send(
                protocol.OBSERVATION,
                {
                    "request_id": request_id,
                    "observation": "",
                    "done": True,
                    "error": f"unsendable reply: {e}",
                },
            )

    def answer(self, msg: protocol.Message) -> dict:
        episode_id = msg["episode_id"]
        try:
            if msg.kind == protocol.RESET:
                self.drop(episode_id)
                env = self.episodes[episode_id] = self.make_env()
                reply = observation_reply(env.reset(msg["prompt"], **msg["columns"]))
            elif episode_id not in self.episodes:
                return {"observation": "", "done": True, "error": f"no episode {episode_id!r} here"}
            else:
                env = self.episodes[episode_id]
                with_ids = "action_ids" in inspect.signature(env.step).parameters
                args = (msg["action"], msg["action_ids"]) if with_ids else (msg["action"],)
                reply = observation_reply(env.step(*args))
        except Exception as e:
            log.error("episode %s: %s", episode_id, traceback.format_exc(limit=3))
            self.drop(episode_id)
            return {"observation": "", "done": True, "error": f"{self.name} raised {type(e).__name__}: {e}"}
        if reply["done"]:
            self.drop(episode_id)
        return reply

    def drop(self, episode_id: str) -> None:
        env = self.episodes.pop(episode_id, None)
        close = getattr(env, "close", None)
        if callable(close):
            try:
                close()
            except Exception as e:  # the episode is over either way
                log.warning("episode %s: close() raised %s: %s", episode_id, type(e).__name__, e)

    def forget(self) -> None:
        self.inbox.clear()
        if self.job is not None:
            self.job[1].result()  # let the running step finish before its episode goes
            self.job = None
        for episode_id in list(self.episodes):
            self.drop(episode_id)

    def close(self) -> None:
        if self.job is None:
            self.forget()
        super().close()


def serve(worker: SocketWorker) -> int:
    """Serve until told to stop; returns the exit code."""
    try:
        return worker.run()
    finally:
        worker.close()

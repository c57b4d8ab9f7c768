"""`orchestrator reward-worker module:function`: serve a Python reward function on a run's
reward socket. Any program can do the same from PROTOCOL.md; this is the Python one.

It follows PROTOCOL.md's conformance section, plus what only a long-lived worker needs:
the function runs in a thread so the worker keeps beating while it scores (and says so
in its hello), it attaches again when the learner restarts, and it exits when the
learner says stop or has been unreachable for `learner_timeout_s`.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor

import zmq

import protocol
from protocol import lifecycle, sockets
from rewards.functions import RewardError, call_reward, load_reward_function

log = logging.getLogger("reward_worker")


class RewardWorker:
    def __init__(self, spec: str, endpoint: str, search_path: str | None = None,
                 learner_timeout_s: float = lifecycle.LEARNER_TIMEOUT_S,
                 signals: lifecycle.StopSignals | None = None) -> None:
        self.spec = spec
        self.fn = load_reward_function(spec, search_path)
        self.endpoint = endpoint
        self.learner_timeout_s = learner_timeout_s
        self.signals = signals or lifecycle.StopSignals()
        self.ctx = zmq.Context()
        self.sock, self.watch = sockets.connect(self.ctx, endpoint)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")
        self.instance: str | None = None  # the learner we are attached to
        self.requests: collections.deque[protocol.Message] = collections.deque()
        self.job: tuple[str, Future] | None = None  # (request id, result) being scored
        self.last_beat = 0.0

    def send(self, kind: str, header: dict | None = None) -> None:
        self.sock.send_multipart(protocol.encode(kind, header))

    def attach(self) -> None:
        self.send(protocol.HELLO, {"role": "reward_worker", "pid": os.getpid(), "beats_while_scoring": True})
        self.send(protocol.READY)

    def run(self) -> int:
        """Serve until told to stop; returns the exit code."""
        log.info("serving %s on %s", self.spec, self.endpoint)
        self.attach()
        while True:
            if self.signals.requested:
                # Tell the learner at once, so what we hold goes to another worker now.
                self.send(protocol.STOP, {"reason": f"reward worker stopped by {self.signals.name}"})
                return lifecycle.signal_exit_code(self.signals.signum)
            for incoming in sockets.incoming(self.sock, 50):
                reason = self.handle(incoming)
                if reason is not None:
                    log.info("stopping: %s", reason)
                    return lifecycle.EXIT_OK
            self.finish_job()
            self.start_job()
            self.beat()
            down = self.watch.down_for()
            if down > self.learner_timeout_s:
                log.error("no learner on %s for %.0f s; it is gone, stopping", self.endpoint, down)
                return lifecycle.EXIT_CRASH

    def handle(self, incoming: sockets.Incoming) -> str | None:
        """Act on one message; return the stop reason when told to stop."""
        msg = incoming.msg
        if msg is None:
            log.error("dropped a malformed message: %s", incoming.error)
            return None
        if msg.kind == protocol.STOP:
            return msg["reason"]
        if msg.kind == protocol.HELLO:
            if msg.header.get("attached") is False:
                # A learner that does not know us (restarted from its checkpoint): what we
                # hold belongs to the old one, which will never read the answer.
                log.info("the learner restarted (instance %s -> %s); attaching again",
                         self.instance, msg.header.get("instance"))
                self.requests.clear()
                self.job = None
                self.attach()
            self.instance = msg.header.get("instance")
        elif msg.kind == protocol.SCORE:
            self.requests.append(msg)
        return None  # heartbeats and other kinds need no answer

    def start_job(self) -> None:
        if self.job is None and self.requests:
            msg = self.requests.popleft()
            inputs = {"prompts": msg["prompts"], "completions": msg["completions"],
                      "completion_ids": msg["completion_ids"], **msg["columns"]}
            result = self.pool.submit(call_reward, self.fn, inputs, self.spec)
            self.job = (msg["request_id"], result)

    def finish_job(self) -> None:
        if self.job is None or not self.job[1].done():
            return
        request_id, result = self.job
        self.job = None
        try:
            reply = {"request_id": request_id, "rewards": result.result()}
        except RewardError as e:
            # The learner ends the run on it, as for an in-process function that raises.
            log.error("%s", e)
            reply = {"request_id": request_id, "rewards": [], "error": str(e)}
        self.send(protocol.SCORE_REPLY, reply)

    def beat(self) -> None:
        if time.monotonic() - self.last_beat >= lifecycle.HEARTBEAT_S:
            self.last_beat = time.monotonic()
            self.send(protocol.HEARTBEAT, {"role": "reward_worker", "time": time.time()})

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.watch.close()
        self.sock.close()
        self.ctx.term()


def serve(spec: str, endpoint: str, search_path: str | None = None,
          learner_timeout_s: float = lifecycle.LEARNER_TIMEOUT_S,
          signals: lifecycle.StopSignals | None = None) -> int:
    """Serve `spec` on `endpoint` until told to stop; returns the exit code."""
    worker = RewardWorker(spec, endpoint, search_path, learner_timeout_s, signals)
    try:
        return worker.run()
    finally:
        worker.close()

"""`orchestrator reward-worker module:function`: serve a Python reward function on a run's
reward socket. Any program can do the same from PROTOCOL.md; this is the Python one."""

from __future__ import annotations

import logging
import os

import zmq

import protocol
from rewards.functions import RewardError, call_reward, load_reward_function

log = logging.getLogger("reward_worker")


def serve(spec: str, endpoint: str, search_path: str | None = None, max_requests: int | None = None) -> int:
    """Connect, say hello and ready, then answer score requests until told to stop.
    Returns how many requests were answered."""
    fn = load_reward_function(spec, search_path)
    name = spec.partition(":")[2]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(endpoint)
    sock.send_multipart(protocol.encode(protocol.HELLO, {"role": "reward_worker", "pid": os.getpid()}))
    sock.send_multipart(protocol.encode(protocol.READY))
    log.info("serving %s on %s", spec, endpoint)
    answered = 0
    try:
        while max_requests is None or answered < max_requests:
            try:
                msg = protocol.decode(sock.recv_multipart())
            except protocol.ProtocolError as e:
                log.error("dropped a malformed message: %s", e)
                continue
            if msg.kind == protocol.STOP:
                log.info("stopping: %s", msg["reason"])
                break
            if msg.kind != protocol.SCORE:
                continue
            inputs = {"prompts": msg["prompts"], "completions": msg["completions"],
                      "completion_ids": msg["completion_ids"], **msg["columns"]}
            try:
                rewards = call_reward(fn, inputs, name)
            except RewardError as e:
                # Send nothing usable: the learner retries elsewhere and, past its attempt
                # limit, drops the group with this reason in its log.
                log.error("%s", e)
                rewards = []
            sock.send_multipart(protocol.encode(
                protocol.SCORE_REPLY, {"request_id": msg["request_id"], "rewards": rewards}))
            answered += 1
    finally:
        sock.close()
        ctx.term()
    return answered

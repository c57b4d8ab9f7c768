"""A minimal environment worker, written from PROTOCOL.md's "The env socket" section alone.

The environment: reset stores columns["target"] (one character); each step's reward is the share of the
action's characters equal to it, divided by 3; the episode is done after the third step. Otherwise the
observation asks for more: "\\nrepeat " + target.
Usage: python env_worker.py ENDPOINT | --run-dir DIR  (DIR/endpoints.json's "env" address)
           [--step-delay SECONDS] [--record FILE] [--leave-after N | --die-after N]
--leave-after N: answer N requests, then send stop instead of answering the next, and exit.
--die-after N: answer N requests, then SIGKILL itself on receiving the next.
"""

import argparse
import json
import os
import signal
import sys
import time

import msgpack
import zmq

TURNS = 3


class Episode:
    def __init__(self, target):
        self.target = target
        self.turns = 0


def new_episode(columns):
    target = columns["target"] if isinstance(columns, dict) else None
    if not isinstance(target, str) or len(target) != 1:
        raise ValueError(f"column 'target' must be a one-character string, got {target!r}")
    return Episode(target)


def advance(episode, action):
    """One step: (observation, done, reward)."""
    if not isinstance(action, str):
        raise ValueError(f"action must be a string, got {type(action).__name__}")
    reward = sum(c == episode.target for c in action) / max(len(action), 1) / TURNS
    episode.turns += 1
    if episode.turns >= TURNS:
        return "", True, reward
    return "\nrepeat " + episode.target, False, reward


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("endpoint", nargs="?")
    parser.add_argument("--run-dir")
    parser.add_argument("--step-delay", type=float, default=0.0, metavar="SECONDS")
    parser.add_argument("--record", metavar="FILE")
    parser.add_argument("--leave-after", type=int, metavar="N")
    parser.add_argument("--die-after", type=int, metavar="N")
    args = parser.parse_args(argv)
    if (args.endpoint is None) == (args.run_dir is None):
        parser.error("give exactly one of ENDPOINT and --run-dir")
    if args.run_dir is not None:
        with open(os.path.join(args.run_dir, "endpoints.json")) as f:
            args.endpoint = json.load(f)["env"]
    return args


def main(argv):
    args = parse_args(argv)
    record = open(args.record, "a") if args.record else None  # closed in the finally below
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)  # so a last stop still goes out on close
    sock.connect(args.endpoint)
    last_sent = 0.0
    answered = 0
    episodes = {}
    leaving = "env worker interrupted"

    def send(kind, **fields):
        nonlocal last_sent
        sock.send_multipart([msgpack.packb({"protocol": 1, "kind": kind, "arrays": [], **fields})])
        last_sent = time.monotonic()

    def attach():
        send("hello", role="env_worker", pid=os.getpid())
        send("ready")

    def on_sigterm(signum, frame):
        nonlocal leaving
        leaving = "env worker stopped by SIGTERM"
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)  # SIGTERM behaves like Ctrl-C
    try:
        attach()
        while True:
            if time.monotonic() - last_sent >= 1.0:
                send("heartbeat", role="env_worker", time=time.time())
            if not sock.poll(max(0, int((last_sent + 1.0 - time.monotonic()) * 1000))):
                continue
            try:
                msg = msgpack.unpackb(sock.recv_multipart()[0])
            except Exception:
                continue
            if not (isinstance(msg, dict) and type(msg.get("protocol")) is int and msg["protocol"] == 1):
                continue
            kind = msg.get("kind")
            if not isinstance(kind, str):
                continue
            if kind in ("reset", "step"):
                request_id, episode_id = msg.get("request_id"), msg.get("episode_id")
                if not (isinstance(request_id, str) and isinstance(episode_id, str)):
                    print(f"dropped a malformed {kind}: request_id/episode_id not strings", file=sys.stderr)
                    continue
                if answered == args.die_after:
                    os.kill(os.getpid(), signal.SIGKILL)
                if answered == args.leave_after:
                    send("stop", reason=f"leaving after {answered} requests")
                    print("left", flush=True)
                    return
                answered += 1
                if kind == "reset":
                    try:
                        episodes[episode_id] = new_episode(msg.get("columns"))
                        send("observation", request_id=request_id, observation="", done=False)
                    except Exception as e:
                        episodes.pop(episode_id, None)
                        send("observation", request_id=request_id, observation="", done=True, error=repr(e))
                else:
                    if record is not None:
                        line = {
                            "episode_id": episode_id,
                            "action": msg.get("action"),
                            "action_ids": msg.get("action_ids"),
                        }
                        record.write(json.dumps(line, default=repr) + "\n")
                        record.flush()
                    if args.step_delay > 0:
                        time.sleep(args.step_delay)  # silent while working: beats_while_working not promised
                    try:
                        if episode_id not in episodes:
                            raise KeyError(f"unknown episode {episode_id!r}")
                        observation, done, reward = advance(episodes[episode_id], msg.get("action"))
                        send(
                            "observation",
                            request_id=request_id,
                            observation=observation,
                            done=done,
                            reward=reward,
                        )
                    except Exception as e:
                        send("observation", request_id=request_id, observation="", done=True, error=repr(e))
                print(f"{kind} {episode_id}", flush=True)
            elif kind == "end":
                if isinstance(msg.get("episode_id"), str):
                    episodes.pop(msg["episode_id"], None)
            elif kind == "hello" and msg.get("attached") is False:
                episodes.clear()
                attach()
                print("reattached", flush=True)
            elif kind == "stop":
                if msg.get("final") is False:  # the actor goes away; a new one will greet us
                    episodes.clear()
                    print(f"waiting: {msg.get('reason')}", flush=True)
                    continue
                print(f"stopped: {msg.get('reason')}", flush=True)
                return
    except KeyboardInterrupt:
        send("stop", reason=leaving)
    finally:
        sock.close()
        ctx.term()
        if record is not None:
            record.close()


if __name__ == "__main__":
    main(sys.argv[1:])

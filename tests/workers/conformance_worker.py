"""A minimal reward worker, written from PROTOCOL.md's "Conformance: a minimal worker" section alone.

Reward of completion i: occurrences of columns["target"][i] in its text, per character.
Usage: python conformance_worker.py ENDPOINT | --run-dir DIR  (DIR/endpoints.json's "reward" address)
"""

import json
import os
import signal
import sys
import time

import msgpack
import zmq


def reward(completion, target):
    text = completion[0]["content"] if isinstance(completion, list) else completion
    return text.count(target) / max(len(text), 1)


def main(argv):
    if len(argv) == 2 and argv[0] == "--run-dir":
        with open(os.path.join(argv[1], "endpoints.json")) as f:
            endpoint = json.load(f)["reward"]
    elif len(argv) == 1:
        endpoint = argv[0]
    else:
        sys.exit(__doc__)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)  # so a last stop still goes out on close
    sock.connect(endpoint)
    last_sent = 0.0

    def send(kind, **fields):
        nonlocal last_sent
        sock.send_multipart([msgpack.packb({"protocol": 1, "kind": kind, "arrays": [], **fields})])
        last_sent = time.monotonic()

    def attach():
        send("hello", role="reward_worker", pid=os.getpid())
        send("ready")

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM behaves like Ctrl-C
    try:
        attach()
        while True:
            if time.monotonic() - last_sent >= 1.0:
                send("heartbeat", role="reward_worker", time=time.time())
            if not sock.poll(max(0, int((last_sent + 1.0 - time.monotonic()) * 1000))):
                continue
            try:
                msg = msgpack.unpackb(sock.recv_multipart()[0])
            except Exception:
                continue
            if not (isinstance(msg, dict) and type(msg.get("protocol")) is int and msg["protocol"] == 1):
                continue
            kind = msg.get("kind")
            if kind == "score":
                try:
                    pairs = zip(msg["completions"], msg["columns"]["target"], strict=True)
                    rewards = [reward(c, t) for c, t in pairs]
                    send("score_reply", request_id=msg["request_id"], rewards=rewards)
                except Exception as e:
                    send("score_reply", request_id=msg.get("request_id"), rewards=[], error=repr(e))
                print(f"scored {msg.get('request_id')}", flush=True)
            elif kind == "hello" and msg.get("attached") is False:
                attach()
                print("reattached", flush=True)
            elif kind == "stop":
                print(f"stopped: {msg.get('reason')}", flush=True)
                return
    except KeyboardInterrupt:
        send("stop", reason="reward worker interrupted")
    finally:
        sock.close()
        ctx.term()


if __name__ == "__main__":
    main(sys.argv[1:])

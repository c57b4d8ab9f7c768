"""A reward worker with faults to order, written from PROTOCOL.md: pyzmq and msgpack only.

usage: python plain_worker.py ENDPOINT [--garbage N] [--hang-after N]
Scores "fraction of the completion's characters equal to the target column" (the tiny
task). --garbage N: answer the first N requests with broken replies of several kinds.
--hang-after N: after N answers, take the next request and never answer it (still
beating: alive but stuck). Prints `holding request ID` and `scored ID` lines.
"""

import os
import sys
import time

import msgpack
import zmq


def header(kind, **fields):
    return msgpack.packb({"protocol": 1, "kind": kind, "arrays": [], **fields})


def main():
    endpoint = sys.argv[1]
    garbage = int(sys.argv[sys.argv.index("--garbage") + 1]) if "--garbage" in sys.argv else 0
    hang = int(sys.argv[sys.argv.index("--hang-after") + 1]) if "--hang-after" in sys.argv else -1
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    # Scoring takes microseconds and the loop beats between messages: it beats while scoring.
    hello = header("hello", role="reward_worker", pid=os.getpid(), beats_while_scoring=True)
    sock.send_multipart([hello])
    sock.send_multipart([header("ready")])
    answered, last_beat = 0, 0.0
    while True:
        if time.monotonic() - last_beat >= 1.0:
            sock.send_multipart([header("heartbeat", role="reward_worker", time=time.time())])
            last_beat = time.monotonic()
        if not sock.poll(200):
            continue
        msg = msgpack.unpackb(sock.recv_multipart()[0])
        if msg.get("kind") == "stop":
            break
        if msg.get("kind") == "hello" and msg.get("attached") is False:
            sock.send_multipart([hello])  # a restarted learner that does not know us
            sock.send_multipart([header("ready")])
        if msg.get("kind") != "score":
            continue
        if answered == hang:
            print("holding request", msg["request_id"], flush=True)
            answered += 1
            continue
        texts = msg["completions"]
        rewards = [t.count(c) / max(len(t), 1) for t, c in zip(texts, msg["columns"]["target"])]
        rid = msg["request_id"]
        broken = [
            [b"\xc1\xc1 not msgpack"],
            [header("score_reply", request_id="no-such-request", rewards=rewards)],
            [header("score_reply", request_id=rid, rewards=rewards[:-1])],
            [header("score_reply", request_id=rid, rewards=["high"] * len(rewards))],
        ]
        if answered < garbage:
            sock.send_multipart(broken[answered % len(broken)])
        else:
            sock.send_multipart(
                [
                    header(
                        "score_reply",
                        request_id=rid,
                        rewards=rewards,
                        rewards_by_function={"digits": rewards},
                    )
                ]
            )
            print("scored", rid, flush=True)
        answered += 1
    sock.close()
    ctx.term()


if __name__ == "__main__":
    main()

"""A reward worker written from PROTOCOL.md alone: pyzmq and msgpack, nothing of ours.

usage: python plain_worker.py ENDPOINT [--garbage N] [--hang-after N]
Scores "fraction of the completion's characters equal to the target column" (the tiny
task). --garbage N: answer the first N requests with broken replies of several kinds.
--hang-after N: after N answers, take the next request and never answer it.
"""

import os
import sys

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
    sock.send_multipart([header("hello", role="reward_worker", pid=os.getpid())])
    sock.send_multipart([header("ready")])
    answered = 0
    while True:
        frames = sock.recv_multipart()
        msg = msgpack.unpackb(frames[0])
        if msg.get("kind") == "stop":
            break
        if msg.get("kind") != "score":
            continue
        if answered == hang:
            print("holding request", msg["request_id"], flush=True)
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
            sock.send_multipart([header("score_reply", request_id=rid, rewards=rewards,
                                        rewards_by_function={"digits": rewards})])
        answered += 1
    sock.close()
    ctx.term()


if __name__ == "__main__":
    main()

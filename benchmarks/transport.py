"""Row 4: rollout messages and weight messages through real ZeroMQ sockets between processes.

Two OS processes, wired like a run: the peer (`python -m benchmarks.transport --endpoint
E`) binds a ROUTER as the learner does, and the benchmark process connects a DEALER as the
actor does, over an ipc:// socket in a private temporary directory.

- Rollouts travel DEALER -> ROUTER: the sender encodes each message with
  `protocol.encode`, the peer decodes each with `protocol.decode`. The clock runs from
  the first encode until the peer confirms it decoded the last one (messages on one
  connection arrive in order), so the rate is the pipelined throughput.
- Weights travel ROUTER -> DEALER, learner to actor: the peer encodes a `weights` message
  and sends it, the benchmark process receives and decodes it and answers with a
  one-frame ack. The peer times encode + send + receive + decode + the ack's way back, so
  the figure slightly overstates one way (the ack round trip is measured too, as `ping`).

Control messages (start, stop, counts) are one b"ctl" frame plus a msgpack map, never
protocol messages, so they cannot be mistaken for payload.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import msgpack
import numpy as np
import zmq

import protocol
from benchmarks.common import ROOT, log, median
from runtime.lifecycle import child_env

CTL = b"ctl"


# -- the peer process (learner side) --------------------------------------------------


def serve(endpoint: str) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    received, nbytes = 0, 0
    while True:
        identity, *frames = (f.buffer for f in sock.recv_multipart(copy=False))
        identity = bytes(identity)
        if bytes(frames[0]) != CTL:
            protocol.decode(frames)  # payload: validate and unpack, as the learner does
            received += 1
            nbytes += sum(len(f) for f in frames)
            continue
        cmd = msgpack.unpackb(bytes(frames[1]))
        if cmd["cmd"] == "count":
            sock.send_multipart([identity, CTL, msgpack.packb({"received": received, "bytes": nbytes})])
            received, nbytes = 0, 0
        elif cmd["cmd"] == "ping":
            sock.send_multipart([identity, CTL, b""])
        elif cmd["cmd"] == "weights":
            times = _send_weights(sock, identity, cmd["shapes"], cmd["reps"])
            sock.send_multipart([identity, CTL, msgpack.packb({"times": times})])
        elif cmd["cmd"] == "exit":
            break
    sock.close(linger=0)
    ctx.term()


def _send_weights(sock: zmq.Socket, identity: bytes, shapes: dict, reps: int) -> list[float]:
    """Send `reps` weights messages (plus one warm-up), each timed until its ack is back."""
    rng = np.random.default_rng(0)
    arrays = {name: rng.standard_normal(shape, dtype=np.float32) for name, shape in shapes.items()}
    times = []
    for version in range(reps + 1):
        t0 = time.perf_counter()
        frames = protocol.encode(protocol.WEIGHTS, {"version": version}, arrays)
        # copy=False as the learner sends them: zmq takes the buffers without copying.
        sock.send_multipart([identity, *frames], copy=False)
        sock.recv_multipart()  # the ack
        if version > 0:
            times.append(time.perf_counter() - t0)
    return times


# -- the benchmark side (actor side) --------------------------------------------------


@dataclass
class TransportResult:
    rollout_messages: int
    rollout_message_bytes: int
    rollout_msgs_per_s: float
    rollout_mb_per_s: float
    ping_ms: float  # round trip of a tiny message: what the weight timings include extra
    weights: dict = field(default_factory=dict)  # label -> weight sync numbers


def rollout_message(group_size: int, tokens: int, rng: np.random.Generator) -> tuple[dict, dict]:
    """(header, arrays) of one rollout shaped like the tiny default's: G completions of
    `tokens` tokens each."""
    lens = np.full(group_size, tokens, dtype=np.int32)
    total = int(lens.sum())
    header = {
        "group_id": "0",
        "policy_version": 0,
        "prompt": "repeat 7",
        "columns": {"target": "7"},
        "texts": ["7" * tokens] * group_size,
        "finish_reasons": ["length"] * group_size,
        "gen_s": 0.01,
        "peak_memory_mb": 2.0,
    }
    arrays = {
        "prompt_ids": rng.integers(0, 57, 8, dtype=np.int32),
        "completion_ids": rng.integers(0, 57, total, dtype=np.int32),
        "completion_lens": lens,
        "logprobs": -rng.random(total, dtype=np.float32),
    }
    return header, arrays


def _ctl(sock: zmq.Socket, cmd: dict) -> dict | None:
    sock.send_multipart([CTL, msgpack.packb(cmd)])
    if cmd["cmd"] == "exit":
        return None
    _, body = sock.recv_multipart()
    return msgpack.unpackb(body) if body else None


def _rollouts(sock: zmq.Socket, n: int, group_size: int, tokens: int) -> tuple[float, int]:
    """Stream n rollouts; return (seconds until the peer decoded them all, bytes sent)."""
    rng = np.random.default_rng(0)
    # Build the arrays once and time encode + send per message, as the actor encodes each
    # group it sends; the sampling that makes the arrays is row 1's business.
    header, arrays = rollout_message(group_size, tokens, rng)
    # Warm-up: the connection is up before the clock starts.
    sock.send_multipart(protocol.encode(protocol.ROLLOUT, header, arrays))
    _ctl(sock, {"cmd": "count"})
    t0 = time.perf_counter()
    for _ in range(n):
        sock.send_multipart(protocol.encode(protocol.ROLLOUT, header, arrays), copy=False)
    counts = _ctl(sock, {"cmd": "count"})
    elapsed = time.perf_counter() - t0
    if counts["received"] != n:
        raise RuntimeError(f"peer decoded {counts['received']} of {n} rollouts")
    return elapsed, counts["bytes"] // n


def _ping_ms(sock: zmq.Socket, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        _ctl(sock, {"cmd": "ping"})
        times.append(time.perf_counter() - t0)
    return median(times) * 1e3


def _weights(sock: zmq.Socket, shapes: dict[str, tuple], reps: int) -> list[float]:
    """Receive and decode `reps` + 1 weights messages from the peer; return its timings."""
    sock.send_multipart([CTL, msgpack.packb({"cmd": "weights", "shapes": shapes, "reps": reps})])
    for _ in range(reps + 1):
        # as the actor receives: frames are zmq buffers, decoded without copying
        msg = protocol.decode([f.buffer for f in sock.recv_multipart(copy=False)])
        if msg.kind != protocol.WEIGHTS or set(msg.arrays) != set(shapes):
            raise RuntimeError("the peer sent an unexpected weights message")
        sock.send_multipart([CTL, b""])
    _, body = sock.recv_multipart()
    return msgpack.unpackb(body)["times"]


def copy_baseline_ms(shapes: dict[str, tuple], reps: int) -> float:
    """The in-process baseline: copy the same arrays in memory (numpy), median ms."""
    rng = np.random.default_rng(0)
    arrays = {name: rng.standard_normal(shape, dtype=np.float32) for name, shape in shapes.items()}
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        copies = {name: a.copy() for name, a in arrays.items()}
        times.append(time.perf_counter() - t0)
    del copies
    return median(times[1:]) * 1e3


def run(
    rollout_messages: int, group_size: int, tokens: int, weight_shapes: dict[str, dict], weight_reps: int
) -> TransportResult:
    """weight_shapes: label -> {array name: shape}; each is synced `weight_reps` times."""
    with tempfile.TemporaryDirectory(prefix="mlxrl-bench-") as tmp:
        os.chmod(tmp, 0o700)
        endpoint = f"ipc://{tmp}/learner.sock"
        peer = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.transport", "--endpoint", endpoint], cwd=ROOT, env=child_env()
        )
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(endpoint)  # zmq connects once the peer has bound; sends queue meanwhile
        try:
            log(f"transport: {rollout_messages} rollouts (G={group_size}, {tokens} tokens each)")
            seconds, msg_bytes = _rollouts(sock, rollout_messages, group_size, tokens)
            result = TransportResult(
                rollout_messages,
                msg_bytes,
                rollout_messages / seconds,
                rollout_messages * msg_bytes / seconds / 1e6,
                _ping_ms(sock, 200),
            )
            for label, shapes in weight_shapes.items():
                n = sum(int(np.prod(s)) for s in shapes.values())
                log(f"transport: weights '{label}' ({n} float32 parameters), {weight_reps} syncs")
                times = _weights(sock, shapes, weight_reps)
                result.weights[label] = {
                    "arrays": len(shapes),
                    "parameters": n,
                    "bytes": 4 * n,
                    "sync_ms": median(times) * 1e3,
                    "sync_ms_each": [t * 1e3 for t in times],
                    "copy_ms": copy_baseline_ms(shapes, weight_reps),
                }
            _ctl(sock, {"cmd": "exit"})
            peer.wait(timeout=30)
        finally:
            if peer.poll() is None:
                peer.kill()
                peer.wait()
            sock.close(linger=0)
            ctx.term()
    return result


def qwen3_0_6b_lora_shapes(rank: int = 8) -> dict[str, tuple]:
    """The real lora_a / lora_b shapes of rank-`rank` LoRA on every linear layer of the
    Qwen3-0.6B architecture, read from mlx-lm's own model and LoRA code. MLX arrays are
    lazy and nothing is evaluated, so no 0.6 B parameters are ever allocated."""
    from mlx_lm.models import qwen3
    from mlx_lm.tuner.utils import linear_to_lora_layers

    from policy.model import adapter_weights, lora_settings
    from runtime.config import LoraConfig

    args = qwen3.ModelArgs(
        model_type="qwen3",
        hidden_size=1024,
        num_hidden_layers=28,
        intermediate_size=3072,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        vocab_size=151936,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        rope_theta=1e6,
    )
    model = qwen3.Model(args)
    model.freeze()
    settings = lora_settings(LoraConfig(rank=rank), len(model.layers))
    linear_to_lora_layers(model, settings["num_layers"], settings["lora_parameters"])
    return {name: tuple(a.shape) for name, a in adapter_weights(model).items()}


def apply_ms(reps: int) -> tuple[float, dict[str, tuple]]:
    """policy.model.set_adapter_weights on the tiny model with a decoded weights message,
    median ms; also returns the tiny adapter's shapes."""
    from benchmarks.common import LORA, MODEL_DIR
    from policy.model import adapter_weights_numpy, load_policy, set_adapter_weights

    model, _, _ = load_policy(str(MODEL_DIR), LORA)
    weights = adapter_weights_numpy(model)
    msg = protocol.decode(protocol.encode(protocol.WEIGHTS, {"version": 1}, weights))
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        set_adapter_weights(model, msg.arrays)
        times.append(time.perf_counter() - t0)
    return median(times[1:]) * 1e3, {k: tuple(v.shape) for k, v in weights.items()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="The learner-side peer of the transport benchmark.")
    parser.add_argument("--endpoint", required=True)
    serve(parser.parse_args().endpoint)

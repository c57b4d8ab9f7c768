"""`actor serve`: the policy behind an OpenAI-compatible HTTP API.

`GET /v1/models`, `POST /v1/chat/completions` and `POST /v1/completions`, with OpenAI's
request and response fields; each response also carries what an RL client needs and
OpenAI does not give: `prompt_token_ids`, each choice's `token_ids` (as sampled, an EOS
included) and `token_logprobs`, and the `policy_version` that sampled it (as vLLM returns
token ids). Alone it serves the base model or one adapter; with `--run-dir` it attaches
to a training run's learner as an observer and applies each new adapter version between
requests, so its `policy_version` follows training.

One request at a time, on the main thread: MLX runs one stream, and the weights change
only between requests. Standard library HTTP, so the core install stays small. It listens
on loopback unless told otherwise: there is no authentication.

No request ends the server: a body over MAX_BODY_BYTES, one that is not a JSON object,
token ids outside the vocabulary, numbers out of range are a 400 (413) naming the field;
anything else that fails is a 500 with the error, logged; a client that stalls is
dropped after CLIENT_TIMEOUT_S.
"""

from __future__ import annotations

import json
import logging
import os
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import protocol
import transport
from actor.completions import BadRequest, Policy, TooLarge, TooSlow, openai_error, respond
from policy.model import load_arrays, tokenizer_fingerprint, weights_frame_bytes
from protocol import sockets
from protocol.connection import Link, State
from runtime import lifecycle
from runtime.config import Config, as_dict
from runtime.rundir import checkpoint_step, latest_checkpoint
from transport.keys import run_key_dir

log = logging.getLogger("actor.serve")

MAX_BODY_BYTES = 16 << 20
CLIENT_TIMEOUT_S = 5.0  # a request must arrive whole within this (one request at a time)


class PolicyServer(HTTPServer):
    """The HTTP server of `actor serve`: its handler serves `policy`."""

    def __init__(self, address: tuple[str, int], policy: Policy) -> None:
        super().__init__(address, Handler)
        self.policy = policy


class Handler(BaseHTTPRequestHandler):
    """One request to a PolicyServer: the routes, and OpenAI's error bodies."""

    server: PolicyServer
    # HTTP/1.0: the connection closes after each response, so an idle keep-alive client
    # cannot hold the one-request-at-a-time loop; a silent one is dropped.
    protocol_version = "HTTP/1.0"
    timeout = CLIENT_TIMEOUT_S

    def reply(self, status: int, body: dict) -> None:
        try:
            data = json.dumps(body, allow_nan=False).encode()  # NaN is not JSON
        except ValueError as e:
            message = f"the response holds a number JSON cannot carry ({e})"
            status, data = 500, json.dumps(openai_error(message, "server_error")).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def error(self, status: int, message: str, param: str | None = None) -> None:
        self.reply(status, openai_error(message, param=param))

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own errors (a request line or headers it cannot parse), as ours."""
        self.close_connection = True
        self.error(code, message or self.responses.get(code, ("error",))[0])

    def do_GET(self) -> None:  # noqa: N802 (the name http.server calls)
        policy, route = self.server.policy, self.path.rstrip("/")
        if route == "/v1/models":
            self.reply(200, models_body(policy))
        elif route == "/health":
            self.reply(200, {"status": "ok", "policy_version": policy.policy_version})
        else:
            self.error(404, f"no route {self.path}")

    def do_POST(self) -> None:  # noqa: N802
        policy = self.server.policy
        route = self.path.rstrip("/")
        if route not in ("/v1/chat/completions", "/v1/completions"):
            self.error(404, f"no route {self.path}")
            return
        try:
            body = read_json(self)
            if policy.waiting:
                self.error(503, policy.waiting)
                return
            if body.get("stream"):
                raise BadRequest("stream is not supported", "stream")
            self.reply(200, respond(policy, body, chat=route == "/v1/chat/completions"))
        except BadRequest as e:
            self.error(e.status, str(e), e.param)
        except Exception as e:  # a bug or an MLX error: this request fails, the server goes on
            log.exception("request failed")
            self.reply(500, openai_error(f"{type(e).__name__}: {e}", "server_error"))

    def log_message(self, fmt: str, *args) -> None:
        log.info("%s %s", self.address_string(), fmt % args)


def models_body(policy: Policy) -> dict:
    """`GET /v1/models`: the one model served, and the policy version it is at."""
    model = {
        "id": policy.name,
        "object": "model",
        "created": 0,
        "owned_by": "mlx-rl-ipc",
        "policy_version": policy.policy_version,
    }
    return {"object": "list", "data": [model]}


def read_json(handler: BaseHTTPRequestHandler, limit: int = MAX_BODY_BYTES) -> dict:
    """The request's JSON object: at most `limit` bytes, UTF-8, no NaN or Infinity."""
    try:
        length = int(handler.headers.get("Content-Length") or 0)
    except ValueError:
        raise BadRequest("Content-Length must be a number of bytes", "Content-Length") from None
    if length < 0:
        raise BadRequest("Content-Length must not be negative", "Content-Length")
    if length > limit:
        handler.close_connection = True  # what follows is not read
        raise TooLarge(f"the request body must be at most {limit} bytes", "Content-Length")
    try:
        data = handler.rfile.read(length)
    except TimeoutError:
        raise TooSlow(f"the request body did not arrive within {CLIENT_TIMEOUT_S:.0f} s") from None
    if len(data) < length:
        raise BadRequest(f"the request body ended after {len(data)} of {length} bytes")
    try:
        body = json.loads(data.decode() if data else "{}", parse_constant=reject_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError
        raise BadRequest(f"the request body is not JSON (UTF-8): {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    try:
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:  # "\ud800" is JSON, but no text a tokenizer can read
        raise BadRequest(
            "the request body holds a lone surrogate (\\ud800-\\udfff): not Unicode text"
        ) from None
    return body


def reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


class Follower:
    """Attached to a training run's learner as an observer: takes each new adapter version."""

    def __init__(self, run_dir: str, cfg: Config, policy: Policy) -> None:
        """Start from the run's newest checkpoint (a finished run's last); without one, serve
        nothing until the learner's first weights arrive."""
        self.policy = policy
        newest = latest_checkpoint(run_dir)
        if newest is not None:
            step = checkpoint_step(newest)
            policy.set_weights(load_arrays(newest / "adapters" / "adapters.safetensors"), step)
            log.info("serving the adapters of %s (policy version %d)", newest.name, step)
        else:
            policy.waiting = (
                f"{run_dir} has no adapters yet: no checkpoint, and no weights from its "
                "learner (it sends them as soon as it runs; is the run started?)"
            )
        self.net = transport.default()
        endpoint = protocol.read_endpoints(Path(run_dir))["learner"]
        keys = run_key_dir(run_dir, endpoint, cfg.run.insecure)
        self.sock, self.watch = sockets.connect(
            self.net, endpoint, keys, sockets.frame_limit(weights_frame_bytes(policy.model))
        )
        self.hello = protocol.encode(
            protocol.HELLO,
            {
                "role": "observer",
                "model": cfg.model.path,
                "tokenizer": tokenizer_fingerprint(policy.tokenizer),
                "lora": as_dict(cfg.lora),
                "pid": os.getpid(),
            },
        )
        # An observer's connection lives an actor's life (protocol/connection.py): it says
        # hello again on a new connection, or when the learner takes it for a stranger.
        self.link = Link(self.watch, "learner", log)
        self.link.saying_hello()
        self.sock.send(self.hello)
        self.stopped: str | None = None

    def poll(self) -> None:
        self.watch.down_for()
        if self.link.hello_due():
            self.link.saying_hello()
            self.sock.send(self.hello)
        newest = None
        for incoming in sockets.incoming(self.sock, 0):
            msg = incoming.msg
            if msg is None:
                log.error("dropped a malformed message: %s", incoming.error)
                continue
            state = self.link.take(msg)
            if msg.kind == protocol.WEIGHTS:
                newest = protocol.newer_weights(newest, msg)
            elif msg.kind == protocol.STOP and state in (State.STOPPED, State.INCOMPATIBLE):
                self.stopped = msg["reason"]
        if newest is not None:
            try:
                self.policy.set_weights(newest.arrays, newest["version"])
            except ValueError as e:
                log.error("ignored weights of version %d: %s", newest["version"], e)

    def close(self) -> None:
        self.watch.close()
        self.sock.close()
        self.net.close()


def serve(
    policy: Policy,
    host: str,
    port: int,
    follower: Follower | None = None,
    signals: lifecycle.StopSignals | None = None,
) -> int:
    """Serve until a stop signal (or the followed run ends); returns the exit code."""
    signals = signals or lifecycle.StopSignals().install()
    server = PolicyServer((host, port), policy)
    server.timeout = 0.1
    print(f"serving {policy.name} on http://{host}:{server.server_port}/v1", flush=True)
    try:
        while not signals.requested:
            server.handle_request()
            if follower is not None:
                follower.poll()
                if follower.stopped:
                    print(f"the run ended ({follower.stopped}); stopping", flush=True)
                    return lifecycle.EXIT_OK
                if follower.watch.refused:
                    print(f"cannot follow the run: the learner {follower.watch.refused}", flush=True)
                    return lifecycle.EXIT_USER_ERROR
    finally:
        server.server_close()
        if follower is not None:
            follower.close()
    return signals.exit_code()

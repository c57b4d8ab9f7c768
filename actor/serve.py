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

import dataclasses
import itertools
import json
import logging
import math
import os
import time
import uuid
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import zmq

import protocol
from policy.data import encode_prompt
from policy.model import load_arrays, set_adapter_weights, tokenizer_fingerprint, weights_frame_bytes
from policy.sampler import Completion, sample_groups
from protocol import lifecycle, sockets
from protocol.config import Config, SamplingConfig, as_dict
from protocol.keys import run_key_dir
from protocol.rundir import checkpoint_step, latest_checkpoint

log = logging.getLogger("actor.serve")

DEFAULT_MAX_TOKENS = 256  # or what the model's context leaves after the prompt, if less
MAX_BODY_BYTES = 16 << 20
CLIENT_TIMEOUT_S = 5.0  # a request must arrive whole within this (one request at a time)
MAX_SEED = 2**31 - 1


class BadRequest(ValueError):
    """A request that cannot be served; the message names the field."""

    status = 400

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class TooLarge(BadRequest):
    status = 413


class TooSlow(BadRequest):
    status = 408


class Policy:
    """The model being served, its tokenizer, and the version of its adapter weights."""

    def __init__(
        self, model, tokenizer, name: str, sampling: SamplingConfig, policy_version: int | None
    ) -> None:
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.sampling, self.policy_version = sampling, policy_version
        # Why there is nothing to serve yet (a followed run without adapters so far):
        # requests get a 503 saying it until weights arrive (`set_weights`).
        self.waiting: str | None = None
        args = getattr(model, "args", None)
        self.context = getattr(args, "max_position_embeddings", None)
        self.vocab = getattr(args, "vocab_size", None) or len(tokenizer.get_vocab())
        self.seeds = itertools.count(int(time.time()))  # a request without `seed` draws anew

    def set_weights(self, weights: dict, policy_version: int) -> None:
        set_adapter_weights(self.model, weights)
        self.policy_version, self.waiting = policy_version, None

    def params(self, body: dict, prompt_tokens: int) -> tuple[SamplingConfig, int]:
        """Sampling settings from OpenAI's fields; temperature 0 is greedy (top-k 1). An
        unset max_tokens is what the context leaves, at most DEFAULT_MAX_TOKENS."""

        def number(name: str, default, lo=None, hi=None, kind=float):
            v = body.get(name, default)
            if v is None:
                return default
            if (
                not isinstance(v, (int, float))
                or isinstance(v, bool)
                or not math.isfinite(v)
                or (kind is int and v != int(v))
            ):
                raise BadRequest(f"{name} must be a{'n integer' if kind is int else ' number'}", name)
            if (lo is not None and v < lo) or (hi is not None and v > hi):
                raise BadRequest(f"{name} must be between {lo} and {hi}", name)
            return kind(v)

        temperature = number("temperature", 1.0, 0.0, 2.0)
        room = (
            DEFAULT_MAX_TOKENS
            if self.context is None
            else min(DEFAULT_MAX_TOKENS, self.context - prompt_tokens)
        )
        max_tokens = number("max_completion_tokens", None, 1, None, int) or number(
            "max_tokens", max(room, 1), 1, None, int
        )
        top_k = 1 if temperature == 0 else number("top_k", 0, 0, self.vocab, int)
        top_p, min_p = number("top_p", 1.0, 0.0, 1.0), number("min_p", 0.0, 0.0, 1.0)
        params = dataclasses.replace(
            self.sampling,
            temperature=temperature or 1.0,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            max_tokens=max_tokens,
        )
        if params.top_p == 0:
            raise BadRequest("top_p must be above 0", "top_p")
        seed = number("seed", None, 0, MAX_SEED, int)
        return params, next(self.seeds) % MAX_SEED if seed is None else seed

    def generate(self, prompt_ids: list[int], body: dict) -> list[tuple[Completion, str]]:
        """`n` completions of the prompt, each cut at the first stop string, with its text."""
        n = body.get("n", 1)
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 64:
            raise BadRequest("n must be an integer from 1 to 64", "n")
        params, seed = self.params(body, len(prompt_ids))
        if self.context and len(prompt_ids) + params.max_tokens > self.context:
            raise BadRequest(
                f"{len(prompt_ids)} prompt tokens + max_tokens {params.max_tokens} exceed the "
                f"model's context of {self.context}",
                "max_tokens",
            )
        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise BadRequest("stop must be a string or a list of strings", "stop")
        eos = set(self.tokenizer.eos_token_ids)
        (group,) = sample_groups(self.model, [prompt_ids], n, params, eos, seed=seed)
        return [self.cut(c, stops) for c in group]

    def cut(self, c: Completion, stops: list[str]) -> tuple[Completion, str]:
        """The completion up to (not including) the first stop string, and its text."""
        text = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        at = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
        if at < 0:
            return c, text
        for k in range(len(c.token_ids) + 1):  # the fewest tokens whose text reaches the stop
            if len(self.tokenizer.decode(c.token_ids[:k], skip_special_tokens=True)) >= at:
                break
        return Completion(c.token_ids[:k], c.logprobs[:k], "stop"), text[:at]

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


def chat_prompt(policy: Policy, body: dict) -> list[int]:
    """The messages (tool calls and tool results included) and `tools`, through the chat
    template."""
    messages, tools = body.get("messages"), body.get("tools")
    if (
        not isinstance(messages, list)
        or not messages
        or not all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and (isinstance(m.get("content"), str) or (m.get("content") is None and m.get("tool_calls")))
            for m in messages
        )
    ):
        raise BadRequest(
            "messages must be a non-empty list of {role, content} with string content "
            "(or an assistant message with tool_calls)",
            "messages",
        )
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise BadRequest("tools must be a list of tool objects", "tools")
        if tools and not getattr(policy.tokenizer, "has_tool_calling", False):
            raise BadRequest(
                f"the chat template of {policy.name} defines no tool calls (mlx-lm found no "
                "tool-call parser for this tokenizer)",
                "tools",
            )
    return encode_prompt(policy.tokenizer, [template_message(m) for m in messages], tools)


def template_message(m: dict) -> dict:
    """A message as chat templates expect it: a tool call's `arguments` as an object (OpenAI
    sends a JSON string), tool results with their call's id."""
    out = {"role": m["role"], "content": m.get("content") or ""}
    if m.get("tool_calls"):
        calls = [c for c in m["tool_calls"] if isinstance(c, dict) and isinstance(c.get("function"), dict)]
        out["tool_calls"] = [
            {**c, "function": {**c["function"], "arguments": arguments(c["function"].get("arguments"))}}
            for c in calls
        ]
    for key in ("tool_call_id", "name"):
        if key in m:
            out[key] = m[key]
    return out


def arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            raise BadRequest(f"a tool call's arguments are not JSON: {value[:80]!r}", "messages") from None
    return value


def chat_message(policy: Policy, c: Completion, text: str, tools: list | None) -> tuple[dict, str]:
    """The assistant message of a sampled turn, and its finish reason. With `tools` in the
    request, each complete tool-call section (the markers mlx-lm knows for this tokenizer)
    is parsed by mlx-lm's parser into OpenAI's `tool_calls`, and the finish reason is
    `tool_calls`; a section cut short, or one the parser refuses, stays in the text."""
    tok = policy.tokenizer
    start, end = getattr(tok, "tool_call_start", None), getattr(tok, "tool_call_end", None)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if not tools or not start or not getattr(tok, "has_tool_calling", False):
        return message, c.finish_reason
    eos = set(tok.eos_token_ids)
    rest = tok.decode([t for t in c.token_ids if t not in eos], skip_special_tokens=False)
    content, calls = [], []
    while start in rest:
        before, _, after = rest.partition(start)
        body, found, after = after.partition(end)
        try:
            parsed = tok.tool_parser(body, tools) if found else None
        except (ValueError, KeyError, TypeError) as e:
            log.warning("a tool call did not parse (%s: %s); left in the text", type(e).__name__, e)
            parsed = None
        if parsed is None:
            content.append(before + start)
            rest = body + found + after
            continue
        content.append(before)
        calls += [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": p["name"], "arguments": json.dumps(p.get("arguments", {}))},
            }
            for p in (parsed if isinstance(parsed, list) else [parsed])
        ]
        rest = after
    if not calls:
        return message, c.finish_reason
    message["content"] = "".join(content) + rest
    message["tool_calls"] = calls
    return message, "tool_calls" if c.finish_reason == "stop" else c.finish_reason


def text_prompt(policy: Policy, body: dict) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        bad = next((t for t in prompt if not 0 <= t < policy.vocab), None)
        if bad is not None:  # MLX would read past the embedding table
            raise BadRequest(
                f"prompt: token id {bad} is outside the vocabulary (0 to {policy.vocab - 1})", "prompt"
            )
        return prompt  # token ids, as OpenAI allows
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("prompt must be a non-empty string (or one string, or token ids)", "prompt")
    return encode_prompt(policy.tokenizer, prompt)


def respond(policy: Policy, body: dict, chat: bool) -> dict:
    """The response body of a chat or text completion request."""
    prompt_ids = chat_prompt(policy, body) if chat else text_prompt(policy, body)
    out = policy.generate(prompt_ids, body)
    choices = []
    for i, (c, text) in enumerate(out):
        choice: dict[str, Any] = {
            "index": i,
            "finish_reason": c.finish_reason,
            "token_ids": c.token_ids,
            "token_logprobs": c.logprobs,
        }
        tokens = [policy.token_text(t) for t in c.token_ids]
        if chat:
            choice["message"], choice["finish_reason"] = chat_message(policy, c, text, body.get("tools"))
            choice["logprobs"] = (
                {
                    "content": [
                        {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                        for t, lp in zip(tokens, c.logprobs)
                    ]
                }
                if body.get("logprobs")
                else None
            )
        else:
            choice["text"] = text
            offsets = list(itertools.accumulate([0] + [len(t) for t in tokens[:-1]]))
            choice["logprobs"] = (
                {"tokens": tokens, "token_logprobs": c.logprobs, "top_logprobs": None, "text_offset": offsets}
                if body.get("logprobs") is not None
                else None
            )
        choices.append(choice)
    completion_tokens = sum(len(c.token_ids) for c, _ in out)
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": policy.name,
        "choices": choices,
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": completion_tokens,
            "total_tokens": len(prompt_ids) + completion_tokens,
        },
        "prompt_token_ids": prompt_ids,
        "policy_version": policy.policy_version,
    }


def handler_for(policy: Policy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        # HTTP/1.0: the connection closes after each response, so an idle keep-alive client
        # cannot hold the one-request-at-a-time loop; a silent one is dropped.
        protocol_version = "HTTP/1.0"
        timeout = CLIENT_TIMEOUT_S

        def reply(self, status: int, body: dict) -> None:
            try:
                data = json.dumps(body, allow_nan=False).encode()  # NaN is not JSON
            except ValueError as e:
                status, data = (
                    500,
                    json.dumps(
                        {
                            "error": {
                                "message": f"the response holds a number JSON cannot carry ({e})",
                                "type": "server_error",
                                "param": None,
                                "code": None,
                            }
                        }
                    ).encode(),
                )
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def error(self, status: int, message: str, param: str | None = None) -> None:
            self.reply(
                status,
                {
                    "error": {
                        "message": message,
                        "type": "invalid_request_error",
                        "param": param,
                        "code": None,
                    }
                },
            )

        def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
            """http.server's own errors (a request line or headers it cannot parse), as
            JSON like ours."""
            self.close_connection = True
            self.error(code, message or self.responses.get(code, ("error",))[0])

        def do_GET(self) -> None:  # noqa: N802 (the name http.server calls)
            if self.path.rstrip("/") == "/v1/models":
                self.reply(
                    200,
                    {
                        "object": "list",
                        "data": [
                            {
                                "id": policy.name,
                                "object": "model",
                                "created": 0,
                                "owned_by": "mlx-rl-ipc",
                                "policy_version": policy.policy_version,
                            }
                        ],
                    },
                )
            elif self.path.rstrip("/") == "/health":
                self.reply(200, {"status": "ok", "policy_version": policy.policy_version})
            else:
                self.error(404, f"no route {self.path}")

        def do_POST(self) -> None:  # noqa: N802
            route = self.path.rstrip("/")
            if route not in ("/v1/chat/completions", "/v1/completions"):
                self.error(404, f"no route {self.path}")
                return
            try:
                body = self.body()
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
                self.reply(
                    500,
                    {
                        "error": {
                            "message": f"{type(e).__name__}: {e}",
                            "type": "server_error",
                            "param": None,
                            "code": None,
                        }
                    },
                )

        def body(self) -> dict:
            """The request's JSON object: at most MAX_BODY_BYTES, UTF-8, no NaN or Infinity."""
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                raise BadRequest("Content-Length must be a number of bytes", "Content-Length") from None
            if length < 0:
                raise BadRequest("Content-Length must not be negative", "Content-Length")
            if length > MAX_BODY_BYTES:
                self.close_connection = True  # what follows is not read
                raise TooLarge(f"the request body must be at most {MAX_BODY_BYTES} bytes", "Content-Length")
            try:
                data = self.rfile.read(length)
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

        def log_message(self, fmt: str, *args) -> None:
            log.info("%s %s", self.address_string(), fmt % args)

    return Handler


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
        self.ctx = zmq.Context()
        endpoint = protocol.read_endpoints(Path(run_dir))["learner"]
        keys = run_key_dir(run_dir, endpoint, cfg.run.insecure)
        self.sock, self.watch = sockets.connect(
            self.ctx, endpoint, keys, sockets.frame_limit(weights_frame_bytes(policy.model))
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
        self.sock.send_multipart(self.hello)
        self.greeted = 1  # the connection the hello goes on
        self.stopped: str | None = None

    def poll(self) -> None:
        self.watch.down_for()
        if self.watch.connections > self.greeted:  # a new connection is a stranger to the learner
            self.greeted = self.watch.connections
            self.sock.send_multipart(self.hello)
        newest = None
        for incoming in sockets.incoming(self.sock, 0):
            msg = incoming.msg
            if msg is None:
                log.error("dropped a malformed message: %s", incoming.error)
            elif msg.kind == protocol.WEIGHTS:
                newest = protocol.newer_weights(newest, msg)
            elif msg.kind == protocol.STOP and msg.header.get("final") is not False:
                self.stopped = msg["reason"]
        if newest is not None:
            try:
                self.policy.set_weights(newest.arrays, newest["version"])
            except ValueError as e:
                log.error("ignored weights of version %d: %s", newest["version"], e)

    def close(self) -> None:
        self.watch.close()
        self.sock.close()
        self.ctx.term()


def serve(
    policy: Policy,
    host: str,
    port: int,
    follower: Follower | None = None,
    signals: lifecycle.StopSignals | None = None,
) -> int:
    """Serve until a stop signal (or the followed run ends); returns the exit code."""
    signals = signals or lifecycle.StopSignals().install()
    server = HTTPServer((host, port), handler_for(policy))
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

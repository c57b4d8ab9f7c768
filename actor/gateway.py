"""The OpenAI API that agent sessions call while a run trains (actor/agents.py).

`POST /v1/chat/completions` and `/v1/completions` (with `stream: true` as server-sent
events in OpenAI's chunk format, usage in the last chunk), `GET /v1/models`, and
`POST /v1/session/reward` for an agent to report its reward. Every route but `/health`
takes the session's key as `Authorization: Bearer KEY`: a key is its session's only
credential, and an unknown or expired key is a 401, so no session can read or extend
another's context.

Each connection has a thread of its own; a call waits in it while the actor's loop decodes
it in the continuous engine with every other session's calls. During training every call
samples with the run's `[sampling]` settings (the behavior logprobs must be the run's): a
request's `temperature`, `top_p`, `top_k`, `min_p` and `seed` are not applied; its
`max_tokens` and `stop` are. With `tools`, a streamed reply sends its text and tool calls
in one chunk at the end (a tool call is only known when its section is complete).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast

from actor.agents import AgentRunner
from actor.completions import (
    BadRequest,
    Policy,
    chat_message,
    chat_request,
    openai_error,
    response_body,
    stop_strings,
    text_prompt,
)
from actor.serve import read_json
from actor.sessions import Call, CallRefused, Session
from policy.sampler import Completion

log = logging.getLogger("actor.gateway")

IDLE_TIMEOUT_S = 120.0  # a keep-alive connection with no request for this long is closed
CALL_TIMEOUT_S = 3600.0  # a call that the engine never answers (a bug) fails after this


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """OpenAI's error object, its type and code by the status."""
    kind = {401: "authentication_error", 503: "service_unavailable"}.get(
        status, "invalid_request_error" if status < 500 else "server_error"
    )
    return openai_error(message, kind, param, "invalid_api_key" if status == 401 else None)


class Gateway(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # many sessions connect at once (the default, 5, drops them)

    def __init__(self, host: str, runner: AgentRunner, policy: Policy) -> None:
        super().__init__((host, 0), Handler)
        self.runner, self.policy = runner, policy
        self.thread = threading.Thread(target=self.serve_forever, name="gateway", daemon=True)

    @property
    def base_url(self) -> str:
        host = str(self.server_address[0])
        return f"http://{host if ':' not in str(host) else f'[{host}]'}:{self.server_port}/v1"

    def start(self) -> None:
        self.runner.base_url = self.base_url
        self.thread.start()
        log.info("serving agent sessions on %s", self.base_url)

    def stop(self) -> None:
        if self.thread.is_alive():
            self.shutdown()
        self.server_close()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as OpenAI's clients expect
    timeout = IDLE_TIMEOUT_S
    server: Gateway

    def reply(self, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def error(self, status: int, message: str, param: str | None = None) -> None:
        headers = {"Retry-After": "1"} if status == 503 else None
        self.reply(status, error_body(status, message, param), headers)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        self.close_connection = True
        self.error(code, message or self.responses.get(code, ("error",))[0])

    def log_message(self, fmt: str, *args) -> None:
        log.debug("%s %s", self.address_string(), fmt % args)

    def session(self) -> Session:
        auth = self.headers.get("Authorization") or ""
        key = auth[len("Bearer ") :].strip() if auth.startswith("Bearer ") else None
        return self.server.runner.session(key)

    def do_GET(self) -> None:  # noqa: N802 (the name http.server calls)
        route = self.path.split("?")[0].rstrip("/")
        try:
            if route == "/health":
                self.reply(200, {"status": "ok"})
                return
            self.session()
            policy = self.server.policy
            if route == "/v1/models":
                model = {"id": policy.name, "object": "model", "created": 0, "owned_by": "mlx-rl-ipc"}
                self.reply(200, {"object": "list", "data": [model]})
            else:
                self.error(404, f"no route {self.path}")
        except CallRefused as e:
            self.error(e.status, str(e), e.param)

    def do_POST(self) -> None:  # noqa: N802
        route = self.path.split("?")[0].rstrip("/")
        try:
            s = self.session()
            body = read_json(self)
            if route == "/v1/session/reward":
                self.take_reward(s, body)
            elif route in ("/v1/chat/completions", "/v1/completions"):
                self.complete(s, body, chat=route.endswith("chat/completions"))
            else:
                self.error(404, f"no route {self.path}")
        except CallRefused as e:
            self.error(e.status, str(e), e.param)
        except BadRequest as e:
            self.error(e.status, str(e), e.param)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the agent hung up; its session goes on
        except Exception as e:  # a bug: this call fails, the actor goes on
            log.exception("an agent's call failed")
            self.error(500, f"{type(e).__name__}: {e}")

    def take_reward(self, s: Session, body: dict) -> None:
        try:
            self.server.runner.report(s, body)
        except ValueError as e:
            raise BadRequest(str(e), "reward") from None
        self.reply(200, {"status": "ok"})

    def complete(self, s: Session, body: dict, chat: bool) -> None:
        runner, policy = self.server.runner, self.server.policy
        n = body.get("n", 1)
        if n != 1:
            raise BadRequest("a session samples one completion per call: n must be 1", "n")
        stops = stop_strings(body)
        max_tokens = _max_tokens(body)
        stream = body.get("stream") is True
        with s.lock:
            if chat:
                messages, tools = chat_request(policy, body)
                prompt_ids = runner.chat_prompt(s, messages, tools)
            else:
                messages, tools = None, None
                prompt_ids = text_prompt(policy, body)
            call = runner.submit(s, prompt_ids, max_tokens, stream)
            chunks = Chunks(self, chat, policy.name, stops, tools) if stream else None
            try:
                # The lock is held until the call has ended, even if the agent hung up:
                # a session's calls never decode side by side.
                c = self.wait(call, chunks)
                cut, text = policy.cut(c, stops)
                reply, finish = chat_message(policy, cut, text, tools) if chat else (None, cut.finish_reason)
                runner.record(call, cut, messages, reply, tools)
            except Exception as e:
                if chunks is None or not chunks.started:
                    raise
                status = e.status if isinstance(e, CallRefused) else 500
                if status == 500:
                    log.exception("a streamed call failed")
                chunks.fail(status, str(e))  # the 200 is sent: the error goes in the stream
                return
        version = min(cut.versions) if cut.versions else policy.policy_version
        if chunks is not None:
            chunks.finish(cut, text, reply, finish, prompt_ids, version)
            return
        out = response_body(policy, body, chat, prompt_ids, [(cut, text)])
        out["policy_version"] = version
        if chat:
            out["choices"][0]["finish_reason"] = finish
        self.reply(200, out)

    def wait(self, call: Call, chunks: Chunks | None) -> Completion:
        deadline = time.monotonic() + CALL_TIMEOUT_S
        tokens: list[int] = []
        while True:
            try:
                kind, value = call.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise CallRefused(503, "the actor did not answer the call in time") from None
            if kind == "error":
                raise value
            if kind == "done":
                return cast(Completion, value)
            tokens += value
            if chunks is not None:
                chunks.tokens(tokens)


class Chunks:
    """A streamed response: server-sent events in OpenAI's chunk format, chunked encoding."""

    def __init__(self, h: Handler, chat: bool, model: str, stops: list[str], tools: Any) -> None:
        self.h, self.chat, self.model, self.stops, self.tools = h, chat, model, stops, tools
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.sent = ""  # the text sent so far
        self.held = bool(tools)  # no more text until the end: with tools, or past a stop
        self.started = False  # the 200 and the headers are sent (with the first event)
        self.gone = False  # the agent hung up

    def start(self) -> None:
        h, self.started = self.h, True
        try:
            h.send_response(200)
            h.send_header("Content-Type", "text/event-stream")
            h.send_header("Cache-Control", "no-cache")
            h.send_header("Transfer-Encoding", "chunked")
            h.end_headers()
        except OSError:
            self.gone = True
            return
        if self.chat:
            self.event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])

    def fail(self, status: int, message: str) -> None:
        """An error after the stream began: an `error` event (OpenAI's clients raise it)."""
        self.write(f"data: {json.dumps(error_body(status, message))}\n\n")
        self.end()

    def end(self) -> None:
        self.write("data: [DONE]\n\n")
        if self.gone:
            return
        try:
            self.h.wfile.write(b"0\r\n\r\n")
            self.h.wfile.flush()
        except OSError:
            self.gone = True

    def event(self, choices: list[dict], **extra: Any) -> None:
        if not self.started:
            self.start()
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        self.write(f"data: {json.dumps({**body, **extra})}\n\n")

    def write(self, text: str) -> None:
        """One chunk; once the agent has hung up, nothing (the call still ends, and is kept:
        its tokens were sampled)."""
        if self.gone:
            return
        data = text.encode()
        try:
            self.h.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.h.wfile.flush()
        except OSError:  # BrokenPipeError, ConnectionResetError
            self.gone = True
            self.h.close_connection = True

    def text(self, delta: str, finish: str | None = None, **more: Any) -> dict:
        if self.chat:
            return {"index": 0, "delta": {"content": delta} if delta else {}, "finish_reason": finish, **more}
        return {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish, **more}

    def tokens(self, ids: list[int]) -> None:
        """Send the text of the tokens so far that can no longer change: none of a stop
        string's start, no half of a character."""
        if self.held:
            return
        text = self.h.server.policy.tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")
        at = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if at >= 0:
            text, self.held = text[:at], True
        elif self.stops:
            text = text[: max(len(self.sent), len(text) - max(map(len, self.stops)) + 1)]
        if len(text) > len(self.sent) and text.startswith(self.sent):
            self.event([self.text(text[len(self.sent) :])])
            self.sent = text

    def finish(
        self, c: Completion, text: str, reply: dict | None, finish: str, prompt_ids: list[int], version: Any
    ) -> None:
        """The last text (and tool calls), the finish reason, the call's exact tokens and
        logprobs; then the usage and `[DONE]`."""
        content = reply["content"] if reply is not None else text
        rest = content[len(self.sent) :] if content.startswith(self.sent) else ""
        choice = self.text(rest, finish, token_ids=c.token_ids, token_logprobs=c.logprobs)
        if reply is not None and reply.get("tool_calls"):
            choice["delta"]["tool_calls"] = [{"index": i, **tc} for i, tc in enumerate(reply["tool_calls"])]
        self.event([choice], prompt_token_ids=prompt_ids, policy_version=version)
        n = len(c.token_ids)
        usage = {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": n,
            "total_tokens": len(prompt_ids) + n,
        }
        self.event([], usage=usage)
        self.end()


def _max_tokens(body: dict) -> int | None:
    for name in ("max_completion_tokens", "max_tokens"):
        v = body.get(name)
        if v is None:
            continue
        if type(v) is not int or v < 1:
            raise BadRequest(f"{name} must be an integer >= 1", name)
        return v
    return None

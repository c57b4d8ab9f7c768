"""OpenAI completion requests answered by the policy: the request's fields checked and
turned into sampling settings and a prompt (chat messages and tools through the chat
template, or text or token ids), the completions sampled, and the response body built
(tool calls parsed, `token_ids`, `token_logprobs` and `policy_version` added).

Apart from actor/serve.py, which is the HTTP server around it (routes, request bodies,
errors, following a run): here what a request means, there how it arrives.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import time
import uuid
from typing import Any

from policy.data import encode_prompt
from policy.engine import sample_groups
from policy.model import set_adapter_weights
from policy.sampler import Completion
from runtime.config import SamplingConfig

# The server's logger: what a request logs is the server's (`actor serve`'s) log.
log = logging.getLogger("actor.serve")

DEFAULT_MAX_TOKENS = 256  # or what the model's context leaves after the prompt, if less
MAX_SEED = 2**31 - 1


def openai_error(
    message: str, kind: str = "invalid_request_error", param: str | None = None, code=None
) -> dict:
    """OpenAI's error body, as both servers answer (`actor serve`, the agents' gateway)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


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
        stops = stop_strings(body)
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
        versions = c.versions[:k] if c.versions is not None else None
        return Completion(c.token_ids[:k], c.logprobs[:k], "stop", versions), text[:at]

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


def chat_prompt(policy: Policy, body: dict) -> list[int]:
    """The messages (tool calls and tool results included) and `tools`, through the chat
    template."""
    return encode_prompt(policy.tokenizer, *chat_request(policy, body))


def chat_request(policy: Policy, body: dict) -> tuple[list[dict], list | None]:
    """The request's messages as the chat template takes them, and its `tools`; checked."""
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
    return [template_message(m) for m in messages], tools or None


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
    return response_body(policy, body, chat, prompt_ids, policy.generate(prompt_ids, body))


def stop_strings(body: dict) -> list[str]:
    """The request's `stop`: a string or a list of non-empty strings."""
    stops = body.get("stop") or []
    stops = [stops] if isinstance(stops, str) else stops
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest("stop must be a string or a list of strings", "stop")
    return stops


def response_body(
    policy: Policy, body: dict, chat: bool, prompt_ids: list[int], out: list[tuple[Completion, str]]
) -> dict:
    """The response to `body` whose completions (each cut at its stop, and its text) are `out`."""
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

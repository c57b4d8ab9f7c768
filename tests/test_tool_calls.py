"""Tool calls in `actor serve`: OpenAI's `tools` and tool messages go through the model's
chat template, and a turn's tool-call markup comes back as OpenAI's `tool_calls`, parsed
by the parser mlx-lm picks for the tokenizer. The model is a tiny random one whose
tokenizer can write JSON and whose template renders tools (mlx-lm's `json_tools` format)."""

from __future__ import annotations

import signal

import pytest

from actor.completions import Policy, chat_message
from policy.model import load_policy
from policy.sampler import Completion
from runtime.config import LoraConfig, SamplingConfig
from tests.helpers import EXAMPLES, TOOLS, make_tool_model, start_server, stop

pytestmark = pytest.mark.slow  # real processes end to end: left out of the fast subset

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    return make_tool_model(tmp_path_factory.mktemp("tool-model"))


def completion_of(tokenizer, text: str) -> Completion:
    ids = list(tokenizer.encode(text, add_special_tokens=False)) + [tokenizer.eos_token_id]
    return Completion(ids, [-0.5] * len(ids), "stop")


def test_a_turn_s_tool_call_markup_becomes_openai_s_tool_calls(tool_model):
    model, tokenizer, _ = load_policy(str(tool_model), LoraConfig())
    policy = Policy(model, tokenizer, "tool-model", SamplingConfig(), None)
    said = 'sum: <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    c = completion_of(tokenizer, said)
    message, finish = chat_message(policy, c, tokenizer.decode(c.token_ids, skip_special_tokens=True), TOOLS)
    assert finish == "tool_calls"
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert message["content"] == "sum: "
    # Without tools in the request the markup is plain text; a call cut short stays text too.
    c = completion_of(tokenizer, said)
    assert chat_message(policy, c, said, None) == ({"role": "assistant", "content": said}, "stop")
    cut = 'x <tool_call>{"name": "add", "argu'
    c = completion_of(tokenizer, cut)
    assert chat_message(policy, c, cut, TOOLS) == ({"role": "assistant", "content": cut}, "stop")


def test_tools_and_tool_messages_reach_the_chat_template(tool_model, tmp_path):
    cfg = tmp_path / "serve.toml"
    cfg.write_text(
        f'[model]\npath = "{tool_model}"\n[data]\nprompts = "{EXAMPLES / "tiny_prompts.jsonl"}"\n'
        '[reward]\nfunctions = ["tiny_task:reward"]\n'
    )
    proc, url = start_server("--config", str(cfg))
    try:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        history = [
            {"role": "user", "content": "add 1 and 2"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "3"},
        ]
        out = client.chat.completions.create(model="tool-model", messages=history, tools=TOOLS, max_tokens=4)
        from transformers import AutoTokenizer

        prompt = AutoTokenizer.from_pretrained(str(tool_model)).decode(out.prompt_token_ids)
        start = "<|system|>tools: add<|end|><|user|>add 1 and 2<|end|><|assistant|><tool_call>"
        assert prompt.startswith(start)
        assert '"arguments": {"a": 1, "b": 2}' in prompt  # the template got the arguments as an object
        assert prompt.endswith("</tool_call><|end|><|tool|>3<|end|><|assistant|>")
    finally:
        assert stop(proc) == 128 + signal.SIGTERM


def test_tools_for_a_model_whose_template_has_none_are_refused():
    proc, url = start_server("--config", str(EXAMPLES / "tiny.toml"))
    try:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model="tiny-model", messages=[{"role": "user", "content": "hi"}], tools=TOOLS, max_tokens=2
            )
        assert e.value.body["param"] == "tools"
        assert "defines no tool calls" in e.value.body["message"]
    finally:
        assert stop(proc) == 128 + signal.SIGTERM

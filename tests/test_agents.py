"""Agent sessions through the served API (actor/agents.py, actor/gateway.py).

The first tests serve sessions in-process from a real engine on the tiny model and call
them with OpenAI's Python client; the rest run `orchestrator up` with an agent beside the
config, as a user would, and check that the learner trained on exactly what the server
returned."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from actor.agents import NO_AGENT, AgentRunner
from actor.completions import Policy
from actor.gateway import Gateway
from actor.rollout import PlacedPrompt
from actor.sessions import AgentGroup, Session
from policy.data import Prompt
from policy.engine import Engine
from runtime.config import AgentConfig, SamplingConfig
from tests.helpers import EXAMPLES, TINY_MODEL, actor_eval_matches, merge_toml, read_metrics, run_up

openai = pytest.importorskip("openai")

PROMPT = [{"role": "system", "content": "repeat digits."}, {"role": "user", "content": "repeat 3"}]


class Served:
    """A gateway and its runner on the tiny model, the engine stepped by a thread as the
    actor's loop steps it; `rows` is how many rows each decode step had."""

    def __init__(self, tiny, max_rows: int = 64, max_episode_tokens: int = 200) -> None:
        model, tokenizer = tiny
        self.sampling = SamplingConfig(group_size=2, max_tokens=8, seed=3)
        eos = set(tokenizer.eos_token_ids)
        self.engine = Engine(model, self.sampling, eos, 3, max_rows)
        cfg = AgentConfig(max_episode_tokens=max_episode_tokens)
        self.runner = AgentRunner(cfg, None, self.engine, tokenizer, eos, self.sampling, 512)
        policy = Policy(model, tokenizer, "tiny", self.sampling, 0)
        self.gateway = Gateway("127.0.0.1", self.runner, policy)
        self.gateway.start()
        self.rows: list[int] = []
        self.paused = threading.Event()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def loop(self) -> None:
        while not self.stopped.is_set():
            if self.paused.is_set():
                time.sleep(0.005)
                continue
            self.runner.pump(0)
            if self.engine.decoded:
                self.rows.append(self.engine.decoded)
            if not self.engine.busy:
                time.sleep(0.002)

    def session(self, first_noise: int = 0) -> Session:
        drawn = PlacedPrompt(Prompt(0, PROMPT, [], {}), [0, 0], [0, 1], first_noise)
        group = AgentGroup(drawn)
        group.sessions.append(session := self.runner.new_session(group, 0, 1))
        self.runner.groups.append(group)  # in flight: no agent runs, the test calls
        return session

    def client(self, s: Session | str):
        key = s if isinstance(s, str) else s.key
        return openai.OpenAI(base_url=self.runner.base_url, api_key=key, max_retries=0)

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(10)
        self.gateway.stop()


@pytest.fixture
def served(tiny):
    s = Served(tiny)
    yield s
    s.close()


def test_a_session_s_calls_continue_its_tokens_and_its_kv_cache(served):
    """The second call's prompt is the first call's prompt and completion, as sampled, then
    the template's tokens for the new message; only those new tokens are prefilled; the
    session's trace masks everything but the sampled tokens."""
    s = served.session()
    client = served.client(s)
    first = client.chat.completions.create(model="tiny", messages=PROMPT, max_tokens=5)
    prefilled = served.engine.prefilled
    messages = [*PROMPT, first.choices[0].message.model_dump(), {"role": "user", "content": "again"}]
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5)

    p1, c1 = first.model_extra["prompt_token_ids"], first.choices[0].model_extra["token_ids"]
    p2, c2 = second.model_extra["prompt_token_ids"], second.choices[0].model_extra["token_ids"]
    assert p2[: len(p1) + len(c1)] == p1 + c1
    new = p2[len(p1) + len(c1) :]
    assert new, "the user's message adds tokens"
    assert served.engine.prefilled - prefilled == len(new)  # the kept cache was continued
    (trace,) = s.traces
    assert trace.prompt_ids == p1
    assert trace.ids == c1 + new + c2
    assert trace.mask == [1] * len(c1) + [0] * len(new) + [1] * len(c2)
    logprobs = (
        first.choices[0].model_extra["token_logprobs"] + second.choices[0].model_extra["token_logprobs"]
    )
    assert [lp for lp, m in zip(trace.logprobs, trace.mask) if m] == logprobs
    assert served.runner.splits == 0


def test_a_call_that_rewrites_the_history_starts_a_new_trace(served):
    s = served.session()
    client = served.client(s)
    client.chat.completions.create(model="tiny", messages=PROMPT, max_tokens=4)
    rewritten = [*PROMPT, {"role": "assistant", "content": "777"}, {"role": "user", "content": "again"}]
    r = client.chat.completions.create(model="tiny", messages=rewritten, max_tokens=4)
    assert len(s.traces) == 2 and served.runner.splits == 1
    assert s.traces[1].prompt_ids == r.model_extra["prompt_token_ids"]


def test_a_streamed_call_sends_what_an_unstreamed_one_returns(served):
    """Two sessions with the same noise sample the same tokens: one streamed, one not. The
    deltas join into the same text; the last chunk carries the exact tokens and logprobs,
    then the usage."""
    plain = served.client(served.session()).chat.completions.create(
        model="tiny", messages=PROMPT, max_tokens=8
    )
    stream = served.client(served.session()).chat.completions.create(
        model="tiny", messages=PROMPT, max_tokens=8, stream=True
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    last = [c for c in chunks if c.choices][-1]
    assert last.choices[0].finish_reason == plain.choices[0].finish_reason
    assert last.choices[0].model_extra["token_ids"] == plain.choices[0].model_extra["token_ids"]
    assert last.choices[0].model_extra["token_logprobs"] == plain.choices[0].model_extra["token_logprobs"]
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens


def test_a_key_is_its_session_s_only_credential(served):
    s, other = served.session(), served.session()
    with pytest.raises(openai.AuthenticationError) as info:
        served.client("sk-session-forged").chat.completions.create(model="tiny", messages=PROMPT)
    assert info.value.status_code == 401 and "unknown or expired" in str(info.value)
    served.client(other).chat.completions.create(model="tiny", messages=PROMPT, max_tokens=2)
    served.runner.forget(other)  # its session ended: the key expires
    with pytest.raises(openai.AuthenticationError):
        served.client(other).chat.completions.create(model="tiny", messages=PROMPT)
    assert served.client(s).models.list().data[0].id == "tiny"
    assert other.traces and not s.traces  # nothing of one session reached the other


def test_a_call_that_fails_on_its_way_leaves_no_trace(served):
    """A call that fails after the gateway handed it on (here the actor answers it with a
    503) changes nothing of its session: the same call again is trained once."""
    from actor.sessions import CallRefused

    s = served.session()
    served.paused.set()
    failed: list = []

    def call() -> None:
        try:
            served.client(s).chat.completions.create(model="tiny", messages=PROMPT, max_tokens=3)
        except openai.APIStatusError as e:
            failed.append(e.status_code)

    thread = threading.Thread(target=call)
    thread.start()
    waiting = served.runner.inbox.get(timeout=10)
    waiting.events.put(("error", CallRefused(503, "the actor started over")))
    thread.join(10)
    assert failed == [503] and s.traces == [] and s.used == 0
    served.paused.clear()
    r = served.client(s).chat.completions.create(model="tiny", messages=PROMPT, max_tokens=3)
    (trace,) = s.traces
    assert trace.prompt_ids == r.model_extra["prompt_token_ids"]
    assert trace.ids == r.choices[0].model_extra["token_ids"] and all(trace.mask)


def test_an_agent_that_hangs_up_mid_stream_does_not_break_its_session(served):
    """The agent closes a streamed call after its first chunk: the call still ends (its
    tokens were sampled, and are kept), and the session's next call is served."""
    import http.client
    from urllib.parse import urlsplit

    s = served.session()
    body = json.dumps({"model": "tiny", "messages": PROMPT, "max_tokens": 8, "stream": True})
    url = urlsplit(served.runner.base_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    connection.request("POST", "/v1/chat/completions", body, {"Authorization": f"Bearer {s.key}"})
    response = connection.getresponse()
    assert response.status == 200 and response.readline()  # the first chunk, then hang up
    connection.sock.close()
    connection.close()
    again = served.client(s).chat.completions.create(model="tiny", messages=PROMPT, max_tokens=4)
    assert again.choices[0].model_extra["token_ids"]
    assert served.thread.is_alive()
    assert len(s.traces) == 2 and served.runner.splits == 1  # the agent never saw the first reply


def test_an_agent_posts_its_reward_with_its_key(served):
    """`POST {base_url}/session/reward`, as a program in any language reports it: with its
    own key it counts; a bad body is a 400 naming `reward`; another key is a 401."""
    import urllib.error
    import urllib.request

    s = served.session()

    def post(key: str, body: object) -> int:
        request = urllib.request.Request(
            f"{served.runner.base_url}/session/reward",
            json.dumps(body).encode(),
            {"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        try:
            return urllib.request.urlopen(request, timeout=10).status
        except urllib.error.HTTPError as e:
            assert e.code != 400 or json.loads(e.read())["error"]["param"] == "reward"
            return e.code

    assert post(s.key, {"reward": "high"}) == 400 and not s.reported
    assert post("sk-session-forged", {"reward": 1}) == 401
    assert post(s.key, {"reward": 0.75}) == 200
    assert s.reported and s.reward == 0.75


def test_a_call_after_the_actor_started_over_is_a_503_with_retry_after(served):
    """The learner moved the data cursor (it restarted): the sessions in flight are given
    up and their rows run again as new sessions; their agents' calls get a 503."""
    s = served.session()
    served.client(s).chat.completions.create(model="tiny", messages=PROMPT, max_tokens=2)
    served.runner.clear()
    with pytest.raises(openai.InternalServerError) as info:
        served.client(s).chat.completions.create(model="tiny", messages=PROMPT, max_tokens=2)
    assert info.value.status_code == 503 and info.value.response.headers["Retry-After"] == "1"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": PROMPT, "n": 2}, "n"),
        ({"messages": PROMPT, "max_tokens": 0}, "max_tokens"),
        ({"messages": "hi"}, "messages"),
        ({"messages": PROMPT, "stop": [1]}, "stop"),
    ],
)
def test_a_malformed_call_is_a_400_naming_the_field(served, body, param):
    client = served.client(served.session())
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", **body)
    assert info.value.status_code == 400 and info.value.param == param


def test_a_session_past_its_token_budget_ends_with_length(tiny):
    served = Served(tiny, max_episode_tokens=10)
    try:
        s = served.session()
        client = served.client(s)
        r = client.chat.completions.create(model="tiny", messages=PROMPT, max_tokens=8)
        messages = [*PROMPT, r.choices[0].message.model_dump(), {"role": "user", "content": "again"}]
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8)
        assert r.choices[0].finish_reason == "length"
        assert s.finish == "length" and sum(s.trace.mask) <= 10
    finally:
        served.close()


def test_64_concurrent_sessions_decode_in_one_batch(served):
    """64 sessions call at once: their calls join one continuous batch."""
    served.paused.set()
    sessions = [served.session(first_noise=i) for i in range(64)]
    replies: list = []

    def call(s: Session) -> None:
        replies.append(served.client(s).chat.completions.create(model="tiny", messages=PROMPT, max_tokens=8))

    threads = [threading.Thread(target=call, args=(s,)) for s in sessions]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while served.runner.inbox.qsize() < 64 and time.monotonic() < deadline:
        time.sleep(0.01)
    served.paused.clear()
    for t in threads:
        t.join(60)
    assert len(replies) == 64
    assert max(served.rows) == 64


# --------------------------------------------------------------------------- a run with an agent

AGENT = '''
import json, os
from pathlib import Path
from openai import OpenAI

CALLS = Path(__file__).parent / "calls"


def run(row, base_url, api_key):
    """Three calls, the second streamed; every call's exact tokens saved for the test."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages, calls = list(row["prompt"]), []
    for turn in range(3):
        if turn == 1:
            chunks = list(client.chat.completions.create(
                model="m", messages=messages, max_tokens=MAX, stream=True))
            last = [c for c in chunks if c.choices][-1]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            prompt, choice = last.model_extra["prompt_token_ids"], last.choices[0].model_extra
        else:
            r = client.chat.completions.create(model="m", messages=messages, max_tokens=MAX)
            text = r.choices[0].message.content
            prompt, choice = r.model_extra["prompt_token_ids"], r.choices[0].model_extra
        calls.append({"prompt": prompt, "ids": choice["token_ids"], "logprobs": choice["token_logprobs"]})
        said = "(rewritten)" if SPLIT and turn == 0 else text
        messages += [{"role": "assistant", "content": said}, {"role": "user", "content": "once more"}]
    CALLS.mkdir(exist_ok=True)
    (CALLS / f"{api_key}.json").write_text(json.dumps(calls))
    return float(str(row.get("answer", "")) in text)
'''


def agent_config(
    folder: Path, model: Path, prompts: str, extra: str = "", max_tokens: int = 6, split: bool = False
) -> Path:
    (folder / "my_agent.py").write_text(AGENT.replace("MAX", str(max_tokens)).replace("SPLIT", str(split)))
    cfg = folder / "run.toml"
    text = f"""
[model]
path = "{model}"
[data]
prompts = "{prompts}"
[sampling]
group_size = 2
max_tokens = {max_tokens}
[train]
steps = 2
batch_size = 2
checkpoint_every = 0
[agent]
function = "my_agent:run"
max_episode_tokens = 120
timeout_s = 120
[log]
completions_every = 1
completions_groups = 8
completions_tokens = true
[run]
dir = "runs/agent"
"""
    cfg.write_text(merge_toml(text, extra))
    return cfg


def check_trained_exactly_what_was_served(folder: Path, turns: float = 3) -> list[dict]:
    """Every completion the learner logged is one trace of a session (its calls that each
    continued the last): its trained tokens are those calls' sampled tokens, with their
    behavior logprobs, and nothing else carries loss; at the first step the learner's
    logprobs equal the behavior logprobs on every trained token."""
    sessions = [json.loads(p.read_text()) for p in (folder / "calls").glob("*.json")]
    rows = [json.loads(line) for line in (folder / "runs/agent/completions.jsonl").read_text().splitlines()]
    assert rows and len(sessions) >= len({json.dumps(r["prompt"]) + r["group_id"] for r in rows})
    for row in rows:
        full = row["prompt_ids"] + row["completion_ids"]
        # (sessions that sampled the same tokens are the same to this check)
        calls = next(c for c in sessions if any(call["prompt"] + call["ids"] == full for call in c))
        end = next(k for k, call in enumerate(calls) if call["prompt"] + call["ids"] == full)
        mine = [
            c for c in calls[: end + 1] if full[: len(c["prompt"]) + len(c["ids"])] == c["prompt"] + c["ids"]
        ]
        mask = [0] * len(full)
        for call in mine:
            at = len(call["prompt"])
            mask[at : at + len(call["ids"])] = [1] * len(call["ids"])
        assert [0] * len(row["prompt_ids"]) + row["loss_mask"] == mask
        trained = [lp for lp, m in zip(row["logprobs"], row["loss_mask"]) if m]
        assert trained == [lp for call in mine for lp in call["logprobs"]]
    first = read_metrics(folder / "runs/agent")[0]
    assert first["step"] == 1 and first["episodes/mean_model_turns"] == turns
    assert first["is_ratio_min"] == pytest.approx(1, abs=1e-3)
    assert first["is_ratio_max"] == pytest.approx(1, abs=1e-3)
    return rows


@pytest.mark.slow
def test_an_agent_with_openai_s_client_trains_on_exactly_the_served_tokens(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text((EXAMPLES / "tiny_chat_prompts.jsonl").read_text())
    cfg = agent_config(tmp_path, TINY_MODEL, prompts.name)
    code, out = run_up(cfg, cwd=tmp_path)
    assert code == 0, out
    check_trained_exactly_what_was_served(tmp_path)


@pytest.mark.slow
def test_a_session_that_rewrites_its_history_trains_each_trace_with_its_reward(tmp_path):
    """The agent's second call rewrites the first reply: that session is two traces, both
    trained, both with the session's reward and advantage."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text((EXAMPLES / "tiny_chat_prompts.jsonl").read_text())
    cfg = agent_config(tmp_path, TINY_MODEL, prompts.name, split=True)
    code, out = run_up(cfg, cwd=tmp_path)
    assert code == 0, out
    rows = check_trained_exactly_what_was_served(tmp_path, turns=1.5)  # traces of 1 and 2 turns
    first = [r for r in rows if r["step"] == 1]
    assert len(first) == 2 * 2 * 2  # 2 groups of 2 sessions, each 2 traces
    for group in {r["group_id"] for r in first}:
        mine = [r for r in first if r["group_id"] == group]
        assert [r["index"] for r in mine] == [0, 1, 2, 3]
        # traces of a session (rows 0-1, 2-3) share its reward and advantage
        assert mine[0]["reward"] == mine[1]["reward"] and mine[0]["advantage"] == mine[1]["advantage"]
        assert mine[2]["reward"] == mine[3]["reward"] and mine[2]["advantage"] == mine[3]["advantage"]
    metrics = read_metrics(tmp_path / "runs/agent")
    assert metrics[-1]["agent/splits"] == 2 * 2 * 2  # a split per session, 4 sessions a step


@pytest.mark.slow
def test_an_agent_on_smollm2_trains_on_exactly_the_served_tokens(tmp_path, smollm2):
    """The real model: several turns, one streamed, the ratio 1 at step 0."""
    prompts = tmp_path / "prompts.jsonl"
    rows = [json.loads(line) for line in (EXAMPLES / "smollm2_heldout.jsonl").read_text().splitlines()][:2]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = agent_config(tmp_path, smollm2, prompts.name, "[train]\nsteps = 1\nbatch_size = 1", max_tokens=12)
    code, out = run_up(cfg, cwd=tmp_path, timeout=900)
    assert code == 0, out
    check_trained_exactly_what_was_served(tmp_path)


FLAKY = '''
import threading, time
from openai import OpenAI

lock, started = threading.Lock(), [0]


def run(row, base_url, api_key):
    """The first three sessions fail: one raises, one hangs past the timeout, one never
    reports a reward. Rows asking for 9 always raise. The rest answer once."""
    with lock:
        started[0] += 1
        n = started[0]
    if row["answer"] == "9":
        raise RuntimeError("this agent cannot do nines")
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    r = client.chat.completions.create(model="m", messages=row["prompt"], max_tokens=4)
    if n == 1:
        raise RuntimeError("the agent's tool broke")
    if n == 2:
        time.sleep(30)
    if n == 3:
        return None
    return float(row["answer"] in r.choices[0].message.content)
'''


@pytest.mark.slow
def test_an_agent_that_fails_loses_only_its_session_or_at_last_its_group(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    rows = [json.loads(line) for line in (EXAMPLES / "tiny_chat_prompts.jsonl").read_text().splitlines()]
    nine = next(r for r in rows if r["answer"] == "9")
    others = [r for r in rows if r["answer"] != "9"][:5]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in [others[0], nine, *others[1:]]))
    (tmp_path / "flaky.py").write_text(FLAKY)
    cfg = agent_config(tmp_path, TINY_MODEL, prompts.name, '[agent]\nfunction = "flaky:run"\ntimeout_s = 3')
    code, out = run_up(cfg, cwd=tmp_path)
    assert code == 0, out
    last = read_metrics(tmp_path / "runs/agent")[-1]
    assert last["step"] == 2
    assert last["env_retries"] >= 3 + 2  # the three first sessions, and the nine's two retries
    (reason,) = last["dropped_reasons"]
    assert last["dropped_reasons"][reason] == 1
    assert "this agent cannot do nines (3 attempts)" in reason
    assert last["groups_trained"] == 4  # nothing half-trained: the dropped group is not in a batch
    log = (tmp_path / "runs/agent/actor.log").read_text()
    for why in (
        "the agent raised RuntimeError: the agent's tool broke",
        "passed agent.timeout_s = 3 s",
        "ended without reporting a reward",
    ):
        assert why in log


NODE_AGENT = """
import OpenAI from "openai";
import fs from "node:fs";

const row = JSON.parse(fs.readFileSync(0, "utf8"));
const client = new OpenAI({ maxRetries: 0 });  // OPENAI_BASE_URL and OPENAI_API_KEY
const messages = [...row.prompt];
const calls = [];
let text = "";
for (let turn = 0; turn < 3; turn++) {
  let prompt, choice;
  if (turn === 1) {
    const stream = await client.chat.completions.create({
      model: "m", messages, max_tokens: 6, stream: true,
    });
    text = "";
    for await (const chunk of stream) {
      if (!chunk.choices.length) continue;
      text += chunk.choices[0].delta.content ?? "";
      if (chunk.choices[0].finish_reason) { prompt = chunk.prompt_token_ids; choice = chunk.choices[0]; }
    }
  } else {
    const r = await client.chat.completions.create({ model: "m", messages, max_tokens: 6 });
    text = r.choices[0].message.content;
    prompt = r.prompt_token_ids; choice = r.choices[0];
  }
  calls.push({ prompt, ids: choice.token_ids, logprobs: choice.token_logprobs });
  messages.push({ role: "assistant", content: text }, { role: "user", content: "once more" });
}
fs.mkdirSync("calls", { recursive: true });
fs.writeFileSync(`calls/${process.env.OPENAI_API_KEY}.json`, JSON.stringify(calls));
console.log(text.includes(row.answer) ? 1 : 0);
"""


@pytest.mark.slow
def test_a_node_agent_with_openai_s_npm_package_trains(tmp_path):
    """`agent.command`: a program in another language, from a folder of its own."""
    import shutil
    import subprocess

    if not (shutil.which("node") and shutil.which("npm")):
        pytest.skip("Node.js and npm are not installed")
    (tmp_path / "package.json").write_text('{"name": "agent", "private": true, "type": "module"}')
    npm = subprocess.run(
        ["npm", "install", "--no-audit", "--no-fund", "openai@4"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if npm.returncode != 0:
        pytest.skip(f"npm could not install openai: {npm.stderr.strip()[-300:]}")
    (tmp_path / "agent.mjs").write_text(NODE_AGENT)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text((EXAMPLES / "tiny_chat_prompts.jsonl").read_text())
    cfg = agent_config(tmp_path, TINY_MODEL, prompts.name, '[agent]\ncommand = ["node", "agent.mjs"]')
    cfg.write_text(cfg.read_text().replace('function = "my_agent:run"\n', ""))
    code, out = run_up(cfg, cwd=tmp_path)
    assert code == 0, out
    check_trained_exactly_what_was_served(tmp_path)


SLOW_PROGRAM = """
import json, sys, time
from openai import OpenAI

row = json.loads(sys.stdin.readline())
client = OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY
messages = list(row["prompt"])
for turn in range(3):
    time.sleep(0.3)  # the agent thinks: a kill finds sessions mid-way
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=4)
    messages += [r.choices[0].message.model_dump(), {"role": "user", "content": "once more"}]
print(float(row["answer"] in (r.choices[0].message.content or "")))
"""


@pytest.mark.slow
def test_an_actor_killed_mid_session_leaves_nothing_half_trained(tmp_path):
    """SIGKILL the actor while its sessions' programs wait on it: they die with it (the
    test's guard finds no process left), the restarted actor runs those rows again, every
    step trains whole groups once, and the ledger balances."""
    import os
    import signal
    import sys

    from tests.helpers import assert_steps_once_and_nothing_lost, orchestrator, pid_of, wait_for_step

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text((EXAMPLES / "tiny_chat_prompts.jsonl").read_text())
    (tmp_path / "slow_agent.py").write_text(SLOW_PROGRAM)
    extra = f'[agent]\ncommand = ["{sys.executable}", "slow_agent.py"]\n[train]\nsteps = 4'
    cfg = agent_config(tmp_path, TINY_MODEL, prompts.name, extra)
    cfg.write_text(cfg.read_text().replace('function = "my_agent:run"\n', ""))
    proc = orchestrator("up", "--config", str(cfg), cwd=tmp_path)
    run = tmp_path / "runs/agent"
    try:
        wait_for_step(run, 2, proc)
        time.sleep(0.5)  # the next batch's sessions are mid-way
        os.kill(pid_of(run, "actor"), signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert "actor exited" in out or "restarting" in out, out
    assert_steps_once_and_nothing_lost(read_metrics(run), 4)


TOOL_AGENT = '''
import json
from pathlib import Path
from openai import OpenAI

CALLS = Path(__file__).parent / "calls"
TOOLS = json.loads((Path(__file__).parent / "tools.json").read_text())


def run(row, base_url, api_key):
    """Ask, run the tool the model calls, give it the result (streamed), save every call."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages, calls, finishes = list(row["prompt"]), [], []
    r = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=80)
    message = r.choices[0].message
    extra = r.choices[0].model_extra
    calls.append({"prompt": r.model_extra["prompt_token_ids"], "ids": extra["token_ids"],
                  "logprobs": extra["token_logprobs"]})
    finishes.append(r.choices[0].finish_reason)
    messages.append(message.model_dump(exclude_none=True))
    for tc in message.tool_calls or []:
        args = json.loads(tc.function.arguments)
        messages.append({"role": "tool", "tool_call_id": tc.id, "content": str(args["a"] + args["b"])})
    text = ""
    if message.tool_calls:
        chunks = list(client.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, max_tokens=8, stream=True))
        last = [c for c in chunks if c.choices][-1]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        extra = last.choices[0].model_extra
        calls.append({"prompt": last.model_extra["prompt_token_ids"], "ids": extra["token_ids"],
                      "logprobs": extra["token_logprobs"]})
        finishes.append(last.choices[0].finish_reason)
    CALLS.mkdir(exist_ok=True)
    (CALLS / f"{api_key}.json").write_text(json.dumps(calls))
    (CALLS / f"{api_key}.finishes").write_text(json.dumps(finishes))
    return float(text.strip() == "3")
'''


@pytest.mark.slow
def test_an_agent_s_tool_calls_come_back_in_openai_s_format_and_train_exactly(tmp_path):
    """On a model whose chat template defines tool calls: the model calls `add`, the agent
    runs it and sends the result (streamed); the learner trains the model's tokens only."""
    from tests.helpers import TOOL_PROMPT, TOOLS, make_tool_model, teach_tool_calls

    model = make_tool_model(tmp_path / "tool-model")
    teach_tool_calls(model)
    (tmp_path / "tools.json").write_text(json.dumps(TOOLS))
    (tmp_path / "tool_agent.py").write_text(TOOL_AGENT)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": TOOL_PROMPT, "answer": "3"}) + "\n")
    extra = """
[agent]
function = "tool_agent:run"
[sampling]
temperature = 0.2
max_tokens = 80
[train]
batch_size = 1
"""
    cfg = agent_config(tmp_path, model, prompts.name, extra)
    code, out = run_up(cfg, cwd=tmp_path)
    assert code == 0, out
    finishes = [json.loads(p.read_text()) for p in (tmp_path / "calls").glob("*.finishes")]
    assert finishes and all(f[0] == "tool_calls" and len(f) == 2 for f in finishes), finishes
    check_trained_exactly_what_was_served(tmp_path, turns=2)


EVAL_AGENT = '''
import json
from pathlib import Path
from openai import OpenAI


def run(row, base_url, api_key):
    """Two tries; the reward is 1 when the digit is in either answer. Saved for the test.
    A row whose answer is "fail" fails every session."""
    if row["answer"] == "fail":
        raise RuntimeError("this agent cannot answer this row")
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages, texts = list(row["prompt"]), []
    for _ in range(2):
        reply = client.chat.completions.create(model="m", messages=messages, max_tokens=4)
        texts.append(text := reply.choices[0].message.content)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "again"}]
    reward = float(any(row["answer"] in t for t in texts))
    out = Path(__file__).parent / "rewards"
    out.mkdir(exist_ok=True)
    (out / api_key).write_text(json.dumps({"answer": row["answer"], "reward": reward}))
    return reward
'''


@pytest.mark.slow
def test_actor_eval_runs_the_agent_on_held_out_rows_and_reports_pass_at_k(tmp_path):
    """Each held-out row as 4 sessions of the agent, which records its rewards: pass@k and
    the mean reward are theirs. A row none of whose sessions reports is unscored and left
    out of them, as a prompt whose rewards failed is in the other evaluations."""
    every = [json.loads(line) for line in (EXAMPLES / "tiny_chat_prompts.jsonl").read_text().splitlines()]
    rows = list({r["answer"]: r for r in every}.values())[:6]  # one row per answer
    rows.append({**rows[0], "answer": "fail"})  # the agent fails every session of this one
    (tmp_path / "held_out.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "eval_agent.py").write_text(EVAL_AGENT)
    extra = '[agent]\nfunction = "eval_agent:run"\n[eval]\nprompts = "held_out.jsonl"\nnum_samples = 4'
    cfg = agent_config(tmp_path, TINY_MODEL, "held_out.jsonl", extra)

    def recorded() -> dict[str, list[float]]:
        saved = [json.loads(p.read_text()) for p in (tmp_path / "rewards").iterdir()]
        assert len(saved) == 6 * 4
        by_row: dict[str, list[float]] = {}
        for s in saved:
            by_row.setdefault(s["answer"], []).append(s["reward"])
        return by_row

    shown = actor_eval_matches(cfg, tmp_path, recorded, threshold=1.0)
    assert shown["eval/prompts"] == "6" and shown["eval/unscored_prompts"] == "1"


@pytest.mark.slow
def test_up_evaluates_an_agent_before_the_first_step_and_after_the_last(tmp_path):
    every = [json.loads(line) for line in (EXAMPLES / "tiny_chat_prompts.jsonl").read_text().splitlines()]
    (tmp_path / "held_out.jsonl").write_text("".join(json.dumps(r) + "\n" for r in every[:4]))
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in every[4:]))
    (tmp_path / "eval_agent.py").write_text(EVAL_AGENT)
    extra = '[agent]\nfunction = "eval_agent:run"\n[eval]\nprompts = "held_out.jsonl"\nnum_samples = 2'
    code, out = run_up(agent_config(tmp_path, TINY_MODEL, "train.jsonl", extra), cwd=tmp_path)
    assert code == 0, out
    assert "eval at step 0: pass@1" in out and "eval at step 2: pass@1" in out, out
    evals = [m for m in read_metrics(tmp_path / "runs/agent") if "eval/pass@1" in m]
    assert [m["step"] for m in evals] == [0, 2]
    assert all(m["eval/prompts"] == 4 and 0 <= m["eval/pass@2"] <= 1 for m in evals)
    log = (tmp_path / "runs/agent/evaluation.log").read_text()
    assert log.count("eval/pass@1") == 2  # the base model's, then the trained adapters'


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_an_agent_s_reward_is_checked(served):
    """A reward that is no number, or turn_rewards that are not one per call, fail the
    session with the reason (it is started again, then its group dropped). This runner
    has no agent to start again: each new attempt fails at once, without a thread."""
    from actor.sessions import parse_reward

    assert parse_reward(0.5) == (0.5, None)
    assert parse_reward({"reward": 1, "turn_rewards": [0, 1]}) == (1.0, [0.0, 1.0])
    for bad in ("1", None, float("nan"), True, {"reward": 1, "turn_rewards": [1, "x"]}):
        with pytest.raises(ValueError):
            parse_reward(bad)
    s = served.session()
    served.client(s).chat.completions.create(model="tiny", messages=PROMPT, max_tokens=2)
    served.runner.report(s, {"reward": 1.0, "turn_rewards": [0.5, 0.5]})
    served.runner.end(s, None)
    assert s.failed == "the agent gave 2 turn_rewards for its 1 calls"
    deadline = time.monotonic() + 10
    while s.group.lost is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert s.group.lost == f"agent: {NO_AGENT} (3 attempts)"


@pytest.mark.slow
def test_a_run_s_64_sessions_share_decode_steps_on_its_timeline(tmp_path):
    """8 rows x 8 sessions a batch: the actor's timeline shows decode steps whose rows are
    the calls of many sessions at once."""
    from orchestrator.timeline import read_events

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text((EXAMPLES / "tiny_chat_prompts.jsonl").read_text())
    extra = "[sampling]\ngroup_size = 8\n[train]\nsteps = 1\nbatch_size = 8"
    code, out = run_up(agent_config(tmp_path, TINY_MODEL, prompts.name, extra), cwd=tmp_path)
    assert code == 0, out
    events = read_events(tmp_path / "runs/agent")
    actor = next(rows for name, rows in events.items() if name.startswith("actor"))
    rows = [e["args"]["rows"] for e in actor if e.get("name") == "decode step" and "args" in e]
    assert max(rows) >= 32, max(rows)


def test_the_smollm2_agent_example_loads_as_written():
    """examples/smollm2_agent.toml validates, its agent imports with the right arguments,
    and it reports a reward per try (its GiGPO step rewards)."""
    from actor.agents import load_agent_function
    from actor.sessions import parse_reward
    from runtime.config import load_config

    cfg = load_config(EXAMPLES / "smollm2_agent.toml")
    assert cfg.agent.enabled and cfg.algorithm.gigpo_omega > 0 and cfg.reward.functions == ("env",)
    run = load_agent_function(cfg.agent, cfg.reward.search_path)

    class Replies:  # OpenAI's client, answering from a list (the example's logic is tested)
        def __init__(self, texts):
            self.texts = list(texts)
            self.chat = self
            self.completions = self

        def create(self, **kw):
            from types import SimpleNamespace as N

            return N(choices=[N(message=N(content=self.texts.pop(0)))])

    module = __import__("sys").modules[run.__module__]
    row = {"prompt": [{"role": "user", "content": "What is 7 + 5?"}], "answer": "12"}
    for texts, want in ((["11", "It is 12."], (0.5, [0.0, 0.5])), (["1", "2", "3"], (0.0, [0.0, 0.0, 0.0]))):
        module.OpenAI = lambda **kw: Replies(texts)  # noqa: B023
        assert parse_reward(run(row=row, base_url="", api_key="")) == want

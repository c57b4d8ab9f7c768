"""What the tests share: the project's paths, a small run config, real processes started
and watched (the orchestrator, workers, the server), and checks of a run's files. Test
files import from here, never from each other or from conftest."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import protocol

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TINY_MODEL = EXAMPLES / "tiny-model"
ENV_WORKER = Path(__file__).parent / "workers" / "env_worker.py"
JUDGED = """
from tiny_task import reward as tiny

def judged(prompts, completions, completion_ids, target, ok=None, **kw):
    if ok is None:
        return tiny(prompts, completions, completion_ids, target)
    return [1.0 if o else 0.0 for o in ok]
"""
PLAIN_WORKER = Path(__file__).parent / "workers" / "plain_worker.py"
WORKER_CONFIG = "[reward]\ntimeout_s = 3.0\nmax_attempts = 10"


def trainer_for(
    model,
    name: str = "grpo",
    *,
    beta: float = 0.0,
    correction=None,
    micro: int = 0,
    fused: bool = False,
    logits=None,
    optimizer=None,
    temperature: float = 1.0,
    max_grad_norm: float = 1.0,
    epsilon: float | None = None,
    max_tokens: int = 6,
    sort_by_length: bool = True,
    share_prompts: bool = True,
    grad_checkpoint: bool = False,
):
    """learner.trainer.Trainer with these settings, built from the config sections as the
    learner builds it; `logits` (learner.batching.Logits, whole by default) and the optimizer
    (Adam at 1e-2 by default) set directly."""
    import mlx.optimizers as optim

    from learner.batching import WHOLE
    from learner.correction import Correction
    from learner.trainer import Trainer
    from runtime.config import AlgorithmConfig, SamplingConfig, TrainConfig

    c = correction or Correction()
    algorithm = AlgorithmConfig(
        name=name, beta=beta, epsilon=epsilon, is_correction=c.mode, is_level=c.level, is_cap=c.cap
    )
    train = TrainConfig(
        max_grad_norm=max_grad_norm,
        micro_batch_size=micro,
        fuse_old_logprobs=fused,
        logit_chunk_mb=0,
        sort_by_length=sort_by_length,
        share_prompts=share_prompts,
        grad_checkpoint=grad_checkpoint,
    )
    trainer = Trainer(
        model,
        algorithm,
        train,
        SamplingConfig(temperature=temperature, max_tokens=max_tokens),
        optimizer=optimizer or optim.Adam(learning_rate=1e-2),
    )
    trainer.logits = logits or WHOLE
    return trainer


def alive(pid: int) -> bool:
    """Whether `pid` runs. A zombie (exited, not yet reaped by a parent such as a
    container's init) counts as dead."""
    out = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout
    return bool(out.strip()) and not out.strip().startswith("Z")


@contextlib.contextmanager
def peer(run: Path, role: str):
    """A real `role` process ("actor" or "learner") for `run`, with this test's socket at
    the other end of the rollout socket: a ROUTER bound where the learner would be (the
    test plays the learner) or a DEALER connected to it (the test plays an actor). Yields
    (process, socket); the process is killed if still running, the socket closed."""
    import zmq

    import protocol

    ctx = zmq.Context()
    endpoint = protocol.read_endpoints(run)["learner"]
    if role == "actor":
        sock = ctx.socket(zmq.ROUTER)
        sock.bind(endpoint)
    else:
        sock = ctx.socket(zmq.DEALER)
        sock.connect(endpoint)
    args = ["actor", "run"] if role == "actor" else ["learner"]
    proc = subprocess.Popen(
        [sys.executable, "-m", *args, "--run-dir", str(run)],
        cwd=ROOT,
        stdout=open(run / f"{role}.log", "w"),
        stderr=subprocess.STDOUT,
    )
    try:
        yield proc, sock
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sock.close(linger=0)
        ctx.term()


def write_config(tmp_path: Path, extra: str = "", steps: int = 3, reward: str = "tiny_task:reward") -> Path:
    """A small copy of examples/tiny.toml whose run directory is inside tmp_path."""
    text = f"""
[model]
path = "{TINY_MODEL}"
[data]
prompts = "{EXAMPLES / "tiny_prompts.jsonl"}"
[sampling]
group_size = 4
max_tokens = 6
[train]
steps = {steps}
batch_size = 2
learning_rate = 3e-4
checkpoint_every = 0
[reward]
functions = ["{reward}"]
[run]
dir = "{tmp_path / "run"}"
"""
    # Reward modules are imported from beside the config, as a user's would be.
    shutil.copy(EXAMPLES / "tiny_task.py", tmp_path / "tiny_task.py")
    cfg = tmp_path / "run.toml"
    cfg.write_text(merge_toml(text, extra))
    return cfg


def merge_toml(base: str, extra: str) -> str:
    """Put each `[section]` block of `extra` under the same section of `base`; a key that
    both set takes `extra`'s value."""
    sections: dict[str, dict[str, str]] = {}
    for text in (base, extra):
        current = ""
        for line in text.strip().splitlines():
            if line.startswith("["):
                current = line.strip()
                sections.setdefault(current, {})
            elif line.strip():
                sections[current][line.split("=")[0].strip()] = line
    return "\n".join(f"{s}\n" + "\n".join(lines.values()) for s, lines in sections.items()) + "\n"


def orchestrator(*args: str, cwd: Path = ROOT, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator", *args],
        cwd=cwd,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        **kw,
    )


def run_up(cfg: Path, *args: str, timeout: float = 300, cwd: Path = ROOT) -> tuple[int, str]:
    proc = orchestrator("up", "--config", str(cfg), *args, cwd=cwd)
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def wait_for(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


def wait_for_step(run: Path, step: int, proc, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    path = run / "metrics.jsonl"
    while True:
        if path.exists() and any(
            json.loads(line)["step"] >= step for line in path.read_text().splitlines() if line.strip()
        ):
            return
        assert time.monotonic() < deadline and proc.poll() is None, "the run did not reach the step"
        time.sleep(0.05)


def pid_of(run: Path, name: str) -> int:
    return int(re.findall(r"\d+", (run / f"heartbeat.{name}").read_text())[0])


def assert_steps_once_and_nothing_lost(metrics: list[dict], steps: int) -> None:
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))  # no step repeats or gaps
    for m in metrics:
        assert m["groups_received"] == m["groups_trained"] + m["groups_dropped"] + m["groups_queued"]
    assert metrics[-1]["groups_trained"] == steps * 2


def start_worker(run: Path, *args: str, stdout=subprocess.DEVNULL) -> subprocess.Popen:
    wait_for(run / "endpoints.json")
    endpoint = protocol.read_endpoints(run)["reward"]
    return subprocess.Popen(
        [sys.executable, str(PLAIN_WORKER), endpoint, *args],
        text=True,
        stdout=stdout,
        stderr=subprocess.STDOUT,
    )


def finish(proc: subprocess.Popen, workers: list[subprocess.Popen]) -> str:
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
            w.wait()
    assert proc.returncode == 0, out
    return out


def assert_nothing_lost(metrics: list[dict], steps: int, batch: int) -> None:
    last = metrics[-1]
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert last["groups_trained"] == steps * batch
    for m in metrics:
        assert m["groups_received"] == m["groups_trained"] + m["groups_dropped"] + m["groups_queued"]


class Lines:
    """A process's stdout lines with the time each arrived, read by a thread."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[tuple[float, str]] = []
        self.thread = threading.Thread(target=self.read, args=(proc,), daemon=True)
        self.thread.start()

    def read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines.append((time.monotonic(), line.strip()))

    def wait_for(self, prefix: str, timeout: float = 120) -> tuple[float, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, line in list(self.lines):
                if line.startswith(prefix):
                    return t, line
            time.sleep(0.02)
        raise AssertionError(f"no line {prefix!r} within {timeout} s: {self.lines}")


def start_server(*args: str) -> tuple[subprocess.Popen, str]:
    """`actor serve ... --port 0`, and its base URL once it listens."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "actor", "serve", "--port", "0", *args],
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    line = proc.stdout.readline()
    found = re.search(r"on (http://\S+/v1)", line)
    if not found:
        proc.kill()
        raise AssertionError(f"no address: {line!r}")
    return proc, found.group(1)


def stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=30)


def held_out_config(tmp_path, extra: str = "", steps: int = 5, reward: str = "judged:judged"):
    (tmp_path / "judged.py").write_text(JUDGED)
    rows = [{"prompt": f"repeat {i}", "target": str(i), "ok": i in (1, 4, 6)} for i in range(8)]
    (tmp_path / "held_out.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return write_config(
        tmp_path,
        f'[eval]\nprompts = "{tmp_path / "held_out.jsonl"}"\nevery = 2\nnum_samples = 4\n{extra}',
        steps=steps,
        reward=reward,
    )


def raw_worker(endpoint: str, *args: str) -> subprocess.Popen:
    """The env worker written from PROTOCOL.md alone (pyzmq and msgpack, no project code)."""
    return subprocess.Popen(
        [sys.executable, str(ENV_WORKER), endpoint, *args],
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


CHAOS_KINDS = {
    "episodes": ("actor", "learner", "reward-worker", "env-worker", "orchestrator"),
    "actors": ("actor", "remote-actor", "learner", "reward-worker", "orchestrator"),
}


def check_chaos(tmp_path: Path, scenario: str) -> None:
    """`benchmarks.chaos`, short: one SIGKILL of each kind of `scenario`, then all its checks pass."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.chaos",
            "--kills",
            "1",
            "--seed",
            "1",
            "--scenario",
            scenario,
            "--steps-per-kill",
            "3",
            "--extra-steps",
            "2",
            "--work-dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    assert f"chaos, {scenario}:" in out, out
    for kind in CHAOS_KINDS[scenario]:
        assert f"| {kind} | 1 |" in out, out
    for check in (
        "every step exactly once",
        "ledger on every line",
        "no stall over 30 s",
        "workers and remote actor stayed to the end",
        "final adapters load",
        "resume twice, the same adapters",
        "no process left",
    ):
        assert f"| {check} | PASS |" in out, out


TEMPLATE = (
    "{% if tools %}<|system|>tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}<|end|>"
    "{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}"
    "<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}{% else %}{{ m['content'] }}{% endif %}"
    "<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "a + b",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            },
        },
    }
]


def make_tool_model(out: Path) -> Path:
    """A tiny random model in `out` whose tokenizer has JSON's characters and a Qwen-style
    `<tool_call>` template (mlx-lm's `json_tools` format)."""
    import mlx.core as mx
    from mlx_lm.models import llama

    from policy.tiny import CHARS, EOS, MODEL_CONFIG, SPECIAL_TOKENS, save_model

    chars = CHARS + [c for c in '<>|{}[]"_' if c not in CHARS]
    config = dict(
        MODEL_CONFIG, vocab_size=len(SPECIAL_TOKENS) + len(chars), eos_token_id=SPECIAL_TOKENS.index(EOS)
    )
    mx.random.seed(0)
    save_model(out, llama.Model(llama.ModelArgs.from_dict(config)), config, chars)
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    tokenizer_config.update(chat_template=TEMPLATE, tool_parser_type="json_tools")
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return out


TOOL_CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
TOOL_PROMPT = [{"role": "user", "content": "add 1 and 2"}]


def teach_tool_calls(model_dir: Path, steps: int = 400) -> None:
    """Train the tool model (all its weights) until it answers `TOOL_PROMPT` with `TOOL_CALL`
    and the tool's result `3` with `3`: a model that calls a tool, for tests of what
    happens around the call. Saves the weights in place."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten
    from mlx_lm import load

    model, tokenizer = load(str(model_dir))
    call = {"type": "function", "id": "call_0", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    after = [
        *TOOL_PROMPT,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "3"},
    ]
    pairs = [(TOOL_PROMPT, TOOL_CALL), (after, "3")]
    rows = []
    for messages, answer in pairs:
        prompt = tokenizer.apply_chat_template(
            messages, tools=TOOLS, add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer.encode(prompt + answer, add_special_tokens=False) + [tokenizer.eos_token_id]
        rows.append((ids, len(tokenizer.encode(prompt, add_special_tokens=False))))
    width = max(len(ids) for ids, _ in rows)
    tokens = mx.array([ids + [0] * (width - len(ids)) for ids, _ in rows])
    mask = mx.array([[1.0 if p <= i + 1 < len(ids) else 0.0 for i in range(width - 1)] for ids, p in rows])

    def loss_fn(m):
        logits = m(tokens[:, :-1])
        ce = nn.losses.cross_entropy(logits, tokens[:, 1:], reduction="none")
        return (ce * mask).sum() / mask.sum()

    optimizer = optim.Adam(learning_rate=3e-3)
    step = nn.value_and_grad(model, loss_fn)
    for _ in range(steps):
        loss, grads = step(model)
        optimizer.update(model, grads)
        mx.eval(model.parameters(), optimizer.state, loss)
    assert loss.item() < 0.01, f"the tool model did not learn its tool call (loss {loss.item():.3f})"
    mx.save_safetensors(
        str(model_dir / "model.safetensors"),
        dict(tree_flatten(model.parameters())),
        metadata={"format": "mlx"},
    )


def actor_eval_matches(cfg: Path, folder: Path, recorded, threshold: float) -> dict:
    """Run `actor eval --config CFG` from `folder`; check its pass@k and mean reward against
    `recorded()` (each held-out row's rewards, as the agent or the environment recorded
    them while it ran), computed here with the unbiased estimator. Returns what it printed."""
    import numpy as np
    import pytest

    from policy.evaluation import pass_at_k

    out = subprocess.run(
        [sys.executable, "-m", "actor", "eval", "--config", str(cfg)],
        cwd=folder,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    shown = dict(line.split() for line in out.stdout.splitlines())
    rewards: dict[str, list[float]] = recorded()
    n = len(next(iter(rewards.values())))
    for k in (1, 2, 4):
        expected = np.mean([pass_at_k(n, sum(r >= threshold for r in rs), k) for rs in rewards.values()])
        assert float(shown[f"eval/pass@{k}"]) == pytest.approx(expected, abs=1e-4)
    mean = np.mean([r for rs in rewards.values() for r in rs])
    assert float(shown["eval/reward_mean"]) == pytest.approx(mean, abs=1e-4)
    return shown

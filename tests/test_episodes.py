"""Multi-turn episodes: the rendering of environment turns, what the learner trains on,
and environment workers (this project's and one written from PROTOCOL.md alone) driving
real runs, one of them killed mid-episode."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

import protocol
from actor.episodes import EpisodeRunner, Renderer
from learner.algorithms import LossInputs, make_algorithm
from learner.batching import TrainRow, make_batch
from learner.groups import group_from_message
from policy.data import Prompt
from policy.model import load_policy
from protocol.worker_socket import WorkerPool
from runtime.config import EnvConfig, LoraConfig, SamplingConfig
from tests.helpers import (
    EXAMPLES,
    ROOT,
    TINY_MODEL,
    Lines,
    actor_eval_matches,
    assert_nothing_lost,
    finish,
    merge_toml,
    orchestrator,
    pid_of,
    raw_worker,
    read_metrics,
    run_up,
    trainer_for,
    wait_for,
    wait_for_step,
    write_config,
)
from transport.zeromq import ZeroMQ

pytestmark = pytest.mark.slow  # real processes end to end: left out of the fast subset


@pytest.fixture(scope="module")
def tokenizer():
    return load_policy(str(TINY_MODEL), LoraConfig())[1]


def text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False)


def test_environment_turns_are_the_chat_template_s_incremental_form(tokenizer):
    """Against the tiny template written out by hand: `<|role|>content<|end|>` per message,
    `<|assistant|>` as the generation prompt."""
    r = Renderer(tokenizer, set(tokenizer.eos_token_ids))
    chat = [{"role": "system", "content": "be brief."}, {"role": "user", "content": "repeat 3"}]
    assert text(tokenizer, r.prompt_ids(chat)) == "<|system|>be brief.<|end|><|user|>repeat 3<|end|>"
    assert text(tokenizer, r.first_turn(chat, None)) == "<|assistant|>"
    said = {"role": "user", "content": "go on"}
    assert text(tokenizer, r.first_turn(chat, said)) == "<|user|>go on<|end|><|assistant|>"
    # After a turn that ended with the EOS the model sampled (`<|end|>`), the template's end
    # of the assistant turn is already there; after a cut turn the environment closes it.
    assert text(tokenizer, r.next_turn(chat, said, after_eos=True)) == "<|user|>go on<|end|><|assistant|>"
    cut = r.next_turn(chat, said, after_eos=False)
    assert text(tokenizer, cut) == "<|end|><|user|>go on<|end|><|assistant|>"
    system = {"role": "system", "content": "no."}
    assert text(tokenizer, r.next_turn(chat, system, after_eos=True)) == "<|system|>no.<|end|><|assistant|>"
    # Text prompts: the observation's own tokens, nothing else.
    assert r.prompt_ids("repeat 3") == list(tokenizer.encode("repeat 3"))
    assert r.first_turn("repeat 3", None) == []
    assert text(tokenizer, r.next_turn("repeat 3", said, after_eos=True)) == "go on"


def perturbed_policy():
    """The tiny model with random LoRA weights, so that the adapters matter."""
    model, tokenizer, _ = load_policy(str(TINY_MODEL), LoraConfig())
    mx.random.seed(3)
    model.update(
        tree_unflatten(
            [
                (name, 0.05 * mx.random.normal(value.shape))
                for name, value in tree_flatten(model.trainable_parameters())
                if name.endswith("lora_b")
            ]
        )
    )
    mx.eval(model.parameters())
    return model, tokenizer


def test_a_three_turn_episode_trains_on_exactly_the_sampled_ids_with_ratio_one(tmp_path):
    """Episodes against the PROTOCOL.md worker, which records the action ids it received;
    the rollouts go through the wire and the learner's own batch code. At step 0 the
    learner's logprobs equal the behavior logprobs on every trained token, the trained
    tokens are the sampled ones, and the environment's tokens carry no loss weight."""
    model, tokenizer = perturbed_policy()
    eos = set(tokenizer.eos_token_ids)
    sampling = SamplingConfig(group_size=3, max_tokens=5, temperature=0.9, top_p=0.9, seed=7)
    env = EnvConfig(environment="socket", max_turns=3, max_episode_tokens=200)
    record = tmp_path / "actions.jsonl"
    net = ZeroMQ()
    pool = WorkerPool(
        net, f"ipc://{tmp_path}/env.sock", "env_worker", protocol.OBSERVATION, 30, 1, owner_role="actor"
    )
    worker = raw_worker(pool.endpoint, "--record", str(record))
    try:
        prompts = [
            Prompt(i, [{"role": "user", "content": f"repeat {d}"}], [], {"target": d})
            for i, d in enumerate("37")
        ]
        groups = EpisodeRunner(pool, model, tokenizer, eos, sampling, env).run(prompts, [0, 3])
    finally:
        pool.close("test over")
        worker.wait(10)
        net.close()
    actions: dict[str, list[int]] = {}
    for line in record.read_text().splitlines():
        r = json.loads(line)
        actions.setdefault(r["episode_id"], []).extend(r["action_ids"])

    samples, episodes = [], []
    for group in groups:
        header, arrays = group.fields(lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        frames = protocol.encode(
            protocol.ROLLOUT,
            {"group_id": "g", "policy_version": 0, "columns": {}, "prompt": group.prompt.prompt, **header},
            arrays,
        )
        g = group_from_message(b"actor", protocol.decode(frames), model.args.vocab_size, sampling.group_size)
        samples += [
            TrainRow(g.prompt_ids, ids, lp, fr, m)
            for ids, lp, fr, m in zip(g.completion_ids, g.logprobs, g.finish_reasons, g.loss_masks)
        ]
        episodes += group.episodes
    assert all(e.finish == "env_done" and e.model_turns == 3 for e in episodes)

    batch = make_batch(samples, tokenizer.pad_token_id)
    tokens, mask = np.array(batch.tokens), np.array(batch.mask)
    for row, (e, s) in enumerate(zip(episodes, samples)):
        targets = tokens[row, 1:]
        trained = targets[mask[row] == 1].tolist()
        assert trained == actions[f"{e.episode_id}/a1"]  # what the model sampled, as the env got it
        # The environment's tokens: the template's text, written out by hand.
        p = len(s.prompt_ids)
        env_runs, current = [], []
        for t, m in zip(targets[p - 1 : p - 1 + len(s.completion_ids)], mask[row, p - 1 :]):
            if m == 0:
                current.append(int(t))
            elif current:
                env_runs.append(text(tokenizer, current))
                current = []
        obs = f"<|user|>\nrepeat {e.prompt.columns['target']}<|end|><|assistant|>"
        turn_ends = [e.ids[i - 1] in eos for i in range(1, len(e.mask)) if e.mask[i - 1] and not e.mask[i]]
        assert env_runs == ["<|assistant|>"] + [("" if ended else "<|end|>") + obs for ended in turn_ends]

    # One micro-batch: the whole batch padded to its longest row, in the rows' order.
    (micro,) = (
        trainer_for(model, temperature=sampling.temperature, sort_by_length=False, share_prompts=False)
        .prepare(batch)
        .micro
    )
    assert micro.old is not None and micro.is_weight is not None
    old, behavior = np.array(micro.old), np.array(batch.behavior)
    assert int(mask.sum()) == sum(len(a) for a in actions.values())
    # 1e-4, as every other ratio-one check: the actor's cached decode and the learner's
    # whole-row forward sum in different orders (measured up to 1.1e-5 on CI's machine),
    # while a token off by one position is off by about 1.
    assert np.abs((old - behavior)[mask == 1]).max() < 1e-4
    assert (behavior[mask == 0] == 0).all()

    # Zero loss weight: the loss's gradient in the logprobs vanishes on environment tokens.
    algorithm = make_algorithm("grpo", max_tokens=sampling.max_tokens)
    adv = mx.array(np.linspace(-1, 1, len(samples)).astype(np.float32))
    logp = micro.old + 0.01  # off the old policy, so the clipped objective has a slope

    def loss(lp):
        return algorithm.loss_sum(LossInputs(lp, micro.old, None, adv, batch.mask, micro.is_weight))[0]

    grad = np.array(mx.grad(loss)(logp))
    assert (grad[mask == 0] == 0).all() and np.abs(grad[mask == 1]).min() > 0


def test_the_digits_example_learns(tmp_path):
    """examples/digits.toml, shortened: this project's env worker serves the example's
    class; the reward (the environment's) rises and step 1's ratio is 1."""
    code, out = run_up(EXAMPLES / "digits.toml", "--run-dir", str(tmp_path / "run"), "--steps", "10")
    assert code == 0, out
    metrics = read_metrics(tmp_path / "run")
    first, last = (np.mean([m["reward"] for m in part]) for part in (metrics[:4], metrics[-4:]))
    assert last > first + 0.15, (first, last)  # measured: 0.58 -> 0.88
    assert metrics[0]["sampling/sampling_logp_difference/max"] < 1e-4
    assert metrics[-1]["episodes/mean_model_turns"] == 3.0
    assert metrics[-1]["episodes/finish/env_done"] == 1.0
    assert_nothing_lost(metrics, 10, 8)
    shown = subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestrator",
            "show",
            "reward",
            "--run-dir",
            str(tmp_path / "run"),
            "--window",
            "4",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert shown.stdout.startswith(
        f"reward: first 4 steps {first:.3f}, last 4 steps {last:.3f} "
        f"({last - first:+.3f}; steps 1-4 and 7-10)"
    ), shown


ENV_CONFIG = """
[env]
environment = "socket"
max_turns = 3
max_episode_tokens = 64
timeout_s = 4.0
"""


def test_killing_an_env_worker_mid_episode_loses_nothing(tmp_path):
    """Two workers from PROTOCOL.md alone serve a run; one is SIGKILLed while it holds
    episodes. Those start again on the other (env_retries), and every group is trained on
    or dropped with a reason."""
    steps, batch = 6, 2
    cfg = write_config(tmp_path, ENV_CONFIG, steps=steps, reward="env")
    proc = orchestrator("up", "--config", str(cfg))
    run = tmp_path / "run"
    wait_for(run / "endpoints.json")
    endpoint = protocol.read_endpoints(run)["env"]
    doomed = raw_worker(endpoint, "--step-delay", "0.02")
    lines = Lines(doomed)
    wait_for_step(run, 1, proc)
    t0 = time.monotonic()
    while not any(t > t0 and line.startswith("reset") for t, line in lines.lines):
        assert proc.poll() is None, "the run ended first"
        time.sleep(0.005)
    doomed.send_signal(signal.SIGKILL)  # it holds that episode, and more of its batch
    survivor = raw_worker(endpoint)
    finish(proc, [doomed, survivor])
    metrics = read_metrics(run)
    assert_nothing_lost(metrics, steps, batch)
    assert metrics[-1]["env_retries"] >= 1
    log = (run / "actor.log").read_text()
    assert "starting it again" in log
    assert metrics[-1]["groups_dropped"] == 0  # a retry each sufficed


def test_an_env_worker_serves_a_python_class_and_says_what_is_wrong(tmp_path):
    """`orchestrator env-worker` refuses a spec that names no environment class."""
    (tmp_path / "envs.py").write_text("class NotAnEnv:\n    pass\n")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestrator",
            "env-worker",
            "envs:NotAnEnv",
            "--connect",
            f"ipc://{tmp_path}/x.sock",
            "--search-path",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "has no class 'NotAnEnv' with reset and step methods" in out.stderr


def test_a_template_that_rewrites_earlier_turns_is_refused_before_the_first_episode():
    """A template that renders only the last message (as some drop old reasoning) cannot
    be extended by appending tokens: a data error before any episode starts."""
    from policy.data import DataError

    _, tokenizer, _ = load_policy(str(TINY_MODEL), LoraConfig())
    tokenizer._tokenizer.chat_template = (
        "{% for m in messages[-1:] %}<|{{ m['role'] }}|>{{ m['content'] }}"
        "<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>"
        "{% endif %}"
    )
    r = Renderer(tokenizer, set(tokenizer.eos_token_ids))
    r.check("repeat 3")  # text prompts need no template
    with pytest.raises(DataError, match="does not render a conversation as the start of its continuation"):
        r.check([{"role": "user", "content": "repeat 3"}])


SLOW_ENV = '''
import time


class SlowEnv:
    """Three steps of 0.15 s each; rewards the share of "7"s."""

    def reset(self, prompt, **columns):
        self.turn = 0
        return ""

    def step(self, action):
        time.sleep(0.15)
        self.turn += 1
        return "\\nrepeat 7", action.count("7") / max(len(action), 1), self.turn == 3
'''


def test_a_python_env_worker_killed_mid_step_is_noticed_in_seconds(tmp_path):
    """`orchestrator up` serves a class whose steps take a while; its env worker, SIGKILLed
    in the middle of one, is restarted by the orchestrator, and the actor takes it for gone
    by its missing heartbeats (it beats while its environment works), long before the
    60 s deadline: the episodes start again on the new worker and nothing is lost."""
    (tmp_path / "slow_env.py").write_text(SLOW_ENV)
    cfg = write_config(
        tmp_path,
        '[env]\nenvironment = "slow_env:SlowEnv"\nmax_turns = 3\nmax_episode_tokens = 64',
        steps=3,
        reward="env",
    )
    proc = orchestrator("up", "--config", str(cfg))
    run = tmp_path / "run"
    lines = Lines(proc)
    _, started = lines.wait_for("started env-worker-0 (pid ")
    pid = int(started.split("pid ")[1].split(")")[0])
    wait_for_step(run, 1, proc)
    time.sleep(0.2)  # inside a step of the next batch's episodes
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    assert proc.wait(120) == 0, lines.lines
    assert time.monotonic() - t0 < 40  # the deadline (60 s) never had to pass
    metrics = read_metrics(run)
    assert_nothing_lost(metrics, 3, 2)
    log = (run / "actor.log").read_text()
    assert "sent nothing for" in log and "deadline" not in log
    assert metrics[-1]["env_retries"] >= 1
    assert any("env-worker-0 exited with code" in line for _, line in lines.lines)


def test_env_workers_attach_to_a_restarted_actor(tmp_path):
    """The actor owns the env socket: SIGKILL it mid-run, the orchestrator restarts it, and
    the env worker it started attaches to the new one by itself (its hello is answered
    with `attached: false`); the run finishes with nothing lost."""
    (tmp_path / "slow_env.py").write_text(SLOW_ENV.replace("time.sleep(0.15)", "time.sleep(0.01)"))
    cfg = write_config(
        tmp_path,
        '[env]\nenvironment = "slow_env:SlowEnv"\nmax_turns = 3\nmax_episode_tokens = 64',
        steps=4,
        reward="env",
    )
    proc = orchestrator("up", "--config", str(cfg))
    run = tmp_path / "run"
    lines = Lines(proc)
    wait_for_step(run, 1, proc)
    os.kill(pid_of(run, "actor"), signal.SIGKILL)
    assert proc.wait(120) == 0, lines.lines
    assert_nothing_lost(read_metrics(run), 4, 2)
    assert "the actor restarted (instance" in (run / "env-worker-0.log").read_text()
    assert any(line.startswith("actor exited with code") for _, line in lines.lines)


def episode_record(*paths: Path) -> dict[str, list[list[int]]]:
    """The model's turns (their sampled ids) of each episode's last attempt, from the
    `--record` files of the workers that served it."""
    attempts: dict[str, dict[int, list[list[int]]]] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            r = json.loads(line)
            base, attempt = r["episode_id"].rsplit("/a", 1)
            attempts.setdefault(base, {}).setdefault(int(attempt), []).append(r["action_ids"])
    return {base: by_attempt[max(by_attempt)] for base, by_attempt in attempts.items()}


def test_an_episode_that_starts_again_is_the_episode_an_uninterrupted_run_samples(tmp_path):
    """Three runs of the same two steps: one served by a single worker throughout, and two
    whose first worker goes partway through the first batch's second turn (it says `stop`
    instead of answering its 21st request, or is SIGKILLed on it) and a fresh worker
    takes over. The episodes that start again are the uninterrupted run's, turn for turn
    and token for token, and every group is trained on exactly as in that run."""
    runs, ups, workers = {}, {}, []
    extra = ENV_CONFIG + "[log]\ncompletions_every = 1\ncompletions_groups = 2\n"
    for name in ("uninterrupted", "left", "killed"):
        (tmp_path / name).mkdir()
        runs[name] = tmp_path / name / "run"
        ups[name] = orchestrator(
            "up", "--config", str(write_config(tmp_path / name, extra, steps=2, reward="env"))
        )
    try:
        for name, args in (
            ("uninterrupted", []),
            ("left", ["--leave-after", "20"]),
            ("killed", ["--die-after", "20"]),
        ):
            wait_for(runs[name] / "endpoints.json")
            workers.append(
                raw_worker(
                    protocol.read_endpoints(runs[name])["env"],
                    *args,
                    "--record",
                    str(runs[name].parent / "first.jsonl"),
                )
            )
        for w, name in zip(workers[1:], ("left", "killed")):
            w.wait(timeout=120)  # gone partway through the first batch
            workers.append(
                raw_worker(
                    protocol.read_endpoints(runs[name])["env"],
                    "--record",
                    str(runs[name].parent / "second.jsonl"),
                )
            )
        for up in ups.values():
            assert up.wait(timeout=240) == 0, up.communicate()[0]
    finally:
        for proc in (*workers, *ups.values()):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    completions = {
        name: [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
        for name, run in runs.items()
    }
    reference = episode_record(tmp_path / "uninterrupted" / "first.jsonl")
    for name in ("left", "killed"):
        metrics = read_metrics(runs[name])
        assert_nothing_lost(metrics, 2, 2)
        assert metrics[-1]["groups_dropped"] == 0 and metrics[-1]["env_retries"] >= 4
        assert episode_record(tmp_path / name / "first.jsonl", tmp_path / name / "second.jsonl") == reference
        for a, b in zip(completions["uninterrupted"], completions[name], strict=True):
            assert [t["role"] for t in b["turns"]] == ["assistant", "user"] * 2 + ["assistant"], b
            assert (a["turns"], a["tokens"], a["reward"]) == (b["turns"], b["tokens"], b["reward"])


def test_an_env_worker_waits_through_an_actor_restart(tmp_path):
    """SIGKILL the learner: the orchestrator restarts it with fresh actors, stopping the old
    actor, which tells its env workers `stop` with `final: false`. A worker written from
    PROTOCOL.md alone stays, attaches to the new actor, serves the run to its end and exits
    when the run is over (`final: true`)."""
    cfg = write_config(tmp_path, ENV_CONFIG + "[train]\ncheckpoint_every = 2\n", steps=5, reward="env")
    proc = orchestrator("up", "--config", str(cfg))
    run = tmp_path / "run"
    wait_for(run / "endpoints.json")
    worker = raw_worker(protocol.read_endpoints(run)["env"])
    said = Lines(worker)
    try:
        wait_for_step(run, 2, proc)
        os.kill(pid_of(run, "learner"), signal.SIGKILL)
        out, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0, out
        assert worker.wait(timeout=30) == 0
    finally:
        for p in (proc, worker):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert_nothing_lost(read_metrics(run), 5, 2)
    lines = [line for _, line in said.lines]
    assert any(line.startswith("waiting: the actor stops; a new one will come") for line in lines), lines
    assert "reattached" in lines and lines[-1] == "stopped: the run is over"


RECORDED_DIGITS = '''
import json, os
from pathlib import Path

from digits_env import DigitsEnv


class Recorded(DigitsEnv):
    """The example's environment, writing each episode's total reward for the test."""

    def reset(self, prompt, digits, **columns):
        self.total = 0.0
        return super().reset(prompt, digits, **columns)

    def step(self, action):
        observation, reward, done = super().step(action)
        self.total += reward
        if done:
            out = Path(__file__).parent / "episodes"
            out.mkdir(exist_ok=True)
            (out / f"{os.getpid()}-{id(self)}").write_text(json.dumps([self.digits, self.total]))
        return observation, reward, done
'''


def digits_eval_config(tmp_path, extra: str = "") -> Path:
    shutil.copy(EXAMPLES / "digits_env.py", tmp_path / "digits_env.py")
    (tmp_path / "recorded.py").write_text(RECORDED_DIGITS)
    rows = (EXAMPLES / "digits_prompts.jsonl").read_text().splitlines()
    (tmp_path / "train.jsonl").write_text("\n".join(rows[6:]) + "\n")
    (tmp_path / "held_out.jsonl").write_text("\n".join(rows[:6]) + "\n")
    text = "\n".join(
        line for line in (EXAMPLES / "digits.toml").read_text().splitlines() if not line.startswith("#")
    )
    text = text.replace('"tiny-model"', f'"{EXAMPLES / "tiny-model"}"').replace(
        "digits_prompts.jsonl", "train.jsonl"
    )
    text = text.replace('"digits_env:DigitsEnv"', '"recorded:Recorded"')
    cfg = tmp_path / "digits.toml"
    cfg.write_text(
        merge_toml(
            text, '[eval]\nprompts = "held_out.jsonl"\nnum_samples = 4\npass_threshold = 0.5\n' + extra
        )
    )
    return cfg


def test_actor_eval_plays_an_environment_s_held_out_episodes(tmp_path):
    """pass@k and the mean reward of the environment's episodes, as recorded by the
    environment itself."""
    cfg = digits_eval_config(tmp_path)

    def recorded() -> dict[str, list[float]]:
        episodes = [json.loads(p.read_text()) for p in (tmp_path / "episodes").iterdir()]
        assert len(episodes) == 6 * 4
        by_row: dict[str, list[float]] = {}
        for digits, total in episodes:
            by_row.setdefault(digits, []).append(total)
        assert len(by_row) == 6
        return by_row

    actor_eval_matches(cfg, tmp_path, recorded, threshold=0.5)


def test_up_evaluates_an_environment_before_the_first_step_and_after_the_last(tmp_path):
    cfg = digits_eval_config(tmp_path, "")
    code, out = run_up(cfg, "--run-dir", str(tmp_path / "run"), "--steps", "2")
    assert code == 0, out
    assert "evaluating the environment" in out and "eval at step 2: pass@1" in out, out
    evals = [m for m in read_metrics(tmp_path / "run") if "eval/pass@1" in m]
    assert [m["step"] for m in evals] == [0, 2] and all(m["eval/prompts"] == 6 for m in evals)

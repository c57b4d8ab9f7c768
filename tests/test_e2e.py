"""End to end: real orchestrator, learner and actor processes over real ZeroMQ sockets."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
import zmq.auth

import protocol
from orchestrator.launch import free_ports
from runtime.config_sections import ALGORITHM_NAMES
from tests.helpers import ROOT, WORKER_CONFIG, orchestrator, read_metrics, run_up, wait_for, write_config

pytestmark = pytest.mark.slow  # real processes end to end: left out of the fast subset

REQUIRED_METRICS = {
    "step",
    "policy_version",
    "reward",
    "reward_std",
    "loss",
    "kl",
    "clip_ratio/region_mean",
    "mismatch_kl",
    "completions/mean_length",
    "rollout_tokens_per_s",
    "step_s",
    "learner_peak_mb",
    "actor_peak_mb",
}


def test_up_trains_end_to_end(tmp_path):
    code, out = run_up(write_config(tmp_path, steps=3))
    run = tmp_path / "run"
    assert code == 0, out
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert [m["policy_version"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert REQUIRED_METRICS <= m.keys()
        assert all(np.isfinite(m[k]) for k in REQUIRED_METRICS), m
        # nothing lost: every group received is trained, dropped with a reason, or queued
        assert m["groups_received"] == m["groups_trained"] + m["groups_dropped"] + m["groups_queued"]
    # Step 0: identical weights on both sides, float32. Tolerance: KL 1e-8, |diff| 1e-4.
    assert metrics[0]["mismatch_kl"] < 1e-8 and metrics[0]["sampling/sampling_logp_difference/max"] < 1e-4
    assert metrics[-1]["groups_trained"] == 3 * 2
    for m in metrics:  # weight sync, measured on both sides
        assert m["weights_mb"] > 0 and m["weights_serialize_s"] >= 0
        assert 0 <= m["weights_transfer_s"] < 10 and 0 <= m["weights_apply_s"] < 10
    assert all(m["version_lag_mean"] == 0 for m in metrics)  # max_staleness = 0: on-policy
    endpoints = json.loads((run / "endpoints.json").read_text())
    assert endpoints["learner"].startswith("ipc://")
    sock_dir = Path(endpoints["learner"][len("ipc://") :]).parent
    assert oct(sock_dir.stat().st_mode & 0o777) == "0o700"
    assert (run / "learner.log").stat().st_size > 0 and (run / "actor.log").exists()
    assert "step    3/3" in out

    from mlx_lm import generate, load

    model, tok = load(
        json.loads((run / "config.json").read_text())["model"]["path"], adapter_path=str(run / "adapters")
    )
    assert len(generate(model, tok, "repeat 3", max_tokens=4)) > 0


def test_default_run_raises_the_reward(default_run):
    """README promises: over the default run, the mean reward of the last 5 steps exceeds
    that of the first 5 by at least 0.2."""
    rewards = [m["reward"] for m in read_metrics(default_run)]
    assert len(rewards) == 60
    assert np.mean(rewards[-5:]) - np.mean(rewards[:5]) >= 0.2, rewards


SHADOWS = ("protocol", "runtime", "transport", "policy", "learner", "actor", "orchestrator")
# The user's `rewards.py` also holds their environment: both are loaded from beside the
# config while the project's own `rewards` package is loaded too.
USER_S_REWARDS = """
def correctness(prompts, completions, **columns):
    return [0.25] * len(completions)


class Env:
    def reset(self, prompt, **columns):
        return ""

    def step(self, action):
        return "", 0.25, True
"""


def a_user_s_folder(
    tmp_path: Path, extra: str = "", steps: int = 1, reward: str = "rewards:correctness"
) -> Path:
    """A folder as a user keeps one: the config (`run.toml`), their `rewards.py`, and
    modules named like each of the project's other packages, which fail loudly if imported
    in their place."""
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "rewards.py").write_text(USER_S_REWARDS)
    for name in SHADOWS:
        (tmp_path / f"{name}.py").write_text(f"raise ImportError('{name}.py of the user shadowed ours')\n")
    write_config(tmp_path, extra, steps=steps, reward=reward)
    return tmp_path


def command(name: str) -> str:
    """The console script `name` (orchestrator, actor), as a user runs it."""
    script = Path(sys.executable).parent / name
    assert script.exists(), f"pip install -e . puts the {name} command beside python"
    return str(script)


def started(folder: Path, name: str, *args: str, log: str) -> subprocess.Popen:
    """`name args...` run in the user's folder, its output in `folder/log`."""
    with open(folder / log, "w") as out:
        return subprocess.Popen([command(name), *args], cwd=folder, stdout=out, stderr=subprocess.STDOUT)


def ended(procs: list[subprocess.Popen | None]) -> None:
    for proc in procs:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


def run_ends(folder: Path, up: subprocess.Popen, beside: dict[str, subprocess.Popen]) -> None:
    """Wait for `up` (logging to up.log) to end with 0, and then each process started
    beside it (logging to its key); fail at once, with its log, when one of those exits
    with an error while the run waits for it."""
    deadline = time.monotonic() + 300
    while up.poll() is None:
        for log, proc in beside.items():
            assert proc.poll() in (None, 0), (folder / log).read_text()
        assert time.monotonic() < deadline, (folder / "up.log").read_text()
        time.sleep(0.1)
    assert up.returncode == 0, (folder / "up.log").read_text()
    for log, proc in beside.items():
        assert proc.wait(timeout=60) == 0, (folder / log).read_text()


def test_a_user_s_folder_never_shadows_the_project(tmp_path):
    """`orchestrator up` run in a folder holding `rewards.py` (and `protocol.py`, ...): the
    children started as `python -m learner` put that folder first on sys.path, and the
    learner died on `No module named 'rewards.functions'`. The user's `rewards.py` is still
    theirs: its reward function scores the run."""
    folder = a_user_s_folder(tmp_path)
    done = subprocess.run(
        [command("orchestrator"), "up", "--config", "run.toml"],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr + (folder / "run" / "learner.log").read_text()
    assert read_metrics(folder / "run")[0]["reward"] == 0.25


def test_orchestrator_start_from_a_user_s_folder(tmp_path):
    """`orchestrator.start` called by a script elsewhere while the working directory is a
    user's folder that shadows the project's packages."""
    folder = a_user_s_folder(tmp_path / "user")
    script = tmp_path / "scripts" / "train.py"
    script.parent.mkdir()
    script.write_text(
        "import orchestrator\n"
        "with orchestrator.start('run.toml', {'train.steps': 2}) as run:\n"
        "    print([m['reward'] for m in run.metrics()])\n"
        "    raise SystemExit(run.wait())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(script)], cwd=folder, capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[0.25, 0.25]" in done.stdout


def test_a_remote_actor_and_a_reward_worker_from_a_user_s_folder(tmp_path):
    """`actor run` (a remote slot's actor) and `orchestrator reward-worker
    rewards:correctness`, each started by hand in the user's folder: neither imports the
    user's modules in place of the project's, the worker serves the user's function from
    their `rewards.py` (which the project's `rewards` package does not hide), and the
    actor's groups are trained."""
    folder = a_user_s_folder(tmp_path, f"[actor]\ncount = 2\nremote = 1\n{WORKER_CONFIG}", 3, "worker")
    up = remote = worker = None
    try:
        up = started(folder, "orchestrator", "up", "--config", "run.toml", log="up.log")
        wait_for(folder / "run" / "endpoints.json")
        remote = started(folder, "actor", "run", "--run-dir", "run", "--slot", "1", log="remote.log")
        deadline, learner_log = time.monotonic() + 120, folder / "run" / "learner.log"
        while not learner_log.exists() or "attached as slot 1" not in learner_log.read_text():
            assert time.monotonic() < deadline, (folder / "remote.log").read_text()
            assert up.poll() is None and remote.poll() is None, (folder / "remote.log").read_text()
            time.sleep(0.1)
        worker = started(
            folder,
            "orchestrator",
            "reward-worker",
            "rewards:correctness",
            "--run-dir",
            "run",
            log="worker.log",
        )
        run_ends(folder, up, {"remote.log": remote, "worker.log": worker})
    finally:
        ended([remote, worker, up])
    metrics = read_metrics(folder / "run")
    assert [m["reward"] for m in metrics] == [0.25] * 3
    assert metrics[-1]["groups_received_by_actor"].get("1", 0) > 0, metrics[-1]  # the remote one's


@pytest.mark.parametrize("by", ["up", "hand"])
def test_an_env_worker_from_a_user_s_folder(tmp_path, by):
    """The env worker `up` starts for `environment = "rewards:Env"`, and one started by
    hand (`orchestrator env-worker rewards:Env --run-dir run`) for a socket environment:
    both in the user's folder, both serve the user's class from their `rewards.py`."""
    environment = "rewards:Env" if by == "up" else "socket"
    extra = f'[env]\nenvironment = "{environment}"\nmax_turns = 2\nmax_episode_tokens = 32'
    folder = a_user_s_folder(tmp_path, extra, 2, "env")
    up = worker = None
    try:
        up = started(folder, "orchestrator", "up", "--config", "run.toml", log="up.log")
        if by == "hand":
            wait_for(folder / "run" / "endpoints.json")
            worker = started(
                folder, "orchestrator", "env-worker", "rewards:Env", "--run-dir", "run", log="worker.log"
            )
        run_ends(folder, up, {"worker.log": worker} if worker is not None else {})
    finally:
        ended([worker, up])
    assert [m["reward"] for m in read_metrics(folder / "run")] == [0.25] * 2
    assert (folder / "run" / "env-worker-0.log").exists() == (by == "up")


@pytest.mark.parametrize("subcommand", ["sample", "eval", "serve"])
def test_actor_commands_from_a_user_s_folder(tmp_path, subcommand):
    """`actor sample`, `actor eval` and `actor serve` with the user's config, in their
    folder: each runs, and the first two score with the user's `rewards.py`."""
    prompts = ROOT / "examples" / "tiny_prompts.jsonl"
    folder = a_user_s_folder(tmp_path, f'[eval]\nprompts = "{prompts}"\nnum_samples = 2\nlimit = 2')
    if subcommand != "serve":
        args = ["--num-samples", "2", "--limit", "2"] if subcommand == "sample" else []
        done = subprocess.run(
            [command("actor"), subcommand, "--config", "run.toml", *args],
            cwd=folder,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        shown = dict(line.split() for line in done.stdout.splitlines() if line.strip())
        if subcommand == "sample":
            rows = [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]
            assert len(rows) == 4 and {r["reward"] for r in rows} == {0.25}, rows
        else:
            assert float(shown["eval/reward_mean"]) == 0.25, done.stdout
        return
    server = subprocess.Popen(
        [command("actor"), "serve", "--config", "run.toml", "--port", "0"],
        cwd=folder,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines = []
        while not (found := re.search(r"on (http://\S+/v1)", line := server.stdout.readline())):
            assert line, "".join(lines)  # it exited before listening
            lines.append(line)
        request = urllib.request.Request(
            found.group(1) + "/completions",
            json.dumps({"prompt": "repeat 3", "max_tokens": 3}).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.status == 200 and json.load(response)["choices"], response
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 128 + signal.SIGTERM  # stopped as asked
    finally:
        ended([server])


def test_learner_survives_malformed_messages(tmp_path):
    """Three malformed messages and a rollout from a peer that never said hello: the learner
    counts each, drops the rollout, and trains on. The run is long and the test stops it
    once the learner has counted them: a run of a few steps of the tiny model can end in
    half a second, before the messages arrive (it did, on a loaded CI machine)."""
    proc = orchestrator("up", "--config", str(write_config(tmp_path, steps=100000)), start_new_session=True)
    run = tmp_path / "run"
    try:
        wait_for(run / "endpoints.json")
        sent_and_counted(run, proc)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: a clean stop
        out, _ = proc.communicate(timeout=60)
    finally:
        ended([proc])
    assert proc.returncode == 130, out
    last = read_metrics(run)[-1]
    assert last["messages_rejected"] == 3
    assert last["dropped_reasons"] == {"no handshake": 1}
    log = (run / "learner.log").read_text()
    assert "not valid msgpack" in log and "protocol version 99" in log and "needs 4000 bytes" in log


def sent_and_counted(run: Path, proc: subprocess.Popen) -> None:
    """Send the malformed messages to the learner's socket, and wait until its metrics count
    them (a step after they arrived)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(protocol.read_endpoints(run)["learner"])
    rollout = protocol.encode(
        protocol.ROLLOUT,
        {
            "group_id": "x",
            "policy_version": 0,
            "prompt": "p",
            "columns": {},
            "texts": ["a"],
            "finish_reasons": ["stop"],
        },
        {
            "prompt_ids": np.array([1], np.int32),
            "completion_ids": np.array([2], np.int32),
            "completion_lens": np.array([1], np.int32),
            "logprobs": np.array([-1.0], np.float32),
        },
    )
    garbage = [
        [b"\xc1 not msgpack"],
        [msgpack.packb({"protocol": 99, "kind": "rollout"})],
        [
            msgpack.packb(
                {
                    "protocol": 1,
                    "kind": "weights",
                    "version": 1,
                    "arrays": [{"name": "w", "dtype": "float32", "shape": [1000]}],
                }
            ),
            b"short",
        ],
        rollout,  # well-formed, but from a peer that never said hello
    ]
    for frames in garbage:
        sock.send_multipart(frames)
    deadline = time.monotonic() + 120
    try:
        while True:
            try:
                metrics = read_metrics(run) if (run / "metrics.jsonl").exists() else []
            except ValueError:  # a line half written
                metrics = []
            if metrics and metrics[-1]["messages_rejected"] == 3 and metrics[-1]["dropped_reasons"]:
                return
            assert time.monotonic() < deadline and proc.poll() is None, metrics[-1:]
            time.sleep(0.2)
    finally:
        sock.close(linger=0)
        ctx.term()


def test_ctrl_c_stops_both_processes_and_keeps_the_adapters(tmp_path):
    proc = orchestrator("up", "--config", str(write_config(tmp_path, steps=100000)), start_new_session=True)
    run = tmp_path / "run"
    deadline = time.monotonic() + 120
    while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.2)
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends on Ctrl-C
    out, _ = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 40
    assert proc.returncode == 130, out
    pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", out)]
    assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert (run / "adapters" / "adapters.safetensors").exists()
    assert json.loads((run / "status.json").read_text())["phase"] == "stopped"
    # the learner wrote a checkpoint of the step it stopped at
    state = json.loads(sorted((run / "checkpoints").glob("step_*"))[-1].joinpath("state.json").read_text())
    assert state["step"] == read_metrics(run)[-1]["step"]


OBJECTIVES = list(ALGORITHM_NAMES)  # every built-in loss
# the others: clip_ratio/low_mean, high_mean
CLIPPED = {"cispo": ["cispo_clip_ratio"], "sapo": [], "vespo": ["vespo/phi_seq_mean"]}


@pytest.fixture(scope="module")
def objective_runs(tmp_path_factory) -> dict[str, tuple[int, str, Path]]:
    """One run per objective, all started at once (small runs wait on each other's
    processes often enough that several together take about 60% of them in a row), each to its
    end before any test looks: (exit code, output, run directory) by name."""
    extra = [
        "--set",
        "algorithm.beta=0.04",
        "--set",
        "algorithm.num_iterations=2",
        "--set",
        "train.micro_batch_size=3",
        "--set",
        "algorithm.is_correction=truncate",
    ]
    procs = {}
    try:
        for name in OBJECTIVES:
            tmp = tmp_path_factory.mktemp(name)
            cfg = write_config(tmp, steps=3)
            proc = orchestrator("up", "--config", str(cfg), "--set", f"algorithm.name={name}", *extra)
            procs[name] = (proc, tmp / "run")
        outputs = {name: proc.communicate(timeout=300)[0] for name, (proc, _) in procs.items()}
        return {name: (proc.returncode, outputs[name], run) for name, (proc, run) in procs.items()}
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("name", OBJECTIVES)
def test_every_objective_trains_end_to_end(objective_runs, name):
    code, out, run = objective_runs[name]
    assert code == 0, out
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert [m["iteration"] for m in metrics] == [0, 1, 0]  # two optimizer steps per batch
    for m in metrics:
        clipped = CLIPPED.get(name, ["clip_ratio/low_mean", "clip_ratio/high_mean"])
        for key in (
            "loss",
            "surrogate_loss",
            "kl",
            *clipped,
            "entropy",
            "learner/padding_ratio",
            "advantage_mean",
            "advantage_std",
            "is_ratio_mean",
            "is_cut_frac",
            "sampling/importance_sampling_ratio/mean",
            "completions/max_length",
            "completions/clipped_ratio",
            "num_tokens",
            "learning_rate",
        ):
            assert np.isfinite(m[key]), (key, m)
        assert m["groups_received"] == m["groups_trained"] + m["groups_dropped"] + m["groups_queued"]
    assert metrics[0]["ratio_min"] == 1.0 == metrics[0]["ratio_max"]  # first pass on a fresh batch
    if name == "dapo":
        dropped = metrics[-1]["dropped_reasons"]
        assert set(dropped) <= {"filtered: equal rewards"}


def test_ratio_is_one_at_step_zero_with_temperature_and_top_p(tmp_path):
    """Temperature 0.7 and top-p 0.9: the actor's behavior logprobs and the learner's
    recomputed ones agree at step 0 (importance ratio 1 within 1e-4)."""
    cfg = write_config(tmp_path, "[sampling]\ntemperature = 0.7\ntop_p = 0.9", steps=1)
    code, out = run_up(cfg)
    assert code == 0, out
    first = read_metrics(tmp_path / "run")[0]
    assert abs(first["is_ratio_min"] - 1) < 1e-4 and abs(first["is_ratio_max"] - 1) < 1e-4
    assert first["mismatch_kl"] < 1e-8


def test_a_tcp_run_is_curve_encrypted_and_refuses_a_stranger_actor(tmp_path):
    """run.transport = "tcp" without `insecure`: `up` makes CURVE keys (owner-only), and
    the actor and a reward worker connect with them. An actor with a key of its own
    (another machine's copy of the run's config and endpoints, the server's public key,
    but a client key the run never listed) is refused: it exits 4 saying so, the learner
    logs the refusal, and the run is unaffected (every group trained, none dropped). The
    run's rewards come from a worker started only once the stranger is gone, so the run
    cannot end before the stranger has knocked, however the processes are scheduled."""
    from runtime.config import load_config, write_run_config

    port = free_ports(1)[0]
    cfg = write_config(tmp_path, f'[run]\ntransport = "tcp"\nport = {port}', steps=6, reward="worker")
    run = tmp_path / "run"
    # The stranger: a run directory of its own, as on another Mac, with a foreign key.
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    write_run_config(stranger, load_config(cfg))
    protocol.write_endpoints(stranger, protocol.make_endpoints(stranger, "tcp", "127.0.0.1", port))
    keys = stranger / "keys"
    keys.mkdir()
    zmq.auth.create_certificates(keys, "client")
    up = orchestrator("up", "--config", str(cfg))
    actor = worker = None
    try:
        while not (run / "keys" / "server.key").exists():
            assert up.poll() is None, up.communicate()[0]
            time.sleep(0.05)
        (keys / "server.key").write_bytes((run / "keys" / "server.key").read_bytes())
        actor = subprocess.Popen(
            [sys.executable, "-m", "actor", "run", "--run-dir", str(stranger), "--key-dir", str(keys)],
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        actor_out, _ = actor.communicate(timeout=240)
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "orchestrator",
                "reward-worker",
                "tiny_task:reward",
                "--run-dir",
                str(run),
            ],
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        out, _ = up.communicate(timeout=300)
        worker.wait(timeout=60)
    finally:
        for proc in (actor, worker, up):
            if proc is not None:
                proc.kill()
                proc.wait()
    assert actor.returncode == 4, actor_out
    assert "cannot connect to the learner: it refused our CURVE key" in actor_out
    assert up.returncode == 0, out
    assert worker.returncode == 0  # the learner told it to stop: the run is over
    assert "refused a connection to the rollout socket" in (run / "learner.log").read_text()
    endpoints = json.loads((run / "endpoints.json").read_text())
    assert endpoints == {
        "learner": f"tcp://127.0.0.1:{port}",
        "reward": f"tcp://127.0.0.1:{port + 1}",
        "env": f"tcp://127.0.0.1:{port + 2}",
    }
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == list(range(1, 7))
    assert metrics[-1]["groups_dropped"] == 0 and metrics[-1]["groups_trained"] == 12
    assert oct((run / "keys").stat().st_mode & 0o777) == "0o700"
    assert oct((run / "keys" / "server.key_secret").stat().st_mode & 0o777) == "0o600"


def test_an_insecure_tcp_run_trains_without_keys(tmp_path):
    port = free_ports(1)[0]
    cfg = write_config(tmp_path, f'[run]\ntransport = "tcp"\ninsecure = true\nport = {port}', steps=2)
    code, out = run_up(cfg)
    assert code == 0, out
    assert not (tmp_path / "run" / "keys").exists()
    assert "plain TCP: no encryption, no authentication" in (tmp_path / "run" / "learner.log").read_text()
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1, 2]


@pytest.mark.parametrize("dense", [True, False])
def test_a_quantized_actor_trains_and_its_mismatch_shows(tmp_path, dense):
    """actor.quantize_bits = 4: the actor samples from 4-bit base weights while the learner
    trains full precision. The run completes, the mismatch is there in the metrics (it is 0
    to float precision with a full-precision actor, see the test above), and the
    truncated-IS correction acts on it. On the CPU the rounded weights are held as float32
    unless model.dequantize_on_cpu = false."""
    cfg = write_config(tmp_path, '[algorithm]\nis_correction = "truncate"', steps=2)
    code, out = run_up(
        cfg, "--set", "actor.quantize_bits=4", "--set", f"model.dequantize_on_cpu={str(dense).lower()}"
    )
    assert code == 0, out
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == [1, 2]
    assert metrics[0]["mismatch_kl"] > 1e-6 and metrics[0]["is_ratio_max"] > 1.0
    log = (tmp_path / "run" / "actor.log").read_text()
    assert "(base weights: 4-bit)" in log
    assert ("rounded to 4 bits and held as float32" in log) == dense
    assert ("rounded to that many bits and held as float32" in out) == dense


def test_completions_are_logged_at_the_configured_steps_and_shown(tmp_path):
    """log.completions_every = 2, one group each: completions.jsonl holds steps 2 and 4,
    each completion with its rewards, advantage and finish reason; `orchestrator show
    completions` prints one of them."""
    cfg = write_config(tmp_path, "[log]\ncompletions_every = 2\ncompletions_groups = 1", steps=4)
    code, out = run_up(cfg)
    assert code == 0, out
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2] * 4 + [4] * 4  # one group of G = 4, twice
    metrics = read_metrics(run)
    for step in (2, 4):
        group = [r for r in rows if r["step"] == step]
        assert len({r["group_id"] for r in group}) == 1 and [r["index"] for r in group] == [0, 1, 2, 3]
        assert all(r["rewards"].keys() == {"reward"} and r["reward"] == r["rewards"]["reward"] for r in group)
        rewards = np.array([r["reward"] for r in group])
        advantages = np.array([r["advantage"] for r in group])
        # GRPO's advantage of each completion, from its group's rewards (scale_rewards = group)
        expected = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-4)
        np.testing.assert_allclose(advantages, expected, atol=1e-3)
        assert all(r["finish_reason"] in ("stop", "length") and 0 < r["tokens"] <= 6 for r in group)
        assert group[0]["policy_version"] <= step - 1 and metrics[step - 1]["step"] == step
    shown = orchestrator("show", "completions", "--run-dir", str(run), "--step", "2", "--width", "200")
    text, _ = shown.communicate(timeout=60)
    assert shown.returncode == 0, text
    assert "step 2" in text and rows[0]["prompt"] in text
    assert rows[0]["completion"].replace("\n", " ⏎ ") in text
    for args, said in (
        (["--step", "3"], "no completions logged at step 3; logged steps: 2, 4"),
        (["--run-dir", str(tmp_path / "nope")], "nope does not exist; give the run.dir"),
    ):
        shown = orchestrator("show", "completions", "--run-dir", str(run), *args)
        text, _ = shown.communicate(timeout=60)
        assert shown.returncode == 2 and said in text, text


def test_plot_writes_a_png_of_the_run_s_curves(default_run, tmp_path):
    """`orchestrator plot` on the default run: a PNG of six panels that is not blank; a
    metrics file without some metrics still plots (those panels say so)."""
    import matplotlib.image

    out = tmp_path / "curves.png"
    proc = orchestrator("plot", "--run-dir", str(default_run), "--out", str(out))
    text, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and f"wrote {out}" in text, text
    image = matplotlib.image.imread(str(out))
    assert image.shape[:2] == (650, 1700) and image[..., :3].std() > 0.05  # drawn on, not blank
    sparse = tmp_path / "sparse"
    sparse.mkdir()
    lines = [json.dumps({"step": s, "reward": s / 10}) + "\n" for s in (1, 2)]
    (sparse / "metrics.jsonl").write_text("".join(lines))
    proc = orchestrator("plot", "--run-dir", str(sparse))
    assert proc.communicate(timeout=120)[0].strip() == f"wrote {sparse / 'curves.png'}"
    assert (sparse / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_group_too_large_for_the_wire_is_dropped_with_the_reason(tmp_path):
    """A data row whose columns alone pass the protocol's 16 MiB header limit: the learner's
    socket would refuse the rollout unread (and an on-policy run would wait for it
    forever), so the actor sends it as a dropped group, naming the sizes, and the run
    trains on the other rows."""
    from protocol.wire import MAX_HEADER_BYTES

    rows = [{"prompt": f"repeat {d}", "target": str(d)} for d in range(3)]
    rows.append({"prompt": "repeat 9", "target": "9", "notes": "x" * (MAX_HEADER_BYTES + 1)})
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out = run_up(write_config(tmp_path, f'[data]\nprompts = "{tmp_path / "rows.jsonl"}"', steps=4))
    assert code == 0, out
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    reason = f"rollout header over the protocol's limit of {MAX_HEADER_BYTES} bytes (texts, prompt, columns)"
    assert metrics[-1]["dropped_reasons"].keys() == {reason}
    assert metrics[-1]["groups_trained"] == 8
    log = (tmp_path / "run" / "actor.log").read_text()
    assert f"data row 3: a rollout header of {MAX_HEADER_BYTES + 1}" not in log  # the header holds more
    assert "data row 3: a rollout header of " in log and "its group is sent as dropped" in log

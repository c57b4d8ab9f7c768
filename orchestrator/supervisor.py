"""Start the learner and the actor as OS processes, watch them, show progress, stop them.

The learner writes `status.json` and `metrics.jsonl`; the supervisor only reads those
files and the processes' exit codes, so a slow terminal can never stall training.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import protocol
from protocol.config import write_run_config

STOP_TIMEOUT_S = 30.0


class RunFailed(RuntimeError):
    pass


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: Path

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def prepare_run_dir(cfg: dict) -> Path:
    run_dir = Path(cfg["run"]["dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("metrics.jsonl", "status.json"):
        (run_dir / stale).unlink(missing_ok=True)
    r = cfg["run"]
    protocol.write_endpoints(run_dir, protocol.make_endpoints(run_dir, r["transport"], r["host"], r["port"]))
    write_run_config(run_dir, cfg)
    return run_dir


def spawn(name: str, args: list[str], run_dir: Path) -> Child:
    log_path = run_dir / f"{name}.log"
    log_file = open(log_path, "w")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # Our packages live beside this one; a source checkout works without installing.
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen([sys.executable, "-m", *args, "--run-dir", str(run_dir)],
                            stdout=log_file, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    return Child(name, proc, log_path)


def format_step(m: dict, steps: int) -> str:
    def f(key: str, fmt: str) -> str:
        v = m.get(key)
        return "-" if v is None else format(v, fmt)
    return (f"step {m['step']:>4}/{steps}  reward {f('reward_mean', '.3f')}  "
            f"loss {f('loss', '+.4f')}  kl {f('kl', '.4f')}  mismatch_kl {f('mismatch_kl', '.1e')}  "
            f"rollout {f('rollout_tokens_per_s', '.0f')} tok/s  {f('step_s', '.2f')} s/step")


class Supervisor:
    def __init__(self, cfg: dict, out: IO[str] = sys.stdout) -> None:
        self.cfg = cfg
        self.out = out
        self.run_dir = prepare_run_dir(cfg)
        self.children: list[Child] = []
        self.metrics_pos = 0
        self.phase = None

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def start(self) -> None:
        self.say(f"run directory: {self.run_dir}")
        self.children = [spawn("learner", ["learner"], self.run_dir),
                         spawn("actor", ["actor", "run"], self.run_dir)]
        for c in self.children:
            self.say(f"started {c.name} (pid {c.proc.pid}), log: {c.log_path}")

    def poll_progress(self) -> None:
        metrics_path = self.run_dir / "metrics.jsonl"
        if metrics_path.exists():
            with open(metrics_path) as f:
                f.seek(self.metrics_pos)
                while (line := f.readline()).endswith("\n"):
                    self.metrics_pos = f.tell()
                    self.say(format_step(json.loads(line), self.cfg["train"]["steps"]))
        status_path = self.run_dir / "status.json"
        try:
            status = json.loads(status_path.read_text())
        except (OSError, ValueError):
            status = None
        if status and status["phase"] != self.phase:
            self.phase = status["phase"]
            reward_socket = protocol.read_endpoints(self.run_dir)["reward"]
            label = {
                "waiting_for_actor": "learner ready; waiting for the actor's handshake",
                "waiting_for_reward_worker": (
                    f"waiting for a reward worker on {reward_socket}; attach one with "
                    f"`orchestrator reward-worker module:function --run-dir {self.run_dir}`"),
                "training": "training",
            }.get(self.phase)
            if label:  # the end of the run is announced by up(), after the last step
                self.say(label)

    def watch(self, poll_s: float = 0.5) -> None:
        """Return when the learner finishes; raise RunFailed if either process fails."""
        learner, actor = self.children
        while True:
            self.poll_progress()
            if learner.proc.poll() is not None:
                break
            if actor.proc.poll() is not None:
                raise RunFailed(f"actor exited with code {actor.proc.returncode}:\n{actor.tail()}")
            time.sleep(poll_s)
        self.poll_progress()
        if learner.proc.returncode != 0:
            raise RunFailed(f"learner exited with code {learner.proc.returncode}:\n{learner.tail()}")

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Ask every live child to stop (SIGTERM), then kill what is left after the timeout."""
        for c in self.children:
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for c in self.children:
            try:
                c.proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                self.say(f"{c.name} did not stop within {timeout_s:.0f} s; killing it")
                c.proc.kill()
                c.proc.wait()


def up(cfg: dict, out: IO[str] = sys.stdout, on_start: Callable[[Supervisor], None] | None = None) -> int:
    """Run training to the end. Returns the process exit code for the CLI."""
    sup = Supervisor(cfg, out)
    sup.start()
    try:
        if on_start:
            on_start(sup)
        sup.watch()
    except RunFailed as e:
        sup.say(f"error: {e}")
        sup.stop()
        return 1
    except KeyboardInterrupt:
        sup.say("interrupted: asking the learner to checkpoint and both processes to stop")
        sup.stop()
        return 130
    sup.stop()
    sup.say(f"done: adapters in {sup.run_dir / 'adapters'}, metrics in {sup.run_dir / 'metrics.jsonl'}")
    return 0

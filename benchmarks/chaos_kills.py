"""The run that benchmarks/chaos.py kills: its two scenarios, the processes a user starts
by hand for each (`External`), and `Chaos`, which starts the run as a user would, keeps
those processes up, SIGKILLs one process of each kind at random moments (the orchestrator
too, then resumes it) and times how long the run takes to make its next step. The checks
made once the run is over, the report and the command are in benchmarks/chaos.py.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import EXAMPLES, ROOT, log
from runtime.lifecycle import child_env

RECOVERY_TIMEOUT_S = 180.0
COMMON = {
    "sampling.group_size": "4",
    "train.batch_size": "2",
    "train.checkpoint_every": "2",
    "train.keep_checkpoints": "3",
    "reward.timeout_s": "10.0",
    "run.max_restarts": "1000",
    "run.hang_timeout_s": "120.0",
}


@dataclass
class Scenario:
    config: Path
    overrides: dict[str, str]
    kinds: tuple[str, ...]
    reward: str  # the reward workers' function
    env_workers: int = 0
    remote_actor: bool = False
    steps_per_kill: int = 4  # the run's progress between two kills: its steps take their time


SCENARIOS = {
    "episodes": Scenario(
        EXAMPLES / "digits.toml",
        {
            **COMMON,
            "reward.functions": '["env", "worker"]',
            "env.environment": '"socket"',
            "env.timeout_s": "10.0",
        },
        ("actor", "learner", "reward-worker", "env-worker", "orchestrator"),
        "digits_env:digit_share",
        env_workers=2,
    ),
    "actors": Scenario(
        EXAMPLES / "tiny.toml",
        {
            **COMMON,
            "sampling.max_tokens": "6",
            "reward.functions": '["worker"]',
            "actor.count": "2",
            "actor.remote": "1",
        },
        ("actor", "remote-actor", "learner", "reward-worker", "orchestrator"),
        "tiny_task:reward",
        remote_actor=True,
        steps_per_kill=20,
    ),
}


def python(*args: str, log_path: Path, cwd: Path = ROOT) -> subprocess.Popen:
    with open(log_path, "a") as out:
        return subprocess.Popen(
            [sys.executable, *args],
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=child_env(),
            start_new_session=True,
        )


def steps_done(run: Path) -> list[int]:
    """Step numbers of the complete lines of metrics.jsonl."""
    try:
        text = (run / "metrics.jsonl").read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line)["step"] for line in text.splitlines(keepends=True) if line.endswith("\n")]


def heartbeat_pid(run: Path, role: str) -> int | None:
    try:
        return int(re.findall(r"\d+", (run / f"heartbeat.{role}").read_text())[0])
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Running, and not a zombie waiting for its parent (or a container's init) to reap it."""
    out = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout
    return bool(out.strip()) and not out.strip().startswith("Z")


@dataclass
class External:
    """A process of the run that a user starts by hand: nothing restarts it but us."""

    name: str
    args: list[str]
    cwd: Path
    proc: subprocess.Popen | None = None
    killed: bool = False  # by us, on purpose


class Chaos:
    def __init__(self, scenario: Scenario, work: Path, kills: int, seed: int) -> None:
        self.scenario, self.work, self.kills = scenario, work, kills
        self.steps = scenario.steps_per_kill * (len(scenario.kinds) * kills + 2)  # every kill lands mid-run
        self.run = work / "run"
        self.rng = random.Random(seed)
        self.orchestrator: subprocess.Popen | None = None
        self.pids: set[int] = set()  # every process of the run we ever saw
        self.recovery: dict[str, list[float]] = {k: [] for k in scenario.kinds}
        self.resumes = 0
        self.step_seen: list[tuple[int, float]] = []  # (last step, when we first saw it)
        self.left_early: list[str] = []  # externals that exited while the run went on
        self.actor = "actor-0" if scenario.remote_actor else "actor"  # the local one's name
        self.externals = externals(scenario, self.run)

    def config_args(self, steps: int) -> list[str]:
        sets = [arg for key, value in self.scenario.overrides.items() for arg in ("--set", f"{key}={value}")]
        return [
            "--config",
            str(self.scenario.config),
            "--run-dir",
            str(self.run),
            "--steps",
            str(steps),
            *sets,
        ]

    def start_orchestrator(self, *args: str) -> None:
        self.orchestrator = python("-m", "orchestrator", "up", *args, log_path=self.work / "orchestrator.log")
        self.pids.add(self.orchestrator.pid)

    def keep_externals(self, holding: tuple[str, ...] = ()) -> None:
        """Start what is not running: at first, and after we killed it (except `holding`).
        One that exited on its own while the run went on is noted (check 4), then started
        again so that the chaos goes on."""
        if not (self.run / "endpoints.json").exists():
            return
        for ext in self.externals:
            if ext.proc is not None and ext.proc.poll() is None:
                continue
            if ext.name in holding:
                continue
            if ext.proc is not None and not ext.killed:
                self.left_early.append(f"{ext.name} (exit {ext.proc.returncode})")
            ext.proc = python(*ext.args, log_path=self.work / f"{ext.name}.log", cwd=ext.cwd)
            ext.killed = False
            self.pids.add(ext.proc.pid)

    def note_children(self) -> None:
        for role in ("learner", self.actor):
            pid = heartbeat_pid(self.run, role)
            if pid:
                self.pids.add(pid)

    def wait_for_progress(
        self,
        after: int,
        since: float | None = None,
        holding: tuple[str, ...] = (),
        timeout: float = RECOVERY_TIMEOUT_S,
    ) -> float:
        """Seconds (from `since`, default now) until a step past `after` is in the metrics;
        keeps the externals up meanwhile (but those in `holding`)."""
        t0 = since or time.monotonic()
        while True:
            self.keep_externals(holding)
            self.note_children()
            done = steps_done(self.run)
            if done and (not self.step_seen or self.step_seen[-1][0] != done[-1]):
                self.step_seen.append((done[-1], time.monotonic()))
            if done and done[-1] > after:
                return time.monotonic() - t0
            if self.orchestrator.poll() is not None:
                raise RuntimeError(
                    f"the orchestrator exited with {self.orchestrator.returncode}; "
                    f"see {self.work / 'orchestrator.log'}"
                )
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"no progress past step {after} within {timeout:.0f} s")
            time.sleep(0.05)

    def step_cycle(self) -> float:
        """Seconds between two steps lately, as seen here: the median of the last few
        gaps between new steps, per step; 1 s until there are any (at most 1 s)."""
        recent = self.step_seen[-6:]
        gaps = [(t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in zip(recent, recent[1:]) if s1 > s0]
        return min(1.0, statistics.median(gaps)) if gaps else 1.0

    def check_not_over(self, i: int) -> None:
        """Raise if the run ended, or reached its last step, before kill `i` (the chaos
        fell behind a fast run)."""
        if self.orchestrator.poll() is not None or self.steps in steps_done(self.run):
            raise RuntimeError(
                f"the run ended or reached its last step before kill {i}; "
                f"see {self.work / 'orchestrator.log'}"
            )

    def wait_until_dead(self, pids: list[int], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while any(alive(p) for p in pids):
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes {pids} outlived their orchestrator by {timeout:.0f} s")
            time.sleep(0.05)

    def kill(self, kind: str) -> bool:
        """SIGKILL one process of `kind`; False if none is running right now."""
        if kind == "orchestrator":
            self.orchestrator.kill()
            self.orchestrator.wait()
            self.note_children()
            self.start_orchestrator("--resume", str(self.run))
            self.resumes += 1
            return True
        if kind in ("actor", "learner"):
            pid = heartbeat_pid(self.run, self.actor if kind == "actor" else kind)
            if pid is None or not alive(pid):
                return False
            os.kill(pid, signal.SIGKILL)
            return True
        live = [e for e in self.externals if e.name.startswith(kind) and e.proc and e.proc.poll() is None]
        if not live:
            return False
        victim = self.rng.choice(live)
        victim.killed = True
        victim.proc.kill()
        victim.proc.wait()
        return True

    def play(self) -> None:
        plan = [k for k in self.scenario.kinds for _ in range(self.kills)]
        self.rng.shuffle(plan)
        for i, kind in enumerate(plan, 1):
            # Kill i comes after step i * steps_per_kill, at a random moment within a step's cycle.
            # A fixed pause would outlast a fast run's steps (0.1 s each for the tiny model
            # on a fast CPU): the kill would come after the run's end.
            self.wait_for_progress(i * self.scenario.steps_per_kill - 1)
            time.sleep(self.rng.uniform(0.0, self.step_cycle()))
            self.check_not_over(i)
            old = [p for p in (heartbeat_pid(self.run, r) for r in ("learner", self.actor)) if p]
            while not self.kill(kind):  # e.g. the actor is being restarted right now
                self.check_not_over(i)
                time.sleep(0.1)
            killed_at = time.monotonic()
            if kind == "orchestrator":
                # Its orphans finish their step and checkpoint before they go: recovery
                # counts from the kill to the first step of the resumed run.
                self.wait_until_dead(old)
            # The remote actor stays dead until the run has gone on without it.
            holding = ("remote-actor",) if kind == "remote-actor" else ()
            took = self.wait_for_progress(steps_done(self.run)[-1], since=killed_at, holding=holding)
            self.recovery[kind].append(took)
            log(f"kill {i}/{len(plan)}: {kind}, next step after {took:.1f} s")

    def finish(self, steps: int) -> int:
        """Let the run train to its last step; returns the orchestrator's exit code."""
        deadline = time.monotonic() + 600
        while self.orchestrator.poll() is None:
            if steps not in steps_done(self.run):  # at the end they are told to stop for good
                self.keep_externals()
            self.note_children()
            if time.monotonic() > deadline:
                raise RuntimeError("the run did not finish within 600 s")
            time.sleep(0.1)
        for ext in self.externals:
            try:
                ext.proc.wait(60)  # told to stop by the learner or the actor: the run is over
            except subprocess.TimeoutExpired:
                pass
        return self.orchestrator.returncode

    def stop_everything(self) -> None:
        for p in [self.orchestrator, *(e.proc for e in self.externals)]:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def externals(scenario: Scenario, run: Path) -> list[External]:
    """The processes a user starts by hand for `scenario`'s run in `run`."""
    args = ["--run-dir", str(run)]
    reward = [
        External(
            f"reward-worker-{i}", ["-m", "orchestrator", "reward-worker", scenario.reward, *args], EXAMPLES
        )
        for i in range(2)
    ]
    env = [
        External(
            f"env-worker-{i}",
            [
                "-m",
                "orchestrator",
                "env-worker",
                "digits_env:DigitsEnv",
                *args,
                "--search-path",
                str(EXAMPLES),
            ],
            ROOT,
        )
        for i in range(scenario.env_workers)
    ]
    remote = [External("remote-actor", ["-m", "actor", "run", *args, "--slot", "1"], ROOT)]
    return reward + env + (remote if scenario.remote_actor else [])

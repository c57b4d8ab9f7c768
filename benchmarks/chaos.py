"""`python -m benchmarks.chaos`: train while killing every kind of process, then check that
nothing was lost and nothing stalled.

Two runs, each with the edges a user touches, started by hand as a user would (`--scenario`
picks one):
- `episodes`: the digits task (examples/digits.toml, multi-turn episodes), its environment
  served by two external `orchestrator env-worker`s, its rewards the environment's plus two
  external `orchestrator reward-worker`s;
- `actors`: the tiny task with two actors, the second remote (`actor run --slot 1`), and two
  external reward workers.
Every few steps (4 for episodes, 20 in the faster actors run), at a random moment within
a step, it SIGKILLs one process of each kind of its scenario (the actor, the remote actor, the learner, a
reward worker, an env worker, or the orchestrator itself, then resumed with `orchestrator
up --resume`), `--kills` times each, in random order. A killed worker is started again at
once, as a user would; the killed remote actor only once the run has made a step without
it. Nothing else is ever restarted by hand: workers and the remote actor that outlive a
dead orchestrator must serve the resumed run. Then it checks:

1. every step number appears exactly once in metrics.jsonl, across all resumes;
2. the ledger holds on every line: groups received = trained + dropped + queued;
3. no kill stalled the run: the next step came within STALL_S after every kill;
4. no worker, and not the remote actor, exited before the run was over (they did when the
   learner told them `stop` as it went away), and each exited 0 at its end;
5. the final adapters load with `mlx_lm.load(..., adapter_path=...)` and generate;
6. resuming from the final checkpoint twice (two copies of the run) gives bit-identical
   adapters after `--extra-steps` more steps;
7. no process of the run is alive at the end.

It prints, per scenario, the recovery time per kind of kill (kill -> next new step) and the
checks, and exits 1 if a check fails. `--kills 1` is the short version the test suite runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import EXAMPLES, ROOT, log
from protocol.lifecycle import child_env

RECOVERY_TIMEOUT_S = 180.0
STALL_S = 30.0  # a kill after which the next step takes longer stalled the run
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
        self.run = work / "run"
        self.rng = random.Random(seed)
        self.orchestrator: subprocess.Popen | None = None
        self.pids: set[int] = set()  # every process of the run we ever saw
        self.recovery: dict[str, list[float]] = {k: [] for k in scenario.kinds}
        self.resumes = 0
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
            self.wait_for_progress(i * self.scenario.steps_per_kill - 1)
            time.sleep(self.rng.uniform(0.0, 1.0))
            old = [p for p in (heartbeat_pid(self.run, r) for r in ("learner", self.actor)) if p]
            while not self.kill(kind):  # e.g. the actor is being restarted right now
                if self.orchestrator.poll() is not None:
                    raise RuntimeError(f"the run ended before kill {i}; see {self.work / 'orchestrator.log'}")
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


# -- checks -----------------------------------------------------------------------------


def check_steps(run: Path, steps: int) -> tuple[bool, str]:
    done = steps_done(run)
    ok = done == list(range(1, steps + 1))
    return ok, f"{len(done)} lines, steps 1..{steps}" if ok else f"steps {done}"


def check_ledger(run: Path) -> tuple[bool, str]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    bad = [
        m["step"]
        for m in rows
        if m["groups_received"] != m["groups_trained"] + m["groups_dropped"] + m["groups_queued"]
    ]
    last = rows[-1]
    return not bad, (
        f"received {last['groups_received']} = trained {last['groups_trained']} + dropped "
        f"{last['groups_dropped']} {last['dropped_reasons']} + queued {last['groups_queued']}"
        + (f"; broken at steps {bad}" if bad else "")
    )


def check_no_stall(chaos: Chaos) -> tuple[bool, str]:
    times = [t for kind in chaos.scenario.kinds for t in chaos.recovery[kind]]
    stalls = [t for t in times if t > STALL_S]
    return not stalls, (
        f"{len(stalls)} of {len(times)} kills stalled; the next step came after "
        f"{max(times, default=0):.1f} s at most"
    )


def check_externals(chaos: Chaos) -> tuple[bool, str]:
    """Every worker and the remote actor exited 0 when the run ended, or was one we had
    just killed and the run finished before it was started again (a fast run outpaces the
    restart: the last kill can come a few steps from the end)."""
    codes = {e.name: e.proc.returncode for e in chaos.externals}
    ok = not chaos.left_early and all(c == 0 for e, c in zip(chaos.externals, codes.values()) if not e.killed)
    early = f"; exited while the run went on: {', '.join(chaos.left_early)}" if chaos.left_early else ""
    outpaced = [e.name for e in chaos.externals if e.killed]
    late = f"; killed by us, the run ended before its restart: {', '.join(outpaced)}" if outpaced else ""
    return ok, f"exit codes at the end {codes}{early}{late}"


def check_adapters_load(run: Path) -> tuple[bool, str]:
    from mlx_lm import generate, load

    model, tokenizer = load(str(EXAMPLES / "tiny-model"), adapter_path=str(run / "adapters"))
    text = generate(model, tokenizer, "repeat 3", max_tokens=6)
    return len(text) > 0, f"mlx_lm.load + generate: {text!r}"


def resume_copy(scenario: Scenario, work: Path, run: Path, name: str, steps: int) -> str:
    """Copy the stopped run, resume the copy to `steps` with its workers (no remote actor:
    the local one takes the batch), return its digest."""
    copy = work / name
    # What a live run writes (sockets, endpoints, status) is the copy's own once it starts.
    shutil.copytree(
        run,
        copy,
        ignore=shutil.ignore_patterns(
            "sockets", "*.log", "run.lock", "endpoints.json", "status.json", "heartbeat.*", "stop.final"
        ),
    )
    orch = python(
        "-m",
        "orchestrator",
        "up",
        "--resume",
        str(copy),
        "--steps",
        str(steps),
        log_path=work / f"{name}.log",
    )
    while not (copy / "endpoints.json").exists():
        time.sleep(0.05)
    workers = [
        python(*e.args, log_path=work / f"{name}-{e.name}.log", cwd=e.cwd)
        for e in externals(scenario, copy)
        if e.name != "remote-actor"
    ]
    try:
        code = orch.wait(300)
        for w in workers:
            w.wait(30)
    finally:
        for p in (orch, *workers):
            if p.poll() is None:
                p.kill()
                p.wait()
    if code != 0:
        raise RuntimeError(f"resuming {copy} exited {code}; see {work / f'{name}.log'}")
    state = json.loads((copy / "checkpoints" / f"step_{steps:06d}" / "state.json").read_text())
    return state["adapters_digest"]


def check_resume_twice(scenario: Scenario, work: Path, run: Path, steps: int, extra: int) -> tuple[bool, str]:
    a = resume_copy(scenario, work, run, "resume-a", steps + extra)
    b = resume_copy(scenario, work, run, "resume-b", steps + extra)
    return a == b, f"step {steps} + {extra}: digests {a} and {b}"


def check_no_process_left(chaos: Chaos) -> tuple[bool, str]:
    deadline = time.monotonic() + 15
    while (left := [p for p in chaos.pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not left, f"{len(chaos.pids)} processes seen, alive: {left or 'none'}"


def report(name: str, chaos: Chaos, steps: int, checks: dict[str, tuple[bool, str]], elapsed: float) -> str:
    lines = [
        f"chaos, {name}: {steps} steps, {chaos.kills} SIGKILLs of each kind, {chaos.resumes} resumes, "
        f"{elapsed:.0f} s",
        "",
        "| killed | kills | next step after: median | max |",
        "|---|---|---|---|",
    ]
    for kind, times in chaos.recovery.items():
        if times:
            lines.append(f"| {kind} | {len(times)} | {statistics.median(times):.1f} s | {max(times):.1f} s |")
    lines += ["", "| check | result | |", "|---|---|---|"]
    for check, (ok, detail) in checks.items():
        lines.append(f"| {check} | {'PASS' if ok else 'FAIL'} | {detail} |")
    return "\n".join(lines)


def play_scenario(
    name: str, work: Path, kills: int, seed: int, extra_steps: int, steps_per_kill: int | None = None
) -> bool:
    """One scenario's chaos run and checks; prints its report, returns whether all passed."""
    scenario = SCENARIOS[name]
    if steps_per_kill is not None:
        scenario = dataclasses.replace(scenario, steps_per_kill=steps_per_kill)
    work.mkdir(parents=True, exist_ok=True)
    steps = scenario.steps_per_kill * (len(scenario.kinds) * kills + 2)  # every kill lands mid-run
    chaos = Chaos(scenario, work, kills, seed)
    log(f"chaos, {name}, in {work}: {steps} steps, {kills} kills of each of {', '.join(scenario.kinds)}")
    t0 = time.monotonic()
    try:
        chaos.start_orchestrator(*chaos.config_args(steps))
        chaos.wait_for_progress(0)
        chaos.play()
        code = chaos.finish(steps)
    finally:
        chaos.stop_everything()
    elapsed = time.monotonic() - t0
    checks = {
        "orchestrator exit code": (code == 0, str(code)),
        "every step exactly once": check_steps(chaos.run, steps),
        "ledger on every line": check_ledger(chaos.run),
        f"no stall over {STALL_S:.0f} s": check_no_stall(chaos),
        "workers and remote actor stayed to the end": check_externals(chaos),
        "final adapters load": check_adapters_load(chaos.run),
        "resume twice, identical adapters": check_resume_twice(scenario, work, chaos.run, steps, extra_steps),
        "no process left": check_no_process_left(chaos),
    }
    print(report(name, chaos, steps, checks, elapsed), f"\nlogs: {work}\n", flush=True)
    return all(ok for ok, _ in checks.values())


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=20, help="SIGKILLs of each kind (default 20)")
    parser.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all")
    parser.add_argument("--seed", type=int, default=0, help="order and moments of the kills")
    parser.add_argument("--extra-steps", type=int, default=4, help="steps after the resume-twice checkpoint")
    parser.add_argument(
        "--steps-per-kill", type=int, help="steps between two kills (default: 4 for episodes, 20 for actors)"
    )
    parser.add_argument("--work-dir", help="keep the runs and logs here (default: a temporary directory)")
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="mlxrl-chaos-")).resolve()
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    passed = [
        play_scenario(n, work / n, args.kills, args.seed, args.extra_steps, args.steps_per_kill)
        for n in names
    ]
    return 0 if all(passed) else 1


if __name__ == "__main__":
    sys.exit(main())

"""`python -m benchmarks.chaos`: train while killing every kind of process, then check that
nothing was lost.

A run of the tiny model scores with two external reward workers (`orchestrator
reward-worker`). At random moments, each after the run has made progress since the last
kill, it SIGKILLs the actor, the learner, a reward worker, or the orchestrator itself (then
resumes with `orchestrator up --resume`), `--kills` times each, in random order. Workers
that die or are told to stop are replaced, as a user would. Then it checks:

1. every step number appears exactly once in metrics.jsonl, across all resumes;
2. the ledger holds on every line: groups received = trained + dropped + queued;
3. the final adapters load with `mlx_lm.load(..., adapter_path=...)` and generate;
4. resuming from the final checkpoint twice (two copies of the run) gives bit-identical
   adapters after `--extra-steps` more steps;
5. no process of the run is alive at the end.

It prints the recovery time per kind of kill (kill -> next new step) and the checks, and
exits 1 if a check fails. `--kills 2` is the short version the test suite runs.
"""

from __future__ import annotations

import argparse
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
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import EXAMPLES, ROOT, TINY_TOML, log
from protocol.lifecycle import child_env

KINDS = ("actor", "learner", "worker", "orchestrator")
RECOVERY_TIMEOUT_S = 180.0

# examples/tiny.toml with small groups, external rewards and room for a thousand restarts.
OVERRIDES = {
    "sampling.group_size": "4", "sampling.max_tokens": "6", "train.batch_size": "2",
    "train.checkpoint_every": "2", "train.keep_checkpoints": "3", "reward.functions": '["worker"]',
    "reward.timeout_s": "10.0", "run.max_restarts": "1000", "run.hang_timeout_s": "120.0",
}


def python(*args: str, log_path: Path, cwd: Path = ROOT) -> subprocess.Popen:
    with open(log_path, "a") as out:
        return subprocess.Popen([sys.executable, *args], cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                env=child_env(), start_new_session=True)


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
class Chaos:
    work: Path
    kills: int
    seed: int
    run: Path = field(init=False)
    orchestrator: subprocess.Popen | None = None
    workers: list[subprocess.Popen] = field(default_factory=list)
    pids: set[int] = field(default_factory=set)  # every process of the run we ever saw
    recovery: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in KINDS})
    resumes: int = 0

    def __post_init__(self) -> None:
        self.run = self.work / "run"
        self.rng = random.Random(self.seed)

    def config_args(self, steps: int) -> list[str]:
        sets = [arg for key, value in OVERRIDES.items() for arg in ("--set", f"{key}={value}")]
        return ["--config", str(TINY_TOML), "--run-dir", str(self.run), "--steps", str(steps), *sets]

    def start_orchestrator(self, *args: str) -> None:
        self.orchestrator = python("-m", "orchestrator", "up", *args, log_path=self.work / "orchestrator.log")
        self.pids.add(self.orchestrator.pid)

    def keep_workers(self, n: int = 2) -> None:
        """Replace workers that died or were told to stop, once the run has its sockets."""
        self.workers = [w for w in self.workers if w.poll() is None]
        while len(self.workers) < n and (self.run / "endpoints.json").exists():
            w = python("-m", "orchestrator", "reward-worker", "tiny_task:reward", "--run-dir", str(self.run),
                       log_path=self.work / "workers.log", cwd=EXAMPLES)
            self.workers.append(w)
            self.pids.add(w.pid)

    def note_children(self) -> None:
        for role in ("learner", "actor"):
            pid = heartbeat_pid(self.run, role)
            if pid:
                self.pids.add(pid)

    def wait_for_progress(self, after: int, since: float | None = None,
                          timeout: float = RECOVERY_TIMEOUT_S) -> float:
        """Seconds (from `since`, default now) until a step past `after` is in the metrics;
        keeps the workers up meanwhile."""
        t0 = since or time.monotonic()
        while True:
            self.keep_workers()
            self.note_children()
            done = steps_done(self.run)
            if done and done[-1] > after:
                return time.monotonic() - t0
            if self.orchestrator.poll() is not None:
                raise RuntimeError(f"the orchestrator exited with {self.orchestrator.returncode}; "
                                   f"see {self.work / 'orchestrator.log'}")
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
        if kind == "worker":
            live = [w for w in self.workers if w.poll() is None]
            if not live:
                return False
            victim = self.rng.choice(live)
            victim.kill()
            victim.wait()
            return True
        pid = heartbeat_pid(self.run, kind)
        if pid is None or not alive(pid):
            return False
        os.kill(pid, signal.SIGKILL)
        return True

    def play(self) -> None:
        plan = [k for k in KINDS for _ in range(self.kills)]
        self.rng.shuffle(plan)
        for i, kind in enumerate(plan, 1):
            time.sleep(self.rng.uniform(0.0, 1.0))  # a random moment within the step's cycle
            old = [p for p in (heartbeat_pid(self.run, r) for r in ("learner", "actor")) if p]
            while not self.kill(kind):  # e.g. the actor is being restarted right now
                time.sleep(0.1)
            killed_at = time.monotonic()
            if kind == "orchestrator":
                # Its orphans finish their step and checkpoint before they go: recovery
                # counts from the kill to the first step of the resumed run.
                self.wait_until_dead(old)
            took = self.wait_for_progress(steps_done(self.run)[-1], since=killed_at)
            self.recovery[kind].append(took)
            log(f"kill {i}/{len(plan)}: {kind}, next step after {took:.1f} s")

    def finish(self, steps: int) -> int:
        """Let the run train to its last step; returns the orchestrator's exit code."""
        deadline = time.monotonic() + 600
        while self.orchestrator.poll() is None:
            if steps not in steps_done(self.run):  # after it, workers stop for good: none anew
                self.keep_workers()
            self.note_children()
            if time.monotonic() > deadline:
                raise RuntimeError("the run did not finish within 600 s")
            time.sleep(0.1)
        for w in self.workers:
            try:
                w.wait(30)  # told to stop by the learner
            except subprocess.TimeoutExpired:
                pass
        return self.orchestrator.returncode

    def stop_everything(self) -> None:
        for p in [self.orchestrator, *self.workers]:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


# -- checks -----------------------------------------------------------------------------

def check_steps(run: Path, steps: int) -> tuple[bool, str]:
    done = steps_done(run)
    ok = done == list(range(1, steps + 1))
    return ok, f"{len(done)} lines, steps 1..{steps}" if ok else f"steps {done}"


def check_ledger(run: Path) -> tuple[bool, str]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    bad = [m["step"] for m in rows
           if m["groups_received"] != m["groups_trained"] + m["groups_dropped"] + m["groups_queued"]]
    last = rows[-1]
    return not bad, (f"received {last['groups_received']} = trained {last['groups_trained']} + dropped "
                     f"{last['groups_dropped']} {last['dropped_reasons']} + queued {last['groups_queued']}"
                     + (f"; broken at steps {bad}" if bad else ""))


def check_adapters_load(run: Path) -> tuple[bool, str]:
    from mlx_lm import generate, load

    model, tokenizer = load(str(EXAMPLES / "tiny-model"), adapter_path=str(run / "adapters"))
    text = generate(model, tokenizer, "repeat 3", max_tokens=6)
    return len(text) > 0, f"mlx_lm.load + generate: {text!r}"


def resume_copy(work: Path, run: Path, name: str, steps: int) -> str:
    """Copy the stopped run, resume the copy to `steps` with a worker, return its digest."""
    copy = work / name
    # What a live run writes (sockets, endpoints, status) is the copy's own once it starts.
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns(
        "sockets", "*.log", "run.lock", "endpoints.json", "status.json", "heartbeat.*"))
    orch = python("-m", "orchestrator", "up", "--resume", str(copy), "--steps", str(steps),
                  log_path=work / f"{name}.log")
    while not (copy / "endpoints.json").exists():
        time.sleep(0.05)
    worker = python("-m", "orchestrator", "reward-worker", "tiny_task:reward", "--run-dir", str(copy),
                    log_path=work / f"{name}-worker.log", cwd=EXAMPLES)
    try:
        code = orch.wait(300)
        worker.wait(30)
    finally:
        for p in (orch, worker):
            if p.poll() is None:
                p.kill()
                p.wait()
    if code != 0:
        raise RuntimeError(f"resuming {copy} exited {code}; see {work / f'{name}.log'}")
    state = json.loads((copy / "checkpoints" / f"step_{steps:06d}" / "state.json").read_text())
    return state["adapters_digest"]


def check_resume_twice(work: Path, run: Path, steps: int, extra: int) -> tuple[bool, str]:
    a = resume_copy(work, run, "resume-a", steps + extra)
    b = resume_copy(work, run, "resume-b", steps + extra)
    return a == b, f"step {steps} + {extra}: digests {a} and {b}"


def check_no_process_left(chaos: Chaos) -> tuple[bool, str]:
    deadline = time.monotonic() + 15
    while (left := [p for p in chaos.pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not left, f"{len(chaos.pids)} processes seen, alive: {left or 'none'}"


def report(chaos: Chaos, steps: int, checks: dict[str, tuple[bool, str]], elapsed: float) -> str:
    lines = [f"chaos: {steps} steps, {chaos.kills} SIGKILLs of each kind, {chaos.resumes} resumes, "
             f"{elapsed:.0f} s", "",
             "| killed | kills | next step after: median | max |", "|---|---|---|---|"]
    for kind, times in chaos.recovery.items():
        if times:
            lines.append(f"| {kind} | {len(times)} | {statistics.median(times):.1f} s | {max(times):.1f} s |")
    lines += ["", "| check | result | |", "|---|---|---|"]
    for name, (ok, detail) in checks.items():
        lines.append(f"| {name} | {'PASS' if ok else 'FAIL'} | {detail} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=20, help="SIGKILLs of each kind (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="order and moments of the kills")
    parser.add_argument("--extra-steps", type=int, default=4, help="steps after the resume-twice checkpoint")
    parser.add_argument("--work-dir", help="keep the runs and logs here (default: a temporary directory)")
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="mlxrl-chaos-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    steps = 4 * len(KINDS) * args.kills + 10  # room for every kill to land mid-run
    chaos = Chaos(work, args.kills, args.seed)
    log(f"chaos run in {work}: {steps} steps, {args.kills} kills of each of {', '.join(KINDS)}")
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
        "final adapters load": check_adapters_load(chaos.run),
        "resume twice, identical adapters": check_resume_twice(work, chaos.run, steps, args.extra_steps),
        "no process left": check_no_process_left(chaos),
    }
    print(report(chaos, steps, checks, elapsed))
    print(f"\nlogs: {work}")
    return 0 if all(ok for ok, _ in checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

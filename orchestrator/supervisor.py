"""Start the run's processes (the learner or its ranks, the local actors, the env workers
of a module environment), watch them, show progress, stop them.

The learner writes `status.json` and `metrics.jsonl`; the supervisor only reads those
files and the processes' exit codes, so a slow terminal can never stall training.
Every child holds the orchestrator's lifeline and run lock (`runtime.lifecycle`): it
stops when the orchestrator dies, and no other run can take the directory while it lives.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import protocol
from orchestrator.launch import Child, child_specs, free_ports, prepare_run_dir, spawn
from orchestrator.progress import display_for, is_eval
from orchestrator.show import MetricsFollower
from protocol import sockets
from runtime import lifecycle
from runtime.config import Config
from runtime.heartbeat import heartbeat_path, seconds_since_beat
from runtime.rundir import Phase, RunExists
from transport import zeromq
from transport.keys import AUTHORIZED, run_keys

STOP_TIMEOUT_S = 30.0
# How long a new run waits for the orphans of a killed orchestrator to stop (they get
# lifecycle.LIFELINE_GRACE_S to checkpoint and exit).
ORPHAN_WAIT_S = 3 * lifecycle.LIFELINE_GRACE_S


class RunFailed(RuntimeError):
    def __init__(self, message: str, code: int = lifecycle.EXIT_CRASH) -> None:
        super().__init__(message)
        self.code = code


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def exposure_note(cfg: Config, run_dir: Path) -> str | None:
    """What a TCP run bound beyond loopback exposes, and what protects it (None otherwise)."""
    r = cfg.run
    if r.transport != "tcp" or r.host in LOOPBACK or r.host.startswith("127."):
        return None
    names = ["rollout", "reward"] + (["env"] if cfg.env.environment else [])
    ports = ", ".join(f"{n} {r.port + i}" for i, n in enumerate(names))
    limits = (
        f"each socket refuses frames over {sockets.frame_limit(cfg.rollout_array_bytes) >> 20} MB, "
        f"closes connections that have not finished their handshake after {zeromq.HANDSHAKE_S:.0f} s "
        f"and holds at most {zeromq.MAX_CONNECTIONS} at a time."
    )
    firewall = (
        "Nothing here stops a flood of connections from keeping new peers out: let only the run's "
        "machines reach these ports (docs/scale-out.md, 'TCP and CURVE keys')."
    )
    if r.insecure:
        return (
            f"exposed on {r.host} (ports: {ports}) in PLAIN TCP (run.insecure): anyone who reaches them "
            f"can join the run, send it rollouts and read its weights. {limits} {firewall}"
        )
    allowed = len(list((run_keys(run_dir) / AUTHORIZED).glob("*.key")))
    return (
        f"exposed on {r.host} (ports: {ports}), protected by CURVE: encrypted, and only the {allowed} "
        f"client key(s) in {run_keys(run_dir) / AUTHORIZED} get in (`orchestrator keys add-peer` adds "
        f"one); {limits} {firewall}"
    )


def signalled_first(procs: dict[str, subprocess.Popen]) -> list[str]:
    """The names, those a signal ended first (stable otherwise). One learner rank killed
    from outside breaks the ring, and the others then exit on their own (code 1), often
    before the next poll: blaming the first dead rank by rank order would name a victim."""
    return sorted(procs, key=lambda name: not ((procs[name].poll() or 0) < 0))


class Supervisor:
    """Starts the learner and the actors, restarts them when they fail, reports progress.

    An actor that dies is restarted alone: the learner keeps its state and hands the new
    actor its current weights and its slot's data cursor; the others go on meanwhile. A
    learner that dies is restarted from its newest checkpoint together with fresh actors
    (the old actors' flow-control state belongs to the dead learner). Each process may be
    restarted `run.max_restarts` times.
    """

    def __init__(
        self,
        cfg: Config,
        out: IO[str] = sys.stdout,
        resume: bool = False,
        shares_mb: dict[str, float] | None = None,
        signals: lifecycle.StopSignals | None = None,
        overwrite: bool = False,
    ) -> None:
        self.cfg = cfg
        self.out = out
        self.resume = resume
        self.shares_mb = shares_mb or {}
        self.signals = signals or lifecycle.StopSignals()
        self.display = display_for(out, cfg.train.steps)
        # The lock comes before anything in the directory is touched: a live run's
        # metrics must never be cleared by a second `up`.
        try:
            self.lock_fd = lifecycle.acquire_run_lock(cfg.run.dir, ORPHAN_WAIT_S, self.say)
        except lifecycle.RunBusy:
            self.display.close()
            raise
        try:
            self.run_dir = prepare_run_dir(cfg, resume, overwrite)
        except RunExists:
            os.close(self.lock_fd)
            self.display.close()
            raise
        self.lifeline = lifecycle.Lifeline()
        (self.run_dir / "plan.json").write_text(json.dumps({"shares_mb": self.shares_mb}) + "\n")
        self.warned: set[str] = set()
        self.children: dict[str, Child] = {}
        self.specs = child_specs(cfg)
        # By rank (learner/ranks.py): they start and restart together.
        self.learners = [name for name, spec in self.specs.items() if spec.kind == "learner"]
        self.actors = [name for name, spec in self.specs.items() if spec.kind == "actor"]  # by slot
        self.env_workers = [name for name, spec in self.specs.items() if spec.kind == "env-worker"]
        self.restarts = {name: 0 for name in (*self.learners, *self.actors, *self.env_workers)}
        self.metrics = MetricsFollower(self.run_dir, resume)
        self.phase: str | None = None
        self.last_step_s = 0.0  # the newest step's step_s: how long a step under way may take

    def say(self, text: str) -> None:
        self.display.say(text)

    def start(self) -> None:
        self.say(f"run directory: {self.run_dir}")
        if self.resume:
            at = self.metrics.resumed_at
            self.say(
                f"resuming from the checkpoint of step {at} of {self.cfg.train.steps}"
                if at
                else "resuming: no checkpoint yet, so from step 0"
            )
        note = exposure_note(self.cfg, self.run_dir)
        if note:
            self.say(note)
        self.start_learners(self.resume)
        for name in [*self.actors, *self.env_workers]:
            self.start_child(name)

    def start_learners(self, resume: bool) -> None:
        """The learner, or its ranks: as `mlx.launch --backend ring` starts them on one
        host (MLX_RANK, and MLX_HOSTFILE naming a fresh port per rank), but each our own
        child, holding the lifeline and the run lock."""
        ranks_env = {}
        if len(self.learners) > 1:
            hostfile = self.run_dir / "ranks.json"
            ports = free_ports(len(self.learners))
            hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in ports]))
            ranks_env = {"MLX_HOSTFILE": str(hostfile)}
        for rank, name in enumerate(self.learners):
            self.start_child(name, resume, {**ranks_env, "MLX_RANK": str(rank)} if ranks_env else None)

    def start_child(self, name: str, resume: bool = False, extra_env: dict[str, str] | None = None) -> None:
        """`resume`: a learner continues from the newest checkpoint."""
        heartbeat_path(self.run_dir, name).unlink(missing_ok=True)
        spec = self.specs[name]
        args = [*spec.args, *(["--resume"] if resume else [])]
        child = spawn(
            name,
            args,
            self.run_dir,
            self.lifeline,
            self.lock_fd,
            self.shares_mb.get(spec.share),
            spec.threads,
            extra_env,
        )
        self.children[name] = child
        self.say(f"started {name} (pid {child.proc.pid}), log: {child.log_path}")

    def poll_progress(self) -> None:
        for metrics in self.new_metrics():
            self.display.metrics(metrics)
            if not is_eval(metrics):
                self.check_memory(metrics)
                self.last_step_s = metrics.get("step_s") or self.last_step_s
        status_path = self.run_dir / "status.json"
        try:
            status = json.loads(status_path.read_text())
        except (OSError, ValueError):
            status = None
        if not status:
            return
        if status["phase"] == Phase.EVALUATING and isinstance(status.get("eval"), dict):
            self.display.eval_progress(status["step"], status["eval"])
        phase = Phase.TRAINING if status["phase"] == Phase.STEPPING else status["phase"]  # still training
        if phase != self.phase:
            self.phase = phase
            reward_socket = protocol.read_endpoints(self.run_dir)["reward"]
            label = {
                Phase.WAITING_FOR_ACTOR: "learner ready; waiting for the actor's handshake",
                Phase.WAITING_FOR_REWARD_WORKER: (
                    f"waiting for a reward worker on {reward_socket}; attach one with "
                    f"`orchestrator reward-worker module:function --run-dir {self.run_dir}`"
                ),
                Phase.TRAINING: "training",
            }.get(phase)
            if label:  # the end of the run is announced by up(), after the last step
                self.say(label)

    def new_metrics(self) -> list[dict]:
        """Whole lines of metrics.jsonl past the last step shown."""
        new = self.metrics.new()
        if self.metrics.went_back is not None:
            self.say(f"continuing from the checkpoint of step {self.metrics.went_back}")
        return new

    def check_memory(self, metrics: dict) -> None:
        """Warn (once per process) when a measured peak passes 90% of its share."""
        for name in ("actor", "learner"):
            peak, share = metrics.get(f"{name}_peak_mb"), self.shares_mb.get(name)
            if peak and share and peak > 0.9 * share and name not in self.warned:
                self.warned.add(name)
                self.say(
                    f"warning: the {name}'s peak memory {peak:.0f} MB is above 90% of its "
                    f"{share:.0f} MB share; see `orchestrator plan`"
                )

    def failure(self, name: str) -> str | None:
        """Why `name` needs a restart (it crashed, or its heartbeat stopped), or None.
        Raises RunFailed for an exit that a restart cannot fix."""
        child = self.children[name]
        code = child.proc.poll()
        if code == lifecycle.EXIT_OK:
            return None  # the learner finished, or told the actor to stop: never restarted
        if code in lifecycle.FINAL_EXITS:
            raise RunFailed(
                f"{name} stopped the run ({lifecycle.FINAL_EXITS[code]}, exit code {code}):\n{child.tail(8)}",
                code,
            )
        if code is not None:
            return f"exited with code {code}"
        age = seconds_since_beat(self.run_dir, name)
        if age is not None and age > self.cfg.run.hang_timeout_s:
            child.proc.kill()
            child.proc.wait()
            return f"sent no heartbeat for {age:.0f} s (hung); killed it"
        return None

    def restart(self, name: str, why: str) -> None:
        child = self.children[name]
        limit = self.cfg.run.max_restarts
        if self.restarts[name] >= limit:
            raise RunFailed(f"{name} {why}, and it was restarted {limit} times already:\n{child.tail()}")
        self.restarts[name] += 1
        self.say(
            f"{name} {why}; restarting it ({self.restarts[name]}/{limit}). Last log lines:\n{child.tail(5)}"
        )
        if self.specs[name].kind == "learner":
            if len(self.learners) > 1:
                # The others wait for the lost rank inside a collective, where no signal
                # reaches them: kill them. All go on together from the newest checkpoint.
                for rank in self.learners:
                    self.children[rank].proc.kill()
                    self.children[rank].proc.wait()
            self.stop_children([*self.learners, *self.actors], STOP_TIMEOUT_S)
            self.start_learners(resume=True)
            for actor in self.actors:
                self.start_child(actor)
        else:  # an actor, or an env worker (it attaches to the actor again by itself)
            self.start_child(name)

    def watch(self, poll_s: float = 0.2) -> None:
        """Return when the learner finishes or a stop signal arrives; raise RunFailed when
        a process ends the run or its restarts run out."""
        while not self.signals.requested:
            self.poll_progress()
            if self.children["learner"].proc.poll() == lifecycle.EXIT_OK:
                break
            learners = signalled_first({name: self.children[name].proc for name in self.learners})
            for name in (*learners, *self.actors, *self.env_workers):
                why = self.failure(name)
                if why is not None:
                    self.restart(name, why)
                    break
            time.sleep(poll_s)
        self.poll_progress()

    def step_under_way(self) -> float:
        """If the learner is in the middle of an optimizer step, say so and return how long
        the rest of it may take (twice the last step's time): the learner leaves a step
        between two takes of groups or two micro-batches, throwing it away, but one
        forward and backward, the update at the end, and with several learner ranks a
        take on rank 0 or a later iteration, are finished first."""
        try:
            status = json.loads((self.run_dir / "status.json").read_text())
        except (OSError, ValueError):
            return 0.0
        if status.get("phase") != Phase.STEPPING:
            return 0.0
        took = f"; the last took {self.last_step_s:.0f} s" if self.last_step_s else ""
        started = time.time() - status.get("since", time.time())
        self.say(
            f"the learner is in step {status['step'] + 1} (started {started:.0f} s ago{took}); "
            "it stops at its next micro-batch and throws the step away"
        )
        return 2 * self.last_step_s

    def stop_child(self, name: str, timeout_s: float = STOP_TIMEOUT_S) -> None:
        self.stop_children([name], timeout_s)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Ask every live child to stop (the learner checkpoints); kill what is left when
        `timeout_s` is up."""
        self.stop_children(list(self.children), timeout_s)

    def stop_children(self, names: list[str], timeout_s: float) -> None:
        # One SIGTERM each: a second one means "stop now, skip the checkpoint".
        for name in names:
            if self.children[name].proc.poll() is None:
                self.children[name].proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for name in names:
            proc = self.children[name].proc
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.say(f"{name} did not stop within {timeout_s:.0f} s; killing it")
                proc.kill()
                proc.wait()

    def evaluate_held_out(self, step: int, adapter: Path | None) -> None:
        """[eval] of an agent's or an environment's run, before the first step and after
        the last: `actor eval` runs the held-out sessions or episodes (actor/standalone.py) and
        appends the figures to the metrics as step `step`'s. Between the processes' lives,
        so it has their memory."""
        what = "agent" if self.cfg.agent.enabled else "environment"
        log = self.run_dir / "evaluation.log"
        self.say(f"evaluating the {what} on the held-out rows (step {step}); log: {log}")
        args = [
            "actor",
            "eval",
            "--metrics-step",
            str(step),
            *(["--adapter", str(adapter)] if adapter else []),
        ]
        child = spawn("evaluation", args, self.run_dir, self.lifeline, self.lock_fd)
        while child.proc.poll() is None:
            if self.signals.requested:
                child.proc.terminate()
                child.proc.wait()
                return
            time.sleep(0.2)
        if child.proc.returncode != 0:
            self.say(f"the evaluation failed (exit code {child.proc.returncode}); see {child.log_path}")
        self.poll_progress()

    def run(self) -> int:
        """Start, watch and stop the run; returns the exit code (see up()). Every way out is
        the end of the run, so the processes tell their workers to exit."""
        multi_turn = self.cfg.agent.enabled or self.cfg.env.environment is not None
        held_out_eval = multi_turn and self.cfg.eval.prompts is not None
        try:
            if held_out_eval and not self.resume:
                self.evaluate_held_out(0, None)
            if self.signals.requested:
                return self.signals.exit_code()
            self.start()
            self.watch()
        except RunFailed as e:
            self.say(f"error: {e}")
            lifecycle.mark_final_stop(self.run_dir)
            self.stop()
            return e.code
        lifecycle.mark_final_stop(self.run_dir)
        if self.signals.requested:
            self.say(
                f"{self.signals.name}: asking the learner to checkpoint and every process to "
                "stop (send it again to kill them now)"
            )
            self.stop(STOP_TIMEOUT_S + self.step_under_way())
            self.poll_progress()  # the steps finished while stopping
            self.say(f"stopped; resume with `orchestrator up --resume {self.run_dir}`")
            return self.signals.exit_code()
        self.stop()
        if held_out_eval:
            self.evaluate_held_out(self.cfg.train.steps, self.run_dir / "adapters")
        self.say(
            f"done: adapters in {self.run_dir / 'adapters'}, metrics in {self.run_dir / 'metrics.jsonl'}"
        )
        return lifecycle.EXIT_OK

    def kill(self) -> None:
        for c in self.children.values():
            if c.proc.poll() is None:
                c.proc.kill()
            c.proc.wait()

    def close(self) -> None:
        """Let go of the lifeline and the lock; call only once no child is alive."""
        self.lifeline.close()
        os.close(self.lock_fd)


def up(
    cfg: Config,
    out: IO[str] = sys.stdout,
    resume: bool = False,
    shares_mb: dict[str, float] | None = None,
    overwrite: bool = False,
) -> int:
    """Run training to the end. Returns the process exit code for the CLI: 0 done, 1 the
    run failed (restarts used up), 2 the run directory holds another run, 4 a user error,
    5 the run directory is busy, 128 + N stopped by signal N (130 Ctrl-C, 143 SIGTERM, 129
    SIGHUP)."""
    signals = lifecycle.StopSignals().install()
    try:
        sup = Supervisor(cfg, out, resume, shares_mb, signals, overwrite)
    except lifecycle.RunBusy as e:
        print(f"error: {e}", file=out, flush=True)
        return lifecycle.EXIT_BUSY
    except RunExists as e:
        print(f"error: {e}", file=out, flush=True)
        return lifecycle.EXIT_CONFIG
    try:
        return sup.run()
    except lifecycle.ForcedStop as e:
        sup.say(f"{signal.Signals(e.signum).name} again: killing every process of the run now")
        sup.kill()
        return lifecycle.signal_exit_code(e.signum)
    finally:
        sup.display.close()
        if all(c.proc.poll() is not None for c in sup.children.values()):
            sup.close()

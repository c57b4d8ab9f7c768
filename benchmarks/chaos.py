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
6. resuming from the final checkpoint twice (two copies of the run) gives the same
   adapters after `--extra-steps` more steps, within 1% of how far those steps moved them
   (a batch's groups are cut into takes as they arrive, as the timing has it);
7. no process of the run is alive at the end.

It prints, per scenario, the recovery time per kind of kill (kill -> next new step) and the
checks, and exits 1 if a check fails. `--kills 1` is the short version the test suite runs.

This module holds the checks, the report and the command; the scenarios and the run under
fire (`Chaos`: starting it, the kills, the recovery times) are in benchmarks/chaos_kills.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.chaos_kills import SCENARIOS, Chaos, Scenario, alive, externals, python, steps_done
from benchmarks.common import EXAMPLES, log

STALL_S = 30.0  # a kill after which the next step takes longer stalled the run


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


def resume_copy(scenario: Scenario, work: Path, run: Path, name: str, steps: int) -> Path:
    """Copy the stopped run, resume the copy to `steps` with its workers (no remote actor:
    the local one takes the batch), return the adapters of its checkpoint of `steps`."""
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
    return checkpoint_adapters(copy, steps)


def checkpoint_adapters(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:06d}" / "adapters" / "adapters.safetensors"


def check_resume_twice(scenario: Scenario, work: Path, run: Path, steps: int, extra: int) -> tuple[bool, str]:
    """Two copies resumed from the same checkpoint train the same groups into the same
    adapters, to float rounding: each learns a batch's groups as they arrive, and how they
    are cut into takes follows the timing (`train.stream_groups = false`: to the bit). A
    resume that lost its place in the data would be off by about the update itself."""
    import mlx.core as mx

    # Side by side: each copy first waits out the remote slot that never attaches.
    with ThreadPoolExecutor(2) as pool:
        copies = pool.map(
            lambda name: resume_copy(scenario, work, run, name, steps + extra), ("resume-a", "resume-b")
        )
        a, b = (mx.load(str(path)) for path in list(copies))
    start = mx.load(str(checkpoint_adapters(run, steps)))
    apart = max(float(mx.abs(a[k] - b[k]).max()) for k in a)
    moved = max(float(mx.abs(a[k] - start[k]).max()) for k in a)
    said = f"step {steps} + {extra}: adapters {apart:.1e} apart, each moved {moved:.1e}"
    return moved > 0 and apart <= 1e-2 * moved, said


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
    chaos = Chaos(scenario, work, kills, seed)
    steps = chaos.steps
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
        "resume twice, the same adapters": check_resume_twice(scenario, work, chaos.run, steps, extra_steps),
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

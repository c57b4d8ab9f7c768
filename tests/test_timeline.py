"""The timeline: spans recorded per process, merged into one trace, summed per process."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

from orchestrator.timeline import (
    parse_steps,
    read_events,
    summarize,
    top_level,
    trace,
    window,
    write_timeline,
)
from runtime.spans import WAIT, Timeline, open_timeline, timeline_dir


def write(run_dir, process: str, events: list[dict]) -> None:
    timeline_dir(run_dir).mkdir(parents=True, exist_ok=True)
    (timeline_dir(run_dir) / f"{process}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def span(name, ts, dur, cat="busy", tid=0, **args):
    return {
        "name": name,
        "cat": cat,
        "ph": "X",
        "ts": ts,
        "dur": dur,
        "tid": tid,
        **({"args": args} if args else {}),
    }


def mark(step, ts):
    return {"name": "step", "cat": "mark", "ph": "i", "s": "p", "ts": ts, "tid": 0, "args": {"step": step}}


def test_spans_nest_per_thread_and_args_added_while_running_are_kept(tmp_path):
    tl = open_timeline(tmp_path, "actor-0")
    with tl.span("decode", rows=4) as args:
        with tl.span("sample"):
            pass
        args["finished"] = 2

    def other():
        with tl.span("beat", WAIT):
            pass

    t = threading.Thread(target=other)
    t.start()
    t.join()
    tl.mark("step", step=1)
    tl.close()
    rows = read_events(tmp_path)["actor-0"]
    by_name = {e["name"]: e for e in rows}
    outer, inner = by_name["decode"], by_name["sample"]
    assert outer["args"] == {"rows": 4, "finished": 2} and outer["tid"] == inner["tid"] == 0
    assert outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]
    assert by_name["beat"]["tid"] == 1 and by_name["beat"]["cat"] == WAIT
    assert by_name["step"]["ph"] == "i" and by_name["step"]["args"] == {"step": 1}
    assert [e["name"] for e in top_level(rows)] == ["decode", "beat"]


def test_off_records_nothing(tmp_path):
    tl = open_timeline(tmp_path, "learner", enabled=False)
    with tl.span("step") as args:
        args["x"] = 1
    tl.mark("step", step=1)
    assert not tl.on and not timeline_dir(tmp_path).exists()
    assert Timeline(None).on is False


def test_the_summary_counts_top_level_spans_of_the_main_thread_by_hand(tmp_path):
    """Learner: waits 0-2 s for groups, steps 2-5 s (a micro-batch nested in it), waits
    5-6, steps 6-9; actor: decodes 0-4, waits for weights 4-6, decodes 6-8 (a heartbeat
    thread's span is not counted). Over steps 1..2 (0-9 s): learner busy 6 of 9 s,
    waiting 3 on groups; actor busy 6, waiting 2 on weights, 1 s untracked."""
    s = 1_000_000
    write(
        tmp_path,
        "learner",
        [
            span("wait for groups", 0, 2 * s, WAIT),
            span("step", 2 * s, 3 * s, step=1),
            span("micro-batch", 2 * s, s),
            mark(1, 5 * s),
            span("wait for groups", 5 * s, s, WAIT),
            span("step", 6 * s, 3 * s, step=2),
            mark(2, 9 * s),
        ],
    )
    write(
        tmp_path,
        "actor-0",
        [
            span("decode", 0, 4 * s),
            span("heartbeat", 0, 9 * s, WAIT, tid=1),
            span("wait for weights", 4 * s, 2 * s, WAIT),
            span("decode", 6 * s, 2 * s),
        ],
    )
    events = read_events(tmp_path)
    assert list(events) == ["learner", "actor-0"]
    t0, t1 = window(events, (1, 2))
    assert (t0, t1) == (0, 9 * s)
    learner, actor = summarize(events, t0, t1)
    assert learner.busy_s == 6 and learner.waits == {"wait for groups": 3} and learner.other_s == 0
    assert actor.busy_s == 6 and actor.waits == {"wait for weights": 2} and actor.other_s == 1
    # step 2 alone: from step 1's end, 5-9 s
    t0, t1 = window(events, (2, 2))
    learner, actor = summarize(events, t0, t1)
    assert (t0, t1) == (5 * s, 9 * s) and learner.busy_s == 3 and actor.busy_s == 2
    assert actor.waits == {"wait for weights": 1}
    with pytest.raises(ValueError, match="has steps 1..2"):
        window(events, (1, 3))


def test_the_trace_is_chrome_json_with_a_named_track_per_process(tmp_path):
    s = 1_000_000
    write(tmp_path, "learner", [span("step", 10 * s, s, step=1), mark(1, 11 * s)])
    write(tmp_path, "reward-worker-0", [span("request", 10 * s, s // 2)])
    with (timeline_dir(tmp_path) / "learner.jsonl").open("a") as f:
        f.write('{"name": "cut sh')  # a crash mid-line
    text = write_timeline(tmp_path)
    assert "learner" in text and "reward-worker-0" in text
    doc = json.loads((tmp_path / "timeline.json").read_text())
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert names == {1: "learner", 2: "reward-worker-0"}
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert min(e["ts"] for e in spans) == 0 and {e["pid"] for e in spans} == {1, 2}
    assert trace(read_events(tmp_path), 10 * s, 11 * s)["displayTimeUnit"] == "ms"


@pytest.mark.parametrize("text", ["3", "a:b", "0:2", "5:2"])
def test_bad_steps_are_refused_by_name(text):
    with pytest.raises(ValueError, match="--steps"):
        parse_steps(text)


def test_the_process_timeline_is_what_module_functions_record_into(tmp_path):
    from runtime import spans

    try:
        spans.start(tmp_path, "learner")
        with spans.span("step", step=1):
            spans.record("publish weights", 0.0, 0.5)
        spans.mark("step", step=1)
    finally:
        spans.start(None, "learner")  # back to off, the file closed
    assert not spans.current().on
    names = [e["name"] for e in read_events(tmp_path)["learner"]]
    assert sorted(names) == ["publish weights", "step", "step"]


def check_trace(doc: dict, tolerance_us: int = 100) -> dict[str, list[dict]]:
    """Every span of the trace nests in or follows the one before it on its thread (a
    `tolerance_us` overhang: the learner's step span is timed by another clock); returns
    the spans by process name."""
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    by_thread: dict[tuple, list[dict]] = {}
    for e in doc["traceEvents"]:
        if e["ph"] == "X":
            by_thread.setdefault((e["pid"], e["tid"]), []).append(e)
    for spans in by_thread.values():
        open_ends: list[int] = []
        for e in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
            while open_ends and open_ends[-1] <= e["ts"] + tolerance_us:
                open_ends.pop()
            end = e["ts"] + e["dur"]
            assert not open_ends or end <= open_ends[-1] + tolerance_us, ("spans cross", e)
            open_ends.append(end)
    out: dict[str, list[dict]] = {}
    for e in doc["traceEvents"]:
        if e["ph"] in "Xi":
            out.setdefault(names[e["pid"]], []).append(e)
    return out


# What the learner records for a step (learner/building.py, learner/service.py): while its
# groups arrive, a "learn groups" span per take of them, holding the take's old-policy and
# reference pass and its forward and backward passes; once the batch is complete, the step's
# span, holding the optimizer step (and in it the update) and the publish.
TAKE_PARTS = ("old and reference logprobs", "forward and backward")
STEP_PARTS = ("optimizer step", "publish weights")
OPTIMIZER_PARTS = ("optimizer update",)
# The step span's start is time.time() and its length perf_counter()'s: the two clocks and
# the rounding to µs put its ends a few µs from its parts'.
CLOCKS_US = 100


def within(inner: dict, outer: dict) -> bool:
    return (
        outer["ts"] - CLOCKS_US <= inner["ts"]
        and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + CLOCKS_US
    )


def check_steps(learner: list[dict], steps: list[int]) -> dict[int, tuple[float, int]]:
    """Each step's spans hold their parts: its takes of groups (since the step before it)
    each hold an old-policy pass and forward and backward passes, its step span one
    optimizer step (holding the update) and one publish, every part lies in one take or
    step, and the parts add up to no more than what holds them. Returns each step's µs
    (its takes' and its span's, what step_s measures) and how many spans they are."""
    main = [e for e in learner if e["ph"] == "X" and e["tid"] == 0]
    by_step = {e["args"]["step"]: e for e in main if e["name"] == "step"}
    assert set(steps) <= set(by_step), by_step.keys()
    takes = [e for e in main if e["name"] == "learn groups"]
    holders = takes + list(by_step.values())
    parts = [e for e in main if e["name"] in TAKE_PARTS + STEP_PARTS + OPTIMIZER_PARTS]
    for e in parts:  # none outside a take or a step, none across two
        assert sum(within(e, holder) for holder in holders) == 1, ("a part outside its step", e)
    spent = {}
    for k in steps:
        step, before = by_step[k], by_step.get(k - 1)
        since = before["ts"] + before["dur"] if before else 0
        mine = [t for t in takes if since <= t["ts"] and t["ts"] + t["dur"] <= step["ts"] + CLOCKS_US]
        assert mine, (k, "no take of groups before the step")
        for take in mine:
            inside = [e for e in parts if within(e, take)]
            assert {e["name"] for e in inside} == set(TAKE_PARTS), (k, take, inside)
            assert sum(e["dur"] for e in inside) <= take["dur"] + CLOCKS_US, (k, take, inside)
        top = [e for e in parts if within(e, step) and e["name"] in STEP_PARTS]
        assert sorted(e["name"] for e in top) == sorted(STEP_PARTS), (k, top)
        assert sum(e["dur"] for e in top) <= step["dur"] + CLOCKS_US, (k, step, top)
        (optimizer,) = (e for e in top if e["name"] == "optimizer step")
        below = [e for e in parts if within(e, optimizer) and e["name"] in OPTIMIZER_PARTS]
        assert [e["name"] for e in below] == list(OPTIMIZER_PARTS), (k, optimizer, below)
        spent[k] = step["dur"] + sum(t["dur"] for t in mine), 1 + len(mine)
    return spent


@pytest.mark.slow
def test_a_real_run_s_timeline_has_every_process_and_its_steps_hold_their_parts(tmp_path):
    """A real run (learner, actor, and a reward worker started by hand as the docs say):
    `orchestrator timeline` writes a trace with a track per process, the worker's among
    them, holding the requests it scored; spans that nest; every step marked. Each of
    steps 2..4 holds the spans the learner recorded for it, as its groups came and once
    they were all in, which add up to its step_s. The summary counts the steps busy."""
    import protocol
    from tests.helpers import WORKER_CONFIG, orchestrator, read_metrics, wait_for, write_config

    cfg = write_config(tmp_path, WORKER_CONFIG, steps=4, reward="worker")
    proc = orchestrator("up", "--config", str(cfg))
    run = tmp_path / "run"
    worker = None
    try:
        wait_for(run / "endpoints.json")
        serve = ["reward-worker", "tiny_task:reward", "--run-dir", str(run)]
        worker = subprocess.Popen(  # from the folder of its reward module (tiny_task.py)
            [sys.executable, "-m", "orchestrator", *serve],
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out
        assert worker.wait(timeout=60) == 0  # it exits when the run ends: its timeline whole
    finally:
        for p in (proc, worker):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", "timeline", "--run-dir", str(run), "--steps", "2:4"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    doc = json.loads((run / "timeline.json").read_text())
    spans = check_trace(doc)
    track = f"reward-worker-{worker.pid}"
    assert set(spans) == {"learner", "actor", track}
    assert {e["name"] for e in spans[track] if e["ph"] == "X"} == {protocol.SCORE}
    learned = {"step", "wait for groups", "learn groups", *TAKE_PARTS, *STEP_PARTS, *OPTIMIZER_PARTS}
    assert learned <= {e["name"] for e in spans["learner"]}
    assert {"decode step", "prefill", "send", "apply weights"} <= {e["name"] for e in spans["actor"]}
    # Each group sent says how long it decoded: decode steps ran in that time, none later.
    sends = [e for e in spans["actor"] if e["name"] == "send"]
    decodes = [e["ts"] for e in spans["actor"] if e["name"] == "decode step"]
    for e in sends:
        began = e["ts"] - e["args"]["decoding_s"] * 1e6
        assert any(began <= ts <= e["ts"] for ts in decodes), e
    marks = sorted(e["args"]["step"] for e in spans["learner"] if e["ph"] == "i")
    assert marks == [2, 3, 4]  # step 1's end opens the window
    events = read_events(run)
    spent = check_steps(events["learner"], [2, 3, 4])
    metrics = {m["step"]: m for m in read_metrics(run)}
    for k in (2, 3, 4):  # its takes and its span are what step_s measures (each to a few µs)
        us, n = spent[k]
        assert abs(us - metrics[k]["step_s"] * 1e6) <= CLOCKS_US * n, (spent[k], metrics[k]["step_s"])
    t0, t1 = window(events, (2, 4))
    learner = next(s for s in summarize(events, t0, t1) if s.process == "learner")
    step_s = sum(metrics[k]["step_s"] for k in (2, 3, 4))
    # busy: the steps, and the scoring between them (top-level too); waits: the rest
    assert step_s <= learner.busy_s + 1e-5, (learner, step_s)
    assert learner.busy_s + sum(learner.waits.values()) <= learner.wall_s + 1e-5, learner
    assert "its longest group decoded for" in done.stdout, done.stdout
    shown = {line.split()[0] for line in done.stdout.splitlines() if line.strip()}
    assert {"learner", "actor", track} <= shown, done.stdout


@pytest.mark.slow
def test_log_timeline_false_records_nothing_and_the_command_says_so(tmp_path):
    from tests.helpers import run_up, write_config

    code, out = run_up(write_config(tmp_path, "[log]\ntimeline = false", steps=1))
    assert code == 0, out
    assert not (tmp_path / "run" / "timeline").exists()
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", "timeline", "--run-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "log.timeline = false" in done.stderr


def test_the_benchmarks_cost_of_a_position_is_the_forwards_time_over_their_positions(tmp_path):
    """benchmarks' summary over steps 2..3 (1-4 s): forwards and backwards of 100 and 300
    positions taking 0.2 and 0.4 s cost 600 ms / 400 positions = 1.5 ms a position; one
    before the window, and one without positions, are not counted."""
    from benchmarks.common import timeline_summary

    s = 1_000_000
    write(
        tmp_path,
        "learner",
        [
            span("forward and backward", 0, s // 2, positions=50),
            mark(1, s),
            span("forward and backward", s, s // 5, positions=100),
            mark(2, 2 * s),
            span("forward and backward", 2 * s, 2 * s // 5, positions=300),
            span("forward and backward", 3 * s, s // 10),
            mark(3, 4 * s),
        ],
    )
    learner = timeline_summary(tmp_path, 3)["learner"]
    assert learner["forward_backward_ms_per_position"] == pytest.approx(1.5)


def test_the_summary_gives_a_step_and_each_step_s_longest_decoding_averaged(tmp_path):
    """Steps 2..3 (step ends at 1, 2 and 4 s): groups sent in step 2 after 1 and 3 s of
    decoding, in step 3 after 2 s, by two actors: (3 + 2) / 2 = 2.5 s; one sent before
    the window, and one without `decoding_s`, are not counted. A step: 3 s / 2. The
    benchmarks' summary reads the same."""
    from benchmarks.common import timeline_summary

    s = 1_000_000
    write(tmp_path, "learner", [mark(1, s), mark(2, 2 * s), mark(3, 4 * s)])
    sends = [(s // 2, 9.0), (s + 100, 1.0), (s + 200, 3.0), (3 * s, 2.0), (3 * s + 100, None)]
    for actor, mine in (("actor-0", sends[:2] + sends[3:]), ("actor-1", sends[2:3])):
        write(
            tmp_path,
            actor,
            [
                span("send", ts, 10, group=str(ts), **({} if d is None else {"decoding_s": d}))
                for ts, d in mine
            ],
        )
    text = write_timeline(tmp_path, steps="2:3")
    assert "a step: 1.50 s; its longest group decoded for 2.50 s (on average)" in text, text
    learner = timeline_summary(tmp_path, 3)["learner"]
    assert (learner["wall_step_s"], learner["longest_group_s"]) == (pytest.approx(1.5), pytest.approx(2.5))
    write(tmp_path, "actor-0", [span("send", s + 100, 10, group="0")])  # a static engine's: none
    write(tmp_path, "actor-1", [])
    assert "longest group" not in write_timeline(tmp_path, steps="2:3")

"""The timeline: spans recorded per process, merged into one trace, summed per process."""

from __future__ import annotations

import json
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
from protocol.timeline import WAIT, Timeline, open_timeline, timeline_dir


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
    from protocol import timeline

    try:
        timeline.start(tmp_path, "learner")
        with timeline.span("step", step=1):
            timeline.record("publish weights", 0.0, 0.5)
        timeline.mark("step", step=1)
    finally:
        timeline.start(None, "learner")  # back to off, the file closed
    assert not timeline.current().on
    names = [e["name"] for e in read_events(tmp_path)["learner"]]
    assert sorted(names) == ["publish weights", "step", "step"]

"""Where a process's time goes: spans it records into the run directory.

Each process (learner, actor, reward and env workers) appends what it did and when to
`RUN/timeline/<process>.jsonl`, one Chrome trace event per line: a span ("ph": "X") with
its start and duration in microseconds of the wall clock, its thread, and a category,
`busy` (computing) or `wait` (blocked on a peer: groups, credit, weights, a reply).
`orchestrator timeline` merges the files into one trace that Perfetto and
chrome://tracing open, and sums each process's busy and waiting time.

Recording stays on by default (`log.timeline`): a span costs two clock reads and one
buffered line, a few microseconds, against decode steps and learner micro-batches of
milliseconds to seconds. Lines are flushed every second, so a crash loses at most that.
The wall clock (not a monotonic one) lets processes on one machine share a time axis; on
several machines the tracks are as aligned as their clocks.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

BUSY, WAIT = "busy", "wait"
FLUSH_S = 1.0


def timeline_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "timeline"


class Timeline:
    """Spans of one process. Disabled (`path` None), every call is a no-op."""

    def __init__(self, path: Path | None) -> None:
        self._file: IO[str] | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", buffering=1 << 16)
        self._lock = threading.Lock()
        self._threads: dict[int, int] = {}
        self._flushed = time.monotonic()

    @property
    def on(self) -> bool:
        return self._file is not None

    @contextmanager
    def span(self, name: str, cat: str = BUSY, **args: Any) -> Iterator[dict[str, Any]]:
        """Record the block as a span. The yielded dict takes more `args` as it runs
        (e.g. how many rows a decode step had)."""
        if self._file is None:
            yield args
            return
        start = time.time()
        try:
            yield args
        finally:
            self.record(name, start, time.time() - start, cat, **args)

    def record(self, name: str, start: float, seconds: float, cat: str = BUSY, **args: Any) -> None:
        """A span that began at `start` (time.time()) and lasted `seconds`."""
        if self._file is None:
            return
        event = {"name": name, "cat": cat, "ph": "X", "ts": round(start * 1e6), "dur": round(seconds * 1e6)}
        self._write(event, args)

    def mark(self, name: str, **args: Any) -> None:
        """An instant (a step's end)."""
        if self._file is not None:
            self._write(
                {"name": name, "cat": "mark", "ph": "i", "s": "p", "ts": round(time.time() * 1e6)}, args
            )

    def _write(self, event: dict[str, Any], args: dict[str, Any]) -> None:
        with self._lock:
            if self._file is None:
                return
            event["tid"] = self._threads.setdefault(threading.get_ident(), len(self._threads))
            if args:
                event["args"] = args
            self._file.write(json.dumps(event, separators=(",", ":")) + "\n")
            if time.monotonic() - self._flushed > FLUSH_S:
                self._file.flush()
                self._flushed = time.monotonic()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


OFF = Timeline(None)
# The process's timeline: one per process, so that any module records into it without
# the object being handed down through every constructor.
_current = OFF


def open_timeline(run_dir: str | Path | None, process: str, enabled: bool = True) -> Timeline:
    """The timeline of `process` (learner, actor-0, reward-worker-1, ...) in `run_dir`."""
    if run_dir is None or not enabled:
        return OFF
    return Timeline(timeline_dir(run_dir) / f"{process}.jsonl")


def start(run_dir: str | Path | None, process: str, enabled: bool = True) -> Timeline:
    """Open this process's timeline, the one `span`, `record` and `mark` write to."""
    global _current
    _current.close()
    _current = open_timeline(run_dir, process, enabled)
    return _current


def current() -> Timeline:
    return _current


def span(name: str, cat: str = BUSY, **args: Any):
    """`Timeline.span` on this process's timeline."""
    return _current.span(name, cat, **args)


def record(name: str, start: float, seconds: float, cat: str = BUSY, **args: Any) -> None:
    _current.record(name, start, seconds, cat, **args)


def mark(name: str, **args: Any) -> None:
    _current.mark(name, **args)

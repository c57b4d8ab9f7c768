"""What `orchestrator up` prints: a live bar on a terminal (checked on a real
pseudo-terminal), plain lines with no control codes anywhere else."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios

import pytest

from orchestrator.progress import format_eval, format_step, health
from tests.helpers import ROOT, run_up, write_config

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
STEP = {
    "step": 7,
    "reward": 0.61234,
    "reward_std": 0.2,
    "kl": 0.00123,
    "clip_ratio/region_mean": 0.05,
    "completions/mean_length": 19.6,
    "rollout_tokens_per_s": 5321.4,
    "step_s": 0.734,
    "version_lag_mean": 0.5,
    "learner_peak_mb": 310.2,
    "learner_share_mb": 4000.0,
    "actor_peak_mb": 201.0,
    "actor_share_mb": 3000.0,
}


def test_the_lines_say_what_tells_a_run_is_healthy():
    assert format_step(STEP, 200) == (
        "step    7/200  reward 0.612 ± 0.200  kl 0.0012  clip 0.050  len 20  rollout 5321 tok/s  0.73 s/step"
    )
    assert health(STEP) == ("reward 0.612  5321 tok/s  staleness 0.5  learner 310/4000 MB  actor 201/3000 MB")
    assert health({"step": 1}) == "reward -  - tok/s  staleness -"
    cispo = {**{k: v for k, v in STEP.items() if k != "clip_ratio/region_mean"}, "cispo_clip_ratio": 0.25}
    assert "clip 0.250" in format_step(cispo, 200)  # CISPO's own: the tokens whose weight was capped
    line = format_eval(
        {
            "step": 25,
            "eval/pass@1": 0.4612,
            "eval/pass@4": 0.835,
            "eval/reward_mean": 0.5,
            "eval/prompts": 200,
            "eval/runtime_s": 4.51,
        }
    )
    assert line == "eval at step 25: pass@1 0.461  pass@4 0.835  reward 0.500  (200 prompts, 4.5 s)"


@pytest.mark.slow
def test_piped_output_is_plain_lines(tmp_path):
    code, out = run_up(write_config(tmp_path, steps=3))
    assert code == 0, out
    assert not ANSI.search(out) and "\r" not in out
    assert [line[:9] for line in out.splitlines() if line.startswith("step ")] == [
        "step    1",
        "step    2",
        "step    3",
    ]


def read_all(fd: int) -> bytes:
    chunks = []
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:  # EIO once the other side is closed (Linux)
            break
        if not data:  # EOF (macOS)
            break
        chunks.append(data)
    return b"".join(chunks)


def terminal_env() -> dict[str, str]:
    """An xterm whose size is the pty's: COLUMNS and LINES, which a parent (a parallel test
    worker) may have set, would override it."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    return {**env, "TERM": "xterm"}


@pytest.mark.slow
@pytest.mark.parametrize("columns", [200, 80])
def test_a_terminal_gets_a_live_bar_above_which_the_lines_scroll(tmp_path, columns):
    """On 80 columns too the bar keeps its left side (step, bar, eta); the figures after it
    are cut short instead."""
    cfg = write_config(tmp_path, steps=3)
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "up", "--config", str(cfg)],
        cwd=ROOT,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=terminal_env(),
    )
    os.close(slave)
    try:
        out = read_all(master).decode(errors="replace")
    finally:
        os.close(master)
        proc.wait(timeout=300)
    assert proc.returncode == 0, out
    assert ANSI.search(out), "no terminal control codes: the bar was not drawn"
    text = ANSI.sub("", out)
    for n in (1, 2, 3):
        assert f"step    {n}/3  reward" in text  # every step's line is kept, above the bar
    bar = [line for line in text.replace("\r", "\n").splitlines() if "3/3" in line and "eta" in line]
    assert bar, text
    assert re.search(r"step 3/3 .+ eta", bar[-1]) and len(bar[-1].rstrip()) <= columns, bar[-1]
    figures = r"reward \d\.\d{3}  \d+ tok/s  staleness \d\.\d  learner \d+/\d+ MB"
    if columns == 200:
        assert re.search(figures, bar[-1]), bar[-1]
    else:
        assert "reward" in bar[-1] and bar[-1].rstrip().endswith("…"), bar[-1]

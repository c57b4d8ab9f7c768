"""Agent sessions against environment episodes: one task, two ways, in the same run.

    python -m benchmarks.agents            # the tiny model, 12 steps, 3 repeats
    python -m benchmarks.agents --quick    # 3 steps, 1 repeat: checks the harness

The task is examples/digits_env.py's, in chat: the model is shown a digit and answers,
then shown the next, three turns; each answer scores the share of its characters that
are the digit. It runs once as environment episodes (`Digits` below, served by an env
worker over the env socket) and once as an agent (`digits_agent` below: a Python function
that calls the served API with OpenAI's client, the same turns, the same reward). Both are
`orchestrator up` runs of the tiny model, 8 rows x 8 a step, `max_staleness = 1`,
interleaved repeat by repeat. Reported: sessions (episodes) per second over steps 2..N,
and the learner's busy share over those steps (from the timeline).
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import EXAMPLES, ROOT, harness, log, of_process, timeline_summary, write_results

BATCH, GROUP = 8, 8


class Digits:
    """The environment: digits_env.py's task for chat prompts."""

    def reset(self, prompt, digits: str, **columns) -> str:
        self.digits, self.turn = digits, 0
        return ""  # the prompt shows the first digit

    def step(self, action: str) -> tuple[str, float, bool]:
        digit = self.digits[self.turn]
        reward = action.count(digit) / max(len(action), 1) / len(self.digits)
        self.turn += 1
        if self.turn == len(self.digits):
            return "", reward, True
        return f"repeat {self.digits[self.turn]}", reward, False


def digits_agent(row: dict, base_url: str, api_key: str) -> float:
    """The agent: the same turns and reward, through OpenAI's client."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages, digits, total = list(row["prompt"]), row["digits"], 0.0
    for k, digit in enumerate(digits):
        reply = client.chat.completions.create(model="m", messages=messages, max_tokens=4)
        text = reply.choices[0].message.content or ""
        total += text.count(digit) / max(len(text), 1) / len(digits)
        if k + 1 < len(digits):
            messages += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": f"repeat {digits[k + 1]}"},
            ]
    return total


def write_files(folder: Path, steps: int) -> dict[str, Path]:
    rng = random.Random(0)
    with open(folder / "prompts.jsonl", "w") as f:
        for _ in range(200):
            digits = "".join(rng.choice("0123456789") for _ in range(3))
            f.write(
                json.dumps({"prompt": [{"role": "user", "content": f"repeat {digits[0]}"}], "digits": digits})
                + "\n"
            )
    common = f"""
[model]
path = "{EXAMPLES / "tiny-model"}"
[data]
prompts = "prompts.jsonl"
[sampling]
group_size = {GROUP}
max_tokens = 4
[train]
steps = {steps}
batch_size = {BATCH}
learning_rate = 3e-4
max_staleness = 1
checkpoint_every = 0
[reward]
functions = ["env"]
"""
    env = common + '[env]\nenvironment = "benchmarks.agents:Digits"\nmax_turns = 3\nmax_episode_tokens = 64\n'
    agent = common + '[agent]\nfunction = "benchmarks.agents:digits_agent"\nmax_episode_tokens = 64\n'
    paths = {}
    for name, text in (("env socket", env), ("agent", agent)):
        path = folder / f"{name.replace(' ', '_')}.toml"
        path.write_text(text + f'[run]\ndir = "runs/{path.stem}"\n')
        paths[name] = path
    return paths


def run_once(config: Path, folder: Path, steps: int) -> dict:
    """One `orchestrator up`: sessions per second and the learner's busy share, steps 2..N."""
    from orchestrator.timeline import read_events, window

    run_dir = folder / "runs" / config.stem
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    t0 = time.perf_counter()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestrator",
            "up",
            "--config",
            str(config),
            "--set",
            f"reward.search_path={ROOT}",
        ],
        cwd=folder,
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{config.stem}: orchestrator up failed:\n{out.stdout[-2000:]}")
    start, end = window(read_events(run_dir), (2, steps))
    summary = timeline_summary(run_dir, steps)
    return {
        "sessions_per_s": (steps - 1) * BATCH * GROUP / ((end - start) / 1e6),  # the timeline's µs
        "learner_busy": of_process(summary, "learner")["busy"],
        "rows_per_decode_step": of_process(summary, "actor").get("rows_per_decode_step"),
        "wall_s": time.perf_counter() - t0,
    }


def main() -> None:
    args = harness(__doc__).parse_args()
    steps, repeats = (3, 1) if args.quick else (12, args.repeats)
    runs: dict[str, list[dict]] = {"env socket": [], "agent": []}
    with tempfile.TemporaryDirectory(prefix="mlxrl-agents-") as tmp:
        folder = Path(tmp)
        configs = write_files(folder, steps)
        for r in range(repeats):
            for name, config in configs.items():
                log(f"{name}, repeat {r + 1}/{repeats}")
                runs[name].append(run_once(config, folder, steps))

    def med(name: str, key: str) -> float:
        return statistics.median(x[key] for x in runs[name] if x[key] is not None)

    env_rate = med("env socket", "sessions_per_s")
    rows = [
        "| rollouts | sessions/s | vs env socket | learner busy | rows a decode step |",
        "|---|---|---|---|---|",
    ]
    for name in runs:
        rate = med(name, "sessions_per_s")
        rows.append(
            f"| {name} | {rate:.1f} | {rate / env_rate:.2f}x | {med(name, 'learner_busy'):.0%} | "
            f"{med(name, 'rows_per_decode_step'):.1f} |"
        )
    report = (
        f"Agent sessions against env episodes: the tiny model, digits in chat (3 turns), {BATCH} rows x "
        f"{GROUP} a step, max_staleness 1; steps 2..{steps}, median of {repeats}.\n\n"
        + "\n".join(rows)
        + "\n"
    )
    write_results(args.results_dir, "agents", {"steps": steps, "repeats": repeats, "runs": runs}, report)


if __name__ == "__main__":
    main()

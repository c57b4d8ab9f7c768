"""Drive a run from Python: start it, follow its metrics as they arrive, wait for it, stop
it. The same run as `orchestrator up`, which it starts as a child process (so the actor
and learner are owned exactly as on the command line, and a crash of this interpreter
stops them):

    import orchestrator
    import my_rewards

    with orchestrator.start("run.toml", {"train.steps": 50,
                                         "reward.functions": [my_rewards.correctness]}) as run:
        for line in run.metrics():
            print(line["step"], line["reward"])
    print(run.wait())  # up's exit code: 0 when every step was trained

Settings are `section.key` names with Python values (TOML's types). A reward function may
be given as a callable defined at the top level of an importable module: it is recorded
by its import path (`module:function`), and the learner imports it from there. A lambda,
a closure or a function of the script being run cannot be imported by another process,
and is refused with the reason.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from orchestrator.show import MetricsFollower
from runtime import lifecycle
from runtime.config import ConfigError


def start(
    config: str | Path | None = None,
    settings: Mapping[str, Any] | None = None,
    *,
    resume: str | Path | None = None,
    run_dir: str | Path | None = None,
    overwrite: bool = False,
    output: IO[str] | None = None,
) -> Run:
    """Start `orchestrator up` on `config` with `settings` (or continue the run in `resume`,
    whose config.json is the config). `output`: where up's progress goes; default: this
    process's stdout. Raises ConfigError for settings that cannot be passed on."""
    if (config is None) == (resume is None):
        raise ConfigError("give a config to start a run, or resume=RUN_DIR to continue one")
    args = ["--config", str(config)] if config is not None else ["--resume", str(resume)]
    extra: list[str] = []
    for name, value in (settings or {}).items():
        extra += ["--set", f"{name}={toml_value(name, value)}"]
    if run_dir is not None:
        args += ["--run-dir", str(run_dir)]
    if overwrite:
        args.append("--overwrite")
    # What imports here imports in the run: reward modules named by path (also a resumed
    # run's, whose config.json names them). Our packages come first, so that a caller's
    # folder holding a `rewards.py` does not shadow them.
    env = lifecycle.child_env()
    callers = [p for p in sys.path if p and os.path.isdir(p)]
    env["PYTHONPATH"] = os.pathsep.join([str(lifecycle.SOURCE_ROOT), *callers, env["PYTHONPATH"]])
    proc = subprocess.Popen(
        lifecycle.python_module("orchestrator", "up", *args, *extra),
        env=env,
        text=True,
        stdout=output,
        stderr=None if output is None else subprocess.STDOUT,
    )
    return Run(proc, Path(resume) if resume is not None else None, config, run_dir, settings or {})


class Run:
    """A run started by `start`. `metrics()` follows it, `wait()` waits for its end, `stop()`
    stops it cleanly (as Ctrl-C does: the learner checkpoints, `resume` continues it)."""

    def __init__(
        self,
        proc: subprocess.Popen,
        resumed: Path | None,
        config: str | Path | None,
        run_dir: str | Path | None,
        settings: Mapping[str, Any],
    ) -> None:
        self.proc, self.resumed = proc, resumed is not None
        self._dir = resumed or (Path(run_dir) if run_dir is not None else None)
        self._config, self._settings = config, settings

    @property
    def dir(self) -> Path:
        """The run directory (from the config, unless given)."""
        if self._dir is None:
            from runtime.config import load_config

            overrides = [f"{k}={toml_value(k, v)}" for k, v in self._settings.items()]
            self._dir = Path(load_config(str(self._config), overrides).run.dir)
        return self._dir

    def metrics(self, poll_s: float = 0.2) -> Iterator[dict[str, Any]]:
        """Each line of metrics.jsonl (training steps, and evaluations) as it is written,
        until the run ends. Lines are never repeated: a resumed run's, or a restarted
        learner's, earlier steps are not given again (the steps it trains again are)."""
        follower = MetricsFollower(self.dir, self.resumed)
        while True:
            running = self.proc.poll() is None
            yield from follower.new()
            if not running:
                return
            time.sleep(poll_s)

    def wait(self, timeout: float | None = None) -> int:
        """Up's exit code (docs/faults.md, "Exit codes"): 0 when the run trained every step."""
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 120.0) -> int:
        """Stop cleanly, as Ctrl-C does; kill it if it has not stopped within `timeout`."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def toml_value(name: str, value: Any) -> str:
    """`value` as a TOML literal for `--set`; callables (reward functions) by import path."""
    if name == "reward.functions" and isinstance(value, (list, tuple)):
        value = [import_path(v) if callable(v) else v for v in value]
    elif callable(value):
        value = import_path(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)) or (
        isinstance(value, list)
        and all(isinstance(v, (int, float, str)) and not isinstance(v, bool) for v in value)
    ):
        return json.dumps(value)  # JSON's numbers, strings and lists of them are TOML's
    raise ConfigError(
        f"{name}: {value!r} is not a setting a config can hold (a number, a string, a bool, "
        "or a list of numbers or strings)"
    )


def import_path(fn: Callable) -> str:
    """`module:function` for a function another process can import, else ConfigError saying why."""
    name, module = getattr(fn, "__qualname__", None), getattr(fn, "__module__", None)
    if not name or not module:
        raise ConfigError(f"{fn!r} has no import path: give a function defined in a module")
    if "<lambda>" in name or "<locals>" in name:
        raise ConfigError(
            f"reward function {name} is a lambda or is defined inside a function: the learner, "
            "another process, imports reward functions by path; define it at the top level "
            f"of a module (here: {module})"
        )
    if module == "__main__":
        raise ConfigError(
            f"reward function {name} is defined in the script being run: the learner would "
            "import that script, and run it; put reward functions in a module of their own"
        )
    target = sys.modules.get(module)
    for part in name.split("."):
        target = getattr(target, part, None)
    if target is not fn:
        raise ConfigError(f"reward function {module}.{name} is not reachable by that name in its module")
    return f"{module}:{name}"

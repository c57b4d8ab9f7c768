"""The Python entry point (`orchestrator.start`): a run started, followed, stopped and
resumed from Python, with a reward function given as a callable."""

from __future__ import annotations

import sys

import pytest

import orchestrator
from orchestrator.run import import_path, toml_value
from runtime.config import ConfigError
from runtime.lifecycle import EXIT_OK, signal_exit_code
from tests.helpers import write_config

pytestmark = pytest.mark.slow  # real processes end to end: left out of the fast subset

REWARDS = """
def half(completions, **columns):
    return [0.5] * len(completions)
"""


@pytest.fixture
def my_rewards(tmp_path, monkeypatch):
    """A user's reward module, importable here (and so, by its path, in the learner)."""
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "my_rewards_for_api.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(mods))
    import my_rewards_for_api

    yield my_rewards_for_api
    sys.modules.pop("my_rewards_for_api", None)


def test_settings_become_toml_and_functions_their_import_path(my_rewards):
    assert toml_value("train.steps", 3) == "3" and toml_value("algorithm.beta", 0.04) == "0.04"
    assert toml_value("run.insecure", True) == "true" and toml_value("data.split", "train") == '"train"'
    functions = toml_value("reward.functions", [my_rewards.half, "worker"])
    assert functions == '["my_rewards_for_api:half", "worker"]'
    with pytest.raises(ConfigError, match="not a setting a config can hold"):
        toml_value("train.steps", {"a": 1})


def test_a_lambda_a_closure_or_a_function_of_the_script_is_refused_saying_why():
    def inner(completions, **kw):
        return [0.0] * len(completions)

    with pytest.raises(ConfigError, match="lambda or is defined inside a function"):
        import_path(lambda completions, **kw: [0.0])
    with pytest.raises(ConfigError, match="lambda or is defined inside a function"):
        import_path(inner)
    inner.__module__, inner.__qualname__ = "__main__", "inner"
    with pytest.raises(ConfigError, match="defined in the script being run"):
        import_path(inner)
    assert import_path(toml_value) == "orchestrator.run:toml_value"


def test_a_run_is_started_followed_stopped_and_resumed_from_python(tmp_path, my_rewards):
    """Metrics arrive as the run trains; stop() is a clean stop (exit 130, a checkpoint);
    resume continues and yields only the steps it trains."""
    cfg = write_config(tmp_path, steps=1000)
    log = open(tmp_path / "up.log", "w")
    with orchestrator.start(
        cfg, {"reward.functions": [my_rewards.half], "train.checkpoint_every": 0}, output=log
    ) as run:
        seen = []
        for line in run.metrics():
            seen.append(line)
            if line["step"] == 2:
                break
        assert run.stop() == signal_exit_code(2)  # SIGINT, as Ctrl-C
    assert [m["step"] for m in seen] == [1, 2] and all(m["reward"] == 0.5 for m in seen)
    assert run.dir == tmp_path / "run" and (run.dir / "checkpoints").is_dir()
    stopped_at = max(int(p.name.split("_")[1]) for p in (run.dir / "checkpoints").iterdir())
    with orchestrator.start(resume=run.dir, settings={"train.steps": stopped_at + 2}, output=log) as again:
        steps = [m["step"] for m in again.metrics()]
        assert again.wait() == EXIT_OK
    assert steps == [stopped_at + 1, stopped_at + 2], (steps, (tmp_path / "up.log").read_text())

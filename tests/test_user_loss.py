"""A loss of the user's own: `algorithm.name = "module:Class"`, imported from beside the
config like a reward function. The config checks its form, the learner imports it (before
the model loads) and says what is wrong; docs/algorithms.md's example works as written; and
a real run trains with it."""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest

from learner.algorithms import GRPO, LossInputs, load_algorithm, make_algorithm
from runtime import lifecycle
from runtime.config import AlgorithmConfig, ConfigError, load_config, validate
from tests.helpers import ROOT, read_metrics, run_up, write_config

# GRPO whose policy terms are doubled, and which says so in the metrics.
MY_LOSS = """
from dataclasses import dataclass

import mlx.core as mx

from learner.algorithms import GRPO


@dataclass(frozen=True)
class MyLoss(GRPO):
    scale: float = 2.0

    def surrogate(self, x):
        per_token, diagnostics = super().surrogate(x)
        return self.scale * per_token, {**diagnostics, "my_loss/scale": mx.array(self.scale)}


def helper():
    return 1


class NotALoss:
    def advantages(self, rewards):
        return rewards
"""

RAW = {"model": {"path": "m"}, "data": {"prompts": "p.jsonl"}, "reward": {"functions": ["m:f"]}}


@pytest.mark.parametrize("name", ["my_loss:MyLoss", "pkg.losses:Mine", "grpo", "vespo", "luspo"])
def test_the_config_takes_a_built_in_name_or_module_class(name):
    assert validate({**RAW, "algorithm": {"name": name}}).algorithm.name == name


@pytest.mark.parametrize("name", ["ppo", "my_loss:", ":MyLoss", "a:b:c", "GRPO"])
def test_the_config_refuses_anything_else_naming_the_choices(name):
    with pytest.raises(ConfigError, match=r"algorithm.name must be one of 'grpo', .* or 'module:Class'"):
        validate({**RAW, "algorithm": {"name": name}})


def test_a_user_loss_loads_from_beside_the_config_with_the_sections_settings(tmp_path):
    (tmp_path / "my_loss.py").write_text(MY_LOSS)
    (tmp_path / "p.jsonl").write_text('{"prompt": "x"}\n')
    (tmp_path / "run.toml").write_text(
        '[model]\npath = "m"\n[data]\nprompts = "p.jsonl"\n[reward]\nfunctions = ["m:f"]\n'
        '[algorithm]\nname = "my_loss:MyLoss"\nbeta = 0.04\nepsilon = 0.1\n'
    )
    cfg = load_config(tmp_path / "run.toml")
    assert cfg.reward.search_path == str(tmp_path)  # reward.search_path: the config's folder
    alg = load_algorithm(cfg.algorithm, 6, cfg.reward.search_path)
    assert type(alg).__name__ == "MyLoss" and isinstance(alg, GRPO)
    assert (alg.beta, alg.epsilon_low, alg.epsilon_high, alg.max_tokens) == (0.04, 0.1, 0.1, 6)
    # Its terms are GRPO's doubled, the KL (the shared tail) is not.
    grpo = make_algorithm("grpo", beta=0.04, epsilon=0.1, max_tokens=6)
    rng = np.random.default_rng(0)
    logp = mx.array(rng.normal(-2, 0.3, (3, 4)).astype(np.float32))
    x = LossInputs(
        logp, logp - 0.05, logp + 0.1, mx.array([1.0, -1.0, 0.5]), mx.ones((3, 4)), mx.ones((3, 4))
    )
    (mine, d_mine), (base, d_base) = alg.loss_sum(x), grpo.loss_sum(x)
    surrogate = float(d_base["surrogate_loss"].item())
    assert float(d_mine["surrogate_loss"].item()) == pytest.approx(2 * surrogate, rel=1e-6)
    assert float(mine.item()) == pytest.approx(float(base.item()) + surrogate, rel=1e-5)  # one more
    assert float(d_mine["my_loss/scale"].item()) == 2.0


@pytest.mark.parametrize(
    "name,problem",
    [
        ("no_such_module:Loss", "algorithm.name 'no_such_module:Loss': cannot import 'no_such_module'"),
        ("my_loss:Missing", "algorithm.name 'my_loss:Missing': my_loss has no class 'Missing'"),
        ("my_loss:helper", "algorithm.name 'my_loss:helper': helper is a function, not a class"),
        (
            "my_loss:NotALoss",
            "algorithm.name 'my_loss:NotALoss': NotALoss is not a loss, it has no from_config, "
            "keep_group, normalizer, loss_sum (subclass learner.algorithms.GRPO",
        ),
        (
            "broken:Loss",
            "algorithm.name 'broken:Loss': importing it raised ZeroDivisionError: division by zero",
        ),
        ("unparsable:Loss", "algorithm.name 'unparsable:Loss': importing it raised SyntaxError"),
        ("ppo", "algorithm.name: unknown algorithm 'ppo'; choose one of grpo, bnpo"),
    ],
)
def test_a_user_loss_that_does_not_load_says_what_is_wrong(tmp_path, name, problem):
    (tmp_path / "my_loss.py").write_text(MY_LOSS)
    (tmp_path / "broken.py").write_text("x = 1 / 0\n")
    (tmp_path / "unparsable.py").write_text("def (:\n")
    with pytest.raises(ConfigError) as e:
        load_algorithm(AlgorithmConfig(name=name), 6, str(tmp_path))
    assert str(e.value).startswith(problem), str(e.value)


BATCH_CENTRED = """
from dataclasses import dataclass

import numpy as np

from learner.algorithms import GRPO


@dataclass(frozen=True)
class BatchCentred(GRPO):
    def advantages(self, rewards):
        return (rewards - rewards.mean()).reshape(-1)  # the whole batch's mean: across groups


@dataclass(frozen=True)
class BatchCentredAndSaysSo(BatchCentred):
    @property
    def group_local(self):
        return False
"""


def test_a_loss_whose_advantages_look_across_groups_must_say_so(tmp_path):
    """The learner trains each group as it arrives, computing a take's advantages alone. A
    user's loss centring on the batch's mean, left group_local (GRPO's default), would
    train on wrong advantages without a word: the learner refuses it before its model
    loads, naming the property. Said so, or not learning groups as they arrive, it loads;
    built-in objectives pass the check."""
    from learner.algorithms import ALGORITHMS
    from learner.ranks import check_loss, load_trainer

    (tmp_path / "batch_loss.py").write_text(BATCH_CENTRED)
    (tmp_path / "p.jsonl").write_text('{"prompt": "x"}\n')

    def config(name: str):
        (tmp_path / "run.toml").write_text(
            '[model]\npath = "no-such-model"\n[data]\nprompts = "p.jsonl"\n[reward]\nfunctions = ["m:f"]\n'
            f'[algorithm]\nname = "{name}"\n'
        )
        return load_config(tmp_path / "run.toml")

    refused = r"'batch_loss:BatchCentred': BatchCentred.group_local is True, but a group's advantages"
    with pytest.raises(ConfigError, match=refused):
        load_trainer(config("batch_loss:BatchCentred"))  # before the (missing) model loads
    check_loss(config("batch_loss:BatchCentred").replace(train={"stream_groups": False}))
    check_loss(config("batch_loss:BatchCentredAndSaysSo"))
    for name in ALGORITHMS:  # every built-in: group-scaled by default
        check_loss(config(name))


def docs_example() -> tuple[str, str]:
    """docs/algorithms.md's user loss: the Python file and the class its TOML names."""
    page = (ROOT / "docs" / "algorithms.md").read_text()
    code = re.search(r"```python\n(# my_loss.py, beside the config\n.*?)```", page, re.S)
    name = re.search(r'```toml\n\[algorithm\]\nname = "(my_loss:\w+)"\n```', page)
    assert code and name, "docs/algorithms.md has lost its user-loss example"
    return code.group(1), name.group(1)


def test_the_docs_example_works_as_written(tmp_path):
    """Dual clipping, by hand: one completion, A = -1, token ratios 5 and 1. GRPO's terms
    are -min(r A, clip(r) A) = 5 and 1 (mean 3, gradient 5 / 2 and 1 / 2 in logp); capped at
    c |A| = 3 the first is 3 (mean 2), and no longer moves with logp."""
    code, name = docs_example()
    (tmp_path / "my_loss.py").write_text(code)
    alg = make_algorithm(name, search_path=str(tmp_path))
    logp = np.log(np.array([[5.0, 1.0]], np.float32))

    def f(lp):
        x = LossInputs(lp, mx.zeros((1, 2)), None, mx.array([-1.0]), mx.ones((1, 2)), mx.ones((1, 2)))
        total, diagnostics = alg.loss_sum(x)
        return total / alg.normalizer(np.ones((1, 2))), diagnostics

    (loss, diagnostics), grad = mx.value_and_grad(f)(mx.array(logp))
    assert float(loss.item()) == pytest.approx(2.0, abs=1e-6)
    np.testing.assert_allclose(np.array(grad), [[0.0, 0.5]], atol=1e-6)
    assert float(diagnostics["dual_clip_fraction"].item()) == 0.5


@pytest.mark.slow
def test_a_run_trains_with_a_user_loss_beside_its_config(tmp_path):
    (tmp_path / "my_loss.py").write_text(MY_LOSS)
    cfg = write_config(tmp_path, '[algorithm]\nname = "my_loss:MyLoss"', steps=3)
    code, out = run_up(cfg)
    assert code == 0, out
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    # the user's class computed every step's loss: its own metric is there
    assert all(m["my_loss/scale"] == 2.0 for m in metrics), metrics[-1]
    assert all(np.isfinite(m["loss"]) and np.isfinite(m["surrogate_loss"]) for m in metrics)


@pytest.mark.slow
def test_a_run_whose_loss_does_not_load_stops_at_once_naming_it(tmp_path):
    (tmp_path / "my_loss.py").write_text(MY_LOSS)
    cfg = write_config(tmp_path, '[algorithm]\nname = "my_loss:Missing"', steps=3)
    code, out = run_up(cfg, timeout=120)
    assert code == lifecycle.EXIT_USER_ERROR, out
    assert "learner stopped the run (user error, exit code 4)" in out
    assert "algorithm.name 'my_loss:Missing': my_loss has no class 'Missing'" in out
    assert "restarting" not in out

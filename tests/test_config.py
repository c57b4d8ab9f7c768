"""The run configuration: TOML loading, validation, overrides, path resolution, and the CLI."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.config import (
    SECTIONS,
    Config,
    ConfigError,
    as_dict,
    load_config,
    load_run_config,
    parse_override,
    read_run_config,
    reference_table,
    validate,
    write_run_config,
)

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
TINY = EXAMPLES / "tiny.toml"
TINY_MODEL = EXAMPLES / "tiny-model"
TINY_PROMPTS = EXAMPLES / "tiny_prompts.jsonl"


def base_sections() -> dict[str, dict[str, str]]:
    """A minimal valid config; values are TOML literals. Absolute paths to the real example."""
    return {
        "model": {"path": json.dumps(str(TINY_MODEL))},
        "data": {"prompts": json.dumps(str(TINY_PROMPTS))},
        "reward": {"functions": '["tiny_task:reward"]'},
    }


def toml_text(sections: dict[str, dict[str, str]]) -> str:
    lines = []
    for section, keys in sections.items():
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {value}" for key, value in keys.items())
        lines.append("")
    return "\n".join(lines)


def write_config(
    tmp_path: Path,
    sections: dict[str, dict[str, str]] | None = None,
    name: str = "run.toml",
    **changes: dict[str, str],
) -> Path:
    """Write base_sections() with `changes` merged in (section=dict of key -> literal)."""
    sections = sections if sections is not None else base_sections()
    for section, keys in changes.items():
        sections.setdefault(section, {}).update(keys)
    path = tmp_path / name
    path.write_text(toml_text(sections))
    return path


def value(cfg: Config, section: str, key: str):
    return getattr(getattr(cfg, section), key)


def error_of(path: Path, **kw) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, **kw)
    return str(info.value)


# --------------------------------------------------------------------------- the example


def test_example_config_loads_and_resolves():
    cfg = load_config(str(TINY))
    assert (
        list(cfg.to_dict())
        == list(SECTIONS)
        == [
            "model",
            "lora",
            "data",
            "sampling",
            "train",
            "algorithm",
            "actor",
            "learner",
            "reward",
            "env",
            "agent",
            "log",
            "eval",
            "run",
        ]
    )
    # Values from the file.
    assert cfg.lora.rank == 8
    assert cfg.lora.scale == 20.0
    assert cfg.sampling.group_size == 8
    assert cfg.sampling.max_tokens == 8
    assert cfg.train.steps == 60
    assert cfg.train.learning_rate == pytest.approx(3e-4)
    assert cfg.train.checkpoint_every == 20
    assert cfg.algorithm.name == "grpo"
    assert cfg.reward.functions == ("tiny_task:reward",)
    # Defaults filled in.
    assert cfg.lora.dropout == 0.0
    assert cfg.lora.num_layers == -1
    assert cfg.lora.keys == ()
    assert cfg.data.shuffle is True
    assert cfg.sampling.top_p == 1.0
    assert cfg.sampling.top_k == 0
    assert cfg.sampling.max_prompt_tokens == 1024
    assert cfg.algorithm.beta == 0.0
    assert cfg.algorithm.epsilon is None  # unset: the objective's own default
    assert cfg.algorithm.num_iterations == 1
    assert cfg.algorithm.is_correction == "none"
    assert cfg.train.max_staleness == 0
    assert cfg.run.transport == "ipc"
    assert cfg.run.host == "127.0.0.1"
    assert cfg.run.port == 5555
    # Paths: absolute, existing, relative to the config file.
    model, prompts = Path(cfg.model.path), Path(cfg.data.prompts)
    assert model.is_absolute() and model.is_dir()
    assert model == TINY_MODEL
    assert (model / "config.json").is_file()
    assert prompts.is_absolute() and prompts.is_file()
    assert prompts == TINY_PROMPTS
    assert cfg.reward.search_path == str(EXAMPLES)
    assert Path(cfg.run.dir).is_absolute()
    assert Path(cfg.run.dir).name == "tiny"


def test_example_config_independent_of_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(TINY)
    assert cfg.model.path == str(TINY_MODEL)
    assert cfg.data.prompts == str(TINY_PROMPTS)
    assert cfg.reward.search_path == str(EXAMPLES)
    # run.dir, unlike the other paths, is relative to the working directory.
    assert cfg.run.dir == str(tmp_path.resolve() / "runs" / "tiny")


def test_config_is_frozen(tmp_path):
    cfg = load_config(write_config(tmp_path))
    with pytest.raises(AttributeError):
        cfg.train.steps = 3
    assert isinstance(cfg.lora.keys, tuple) and isinstance(cfg.reward.functions, tuple)


def test_relative_paths_resolve_against_config_dir(tmp_path, monkeypatch):
    cfg_dir = tmp_path / "cfgs"
    cfg_dir.mkdir()
    (cfg_dir / "m").symlink_to(TINY_MODEL, target_is_directory=True)
    (cfg_dir / "p.jsonl").write_text(TINY_PROMPTS.read_text())
    path = write_config(cfg_dir, model={"path": '"m"'}, data={"prompts": '"p.jsonl"'})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config("../cfgs/run.toml")
    assert cfg.model.path == str(cfg_dir.resolve() / "m")
    assert cfg.data.prompts == str(cfg_dir.resolve() / "p.jsonl")
    assert cfg.reward.search_path == str(cfg_dir.resolve())
    assert cfg.run.dir == str(elsewhere.resolve() / "runs" / "default")
    assert path.is_file()


def test_run_config_round_trip(tmp_path):
    cfg = load_config(TINY)
    write_run_config(tmp_path, cfg)
    assert read_run_config(tmp_path) == cfg
    assert read_run_config(str(tmp_path)).model.path == str(TINY_MODEL)
    # config.json is plain JSON data: lists, and null for unset keys.
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved == as_dict(cfg) and saved["reward"]["functions"] == ["tiny_task:reward"]
    assert saved["algorithm"]["epsilon"] is None


# --------------------------------------------------------------------------- validation errors


def test_minimal_config_is_valid(tmp_path):
    cfg = load_config(write_config(tmp_path))
    assert cfg.model.path == str(TINY_MODEL)
    assert cfg.train.steps == 100
    assert cfg.algorithm.name == "grpo"


def test_unknown_section(tmp_path):
    msg = error_of(write_config(tmp_path, bogus={"x": "1"}))
    assert "unknown section [bogus]" in msg


def test_section_not_a_table(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("sampling = 3\n" + toml_text(base_sections()))
    with pytest.raises(ConfigError, match=r"\[sampling\] must be a table"):
        load_config(path)


@pytest.mark.parametrize("section,key", [("train", "stepz"), ("model", "name"), ("sampling", "top-p")])
def test_unknown_key(tmp_path, section, key):
    msg = error_of(write_config(tmp_path, **{section: {json.dumps(key): "1"}}))
    assert f"unknown key {section}.{key}" in msg


@pytest.mark.parametrize(
    "section,key,literal,type_name",
    [
        ("train", "steps", '"5"', "an integer"),
        ("train", "steps", "5.0", "an integer"),
        ("lora", "rank", "[8]", "an integer"),
        ("sampling", "temperature", '"hot"', "a number"),
        ("data", "shuffle", "1", "true or false"),
        ("run", "transport", "1", "a string"),
        ("lora", "keys", '"q_proj"', "a list"),
        ("model", "path", "3", "a string"),
    ],
)
def test_wrong_type(tmp_path, section, key, literal, type_name):
    msg = error_of(write_config(tmp_path, **{section: {key: literal}}))
    assert msg.startswith(f"{section}.{key} must be {type_name}, got ")


@pytest.mark.parametrize(
    "section,key", [("train", "steps"), ("sampling", "group_size"), ("lora", "rank"), ("run", "port")]
)
def test_bool_rejected_for_int(tmp_path, section, key):
    msg = error_of(write_config(tmp_path, **{section: {key: "true"}}))
    assert msg == f"{section}.{key} must be an integer, got True"


def test_bool_rejected_for_float(tmp_path):
    msg = error_of(write_config(tmp_path, sampling={"temperature": "true"}))
    assert msg == "sampling.temperature must be a number, got True"


def test_int_accepted_for_float(tmp_path):
    path = write_config(tmp_path, sampling={"temperature": "2", "top_p": "1"}, lora={"scale": "16"})
    cfg = load_config(path)
    for value, want in [(cfg.sampling.temperature, 2.0), (cfg.sampling.top_p, 1.0), (cfg.lora.scale, 16.0)]:
        assert type(value) is float
        assert value == want


@pytest.mark.parametrize(
    "section,key,literal,problem",
    [
        ("sampling", "group_size", "1", "must be >= 2"),
        ("sampling", "temperature", "0", "must be > 0"),
        ("sampling", "temperature", "-0.5", "must be > 0"),
        ("sampling", "top_p", "1.5", "must be <= 1"),
        ("sampling", "top_p", "0.0", "must be > 0"),
        ("sampling", "min_p", "1.0", "must be < 1"),
        ("sampling", "max_tokens", "0", "must be >= 1"),
        ("lora", "dropout", "1.0", "must be < 1"),
        ("lora", "dropout", "-0.1", "must be >= 0"),
        ("lora", "rank", "0", "must be >= 1"),
        ("lora", "num_layers", "-2", "must be >= -1"),
        ("train", "steps", "0", "must be >= 1"),
        ("train", "learning_rate", "0.0", "must be > 0"),
        ("algorithm", "beta", "-1", "must be >= 0"),
        ("algorithm", "is_cap", "1", "must be > 1"),
        ("run", "port", "0", "must be >= 1"),
        ("run", "port", "70000", "must be <= 65535"),
        ("run", "transport", '"udp"', "must be one of 'ipc', 'tcp'"),
        (
            "algorithm",
            "name",
            '"ppo"',
            "must be one of 'grpo', 'bnpo', 'dapo', 'dr_grpo', 'gspo', 'rloo', 'cispo', 'sapo', 'luspo', "
            "'vespo' or 'module:Class'",
        ),
    ],
)
def test_out_of_range(tmp_path, section, key, literal, problem):
    msg = error_of(write_config(tmp_path, **{section: {key: literal}}))
    assert msg.startswith(f"{section}.{key} {problem}, got ")


@pytest.mark.parametrize(
    "section,key,literal",
    [
        ("sampling", "group_size", "2"),
        ("sampling", "top_p", "1.0"),
        ("lora", "dropout", "0.99"),
        ("lora", "num_layers", "-1"),
        ("run", "port", "65535"),
        ("run", "insecure", "true"),
        ("train", "checkpoint_every", "0"),
    ],
)
def test_boundary_values_accepted(tmp_path, section, key, literal):
    cfg = load_config(write_config(tmp_path, **{section: {key: literal}}))
    assert value(cfg, section, key) == json.loads(literal)


@pytest.mark.parametrize("section,key", [("reward", "functions"), ("model", "path"), ("data", "prompts")])
def test_missing_required_key(tmp_path, section, key):
    sections = base_sections()
    del sections[section][key]
    msg = error_of(write_config(tmp_path, sections))
    assert msg == f"missing required key {section}.{key}"


@pytest.mark.parametrize("function", ['"tiny_task.reward"', '"tiny_task"', '":reward"', '"tiny_task:"'])
def test_reward_function_needs_module_and_function(tmp_path, function):
    msg = error_of(write_config(tmp_path, reward={"functions": f"[{function}]"}))
    assert msg.startswith("reward.functions entries must be 'module:function', 'worker' or 'env'")
    msg = error_of(write_config(tmp_path, reward={"functions": '["a:b", ""]'}))
    assert msg == "reward.functions[1] must not be empty"


def test_reward_function_list_problems_are_named(tmp_path):
    assert error_of(write_config(tmp_path, reward={"functions": "[]"})) == (
        "reward.functions must name at least one reward, got []"
    )
    msg = error_of(write_config(tmp_path, reward={"functions": '["worker", "worker"]'}))
    assert msg.startswith("reward.functions may name each function (and 'worker', 'env') once")
    msg = error_of(write_config(tmp_path, reward={"functions": '["a:b", "a:b"]'}))
    assert msg.startswith("reward.functions may name each function (and 'worker', 'env') once")
    msg = error_of(write_config(tmp_path, reward={"functions": '["a:b", "worker"]', "weights": "[1.0]"}))
    assert msg == "reward.weights has 1 entries for 2 reward.functions"
    msg = error_of(write_config(tmp_path, reward={"functions": '["a:b"]', "weights": '["x"]'}))
    assert msg == "reward.weights[0] must be a number, got 'x'"
    msg = error_of(write_config(tmp_path, lora={"keys": '["q_proj", 3]'}))
    assert msg == "lora.keys[1] must be a string, got 3"


def test_missing_prompts_file(tmp_path):
    msg = error_of(write_config(tmp_path, data={"prompts": '"nope.jsonl"'}))
    assert re.fullmatch(r"data\.prompts file .*nope\.jsonl does not exist", msg)
    assert str(tmp_path.resolve() / "nope.jsonl") in msg


@pytest.mark.slow
def test_prompts_may_be_a_folder_or_a_dataset_name_but_not_a_missing_file(tmp_path, tiny):
    """A folder is a `datasets` save_to_disk folder, read when the data loads (a folder that
    is none is a data error then); a bare name is a dataset of the Hugging Face cache."""
    from policy.data import DataError, load_prompts

    folder = load_config(write_config(tmp_path, data={"prompts": json.dumps(str(EXAMPLES))}))
    assert folder.data.prompts == str(EXAMPLES)
    with pytest.raises(DataError, match=f"{re.escape(str(EXAMPLES))}: not a `datasets` save_to_disk folder"):
        load_prompts(folder.data.prompts, tiny[1], 64)
    named = load_config(write_config(tmp_path, data={"prompts": '"acme/prompts"'}))
    assert named.data.prompts == "acme/prompts"
    for missing in ("./acme/prompts", "rows.csv", "rows.parquet"):
        assert error_of(write_config(tmp_path, data={"prompts": json.dumps(missing)})).startswith(
            "data.prompts file "
        )


@pytest.mark.parametrize("model", ["./nope", "../nope", "/definitely/not/here", "./tiny_prompts.jsonl"])
def test_model_path_not_a_directory(tmp_path, model):
    (tmp_path / "tiny_prompts.jsonl").write_text("{}\n")
    msg = error_of(write_config(tmp_path, model={"path": json.dumps(model)}))
    assert msg == f"model.path {model!r} is not a directory"


@pytest.mark.parametrize("hub_id", ["org/model", "mlx-community/Qwen2.5-0.5B-Instruct-4bit"])
def test_hub_id_model_path_kept(tmp_path, hub_id):
    cfg = load_config(write_config(tmp_path, model={"path": json.dumps(hub_id)}))
    assert cfg.model.path == hub_id


@pytest.mark.parametrize(
    "text", ["[train\nsteps = 1\n", "steps = \n", "[train]\nsteps = 1\nsteps = 2\n", "key without value\n"]
)
def test_invalid_toml(tmp_path, text):
    path = tmp_path / "broken.toml"
    path.write_text(text)
    msg = error_of(path)
    assert "broken.toml is not valid TOML" in msg


def test_nonexistent_config_file(tmp_path):
    path = tmp_path / "absent.toml"
    msg = error_of(path)
    assert msg == f"config file {path} does not exist"


def test_validate_reports_unknown_before_missing():
    with pytest.raises(ConfigError, match=r"unknown key train\.nope"):
        validate({"train": {"nope": 1}})
    with pytest.raises(ConfigError, match=r"missing required key model\.path"):
        validate({})


# --------------------------------------------------------------------------- overrides


@pytest.mark.parametrize(
    "item,expected",
    [
        ("train.steps=5", ("train", "steps", 5)),
        ("sampling.temperature=0.7", ("sampling", "temperature", 0.7)),
        ("algorithm.name=grpo", ("algorithm", "name", "grpo")),
        ('algorithm.name="grpo"', ("algorithm", "name", "grpo")),
        ("data.shuffle=false", ("data", "shuffle", False)),
        ('lora.keys=["q_proj", "v_proj"]', ("lora", "keys", ["q_proj", "v_proj"])),
        ("run.dir=runs/x", ("run", "dir", "runs/x")),
        (" train.steps =12", ("train", "steps", 12)),
        ('reward.functions=["mod:fn"]', ("reward", "functions", ["mod:fn"])),
        ("train.steps=", ("train", "steps", "")),
        ("train.steps=abc", ("train", "steps", "abc")),
    ],
)
def test_parse_override(item, expected):
    got = parse_override(item)
    assert got == expected
    assert type(got[2]) is type(expected[2])


@pytest.mark.parametrize("item", ["steps5", "train.steps", "train=5", "train.=5", "", "=5"])
def test_parse_override_malformed(item):
    with pytest.raises(ConfigError, match="--set expects section.key=value"):
        parse_override(item)


def test_load_config_applies_overrides(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(
        TINY,
        overrides=[
            "train.steps=5",
            "sampling.temperature=0.7",
            "algorithm.name=grpo",
            "lora.dropout=0",
            "run.transport=tcp",
            "run.insecure=true",
        ],
    )
    assert cfg.train.steps == 5
    assert cfg.sampling.temperature == pytest.approx(0.7)
    assert cfg.lora.dropout == 0.0 and type(cfg.lora.dropout) is float
    assert cfg.run.transport == "tcp"
    assert cfg.train.learning_rate == pytest.approx(3e-4)  # untouched keys keep file values


def test_load_config_override_adds_missing_section(tmp_path):
    cfg = load_config(write_config(tmp_path), overrides=["train.batch_size=3"])
    assert cfg.train.batch_size == 3


def test_load_config_steps_and_run_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(TINY, steps=7, run_dir="myrun")
    assert cfg.train.steps == 7
    assert cfg.run.dir == str(tmp_path.resolve() / "myrun")
    absolute = tmp_path / "abs" / "run"
    assert load_config(TINY, run_dir=str(absolute)).run.dir == str(absolute)
    # --steps is applied after --set.
    assert load_config(TINY, overrides=["train.steps=5"], steps=9).train.steps == 9


def test_load_config_steps_are_validated():
    with pytest.raises(ConfigError, match=r"train\.steps must be >= 1, got 0"):
        load_config(TINY, steps=0)


@pytest.mark.parametrize(
    "item,message",
    [
        ("train.steps=abc", r"train\.steps must be an integer, got 'abc'"),
        ("train.nope=1", r"unknown key train\.nope"),
        ("nosuch.key=1", r"unknown section \[nosuch\]"),
        ("sampling.group_size=1", r"sampling\.group_size must be >= 2"),
        ("steps5", r"--set expects section\.key=value, got 'steps5'"),
    ],
)
def test_load_config_bad_override(item, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, overrides=[item])


# --------------------------------------------------------------------------- non-finite numbers


@pytest.mark.parametrize(
    "section,key,literal",
    [
        ("sampling", "temperature", "nan"),
        ("sampling", "top_p", "nan"),
        ("train", "learning_rate", "nan"),
        ("train", "learning_rate", "inf"),
    ],
)
def test_non_finite_floats_rejected(tmp_path, section, key, literal):
    path = write_config(tmp_path, **{section: {key: literal}})
    try:
        cfg = load_config(path)
    except ConfigError as e:
        assert f"{section}.{key}" in str(e)
        return
    pytest.fail(
        f"{section}.{key} = {literal} accepted as {value(cfg, section, key)!r} "
        f"(finite: {math.isfinite(value(cfg, section, key))})"
    )


@pytest.mark.parametrize("kw", [{"overrides": ["model.path=x"]}, {"run_dir": "x"}, {"steps": 3}])
def test_override_on_non_table_section(tmp_path, kw):
    sections = base_sections()
    section = {"overrides": "model", "run_dir": "run", "steps": "train"}[next(iter(kw))]
    sections.pop(section, None)
    path = tmp_path / "c.toml"
    path.write_text(f"{section} = 1\n" + toml_text(sections))
    try:
        load_config(path, **kw)
    except ConfigError:
        return
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"{type(e).__name__}: {e}")
    pytest.fail("accepted")


def test_empty_model_path_rejected(tmp_path):
    path = write_config(tmp_path, model={"path": '""'})
    try:
        cfg = load_config(path)
    except ConfigError:
        return
    pytest.fail(f"model.path '' accepted as {cfg.model.path!r}")


# --------------------------------------------------------------------------- the CLI


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", "up", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("config error: ")
    return lines[0]


def test_cli_unknown_key(tmp_path):
    path = write_config(tmp_path, train={"stepz": "5"})
    line = one_error_line(run_cli("--config", str(path)))
    assert "unknown key train.stepz" in line


def test_cli_wrong_type(tmp_path):
    path = write_config(tmp_path, sampling={"group_size": '"eight"'})
    line = one_error_line(run_cli("--config", str(path)))
    assert "sampling.group_size must be an integer" in line


def test_cli_bad_set_value():
    line = one_error_line(run_cli("--config", str(TINY), "--set", "train.steps=abc"))
    assert "train.steps must be an integer, got 'abc'" in line


def test_cli_missing_config_file(tmp_path):
    line = one_error_line(run_cli("-c", str(tmp_path / "absent.toml")))
    assert "absent.toml does not exist" in line


# --------------------------------------------------------------------------- typed sections


def test_readme_reference_is_generated_from_the_dataclasses():
    page = (REPO / "docs" / "configuration.md").read_text()
    table = reference_table()
    assert table in page, "docs/configuration.md's reference is stale: paste `python -m runtime.config`"
    rows = table.splitlines()[2:]
    assert len(rows) == sum(len(dataclasses.fields(cls)) for cls in SECTIONS.values())
    for cls in SECTIONS.values():
        for f in dataclasses.fields(cls):
            assert f.metadata["doc"], f"{cls.__name__}.{f.name} has no help line"


def test_reference_row_shows_default_and_help():
    rows = {line.split(" | ")[0].strip("| `"): line for line in reference_table().splitlines()[2:]}
    assert rows["train.learning_rate"] == "| `train.learning_rate` | 1e-5 | Adam learning rate |"
    assert rows["model.path"].startswith("| `model.path` | required | ")
    assert rows["algorithm.name"].startswith('| `algorithm.name` | `"grpo"` | ')
    assert rows["data.shuffle"].startswith("| `data.shuffle` | true | ")


def test_search_path_defaults_to_config_dir_and_resolves_against_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(write_config(tmp_path))
    assert cfg.reward.search_path == str(tmp_path.resolve())
    cfg = load_config(write_config(tmp_path, reward={"search_path": '"rewards"'}))
    assert cfg.reward.search_path == str(tmp_path.resolve() / "rewards")


def test_replace_validates_again(tmp_path):
    cfg = load_config(write_config(tmp_path))
    changed = cfg.replace(train={"steps": 3}, sampling={"temperature": 1})
    assert changed.train.steps == 3 and changed.sampling.temperature == 1.0
    assert cfg.train.steps == 100  # the original is untouched
    assert changed.model == cfg.model
    with pytest.raises(ConfigError, match=r"train\.steps must be >= 1, got 0"):
        cfg.replace(train={"steps": 0})


def test_null_only_for_unset_keys(tmp_path):
    raw = {"model": {"path": "m"}, "data": {"prompts": "p"}, "reward": {"functions": ["a:b"]}}
    assert validate({**raw, "algorithm": {"epsilon": None}}).algorithm.epsilon is None
    with pytest.raises(ConfigError, match=r"train\.steps must be an integer, got None"):
        validate({**raw, "train": {"steps": None}})
    with pytest.raises(ConfigError, match=r"model\.path must be a string, got None"):
        validate({**raw, "model": {"path": None}})


def test_load_run_config_applies_overrides_to_the_saved_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(TINY, run_dir="first")
    Path(cfg.run.dir).mkdir()
    write_run_config(cfg.run.dir, cfg)
    moved = tmp_path / "moved"
    Path(cfg.run.dir).rename(moved)
    resumed = load_run_config(moved, ["sampling.temperature=0.5"], steps=70)
    assert resumed.run.dir == str(moved.resolve())  # the directory given is the run
    assert (resumed.train.steps, resumed.sampling.temperature) == (70, 0.5)
    assert resumed.reward.search_path == str(EXAMPLES) == cfg.reward.search_path
    back = resumed.replace(train={"steps": 60}, sampling={"temperature": 1.0}, run={"dir": cfg.run.dir})
    assert back == cfg
    with pytest.raises(ConfigError, match="not a run directory"):
        load_run_config(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match=r"unknown key train\.nope"):
        load_run_config(moved, ["train.nope=1"])


def test_env_section_is_checked():
    raw = {"model": {"path": "m"}, "data": {"prompts": "p"}, "reward": {"functions": ["env"]}}
    with pytest.raises(
        ConfigError, match=r"reward.functions names 'env', but no env.environment or \[agent\] is set"
    ):
        validate(raw)
    cfg = validate({**raw, "env": {"environment": "digits_env:DigitsEnv"}})
    assert (cfg.env.max_turns, cfg.env.max_episode_tokens, cfg.env.max_attempts) == (4, 256, 3)
    assert validate({**raw, "env": {"environment": "socket"}}).env.environment == "socket"
    with pytest.raises(ConfigError, match=r"env\.environment must be 'module:Class', 'socket' or 'openenv'"):
        validate({**raw, "env": {"environment": "digits"}})
    with pytest.raises(ConfigError, match='env.openenv_url goes with env.environment = "openenv", and only'):
        validate({**raw, "env": {"environment": "openenv"}})
    with pytest.raises(ConfigError, match='env.openenv_url goes with env.environment = "openenv", and only'):
        validate({**raw, "env": {"environment": "socket", "openenv_url": "http://127.0.0.1:8000"}})
    openenv = validate({**raw, "env": {"environment": "openenv", "openenv_url": "http://127.0.0.1:8000"}}).env
    assert (openenv.openenv_action_field, openenv.openenv_observation_field) == ("message", None)
    held = {"prompts": "held.jsonl"}
    assert validate({**raw, "env": {"environment": "socket"}, "eval": held}).eval.prompts == "held.jsonl"
    with pytest.raises(ConfigError, match="are evaluated before the first step and after the last"):
        validate({**raw, "env": {"environment": "socket"}, "eval": {**held, "every": 5}})


def test_several_actors_with_an_environment_are_refused():
    """Each actor would bind the run's one env socket: say so instead of splitting the env
    workers between actors that cannot tell."""
    digits = TINY.parent / "digits.toml"
    with pytest.raises(
        ConfigError,
        match=r"actor\.count = 2 with env\.environment: one actor serves the "
        r"environment's episodes for now; set actor\.count = 1",
    ):
        load_config(digits, overrides=["actor.count=2"])


def test_up_starts_what_the_config_names_each_process_built_once(tmp_path):
    """child_specs: the learner ranks, the local actors (remote slots come last), the env
    workers of a module environment; each with its command, memory share and threads."""
    from orchestrator.launch import ChildSpec, child_specs
    from orchestrator.plan import thread_count
    from tests.helpers import write_config as small_config

    cfg = load_config(small_config(tmp_path, "[learner]\nranks = 2\n[actor]\ncount = 3\nremote = 1\n"))
    specs = child_specs(cfg)
    threads = thread_count(False)
    assert list(specs) == ["learner", "learner-1", "actor-0", "actor-1"]
    assert specs["learner-1"].args == ["learner"] and specs["learner-1"].threads == max(1, threads // 2)
    assert specs["actor-1"].args == ["actor", "run", "--slot", "1"] and specs["actor-1"].share == "actor"
    cfg = load_config(
        small_config(
            tmp_path,
            '[env]\nenvironment = "digits_env:DigitsEnv"\nnum_workers = 2\n[sampling]\nmax_tokens = 4',
            reward="env",
        )
    )
    specs = child_specs(cfg)
    assert list(specs) == ["learner", "actor", "env-worker-0", "env-worker-1"]
    worker = ["orchestrator", "env-worker", "digits_env:DigitsEnv", "--search-path", str(tmp_path.resolve())]
    assert specs["env-worker-1"] == ChildSpec("env-worker", worker, "env-worker-1", 1)

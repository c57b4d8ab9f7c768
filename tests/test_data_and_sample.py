"""Prompt data, reward inputs, and `actor sample` against the default run's adapter."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from policy.data import DataError, PromptStream, load_prompts
from rewards.functions import RewardError, reward_inputs
from rewards.scorer import Scorer
from runtime.config import RewardConfig
from tests.helpers import EXAMPLES, ROOT, read_metrics, run_up, write_config


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_text_and_chat_prompts_are_encoded_as_the_model_expects(tiny, tmp_path):
    _, tok = tiny
    messages = [{"role": "user", "content": "repeat 3"}]
    path = write_jsonl(
        tmp_path / "p.jsonl", [{"prompt": "repeat 3", "target": "3"}, {"prompt": messages, "answer": "3"}]
    )
    text, chat = load_prompts(path, tok, 1024)
    assert text.prompt_ids == list(tok.encode("repeat 3")) and text.columns == {"target": "3"}
    rendered = "<|user|>repeat 3<|end|><|assistant|>"
    assert tok.decode(chat.prompt_ids) == rendered
    assert chat.prompt_ids == list(tok.encode(rendered, add_special_tokens=False))
    assert chat.columns == {"answer": "3"} and chat.prompt == messages


def test_long_prompts_keep_their_end(tiny, tmp_path):
    _, tok = tiny
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "abcdefghij"}])
    (p,) = load_prompts(path, tok, 4)
    assert tok.decode(p.prompt_ids) == "ghij"


@pytest.mark.parametrize(
    "line,problem",
    [
        ("{not json", "p.jsonl:2: not valid JSON"),
        ('{"question": "x"}', "p.jsonl:2: no column 'prompt' (columns: question); set data.prompt_column"),
        ('{"prompt": ""}', "p.jsonl:2, column 'prompt': must be a non-empty string or a message list"),
        (
            '{"prompt": [{"role": "user"}]}',
            "p.jsonl:2, column 'prompt': a chat prompt must be a non-empty list",
        ),
        ('{"prompt": 7}', "p.jsonl:2, column 'prompt': must be a non-empty string"),
        ("[1, 2]", "p.jsonl:2: each row must be an object with a 'prompt' column"),
    ],
)
def test_bad_rows_name_file_and_line(tiny, tmp_path, line, problem):
    _, tok = tiny
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ok"}, line])
    with pytest.raises(DataError, match=re.escape(problem)):
        load_prompts(path, tok, 64)


ROWS = [
    {"question": "repeat 3", "answer": "3", "level": "easy"},
    {"question": "repeat 42", "answer": "42", "level": "hard"},
    {"question": "hi", "answer": "", "level": "easy"},
]


def write_every_format(tmp_path) -> dict[str, str]:
    """ROWS as each form data.prompts takes; returns the data.prompts value and the split."""
    import csv

    import datasets

    out = {"jsonl": write_jsonl(tmp_path / "p.jsonl", ROWS)}
    out["json"] = tmp_path / "p.json"
    out["json"].write_text(json.dumps(ROWS))
    out["json lines"] = write_jsonl(tmp_path / "lines.json", ROWS)
    out["csv"] = tmp_path / "p.csv"
    with open(out["csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(ROWS[0]))
        writer.writeheader()
        writer.writerows(ROWS)
    data = datasets.Dataset.from_list(ROWS)
    out["parquet"] = tmp_path / "p.parquet"
    data.to_parquet(str(out["parquet"]))
    data.save_to_disk(str(tmp_path / "saved"))
    out["save_to_disk"] = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:1]), "test": data}).save_to_disk(
        str(tmp_path / "saved-dict")
    )
    out["save_to_disk, split test"] = tmp_path / "saved-dict"
    return {k: str(v) for k, v in out.items()}


def test_every_data_format_loads_the_same_rows(tiny, tmp_path):
    """JSONL, a JSON array, JSON lines in a .json file, CSV, parquet, a save_to_disk folder
    and a split of a saved DatasetDict: the same prompts and columns, the prompt taken from
    the column data.prompt_column names."""
    _, tok = tiny
    for form, source in write_every_format(tmp_path).items():
        split = "test" if "split" in form else None
        prompts = load_prompts(source, tok, 64, split=split, prompt_column="question")
        assert [p.prompt for p in prompts] == [r["question"] for r in ROWS], form
        columns = [{"answer": r["answer"], "level": r["level"]} for r in ROWS]
        assert [p.columns for p in prompts] == columns, form
        assert [p.prompt_ids for p in prompts] == [list(tok.encode(r["question"])) for r in ROWS], form
        assert [p.index for p in prompts] == [0, 1, 2]


def test_a_dataset_in_the_local_hugging_face_cache_loads_offline(tiny, tmp_path, monkeypatch):
    """data.prompts = "acme/tiny-prompts": a dataset in the `datasets` cache (what an
    earlier download leaves: Arrow files under acme___tiny-prompts/default/), read
    without the network through the library's own offline lookup."""
    import shutil

    import datasets
    from datasets.packaged_modules.json.json import Json

    _, tok = tiny
    builder = Json(
        data_files={"train": str(write_jsonl(tmp_path / "train.jsonl", ROWS))},
        dataset_name="tiny-prompts",
        hash="0" * 16,
        cache_dir=str(tmp_path / "build"),
    )
    builder.download_and_prepare()
    cache = tmp_path / "datasets"
    (cache / "acme___tiny-prompts").mkdir(parents=True)
    shutil.move(str(Path(builder.cache_dir).parents[1]), cache / "acme___tiny-prompts" / "default")
    # datasets reads these once, at import: an earlier test imported it
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    prompts = load_prompts("acme/tiny-prompts", tok, 64, prompt_column="question")
    assert [p.prompt for p in prompts] == [r["question"] for r in ROWS]
    assert [p.columns["answer"] for p in prompts] == [r["answer"] for r in ROWS]
    with pytest.raises(DataError, match="'acme/nothing' is neither a file nor a dataset in the local"):
        load_prompts("acme/nothing", tok, 64)


@pytest.mark.parametrize(
    "form,problem",
    [
        ("csv", r"p\.csv:2: no column 'prompt' \(columns: question, answer, level\)"),
        ("parquet", r"p\.parquet row 0: no column 'prompt'"),
        ("save_to_disk", r"saved row 0: no column 'prompt'"),
        ("save_to_disk, split test", r"saved-dict: no split 'validation' \(splits: train, test\); set data"),
    ],
)
def test_bad_data_names_the_file_row_and_column(tiny, tmp_path, form, problem):
    _, tok = tiny
    source = write_every_format(tmp_path)[form]
    with pytest.raises(DataError, match=problem):
        load_prompts(source, tok, 64, split="validation" if "split" in form else None)


def test_prompt_stream_shuffles_by_seed_and_resumes_from_its_cursor(tiny):
    prompts = load_prompts(EXAMPLES / "tiny_prompts.jsonl", tiny[1], 64)[:10]
    a = PromptStream(prompts, True, seed=3)
    first = [next(a).index for _ in range(25)]
    assert sorted(first[:10]) == list(range(10)) and first[:10] != list(range(10))
    again = PromptStream(prompts, True, seed=3)
    assert [next(again).index for _ in range(25)] == first  # the same seed, the same order
    other = PromptStream(prompts, True, seed=4)
    assert [next(other).index for _ in range(10)] != first[:10]  # another seed, another order
    b = PromptStream(prompts, True, seed=3)
    for _ in range(13):
        next(b)
    resumed = PromptStream(prompts, True, seed=3, cursor=b.cursor)
    assert [next(resumed).index for _ in range(12)] == first[13:]


def test_actor_slots_split_the_one_stream_and_resume_within_their_share(tiny):
    """Three actors' slots of the stream: together each of its prompts exactly once, in
    the single stream's order; a resumed slot continues where its own cursor was."""
    prompts = load_prompts(EXAMPLES / "tiny_prompts.jsonl", tiny[1], 64)[:10]
    whole = PromptStream(prompts, True, seed=3)
    order = [next(whole).index for _ in range(30)]
    streams = [PromptStream(prompts, True, seed=3, slot=s, slots=3) for s in range(3)]
    taken = {s: [(next(streams[s]), streams[s].index)[1] for _ in range(10)] for s in range(3)}
    assert taken[1] == list(range(1, 30, 3)) and sorted(sum(taken.values(), [])) == list(range(30))
    again = PromptStream(prompts, True, seed=3, slot=1, slots=3)
    assert [next(again).index for _ in range(10)] == [order[i] for i in taken[1]]
    half = PromptStream(prompts, True, seed=3, slot=2, slots=3)
    for _ in range(4):
        next(half)
    resumed = PromptStream(prompts, True, seed=3, cursor=half.cursor, slot=2, slots=3)
    assert [(next(resumed), resumed.index)[1] for _ in range(6)] == taken[2][4:]


def test_reward_inputs_repeat_columns_and_shape_completions_like_the_prompt():
    chat = reward_inputs([{"role": "user", "content": "q"}], ["a", "b"], [[1], [2, 3]], {"answer": "7"})
    assert chat["completions"] == [
        [{"role": "assistant", "content": "a"}],
        [{"role": "assistant", "content": "b"}],
    ]
    assert chat["answer"] == ["7", "7"] and chat["completion_ids"] == [[1], [2, 3]]
    assert len(chat["prompts"]) == 2
    text = reward_inputs("q", ["a"], [[1]], {})
    assert text["completions"] == ["a"] and text["prompts"] == ["q"]


def test_weighted_rewards_leave_none_out_like_trl(tmp_path):
    (tmp_path / "two.py").write_text(
        "def a(completions, **kw):\n    return [1.0, None, 0.5, None]\n"
        "def b(completions, **kw):\n    return [2.0, 3.0, None, None]\n"
    )
    scorer = Scorer(RewardConfig(("two:a", "two:b"), (1.0, 0.5), search_path=str(tmp_path)))
    scored = scorer.submit("k", "q", ["x", "y", "z", "w"], [[1], [2], [3], [4]], {})
    # the last completion no function scores: unscorable, NaN (TRL's marking)
    np.testing.assert_allclose(scored.total, [1.0 + 1.0, 1.5, 0.5, np.nan])
    assert scored.by_function == {"two:a": [1.0, None, 0.5, None], "two:b": [2.0, 3.0, None, None]}
    assert [scorer.metric_name(k) for k in scored.by_function] == ["a", "b"]


def test_user_modules_named_like_the_project_s_packages_load_from_their_directory(tmp_path):
    """`policy.py`, `protocol.py` and an `actor/` package beside a config are the user's,
    not this project's packages of those names; a module's imports of its neighbours work."""
    from orchestrator.workers import load_env_class
    from rewards.functions import load_reward_function

    (tmp_path / "bonus_of_theirs.py").write_text("BONUS = 0.5\n")
    (tmp_path / "protocol.py").write_text(
        "from bonus_of_theirs import BONUS\n"
        "def score(completions, **kw):\n"
        "    return [BONUS] * len(completions)\n"
    )
    (tmp_path / "policy.py").write_text(
        "class Echo:\n    def reset(self, **kw):\n        return 'go'\n"
        "    def step(self, action):\n        return (action, 1.0, True)\n"
    )
    (tmp_path / "actor").mkdir()
    (tmp_path / "actor" / "__init__.py").write_text("")
    (tmp_path / "actor" / "scoring.py").write_text(
        "from . import weights\ndef score(completions, **kw):\n    return [weights.W] * len(completions)\n"
    )
    (tmp_path / "actor" / "weights.py").write_text("W = 2.0\n")
    assert load_reward_function("protocol:score", str(tmp_path))(["a", "b"]) == [0.5, 0.5]
    assert load_reward_function("actor.scoring:score", str(tmp_path))(["a"]) == [2.0]
    assert load_env_class("policy:Echo", str(tmp_path))().step("x") == ("x", 1.0, True)
    import policy
    import protocol

    assert hasattr(protocol, "encode") and not hasattr(policy, "Echo")  # ours are untouched
    with pytest.raises(RewardError, match="has no function 'nope'"):
        load_reward_function("protocol:nope", str(tmp_path))


def test_reward_functions_of_the_same_name_in_two_modules_do_not_collide(tmp_path):
    """`math_rewards:correct` and `code_rewards:correct` are two functions: both count in
    the total with their own weights, and each keeps its own column in the metrics."""
    for module, value in (("math_rewards", 1.0), ("code_rewards", 0.25)):
        (tmp_path / f"{module}.py").write_text(
            f"def correct(completions, **kw):\n    return [{value}] * len(completions)\n"
        )
    scorer = Scorer(
        RewardConfig(("math_rewards:correct", "code_rewards:correct"), (1.0, 2.0), search_path=str(tmp_path))
    )
    scored = scorer.submit("k", "q", ["x", "y"], [[1], [2]], {})
    np.testing.assert_allclose(scored.total, [1.0 + 2 * 0.25] * 2)
    assert scored.by_function == {"math_rewards:correct": [1.0, 1.0], "code_rewards:correct": [0.25, 0.25]}
    assert {scorer.metric_name(k) for k in scored.by_function} == {
        "math_rewards:correct",
        "code_rewards:correct",
    }


@pytest.mark.slow
def test_chat_prompts_train_end_to_end_and_rewards_read_the_answer_column(tmp_path):
    (tmp_path / "recording.py").write_text(
        "import json, pathlib\n"
        "def reward(prompts, completions, completion_ids, answer, **kw):\n"
        "    with open(pathlib.Path(__file__).parent / 'calls.jsonl', 'a') as f:\n"
        "        f.write(json.dumps({'prompts': prompts, 'completions': completions,\n"
        "                            'answer': answer, 'ids': completion_ids}) + '\\n')\n"
        "    return [c[0]['content'].count(a) / max(len(c[0]['content']), 1)\n"
        "            for c, a in zip(completions, answer)]\n"
    )
    cfg = write_config(
        tmp_path,
        f'[data]\nprompts = "{EXAMPLES / "tiny_chat_prompts.jsonl"}"',
        steps=3,
        reward="recording:reward",
    )
    code, out = run_up(cfg)
    assert code == 0, out
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1, 2, 3]
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    rows = {
        json.dumps(json.loads(line)["prompt"]): json.loads(line)["answer"]
        for line in (EXAMPLES / "tiny_chat_prompts.jsonl").read_text().splitlines()
    }
    assert len(calls) >= 6  # one call per group of 4
    for call in calls:
        assert len(call["answer"]) == len(call["completions"]) == len(call["prompts"]) == 4
        # the answer column is the one of the row the prompt came from, repeated per completion
        assert call["answer"] == [rows[json.dumps(call["prompts"][0])]] * 4
        assert all(
            c[0]["role"] == "assistant" and isinstance(c[0]["content"], str) for c in call["completions"]
        )
        assert all(isinstance(i, int) for ids in call["ids"] for i in ids)


def actor_sample(tmp_path, name, *args):
    out = tmp_path / f"{name}.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "actor",
            "sample",
            "--config",
            str(EXAMPLES / "tiny.toml"),
            "--limit",
            "16",
            "-k",
            "4",
            "--out",
            str(out),
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = {line.split()[0]: line.split()[1] for line in proc.stdout.splitlines() if line.strip()}
    return out, summary


@pytest.mark.slow
def test_actor_sample_shows_the_trained_adapter_is_better(tmp_path, default_run):
    base_out, base = actor_sample(tmp_path, "base")
    tuned_out, tuned = actor_sample(tmp_path, "tuned", "--adapter", str(default_run / "adapters"))
    assert float(tuned["reward_mean"]) > float(base["reward_mean"]) + 0.3, (base, tuned)
    rows = [json.loads(line) for line in tuned_out.read_text().splitlines()]
    assert len(rows) == 16 * 4
    for r in rows:
        assert {"prompt", "completion", "token_ids", "logprobs", "finish_reason", "reward"} <= r.keys()
        assert len(r["token_ids"]) == len(r["logprobs"]) and r["finish_reason"] in ("stop", "length")
    assert float(tuned["tokens_per_s"]) > 0


@pytest.mark.slow
def test_actor_sample_is_reproducible_by_seed(tmp_path):
    a, _ = actor_sample(tmp_path, "a", "--seed", "5")
    b, _ = actor_sample(tmp_path, "b", "--seed", "5")
    c, _ = actor_sample(tmp_path, "c", "--seed", "6")
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


@pytest.mark.slow
def test_pass_at_k_for_binary_rewards(tmp_path):
    (tmp_path / "binary.py").write_text(
        "def exact(completions, target, **kw):\n"
        "    return [1.0 if c[:1] == t else 0.0 for c, t in zip(completions, target)]\n"
    )
    out = tmp_path / "s.jsonl"
    cfg = write_config(tmp_path, reward="binary:exact")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "actor",
            "sample",
            "--config",
            str(cfg),
            "--limit",
            "8",
            "-k",
            "4",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    by_prompt: dict[int, list[float]] = {}
    for r in rows:
        by_prompt.setdefault(r["prompt_index"], []).append(r["reward"])
    expected = np.mean([max(v) == 1.0 for v in by_prompt.values()])
    line = next(line for line in proc.stdout.splitlines() if "pass@4" in line)
    assert float(line.split()[1]) == pytest.approx(expected, abs=1e-4)

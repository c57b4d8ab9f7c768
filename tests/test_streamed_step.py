"""The streamed update (learner/building.py, learner.ranks.RankShare): a batch's groups
taken as they arrive, each through forward and backward at once with its loss summed
unnormalised, and the whole batch's normaliser applied once at the end, moves the adapters
as the whole batch's step does, and reports the same metrics: for every objective, every
behavior-policy correction, with two iterations on the batch, and with per-token
advantages. (Two learner ranks: tests/test_scale_out.py, streamed ranks against a learner
alone that waits for the whole batch.)"""

from dataclasses import replace

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest

from learner import batching
from learner.algorithms import ALGORITHMS
from learner.batching import TrainRow, batch_mask, make_batch, token_rows
from learner.correction import Correction
from learner.ranks import Ranks, RankShare, rows_of_rank
from policy.engine import sample_groups
from policy.logprobs import output_head
from policy.model import adapter_weights_numpy
from runtime.config import SamplingConfig
from tests.helpers import trainer_for
from tests.test_step import assert_same_update, model_with, perturbed

G = 4
REWARDS = np.array([[1.0, 0.0, 0.5, 0.0], [0.0, 0.2, 1.0, 1.0], [0.3, 0.9, 0.0, 0.6]])
CUTS = [12, 3, 7, 1, 12, 5, 9, 2, 4, 11, 6, 8]  # ragged: each group's rows of other lengths
TAKES = [[1], [0, 2]]  # the groups as they arrive: one, then two at once, out of batch order


@pytest.fixture(autouse=True)
def free_forwards(monkeypatch):
    """Small ragged takes are cut into several micro-batches of their own shapes."""
    monkeypatch.setattr(batching, "FORWARD_POSITIONS", 0)


def sampled_rows(model, tok) -> list[TrainRow]:
    """3 groups of 4 completions, of CUTS lengths, each group's prompt of its own length."""
    prompts = [tok.encode("repeat " + "12345"[: 2 * i + 1]) for i in range(len(REWARDS))]
    sampled = sample_groups(model, prompts, G, SamplingConfig(temperature=0.7, max_tokens=12), set(), seed=3)
    rows = []
    for i, (p, c) in enumerate((p, c) for p, group in zip(prompts, sampled) for c in group):
        n = min(CUTS[i], len(c.token_ids))
        rows.append(
            TrainRow(np.array(p), np.array(c.token_ids[:n]), np.array(c.logprobs[:n]), c.finish_reason)
        )
    return rows


def group_rows(rows: list[TrainRow], groups: list[int]) -> list[TrainRow]:
    return [r for g in groups for r in rows[g * G : (g + 1) * G]]


def per_token_advantages(rows: list[TrainRow]) -> list[np.ndarray]:
    """A made-up per-token advantage of every completion token (as GiGPO's are)."""
    rng = np.random.default_rng(7)
    return [rng.normal(size=len(r.completion_ids)).astype(np.float32) for r in rows]


def advantages_of(trainer, rows: list[TrainRow], groups: list[int], per_token: bool) -> np.ndarray:
    """The groups' advantages, from their own rewards alone, laid out as their batch's mask
    when `per_token`."""
    if not per_token:
        return trainer.algorithm.advantages(REWARDS[groups])
    values = per_token_advantages(rows)
    return token_rows(
        group_rows(rows, groups), [values[i] for g in groups for i in range(g * G, (g + 1) * G)]
    )


def whole_batch(trainer, rows, iterations: int, per_token: bool) -> list[dict]:
    everything = list(range(len(REWARDS)))
    prepared = trainer.prepare(make_batch(group_rows(rows, everything), 0))
    adv = advantages_of(trainer, rows, everything, per_token)
    return [{**prepared.stats, **trainer.step(prepared, adv)} for _ in range(iterations)]


def streamed(trainer, rows, iterations: int, per_token: bool) -> list[dict]:
    share = RankShare(trainer, Ranks())
    for groups in TAKES:
        share.take(make_batch(group_rows(rows, groups), 0), advantages_of(trainer, rows, groups, per_token))
    in_order = group_rows(rows, [g for take in TAKES for g in take])
    norm = trainer.algorithm.normalizer(batch_mask(in_order))  # the whole batch's, as the learner takes it
    return [share.step(norm) for _ in range(iterations)]


def both_ways(
    name: str, correction: Correction, iterations: int, per_token: bool = False, beta: float = 0.04
):
    model, tok = model_with()
    start = perturbed(adapter_weights_numpy(model), 5, 0.01)
    rows = sampled_rows(model, tok)
    results = []
    for run in (whole_batch, streamed):
        m, _ = model_with(start)
        trainer = trainer_for(
            m,
            name,
            beta=0.04,
            correction=correction,
            fused=iterations == 1,
            temperature=0.7,
            max_grad_norm=1e9,
            optimizer=optim.SGD(learning_rate=1.0),  # the update is the gradient
            epsilon=0.1 if name in ("gspo", "luspo") else None,
        )
        results.append((run(trainer, rows, iterations, per_token), adapter_weights_numpy(m)))
    (whole, w_whole), (stream, w_stream) = results
    # What the forwards computed differs: takes are cut into micro-batches of their own.
    padding = [s.pop("learner/padding_ratio") for s in whole + stream]
    assert all(0 < p <= 1 for p in padding)
    assert_same_update(whole, w_whole, stream, w_stream, start, 1e-4)
    return whole


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_objective_learns_groups_as_they_arrive_as_it_learns_the_whole_batch(name):
    both_ways(name, Correction("truncate", "token", 2.0), iterations=1)


@pytest.mark.parametrize(
    "mode, level", [("none", "token"), ("truncate", "token"), ("mask", "token"), ("truncate", "sequence")]
)
def test_every_correction_streams_exactly_over_two_iterations(mode, level):
    """num_iterations = 2: the first step's gradient streams (old-policy and reference
    passes with it), the second goes over the kept micro-batches, the normaliser known."""
    steps = both_ways("grpo", Correction(mode, level, 1.05), iterations=2)
    assert steps[1]["ratio_max"] > 1.0 or steps[1]["ratio_min"] < 1.0  # the second step is off-policy


def test_per_token_advantages_stream_exactly():
    """GiGPO's [B, T] advantages, laid out as each take's own mask."""
    both_ways("dapo", Correction(), iterations=2, per_token=True)


def test_the_normaliser_is_the_whole_batch_s_not_each_take_s():
    """The check above fails when a take is divided by its own normaliser: DAPO's (tokens)
    of the first take alone is not the batch's, and its rows would weigh more."""
    model, tok = model_with()
    rows = sampled_rows(model, tok)
    trainer = trainer_for(model, "dapo")
    first = trainer.algorithm.normalizer(batch_mask(group_rows(rows, TAKES[0])))
    whole = trainer.algorithm.normalizer(batch_mask(rows))
    assert first < whole / 2  # so a per-take normaliser would be off by more than any tolerance


@pytest.mark.parametrize(
    "share_prompts, sort_by_length, chunk", [(True, True, 0), (False, True, 5), (False, False, 0)]
)
def test_reference_logprobs_taken_ahead_give_the_update_the_step_s_own_reference_pass_gives(
    share_prompts, sort_by_length, chunk
):
    """While it would wait, the learner takes a queued group's reference logprobs ahead
    (learner/ahead.py::reference_ahead): the step then uses them, laid out as each micro-batch's
    own, for the micro-batches whose rows all have them, and runs the reference pass for
    the others. Group 2 has them and its rows have environment tokens (loss mask 0);
    group 0 has them for two rows only; group 1 has none. Over two iterations (the
    second reuses them). Each group's prompt once, whole rows by length or in order (a
    group's rows a micro-batch), and logits by chunks of 5 positions."""
    model, tok = model_with()
    start = perturbed(adapter_weights_numpy(model), 5, 0.01)
    rows = [
        replace(r, loss_mask=(np.arange(len(r.completion_ids)) % 3 != 1).astype(np.float32))
        if i >= 2 * G
        else r
        for i, r in enumerate(sampled_rows(model, tok))
    ]
    results, used = [], []
    for ahead in (False, True):
        m, _ = model_with(start)
        trainer = trainer_for(
            m,
            "grpo",
            beta=0.04,
            fused=False,
            temperature=0.7,
            max_grad_norm=1e9,
            optimizer=optim.SGD(learning_rate=1.0),
            share_prompts=share_prompts,
            sort_by_length=sort_by_length,
            micro=0 if sort_by_length else G,
            logits=batching.Logits(output_head(m), chunk) if chunk else None,
        )
        these = list(rows)
        if ahead:
            for i, ref in zip(range(2 * G, 3 * G), trainer.reference_logprobs(group_rows(rows, [2]))):
                these[i] = replace(these[i], reference_logprobs=ref)
            for i, ref in zip(range(2), trainer.reference_logprobs(rows[:2])):
                these[i] = replace(these[i], reference_logprobs=ref)
        share = RankShare(trainer, Ranks())
        for groups in TAKES:
            share.take(make_batch(group_rows(these, groups), 0), advantages_of(trainer, these, groups, False))
        norm = trainer.algorithm.normalizer(batch_mask(group_rows(these, [g for t in TAKES for g in t])))
        stats = [share.step(norm) for _ in range(2)]
        used.append([micro.ref_ahead for prepared, _ in share.parts for micro in prepared.micro])
        results.append((stats, adapter_weights_numpy(m)))
    (before, w_before), (after, w_after) = results
    assert not any(used[0]) and any(used[1]) and not all(used[1])
    for s in before + after:
        s.pop("learner/padding_ratio")
    assert_same_update(before, w_before, after, w_after, start, 1e-4)


def test_reference_logprobs_taken_ahead_give_no_kl_off_the_trained_tokens():
    """Ahead, they are known on the trained tokens only (0 elsewhere, as on a prompt): a
    position off them where the policy's logprob is very low must not make exp(ref - logp)
    inf, which the mask's 0 would turn into NaN."""
    model, _ = model_with()
    trainer = trainer_for(model, "grpo", beta=0.04, fused=True, temperature=0.7)
    mask = mx.array([[0.0, 1.0, 1.0]])
    micro = batching.Micro(np.array([0]), None, mask, mx.zeros((1, 3)), 3, ref=mx.array([[0.0, -1.0, -2.0]]))
    logp = mx.array([[-200.0, -1.1, -2.2]])
    micro.ref_ahead = True
    loss, diag = trainer._objective(micro, mx.array([1.0]), 1.0, logp, mx.zeros((1, 3)))
    kl = (np.exp([0.1, 0.2]) - [0.1, 0.2] - 1).mean()  # k3 on the two trained tokens
    assert diag["kl"].item() == pytest.approx(kl, rel=1e-5) and np.isfinite(loss.item())


class Place:
    """A rank's place among `n` ranks, as mx.distributed.Group gives it."""

    def __init__(self, rank: int, n: int) -> None:
        self.rank, self.size = (lambda: rank), (lambda: n)


class Recorder:
    """A trainer that notes which rows (by their advantages) each take trained."""

    def __init__(self) -> None:
        self.trained: list[float] = []

    def prepare(self, batch, norm):
        return batching.Prepared([], norm, {})

    def accumulate(self, gradient, prepared, advantages, norm):
        self.trained += advantages.tolist()


@pytest.mark.parametrize("size", [2, 3, 4])
def test_every_row_of_every_take_is_on_one_rank_and_small_takes_spread(size):
    """Takes of 1 to 9 rows, one after the other: each row is trained by exactly one rank,
    whichever ranks a take left without a row, and the rows of takes smaller than the
    ranks do not all land on the same rank."""
    takes = [1, 1, 1, 1, 2, 3, 5, 9, 1, 2]
    rows = [TrainRow(np.array([1, 2]), np.array([3]), np.array([-0.5]), "stop")]
    recorders = [Recorder() for _ in range(size)]
    shares = [RankShare(r, Ranks(Place(rank, size))) for rank, r in enumerate(recorders)]  # type: ignore[arg-type]
    first = 0
    for n in takes:
        batch, ids = make_batch(rows * n, 0), np.arange(first, first + n, dtype=np.float32)
        for share in shares:
            share.take(batch, ids)
        first += n
    trained = sorted(row for r in recorders for row in r.trained)
    assert trained == list(range(sum(takes)))  # each once
    assert min(len(r.trained) for r in recorders) >= 3  # 26 rows: no rank left out


@pytest.mark.parametrize(
    "ranks, group_size, batch_size", [(6, 2, 3), (5, 2, 3), (8, 2, 4), (7, 3, 3), (2, 4, 2)]
)
def test_with_more_ranks_than_a_group_has_rows_the_learner_waits_for_the_whole_batch(
    ranks, group_size, batch_size
):
    """A take of one group then could leave a rank with no row in the whole batch (6 ranks,
    G 2, B 3: takes of 2 groups then 1 give ranks 0 and 3 nothing), which has no gradient
    to add: the learner streams only when every take has a row for every rank, and the
    whole batch has one for each."""
    from types import SimpleNamespace

    from learner.building import streams
    from runtime.config import SamplingConfig, TrainConfig

    train, sampling = TrainConfig(batch_size=batch_size), SamplingConfig(group_size=group_size)
    cfg = SimpleNamespace(train=train, sampling=sampling)
    algorithm = trainer_for(model_with()[0]).algorithm
    assert streams(cfg, algorithm, ranks) == (ranks <= group_size)
    whole = batch_size * group_size
    assert all(len(rows_of_rank(whole, rank, ranks, 0)) > 0 for rank in range(ranks))
    one_group = [rows_of_rank(group_size, rank, ranks, k) for rank in range(ranks) for k in range(3)]
    assert all(len(rows) > 0 for rows in one_group) == (ranks <= group_size)


RANK_SCRIPT = """
import sys

import mlx.optimizers as optim
import numpy as np

from learner.batching import batch_mask, make_batch
from learner.correction import Correction
from learner.ranks import Ranks, RankShare, rows_of_rank
from policy.model import adapter_weights_numpy
from tests.helpers import trainer_for
from tests.test_step import model_with, perturbed
from tests.test_streamed_step import TAKES, advantages_of, group_rows, sampled_rows

ranks = Ranks.join()
assert ranks.size == 2, ranks.size
model, tok = model_with()
start = perturbed(adapter_weights_numpy(model), 5, 0.01)
rows = sampled_rows(model, tok)
m, _ = model_with(start)
trainer = trainer_for(
    m, "dapo", beta=0.04, correction=Correction("truncate", "token", 1.05), temperature=0.7,
    max_grad_norm=1e9, optimizer=optim.SGD(learning_rate=1.0),
)
share = RankShare(trainer, ranks)
for groups in TAKES:
    share.take(make_batch(group_rows(rows, groups), 0), advantages_of(trainer, rows, groups, False))
norm = ranks.share_norm(trainer.algorithm.normalizer(batch_mask(rows)))
steps = [share.step(norm) for _ in range(2)]
if ranks.rank == 0:
    np.savez(sys.argv[1], **adapter_weights_numpy(m))
    print("rows on rank 0:", sum(len(p.micro[0].index) for p, _ in share.parts))
    print("loss", steps[0]["loss"], steps[1]["loss"])
"""


def test_two_learner_ranks_learn_groups_as_they_arrive_as_one_learns_the_whole_batch(tmp_path):
    """Two ranks under `mlx.launch --backend ring`, each taking its share of the rows of
    each take as it arrives (TAKES: one group, then two), two steps (num_iterations = 2):
    the adapters one process reaches with the whole batch at once."""
    import subprocess
    import sys
    from pathlib import Path

    from orchestrator.launch import free_ports
    from tests.helpers import ROOT

    script, out = tmp_path / "ranks.py", tmp_path / "rank0.npz"
    script.write_text(RANK_SCRIPT)
    launch = [str(Path(sys.executable).parent / "mlx.launch"), "--backend", "ring", "-n", "2"]
    launch += ["--starting-port", str(free_ports(1)[0]), "--", sys.executable, str(script), str(out)]
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(launch, cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    model, tok = model_with()
    start = perturbed(adapter_weights_numpy(model), 5, 0.01)
    rows = sampled_rows(model, tok)
    m, _ = model_with(start)
    trainer = trainer_for(
        m,
        "dapo",
        beta=0.04,
        correction=Correction("truncate", "token", 1.05),
        temperature=0.7,
        max_grad_norm=1e9,
        optimizer=optim.SGD(learning_rate=1.0),
    )
    whole_batch(trainer, rows, 2, per_token=False)
    alone, ranked = adapter_weights_numpy(m), dict(np.load(out))
    moved = max(np.abs(alone[k] - start[k]).max() for k in start)
    assert moved > 1e-4
    for k in alone:
        np.testing.assert_allclose(ranked[k], alone[k], rtol=1e-4, atol=1e-4 * moved, err_msg=k)

"""Reference logprobs taken from an actor's partials while a group is still sampled
(learner/ahead.py::ReferenceAhead, PROTOCOL.md `partial`): run a few tokens at a time on
the keys and values of what came before, they are the reference logprobs the step's own
reference pass takes of the whole group, with the adapters off; a rollout that does not
continue its partials, a group over the budget and a forgotten actor get none."""

import mlx.core as mx
import numpy as np
import pytest

from learner import batching
from learner.ahead import ReferenceAhead
from learner.groups import Group
from policy.logprobs import output_head, sequence_logprobs
from policy.model import adapter_weights_numpy
from protocol.messages import Partial
from tests.helpers import trainer_for
from tests.test_step import model_with, perturbed
from tests.test_streamed_step import G, sampled_rows

ACTOR = b"actor-1"


def partial_of(rows, group_id: str, tokens: int) -> Partial:
    """The group's partial after `tokens` decode steps: each row's first `tokens` IDs."""
    return Partial.of(group_id, rows[0].prompt_ids, [r.completion_ids[:tokens] for r in rows])


def setup(chunk: int = 0, budget_mb: float = 64.0):
    """A trainer with the KL penalty on adapters far from 0 (so the policy's logprobs are
    not the reference's), its ReferenceAhead, and 3 sampled groups of ragged rows."""
    model, tok = model_with()
    rows = sampled_rows(model, tok)
    model, _ = model_with(perturbed(adapter_weights_numpy(model), 5, 0.3))
    logits = batching.Logits(output_head(model), chunk) if chunk else None
    trainer = trainer_for(model, "grpo", beta=0.04, temperature=0.7, logits=logits)
    return trainer, ReferenceAhead(trainer, budget_mb=budget_mb, max_tokens=12), rows


def run_all(ahead: ReferenceAhead) -> int:
    n = 0
    while ahead.run_one():
        n += 1
    return n


@pytest.mark.parametrize("chunk", [0, 5])
def test_partials_give_the_reference_logprobs_the_step_s_own_pass_gives(chunk):
    """Groups 0 and 2 send partials after 2 and 5 tokens, then group 0 again after 9 (its
    rows ended at other lengths), group 1 sends none. Each rollout then gets, for every
    row, the reference logprobs trainer.reference_logprobs takes of the whole group (the
    step's reference pass, adapters off), to float rounding; not the policy's.

    Whole (`chunk` 0), each partial's new tokens of both groups run in one forward after
    the prompts: rows of two prompts of their own lengths, some ending sooner (left- and
    right-padded). `chunk` 5: the learner's logits by chunks of 5 positions, so the new
    tokens run a few rows and tokens at a time."""
    trainer, ahead, rows = setup(chunk)
    groups = [rows[i * G : (i + 1) * G] for i in range(3)]
    for tokens in (2, 5):
        ahead.offer(ACTOR, partial_of(groups[0], "0", tokens))
        ahead.offer(ACTOR, partial_of(groups[2], "2", tokens))
        forwards = run_all(ahead)
        assert forwards == (3 if tokens == 2 else 1) if chunk == 0 else forwards > 3
    ahead.offer(ACTOR, partial_of(groups[0], "0", 9))
    run_all(ahead)
    arrived = [Group.of_rows(ACTOR, str(i), rows) for i, rows in enumerate(groups)]
    ahead.take(arrived)
    assert arrived[1].reference is None  # no partials: its step takes the reference pass
    assert ahead.groups == {} and ahead.held() == 0
    for i in (0, 2):
        got = arrived[i].reference
        assert got is not None
        want = trainer.reference_logprobs(groups[i])
        for row, g, w in zip(groups[i], got, want):
            assert g.shape == (len(row.completion_ids),)
            np.testing.assert_allclose(g, w, atol=2e-5, rtol=0)
        tokens = mx.array(np.concatenate([groups[i][0].prompt_ids, groups[i][0].completion_ids])[None])
        policy = np.array(sequence_logprobs(trainer.model, tokens, 0.7))[0, -len(got[0]) :]
        assert np.abs(policy - got[0]).max() > 1e-3  # the adapters were off


def test_a_rollout_that_does_not_continue_its_partials_gets_its_reference_pass_whole():
    """The rollout is what is trained: a row whose tokens differ from what its partial
    said (a peer's bug) throws the partials' work away, as does another prompt."""
    trainer, ahead, rows = setup()
    group = rows[:G]
    ahead.offer(ACTOR, partial_of(group, "7", 3))
    run_all(ahead)
    g = Group.of_rows(ACTOR, "7", group)
    g.completion_ids = [c.copy() for c in g.completion_ids]
    g.completion_ids[0][1] = (g.completion_ids[0][1] + 1) % 50
    ahead.take([g])
    assert g.reference is None and ahead.groups == {}

    ahead.offer(ACTOR, partial_of(group, "8", 3))
    run_all(ahead)
    other = Group.of_rows(ACTOR, "8", rows[G : 2 * G])  # the same id, another prompt
    ahead.take([other])
    assert other.reference is None


def test_groups_over_the_budget_are_left_to_their_steps_and_a_forgotten_actor_s_go():
    """Keys and values held stay under `train.reference_ahead_mb`, each group begun
    reserving its rows at max_tokens: a group that would go over is refused once its
    prompt ran (its step takes the reference pass) and its later partials are ignored.
    An actor that says hello again or is gone leaves nothing held."""
    trainer, ahead, rows = setup()
    ahead.offer(ACTOR, partial_of(rows[:G], "0", 2))
    ahead.run_one()  # its prompt
    one = ahead.held()  # 4 rows of prompt + 12 tokens, at the model's keys and values a position
    last, layers, _ = ahead.groups[(ACTOR, "0")].rows[0].state
    per_position = sum(k.nbytes for k in layers) * 2 / len(rows[0].prompt_ids)
    assert one == int(G * (per_position * (len(rows[0].prompt_ids) + 12) + last.nbytes))
    ahead.budget = one + 1
    ahead.offer(ACTOR, partial_of(rows[G : 2 * G], "1", 2))
    run_all(ahead)
    assert list(ahead.groups) == [(ACTOR, "0")] and ahead.refused == {(ACTOR, "1")}
    ahead.offer(ACTOR, partial_of(rows[G : 2 * G], "1", 4))
    assert (ACTOR, "1") not in ahead.groups
    g = Group.of_rows(ACTOR, "1", rows[G : 2 * G])
    ahead.take([g])
    assert g.reference is None and not ahead.refused

    ahead.forget(ACTOR)
    assert ahead.groups == {} and ahead.held() == 0
    assert not ReferenceAhead(None).run_one()  # off: holds nothing, asks for nothing
    off = ReferenceAhead(None)
    off.offer(ACTOR, partial_of(rows[:G], "0", 2))
    assert off.groups == {}


@pytest.mark.slow
def test_the_real_learner_takes_a_group_s_reference_logprobs_from_its_partials(tmp_path, tiny):
    """The real learner process (beta 0.04, batch 1, 2 steps), this test as its actor. Its
    hello asks for partials. Group "a" sends partials after 1 and 2 of its 3 tokens (and a
    malformed one, which is logged and dropped), then its rollout: the learner runs the
    partials while it waits, and the step's take of "a" runs no reference pass (every
    micro-batch's reference logprobs were ahead). Group "b"'s rollout does not continue its
    partial: it is trained all the same, with its own reference pass."""
    import json
    import time

    import protocol
    from orchestrator.launch import prepare_run_dir
    from runtime.config import load_config
    from tests.helpers import peer, read_metrics, write_config
    from tests.test_staleness import Actor

    _, tok = tiny
    extra = "[train]\nbatch_size = 1\n[algorithm]\nbeta = 0.04"
    cfg = load_config(write_config(tmp_path, extra, steps=2))
    run = prepare_run_dir(cfg)
    prompt = np.array(tok.encode("repeat 1"), np.int32)
    rng = np.random.default_rng(0)

    def partial(group_id: str, rows: np.ndarray, tokens: int) -> list:
        so_far = rows[:, :tokens]
        lens = np.full(len(rows), tokens, np.int32)
        return Partial(
            group_id=group_id, prompt_ids=prompt, completion_ids=so_far.ravel(), completion_lens=lens
        ).frames()

    with peer(run, "learner") as (learner, sock):
        actor = Actor(sock, cfg, tok)  # says hello, takes the learner's, then the weights
        for name, tampered in (("a", False), ("b", True)):
            rows = rng.integers(5, 40, (4, 3)).astype(np.int32)
            sock.send_multipart(partial(name, rows, 1))
            sock.send_multipart(partial(name, rows, 2))
            sock.send_multipart(protocol.encode(protocol.PARTIAL, {"group_id": name}, {"prompt_ids": prompt}))
            time.sleep(2)  # the learner runs them while it waits (it looks every 0.1 s)
            if tampered:
                rows[1, 0] += 1
            actor.send_group(0 if name == "a" else 1, name, ids=rows.ravel())
            actor.expect(protocol.WEIGHTS, version=1 if name == "a" else 2)
        actor.expect(protocol.STOP)
        assert learner.wait(60) == 0
    assert actor.learner_hello.get("partials") == 16
    assert read_metrics(run)[-1]["groups_trained"] == 2
    assert "dropped a malformed message" in (run / "learner.log").read_text()
    spans = [json.loads(line) for line in (run / "timeline" / "learner.jsonl").read_text().splitlines()]
    partial_runs = [e for e in spans if e["name"] == "reference logprobs ahead" and e["args"].get("partial")]
    assert len(partial_runs) >= 4  # each group's prompt, then its 2 tokens (rows as far along: one forward)
    takes = [e for e in spans if e["name"] == "learn groups"]
    assert len(takes) == 2
    for take, all_ahead in zip(takes, (True, False)):
        inside = [e for e in spans if take["ts"] <= e["ts"] <= take["ts"] + take["dur"]]
        micro = [e for e in inside if e["name"] == "forward and backward" and e["args"]["rows"] > 0]
        (ref,) = [e for e in inside if e["name"] == "old and reference logprobs"]
        assert ref["args"]["ahead"] == (len(micro) if all_ahead else 0), (ref, micro)


def test_a_stop_while_a_rollout_s_tail_runs_leaves_the_group_to_its_step():
    """A stop asked for while the learner runs the tokens since a group's last partial
    (as its rollout arrives) ends that work, raises nothing, and leaves the group without
    reference logprobs (its step, if any, takes the pass); its partials are done with."""
    trainer, ahead, rows = setup()
    ahead.offer(ACTOR, partial_of(rows[:G], "0", 2))
    run_all(ahead)
    trainer.stopping = lambda: True
    g = Group.of_rows(ACTOR, "0", rows[:G])
    ahead.take([g])
    assert g.reference is None and ahead.groups == {}


def test_partials_that_cannot_be_of_the_run_s_groups_are_ignored():
    """A partial with an ID outside the vocabulary, not group_size completions, or a
    completion over max_tokens starts nothing (the learner logs it); nor does a partial
    that comes after its group's rollout."""
    trainer, _, rows = setup()
    ahead = ReferenceAhead(trainer, budget_mb=64, max_tokens=12, group_size=G, vocab_size=50)
    bad = partial_of(rows[:G], "0", 2)
    bad.completion_ids[0] = 50
    ahead.offer(ACTOR, bad)
    ahead.offer(ACTOR, partial_of(rows[: G - 1], "1", 2))
    long = partial_of(rows[:G], "2", 2)
    long.completion_lens[0], long.completion_lens[1] = 13, -9  # sums as before
    ahead.offer(ACTOR, long)
    assert ahead.groups == {}
    ahead.take([Group.of_rows(ACTOR, "3", rows[G : 2 * G])])
    ahead.offer(ACTOR, partial_of(rows[G : 2 * G], "3", 2))
    assert ahead.groups == {}
    ahead.offer(ACTOR, partial_of(rows[:G], "4", 2))
    assert list(ahead.groups) == [(ACTOR, "4")]


def test_rows_that_end_apart_hold_no_more_than_their_group_s_reserve():
    """A group's rows end at different lengths, so they run apart after a forward of all
    of them: each keeps its own copy of the keys and values, not a slice that would keep
    the whole forward's arrays alive. What the learner holds stays within what the group
    reserved (every row at max_tokens)."""
    import gc

    trainer, ahead, rows = setup()
    group = rows[:G]  # CUTS: 12, 3, 7 and 1 tokens
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    for tokens in (1, 3, 5, 7, 9, 12):
        ahead.offer(ACTOR, partial_of(group, "0", tokens))
        run_all(ahead)
    gc.collect()
    held = mx.get_active_memory() - before
    # 1.1: the allocator rounds up each small array (slices of the forward's arrays: 1.7x)
    assert 0 < held <= 1.1 * ahead.held(), (held, ahead.held())


def test_a_forward_s_keys_and_values_stay_within_a_quarter_of_the_budget():
    """One forward holds its rows' keys and values twice more (left-padded, then grown):
    under a budget that holds one group and little more, its rows run a few at a time,
    not all four together, and give the same logprobs."""
    trainer, ahead, rows = setup()
    group = rows[:G]
    ahead.offer(ACTOR, partial_of(group, "0", 2))
    ahead.run_one()  # its prompt
    ahead.budget = ahead.held() + 1
    for tokens in (5, 9):  # rows behind: 4 (the first 2 tokens too), then 2 (CUTS 12, 3, 7, 1)
        ahead.offer(ACTOR, partial_of(group, "0", tokens))
        assert run_all(ahead) > 1
    g = Group.of_rows(ACTOR, "0", group)
    ahead.take([g])
    assert g.reference is not None
    for got, want in zip(g.reference, trainer.reference_logprobs(group)):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)

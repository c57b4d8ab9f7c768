"""GiGPO (learner/gigpo.py): its advantages against values worked out by hand, the model
turns and anchor states read from a loss mask, the per-token advantages as the batch and
its micro-batches lay them out, and every loss with per-token advantages."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest

import protocol
from learner import batching
from learner.algorithms import LossInputs, make_algorithm
from learner.batching import TrainRow, make_batch, prompt_keys, shared_prompt_rows, token_rows, whole_rows
from learner.gigpo import (
    anchor_states,
    batch_advantages,
    discounted_returns,
    gigpo_group,
    model_turns,
    turn_values,
)
from learner.groups import group_from_message
from learner.ranks import Command, Ranks
from policy.model import adapter_weights_numpy, load_policy, set_adapter_weights
from runtime.config import ALGORITHM_NAMES, ConfigError, LoraConfig, validate
from tests.helpers import TINY_MODEL, trainer_for

EPS = 1e-4  # STD_EPS

# -- the advantages, by hand ------------------------------------------------------------------


def test_three_episodes_with_shared_anchors_and_step_rewards():
    # Three episodes; anchors: E0 [P, B, C], E1 [P, A], E2 [Q, A]. Step groups: P = {E0t0,
    # E1t0}, A = {E1t1, E2t1}; Q, B, C have one step each (step advantage 0).
    anchors = [["P", "B", "C"], ["P", "A"], ["Q", "A"]]
    step_rewards = [[0.0, 1.0, 2.0], [3.0, 0.0], [0.0, 4.0]]
    rewards = np.array([2.0, 1.0, 0.0])
    got = gigpo_group(rewards, step_rewards, anchors, gamma=0.5, omega=1.0)
    # Episodes: mean 1, deviations (1, 0, -1), sample std sqrt((1 + 0 + 1) / 2) = 1.
    episode = [1 / (1 + EPS), 0.0, -1 / (1 + EPS)]
    np.testing.assert_allclose(got.episode, episode, atol=1e-6)
    # Returns, gamma 0.5, from the last turn back:
    #   E0: G2 = 2, G1 = 1 + 0.5 * 2 = 2, G0 = 0 + 0.5 * 2 = 1
    #   E1: G1 = 0, G0 = 3 + 0.5 * 0 = 3
    #   E2: G1 = 4, G0 = 0 + 0.5 * 4 = 2
    # P = {1, 3}: mean 2, deviations -1, +1, std sqrt((1 + 1) / 1) = sqrt 2.
    # A = {0, 4}: mean 2, deviations -2, +2, std sqrt((4 + 4) / 1) = sqrt 8.
    p, a = 1 / (math.sqrt(2) + EPS), 2 / (math.sqrt(8) + EPS)
    step = [[-p, 0.0, 0.0], [p, -a], [0.0, a]]
    for g, want in zip(got.step, step):
        np.testing.assert_allclose(g, want, atol=1e-6)
    combined = [
        [episode[0] - p, episode[0], episode[0]],
        [0.0 + p, 0.0 - a],
        [episode[2] + 0.0, episode[2] + a],
    ]
    for g, want in zip(got.combined, combined):
        np.testing.assert_allclose(g, want, atol=1e-6)
    assert sorted(got.step_group_sizes) == [1, 1, 1, 2, 2]  # P, A; Q, B, C
    # omega scales the step part only
    half = gigpo_group(rewards, step_rewards, anchors, gamma=0.5, omega=0.5)
    np.testing.assert_allclose(half.combined[1], [0.5 * p, -0.5 * a], atol=1e-6)


def test_final_reward_only_without_std_scaling():
    # No step rewards: 0 on each turn but the last, which has the episode's reward.
    # E0 (R = 1) anchors [P, A, B], E1 (R = 0) anchors [P, A]; gamma 0.5, omega 2, no std.
    got = gigpo_group(
        np.array([1.0, 0.0]), None, [["P", "A", "B"], ["P", "A"]], gamma=0.5, omega=2.0, scale_rewards="none"
    )
    # Episodes: R - mean = (0.5, -0.5).
    np.testing.assert_allclose(got.episode, [0.5, -0.5], atol=1e-6)
    # Returns: E0 [0.25, 0.5, 1] (1 * 0.5^2, 1 * 0.5, 1), E1 [0, 0].
    # P = {0.25, 0}: mean 0.125 -> (+0.125, -0.125); A = {0.5, 0}: mean 0.25 -> (+0.25, -0.25); B alone: 0.
    np.testing.assert_allclose(got.step[0], [0.125, 0.25, 0.0], atol=1e-6)
    np.testing.assert_allclose(got.step[1], [-0.125, -0.25], atol=1e-6)
    # Combined: 0.5 + 2 * (0.125, 0.25, 0) and -0.5 + 2 * (-0.125, -0.25).
    np.testing.assert_allclose(got.combined[0], [0.75, 1.0, 0.5], atol=1e-6)
    np.testing.assert_allclose(got.combined[1], [-0.75, -1.0], atol=1e-6)


def test_an_unscored_episode_has_no_signal_and_stays_out_of_its_step_groups():
    # R = (1, NaN, 0), every episode anchors [P, A], no step rewards, gamma 0.5.
    got = gigpo_group(np.array([1.0, np.nan, 0.0]), None, [["P", "A"]] * 3, gamma=0.5, omega=1.0)
    # Episodes over the scored {1, 0}: mean 0.5, std sqrt(0.5) = 0.70710678.
    e = 0.5 / (math.sqrt(0.5) + EPS)
    np.testing.assert_allclose(got.episode, [e, 0.0, -e], atol=1e-6)
    # Returns: E0 [0.5, 1], E1 none, E2 [0, 0]. P = {0.5, 0}: mean 0.25, std sqrt(0.125);
    # A = {1, 0}: mean 0.5, std sqrt(0.5).
    p, a = 0.25 / (math.sqrt(0.125) + EPS), 0.5 / (math.sqrt(0.5) + EPS)
    np.testing.assert_allclose(got.step[0], [p, a], atol=1e-6)
    np.testing.assert_allclose(got.step[1], [0.0, 0.0], atol=1e-6)
    np.testing.assert_allclose(got.step[2], [-p, -a], atol=1e-6)
    np.testing.assert_allclose(got.combined[1], [0.0, 0.0], atol=1e-6)
    np.testing.assert_allclose(got.combined[0], [e + p, e + a], atol=1e-6)
    assert got.step_group_sizes == [2, 2]  # the scored steps


def test_the_algorithm_gives_the_episode_part_and_a_lone_step_is_zero():
    # RLOO's own episode advantages are used as they are; a step group of one adds nothing.
    rewards = np.array([1.0, 0.0, 0.0])
    episode = make_algorithm("rloo").advantages(rewards[None])  # (1 - 1/3) * 3/2 = 1, -0.5, -0.5
    np.testing.assert_allclose(episode, [1.0, -0.5, -0.5], atol=1e-6)
    got = gigpo_group(rewards, None, [["X"], ["Y"], ["Z"]], gamma=0.9, omega=1.0, episode=episode)
    for g, want in zip(got.combined, episode):
        np.testing.assert_allclose(g, [want], atol=1e-6)
    with pytest.raises(ValueError, match="2 model turns but 1 step rewards"):
        gigpo_group(rewards, [[1.0], [1.0], [0.0]], [["X"], ["Y", "W"], ["Z"]], gamma=0.9, omega=1.0)


def test_discounted_returns():
    np.testing.assert_allclose(discounted_returns([1.0, 2.0, 4.0], 0.5), [1 + 0.5 * 4, 2 + 0.5 * 4, 4])


# -- turns and anchors from a loss mask -------------------------------------------------------


def test_model_turns_and_anchor_states_from_a_loss_mask():
    prompt = np.array([1, 2])
    ids = np.array([5, 6, 7, 8, 9, 10, 11, 12, 13])
    mask = np.array([0, 1, 1, 0, 0, 1, 0, 1, 0], np.uint8)  # a trailing observation: no turn
    assert model_turns(mask, len(ids)) == [(1, 3), (5, 6), (7, 8)]
    # turn 0: the prompt and the environment's token before it; then what lies between turns
    assert anchor_states(prompt, ids, mask) == [(1, 2, 5), (8, 9), (11,)]
    # a first turn right after the prompt; a completion without a mask is one turn
    assert anchor_states(prompt, ids[:4], np.array([1, 1, 0, 1])) == [(1, 2), (7,)]
    assert model_turns(None, 3) == [(0, 3)]
    assert anchor_states(prompt, ids[:3], None) == [(1, 2)]
    np.testing.assert_array_equal(
        turn_values(mask, len(ids), np.array([1.5, -2.0, 3.0])), [0, 1.5, 1.5, 0, 0, -2.0, 0, 3.0, 0]
    )


# -- the learner's path -----------------------------------------------------------------------


def episode_rollout(prompt, completions, masks, turn_rewards=None):
    """A rollout message of episodes, decoded as the learner receives it."""
    header = {
        "group_id": "g",
        "policy_version": 0,
        "prompt": "p",
        "columns": {},
        "texts": ["x"] * len(completions),
        "finish_reasons": ["env_done"] * len(completions),
        **({"turn_rewards": turn_rewards} if turn_rewards is not None else {}),
    }
    ids = np.concatenate([np.array(c, np.int32) for c in completions])
    mask = np.concatenate([np.array(m, np.uint8) for m in masks])
    arrays = {
        "prompt_ids": np.array(prompt, np.int32),
        "completion_ids": ids,
        "completion_lens": np.array([len(c) for c in completions], np.int32),
        "logprobs": np.where(mask == 1, -1.0, 0.0).astype(np.float32),
        "loss_mask": mask,
    }
    return protocol.decode(protocol.encode(protocol.ROLLOUT, header, arrays))


def two_groups():
    """Two groups of two episodes. Group 0: both start from the prompt, then E0 sees [9]
    and E1 [9] too (a shared turn-1 anchor); step rewards given. Group 1 (another prompt
    length): final rewards only, turn-1 anchors differ."""
    g0 = group_from_message(
        b"a",
        episode_rollout(
            [1, 2, 3],
            [[20, 21, 9, 22], [23, 9, 24, 25, 7]],
            [[1, 1, 0, 1], [1, 0, 1, 1, 0]],
            turn_rewards=[[1.0, 0.0], [0.0, 2.0]],
        ),
        57,
        2,
    )
    g1 = group_from_message(
        b"a", episode_rollout([4], [[30, 31, 5, 32], [33, 6, 34]], [[1, 1, 0, 1], [1, 0, 1]]), 57, 2
    )
    g0.rewards, g1.rewards = np.array([1.0, 0.0]), np.array([0.0, 1.0])
    return [g0, g1]


def test_per_token_advantages_sit_on_the_batch_mask_and_every_micro_batch_layout():
    groups = two_groups()
    rewards = np.stack([g.rewards for g in groups])
    episode = make_algorithm("grpo").advantages(rewards)
    samples = [s for g in groups for s in g.samples()]
    batch = make_batch(samples, 0)
    adv, stats = batch_advantages(groups, samples, episode, gamma=0.5, omega=1.0, scale_rewards="group")
    e = 0.5 / (math.sqrt(0.5) + EPS)  # each group's rewards {1, 0}: std sqrt(0.5)
    np.testing.assert_allclose(episode, [e, -e, -e, e], atol=1e-6)
    # Group 0 returns (gamma 0.5): E0 [1 + 0, 0] = [1, 0], E1 [0 + 0.5 * 2, 2] = [1, 2].
    # Turn 0 anchors equal (the prompt): {1, 1} -> 0. Turn 1 anchors both (9,): {0, 2}: mean 1,
    # std sqrt 2 -> -1 / (sqrt 2 + eps), +1 / (sqrt 2 + eps).
    s = 1 / (math.sqrt(2) + EPS)
    # Group 1, final rewards: E0 [0, 0], E1 [0.5, 1]; turn 0 shared: {0, 0.5} -> -0.25, +0.25
    # over std sqrt(0.125); turn 1 anchors (5,) and (6,) alone: 0.
    q = 0.25 / (math.sqrt(0.125) + EPS)
    per_turn = [[e, e - s], [-e, -e + s], [-e - q, -e], [e + q, e]]
    want = [
        turn_values(smp.loss_mask, len(smp.completion_ids), np.array(v)) for smp, v in zip(samples, per_turn)
    ]
    mask = np.array(batch.mask)
    assert adv.shape == mask.shape
    for i, smp in enumerate(samples):
        p, c = len(smp.prompt_ids), len(smp.completion_ids)
        np.testing.assert_allclose(adv[i, p - 1 : p - 1 + c], want[i], atol=1e-6)
        assert not adv[i, : p - 1].any() and not adv[i, p - 1 + c :].any()
    assert not adv[mask == 0].any()  # only the model's tokens carry an advantage
    assert stats == {"gigpo/step_groups": 3.0, "gigpo/step_group_size_mean": (2 + 2 + 2 + 1 + 1) / 5}

    # Every micro-batch takes its rows' values where its own mask puts their tokens.
    host = {k: np.array(getattr(batch, k)) for k in ("tokens", "mask", "behavior")}
    keys = prompt_keys(host, batch)
    for index in (np.array([0, 1]), np.array([3, 2, 0]), np.arange(4)):
        for m in (
            whole_rows(batch, index, own_length=True),
            whole_rows(batch, index, own_length=False),
            shared_prompt_rows(host, batch, index, keys, {}),
            shared_prompt_rows(host, batch, index, keys, {keys[0][0]: 0}),  # the first prompt carried
        ):
            laid = np.array(m.per_token(adv))
            assert laid.shape == m.mask.shape
            assert not laid[np.array(m.mask) == 0].any()
            for k, i in enumerate(index):
                on = samples[i].loss_mask == 1
                np.testing.assert_allclose(laid[k][np.array(m.mask[k]) == 1], want[i][on], atol=1e-6)

    # omega 0: the episode advantage on every model token, as the [B] advantages give it.
    flat, _ = batch_advantages(groups, samples, episode, gamma=0.5, omega=0.0, scale_rewards="group")
    np.testing.assert_array_equal(flat, mask * episode[:, None].astype(np.float32))


def test_turn_rewards_are_checked_against_the_model_turns():
    with pytest.raises(ValueError, match=r"turn_rewards has \[1, 2\] rewards per completion for \[2, 2\]"):
        group_from_message(
            b"a",
            episode_rollout(
                [1], [[2, 3, 4], [5, 6, 7]], [[1, 0, 1], [1, 0, 1]], turn_rewards=[[1.0], [1.0, 2.0]]
            ),
            57,
            2,
        )
    with pytest.raises(
        protocol.ProtocolError, match="field .turn_rewards. must be a list of lists of finite numbers"
    ):
        episode_rollout([1], [[2, 3, 4], [5, 6, 7]], [[1, 0, 1], [1, 0, 1]], turn_rewards=[[1.0], [None]])
    assert two_groups()[0].turn_rewards == [[1.0, 0.0], [0.0, 2.0]]


def test_gigpo_needs_episodes():
    base = {"model": {"path": "m"}, "data": {"prompts": "p.jsonl"}, "reward": {"functions": ["m:f"]}}
    with pytest.raises(ConfigError, match="GiGPO's step-level advantage needs multi-turn episodes"):
        validate({**base, "algorithm": {"gigpo_omega": 1.0}})
    cfg = validate({**base, "algorithm": {"gigpo_omega": 1.0}, "env": {"environment": "m:Env"}})
    assert (cfg.algorithm.gigpo_omega, cfg.algorithm.gigpo_gamma) == (1.0, 0.95)
    assert validate(base).algorithm.gigpo_omega == 0.0


class LoopbackGroup:
    """Two learner ranks in one process: what rank 0 sends, rank 1 receives."""

    def __init__(self, rank: int) -> None:
        self.r = rank

    def rank(self) -> int:
        return self.r

    def size(self) -> int:
        return 2


class Loopback(Ranks):
    def __init__(self, rank: int, wire: list) -> None:
        super().__init__(group=LoopbackGroup(rank))  # type: ignore[arg-type]
        self.wire = wire

    def from_rank0(self, tree):
        if self.rank == 0:
            self.wire.append(tree)
            return tree
        sent = self.wire.pop(0)
        ours = tree if isinstance(tree, list) else [tree]
        theirs = sent if isinstance(sent, list) else [sent]
        assert [(a.shape, a.dtype) for a in ours] == [(a.shape, a.dtype) for a in theirs]
        return sent


def test_learner_ranks_share_per_token_advantages():
    groups = two_groups()
    samples = [s for g in groups for s in g.samples()]
    batch = make_batch(samples, 0)
    episode = make_algorithm("grpo").advantages(np.stack([g.rewards for g in groups]))
    per_token, _ = batch_advantages(groups, samples, episode, gamma=0.5, omega=1.0, scale_rewards="group")
    for adv in (episode, per_token):
        wire: list = []
        Loopback(0, wire).share_rows(batch, adv)
        follower = Loopback(1, wire)
        command, rows, length, adv_ndim = follower.broadcast()
        assert command == Command.ROWS
        got = follower.receive_rows(rows, length, adv_ndim)
        assert not wire
        np.testing.assert_array_equal(got[1], adv.astype(np.float32))
        np.testing.assert_array_equal(np.array(got[0].mask), np.array(batch.mask))


# -- losses with per-token advantages ---------------------------------------------------------


@pytest.mark.parametrize("name", ALGORITHM_NAMES)
def test_constant_per_token_advantages_are_the_per_completion_ones(name):
    rng = np.random.default_rng(0)
    alg = make_algorithm(name, beta=0.04, max_tokens=5)
    logp = np.log(rng.uniform(0.2, 0.9, (4, 5))).astype(np.float32)
    old = (logp + rng.normal(0, 0.3, logp.shape)).astype(np.float32)
    ref = (logp + rng.normal(0, 0.3, logp.shape)).astype(np.float32)
    mask = (rng.random((4, 5)) < 0.7).astype(np.float32)
    mask[:, 0] = 1
    adv = np.array([1.2, -0.4, 0.0, -2.0], np.float32)

    def run(a):
        def f(lp):
            x = LossInputs(lp, mx.array(old), mx.array(ref), mx.array(a), mx.array(mask), mx.ones(logp.shape))
            total, diag = alg.loss_sum(x)
            return total, diag

        (total, diag), grad = mx.value_and_grad(f)(mx.array(logp))
        return float(total.item()), np.array(grad), {k: float(v.item()) for k, v in diag.items()}

    per_completion = run(adv)
    per_token = run(np.repeat(adv[:, None], 5, axis=1))
    assert per_token[0] == per_completion[0]
    np.testing.assert_array_equal(per_token[1], per_completion[1])
    assert per_token[2] == per_completion[2]
    # and a per-token advantage weighs its own token: one off the mask changes nothing
    last_on, first_off = int(np.flatnonzero(mask[3])[-1]), np.argwhere(mask == 0)[0]
    varied = np.repeat(adv[:, None], 5, axis=1)
    varied[3, last_on] += 1.0
    assert last_on > 0 and run(varied)[0] != per_completion[0]
    varied = np.repeat(adv[:, None], 5, axis=1)
    varied[tuple(first_off)] += 1.0
    assert run(varied)[0] == per_completion[0]


LORA = LoraConfig(rank=4, scale=10.0)


@pytest.fixture
def free_forwards(monkeypatch):
    monkeypatch.setattr(batching, "FORWARD_POSITIONS", 0)  # small batches cut in several micro-batches


@pytest.mark.parametrize("share_prompts,sort_by_length", [(True, True), (False, True), (False, False)])
def test_a_step_with_constant_per_token_advantages_is_the_step_with_per_completion_ones(
    free_forwards, share_prompts, sort_by_length
):
    """The same SGD update from [B] advantages and from [B, T] rows of them, whatever the
    micro-batches' layout (shared prompts, own lengths, the batch's length)."""
    rng = np.random.default_rng(1)
    samples = []
    for p_len, c_len in [(3, 9), (3, 2), (5, 6), (5, 1), (2, 7), (2, 4)]:
        prompt = rng.integers(1, 57, p_len) if p_len != 3 or not samples else samples[0].prompt_ids
        mask = (np.arange(c_len) % 3 != 1).astype(np.float32)
        mask[0] = 1
        samples.append(
            TrainRow(prompt, rng.integers(1, 57, c_len), np.full(c_len, -1.0, np.float32), "stop", mask)
        )
    batch = make_batch(samples, 0)
    adv = np.array([1.0, -0.5, 0.25, 2.0, -1.5, 0.0])
    laid = token_rows(samples, [np.full(len(s.completion_ids), a) for s, a in zip(samples, adv)])
    mx.random.seed(0)
    model, _, _ = load_policy(str(TINY_MODEL), LORA)
    start = adapter_weights_numpy(model)
    deltas = []
    for a in (adv, laid):
        set_adapter_weights(model, start)
        trainer = trainer_for(
            model,
            "grpo",
            micro=2,
            optimizer=optim.SGD(learning_rate=1.0),
            max_grad_norm=1e9,
            share_prompts=share_prompts,
            sort_by_length=sort_by_length,
        )
        prepared = trainer.prepare(batch)
        assert len(prepared.micro) > 1
        trainer.step(prepared, a)
        deltas.append({k: v - start[k] for k, v in adapter_weights_numpy(model).items()})
    for k in deltas[0]:
        np.testing.assert_allclose(deltas[1][k], deltas[0][k], rtol=1e-5, atol=1e-7)
    assert any(np.abs(d).max() > 0 for d in deltas[0].values())


# -- the actor's rollouts: agent sessions and env episodes, as the learner reads them -----


def hand_values() -> list[list[float]]:
    """Two episodes of two model turns; both start from the prompt and both get the same
    feedback, so each turn k is one step group of two. Rewards: 1 (step rewards [0, 1])
    and 0 ([0, 0]); gamma 0.5, omega 1, std-scaled (sample std, ddof 1).
      episode: R = [1, 0], mean 0.5, std sqrt(0.5) = 0.70711: A = +-0.5 / (0.70711 + EPS)
      returns: E0 [0 + 0.5 * 1, 1] = [0.5, 1], E1 [0, 0]
      step 0:  [0.5, 0], mean 0.25, std 0.35355: +-0.25 / (0.35355 + EPS)
      step 1:  [1, 0],   mean 0.5,  std 0.70711: +-0.5 / (0.70711 + EPS)"""
    a_ep = 0.5 / (math.sqrt(0.5) + EPS)
    a0, a1 = 0.25 / (math.sqrt(0.125) + EPS), 0.5 / (math.sqrt(0.5) + EPS)
    return [[a_ep + a0, a_ep + a1], [-a_ep - a0, -a_ep - a1]]


def gigpo_of(header: dict, arrays: dict) -> list[np.ndarray]:
    """The rollout through the wire and the learner's group check, scored with its
    env_rewards, into GiGPO (gamma 0.5, omega 1)."""
    base = {"group_id": "0", "policy_version": 0, "prompt": "p", "columns": {}, "gen_s": 0.0}
    msg = protocol.decode(protocol.encode(protocol.ROLLOUT, {**base, **header}, arrays))
    g = group_from_message(b"a", msg, 100, 2)
    rewards = np.array(g.env_rewards, dtype=np.float64)
    masks = g.loss_masks or []
    anchors = [anchor_states(g.prompt_ids, ids, m) for ids, m in zip(g.completion_ids, masks)]
    assert anchors[0] == anchors[1]  # the same observations
    return gigpo_group(rewards, g.turn_rewards, anchors, gamma=0.5, omega=1.0).combined


def test_gigpo_of_agent_sessions_as_the_actor_sends_them(tiny):
    """Sessions whose agent reports per-call rewards: each call is a model turn, the
    feedback between calls its anchor."""
    from actor.agents import AgentRunner
    from actor.rollout import PlacedPrompt
    from actor.sessions import AgentGroup, Session, Trace
    from policy.data import Prompt
    from runtime.config import AgentConfig, SamplingConfig

    _, tok = tiny
    runner = AgentRunner(AgentConfig(), None, None, tok, {1}, SamplingConfig(group_size=2), 512)  # type: ignore[arg-type]
    g = AgentGroup(PlacedPrompt(Prompt(0, "p", [], {}), [0, 0], [0, 1], 0))
    for j, (reward, turns) in enumerate([(1.0, [0.0, 1.0]), (0.0, [0.0, 0.0])]):
        t = Trace([5, 6, 7], ids=[10 + j, 11, 1, 20, 21, 30 + j, 1], mask=[1, 1, 1, 0, 0, 1, 1])
        t.logprobs, t.versions = [-0.1] * 7, [0] * 7
        t.call_starts, t.call_numbers = [0, 5], [0, 1]
        s = Session(f"k{j}", g, j, 1, 0.0, traces=[t], reward=reward, turn_rewards=turns, reported=True)
        s.done = True
        g.sessions.append(s)
    header, arrays = runner.fields(g, lambda ids: "x")
    assert header["turn_rewards"] == [[0.0, 1.0], [0.0, 0.0]]
    for got, want in zip(gigpo_of(header, arrays), hand_values()):
        assert got == pytest.approx(want, abs=1e-6)


def test_gigpo_of_env_episodes_as_the_actor_sends_them():
    """Episodes whose environment rewards its answers: the reward of the answer to turn k
    is turn k's step reward."""
    from actor.episodes import Episode, EpisodeGroup
    from policy.data import Prompt

    prompt = Prompt(0, "p", [5, 6, 7], {})
    episodes = []
    for j, answers in enumerate([(0.0, 1.0), (0.0, 0.0)]):
        e = Episode(f"e{j}", 0, prompt, j, [5, 6, 7])
        for k, reward in enumerate(answers):  # a model turn, then the environment's answer
            e.turn_starts.append(len(e.ids))
            e.turn_rewards.append(0.0)
            e.add([10 + j + k, 1], [-0.1, -0.1])
            e.rewards.append(reward)
            e.turn_rewards[-1] += reward
            if k == 0:
                e.add([20, 21])  # the observation: the same for both
        e.finish = "env_done"
        episodes.append(e)
    header, arrays = EpisodeGroup(prompt, [5, 6, 7], episodes).fields(lambda ids: "x")
    assert header["turn_rewards"] == [[0.0, 1.0], [0.0, 0.0]]
    for got, want in zip(gigpo_of(header, arrays), hand_values()):
        assert got == pytest.approx(want, abs=1e-6)


def test_rewards_per_run_follow_the_loss_mask():
    from actor.rollout import rewards_per_run

    # Turns at 0 and 4; a third that sampled nothing (at 7, after the last run's end) adds to
    # the run before it; two turns with no context between them are one run.
    assert rewards_per_run([1, 1, 0, 0, 1, 1, 0], [0, 4, 7], [1.0, 2.0, 4.0]) == [1.0, 6.0]
    assert rewards_per_run([0, 1, 1, 1], [1, 2], [1.0, 2.0]) == [3.0]

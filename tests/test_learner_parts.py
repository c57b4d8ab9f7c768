"""The learner's parts on their own: the ledger, the intake, the rollout socket and the
metrics file (the process around them is tested end to end elsewhere)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import zmq

import protocol
from learner.groups import group_from_message
from learner.intake import Intake
from learner.ledger import Ledger
from learner.metrics import MetricsFile
from learner.rollout_socket import RolloutSocket
from rewards.functions import RewardError
from rewards.scorer import Scored, Scorer
from runtime.config import RewardConfig
from transport.zeromq import ZeroMQ

A, B = b"actor-a", b"actor-b"


def rollout(
    group_id: str, version: int = 0, row: int = 0, lens=(2, 2), cursor=None, start_cursor=None
) -> protocol.Message:
    ids = np.arange(1, sum(lens) + 1, dtype=np.int32)
    frames = protocol.encode(
        protocol.ROLLOUT,
        {
            "group_id": group_id,
            "policy_version": version,
            "prompt": "repeat 1",
            "columns": {"target": "1"},
            "texts": ["1" * n for n in lens],
            "finish_reasons": ["length"] * len(lens),
            "row": row,
            **({"cursor": cursor} if cursor else {}),
            **({"start_cursor": start_cursor} if start_cursor else {}),
        },
        {
            "prompt_ids": np.array([3, 4], np.int32),
            "completion_ids": ids,
            "completion_lens": np.array(lens, np.int32),
            "logprobs": np.full(len(ids), -1.0, np.float32),
        },
    )
    return protocol.decode(frames)


# -- the ledger --------------------------------------------------------------------------


def test_the_ledger_accounts_for_every_group_and_the_credit_of_each_actor():
    ledger = Ledger()
    for _ in range(5):
        ledger.receive()
    ledger.drop("stale", A, [0, 2])
    ledger.train([(A, [0, 4], None), (B, [0, 3], None)])
    assert ledger.counts(queued=2) == {
        "groups_received": 5,
        "groups_trained": 2,
        "groups_queued": 2,
        "groups_dropped": 1,
        "dropped_reasons": {"stale": 1},
        "messages_rejected": 0,
        "groups_received_by_actor": {},
    }
    assert ledger.data_cursor == [0, 4]  # the newest consumed prompt, not the last one seen
    assert ledger.credits_due([A, B]) == [(A, 2), (B, 1)]
    assert ledger.credits_due([A, B]) == []  # told once, until it changes
    ledger.drop("filtered: equal rewards", B)
    assert ledger.credits_due([A, B]) == [(B, 2)]


def test_a_ledger_from_a_checkpoint_counts_queued_groups_as_not_received():
    ledger = Ledger()
    for _ in range(4):
        ledger.receive()
    ledger.train([(A, [1, 0], None)])
    ledger.drop("stale", A)
    ledger.reject_message()
    restored = Ledger()
    restored.restore(json.loads(json.dumps(ledger.state())))
    # two groups were queued: the resumed actor samples their prompts again
    assert restored.counts(queued=0) == {**ledger.counts(queued=0), "groups_received": 2}
    assert restored.data_cursor == [1, 0]


def test_routine_drops_are_said_once_a_step_and_others_with_their_group(caplog):
    """DAPO drops most groups of a run: one line a step with the counts, not one a group."""
    ledger = Ledger()
    with caplog.at_level("INFO", logger="learner"):
        for i in range(5):
            ledger.drop("filtered: equal rewards", A, group_id=f"g{i}")
        ledger.drop("stale", A, group_id="g5")
        ledger.drop("completion_ids out of range", B, group_id="bad")
        ledger.say_drops(7)
        ledger.say_drops(8)  # nothing since: nothing said
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "dropped group bad: completion_ids out of range",
        "step 7: dropped 6 groups (filtered: equal rewards 5, stale 1)",
    ]
    assert ledger.dropped == {"filtered: equal rewards": 5, "stale": 1, "completion_ids out of range": 1}


# -- the intake --------------------------------------------------------------------------


@pytest.fixture
def scorer(tmp_path):
    (tmp_path / "r.py").write_text(
        "def ones(completions, **kw):\n    return [float(c.count('1')) for c in completions]\n"
        "def fails(completions, **kw):\n    raise ValueError('bad column')\n"
    )
    return lambda fn: Scorer(RewardConfig((f"r:{fn}",), search_path=str(tmp_path)))


def group(group_id: str, lens=(2, 2), **kw):
    return group_from_message(A, rollout(group_id, lens=lens, **kw), vocab_size=100, group_size=len(lens))


def test_the_intake_scores_filters_and_batches_dropping_stale_groups(scorer):
    ledger = Ledger()
    keep = lambda r: len(set(r.tolist())) > 1  # noqa: E731 - DAPO's filter
    intake = Intake(scorer("ones"), keep, ledger)
    intake.add([group("same", (2, 2)), group("old", (1, 3), version=0), group("new", (3, 1), version=2)])
    assert intake.queued == 3
    intake.score()
    assert ledger.dropped == {"filtered: equal rewards": 1} and intake.queued == 2
    assert intake.next_groups(policy_version=2, most=2, least=2, max_staleness=1) == []  # "old" is stale
    assert ledger.dropped["stale"] == 1
    intake.add([group("newer", (1, 2), version=2)])
    intake.score()
    batch = intake.next_groups(policy_version=2, most=2, least=2, max_staleness=1)
    assert [g.group_id for g in batch] == ["new", "newer"]
    assert intake.queued == 2  # taken into the batch being built, not trained yet: still queued
    intake.settle()
    assert intake.queued == 0
    np.testing.assert_array_equal(batch[0].rewards, [3.0, 1.0])


def test_the_queue_keeps_the_order_of_arrival_whatever_order_rewards_come_back_in(scorer):
    """Several reward workers answer in any order: the batch is the same either way, so a
    resumed run repeats itself to the bit."""
    intake = Intake(scorer("ones"), lambda r: True, Ledger())
    groups = [group(name, lens=(1, 2)) for name in ("first", "second", "third")]
    intake.add(groups)
    for g in groups:  # as if an external worker holds them
        intake.awaiting[f"{g.sender.hex()}/{g.group_id}"] = g
    intake.unscored.clear()
    answers = [Scored(f"{A.hex()}/{name}", np.array([1.0, 2.0])) for name in ("third", "first", "second")]
    intake.take(answers[:1], [], [])
    assert intake.next_groups(policy_version=0, most=2, least=2, max_staleness=0) == []
    intake.take(answers[1:], [], [])
    assert [g.group_id for g in intake.next_groups(policy_version=0, most=2, least=2, max_staleness=0)] == [
        "first",
        "second",
    ]
    third = intake.next_groups(policy_version=0, most=1, least=1, max_staleness=0)
    assert [g.group_id for g in third] == ["third"]


def test_a_group_that_can_join_no_later_batch_is_taken_before_a_younger_one(scorer):
    """At max_staleness 1 a long group sampled by version 1 must be in the batch trained at
    version 2; a short group of version 2, arrived first, can wait for the next. With one
    place left both go in, taken in their order of arrival, and neither is dropped."""
    ledger = Ledger()
    intake = Intake(scorer("ones"), lambda r: True, ledger)
    intake.add([group("young", (1, 2), version=2), group("old", (2, 1), version=1)])
    intake.add([group("b", (1, 1), version=2)])
    intake.score()
    one = intake.next_groups(policy_version=2, most=1, least=1, max_staleness=1)
    assert [g.group_id for g in one] == ["old"]
    intake.settle()
    taken = intake.next_groups(policy_version=3, most=2, least=1, max_staleness=1)
    assert [g.group_id for g in taken] == ["young", "b"]  # the rest in their order of arrival
    assert "stale" not in ledger.dropped
    # Versions 3, 2, 3, 1, 2 in arrival order, two wanted: the oldest two (d, then b), in
    # their order of arrival; the rest stay queued in theirs.
    intake = Intake(scorer("ones"), lambda r: True, Ledger())
    intake.add([group(name, (1, 2), version=v) for name, v in zip("abcde", (3, 2, 3, 1, 2))])
    intake.score()
    taken = intake.next_groups(policy_version=3, most=2, least=1, max_staleness=2)
    assert [g.group_id for g in taken] == ["b", "d"]
    assert [g.group_id for _, g in intake.queue] == ["a", "c", "e"]


def test_younger_groups_leave_room_for_the_last_version_s_groups_still_sampled(scorer):
    """At max_staleness 1, training version 2: groups of version 1 can join no later batch.
    While the actors say they still sample `reserve` of them, younger groups take only the
    places left over; the last version's groups that have arrived go in whatever the
    reserve. Nothing is dropped."""
    ledger = Ledger()
    intake = Intake(scorer("ones"), lambda r: True, ledger)
    intake.add([group(name, (1, 2), version=2) for name in ("y1", "y2", "y3")])
    intake.score()
    taken = intake.next_groups(policy_version=2, most=3, least=1, max_staleness=1, reserve=2)
    assert [g.group_id for g in taken] == ["y1"]  # two places kept
    assert intake.next_groups(policy_version=2, most=2, least=1, max_staleness=1, reserve=2) == []
    intake.add([group("last", (2, 1), version=1)])
    intake.score()
    taken = intake.next_groups(policy_version=2, most=2, least=1, max_staleness=1, reserve=1)
    assert [g.group_id for g in taken] == ["last"]  # one more still sampled: its place kept
    taken = intake.next_groups(policy_version=2, most=1, least=1, max_staleness=1, reserve=0)
    assert [g.group_id for g in taken] == ["y2"]  # none left to wait for
    assert [g.group_id for _, g in intake.queue] == ["y3"] and "stale" not in ledger.dropped
    # A batch wanted whole (least = most) waits for the groups it keeps room for.
    intake.add([group("y4", (1, 2), version=2)])
    intake.score()
    assert intake.next_groups(policy_version=2, most=2, least=2, max_staleness=1, reserve=1) == []
    # Groups of the last version whose rewards are not back yet are kept places too.
    waiting = group("scored-later", (2, 2), version=1)
    intake.awaiting["key"] = waiting
    assert intake.next_groups(policy_version=2, most=2, least=2, max_staleness=1) == []
    intake.awaiting.clear()
    taken = intake.next_groups(policy_version=2, most=2, least=2, max_staleness=1)
    assert [g.group_id for g in taken] == ["y3", "y4"]
    intake.settle()
    # At max_staleness 0 every group is in its last version: a reserve changes nothing.
    intake.add([group("y5", (1, 2), version=2)])
    intake.score()
    taken = intake.next_groups(policy_version=2, most=1, least=1, max_staleness=0, reserve=5)
    assert [g.group_id for g in taken] == ["y5"]


def test_the_rollout_socket_counts_the_groups_each_live_actor_says_it_still_samples(socket_pair):
    """Each actor's newest `in_flight` counts, by version; a rollout without one (or with a
    malformed one) and a new hello forget it."""
    sock, actor, _ = socket_pair
    actor.send_multipart(actor_hello())
    pump(sock, actor, 3)

    def send(name: str, **header) -> None:
        msg = rollout(name, version=1, cursor=[0, 4 + len(name)], start_cursor=[0, 3 + len(name)])
        actor.send_multipart(protocol.encode(protocol.ROLLOUT, {**msg.header, **header}, msg.arrays))
        received = sock.ledger.received
        for _ in range(200):  # a rollout has no reply: wait until it is read
            sock.receive(10, 5)
            if sock.ledger.received > received:
                break

    send("a", in_flight=[0, 0, 1])
    assert (sock.sampling(0), sock.sampling(1), sock.sampling(2)) == (2, 1, 0)
    send("bb", in_flight=[1])
    assert (sock.sampling(0), sock.sampling(1)) == (0, 1)  # the newest list, not a sum
    send("ccc")
    assert sock.sampling(1) == 0  # no list: unknown, nothing kept
    send("dddd", in_flight="1")
    assert sock.sampling(1) == 0  # malformed (the field is lenient): the same
    send("eeeee", in_flight=[1, 1])
    send("ffffff", in_flight=[1, True])  # an entry that is no int: the list is malformed
    assert sock.sampling(1) == 0
    send("ggggggg", in_flight=[1])
    assert sock.sampling(1) == 1
    actor.send_multipart(actor_hello())  # says hello again: it forgets what it sampled
    pump(sock, actor, 3)
    assert sock.sampling(1) == 0


def test_a_failing_reward_function_is_dropped_and_named_with_its_row(scorer):
    ledger = Ledger()
    intake = Intake(scorer("fails"), lambda r: True, ledger)
    intake.add([group("g", row=17)])
    with pytest.raises(
        RewardError,
        match=r"reward function r:fails raised ValueError: bad column "
        r"\(on data row 17, prompt 'repeat 1'\)",
    ):
        intake.score()
    assert ledger.dropped == {"reward error": 1} and intake.queued == 0


# -- the rollout socket ------------------------------------------------------------------

IDENTITY = {"model": "m", "tokenizer": "t", "lora": {"rank": 8}, "instance": "i1"}


@pytest.fixture
def socket_pair(tmp_path):
    net = ZeroMQ()
    ctx = net.ctx  # the actor's side is a plain ZeroMQ socket
    ledger = Ledger()
    ledger.data_cursor = [0, 3]  # where a new actor's data begins
    weights = {"w": np.ones(3, np.float32)}
    sock = RolloutSocket(
        net,
        f"ipc://{tmp_path}/learner.sock",
        ledger,
        IDENTITY,
        lambda actor, msg: group_from_message(actor, msg, 100, 2),
        lambda: weights,
        actor_count=2,
    )
    actor = ctx.socket(zmq.DEALER)
    actor.connect(f"ipc://{tmp_path}/learner.sock")
    yield sock, actor, ledger
    actor.close(linger=0)
    sock.sock.close(linger=0)
    net.close()


def pump(sock: RolloutSocket, actor: zmq.Socket, n: int) -> tuple[list, list[protocol.Message]]:
    groups, got = [], []
    for _ in range(200):
        groups += sock.receive(10, 5)
        while actor.poll(0):
            got.append(protocol.decode(actor.recv_multipart()))
        if len(got) >= n:
            break
    return groups, got


def actor_hello(**changes) -> list:
    return protocol.encode(
        protocol.HELLO,
        {"role": "actor", "pid": 1, "model": "m", "tokenizer": "t", "lora": {"rank": 8}, **changes},
    )


def test_an_actor_that_matches_gets_hello_and_weights_and_one_that_does_not_is_told_why(socket_pair):
    sock, actor, _ = socket_pair
    actor.send_multipart(actor_hello(lora={"rank": 16}))
    _, (stop,) = pump(sock, actor, 1)
    assert stop.kind == protocol.STOP and stop["reason"].startswith("incompatible: LoRA config")
    assert stop["code"] == protocol.INCOMPATIBLE  # what the actor acts on: the reason is for logs
    actor.send_multipart(actor_hello())
    _, (hello, weights, credit) = pump(sock, actor, 3)
    assert hello["instance"] == "i1" and hello["data_cursor"] == [0, 3]
    assert hello["max_staleness"] == 0  # the run's k, which the actor keeps to
    assert credit.kind == protocol.CREDIT and credit["groups_consumed"] == 0
    assert weights["version"] == 5 and weights.arrays["w"].tolist() == [1, 1, 1]
    assert sock.weight_sync["weights_mb"] > 0
    actor.send_multipart(actor_hello(slot=2))
    _, (stop,) = pump(sock, actor, 1)
    assert stop["reason"] == "incompatible: slot 2: this run has actor.count = 2 (slots 0 to 1)"
    assert stop["code"] == protocol.INCOMPATIBLE


def test_each_actor_slot_continues_after_its_own_newest_group():
    """A restarted actor of slot s starts after the newest group of s the learner holds;
    a checkpoint keeps the consumed cursors per slot; a slot never seen starts after the
    newest consumed of any."""
    ledger = Ledger()
    a, b, b2 = b"a", b"b", b"b-restarted"
    ledger.attach(a, 0)
    ledger.attach(b, 1)
    for sender, cursor in [(a, [0, 1]), (b, [0, 2]), (a, [0, 3]), (b, [0, 4]), (b, [0, 6])]:
        ledger.receive(sender)
        ledger.received_group(sender, cursor)
    # [0, 6] still queued
    ledger.train([(a, [0, 1], None), (b, [0, 2], None), (a, [0, 3], None), (b, [0, 4], None)])
    ledger.attach(b2, 1)
    assert ledger.cursor_for(1) == ([0, 6], []) and ledger.cursor_for(0) == ([0, 3], [])
    assert ledger.counts(1)["groups_received_by_actor"] == {"0": 2, "1": 3}
    resumed = Ledger()
    resumed.restore(ledger.state())
    assert resumed.cursor_for(1) == ([0, 4], []) and resumed.cursor_for(0) == ([0, 3], [])
    assert resumed.cursor_for(2) == ([0, 4], [])  # the newest consumed of any slot


def spans(stream, n: int) -> list[tuple[list[int], list[int]]]:
    """(start_cursor, cursor) of the stream's next n prompts, as an actor sends them."""
    out = []
    for _ in range(n):
        next(stream)
        out.append((list(stream.start), list(stream.cursor)))
    return out


@pytest.mark.parametrize("slots", [1, 2])
def test_groups_that_arrive_out_of_data_order_leave_holes_a_restarted_actor_fills_and_nothing_else(slots):
    """An actor sends each group when it finishes, not in data order. The learner keeps,
    per slot, the cursor up to which it holds every prompt and the spans beyond it; a
    restarted actor (and a resumed run, from the consumed ones) samples exactly the
    holes and goes on after the newest, across an epoch's end."""
    from policy.data import Prompt, PromptStream

    prompts = [Prompt(i, f"p{i}", [i + 3], {}) for i in range(5)]
    first = spans(PromptStream(prompts, True, 1, slot=slots - 1, slots=slots), 6)  # crosses an epoch
    ledger, a = Ledger(), b"a"
    ledger.attach(a, slots - 1)
    arrived = [first[i] for i in (1, 3, 4)]  # 0, 2 and 5 still decoding when the actor dies
    for start, cursor in arrived:
        ledger.receive(a)
        ledger.received_group(a, cursor, start)
    ledger.train([(a, cursor, start) for start, cursor in arrived[:2]])
    held, skip = ledger.cursor_for(slots - 1)
    assert held is None and skip == [first[i][1] for i in (1, 3, 4)]

    restarted = PromptStream(prompts, True, 1, (0, 0), slots - 1, slots, [tuple(c) for c in skip])
    after = spans(PromptStream(prompts, True, 1, tuple(first[5][1]), slots - 1, slots), 1)
    assert spans(restarted, 4) == [first[0], first[2], first[5], *after]
    ledger.received_group(a, first[0][1], first[0][0])  # the first hole filled
    assert ledger.cursor_for(slots - 1) == (first[1][1], [first[3][1], first[4][1]])

    resumed = Ledger()  # from a checkpoint: it knows the consumed groups only
    resumed.restore(json.loads(json.dumps(ledger.state())))
    assert resumed.cursor_for(slots - 1) == (None, [first[1][1], first[3][1]])
    resumed.attach(b"a2", slots - 1)
    assert resumed.cursor_for(slots - 1) == (None, [first[1][1], first[3][1]])


def test_rollouts_become_groups_or_counted_drops_and_credit_flows(socket_pair):
    sock, actor, ledger = socket_pair
    frames = protocol.encode(protocol.ROLLOUT, rollout("x").header, rollout("x").arrays)
    actor.send_multipart(frames)  # before any hello
    pump(sock, actor, 0)
    assert ledger.dropped == {"no handshake": 1}
    actor.send_multipart(actor_hello())
    pump(sock, actor, 3)
    actor.send_multipart(frames)
    actor.send_multipart(frames[:1] + [b"short"] + frames[2:])  # a rollout that fails validation
    groups, got = pump(sock, actor, 1)
    assert [g.group_id for g in groups] == ["x"]
    assert ledger.received == 3 and ledger.rejected == 1 and ledger.dropped["malformed"] == 1
    credit = [m for m in got if m.kind == protocol.CREDIT]
    # Consumed since its hello: the malformed one (so the actor is not left waiting); the one
    # before its hello is not its to count (it counts from its hello too).
    assert credit[-1]["groups_consumed"] == 1
    assert credit[-1]["window"] == 1  # (k + 1) * B = 1 in flight, for slot 0 and slot 1 (loading)


def test_a_dropped_group_still_holds_its_place_in_the_data_and_a_bad_span_is_refused(socket_pair):
    """A group the learner drops (here: G 3 where the config says 2) is held as much as a
    trained one: the slot's cursor passes it, so a restarted actor neither samples it again
    nor leaves a hole that never closes. A start_cursor that is not before its cursor is
    dropped with a reason naming it, and covers nothing."""
    sock, actor, ledger = socket_pair
    actor.send_multipart(actor_hello())
    pump(sock, actor, 3)
    assert ledger.cursor_for(0) == ([0, 3], [])  # the fixture's newest consumed of any slot
    for msg in (
        rollout("wrong size", lens=(2, 2, 2), cursor=[0, 4], start_cursor=[0, 3]),
        rollout("backwards", cursor=[0, 5], start_cursor=[0, 9]),
        rollout("ok", cursor=[0, 7], start_cursor=[0, 6]),
    ):
        actor.send_multipart(protocol.encode(protocol.ROLLOUT, msg.header, msg.arrays))
    groups = []
    for _ in range(50):
        groups += sock.receive(10, 5)
        if ledger.received == 3:
            break
    assert [g.group_id for g in groups] == ["ok"]
    assert ledger.dropped == {
        "group of 3 completions, config says 2": 1,
        "start_cursor [0, 9] is not an [epoch, position] before cursor [0, 5]": 1,
    }
    assert ledger.cursor_for(0) == ([0, 4], [[0, 7]])  # [0, 4] -> [0, 6] is a hole: sampled again


def test_a_slot_that_consumed_nothing_yet_resumes_at_its_own_start():
    """Checkpointed with nothing of slot 1 consumed, a resumed run starts slot 1 at the
    data's start, not after slot 0's newest (which would skip slot 1's first prompts)."""
    ledger = Ledger()
    ledger.attach(A, 0)
    ledger.attach(B, 1)
    ledger.receive(A)
    ledger.received_group(A, [0, 1], [0, 0])
    ledger.train([(A, [0, 1], [0, 0])])
    resumed = Ledger()
    resumed.restore(json.loads(json.dumps(ledger.state())))
    resumed.attach(b"b2", 1)
    assert resumed.cursor_for(1) == (None, []) and resumed.cursor_for(0) == ([0, 1], [])


# -- the metrics file --------------------------------------------------------------------


def test_the_metrics_file_drops_steps_after_the_checkpoint_it_resumes(tmp_path):
    path = tmp_path / "metrics.jsonl"
    first = MetricsFile(path)
    for step in (1, 2, 3):
        first.write({"step": step})
    first.close()
    resumed = MetricsFile(path, resume_at=2)
    resumed.write({"step": 3, "again": True})
    resumed.close()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"step": 1},
        {"step": 2},
        {"step": 3, "again": True},
    ]


# -- TRL's metric names --------------------------------------------------------------------


def scored_group(group_id: str, lens, finish, by_function: dict, weights: dict):
    g = group_from_message(b"a", rollout(group_id, lens=lens), 100, len(lens))
    g.finish_reasons = finish
    g.rewards_by_function = by_function
    # as the scorer sums them: None left out, NaN where no function scored the completion
    g.rewards = np.array(
        [
            sum(weights[k] * (v[i] or 0.0) for k, v in by_function.items())
            if any(v[i] is not None for v in by_function.values())
            else np.nan
            for i in range(len(lens))
        ]
    )
    return g


def test_batch_metrics_carry_trl_s_names_and_meanings():
    """Two groups of three, two reward functions weighted 1 and 0.5; completion 2 of group
    b is unscored by both (None): TRL leaves it out of `reward` and `reward_std` and each
    function's None out of its own statistics. Every value computed by hand."""
    from learner.batching import TrainRow
    from learner.metrics import batch_metrics, batch_tokens

    w = {"f": 1.0, "g": 0.5}
    a = scored_group(
        "a", (2, 3, 4), ["stop", "length", "stop"], {"f": [1.0, 0.0, 1.0], "g": [0.0, 0.0, 1.0]}, w
    )
    b = scored_group(
        "b", (5, 1, 6), ["length", "length", "stop"], {"f": [1.0, 1.0, None], "g": [1.0, 1.0, None]}, w
    )
    samples = [
        TrainRow(g.prompt_ids, ids, lp, fr)
        for g in (a, b)
        for ids, lp, fr in zip(g.completion_ids, g.logprobs, g.finish_reasons)
    ]
    m = batch_metrics([a, b], samples, np.stack([a.rewards, b.rewards]), np.zeros(6), 3, lambda k: k)
    totals = np.array([1.0, 0.0, 1.5, 1.5, 1.5])  # the five scored completions' weighted sums
    assert m["reward"] == pytest.approx(totals.mean())
    assert m["reward_std"] == pytest.approx(np.std(totals, ddof=1))
    assert (m["reward_min"], m["reward_max"]) == (0.0, 1.5)  # the unscored NaN left out
    assert m["rewards/f/mean"] == pytest.approx(0.8) and m["rewards/f/std"] == pytest.approx(
        np.std([1, 0, 1, 1, 1], ddof=1)
    )
    assert m["rewards/g/mean"] == pytest.approx(0.6) and m["rewards/g/std"] == pytest.approx(
        np.std([0, 0, 1, 1, 1], ddof=1)
    )
    # group b's scored rewards are 1.5 and 1.5: std 0; group a's are not
    assert m["frac_reward_zero_std"] == pytest.approx(0.5)
    assert (m["completions/mean_length"], m["completions/min_length"], m["completions/max_length"]) == (
        pytest.approx(21 / 6),
        1.0,
        6.0,
    )
    assert m["completions/clipped_ratio"] == pytest.approx(3 / 6)  # no EOS: cut at max_tokens
    assert (
        m["completions/mean_terminated_length"],
        m["completions/min_terminated_length"],
        m["completions/max_terminated_length"],
    ) == (pytest.approx(4.0), 2.0, 6.0)
    assert batch_tokens(samples) == 6 * 2 + 21  # TRL's num_tokens adds prompts and completions


def test_the_completions_table_shows_each_group_under_its_prompt():
    from orchestrator.show import NotLogged, completions_table

    long = "math_rewards:correctness"  # whole: cut to 10 it read "math_rewar"
    row = {
        "step": 3,
        "policy_version": 2,
        "group_id": "g1",
        "prompt": [{"role": "user", "content": "2+2?"}],
        "finish_reason": "stop",
        "tokens": 3,
        "rewards": {"f": 1.0, long: None},
        "advantage": 0.5,
    }
    rows = [
        {**row, "index": 0, "completion": "4\nok", "reward": 1.0},
        {**row, "index": 1, "completion": "five", "reward": None, "rewards": {"f": None, long: None}},
        {**row, "step": 1, "index": 0, "completion": "old", "reward": 0.0},
    ]
    text = completions_table(rows, None, width=100)
    lines = text.splitlines()
    assert lines[0] == "step 3" and '"content": "2+2?"' in lines[2] and "policy version 2" in lines[2]
    assert "4 ⏎ ok" in lines[4] and "1.000" in lines[4] and "+0.500" in lines[4]
    assert lines[5].split()[1:3] == ["-", "+0.500"]  # unscored: no reward, each function "-"
    assert "old" not in text
    assert lines[3].split()[3:5] == ["f", long]
    with pytest.raises(NotLogged, match="logged steps: 1, 3"):
        completions_table(rows, 2)
    with pytest.raises(NotLogged, match="no completions logged yet"):
        completions_table([], None)


def test_a_group_that_no_reward_scored_has_no_std_and_advantage_zero():
    """Every episode of group b ended with an environment error before any reward: its
    rewards are all unscored. As in TRL, it has no std (not "zero std"), stays out of
    `reward`, and its advantages are 0 (it still counts as trained)."""
    from learner.algorithms import make_algorithm
    from learner.batching import TrainRow
    from learner.metrics import batch_metrics

    a = scored_group("a", (2, 3), ["stop", "stop"], {"env": [1.0, 0.0]}, {"env": 1.0})
    b = scored_group("b", (2, 2), ["stop", "stop"], {"env": [None, None]}, {"env": 1.0})
    rewards = np.stack([a.rewards, b.rewards])
    advantages = make_algorithm("grpo").advantages(rewards)
    np.testing.assert_array_equal(advantages[2:], [0.0, 0.0])
    samples = [
        TrainRow(g.prompt_ids, ids, lp, fr)
        for g in (a, b)
        for ids, lp, fr in zip(g.completion_ids, g.logprobs, g.finish_reasons)
    ]
    m = batch_metrics([a, b], samples, rewards, advantages, 1, lambda k: k)
    assert m["frac_reward_zero_std"] == 0.0  # a's std is 0.71, b has none
    assert m["reward"] == pytest.approx(0.5)


def test_the_plot_s_reward_band_stays_inside_the_range_the_rewards_took():
    """Rewards in [0, 1] at mean 0.9 and std 0.3: the band is 0.6 to 1.0, not 1.2; a line
    without the range (an older run) keeps mean ± std."""
    from orchestrator.show import band

    rows = [
        {"step": 1, "reward": 0.9, "reward_std": 0.3, "reward_min": 0.0, "reward_max": 1.0},
        {"step": 2, "reward": 0.1, "reward_std": 0.2, "reward_min": 0.0, "reward_max": 1.0},
        {"step": 3, "reward": 0.5, "reward_std": 0.25},
    ]
    low, high = band(rows, "reward", "reward_std")
    assert low == pytest.approx([0.6, 0.0, 0.25]) and high == pytest.approx([1.0, 0.3, 0.75])


def learner_of_fakes(took: list[str], say, batch_size: int = 3, **parts):
    """A Learner with no process behind it, streaming: its batch notes each group it takes
    (`learn NAME`) in `took`, its status goes to `say`, and its rollout socket, scorer and
    other parts are `parts` (SimpleNamespace fakes)."""
    from types import SimpleNamespace

    from learner.intake import Intake
    from learner.ledger import Ledger
    from learner.service import Learner
    from runtime.config import TrainConfig

    class Building:
        groups: list = []
        started = None

        def take(self, groups, cfg, pad_id):
            took.extend(f"learn {g.name}" for g in groups)
            self.groups = [*self.groups, *groups]

    learner = Learner.__new__(Learner)
    learner.cfg = SimpleNamespace(train=TrainConfig(batch_size=batch_size, steps=5))  # type: ignore[assignment]
    learner.step, learner.streams, learner.pad_id, learner.building = 0, True, 0, Building()  # type: ignore[assignment]
    scorer = SimpleNamespace(poll=lambda timeout: ([], [], []))
    learner.intake = Intake(scorer, lambda rewards: True, Ledger())  # type: ignore[arg-type]
    learner.write_status = lambda phase, **extra: say(phase)  # type: ignore[method-assign]
    for name, part in parts.items():
        setattr(learner, name, part)
    return learner


def queued(learner, *names: str) -> None:
    """Groups of version 0 queued at the learner's intake, in this order of arrival."""
    from types import SimpleNamespace

    for name in names:
        learner.intake.queue.append((len(learner.intake.queue), SimpleNamespace(policy_version=0, name=name)))


def test_the_learner_says_it_is_stepping_before_every_take_of_a_batch():
    """status.json says "stepping" before each take of groups, not only the first: `up`
    gives a step under way its time before it kills the learner (Supervisor.step_under_way),
    and between takes the phase the sockets say has replaced it."""
    from types import SimpleNamespace

    from runtime.rundir import Phase

    said: list[str] = []
    learner = learner_of_fakes(said, said.append, rollouts=SimpleNamespace(sampling=lambda version: 0))
    for arrived in ("a", "b"):  # one group, then another: two takes
        queued(learner, arrived)
        assert learner.learn() is True  # it took a group
    assert said == [Phase.STEPPING, "learn a", Phase.STEPPING, "learn b"]
    assert learner.learn() is False  # none at hand


def test_groups_at_hand_are_learned_before_any_work_ahead():
    """Two groups queued, and reference logprobs to take ahead (learner/ahead.py): the
    learner's loop learns both before it works ahead. Work ahead first would keep a batch's
    last group, which ends the step, waiting for what only a later step needs."""
    from types import SimpleNamespace

    done: list[str] = []

    def work(intake, oldest):
        done.append("work ahead")
        return True

    def receive(timeout_ms, version):
        signals.requested = done.count("work ahead") == 2  # then the loop ends
        return []

    signals = SimpleNamespace(requested=False)
    partials = SimpleNamespace(work=work, take=lambda arrived: None)
    learner = learner_of_fakes(
        done,
        lambda phase: None,
        num_tokens=0,
        evaluator=None,
        signals=signals,
        rollouts=SimpleNamespace(
            partials=partials, receive=receive, send_credits=lambda: None, sampling=lambda version: 0
        ),
        reports=SimpleNamespace(write_phase=lambda step, at_once: None),
        checkpoints=SimpleNamespace(write=lambda step, tokens: None),
    )
    queued(learner, "a", "b")
    learner.run()
    assert done == ["learn a", "learn b", "work ahead", "work ahead"]


def test_a_batch_put_back_is_queued_again_in_its_order_of_arrival():
    """A step stopped before it trained its batch (learner.trainer.StepStopped), taken in
    two pieces as its groups arrived: the groups go back ahead of those that arrived
    after them, in their order."""
    from learner.intake import Intake
    from learner.ledger import Ledger

    intake = Intake(None, lambda rewards: True, Ledger())  # type: ignore[arg-type]  # no scoring here
    groups = [type("G", (), {"policy_version": 0, "name": n})() for n in "abcde"]
    intake.queue = list(enumerate(groups))
    taken = intake.next_groups(0, 2, 1, 1) + intake.next_groups(0, 1, 1, 1)  # as they arrived
    assert [g.name for g in taken] == ["a", "b", "c"]
    intake.queue.append((5, type("G", (), {"policy_version": 0, "name": "f"})()))
    intake.put_back()
    assert [g.name for _, g in intake.queue] == ["a", "b", "c", "d", "e", "f"]
    assert [g.name for g in intake.next_groups(0, 3, 3, 1)] == ["a", "b", "c"]
    intake.settle()  # trained: nothing to put back any more
    intake.put_back()
    assert [g.name for _, g in intake.queue] == ["d", "e", "f"]

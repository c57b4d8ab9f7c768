"""Protocol v1: the msgpack + raw-frame codec, its validation, and the socket endpoints."""

from __future__ import annotations

import os
import random
import re
import shutil
import stat
import tempfile
from pathlib import Path

import msgpack
import numpy as np
import pytest

import protocol
from protocol import (
    HEARTBEAT,
    HELLO,
    PROTOCOL_VERSION,
    ROLLOUT,
    SCORE_REPLY,
    STOP,
    WEIGHTS,
    Message,
    ProtocolError,
    decode,
    encode,
    make_endpoints,
    read_endpoints,
    write_endpoints,
)

# --------------------------------------------------------------------------- helpers


def pack(header) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def rollout_parts(group: int = 2) -> tuple[dict, dict[str, np.ndarray]]:
    """A valid rollout: header and arrays. Negative tests mutate exactly one thing."""
    lens = np.array([3, 2, 4, 1][:group], dtype=np.int32)
    n = int(lens.sum())
    header = {
        "group_id": "g-0001",
        "policy_version": 3,
        "prompt": "repeat 6",
        "columns": {"target": "6"},
        "texts": [f"text {i}" for i in range(group)],
        "finish_reasons": ["stop", "length", "stop", "length"][:group],
    }
    arrays = {
        "prompt_ids": np.array([5, 6, 7], dtype=np.int32),
        "completion_ids": np.arange(10, 10 + n, dtype=np.int32),
        "completion_lens": lens,
        "logprobs": -np.linspace(0.0, 2.0, n, dtype=np.float32),
    }
    return header, arrays


def rollout_frames(
    header_changes: dict | None = None,
    array_changes: dict | None = None,
    drop_fields: tuple = (),
    drop_arrays: tuple = (),
) -> list[bytes]:
    header, arrays = rollout_parts()
    header.update(header_changes or {})
    arrays.update(array_changes or {})
    for name in drop_fields:
        del header[name]
    for name in drop_arrays:
        del arrays[name]
    return encode(ROLLOUT, header, arrays)


def forge(header: dict, frames: list[bytes] = (), **overrides) -> list[bytes]:
    """Frames whose header is packed by hand, so it can break any rule."""
    head = {"protocol": PROTOCOL_VERSION, "arrays": [], **header, **overrides}
    return [pack(head), *frames]


def stop_with_array(spec: dict, frame: bytes) -> list[bytes]:
    return forge({"kind": STOP, "reason": "done", "arrays": [spec]}, [frame])


def assert_same_array(got: np.ndarray, want: np.ndarray) -> None:
    want = np.asarray(want)
    assert got.dtype == want.dtype
    assert got.dtype.name == want.dtype.name
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


# --------------------------------------------------------------------------- round trips


def test_rollout_helper_is_valid():
    header, arrays = rollout_parts()
    msg = decode(encode(ROLLOUT, header, arrays))
    assert isinstance(msg, Message)
    assert msg.kind == ROLLOUT
    assert msg["group_id"] == "g-0001"
    assert msg["policy_version"] == 3
    assert msg["columns"] == {"target": "6"}
    assert msg["texts"] == ["text 0", "text 1"]
    assert msg["finish_reasons"] == ["stop", "length"]
    assert list(msg.arrays) == ["prompt_ids", "completion_ids", "completion_lens", "logprobs"]
    for name, want in arrays.items():
        assert_same_array(msg.arrays[name], want)


ROUND_TRIPS = {
    HELLO: (
        {
            "role": "actor",
            "model": "/models/tiny",
            "tokenizer": "/models/tiny",
            "lora": {"rank": 8, "scale": 20.0, "keys": ["q_proj"]},
            "pid": 4242,
        },
        {"vocab_mask": np.array([1, 0, 1, 1], dtype=np.uint8), "one": np.array([7], dtype=np.int64)},
    ),
    ROLLOUT: rollout_parts(group=3),
    WEIGHTS: (
        {"version": 12, "note": "extra fields are kept"},
        {
            "layers.0.lora_a": np.arange(12, dtype=np.float16).reshape(3, 4) / 8,
            "layers.0.lora_b": np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 2, 2),
            "step": np.array([2**40 + 3], dtype=np.int64),
            "empty": np.zeros((0,), dtype=np.float32),
            "empty_2d": np.zeros((3, 0), dtype=np.int32),
            "big_ints": np.array([-(2**62), 2**62, -1], dtype=np.int64),
            "bytes": np.frombuffer(b"\x00\xffabc", dtype=np.uint8),
        },
    ),
    HEARTBEAT: (
        {"role": "learner", "time": 1712345678.25},
        {"f16": np.array([-1.5, 0.0, 65504.0], dtype=np.float16)},
    ),
    STOP: (
        {"reason": "steps done"},
        {"tail": np.array([], dtype=np.uint8)},
    ),
}


@pytest.mark.parametrize("kind", list(ROUND_TRIPS))
def test_round_trip_every_kind(kind):
    header, arrays = ROUND_TRIPS[kind]
    frames = encode(kind, header, arrays)
    assert isinstance(frames[0], bytes)
    # array frames are zero-copy byte views of the arrays
    assert [memoryview(f).nbytes for f in frames[1:]] == [np.asarray(a).nbytes for a in arrays.values()]
    assert len(frames) == 1 + len(arrays)
    msg = decode(frames)
    assert msg.kind == kind
    assert msg["protocol"] == PROTOCOL_VERSION
    assert msg["kind"] == kind
    for key, value in header.items():
        assert msg[key] == value
    assert [s["name"] for s in msg["arrays"]] == list(arrays)
    assert set(msg.arrays) == set(arrays)
    for name, want in arrays.items():
        assert_same_array(msg.arrays[name], want)


@pytest.mark.parametrize("kind", [HELLO, WEIGHTS, HEARTBEAT, STOP])
def test_round_trip_without_arrays(kind):
    header, _ = ROUND_TRIPS[kind]
    frames = encode(kind, header)
    assert len(frames) == 1
    msg = decode(frames)
    assert msg.arrays == {}
    assert msg["arrays"] == []


def test_empty_arrays_keep_their_shape():
    arrays = {
        "e_f16": np.zeros((0,), dtype=np.float16),
        "e_i64": np.zeros((2, 0, 3), dtype=np.int64),
        "e_u8": np.zeros((0, 0), dtype=np.uint8),
    }
    frames = encode(WEIGHTS, {"version": 0}, arrays)
    assert [bytes(f) for f in frames[1:]] == [b"", b"", b""]
    msg = decode(frames)
    assert msg.arrays["e_i64"].shape == (2, 0, 3)
    for name, want in arrays.items():
        assert_same_array(msg.arrays[name], want)


@pytest.mark.parametrize(
    "dtype,value",
    [
        ("float32", 3.25),
        ("int32", -9),
        ("int64", 2**40),
        ("float16", -1.5),
        ("uint8", 255),
    ],
)
def test_decode_zero_d_array(dtype, value):
    frame = np.array(value, dtype=dtype).tobytes()
    msg = decode(stop_with_array({"name": "s", "dtype": dtype, "shape": []}, frame))
    assert_same_array(msg.arrays["s"], np.array(value, dtype=dtype))
    assert msg.arrays["s"].shape == ()


@pytest.mark.parametrize("dtype", ["float32", "int64", "float16"])
def test_zero_d_array_round_trip(dtype):
    want = np.array(3, dtype=dtype)
    frames = encode(WEIGHTS, {"version": 0}, {"s": want})
    assert msgpack.unpackb(frames[0])["arrays"][0]["shape"] == []
    assert_same_array(decode(frames).arrays["s"], want)


def test_non_contiguous_and_big_endian_arrays_round_trip():
    base = np.arange(24, dtype=np.int64).reshape(4, 6)
    strided = base[:, ::2].T  # not C-contiguous
    big = np.array([1.5, -2.0, 65504.0], dtype=">f2")
    frames = encode(WEIGHTS, {"version": 1}, {"strided": strided, "big": big})
    spec = {s["name"]: s for s in msgpack.unpackb(frames[0])["arrays"]}
    assert spec["strided"] == {"name": "strided", "dtype": "int64", "shape": [3, 4]}
    assert spec["big"]["dtype"] == "float16"
    assert bytes(frames[2]) == np.array([1.5, -2.0, 65504.0], dtype="<f2").tobytes()
    msg = decode(frames)
    np.testing.assert_array_equal(msg.arrays["strided"], strided)
    assert msg.arrays["strided"].shape == (3, 4)
    np.testing.assert_array_equal(msg.arrays["big"], big)
    assert msg.arrays["big"].dtype.name == "float16"


def test_encode_owns_protocol_and_kind_fields():
    frames = encode(STOP, {"reason": "x", "protocol": 99, "kind": "bogus"})
    head = msgpack.unpackb(frames[0])
    assert head["protocol"] == PROTOCOL_VERSION == 1
    assert head["kind"] == STOP
    assert decode(frames).kind == STOP


def test_public_names_are_exported():
    assert set(protocol.__all__) >= {"encode", "decode", "ProtocolError", "Message", "make_endpoints"}
    assert issubclass(ProtocolError, ValueError)
    assert (HELLO, ROLLOUT, WEIGHTS, HEARTBEAT, STOP) == ("hello", "rollout", "weights", "heartbeat", "stop")


# --------------------------------------------------------------------------- generic validation


def test_empty_frame_list():
    with pytest.raises(ProtocolError, match="empty message"):
        decode([])


@pytest.mark.parametrize("junk", [b"\xc1", b"", b"\x92\x01", b"\x81\xa1k", b"\xff\xff\xff\x00garbage"])
def test_header_not_msgpack(junk):
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        decode([junk])


@pytest.mark.parametrize(
    "value,name",
    [
        ([1, 2, 3], "list"),
        ("hello", "str"),
        (7, "int"),
        (None, "NoneType"),
    ],
)
def test_header_not_a_map(value, name):
    with pytest.raises(ProtocolError, match=f"header must be a map, got {name}"):
        decode([pack(value)])


def test_header_with_non_string_keys():
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        decode([pack({1: "x", "protocol": 1})])


@pytest.mark.parametrize("version,shown", [(2, "2"), (0, "0"), ("1", "'1'"), (None, "None")])
def test_wrong_protocol_version(version, shown):
    with pytest.raises(ProtocolError, match=f"protocol version {shown} is not 1"):
        decode(forge({"kind": STOP, "reason": "x"}, protocol=version))


def test_missing_protocol_version():
    frames = [pack({"kind": STOP, "reason": "x", "arrays": []})]
    with pytest.raises(ProtocolError, match="protocol version None is not 1"):
        decode(frames)


@pytest.mark.parametrize("kind", ["bogus", "HELLO", "", None, 3])
def test_unknown_kind(kind):
    with pytest.raises(ProtocolError, match="unknown message kind"):
        decode(forge({"kind": kind}))


def test_unknown_kind_is_named():
    with pytest.raises(ProtocolError, match="unknown message kind 'bogus'"):
        decode(forge({"kind": "bogus"}))


@pytest.mark.parametrize(
    "kind,header,missing",
    [
        (STOP, {}, "reason"),
        (WEIGHTS, {}, "version"),
        (HEARTBEAT, {"role": "actor"}, "time"),
        (HELLO, {"role": "actor", "model": "m", "tokenizer": "t", "lora": {}}, "pid"),
    ],
)
def test_missing_required_field(kind, header, missing):
    with pytest.raises(ProtocolError, match=f"{kind}: missing field '{missing}'"):
        decode(encode(kind, header))


@pytest.mark.parametrize(
    "field,value,said",
    [("final", "yes", "'final' must be true or false"), ("code", 4, "'code' must be a string")],
)
def test_a_stop_s_optional_fields_are_checked(field, value, said):
    with pytest.raises(ProtocolError, match=f"stop: field {said}"):
        decode(encode(STOP, {"reason": "r", field: value}))
    stop = decode(encode(STOP, {"reason": "r", "code": "incompatible", "final": True}))
    assert stop["code"] == "incompatible"


@pytest.mark.parametrize(
    "field",
    [
        "group_id",
        "policy_version",
        "prompt",
        "columns",
        "texts",
        "finish_reasons",
    ],
)
def test_rollout_missing_required_field(field):
    with pytest.raises(ProtocolError, match=f"rollout: missing field '{field}'"):
        decode(rollout_frames(drop_fields=(field,)))


@pytest.mark.parametrize(
    "kind,header,message",
    [
        (WEIGHTS, {"version": "3"}, "field 'version' must be an integer, got str"),
        (WEIGHTS, {"version": 1.0}, "field 'version' must be an integer, got float"),
        (STOP, {"reason": 5}, "field 'reason' must be a string, got int"),
        (HEARTBEAT, {"role": "actor", "time": "now"}, "field 'time' must be a number, got str"),
        (ROLLOUT, {**rollout_parts()[0], "texts": "abc"}, "field 'texts' must be a list, got str"),
    ],
)
def test_wrong_field_type(kind, header, message):
    arrays = rollout_parts()[1] if kind == ROLLOUT else None
    with pytest.raises(ProtocolError, match=message):
        decode(encode(kind, header, arrays))


@pytest.mark.parametrize("value", [True, False])
def test_bool_where_int_expected(value):
    with pytest.raises(ProtocolError, match="field 'version' must be an integer, got bool"):
        decode(encode(WEIGHTS, {"version": value}))
    with pytest.raises(ProtocolError, match="field 'policy_version' must be an integer, got bool"):
        decode(rollout_frames({"policy_version": value}))


def test_bool_where_number_expected():
    with pytest.raises(ProtocolError, match="field 'time' must be a number, got bool"):
        decode(encode(HEARTBEAT, {"role": "actor", "time": True}))


def test_negative_int_field():
    with pytest.raises(ProtocolError, match="field 'version' must be >= 0, got -1"):
        decode(encode(WEIGHTS, {"version": -1}))
    with pytest.raises(ProtocolError, match="field 'pid' must be >= 0, got -7"):
        decode(encode(HELLO, {"role": "actor", "model": "m", "tokenizer": "t", "lora": {}, "pid": -7}))


def test_int_field_zero_is_fine():
    assert decode(encode(WEIGHTS, {"version": 0}))["version"] == 0


@pytest.mark.parametrize("arrays", [{}, "x", None, 3])
def test_arrays_field_not_a_list(arrays):
    with pytest.raises(ProtocolError, match="stop: field 'arrays' must be a list"):
        decode(forge({"kind": STOP, "reason": "x"}, arrays=arrays))


def test_arrays_field_may_be_left_out_when_there_are_none():
    assert decode([pack({"protocol": 1, "kind": "ready"})]).arrays == {}
    with pytest.raises(ProtocolError, match="header lists 0 arrays but 1 frames follow"):
        decode([pack({"protocol": 1, "kind": STOP, "reason": "x"}), b"\0"])


def test_hello_model_fields_are_the_rollout_socket_s_business():
    """The learner's hello on the reward socket and the actor's on the env socket carry no
    model (PROTOCOL.md, hello): the wire takes them; the rollout socket refuses an actor or
    observer that does not say what it runs, naming what is missing."""
    from learner.rollout_socket import RolloutSocket

    learner = {"role": "learner", "pid": 3, "instance": "ab12", "heartbeat_s": 1.0}
    assert decode(encode(HELLO, learner))["instance"] == "ab12"
    bare = decode(encode(HELLO, {"role": "observer", "pid": 3, "model": "m", "lora": []}))  # lora: not a map
    rollouts = RolloutSocket.__new__(RolloutSocket)  # only its hello check, no socket
    rollouts.identity = {"model": "m", "tokenizer": "t", "lora": {}}
    assert rollouts.incompatibility(bare) == (
        "an observer's hello needs 'tokenizer', 'lora' (PROTOCOL.md, hello)"
    )


def test_score_reply_with_an_error_needs_no_usable_rewards():
    msg = decode(encode(SCORE_REPLY, {"request_id": "r", "rewards": [], "error": "KeyError: x"}))
    assert msg["error"] == "KeyError: x"
    with pytest.raises(ProtocolError, match="field 'error' must be a string"):
        decode(encode(SCORE_REPLY, {"request_id": "r", "rewards": [], "error": 3}))


def test_frame_count_mismatch():
    frames = encode(WEIGHTS, {"version": 1}, {"a": np.zeros(2, np.float32), "b": np.ones(1, np.int32)})
    with pytest.raises(ProtocolError, match="header lists 2 arrays but 1 frames follow"):
        decode(frames[:-1])
    with pytest.raises(ProtocolError, match="header lists 2 arrays but 3 frames follow"):
        decode([*frames, b""])
    with pytest.raises(ProtocolError, match="header lists 0 arrays but 1 frames follow"):
        decode([*encode(STOP, {"reason": "x"}), b"\x00"])


@pytest.mark.parametrize("dtype", ["float64", "bool", "int16", "complex64", "uint32"])
def test_unsupported_dtype(dtype):
    frames = encode(WEIGHTS, {"version": 1}, {"w": np.zeros(3, dtype=dtype)})
    with pytest.raises(ProtocolError, match=f"array 'w' has unsupported dtype '{dtype}'"):
        decode(frames)


@pytest.mark.parametrize("dtype", [None, 5, "<f4", "float"])
def test_unsupported_dtype_forged(dtype):
    frames = stop_with_array({"name": "w", "dtype": dtype, "shape": [1]}, b"\x00" * 4)
    with pytest.raises(ProtocolError, match="has unsupported dtype"):
        decode(frames)


@pytest.mark.parametrize("shape", [[-1], [2, -3], [1.5], ["2"], [True], [None], 4, None, "2", {"0": 1}])
def test_bad_shape(shape):
    frames = stop_with_array({"name": "w", "dtype": "uint8", "shape": shape}, b"\x00\x00")
    with pytest.raises(ProtocolError, match=r"array 'w' needs a shape of at most 8 integers in \[0, "):
        decode(frames)


@pytest.mark.parametrize(
    "spec",
    [
        {"dtype": "uint8", "shape": [1]},
        {"name": 3, "dtype": "uint8", "shape": [1]},
        "w",
        ["w", "uint8", [1]],
        None,
    ],
)
def test_array_spec_without_string_name(spec):
    with pytest.raises(ProtocolError, match="every array needs a string 'name'"):
        decode(stop_with_array(spec, b"\x00"))


@pytest.mark.parametrize(
    "dtype,shape,nbytes,expected",
    [
        ("float32", [3], 8, 12),
        ("float32", [3], 13, 12),
        ("int64", [2, 2], 31, 32),
        ("float16", [], 0, 2),
        ("uint8", [0], 1, 0),
        ("int32", [2, 0], 8, 0),
    ],
)
def test_frame_length_does_not_match(dtype, shape, nbytes, expected):
    frames = stop_with_array({"name": "w", "dtype": dtype, "shape": shape}, b"\x01" * nbytes)
    message = rf"array 'w' {dtype}\[.*\] needs {expected} bytes, frame has {nbytes}"
    with pytest.raises(ProtocolError, match=message):
        decode(frames)


def test_truncated_real_frame():
    frames = encode(WEIGHTS, {"version": 1}, {"w": np.arange(6, dtype=np.float32)})
    frames[1] = frames[1][:-1]
    with pytest.raises(ProtocolError, match="needs 24 bytes, frame has 23"):
        decode(frames)


def test_duplicate_array_name():
    spec = {"name": "w", "dtype": "uint8", "shape": [1]}
    frames = forge({"kind": WEIGHTS, "version": 1, "arrays": [spec, dict(spec)]}, [b"\x01", b"\x02"])
    with pytest.raises(ProtocolError, match="weights: array 'w' appears twice"):
        decode(frames)


def test_message_over_max_bytes():
    frames = encode(WEIGHTS, {"version": 1}, {"w": np.zeros(64, dtype=np.float32)})
    assert sum(map(len, frames)) > 100
    with pytest.raises(ProtocolError, match=r"message of \d+ bytes exceeds the limit of 100"):
        decode(frames, max_bytes=100)
    # The limit counts every frame, and a message at the limit passes.
    total = sum(map(len, frames))
    assert decode(frames, max_bytes=total).arrays["w"].shape == (64,)
    with pytest.raises(ProtocolError, match=f"message of {total} bytes exceeds the limit of {total - 1}"):
        decode(frames, max_bytes=total - 1)


def test_max_bytes_checked_before_parsing():
    with pytest.raises(ProtocolError, match="exceeds the limit of 100"):
        decode([b"\xc1" * 101], max_bytes=100)


def test_header_over_header_limit():
    from protocol.wire import MAX_HEADER_BYTES

    with pytest.raises(ProtocolError, match=f"header of {MAX_HEADER_BYTES + 1} bytes exceeds"):
        decode([b"\x00" * (MAX_HEADER_BYTES + 1)])


# --------------------------------------------------------------------------- rollout validation


@pytest.mark.parametrize("name", ["prompt_ids", "completion_ids", "completion_lens", "logprobs"])
def test_rollout_missing_array(name):
    with pytest.raises(ProtocolError, match=f"rollout: missing array '{name}'"):
        decode(rollout_frames(drop_arrays=(name,)))


@pytest.mark.parametrize(
    "name,value,want",
    [
        ("prompt_ids", np.array([5, 6, 7], dtype=np.int64), "int32"),
        ("completion_ids", np.arange(10, 15, dtype=np.uint8), "int32"),
        ("completion_lens", np.array([3, 2], dtype=np.int64), "int32"),
        ("logprobs", np.full(5, -0.5, dtype=np.float16), "float32"),
        ("prompt_ids", np.array([[5, 6, 7]], dtype=np.int32), "int32"),
        ("logprobs", np.full((5, 1), -0.5, dtype=np.float32), "float32"),
    ],
)
def test_rollout_array_with_wrong_dtype_or_rank(name, value, want):
    with pytest.raises(ProtocolError, match=f"rollout: array '{name}' must be {want} of rank 1"):
        decode(rollout_frames(array_changes={name: value}))


@pytest.mark.parametrize("lens", [[3, 1], [3, 3], [0, 0], [6, -1]])
def test_rollout_completion_lens_not_summing(lens):
    with pytest.raises(ProtocolError, match="completion_lens must be >= 0 and sum to len"):
        decode(rollout_frames(array_changes={"completion_lens": np.array(lens, dtype=np.int32)}))


def test_rollout_zero_length_completion_is_fine():
    header, arrays = rollout_parts()
    arrays["completion_lens"] = np.array([5, 0], dtype=np.int32)
    msg = decode(encode(ROLLOUT, header, arrays))
    assert msg.arrays["completion_lens"].tolist() == [5, 0]


@pytest.mark.parametrize("n", [4, 6, 0])
def test_rollout_logprobs_length_mismatch(n):
    logprobs = np.full(n, -0.25, dtype=np.float32)
    with pytest.raises(ProtocolError, match="logprobs and completion_ids differ in length"):
        decode(rollout_frames(array_changes={"logprobs": logprobs}))


@pytest.mark.parametrize("bad", [0.5, 1e-3, np.nan, np.inf, -np.inf])
def test_rollout_bad_logprob(bad):
    logprobs = np.full(5, -0.25, dtype=np.float32)
    logprobs[2] = bad
    with pytest.raises(ProtocolError, match="logprobs must be finite and <= 0"):
        decode(rollout_frames(array_changes={"logprobs": logprobs}))


def test_rollout_zero_logprob_is_fine():
    msg = decode(rollout_frames(array_changes={"logprobs": np.zeros(5, dtype=np.float32)}))
    assert msg.arrays["logprobs"].tolist() == [0.0] * 5


@pytest.mark.parametrize("reason", ["eos", "STOP", "", None, 1])
def test_rollout_unknown_finish_reason(reason):
    with pytest.raises(ProtocolError, match=f"rollout: unknown finish reason {reason!r}"):
        decode(rollout_frames({"finish_reasons": ["stop", reason]}))


@pytest.mark.parametrize(
    "texts,reasons,message",
    [
        (["a"], ["stop", "stop"], "2 completions but 1 texts and 2 finish reasons"),
        (["a", "b", "c"], ["stop", "stop"], "2 completions but 3 texts and 2 finish reasons"),
        (["a", "b"], ["stop"], "2 completions but 2 texts and 1 finish reasons"),
        ([], [], "2 completions but 0 texts and 0 finish reasons"),
    ],
)
def test_rollout_texts_count_mismatch(texts, reasons, message):
    with pytest.raises(ProtocolError, match=message):
        decode(rollout_frames({"texts": texts, "finish_reasons": reasons}))


def test_rollout_text_not_a_string():
    with pytest.raises(ProtocolError, match="every text must be a string"):
        decode(rollout_frames({"texts": ["a", 3]}))


def test_rollout_empty_prompt_ids():
    with pytest.raises(ProtocolError, match="rollout: prompt_ids is empty"):
        decode(rollout_frames(array_changes={"prompt_ids": np.zeros(0, dtype=np.int32)}))


def test_rollout_empty_group():
    frames = rollout_frames(
        {"texts": [], "finish_reasons": []},
        {
            "completion_ids": np.zeros(0, np.int32),
            "completion_lens": np.zeros(0, np.int32),
            "logprobs": np.zeros(0, np.float32),
        },
    )
    with pytest.raises(ProtocolError, match="a group needs at least one completion"):
        decode(frames)


# --------------------------------------------------------------------------- hello validation


@pytest.mark.parametrize("role", ["actor", "learner", "reward_worker", "orchestrator"])
def test_hello_known_roles(role):
    header = {**ROUND_TRIPS[HELLO][0], "role": role}
    assert decode(encode(HELLO, header))["role"] == role


@pytest.mark.parametrize("role", ["wizard", "Actor", ""])
def test_hello_unknown_role(role):
    header = {**ROUND_TRIPS[HELLO][0], "role": role}
    with pytest.raises(ProtocolError, match=f"hello: unknown role '{role}'"):
        decode(encode(HELLO, header))


# --------------------------------------------------------------------------- fuzzing


def _valid_messages() -> list[list[bytes]]:
    return [encode(kind, header, arrays) for kind, (header, arrays) in ROUND_TRIPS.items()]


def test_random_bytes_only_raise_protocol_error():
    rng = random.Random(20240601)
    for _ in range(200):
        if rng.random() < 0.5:
            frames = [rng.randbytes(rng.randrange(0, 64))]
        else:
            frames = [rng.randbytes(rng.randrange(0, 48)) for _ in range(rng.randrange(1, 6))]
        with pytest.raises(ProtocolError):
            decode(frames)


def test_mutated_messages_only_raise_protocol_error():
    """Flip, cut, insert and reorder bytes and frames of real messages: decode either
    returns a Message or raises ProtocolError, never anything else."""
    rng = random.Random(7)
    valid = _valid_messages()
    outcomes = {"ok": 0, "protocol_error": 0}
    for _ in range(200):
        frames = [bytearray(f) for f in rng.choice(valid)]
        for _ in range(rng.randrange(1, 4)):
            i = rng.randrange(len(frames))
            f = frames[i]
            op = rng.randrange(5)
            if op == 0 and f:
                f[rng.randrange(len(f))] = rng.randrange(256)
            elif op == 1 and f:
                del f[rng.randrange(len(f)) :]
            elif op == 2:
                f[rng.randrange(len(f) + 1) : 0] = rng.randbytes(rng.randrange(1, 5))
            elif op == 3:
                frames.insert(rng.randrange(len(frames) + 1), bytearray(rng.randbytes(rng.randrange(8))))
            elif op == 4 and len(frames) > 1:
                del frames[rng.randrange(1, len(frames))]
        try:
            msg = decode([bytes(f) for f in frames])
        except ProtocolError:
            outcomes["protocol_error"] += 1
        else:
            assert isinstance(msg, Message)
            outcomes["ok"] += 1
    assert outcomes["protocol_error"] > 100


# --------------------------------------------------------------------------- odd inputs
# Malformed but well-formed msgpack headers that once made decode raise something other
# than ProtocolError (or accept a bad value); each must now be a ProtocolError.

ODD_INPUTS = {
    "kind is a list": forge({"kind": [1]}),
    "kind is a map": forge({"kind": {"a": 1}}),
    "dtype is a list": stop_with_array({"name": "w", "dtype": ["uint8"], "shape": [1]}, b"\x00"),
    "65 dimensions": stop_with_array({"name": "w", "dtype": "uint8", "shape": [1] * 65}, b"\x00"),
    "empty array with a huge dimension": stop_with_array(
        {"name": "w", "dtype": "uint8", "shape": [0, 2**63]}, b""
    ),
    "empty array too big in total": stop_with_array(
        {"name": "w", "dtype": "uint8", "shape": [0, 2**40, 2**40]}, b""
    ),
    "finish reason is a list": rollout_frames({"finish_reasons": ["stop", ["stop"]]}),
}


@pytest.mark.parametrize("case", list(ODD_INPUTS))
def test_odd_inputs_raise_protocol_error(case):
    try:
        decode(ODD_INPUTS[case])
    except ProtocolError:
        return
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"{case}: {type(e).__name__}: {e}")
    pytest.fail(f"{case}: accepted")


def test_bool_protocol_version_rejected():
    with pytest.raises(ProtocolError, match="protocol version"):
        decode(forge({"kind": STOP, "reason": "x"}, protocol=True))


# --------------------------------------------------------------------------- endpoints


def test_make_endpoints_ipc_private_dir(tmp_path):
    eps = make_endpoints(tmp_path)
    assert set(eps) == {"learner", "reward", "env"}
    assert eps["reward"] == eps["learner"].replace("learner.sock", "reward.sock")
    assert eps["env"] == eps["learner"].replace("learner.sock", "env.sock")
    addr = eps["learner"]
    assert addr.startswith("ipc://")
    sock = Path(addr.removeprefix("ipc://"))
    assert sock.name == "learner.sock"
    assert sock.parent == tmp_path.resolve() / "sockets"
    assert sock.parent.is_dir()
    assert stat.S_IMODE(os.stat(sock.parent).st_mode) == 0o700
    assert len(str(sock)) < 100


def test_make_endpoints_tightens_existing_dir(tmp_path):
    (tmp_path / "sockets").mkdir(mode=0o777)
    os.chmod(tmp_path / "sockets", 0o777)
    make_endpoints(tmp_path)
    assert stat.S_IMODE(os.stat(tmp_path / "sockets").st_mode) == 0o700


def test_make_endpoints_creates_missing_run_dir(tmp_path):
    run = tmp_path / "a" / "b"
    eps = make_endpoints(run)
    assert eps["learner"] == f"ipc://{run.resolve()}/sockets/learner.sock"
    assert (run / "sockets").is_dir()


def test_make_endpoints_deep_run_dir(tmp_path):
    deep = tmp_path.joinpath(*(["d" * 20] * 6))
    assert len(str(deep)) > 100
    eps = make_endpoints(deep)
    sock = Path(eps["learner"].removeprefix("ipc://"))
    try:
        assert len(str(sock)) < 100
        assert sock.name == "learner.sock"
        assert sock.parent.is_dir()
        assert stat.S_IMODE(os.stat(sock.parent).st_mode) == 0o700
        assert not str(sock).startswith(str(deep))
    finally:
        if not str(sock.parent).startswith(str(tmp_path)):
            shutil.rmtree(sock.parent, ignore_errors=True)


def test_a_deep_run_dir_binds_the_same_addresses_when_resumed(tmp_path, monkeypatch):
    """Workers that outlived the orchestrator wait on the old addresses: a resume (a new
    make_endpoints for the same run directory) must give the same ones. A directory of that
    name that is not ours is not used."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    deep = tmp_path.joinpath(*(["d" * 20] * 6))
    first, again = make_endpoints(deep), make_endpoints(deep)
    assert first == again
    assert make_endpoints(tmp_path.joinpath(*(["e" * 20] * 6))) != first
    sock_dir = Path(first["learner"].removeprefix("ipc://")).parent
    shutil.rmtree(sock_dir)
    sock_dir.symlink_to(tmp_path)  # planted by someone else: not followed
    moved = Path(make_endpoints(deep)["learner"].removeprefix("ipc://")).parent
    assert moved != sock_dir and moved.parent == tmp_path / "tmp"
    assert stat.S_IMODE(os.stat(moved).st_mode) == 0o700


def test_make_endpoints_tcp(tmp_path):
    assert make_endpoints(tmp_path, transport="tcp") == {
        "learner": "tcp://127.0.0.1:5555",
        "reward": "tcp://127.0.0.1:5556",
        "env": "tcp://127.0.0.1:5557",
    }
    assert make_endpoints(tmp_path, "tcp", host="0.0.0.0", base_port=7000) == {
        "learner": "tcp://0.0.0.0:7000",
        "reward": "tcp://0.0.0.0:7001",
        "env": "tcp://0.0.0.0:7002",
    }
    assert not (tmp_path / "sockets").exists()


@pytest.mark.parametrize("transport", ["udp", "IPC", "", "inproc"])
def test_make_endpoints_unknown_transport(tmp_path, transport):
    with pytest.raises(ValueError, match="transport must be 'ipc' or 'tcp'"):
        make_endpoints(tmp_path, transport=transport)


def test_write_read_endpoints_round_trip(tmp_path):
    eps = make_endpoints(tmp_path)
    write_endpoints(tmp_path, eps)
    assert (tmp_path / "endpoints.json").is_file()
    assert not (tmp_path / "endpoints.tmp").exists()
    assert read_endpoints(tmp_path) == eps
    other = {"learner": "tcp://127.0.0.1:6000", "extra": "ipc:///x/y.sock"}
    write_endpoints(tmp_path, other)
    assert read_endpoints(str(tmp_path)) == other


def test_read_endpoints_missing(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_endpoints(tmp_path)


# --------------------------------------------------------------------------- episodes and the env socket


def test_an_episode_rollout_round_trips_with_its_loss_mask():
    header, arrays = rollout_parts()
    n = len(arrays["completion_ids"])
    mask = np.array([0, 1, 1, 0, 1][:n], dtype=np.uint8)
    header.update(
        finish_reasons=["env_done", "max_turns"],
        env_rewards=[0.5, None],
        env_retries=2,
        turns=[[{"role": "assistant", "content": "a"}], [{"role": "user", "content": "b"}]],
    )
    msg = decode(encode(ROLLOUT, header, {**arrays, "loss_mask": mask}))
    assert_same_array(msg.arrays["loss_mask"], mask)
    assert msg["env_rewards"] == [0.5, None] and msg["finish_reasons"] == ["env_done", "max_turns"]


@pytest.mark.parametrize(
    "changes, arrays, message",
    [
        ({}, {"loss_mask": np.ones(4, dtype=np.uint8)}, "loss_mask must be uint8 0/1, one per completion id"),
        ({}, {"loss_mask": np.full(5, 2, dtype=np.uint8)}, "loss_mask must be uint8 0/1"),
        ({}, {"loss_mask": np.ones(5, dtype=np.int32)}, "array 'loss_mask' must be uint8 of rank 1"),
        ({"env_rewards": [1.0]}, {}, "env_rewards must have 2 entries, one per completion"),
        (
            {"env_rewards": [1.0, float("nan")]},
            {},
            "field 'env_rewards' must be a list of finite numbers or nil",
        ),
        ({"turns": [[{"role": "user"}], []]}, {}, "field 'turns' must be a list of lists of {'role': str"),
        ({"error": 3}, {}, "field 'error' must be a string"),
        ({}, {"policy_versions": np.ones(4, dtype=np.int32)}, "policy_versions must be int32 >= 0, one per"),
        (
            {},
            {"policy_versions": np.ones(5, dtype=np.int64)},
            "array 'policy_versions' must be int32 of rank 1",
        ),
        ({}, {"policy_versions": np.full(5, -1, dtype=np.int32)}, "policy_versions must be int32 >= 0"),
    ],
)
def test_bad_optional_rollout_fields_are_named(changes, arrays, message):
    with pytest.raises(ProtocolError, match=re.escape(message)):
        decode(rollout_frames(changes, arrays))


def test_observation_fields_are_checked():
    ok = {"kind": "observation", "request_id": "r", "observation": "", "done": False}
    assert decode(forge(ok, reward=None, role="tool", info={"k": [1]})).kind == "observation"
    for field, value, what in [
        ("done", 1, "true or false"),
        ("reward", float("inf"), "a finite number"),
        ("role", "", "a non-empty string"),
        ("info", [], "a map"),
        ("error", 1, "a string"),
    ]:
        with pytest.raises(ProtocolError, match=re.escape(what)):
            decode(forge({**ok, field: value}))
    for kind, fields in [
        ("reset", {"request_id": "r", "episode_id": "e", "prompt": "p"}),
        ("step", {"request_id": "r", "episode_id": "e", "action": "a"}),
        ("end", {}),
    ]:
        with pytest.raises(ProtocolError, match="missing field"):
            decode(forge({"kind": kind, **fields}))

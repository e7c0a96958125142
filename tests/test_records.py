"""Records: bit-exact round trips, packed arrays, and one typed error for every bad payload."""

import math

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.records import (
    SCHEMA,
    DeadLetter,
    Feedback,
    GroupClosed,
    PromptTask,
    RecordError,
    ScoredTrajectory,
    TrainGroup,
    Trajectory,
    WeightsPublished,
    decode,
    encode,
    pack_f32,
    pack_i32,
    unpack_f32,
    unpack_i32,
)

text = st.text(max_size=20)
small_int = st.integers(min_value=0, max_value=2**31 - 1)
token_ids = st.lists(st.integers(min_value=-(2**31), max_value=2**31 - 1), max_size=64)
floats32 = st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), max_size=64)
json_value = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), text)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": text}), max_size=3)


@st.composite
def trajectories(draw):
    return Trajectory(
        prompt_id=draw(text),
        attempt=draw(small_int),
        request_id=draw(text),
        turn=draw(small_int),
        generation_batch=draw(small_int),
        prompt_ids=pack_i32(draw(token_ids)),
        completion_ids=pack_i32(draw(token_ids)),
        logprobs=pack_f32(draw(floats32)),
        loss_mask=pack_i32(draw(st.lists(st.integers(0, 1), max_size=64))),
        messages=draw(messages),
        completion=draw(text),
        finish_reason=draw(st.sampled_from(["stop", "length", "abort"])),
        data_dict=draw(st.dictionaries(text, json_value, max_size=4)),
        policy_version=draw(small_int),
        max_policy_version=draw(small_int),
    )


@st.composite
def any_record(draw):
    t = draw(trajectories())
    scored = ScoredTrajectory(
        trajectory=t,
        rewards=draw(st.dictionaries(text, st.one_of(st.none(), st.floats(allow_nan=False)), max_size=3)),
        reward=draw(st.floats(allow_nan=False)),
    )
    return draw(
        st.sampled_from(
            [
                t,
                scored,
                PromptTask(prompt_id="p", generation_batch=3, num_generations=8, messages=draw(messages), seed=draw(small_int)),
                GroupClosed(prompt_id="p", attempt=1, generation_batch=2, record_ids=draw(st.lists(text, max_size=8))),
                TrainGroup(prompt_id="p", attempt=0, generation_batch=0, records=[scored], advantages=[draw(st.floats(allow_nan=False))]),
                WeightsPublished(version=draw(small_int), path=draw(text), final=draw(st.booleans())),
                Feedback(prompt_id="p", attempt=0, generation_batch=1, outcome="dropped", reason=draw(text)),
                DeadLetter(edge="x", entry_id="1-0", payload=draw(st.binary(max_size=64)), error=draw(text)),
            ]
        )
    )


@settings(max_examples=200, deadline=None)
@given(any_record())
def test_any_record_round_trips_bit_exactly(record):
    blob = encode(record)
    again = decode(blob)
    assert type(again) is type(record)
    assert encode(again) == blob  # byte-identical, NaNs and infinities included


@given(token_ids, floats32)
def test_packed_arrays_round_trip(ids, values):
    assert unpack_i32(pack_i32(ids)).tolist() == ids
    back = unpack_f32(pack_f32(values))
    expected = np.asarray(values, dtype=np.float32)
    assert back.tobytes() == expected.tobytes()


def test_packing_accepts_numpy_and_torch_without_lists():
    torch = pytest.importorskip("torch")
    assert unpack_i32(pack_i32(torch.tensor([1, 2, 3]))).tolist() == [1, 2, 3]
    assert unpack_f32(pack_f32(np.array([0.5, -1.25]))).tolist() == [0.5, -1.25]
    view = unpack_i32(pack_i32([7, 8]))
    assert not view.flags.writeable  # a view over the bytes, not a copy


def test_trajectory_accessors():
    t = Trajectory(
        prompt_id="e0:1", attempt=0, request_id="e0:1/0/3", generation_batch=0,
        prompt_ids=pack_i32([1, 2]), completion_ids=pack_i32([5, 6, 7]), logprobs=pack_f32([-0.5, -1.0, -2.0]),
        finish_reason="length", policy_version=4, max_policy_version=5,
    )
    assert t.record_id == "e0:1/0/3/0"
    assert t.group_id == "e0:1/0"
    assert t.is_truncated
    assert t.completion_loss_mask().tolist() == [1, 1, 1]
    assert math.isclose(float(t.completion_logprobs()[1]), -1.0)


@pytest.mark.parametrize("payload", [b"", b"\x00\x01garbage", b"\xc1", msgspec.msgpack.encode([1, 2, 3])])
def test_garbage_is_a_record_error(payload):
    with pytest.raises(RecordError):
        decode(payload)


def test_unknown_tag_is_a_record_error():
    payload = msgspec.msgpack.encode({"type": "launch_missiles", "schema": 1})
    with pytest.raises(RecordError, match="launch_missiles|type"):
        decode(payload)


def test_wrong_field_type_names_the_field():
    payload = msgspec.msgpack.encode(
        {"type": "weights", "schema": 1, "version": "seven", "path": "/x"}
    )
    with pytest.raises(RecordError, match="version"):
        decode(payload)


def test_newer_schema_is_refused_with_the_versions():
    payload = msgspec.msgpack.encode({"type": "weights", "schema": SCHEMA + 1, "version": 1, "path": "/x", "new_field": 1})
    with pytest.raises(RecordError, match=f"schema {SCHEMA + 1}.*up to {SCHEMA}"):
        decode(payload)


def test_old_records_gain_new_fields_by_default():
    # A record written before `final` existed still decodes, with the default.
    payload = msgspec.msgpack.encode({"type": "weights", "schema": 1, "version": 2, "path": "/w"})
    record = decode(payload)
    assert record.final is False and record.version == 2

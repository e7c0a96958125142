"""Fuzzing the four places where input from outside meets the code: record decoding (bytes off the wire),
config parsing (TOML text and ``--set`` overrides), a custom scheduler's return values, and a reward
function's outputs; and a dead letter of anything, as the advantage stage and the feeder see it (a drop or
nothing). Each target asserts the same promise: a valid value, or the project's typed error
(RecordError, ConfigError, SchedulerError, and for rewards a score or RewardFailed) — never another
exception, never a hang.

Profiles (``ROLLSTREAM_FUZZ_PROFILE``): ``fuzz-ci`` (the default, 300 cases per target, seconds) and
``fuzz`` (10,000 cases per target, or ``ROLLSTREAM_FUZZ_EXAMPLES``): ``make fuzz``.
"""

from __future__ import annotations

import asyncio
import functools
import math
import os
import string

import msgspec
import numpy as np
import pytest
from fake_context import FakeContext
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import config.schema as config_schema
from config import ConfigError, config_from_dict, load_config
from config.render import toml_value
from pipeline.records import (
    GroupClosed,
    PromptTask,
    Record,
    RecordError,
    ScoredTrajectory,
    Trajectory,
    TrajectoryGroup,
    decode,
    encode,
    pack_f32,
    pack_i32,
)
from pipeline.stage import Stage
from schedulers import SchedulerError, normalize_step_result
from schedulers.protocol import (
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatMessage,
    RolloutInferRequest,
)
from schedulers.results import run_results, trajectory_parts

settings.register_profile(
    "fuzz-ci", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)
settings.register_profile(
    "fuzz",
    max_examples=int(os.environ.get("ROLLSTREAM_FUZZ_EXAMPLES", "10000")),
    deadline=None,
    suppress_health_check=list(HealthCheck),
    database=None,
)
FUZZ = settings(settings.get_profile(os.environ.get("ROLLSTREAM_FUZZ_PROFILE", "fuzz-ci")))

# msgpack-able values of any shape: what a foreign or corrupted producer could put in a field.
msgpack_ints = st.integers(-(2**63), 2**64 - 1)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    msgpack_ints,
    st.floats(),
    st.text(max_size=12),
    st.binary(max_size=12),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8) | msgpack_ints, inner, max_size=4)
    ),
    max_leaves=12,
)


def trajectory(**overrides) -> Trajectory:
    fields = {
        "prompt_id": "e0:1",
        "attempt": 0,
        "request_id": "e0:1/0/0",
        "generation_batch": 0,
        "prompt_ids": pack_i32([1, 2, 3]),
        "completion_ids": pack_i32([4, 5]),
        "logprobs": pack_f32([-0.5, -0.25]),
        "messages": [{"role": "user", "content": "What is 1+1?"}],
        "completion": "2",
        "data_dict": {"solution": "2"},
        "policy_version": 0,
        "max_policy_version": 0,
    }
    return Trajectory(**{**fields, **overrides})


SAMPLES: list[Record] = [
    trajectory(),
    PromptTask(
        prompt_id="e0:1", generation_batch=0, num_generations=4, messages=[{"role": "user", "content": "x"}]
    ),
    GroupClosed(prompt_id="e0:1", attempt=0, generation_batch=0, record_ids=["e0:1/0/0/0"]),
    ScoredTrajectory(trajectory=trajectory(), rewards={"accuracy": 1.0}, reward=1.0),
    TrajectoryGroup(
        manifest=GroupClosed(prompt_id="e0:1", attempt=0, generation_batch=0, record_ids=["e0:1/0/0/0"]),
        trajectories=[trajectory()],
    ),
]
TAGS = [
    "prompt_task",
    "trajectory",
    "group_closed",
    "trajectory_group",
    "scored",
    "train_group",
    "weights",
    "feedback",
    "dead_letter",
    "nonsense",
]
FIELDS = sorted({f.name for cls in Record.__subclasses__() for f in msgspec.structs.fields(cls)})


# ---------------------------------------------------------------- records


def decodes_or_record_error(payload: bytes) -> None:
    try:
        record = decode(payload)
    except RecordError:
        return
    assert isinstance(record, Record)
    assert decode(encode(record)) == record  # what decodes, re-encodes: a worker can forward it


@FUZZ
@given(st.binary(max_size=512))
@example(b"")
@example(b"\xc1")
# a GroupClosed whose tag string is not UTF-8: msgspec raised UnicodeDecodeError, which killed the worker
@example(
    b"\x87\xa4type\xadgroup_closed\xa6schema\x01\xa9prompt_id\xa4e0:1\xa7attempt\x00\xb0generation_batch"
    b"\x00\xaarecord_ids\x91\xaae0:1/0/0/0\xa5stage\xa7rollout"
)
@example(b"\x81\xa4type\xa3\xff\xfe\xfd")
def test_fuzz_decode_arbitrary_bytes(payload):
    decodes_or_record_error(payload)


@FUZZ
@given(st.sampled_from(SAMPLES), st.data())
def test_fuzz_decode_mutated_records(record, data):
    """A valid record's bytes, truncated, bit-flipped, or with bytes inserted."""
    payload = bytearray(encode(record))
    for _ in range(data.draw(st.integers(1, 4))):
        where = data.draw(st.integers(0, len(payload) - 1))
        action = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        if action == "flip":
            payload[where] ^= 1 << data.draw(st.integers(0, 7))
        elif action == "cut":
            del payload[where:]
            if not payload:
                break
        else:
            payload[where:where] = data.draw(st.binary(min_size=1, max_size=8))
    decodes_or_record_error(bytes(payload))


@FUZZ
@given(
    st.sampled_from(TAGS),
    st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), values, max_size=10),
    st.sampled_from(SAMPLES),
    st.booleans(),
)
@example("trajectory", {"completion_ids": b"abc"}, SAMPLES[0], True)  # a packed array of 3 bytes
@example("trajectory", {"schema": 2}, SAMPLES[0], True)
def test_fuzz_decode_well_formed_msgpack_with_wrong_fields(tag, fields, base, start_from_valid):
    """Valid msgpack maps with a record tag and fields of any type: the closest thing to a foreign producer."""
    body = msgspec.msgpack.decode(encode(base)) if start_from_valid else {}
    body.update(fields)
    body["type"] = tag
    decodes_or_record_error(msgspec.msgpack.encode(body))


@functools.cache
def unshuffled_config():
    """A default config, the dataset in row order: batch 0 is prompts e0:0 .. e0:7."""
    return config_from_dict({"reward": {"reward_funcs": ["accuracy"]}, "data": {"dataset_shuffle": False}})


# Ids of any value in a record that could reach the dead edge: a foreign or corrupted producer's.
any_text, any_int = st.text(max_size=12), msgpack_ints.filter(lambda n: n < 2**63)
records_with_any_ids = st.one_of(
    st.builds(trajectory, prompt_id=any_text, attempt=any_int, generation_batch=any_int),
    st.builds(PromptTask, prompt_id=any_text, attempt=any_int, generation_batch=any_int,
              num_generations=st.just(1), messages=st.just([])),
    st.builds(GroupClosed, prompt_id=any_text, attempt=any_int, generation_batch=any_int,
              record_ids=st.lists(any_text, max_size=3)),
)


@FUZZ
@given(st.binary(max_size=256) | records_with_any_ids.map(encode), st.sampled_from(["trajectories", "dead"]))
@example(encode(PromptTask(prompt_id="e0:0", generation_batch=0, num_generations=1, messages=[])), "prompts")
def test_fuzz_a_dead_letter_of_anything_becomes_a_drop_or_nothing_and_only_a_released_group_is_replaced(
    payload, edge
):
    """The advantage stage turns a dead letter into at most one drop that encodes; the feeder replaces
    only a group it released (here: batch 0's), whatever ids the payload made up."""
    from pipeline.records import DeadLetter, Feedback
    from stages.advantage import Advantage
    from stages.feeder import Feeder

    cfg = unshuffled_config()
    feeder = Feeder(cfg, [{"messages": [{"role": "user", "content": str(i)}]} for i in range(64)])
    released = {task.group_id for task in feeder.release_batch()}
    ctx = FakeContext("fuzz", "advantage", "w")
    letter = DeadLetter(edge=edge, entry_id="1-0", payload=payload, error="boom")
    handled = asyncio.run(Advantage(cfg).handle(letter, ctx))
    assert not handled.hold and handled.release == [] and len(handled.outputs) <= 1
    for _edge, feedback in handled.outputs:
        assert isinstance(decode(encode(feedback)), Feedback)
        answered = asyncio.run(feeder.handle(feedback, ctx))
        assert answered.hold == (f"{feedback.prompt_id}/{feedback.attempt}" in released)


def test_a_packed_array_of_the_wrong_length_is_a_record_error():
    """Regression (found by the fuzzer): such a record decoded, then failed in a handler's np.frombuffer."""
    body = msgspec.msgpack.decode(encode(trajectory()))
    body["loss_mask"] = b"\x01\x00\x00"
    with pytest.raises(RecordError, match="loss_mask"):
        decode(msgspec.msgpack.encode(body))


def test_an_unencodable_record_is_a_record_error():
    """Regression: an object in rollout_infos raised TypeError out of the worker's commit, killing it."""
    with pytest.raises(RecordError, match="Trajectory 'e0:1/0/0/0'"):
        encode(trajectory(rollout_infos={"engine": object()}))
    with pytest.raises(RecordError):
        encode(trajectory(rollout_infos={"big": 2**70}))


# ---------------------------------------------------------------- config

# TOML fragments that look like a config: real sections and keys, values of every TOML type.
toml_values = st.one_of(
    st.integers(-(2**63), 2**63 - 1).map(str),
    st.floats().map(toml_value),
    st.booleans().map(toml_value),
    st.text(max_size=10).map(toml_value),
    st.lists(st.integers(-5, 100), max_size=3).map(toml_value),
    st.lists(st.text(max_size=6), max_size=3).map(toml_value),
    st.sampled_from(["none", "[", "{a = 1}", "1980-01-01", '"""x"""', "nan", "-inf", "1e999", "0x10"]),
)
sections = st.sampled_from([*config_schema.FIELDS, "nosuch"])


@st.composite
def config_text(draw) -> str:
    lines = []
    for section in draw(st.lists(sections, max_size=4)):
        lines.append(f"[{section}]")
        keys = list(config_schema.FIELDS.get(section, {})) + ["nosuch_key"]
        for key in draw(st.lists(st.sampled_from(keys), max_size=5)):
            lines.append(f"{key} = {draw(toml_values)}")
    if draw(st.booleans()):  # and some plain garbage
        lines.insert(draw(st.integers(0, len(lines))), draw(st.text(max_size=30)))
    return "\n".join(lines)


def loads_or_config_error(path, overrides=()) -> None:
    try:
        cfg = load_config(path, overrides)
    except ConfigError as exc:
        assert "\n" not in str(exc).strip(), "a config error is one line"
        return
    assert cfg.grpo.generation_batch_size % cfg.grpo.num_generations == 0
    assert len(cfg.reward.reward_weights) == len(cfg.reward.reward_funcs) + (
        cfg.reward.reward_model is not None
    )


@FUZZ
@given(config_text() | st.text(max_size=200) | st.binary(max_size=200))
@example(b"\xff\xfe[run]\n")  # not UTF-8
@example("[reward]\nreward_funcs = ['accuracy']\n[grpo]\nnum_generations = 0\n")
def test_fuzz_config_file(tmp_path_factory, text):
    path = tmp_path_factory.getbasetemp() / "fuzz.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
    loads_or_config_error(path)


keys = st.sampled_from([f"{s}.{k}" for s, fields in config_schema.FIELDS.items() for k in fields])


@FUZZ
@given(
    st.lists(
        st.one_of(
            st.tuples(keys, toml_values).map("=".join),
            st.tuples(keys, st.text(max_size=12)).map("=".join),
            st.text(alphabet=string.printable, max_size=30),
            st.just("data.columns.query=prompt"),
            st.just("data.columns.a.b=c"),
        ),
        max_size=5,
    )
)
def test_fuzz_config_overrides(overrides):
    loads_or_config_error(None, ["reward.reward_funcs=['accuracy']", *overrides])


def test_a_config_file_that_is_not_utf8_or_not_a_file_is_a_config_error(tmp_path):
    """Regression: tomllib raised UnicodeDecodeError, and a directory IsADirectoryError, as tracebacks."""
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b'[run]\nname = "caf\xe9"\n')
    with pytest.raises(ConfigError, match="latin1.toml"):
        load_config(bad)
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)


def test_config_from_dict_rejects_structures_of_any_shape():
    for data in ({"run": []}, {"grpo": {"num_generations": {"a": 1}}}, {"reward": {"reward_weights": "x"}}):
        with pytest.raises(ConfigError):
            config_from_dict(data)


# ---------------------------------------------------------------- scheduler returns


class ParsingOnlyBackend:
    """The TokenBackend protocol for results that never sample: trajectory_parts only tokenizes."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    async def generate(self, prompt_ids, **kwargs):
        raise AssertionError("trajectory_parts must not sample")


@pytest.fixture(scope="module")
def infer_engine(tiny_model_dir):
    from transformers import AutoTokenizer

    from schedulers.engine import InferEngine

    return InferEngine(
        ParsingOnlyBackend(AutoTokenizer.from_pretrained(str(tiny_model_dir))), max_model_len=256
    )


tokens = st.lists(st.integers(0, 300), max_size=6)
garbage = st.one_of(values, st.builds(object), st.just(np.float32(1.0)), st.just(float("nan")))
token_fields = st.one_of(
    tokens, st.lists(tokens, max_size=3), st.lists(st.integers(-(2**40), 2**40), max_size=4), garbage
)
mask_fields = st.one_of(
    st.lists(st.integers(0, 1), max_size=6),
    st.lists(st.lists(st.integers(0, 1), max_size=6), max_size=3),
    garbage,
)
logprob_fields = st.one_of(
    st.lists(st.floats(-20, 0), max_size=6), st.lists(st.lists(st.floats(), max_size=6), max_size=3), garbage
)
message_lists = st.one_of(
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "assistant", "tool"]), "content": st.text(max_size=8)}
        ),
        max_size=3,
    ),
    garbage,
)


@st.composite
def choices(draw):
    ids = draw(tokens)
    logprobs = draw(
        st.one_of(
            st.just({"content": [{"token_id": t, "logprob": -0.1} for t in ids]}),
            st.none(),
            st.dictionaries(st.sampled_from(["content", "x"]), values, max_size=2),
        )
    )
    choice = ChatCompletionResponseChoice(
        index=0,
        message=ChatMessage(role="assistant", content="x"),
        finish_reason=draw(st.sampled_from(["stop", "length", None, "weird"])),
        logprobs=logprobs,
        token_ids=draw(st.one_of(st.just(ids), st.none(), st.lists(st.integers(-5, 2**33), max_size=3))),
        policy_versions=draw(st.one_of(st.just((0, 1)), st.tuples(st.integers(-3, 3), st.integers(-3, 3)))),
    )
    return ChatCompletionResponse(choices=[choice])


result_dicts = st.fixed_dictionaries(
    {},
    optional={
        "response_token_ids": token_fields,
        "response_loss_mask": mask_fields,
        "rollout_logprobs": logprob_fields,
        "response": st.one_of(choices(), garbage),
        "messages": message_lists,
        "prompt_messages": message_lists,
        "prompt_token_ids": st.one_of(tokens, garbage),
        "rollout_infos": st.one_of(st.dictionaries(st.text(max_size=5), values, max_size=3), garbage),
        "finish_reason": st.one_of(st.sampled_from(["stop", "length", "abort"]), garbage),
        "policy_versions": st.one_of(st.tuples(st.integers(0, 5), st.integers(0, 5)), garbage),
        "explicit_loss_mask": st.booleans(),
    },
)


@FUZZ
@given(
    st.one_of(st.lists(st.one_of(result_dicts, garbage), max_size=3), result_dicts, garbage),
    st.sampled_from(["default", "last_round"]),
)
@example(
    [{"response_token_ids": [5, 6], "rollout_logprobs": [-0.5, -0.25], "rollout_infos": {"x": object()}}],
    "default",
)
@example([{"response_token_ids": [2**40], "rollout_logprobs": [-0.5]}], "default")
@example([{"response_token_ids": [5], "rollout_logprobs": [float("nan")]}], "default")
@example("not a list", "default")
def test_fuzz_scheduler_run_results(infer_engine, returned, loss_scale):
    """Every form a custom scheduler's run() may return: parts that travel as a Trajectory, or SchedulerError."""
    try:
        for j, result in enumerate(run_results(returned, "fuzz", "r0")):
            parts = trajectory_parts(
                result,
                infer_engine,
                loss_scale=loss_scale,
                scheduler="fuzz",
                index=j,
                default_versions=(0, 0),
                default_messages=[{"role": "user", "content": "q"}],
            )
            record = trajectory(**parts.record_fields())
            back = decode(encode(record))
            # no silent int32 wrap-around: the learner trains on exactly these tokens
            assert back.completion_token_ids().tolist() == parts.completion_ids
            assert len(parts.logprobs) == len(parts.completion_ids) == len(parts.loss_mask)
            assert all(math.isfinite(v) for v in parts.logprobs)
    except SchedulerError:
        pass


@FUZZ
@given(
    st.one_of(
        garbage,
        st.tuples(st.just(RolloutInferRequest(messages=[])), garbage),
        st.fixed_dictionaries(
            {"infer_request": st.one_of(st.just(RolloutInferRequest(messages=[])), garbage)}
        ),
    )
)
def test_fuzz_scheduler_step_returns(returned):
    try:
        normalized = normalize_step_result(returned, "fuzz", 1)
    except SchedulerError:
        return
    assert isinstance(normalized["infer_request"], RolloutInferRequest)
    assert isinstance(normalized.get("rollout_infos", {}), dict)


# ---------------------------------------------------------------- reward outputs


class Boom(Exception):
    pass


reward_values = st.one_of(
    st.none(),
    st.floats(),  # NaN and +-inf included
    st.integers(-(2**1100), 2**1100),  # beyond float's range too
    st.booleans(),
    st.text(max_size=4),
    st.builds(object),
    st.just(np.float32("nan")),
    st.just(np.float32(0.5)),
    st.just(np.int64(3)),
    st.just(complex(1, 1)),
)
reward_outputs = st.one_of(
    st.lists(reward_values, min_size=0, max_size=4),  # right and wrong lengths
    st.lists(reward_values, max_size=4).map(tuple),
    st.lists(st.floats(width=32), max_size=4).map(lambda v: np.array(v, dtype=np.float32)),
    st.lists(reward_values, max_size=4).map(iter),
    st.just("endless"),
    values,
    st.builds(Boom, st.text(max_size=5)),
    st.just(ValueError("bad")),
    st.just(KeyError("solution")),
)


class FuzzedReward:
    """A reward function whose output the test sets before each call (a raise when it is an exception)."""

    def __init__(self) -> None:
        self.output = None

    def __call__(self, completions, **kwargs):
        if isinstance(self.output, BaseException):
            raise self.output
        if self.output == "endless":
            return iter(lambda: 1.0, None)  # an endless generator
        return self.output


@pytest.fixture(scope="module", params=["zero", "drop_group", "dead_letter"])
def fuzzed_reward_stage(request):
    from config import load_config
    from rewards import orms
    from stages.reward import Reward

    fuzzed = FuzzedReward()
    orms["fuzzed"] = fuzzed
    cfg = load_config(
        None,
        [
            "reward.reward_funcs=['fuzzed', 'format']",
            "reward.reward_weights=[1.0, 0.5]",
            "reward.max_retries=0",
            f"reward.on_error={request.param}",
            # One stage scores every example: the stop on a repeated error (tested in test_reward_stage) would
            # end the fuzzing of outputs after three failing examples in a row.
            "run.max_consecutive_errors=1000000",
        ],
    )
    stage = Reward(cfg)
    yield stage, fuzzed
    asyncio.run(stage.close())
    del orms["fuzzed"]


@FUZZ
@given(reward_outputs, st.integers(1, 3))
@example([float("inf"), 1.0], 2)
@example(np.array([0.5, float("nan")], dtype=np.float32), 2)
@example("endless", 2)
def test_fuzz_reward_outputs(fuzzed_reward_stage, output, requests):
    """NaN, inf, wrong length, wrong type, exceptions: a finite score per record, or RewardFailed (dead_letter)."""
    from rewards.scoring import RewardFailed

    stage, fuzzed = fuzzed_reward_stage
    fuzzed.output = output
    batch = [[trajectory(request_id=f"e0:1/0/{i}")] for i in range(requests)]
    try:
        scored = asyncio.run(asyncio.wait_for(stage.scorer.score_requests(batch), timeout=30))
    except RewardFailed:
        assert stage.cfg.reward.on_error == "dead_letter"
        return
    assert len(scored) == requests
    for s in scored:
        assert math.isfinite(s.reward)
        assert all(v is None or (isinstance(v, float) and math.isfinite(v)) for v in s.rewards.values())
        decode(encode(s))  # it travels


# ---------------------------------------------------------------- the two worker crashes, end to end


class EmitsWhatItIsTold(Stage):
    """in -> out; prompt_id "bad" makes an output that cannot be encoded (an object in rollout_infos)."""

    name = "emitter"
    consumes = ("in",)
    concurrency = 2

    async def handle(self, record, ctx):
        from pipeline.stage import Handled

        infos = {"engine": object()} if record.prompt_id == "bad" else {}
        return Handled(outputs=[("out", trajectory(prompt_id=record.prompt_id, rollout_infos=infos))])


async def test_the_worker_survives_a_bad_utf8_tag_and_an_unencodable_output():
    """Regression: both raised out of the worker's record task and failed the whole worker."""
    from pipeline.records import DeadLetter, Feedback
    from pipeline.transport.memory import MemoryTransport
    from pipeline.worker import Worker

    def feedback(prompt_id: str) -> bytes:
        return encode(Feedback(prompt_id=prompt_id, attempt=0, generation_batch=0, outcome="trained"))

    bad_tag = b"\x81\xa4type\xa3\xff\xfe\xfd"
    transport = MemoryTransport()
    await transport.produce("in", [feedback("a"), bad_tag, feedback("bad"), feedback("b")])
    worker = Worker(
        EmitsWhatItIsTold(),
        transport,
        run="t",
        burst=True,
        block_ms=20,
        min_idle_ms=60_000,
        retry_backoff_s=0.001,
        max_retries=1,
    )
    assert await asyncio.wait_for(worker.serve(), timeout=60) == 0

    async def drain(edge):
        out = []
        while batch := await transport.consume(edge, "check", "c", 100, 10):
            out += [decode(d.payload) for d in batch]
            await transport.ack(edge, "check", [d.id for d in batch])
        return out

    assert sorted(t.prompt_id for t in await drain("out")) == ["a", "b"]
    dead = await drain("dead")
    assert all(isinstance(d, DeadLetter) for d in dead) and len(dead) == 2
    errors = sorted(d.error for d in dead)
    assert "undecodable" in errors[1] and "RecordError: cannot encode Trajectory" in errors[0]
    assert (await transport.stats("in", "emitter")).pending == 0

"""ms-swift's scheduler API as ms-swift's users write against it (issue 27): constructors of every version,
``RolloutOutput`` results, continuation contexts without an end-of-turn token, the gym's ms-swift keys and
reward weights, and a scheduler that fails on every group stopping the run.

The schedulers are tests/plugins/sched_swift.py (written in ms-swift's styles), the env and context manager
tests/gym_plugin.py; each form runs in a real short ``rollstream train`` (``run_pipeline``, the tiny model,
the session's vLLM engine), and the tests assert on what the plugin was given and on the trained records.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from pathlib import Path

import pytest

from config import load_config
from pipeline.errors import UserError
from pipeline.plugins import load_plugins
from pipeline.records import TrajectoryGroup
from pipeline.run_dir import edge_tail
from pipeline.stage import ErrorStreak
from pipeline.transport import connect
from schedulers import (
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatMessage,
    MultiTurnScheduler,
    RequestConfig,
    RolloutInferRequest,
    RolloutOutput,
    RolloutScheduler,
    SchedulerError,
    SchedulerFailed,
    construct_scheduler,
    remove_response,
)
from schedulers.base import drop_tokens
from schedulers.engine import resolve_config

PLUGINS = Path(__file__).parent / "plugins"
SCHED_PLUGIN = PLUGINS / "sched_swift.py"
GYM_PLUGIN = Path(__file__).with_name("gym_plugin.py")
END = "<|im_end|>"


# ----------------------------------------------------------------------------------------- unit: constructors


class V38(MultiTurnScheduler):  # ms-swift >= 3.8 built-ins: def __init__(self, *args, **kwargs)
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.acc = kwargs.get("acc_function", "default")


class GymStyle(MultiTurnScheduler):  # ms-swift's GYMScheduler: positional super().__init__(infer_engine, max_turns)
    def __init__(self, infer_engine, max_turns=None, tokenizer=None, **kwargs):
        super().__init__(infer_engine, max_turns, **kwargs)
        self.declared_tokenizer = tokenizer


class V37(MultiTurnScheduler):  # ms-swift 3.6/3.7: max_turns first
    def __init__(self, max_turns=None, *args, **kwargs):
        super().__init__(max_turns, *args, **kwargs)
        self.kwargs = kwargs


class Strict(MultiTurnScheduler):  # no **kwargs: only declared keywords may be passed
    def __init__(self, infer_engine=None, max_turns=None):
        super().__init__(infer_engine, max_turns)


class FakeEngine:
    tokenizer = "the-engine's-tokenizer"
    max_model_len = 99


@pytest.mark.parametrize("cls", [V38, GymStyle, V37, Strict, MultiTurnScheduler])
def test_every_constructor_form_gets_the_engine_and_max_turns(cls):
    engine = FakeEngine()
    s = construct_scheduler(cls, infer_engine=engine, max_turns=3, tokenizer="tok", gym_env="counting")
    assert s.max_turns == 3 and s.infer_engine is engine and s.engine is engine
    # tokenizer= only where __init__ declares it (ms-swift's rollout); else the engine's
    assert s.tokenizer == "the-engine's-tokenizer"
    assert getattr(s, "declared_tokenizer", "tok") == "tok"
    if cls is V37:
        assert "infer_engine" not in s.kwargs and s.kwargs["gym_env"] == "counting"  # as 3.7 built it
    assert s.max_model_len == 99  # ms-swift's __getattr__: what the scheduler lacks, its engine has
    with pytest.raises(AttributeError, match="nor has its infer_engine"):
        s.no_such_helper  # noqa: B018
    # a direct positional call of an old style still means max_turns
    assert MultiTurnScheduler(5).max_turns == 5 and MultiTurnScheduler(5).infer_engine is None


def test_a_constructor_that_cannot_take_the_arguments_names_them():
    class NoArgs(MultiTurnScheduler):
        def __init__(self):
            super().__init__()

    with pytest.raises(SchedulerError, match=r"NoArgs could not be built with max_turns, infer_engine"):
        construct_scheduler(NoArgs, infer_engine=FakeEngine(), max_turns=2)


def test_protocol_objects_as_ms_swift_builds_them():
    choice = ChatCompletionResponseChoice(
        index=0, message=ChatMessage(role="assistant", content="7", reasoning_content="3+4"), finish_reason="stop",
        logprobs={"content": [{"token_id": 5, "logprob": -0.5}, {"token_id": 6, "logprob": -0.25}]},
        token_ids=[5, 6])
    response = ChatCompletionResponse("tiny", [choice], None)  # ms-swift's positional (model, choices, usage)
    assert response.id.startswith("chatcmpl-") and response.choices[0].message.reasoning_content == "3+4"
    assert RolloutScheduler._extract_logprobs_from_choice(choice) == [-0.5, -0.25]
    assert MultiTurnScheduler._extract_logprobs_from_choice(
        ChatCompletionResponseChoice(0, ChatMessage("assistant", ""), "stop")) == []
    out = RolloutOutput(response=response, response_token_ids=[5, 6], response_loss_mask=[1, 1],
                        rollout_logprobs=[-0.5, -0.25])
    assert out.response_token_ids == [[5, 6]] and out.response_loss_mask == [[1, 1]]  # flat lists wrapped
    assert out.rollout_logprobs == [[-0.5, -0.25]] and out.messages is None and out.model_dump()["rollout_infos"] == {}
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert RolloutInferRequest.remove_response(messages) == "a" and messages == [{"role": "user", "content": "q"}]
    assert remove_response(messages) is None
    config = RequestConfig(max_tokens=8, stream=False, logprobs=True, top_logprobs=None, return_details=True)
    rollout = RequestConfig(max_tokens=12, temperature=0.7, top_p=0.9, top_k=5, min_p=0.0,
                            repetition_penalty=1.1, stop=["\n\n"], seed=3)
    resolved = resolve_config(config, rollout)  # None / empty = the rollout's setting
    assert (resolved.max_tokens, resolved.temperature, resolved.top_k, resolved.stop, resolved.seed) == (
        8, 0.7, 5, ["\n\n"], 3)
    with pytest.raises(SchedulerError, match="n == 1"):
        resolve_config(RequestConfig(n=2), rollout)


def test_end_of_turn_tokens_leave_a_continued_round_with_their_logprobs():
    ids, mask, logprobs = drop_tokens([1, 2, 9, 4, 5], [1, 1, 1, 0, 0], [-0.1, -0.2, -0.3], frozenset({9}))
    assert (ids, mask, logprobs) == ([1, 2, 4, 5], [1, 1, 0, 0], [-0.1, -0.2])


def test_error_streak_counts_groups_not_retries():
    streak = ErrorStreak(3)
    error = AttributeError("no attribute 'x' (request g0/0/1)")
    assert not streak.failed("g0/0", error) and not streak.failed("g0/0", error)  # a retry counts once
    assert not streak.failed("g1/0", AttributeError("no attribute 'x' (request g1/0/3)"))
    streak.succeeded()
    assert not streak.failed("g2/0", error) and not streak.failed("g3/0", ValueError("other"))  # starts over
    assert not streak.failed("g4/0", ValueError("other")) and streak.failed("g5/0", ValueError("other"))


def test_gym_env_reward_is_always_one_more_reward_as_ms_swift_adds_it():
    """ms-swift (GRPOTrainer._prepare_rewards): with use_gym_env, gym_reward is appended after the reward
    functions and the reward model, and reward_weights must hold one weight for it, the last (default 1.0)."""
    gym = 'rollout.gym_env="counting"'
    cfg = load_config(None, [gym, 'reward.reward_funcs=["format"]', "reward.reward_weights=[0.2, 1.0]"])
    assert cfg.reward.reward_funcs == ["format", "env_reward"] and cfg.reward.reward_weights == [0.2, 1.0]
    cfg = load_config(None, [gym, 'reward.reward_funcs=["format"]'])  # no weights: never dropped, 1.0 each
    assert cfg.reward.reward_funcs == ["format", "env_reward"] and cfg.reward.reward_weights == [1.0, 1.0]
    cfg = load_config(None, [gym])
    assert cfg.reward.reward_funcs == ["env_reward"] and cfg.reward.reward_weights == [1.0]
    # rollstream's own form: env_reward named where it stands, weights in that order
    cfg = load_config(None, [gym, 'reward.reward_funcs=["env_reward", "format"]', "reward.reward_weights=[1.0, 0.2]"])
    assert cfg.reward.reward_funcs == ["env_reward", "format"] and cfg.reward.reward_weights == [1.0, 0.2]
    # ms-swift orders [functions, reward model, gym]; here the reward model scores last: its weight moves
    cfg = load_config(None, [gym, 'reward.reward_funcs=["format"]', 'reward.reward_model="http://127.0.0.1:9/rm"',
                             "reward.reward_weights=[0.2, 0.5, 1.0]"])
    assert cfg.reward.reward_funcs == ["format", "env_reward"] and cfg.reward.reward_weights == [0.2, 1.0, 0.5]
    with pytest.raises(UserError, match=r"2 \(format, env_reward\).*use_gym_env the env's reward is one more"):
        load_config(None, [gym, 'reward.reward_funcs=["format"]', "reward.reward_weights=[1.0]"])
    plain = load_config(None, ['reward.reward_funcs=["format"]'])  # no env: nothing appended
    assert plain.reward.reward_funcs == ["format"]


# ----------------------------------------------------------------------------------------- real runs


def plugin(path: Path):
    """The plugin module as the run loads it (once per process, by path)."""
    load_plugins([str(SCHED_PLUGIN), str(GYM_PLUGIN)])
    return sys.modules[f"rollstream_plugin_{path.stem}"]


def run_config(tmp_path, name, *extra):
    return load_config("configs/demo.toml", [
        f"run.output_dir={json.dumps(str(tmp_path / name))}",
        f"run.name=sched-{name}-{uuid.uuid4().hex[:6]}",
        "run.max_steps=2",
        f"run.external_plugins=[{json.dumps(str(SCHED_PLUGIN))}, {json.dumps(str(GYM_PLUGIN))}]",
        "grpo.num_generations=4",
        "grpo.generation_batch_size=8",
        "grpo.per_device_train_batch_size=4",
        "grpo.max_completion_length=10",
        "rollout.max_model_len=256",
        *extra,
    ])


async def train_and_collect(cfg, engine, prompts):
    """A real run (in process, the shared engine); returns its result and the trajectories it sent. Every
    prompt the engine was given is appended to ``prompts`` (token ids)."""
    from rollstream import train

    transport = await connect("memory", run=cfg.run.name)
    try:
        result = await asyncio.wait_for(train.run_pipeline(cfg, engine=engine, transport=transport), 300)
        entries = await edge_tail(transport, "trajectories", 100_000)
    finally:
        await transport.close()
    assert result.exit_code == 0
    rows = [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    trajectories = [t for e in entries if isinstance(e, TrajectoryGroup) for t in e.trajectories]
    assert trajectories
    return result, rows, trajectories


@pytest.fixture
def spy_prompts(vllm_engine, monkeypatch):
    """The prompts the real engine samples from (the real generate runs; this only records its input)."""
    prompts: list[list[int]] = []
    generate = vllm_engine.generate

    async def recording(prompt_ids, **kwargs):
        prompts.append(list(prompt_ids))
        return await generate(prompt_ids, **kwargs)

    monkeypatch.setattr(vllm_engine, "generate", recording)
    return prompts


def decode(engine, ids) -> str:
    return engine.tokenizer.decode(list(ids), skip_special_tokens=False)


@pytest.mark.e2e
async def test_swift_continuation_scheduler_never_has_an_end_of_turn_inside_the_context(
        tmp_path, vllm_engine, spy_prompts):
    cfg = run_config(tmp_path, "continuation", 'rollout.multi_turn_scheduler="swift_tip_continuation"',
                     "rollout.max_turns=3")
    mod = plugin(SCHED_PLUGIN)
    mod.SEEN.clear()
    _, _, trajectories = await train_and_collect(cfg, vllm_engine, spy_prompts)
    [init] = mod.SEEN["init"]  # built once, by keyword, on the engine
    assert init == {"class": "SwiftTipContinuation", "max_turns": 3, "engine": "InferEngine",
                    "kwargs": ["infer_engine", "max_turns"]}  # by keyword; tokenizer only where declared
    tip = mod.SwiftTipContinuation.tips_prompt
    steps = mod.SEEN["step"]
    assert steps and all(s["ends_with_eos"] and s["logprobs"] == s["ids"] for s in steps)
    continued = [decode(vllm_engine, p) for p in spy_prompts if tip in decode(vllm_engine, p)]
    assert continued, "every reply that ends with EOS gets the tip and a second turn"
    for prompt in continued:  # the assistant message being continued holds no end-of-turn token
        assert END not in prompt.rsplit("<|im_start|>assistant\n", 1)[1], prompt
    tipped = [t for t in trajectories if tip in t.completion]
    assert tipped
    tip_ids = vllm_engine.tokenizer.encode(tip, add_special_tokens=False)
    for t in tipped:
        text = decode(vllm_engine, t.completion_token_ids())
        assert END not in text.split(tip)[0]  # trained as the engine saw it: no EOS before the tip
        assert list(t.completion_loss_mask()).count(0) == len(tip_ids)
        # the final structured conversation: the prompt, then one continued assistant message
        assert t.conversation[:-1] == t.messages and t.conversation[-1]["role"] == "assistant"
        assert t.conversation[-1]["content"] == t.completion and tip in t.completion


@pytest.mark.e2e
async def test_swift_run_override_returning_rollout_output_trains_both_turns(tmp_path, vllm_engine, spy_prompts):
    cfg = run_config(tmp_path, "output", 'rollout.multi_turn_scheduler="swift_rollout_output"')
    mod = plugin(SCHED_PLUGIN)
    mod.SEEN.clear()
    _, _, trajectories = await train_and_collect(cfg, vllm_engine, spy_prompts)
    assert all(r["model"] and r["response_id"].startswith("chatcmpl-") for r in mod.SEEN["run"])
    seconds = {tuple(p) for p in spy_prompts if "Once more." in decode(vllm_engine, p)}
    for t in trajectories:
        assert t.rollout_infos == {"num_turns": 2, "via": "RolloutOutput"}
        roles = [m["role"] for m in t.conversation]
        assert roles == ["user", "assistant", "user", "assistant"] and t.conversation[2]["content"] == "Once more."
        assert t.completion == t.conversation[-1]["content"] and t.messages == t.conversation[:1]
        ids, mask = list(t.completion_token_ids()), list(t.completion_loss_mask())
        text = decode(vllm_engine, ids)
        assert "<|im_start|>user\nOnce more.<|im_end|>\n<|im_start|>assistant\n" in text  # the template, mask 0
        gap = vllm_engine.tokenizer.encode("<|im_start|>user\nOnce more.", add_special_tokens=False)
        at = next(i for i in range(len(ids)) if ids[i:i + len(gap)] == gap)
        assert mask[at:at + len(gap)] == [0] * len(gap) and sum(mask) > 0
        first_reply_closed = ids[at - 1] == vllm_engine.tokenizer.eos_token_id
        if first_reply_closed:  # the trained layout is the engine's second prompt, token for token
            end = at + len(gap) + len(vllm_engine.tokenizer.encode("<|im_end|>\n<|im_start|>assistant\n",
                                                                    add_special_tokens=False))
            assert tuple(list(t.prompt_token_ids()) + ids[:end]) in seconds
        lps = t.completion_logprobs()
        assert all(lp < 0 for lp, m in zip(lps, mask) if m) and all(lp == 0 for lp, m in zip(lps, mask) if not m)


@pytest.mark.e2e
async def test_swift_new_turn_and_v37_schedulers_run_as_written(tmp_path, vllm_engine, spy_prompts):
    """Two constructor generations in two short runs: >= 3.8 new turns (GYMScheduler-style positional
    super().__init__, tokenizer declared), and 3.7 (max_turns first, step returns (request, extra))."""
    mod = plugin(SCHED_PLUGIN)
    for name, cls in (("swift_tool_new_turn", "SwiftToolNewTurn"), ("swift_v37_style", "SwiftV37Style")):
        cfg = run_config(tmp_path, name, f'rollout.multi_turn_scheduler="{name}"', "rollout.max_turns=2")
        mod.SEEN.clear()
        _, _, trajectories = await train_and_collect(cfg, vllm_engine, spy_prompts)
        [init] = mod.SEEN["init"]
        assert init["class"] == cls and init["max_turns"] == 2
        if cls == "SwiftToolNewTurn":
            assert init == {"class": cls, "max_turns": 2, "engine": "InferEngine", "tokenizer": True}
        else:
            assert init["kwargs"] == []  # built cls(max_turns=...) as 3.7 did; the engine assigned after
        inserted = "Tool result 1: 12" if cls == "SwiftToolNewTurn" else "Check it again."
        two_turns = [t for t in trajectories if t.rollout_infos["num_turns"] == 2]
        assert two_turns
        for t in two_turns:
            assert [m["role"] for m in t.conversation] == ["user", "assistant", "user", "assistant"]
            assert t.conversation[2]["content"] == inserted
            extra = {"tool_calls": 1} if cls == "SwiftToolNewTurn" else {"checked_at": 1}
            assert extra.items() <= t.rollout_infos.items()
            assert f"<|im_start|>user\n{inserted}<|im_end|>" in decode(vllm_engine, t.completion_token_ids())


@pytest.mark.e2e
async def test_gym_env_and_context_manager_with_ms_swift_keys_and_weights(tmp_path, vllm_engine, spy_prompts):
    cfg = run_config(tmp_path, "gym", 'rollout.gym_env="counting"', 'rollout.context_manager="recording"',
                     "rollout.env_config={done_at = 2}", "rollout.max_turns=3",
                     'reward.reward_funcs=["format"]', "reward.reward_weights=[0.2, 1.0]")
    assert cfg.reward.reward_funcs == ["format", "env_reward"]
    gym = plugin(GYM_PLUGIN)
    gym.MANAGED.clear()
    _, rows, trajectories = await train_and_collect(cfg, vllm_engine, spy_prompts)
    assert all("rewards/env_reward/mean" in r and "rewards/format/mean" in r for r in rows)
    for t in trajectories:
        infos = t.rollout_infos
        assert infos["trajectory_id"] == t.request_id  # ms-swift: the request's id
        steps = len(infos["step_rewards"])
        assert steps == infos["num_turns"] and 1 <= steps <= 2
        # ms-swift's trajectory_info: the reset's info, then each step's; rollstream's alias kept
        assert infos["trajectory_info"][0] == {"uuid": t.request_id}
        assert infos["trajectory_info"][1:] == [{"reply": m["content"]} for m in t.conversation
                                               if m["role"] == "assistant"]
        assert [e["info"] for e in infos["trajectory_infos"]] == infos["trajectory_info"]
        assert t.conversation[0] == {"role": "system", "content": "You count."}
        assert t.request_id in gym.MANAGED  # the context manager saw each trajectory by its id


@pytest.mark.e2e
async def test_a_scheduler_failing_on_every_group_stops_the_run_with_its_error(tmp_path, vllm_engine):
    from rollstream import train

    cfg = run_config(tmp_path, "fails", 'rollout.multi_turn_scheduler="swift_always_fails"',
                     "run.max_consecutive_errors=2")
    with pytest.raises(SchedulerFailed, match="missing_helper") as raised:
        await asyncio.wait_for(train.run_pipeline(cfg, engine=vllm_engine), 120)
    assert "2 consecutive prompt groups" in str(raised.value)
    assert isinstance(raised.value, UserError)  # the CLI prints it on one line and exits 2

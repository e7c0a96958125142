"""The tool_calling scheduler (TRL's ``tools=`` / ``environment_factory=``) on a scripted token engine (a fake
of the TokenBackend protocol) with the tiny model's real tokenizer and real chat templates (Qwen2.5, Qwen3,
Llama 3.1, as TRL ships them): parsing, tool execution and failures, token layout, the environment pool,
what reaches the rewards. The same scheduler in real runs on vLLM: tests/test_agent_e2e.py."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from test_schedulers import ScriptedBackend, parts
from transformers import AutoTokenizer

from config import config_from_dict
from data.chat import ChatTemplate
from pipeline.records import Trajectory, pack_f32, pack_i32
from rewards.environments import EnvironmentView
from rewards.scoring import RewardScorer, reward_kwargs
from schedulers import (
    RequestConfig,
    RolloutInferRequest,
    ToolCallingScheduler,
    ToolSetupError,
    registered_tools,
)
from schedulers.engine import InferEngine, RequestContext, request_context
from schedulers.tool_calling import environment_tools, tool_schema

TEMPLATES = Path(__file__).parent / "data_templates"
PLUGIN = "trl_tools"
sys.path.insert(0, str(Path(__file__).parent / "plugins"))
import trl_tools


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


CALL = '<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def engine(tokenizer, replies, template="qwen2_5", max_model_len=8192):
    chat = ChatTemplate(template=(TEMPLATES / f"{template}.jinja").read_text())
    return InferEngine(ScriptedBackend(tokenizer, replies), max_model_len=max_model_len, chat=chat)


def scheduler(eng, **kwargs):
    kwargs.setdefault("tools", [f"{PLUGIN}:add", f"{PLUGIN}:multiply", f"{PLUGIN}:divide"])
    kwargs.setdefault("tool_timeout_s", 5.0)
    kwargs.setdefault("max_completion_length", 200)
    return ToolCallingScheduler(infer_engine=eng, **kwargs)


async def run(sched, messages, data_dict=None, budget=200):
    request = RolloutInferRequest(messages=messages, data_dict=data_dict or {}, uuid="r0", tools=sched.tool_schemas)
    with request_context(RequestContext(request_id="r0", config=RequestConfig(max_tokens=budget, seed=1),
                                        tools=sched.tool_schemas)):
        return await sched.run(request, RequestConfig(max_tokens=budget, seed=1))


QUESTION = [{"role": "user", "content": "What is 3+4?"}]


async def test_a_tool_call_is_run_and_the_reply_trained_token_exact(tokenizer):
    eng = engine(tokenizer, [CALL.format(name="add", args='{"a": 3, "b": 4}'), "It is 7."])
    sched = scheduler(eng)
    result = await run(sched, list(QUESTION))
    backend = eng.backend
    # The second turn's prompt is the first's plus exactly the trained ids up to it: nothing re-tokenized.
    first, second = backend.prompts
    p = parts(result, eng)
    assert second == first + p.completion_ids[: len(second) - len(first)]
    assert p.prompt_ids == first
    # model tokens mask 1, the tool message's template tokens mask 0
    reply1 = tokenizer.encode(CALL.format(name="add", args='{"a": 3, "b": 4}'), add_special_tokens=False)
    gap = second[len(first) + len(reply1) + 1:]
    assert tokenizer.decode(gap) == "\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert p.loss_mask == [1] * (len(reply1) + 1) + [0] * len(gap) + [1] * (len(p.completion_ids) - len(second) + len(first))
    assert sum(p.loss_mask) == sum(1 for lp in p.logprobs if lp != 0.0)
    messages = result["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert messages[1]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 3, "b": 4}}
    assert messages[2] == {"role": "tool", "name": "add", "content": "7"}
    assert p.completion == "It is 7."
    infos = result["rollout_infos"]
    assert (infos["num_tool_calls"], infos["num_tool_failures"], infos["template_rewrites"]) == (1, 0, 0)
    # every prompt showed the tools (their schemas from the docstrings, by transformers' get_json_schema)
    assert "Add two integers." in tokenizer.decode(first) and '"a"' in tokenizer.decode(first)


async def test_async_tool_several_calls_and_failures_are_answered_as_trl_does(tokenizer):
    calls = "\n".join([CALL.format(name="multiply", args='{"a": 6, "b": 7}'),
                       CALL.format(name="divide", args='{"a": 1, "b": 0}'),
                       CALL.format(name="nope", args="{}"),
                       CALL.format(name="add", args='{"a": 1}')])
    eng = engine(tokenizer, [calls, "done"])
    result = await run(scheduler(eng, max_completion_length=1000), list(QUESTION), budget=1000)
    tool_messages = [m for m in result["messages"] if m["role"] == "tool"]
    assert [m["content"] for m in tool_messages] == [
        "42",
        "{'error': 'division by zero'}",
        "{'error': 'Tool nope not found.'}",
        "{'error': \"add() missing 1 required positional argument: 'b'\"}",
    ]
    assert (result["rollout_infos"]["num_tool_calls"], result["rollout_infos"]["num_tool_failures"]) == (4, 3)


async def test_a_malformed_call_ends_the_episode_as_text_and_counts_as_a_failed_call(tokenizer):
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}\n</tool_call>'
    eng = engine(tokenizer, [bad])
    result = await run(scheduler(eng), list(QUESTION))
    assert len(eng.backend.prompts) == 1
    assert result["messages"][-1] == {"role": "assistant", "content": bad}
    assert (result["rollout_infos"]["num_tool_calls"], result["rollout_infos"]["num_tool_failures"]) == (1, 1)


async def test_a_hanging_tool_is_bounded(tokenizer):
    eng = engine(tokenizer, [CALL.format(name="hang", args='{"seconds": 30}'), "ok"])
    sched = scheduler(eng, tools=[f"{PLUGIN}:hang"], tool_timeout_s=0.5)
    try:
        result = await asyncio.wait_for(run(sched, list(QUESTION)), timeout=20)
    finally:
        trl_tools.RELEASE_HANG.set()  # frees the pool thread
        await sched.shutdown()
    assert result["messages"][2]["content"] == "{'error': 'tool hang timed out after 0.5 s'}"
    assert result["rollout_infos"]["num_tool_failures"] == 1


async def test_max_tool_calling_iterations_and_the_completion_budget(tokenizer):
    call = CALL.format(name="add", args='{"a": 1, "b": 1}')
    eng = engine(tokenizer, [call] * 5)
    result = await run(scheduler(eng, max_tool_calling_iterations=2, max_completion_length=1000), list(QUESTION),
                       budget=1000)
    assert len(eng.backend.prompts) == 3 and result["rollout_infos"]["num_tool_calls"] == 2
    # a budget that the tool result would overflow: the episode ends with the call, the result dropped (TRL)
    eng = engine(tokenizer, [call] * 5)
    reply = len(tokenizer.encode(call, add_special_tokens=False)) + 1
    result = await run(scheduler(eng, max_completion_length=reply + 3), list(QUESTION))
    assert len(eng.backend.prompts) == 1 and result["messages"][-1]["role"] == "assistant"
    assert sum(len(r) for r in result["response_token_ids"]) == reply


@pytest.mark.parametrize("template, call, rewrites", [
    # (the tiny tokenizer's EOS is <|im_end|>: the scripted reply writes Llama's end-of-turn itself)
    ("llama3_1", '{"name": "add", "parameters": {"a": 3, "b": 4}}<|eot_id|>', None),
    # Qwen3 keeps the reasoning of the turns since the last user message: the history renders as sampled
    ("qwen3", "<think>\nadd them\n</think>\n\n" + CALL.format(name="add", args='{"a": 3, "b": 4}'), 0),
    # a call written compactly re-renders otherwise: the sampled tokens stay, the rewrite is counted
    ("qwen2_5", '<tool_call>{"name":"add","arguments":{"a":3,"b":4}}</tool_call>', 1),
])
async def test_other_template_families(tokenizer, template, call, rewrites):
    eng = engine(tokenizer, [call, "7"], template=template)
    result = await run(scheduler(eng), list(QUESTION))
    assert result["messages"][1]["tool_calls"][0]["function"]["arguments"] == {"a": 3, "b": 4}
    assert result["messages"][2]["content"] == "7"
    first, second = eng.backend.prompts
    p = parts(result, eng)
    assert second == first + p.completion_ids[: len(second) - len(first)]
    if rewrites is not None:
        assert result["rollout_infos"]["template_rewrites"] == rewrites


async def test_environment_factory_reset_tools_pool_and_what_the_rewards_see(tokenizer):
    eng = engine(tokenizer, [CALL.format(name="increment", args='{"step": 3}'), "done",
                             CALL.format(name="increment", args='{"step": 1}'), "done"])
    sched = scheduler(eng, tools=[], environment_factory=f"{PLUGIN}:CounterEnv")
    assert [t["function"]["name"] for t in sched.tool_schemas] == ["increment"]
    first = await run(sched, [{"role": "user", "content": "Count."}], data_dict={"target": 3})
    second = await run(sched, [{"role": "user", "content": "Count."}], data_dict={"target": 2})
    # reset(**row)'s observation is appended to the prompt; one instance reused (TRL: built once, reset often)
    assert first["prompt_messages"] == [{"role": "user", "content": "Count. Reach 3."}]
    assert sched._created == 1 and sched._pool[0].resets == 2
    env = sched._pool[0]
    await sched.shutdown()  # the worker's close: every pooled environment closed once
    assert env.closed == 1 and not sched._pool
    envs = [first["rollout_infos"]["environment"], second["rollout_infos"]["environment"]]
    assert envs[0]["attributes"]["count"] == 3 and envs[0]["__get_reward__"] == 1.0
    assert envs[1]["__get_reward__"] == -1.0 and "lock" in envs[1]["skipped"]
    view = EnvironmentView(envs[0])
    assert (view.reward, view.get_reward()) == (1.0, 1.0)
    with pytest.raises(AttributeError, match="not plain data"):
        view.lock  # noqa: B018
    with pytest.raises(AttributeError, match="no such attribute"):
        view.increment  # noqa: B018


def _trajectory(i, infos, eng):
    ids = eng.tokenizer.encode("done", add_special_tokens=False)
    return Trajectory(prompt_id="e0:1", attempt=0, request_id=f"e0:1/0/{i}", generation_batch=0,
                      prompt_ids=pack_i32([1]), completion_ids=pack_i32(ids), logprobs=pack_f32([0.0] * len(ids)),
                      messages=[{"role": "user", "content": "Count."}], completion="done", rollout_infos=infos,
                      policy_version=0, max_policy_version=0)


async def test_rewards_get_environments_and_the_env_reward_as_trl(tokenizer, tmp_path):
    eng = engine(tokenizer, [CALL.format(name="increment", args='{"step": 3}'), "done", "done"])
    sched = scheduler(eng, tools=[], environment_factory=f"{PLUGIN}:CounterEnv")
    results = [await run(sched, [{"role": "user", "content": "Count."}], data_dict={"target": 3}) for _ in range(2)]
    requests = [[_trajectory(i, r["rollout_infos"], eng)] for i, r in enumerate(results)]
    _, kwargs = reward_kwargs(requests)
    assert [e.count for e in kwargs["environments"]] == [3, 0]
    plugin = tmp_path / "env_reward.py"
    plugin.write_text(
        "from rewards import orms\n"
        "def env_reward_attr(completions, environments, **kwargs):\n"
        "    return [env.reward for env in environments]\n"
        "orms['env_reward_attr'] = env_reward_attr\n")
    cfg = config_from_dict({"run": {"external_plugins": [str(plugin)]},
                            "rollout": {"environment_factory": f"{PLUGIN}:CounterEnv"},
                            "reward": {"reward_funcs": ["env_reward_attr"]}})
    from pipeline.plugins import load_plugins

    load_plugins(cfg.run.external_plugins)
    scorer = RewardScorer(cfg)
    try:
        scored = await scorer.score_requests(requests)
    finally:
        await scorer.close()
    assert [s.rewards for s in scored] == [{"env_reward_attr": 1.0, "CounterEnv": 1.0},
                                           {"env_reward_attr": 0.0, "CounterEnv": -1.0}]
    assert [s.reward for s in scored] == [2.0, -1.0]


def test_setup_errors_name_the_setting_and_the_fix(tokenizer):
    eng = engine(tokenizer, [])
    with pytest.raises(ToolSetupError, match="module:name"):
        scheduler(eng, tools=["add"])
    with pytest.raises(ToolSetupError, match="cannot import 'no_such_module'"):
        scheduler(eng, tools=["no_such_module:f"])

    def undocumented(x):
        return x

    registered_tools["undocumented"] = undocumented
    try:
        with pytest.raises(ToolSetupError, match="Google-style docstring"):
            scheduler(eng, tools=["undocumented"])
    finally:
        del registered_tools["undocumented"]
    registered_tools["add_again"] = trl_tools.add
    try:  # a plugin's registered name works as "module:function" does
        assert scheduler(eng, tools=["add_again"]).tool_schemas == [tool_schema(trl_tools.add)]
    finally:
        del registered_tools["add_again"]
    assert [m.__name__ for m in environment_tools(trl_tools.CounterEnv())] == ["increment"]


async def test_a_template_without_tool_calls_is_refused_on_the_first_reply(tokenizer):
    eng = InferEngine(ScriptedBackend(tokenizer, ["7"]), max_model_len=256)  # the tiny model's own ChatML
    with pytest.raises(ToolSetupError, match="tool-call format"):
        await run(scheduler(eng), list(QUESTION))


def test_trl_names_as_flags_and_keys_select_the_tool_calling_scheduler():
    from config import ConfigError, load_config, swift_args

    flags = swift_args.parse_flags(["--tools", f"{PLUGIN}:add", "--environment_factory", f"{PLUGIN}:CounterEnv",
                                    "--max_tool_calling_iterations", "3", "--reward_funcs", "accuracy"])
    cfg = load_config(None, [], swift=flags)
    r = cfg.rollout
    assert (r.tools, r.environment_factory, r.max_tool_calling_iterations) == (
        [f"{PLUGIN}:add"], f"{PLUGIN}:CounterEnv", 3)
    assert r.multi_turn_scheduler == "tool_calling"
    # an environment that owns its reward may be the only reward source (TRL); gym envs and TRL's do not mix
    assert config_from_dict({"rollout": {"environment_factory": f"{PLUGIN}:CounterEnv"}}).reward.reward_funcs == []
    with pytest.raises(ConfigError, match="no reward source"):
        config_from_dict({"rollout": {"tools": [f"{PLUGIN}:add"]}})
    with pytest.raises(ConfigError, match="not both"):
        config_from_dict({"rollout": {"tools": [f"{PLUGIN}:add"], "use_gym_env": True, "gym_env": "guess_number"},
                          "reward": {"reward_funcs": ["accuracy"]}})

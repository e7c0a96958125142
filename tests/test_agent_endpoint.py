"""The agent endpoint and the ``agent`` scheduler (``rollout.agent``) on a scripted token engine (a fake of the
TokenBackend protocol) with the tiny model's tokenizer and a tool-calling chat template, driven by the real
``openai`` client and by verifiers' token route over HTTP: sessions and keys, enforced sampling, records and
branches, failures. The same in real runs on vLLM: tests/test_agent_e2e.py."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from test_schedulers import ScriptedBackend, parts
from transformers import AutoTokenizer

from data.chat import ChatTemplate
from schedulers import AgentFailed, AgentScheduler, RequestConfig, RolloutInferRequest, registered_agents
from schedulers.agent_endpoint import Call, episode_records
from schedulers.engine import InferEngine, RequestContext, request_context
from tinymodels.agent import AGENT_CHAT_TEMPLATE

ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
QUESTION = [{"role": "user", "content": "What is 3+4?"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


class RecordingBackend(ScriptedBackend):
    """Also records the sampling settings of every call."""

    def __init__(self, tokenizer, replies):
        super().__init__(tokenizer, replies)
        self.sampling: list[dict] = []

    async def generate(self, prompt_ids, *, request_id, seed, max_tokens, **sampling):
        self.sampling.append({"max_tokens": max_tokens, "seed": seed, **sampling})
        return await super().generate(prompt_ids, request_id=request_id, seed=seed, max_tokens=max_tokens)


def scheduler(tokenizer, replies, agent, **kwargs):
    engine = InferEngine(RecordingBackend(tokenizer, replies), max_model_len=1024,
                         chat=ChatTemplate(template=AGENT_CHAT_TEMPLATE))
    registered_agents["test_agent"] = agent
    return AgentScheduler(infer_engine=engine, agent="test_agent", max_completion_length=200, **kwargs)


async def run(sched, messages=QUESTION, data_dict=None):
    request = RolloutInferRequest(messages=list(messages), data_dict=data_dict or {"solution": "7"}, uuid="r0")
    config = RequestConfig(max_tokens=200, seed=7, temperature=0.9, top_p=0.95)
    try:
        with request_context(RequestContext(request_id="r0", config=config)):
            return await sched.run(request, config)
    finally:
        await sched.shutdown()


async def tool_agent(base_url, api_key, row):
    """An agent as people write them with the openai client: call, run the tool, call again."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = list(row["prompt"])
    while True:
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[ADD],
                                                     temperature=0.0, max_tokens=1000)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return float(message.content.strip() == row["solution"])
        for call in message.tool_calls:
            args = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})


async def test_an_openai_agent_with_a_tool_trains_as_one_token_exact_sequence(tokenizer):
    sched = scheduler(tokenizer, [CALL, "7"], tool_agent)
    records = await run(sched)
    backend = sched.infer_engine.backend
    assert len(records) == 1 and records[0]["rollout_infos"] == {
        "num_turns": 2, "branches": 1, "rewards": {"agent": 1.0}, "call_seeds": backend.seeds}
    assert backend.seeds[0] == 7 and backend.seeds[1] != backend.seeds[0]  # the request's seed, offset per call
    p = parts(records[0], sched.infer_engine)
    first, second = backend.prompts
    # the second call's prompt extends the first call's prompt and sampled reply token for token
    assert p.prompt_ids == first and second == first + p.completion_ids[: len(second) - len(first)]
    reply = tokenizer.encode(CALL, add_special_tokens=False) + [tokenizer.eos_token_id]
    assert p.completion_ids[: len(reply)] == reply and p.loss_mask[: len(reply)] == [1] * len(reply)
    gap = len(second) - len(first) - len(reply)
    assert p.loss_mask[len(reply): len(reply) + gap] == [0] * gap and sum(p.loss_mask) == len(reply) + 2
    assert tokenizer.decode(first).startswith("<|im_start|>system\nTools: add")  # the agent's tools rendered
    assert p.completion == "7" and [m["role"] for m in p.conversation] == ["user", "assistant", "tool", "assistant"]
    # the trainer's sampling, not the agent's (temperature 0, max_tokens 1000); the budget shrinks per call
    assert [s["temperature"] for s in backend.sampling] == [0.9, 0.9]
    assert backend.sampling[0]["max_tokens"] == 200 and backend.sampling[1]["max_tokens"] == 200 - len(reply)


async def test_streaming_text_completions_and_the_token_route(tokenizer):
    async def agent(base_url, api_key, row):
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        stream = await client.chat.completions.create(model="policy", messages=row["prompt"], tools=[ADD],
                                                      stream=True)
        chunks = [chunk async for chunk in stream]
        calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or []) if c.choices]
        assert calls[0].function.name == "add" and json.loads(calls[0].function.arguments) == {"a": 3, "b": 4}
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        text = await client.completions.create(model="policy", prompt="2+2=", max_tokens=5)
        assert text.choices[0].text == "4"
        models = await client.models.list()
        assert models.data[0].id == "policy"
        root = base_url.removesuffix("/v1")
        async with httpx.AsyncClient() as http:  # verifiers' route: token ids in, ids and one logprob each out
            ids = tokenizer.encode("hi", add_special_tokens=False)
            answer = (await http.post(f"{root}/inference/v1/generate", headers={"Authorization": f"Bearer {api_key}"},
                                      json={"model": "policy", "token_ids": ids,
                                            "sampling_params": {"max_tokens": 8, "logprobs": 1}})).json()
            choice = answer["choices"][0]
            assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
            assert choice["logprobs"]["content"][0]["token"] == f"token_id:{choice['token_ids'][0]}"
            wrong = await http.post(f"{root}/inference/v1/generate", headers={"Authorization": "Bearer nope"},
                                    json={"token_ids": ids})
            assert wrong.status_code == 401

    sched = scheduler(tokenizer, [CALL, "4", "ok"], agent)
    records = await run(sched)
    # three calls, none extending the one before: three branches, each trained once
    assert len(records) == 3 and all(r["rollout_infos"]["branches"] == 3 for r in records)
    assert "rewards" not in records[0]["rollout_infos"]


async def test_another_episodes_key_is_refused(tokenizer):
    async def agent(base_url, api_key, row):
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key + "x", max_retries=0)
        await client.chat.completions.create(model="policy", messages=row["prompt"])

    with pytest.raises(AgentFailed, match="AuthenticationError"):
        await run(scheduler(tokenizer, ["7"], agent))


async def test_a_rewritten_history_starts_a_branch(tokenizer):
    async def agent(base_url, api_key, row):
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        first = await client.chat.completions.create(model="policy", messages=row["prompt"])
        # the agent summarizes instead of echoing the reply: the history no longer extends what was sampled
        rewritten = [{"role": "user", "content": "Earlier you said: " + first.choices[0].message.content}]
        await client.chat.completions.create(model="policy", messages=rewritten)
        return 0.5

    sched = scheduler(tokenizer, ["8", "7"], agent)
    records = await run(sched)
    assert [r["rollout_infos"]["branches"] for r in records] == [2, 2]
    assert records[1]["prompt_token_ids"] == sched.infer_engine.backend.prompts[1]
    assert all(r["rollout_infos"]["rewards"] == {"agent": 0.5} for r in records)


@pytest.mark.parametrize("agent, match", [
    ("hangs", "timed out after 0.5 s"),
    ("raises", "raised ValueError: broken"),
    ("returns_text", "returned str"),
    ("no_call", "made no call"),
])
async def test_failing_agents_are_bounded_and_loud(tokenizer, agent, match):
    async def hangs(base_url, api_key, row):
        await asyncio.Event().wait()

    async def raises(base_url, api_key, row):
        raise ValueError("broken")

    async def returns_text(base_url, api_key, row):
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        await client.chat.completions.create(model="policy", messages=row["prompt"])
        return "good"

    async def no_call(base_url, api_key, row):
        return 1.0

    agents = {"hangs": hangs, "raises": raises, "returns_text": returns_text, "no_call": no_call}
    sched = scheduler(tokenizer, ["7"], agents[agent], agent_timeout_s=0.5)
    with pytest.raises(AgentFailed, match=match):
        await run(sched)
    assert not sched.endpoint.sessions  # the episode's key no longer opens anything


def test_episode_records_split_and_continue():
    calls = [Call([1, 2], [3, 4], [-0.1, -0.2], "stop", (0, 0)),
             Call([1, 2, 3, 4, 5], [6], [-0.3], "stop", (0, 1)),  # extends: 5 is the template's, mask 0
             Call([9, 2], [7], [-0.4], "length", (1, 1))]         # does not: a new branch
    records = episode_records(calls, [{"role": "user", "content": "q"}])
    assert [r["prompt_token_ids"] for r in records] == [[1, 2], [9, 2]]
    assert records[0]["response_token_ids"] == [[3, 4, 5], [6]]
    assert records[0]["response_loss_mask"] == [[1, 1, 0], [1]]
    assert records[0]["policy_versions"] == (0, 1) and records[1]["finish_reason"] == "length"

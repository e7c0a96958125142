"""The verifiers bridge (compat/verifiers_bridge.py) running a verifiers 0.4 environment written in its own style
(tests/verifiers_env: in-memory sums, an exact-answer ``@vf.reward``) unchanged, in its own venv, against
rollstream's agent endpoint over a scripted engine: verifiers' train client renders the prompt, calls the
endpoint's token route through a per-episode session URL, and the bridge hands back token-exact branches and
verifiers' own reward. Needs ``make venv-verifiers`` (skipped, saying so, without it)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
from test_schedulers import ScriptedBackend
from transformers import AutoTokenizer

from schedulers.agent_endpoint import AgentEndpoint
from schedulers.engine import InferEngine, RequestContext
from schedulers.protocol import RequestConfig

ROOT = Path(__file__).resolve().parent.parent
BRIDGE_PYTHON = ROOT / ".venv-verifiers" / "bin" / "python"
BRIDGE = ROOT / "compat" / "verifiers_bridge.py"
ENV_ID = "rollstream-add"  # tests/verifiers_env, installed into .venv-verifiers by make venv-verifiers

pytestmark = pytest.mark.skipif(not BRIDGE_PYTHON.exists(),
                                reason=".venv-verifiers is absent: run `make venv-verifiers` to test the bridge")


class SumBackend(ScriptedBackend):
    """Answers the sum the prompt asks (or that sum plus ``offset``), so concurrent episodes get their own."""

    def __init__(self, tokenizer, offset: int = 0) -> None:
        super().__init__(tokenizer, [])
        self.offset = offset

    async def generate(self, prompt_ids, *, request_id, seed, max_tokens, **sampling):
        a, b = re.findall(r"What is (\d+)\+(\d+)\?", self.tokenizer.decode(prompt_ids))[-1]
        self.replies = [str(int(a) + int(b) + self.offset)]
        return await super().generate(prompt_ids, request_id=request_id, seed=seed, max_tokens=max_tokens)


class BridgeProcess:
    """The bridge as rollstream's rollout worker runs it: a subprocess spoken to in JSON lines."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.pending: dict[int, asyncio.Future] = {}
        self.next_id = 0
        self.reading = asyncio.create_task(self._read())

    @classmethod
    async def start(cls, knobs: dict) -> tuple[BridgeProcess, dict]:
        process = await asyncio.create_subprocess_exec(
            str(BRIDGE_PYTHON), str(BRIDGE), "--env", ENV_ID, "--taskset-json", json.dumps(knobs),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=64 * 1024 * 1024)
        ready = json.loads(await asyncio.wait_for(process.stdout.readline(), timeout=180))
        return cls(process), ready

    async def _read(self) -> None:
        while line := await self.process.stdout.readline():
            answer = json.loads(line)
            future = self.pending.pop(answer["id"], None)
            if future is not None:
                future.set_result(answer)

    def send(self, request: dict) -> tuple[int, asyncio.Future]:
        self.next_id += 1
        future = self.pending[self.next_id] = asyncio.get_running_loop().create_future()
        self.process.stdin.write((json.dumps({"id": self.next_id, **request}) + "\n").encode())
        return self.next_id, future

    async def ask(self, request: dict, timeout_s: float = 180) -> dict:
        _, future = self.send(request)
        await self.process.stdin.drain()
        return await asyncio.wait_for(future, timeout=timeout_s)

    async def close(self) -> int:
        self.process.stdin.write(b'{"op": "close"}\n')
        await self.process.stdin.drain()
        code = await asyncio.wait_for(self.process.wait(), timeout=60)
        self.reading.cancel()
        return code


@pytest.fixture(scope="module")
async def bridge():
    process, ready = await BridgeProcess.start({"num_tasks": 4, "seed": 1})
    assert ready["ready"] is True and ready["verifiers"] == "0.4.0", ready
    yield process
    assert await process.close() == 0  # "close" exits cleanly with nothing in flight


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


async def endpoint_for(tokenizer, offset: int = 0) -> AgentEndpoint:
    endpoint = AgentEndpoint(InferEngine(SumBackend(tokenizer, offset), max_model_len=256))
    await endpoint.start()
    return endpoint


def run_request(endpoint: AgentEndpoint, session, task: dict, tiny_model_dir: Path) -> dict:
    return {"op": "run", "task": task, "base_url": endpoint.session_url(session), "model": endpoint.model_name,
            "renderer_model_name": str(tiny_model_dir),
            "sampling": {"temperature": 1.0, "max_tokens": 16, "top_p": 1.0, "seed": 3}}


async def test_tasks_come_back_as_wire_data_and_chat_prompts(bridge):
    answer = await bridge.ask({"op": "tasks"})
    assert len(answer["tasks"]) == 4 and [t["idx"] for t in answer["tasks"]] == [0, 1, 2, 3]
    for task, prompt in zip(answer["tasks"], answer["prompts"]):
        a, b = map(int, re.fullmatch(r"What is (\d+)\+(\d+)\?", task["prompt"]).groups())
        assert task["answer"] == str(a + b) and prompt == [{"role": "user", "content": task["prompt"]}]
    assert len((await bridge.ask({"op": "tasks", "limit": 2}))["tasks"]) == 2


async def test_an_episode_trains_on_exactly_the_tokens_the_endpoint_sampled(bridge, tokenizer, tiny_model_dir):
    task = (await bridge.ask({"op": "tasks", "limit": 1}))["tasks"][0]
    endpoint = await endpoint_for(tokenizer)
    session = endpoint.open(RequestContext(request_id="r0", config=RequestConfig(max_tokens=64, seed=7)), 64)
    try:
        answer = await bridge.ask(run_request(endpoint, session, task, tiny_model_dir))
    finally:
        endpoint.close_session(session)
        await endpoint.close()
    assert answer["ok"] is True and answer["errors"] == [], answer["errors"]
    (trace,) = answer["traces"]
    (call,) = session.calls  # one turn: the null harness's chat loop ends on a reply without tool calls
    (branch,) = trace["branches"]
    # verifiers rendered the prompt with the model's own chat template, and trains on prompt + sampled ids
    chat = tokenizer.apply_chat_template([{"role": "user", "content": task["prompt"]}], add_generation_prompt=True,
                                         tokenize=False)
    assert call.prompt_ids == tokenizer.encode(chat, add_special_tokens=False)
    assert branch["token_ids"] == call.prompt_ids + call.completion_ids
    assert branch["sampled_mask"] == [0] * len(call.prompt_ids) + [1] * len(call.completion_ids)
    assert branch["logprobs"] == [0.0] * len(call.prompt_ids) + call.logprobs
    assert call.completion_ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(call.completion_ids, skip_special_tokens=True) == task["answer"]
    # verifiers' reward, computed by the environment's own @vf.reward
    assert trace["reward"] == 1.0 and trace["rewards"] == {"correct": 1.0} and trace["weights"] == {"correct": 1.0}
    assert trace["metrics"]["reply_chars"] == len(task["answer"])
    assert trace["stop"] == "agent_completed" and trace["truncated"] is False and trace["num_turns"] == 1
    assert [m["role"] for m in trace["messages"]] == ["user", "assistant"]


async def test_concurrent_episodes_each_get_their_own_answer_and_reward(bridge, tokenizer, tiny_model_dir):
    tasks = (await bridge.ask({"op": "tasks"}))["tasks"][:3]
    right, wrong = await endpoint_for(tokenizer), await endpoint_for(tokenizer, offset=1)
    jobs, sessions = [], []
    for i, task in enumerate(tasks):
        for endpoint in (right, wrong):
            session = endpoint.open(RequestContext(request_id=f"r{i}", config=RequestConfig(seed=i)), 64)
            sessions.append(session)
            jobs.append(bridge.ask(run_request(endpoint, session, task, tiny_model_dir)))
    try:
        answers = await asyncio.gather(*jobs)
    finally:
        await right.close()
        await wrong.close()
    assert all(a["ok"] for a in answers), [a["errors"] for a in answers]
    assert [a["traces"][0]["reward"] for a in answers] == [1.0, 0.0] * len(tasks)
    for answer, session in zip(answers, sessions):  # each episode's tokens came through its own session
        (call,) = session.calls
        assert answer["traces"][0]["branches"][0]["token_ids"] == call.prompt_ids + call.completion_ids


async def test_a_failing_run_answers_its_id_and_the_bridge_lives_on(bridge, tokenizer, tiny_model_dir):
    task = (await bridge.ask({"op": "tasks", "limit": 1}))["tasks"][0]
    missing = await bridge.ask({"op": "run", "task": task})
    assert missing["ok"] is False and "base_url" in missing["errors"][0]
    endpoint = await endpoint_for(tokenizer)
    session = endpoint.open(RequestContext(request_id="r0", config=RequestConfig()), 64)
    request = run_request(endpoint, session, task, tiny_model_dir)
    try:
        # another episode's (here: no) key: the endpoint refuses the call, verifiers records the provider error
        refused = await bridge.ask({**request, "base_url": request["base_url"].replace(session.key, "nope")})
        assert refused["ok"] is False and refused["traces"] == [] and not session.calls
        assert any("401" in e or "session" in e for e in refused["errors"]), refused["errors"]
        unknown = await bridge.ask({"op": "dance"})
        assert unknown["ok"] is False and "unknown op" in unknown["errors"][0]
        ident, cancelled = bridge.send(request)
        bridge.send({"op": "cancel", "id": ident})  # read right after the run: it is cancelled before any call
        cancelled = await asyncio.wait_for(cancelled, timeout=60)
        assert cancelled["ok"] is False and cancelled["errors"] == ["Cancelled: the run was cancelled"]
        assert not session.calls
        fine = await bridge.ask(request)
    finally:
        await endpoint.close()
    assert fine["ok"] is True and fine["traces"][0]["reward"] == 1.0 and len(session.calls) == 1


SHARED_TURN = '''
import json, sys
sys.path.insert(0, sys.argv[1])
import verifiers.v1 as vf
from verifiers.v1.trace import AgentInfo, Trace, TraceTask
from verifiers_bridge import trace_branches

def node(parent, role, ids, mask, logprobs=()):
    return vf.MessageNode(parent=parent, message={"role": role, "content": "x"}, token_ids=ids, mask=mask,
                          logprobs=list(logprobs), sampled=any(mask))

# turn 1 (node 1) is shared; the histories then diverge (nodes 2-3 and 4-5): two leaves, two branches
nodes = [node(None, "user", [1, 2], [False, False]), node(0, "assistant", [3, 4], [False, True], [-0.4]),
         node(1, "user", [5], [False]), node(2, "assistant", [6, 7], [False, True], [-0.7]),
         node(1, "user", [8], [False]), node(4, "assistant", [9], [True], [-0.9])]
trace = Trace(task=TraceTask(type="T", data=vf.TaskData()), agent=AgentInfo(config=vf.AgentConfig()), nodes=nodes)
print(json.dumps(trace_branches(trace)))
'''


def test_a_turn_two_branches_share_is_trained_in_the_first_only():
    """verifiers' own Trace and Branch objects (run in the bridge's venv): the shared sampled token keeps its mask
    and log-prob in branch 0 only."""
    import subprocess

    out = subprocess.run([str(BRIDGE_PYTHON), "-c", SHARED_TURN, str(BRIDGE.parent)], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    first, second = json.loads(out.splitlines()[-1])
    assert first == {"token_ids": [1, 2, 3, 4, 5, 6, 7], "sampled_mask": [0, 0, 0, 1, 0, 0, 1],
                     "logprobs": [0.0, 0.0, 0.0, -0.4, 0.0, 0.0, -0.7]}
    assert second == {"token_ids": [1, 2, 3, 4, 8, 9], "sampled_mask": [0, 0, 0, 0, 0, 1],
                      "logprobs": [0.0, 0.0, 0.0, 0.0, 0.0, -0.9]}


@pytest.mark.e2e
async def test_a_verifiers_environment_trains_unchanged(tmp_path, vllm_engine, tiny_model_dir):
    """data.dataset = "verifiers:rollstream-add" in a real `rollstream train`: the taskset is the dataset, every
    request one episode through verifiers' own runner (null harness, subprocess runtime) against the agent
    endpoint, its branches trained token-exact, its named reward logged as rewards/correct/mean."""
    import uuid

    from config import load_config
    from rollstream import train

    await vllm_engine.reset_weights(tiny_model_dir)
    cfg = load_config("configs/demo.toml", [
        f"run.output_dir={json.dumps(str(tmp_path))}", "run.max_steps=2", f"run.name=vf-{uuid.uuid4().hex[:6]}",
        f'data.dataset="verifiers:{ENV_ID}"', 'rollout.verifiers_taskset={num_tasks = 8, seed = 1}',
        f"rollout.verifiers_python={json.dumps(str(BRIDGE_PYTHON))}", "rollout.max_model_len=256",
        "reward.reward_funcs=[]", "reward.reward_weights=[]", "grpo.num_generations=4",
        "grpo.generation_batch_size=8", "grpo.per_device_train_batch_size=8", "grpo.max_staleness=0"])
    assert cfg.rollout.multi_turn_scheduler == "verifiers"
    result = await asyncio.wait_for(train.run_pipeline(cfg, engine=vllm_engine), 600)
    assert result.exit_code == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all("rewards/correct/mean" in r for r in rows)
    # the engine's and the learner's log-probs of the trained tokens agree: verifiers' branches are what was sampled
    assert max(r["sampling/sampling_logp_difference/max"] for r in rows) < 1e-4
    completions = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert len(completions) == 16
    for c in completions:  # verifiers' exact-answer reward on the tiny model's own answer
        question = re.findall(r"What is (\d+)\+(\d+)\?", c["prompt"])[-1]
        assert c["rewards"]["correct"] == float(c["completion"].strip() == str(sum(map(int, question))))

"""Scheduler protocol on a deterministic token engine (a fake of the TokenBackend protocol, no vLLM) and
the tiny model's real tokenizer: token layout, masks, ms-swift's return forms, registry and plugins."""

from __future__ import annotations

import asyncio
import sys
import textwrap
from dataclasses import dataclass

import pytest
from transformers import AutoTokenizer

import schedulers
from pipeline.plugins import load_plugins
from schedulers import (
    MultiTurnScheduler,
    RequestConfig,
    RolloutInferRequest,
    RolloutOutput,
    SchedulerError,
    UnknownSchedulerError,
    build_scheduler,
    multi_turns,
)
from schedulers.builtin import CalculatorPool, ToolCallScheduler, run_calculator
from schedulers.engine import InferEngine, RequestContext, request_context
from schedulers.results import run_results, trajectory_parts


@dataclass
class FakeSample:
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    min_version: int
    max_version: int


class ScriptedBackend:
    """Replies with scripted texts (encoded by the real tokenizer), ending with EOS; records every prompt."""

    def __init__(self, tokenizer, replies: list[str], version: int = 0) -> None:
        self.tokenizer = tokenizer
        self.replies = list(replies)
        self.prompts: list[list[int]] = []
        self.seeds: list[int | None] = []
        self.version = version

    async def generate(self, prompt_ids, *, request_id, seed, max_tokens, **sampling):
        self.prompts.append(list(prompt_ids))
        self.seeds.append(seed)
        ids = self.tokenizer.encode(self.replies.pop(0), add_special_tokens=False) + [self.tokenizer.eos_token_id]
        ids = ids[:max_tokens]
        finish = "stop" if ids[-1] == self.tokenizer.eos_token_id else "length"
        return FakeSample(ids, [-0.01 * (k + 1) for k in range(len(ids))], finish, self.version, self.version)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def engine_for(tokenizer, replies, max_model_len=256):
    return InferEngine(ScriptedBackend(tokenizer, replies), max_model_len=max_model_len)


async def run_scheduler(scheduler, engine, messages, data_dict=None, seed=10):
    scheduler.infer_engine = engine
    request = RolloutInferRequest(messages=messages, data_dict=data_dict or {}, uuid="r0")
    with request_context(RequestContext(request_id="r0", config=RequestConfig(max_tokens=64, seed=seed))):
        return await scheduler.run(request, RequestConfig(max_tokens=64, seed=seed))


def parts(result, engine, loss_scale="default"):
    return trajectory_parts(result, engine, loss_scale=loss_scale, scheduler="t", index=0,
                            default_versions=(0, 0), default_messages=[])


class AskAgain(MultiTurnScheduler):
    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({"role": "user", "content": "again"})
        return {"infer_request": infer_request}


async def test_new_turn_style_token_layout(tokenizer):
    engine = engine_for(tokenizer, ["12", "13", "14"])
    [result] = await run_scheduler(AskAgain(max_turns=3), engine, [{"role": "user", "content": "What is 3+4?"}])
    p = parts(result, engine)
    backend = engine.backend
    # every turn's prompt is the previous prompt plus everything since: the learner sees what vLLM saw
    assert backend.prompts[1] == backend.prompts[0] + p.completion_ids[: len(backend.prompts[1]) - len(backend.prompts[0])]
    assert backend.prompts[0] + p.completion_ids[: len(backend.prompts[2]) - len(backend.prompts[0])] == backend.prompts[2]
    # and it is exactly the chat template of the whole conversation
    text = tokenizer.decode(backend.prompts[0] + p.completion_ids, skip_special_tokens=False)
    assert text == tokenizer.apply_chat_template(result["messages"], tokenize=False).rstrip("\n")
    # model tokens: 3 replies of 2 tokens + EOS, mask 1; the rest (template turns) mask 0
    assert sum(p.loss_mask) == 9 and len(p.loss_mask) == len(p.completion_ids) > 9
    assert [lp for lp, m in zip(p.logprobs, p.loss_mask) if m] == pytest.approx([-0.01, -0.02, -0.03] * 3)
    assert all(lp == 0.0 for lp, m in zip(p.logprobs, p.loss_mask) if not m)
    assert result["rollout_infos"]["num_turns"] == 3 and p.completion == "14"
    assert p.prompt_messages == [{"role": "user", "content": "What is 3+4?"}]
    # each turn has its own seed
    assert len(set(backend.seeds)) == 3


async def test_last_round_masks_earlier_turns_unless_the_mask_is_explicit(tokenizer):
    engine = engine_for(tokenizer, ["12", "13"])
    [result] = await run_scheduler(AskAgain(max_turns=2), engine, [{"role": "user", "content": "hi"}])
    p = parts(result, engine, loss_scale="last_round")
    assert sum(p.loss_mask) == 3  # only the last reply ("13" + EOS)
    assert p.loss_mask[-3:] == [1, 1, 1] and [lp for lp, m in zip(p.logprobs, p.loss_mask) if m] == pytest.approx([-0.01, -0.02, -0.03])
    explicit = dict(result, explicit_loss_mask=True)
    assert sum(parts(explicit, engine, loss_scale="last_round").loss_mask) == 6


class OldBareRequest(MultiTurnScheduler):
    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({"role": "user", "content": "more"})
        return infer_request


class OldTuple(MultiTurnScheduler):
    async def step(self, infer_request, response_choice, current_turn):  # async works too
        infer_request.messages.append({"role": "user", "content": "more"})
        return infer_request, {"seen": current_turn}

    async def check_finished(self, infer_request, response_choice, current_turn):
        return current_turn >= 2


@pytest.mark.parametrize("cls", [OldBareRequest, OldTuple])
async def test_old_ms_swift_return_forms(tokenizer, cls):
    engine = engine_for(tokenizer, ["1", "2"])
    [result] = await run_scheduler(cls(max_turns=2), engine, [{"role": "user", "content": "q"}])
    assert result["rollout_infos"]["num_turns"] == 2
    if cls is OldTuple:
        assert result["rollout_infos"]["seen"] == 1
    assert len(engine.backend.prompts) == 2


class BadLogprobs(MultiTurnScheduler):
    def step(self, infer_request, response_choice, current_turn):
        ids = list(response_choice.token_ids)
        infer_request.messages.append({"role": "user", "content": "x"})
        # one logprob too many for the trained tokens: the rule len(logprobs) == sum(mask) is broken
        return {"infer_request": infer_request, "response_token_ids": ids, "response_loss_mask": [0] + [1] * (len(ids) - 1),
                "rollout_logprobs": [0.0] * len(ids)}


async def test_mask_logprob_rule_violation_names_scheduler_and_turn(tokenizer):
    engine = engine_for(tokenizer, ["1", "2"])
    with pytest.raises(SchedulerError, match=r"scheduler BadLogprobs, turn 1: 2 rollout_logprobs for 1 trained"):
        await run_scheduler(BadLogprobs(max_turns=2), engine, [{"role": "user", "content": "q"}])


class Rewriter(MultiTurnScheduler):
    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages[0]["content"] = "rewritten"
        infer_request.messages.append({"role": "user", "content": "x"})
        return {"infer_request": infer_request}


async def test_rewritten_history_is_an_error(tokenizer):
    engine = engine_for(tokenizer, ["1", "2"])
    with pytest.raises(SchedulerError, match="Rewriter, turn 1: step\\(\\) rewrote earlier messages"):
        await run_scheduler(Rewriter(max_turns=2), engine, [{"role": "user", "content": "q"}])


async def test_continuation_style_drops_eos_and_inserts_text(tokenizer):
    class Continue(MultiTurnScheduler):
        def step(self, infer_request, response_choice, current_turn):
            infer_request.messages[-1]["content"] += " wait,"
            return {"infer_request": infer_request}

    engine = engine_for(tokenizer, ["12", "13"])
    [result] = await run_scheduler(Continue(max_turns=2), engine, [{"role": "user", "content": "q"}])
    p = parts(result, engine)
    inserted = tokenizer.encode(" wait,", add_special_tokens=False)
    twelve = tokenizer.encode("12", add_special_tokens=False)
    # "12" without its EOS (the message goes on), the inserted text (mask 0), then "13" + EOS
    assert p.completion_ids[: len(twelve) + len(inserted)] == twelve + inserted
    assert p.loss_mask == [1] * len(twelve) + [0] * len(inserted) + [1] * (len(p.completion_ids) - len(twelve) - len(inserted))
    assert result["messages"][-1]["content"] == "12 wait,13" and len(result["response_token_ids"]) == 1


async def test_continuation_with_given_ids_keeps_the_reply_eos_out_of_the_next_context(tokenizer):
    """ms-swift's tool/tip schedulers return the reply's token_ids (ending with EOS) plus the inserted text:
    the next turn's context (and the trained ids) continue the message without the EOS, as ms-swift's
    re-rendered prompt does (`...3*4Result: 12`, never `...3*4<|im_end|>Result: 12`)."""

    class SwiftTool(MultiTurnScheduler):
        def step(self, infer_request, response_choice, current_turn):
            ids = list(response_choice.token_ids)
            result = self.tokenizer.encode("Result: 12", add_special_tokens=False)
            infer_request.messages[-1]["content"] += "Result: 12"
            return {"infer_request": infer_request, "response_token_ids": ids + result,
                    "response_loss_mask": [1] * len(ids) + [0] * len(result),
                    "rollout_logprobs": self._extract_logprobs_from_choice(response_choice)}

    engine = engine_for(tokenizer, ["3*4", "done"])
    [result] = await run_scheduler(SwiftTool(max_turns=2), engine, [{"role": "user", "content": "q"}])
    second = tokenizer.decode(engine.backend.prompts[1], skip_special_tokens=False)
    assert second.endswith("<|im_start|>assistant\n3*4Result: 12")
    p = parts(result, engine)
    assert engine.backend.prompts[1] == engine.backend.prompts[0] + p.completion_ids[: len(engine.backend.prompts[1])
                                                                                      - len(engine.backend.prompts[0])]
    assert tokenizer.eos_token_id not in p.completion_ids[:-1] and p.completion_ids[-1] == tokenizer.eos_token_id
    three = len(tokenizer.encode("3*4", add_special_tokens=False))
    assert [lp for lp, m in zip(p.logprobs, p.loss_mask) if m][:three] == pytest.approx([-0.01 * (k + 1)
                                                                                        for k in range(three)])


async def test_run_returning_rollout_output_is_trained_as_ms_swift_lays_it_out(tokenizer):
    """Two assistant turns in one RolloutOutput: the prompt is the conversation before the first, the
    template's tokens between them are mask 0, and the result is the engine's second prompt token for token."""

    class TwoTurns(MultiTurnScheduler):
        async def run(self, infer_request, request_config, **kwargs):
            ids, logprobs = [], []
            for turn in (1, 2):
                response = await self.infer_engine.infer_async(infer_request, request_config)
                choice = response.choices[0]
                infer_request.messages.append({"role": "assistant", "content": choice.message.content})
                ids.append(list(choice.token_ids))
                logprobs.append(self._extract_logprobs_from_choice(choice))
                if turn == 1:
                    infer_request.messages.append({"role": "user", "content": "again"})
            return RolloutOutput(response=response, messages=infer_request.messages, response_token_ids=ids,
                                 rollout_logprobs=logprobs, rollout_infos={"num_turns": 2})

    engine = engine_for(tokenizer, ["12", "13"])
    outputs = await run_scheduler(TwoTurns(), engine, [{"role": "user", "content": "q"}])
    [result] = run_results(outputs, "TwoTurns", "r0")
    p = parts(result, engine)
    prompts = engine.backend.prompts
    assert p.prompt_ids == prompts[0] and prompts[1] == p.prompt_ids + p.completion_ids[: len(prompts[1]) - len(prompts[0])]
    assert sum(p.loss_mask) == 6 and p.completion == "13"  # 2 replies of 2 tokens + EOS
    assert [m["role"] for m in p.conversation] == ["user", "assistant", "user", "assistant"]
    with pytest.raises(SchedulerError, match="2 rounds of response_token_ids for 1 assistant"):
        parts({**result, "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "13"}]},
              engine)


async def test_math_tip_trick_and_multi_turn_builtins(tokenizer):
    engine = engine_for(tokenizer, ["<think>5</think><answer>5</answer>", "7"])
    [result] = await run_scheduler(build_scheduler("math_tip_trick"), engine, [{"role": "user", "content": "3+4?"}],
                                   data_dict={"solution": "7"})
    p = parts(result, engine)
    tips = tokenizer.encode(schedulers.builtin.MathTipsScheduler.tips_prompt, add_special_tokens=False)
    assert result["messages"][-1]["content"].startswith("<think>5" + schedulers.builtin.MathTipsScheduler.tips_prompt)
    start = p.completion_ids.index(tips[0], 1)
    assert p.completion_ids[start:start + len(tips)] == tips and p.loss_mask[start:start + len(tips)] == [0] * len(tips)
    assert len([x for x in p.loss_mask if x]) == len(p.completion_ids) - len(tips)

    engine = engine_for(tokenizer, ["5", "7", "never"])
    [result] = await run_scheduler(build_scheduler("math_tip_trick_multi_turn", 5), engine,
                                   [{"role": "user", "content": "3+4?"}], data_dict={"solution": "7"})
    assert [m["role"] for m in result["messages"]] == ["user", "assistant", "user", "assistant"]
    assert result["rollout_infos"]["num_turns"] == 2 and len(engine.backend.replies) == 1


async def test_calculator_runs_in_a_subprocess_with_a_timeout():
    assert await run_calculator("6*7") == "Result: 42"
    assert await run_calculator("(1+2)*-3/2") == "Result: -4.5"
    assert (await run_calculator("__import__('os')")).startswith("Calculation error")
    pool = CalculatorPool(1)
    results = await asyncio.gather(pool.run("9**9**9**9", 0.5), pool.run("2**10", 2.0))
    assert results == ["Calculation error: timed out after 0.5 s", "Result: 1024"]
    assert pool.started == 2  # the hung process was killed and a fresh one took the next call


def test_tool_call_parsing():
    assert ToolCallScheduler.extract_tool_calls("Action: calculator\nAction Input: 2+3\n") == [
        {"tool": "calculator", "params": "2+3"}]
    assert ToolCallScheduler.extract_tool_calls("Action: calculator\nAction Input: 2+3\nObservation: Result: 5\n") is None


def test_unknown_scheduler_lists_registered():
    with pytest.raises(UnknownSchedulerError, match="did you mean 'math_tip_trick'.*tool_call_scheduler"):
        build_scheduler("math_tip_trik")


def test_plugin_file_registers_a_scheduler(tmp_path):
    plugin = tmp_path / "my_plugin.py"
    plugin.write_text(textwrap.dedent("""
        from schedulers import MultiTurnScheduler, multi_turns

        class PluginScheduler(MultiTurnScheduler):
            def step(self, infer_request, response_choice, current_turn):
                return infer_request

        multi_turns["plugin_scheduler_t1"] = PluginScheduler
    """))
    load_plugins([str(plugin)])
    try:
        scheduler = build_scheduler("plugin_scheduler_t1", 3)
        assert type(scheduler).__name__ == "PluginScheduler" and scheduler.max_turns == 3
    finally:
        multi_turns.pop("plugin_scheduler_t1", None)


def test_entry_point_group_registers_a_scheduler(tmp_path, monkeypatch):
    (tmp_path / "ep_sched_pkg.py").write_text(
        "from schedulers import MultiTurnScheduler\nclass EPScheduler(MultiTurnScheduler):\n    pass\n"
    )
    dist = tmp_path / "ep_sched_pkg-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-sched-pkg\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[rollstream.schedulers]\nep_scheduler = ep_sched_pkg:EPScheduler\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert type(build_scheduler("ep_scheduler")).__name__ == "EPScheduler"
    finally:
        multi_turns.pop("ep_scheduler", None)
        sys.modules.pop("ep_sched_pkg", None)

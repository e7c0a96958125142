"""Multi-turn rollout on the real vLLM engine and the tiny model: every built-in scheduler through the rollout
stage, the learner reproducing the logprobs of model tokens, a plugin scheduler loaded from a file, per-turn
records, prompt truncation, and weight updates landing while multi-turn requests are in flight."""

from __future__ import annotations

import asyncio
import textwrap

import pytest
import torch
from fake_context import FakeContext
from polling import wait_until

from config import config_from_dict
from pipeline import metrics
from pipeline.plugins import load_plugins
from pipeline.records import Feedback, GroupClosed, PromptTask, ScoredTrajectory, Trajectory, TrajectoryGroup
from schedulers import MultiTurnScheduler, multi_turns
from stages import FEEDBACK
from stages.rollout import Rollout
from trainer.model import Batch, completion_logps
from weights.snapshots import save_weights_atomically

pytestmark = pytest.mark.e2e

IMPOSSIBLE = "no-such-answer"  # a solution the model never writes, so the tip schedulers always tip


def cfg(scheduler=None, max_turns=None, max_completion_length=12, loss_scale="default", weight_load="pause",
        max_length=None, truncation_strategy="left"):
    return config_from_dict({
        "grpo": {"max_completion_length": max_completion_length, "truncation_strategy": truncation_strategy},
        "rollout": {"max_concurrent_groups": 4, "max_model_len": 256, "multi_turn_scheduler": scheduler,
                    "max_turns": max_turns, "loss_scale": loss_scale, "weight_load": weight_load},
        "data": {"max_length": max_length},
        "reward": {"reward_funcs": ["accuracy"]},
    })


def task(messages=None, solution=IMPOSSIBLE, generations=4, seed=300, min_policy_version=0):
    return PromptTask(prompt_id="e0:3", generation_batch=0, num_generations=generations,
                      messages=messages or [{"role": "user", "content": "What is 3+4?"}],
                      data_dict={"solution": solution}, seed=seed, min_policy_version=min_policy_version)


async def run_stage(engine, model_dir, config, t):
    stage = Rollout(config, model_dir, engine=engine)
    await stage.start(FakeContext(run='mt', stage='rollout'))
    out = await stage.handle(t, FakeContext(run='mt', stage='rollout'))
    records = [r for _, r in out.outputs]
    # With a scheduler the group travels as one TrajectoryGroup entry (one reward worker scores it whole).
    assert all(isinstance(r, TrajectoryGroup) for r in records) or config.rollout.multi_turn_scheduler is None
    records = [x for r in records for x in ([*r.trajectories, r.manifest] if isinstance(r, TrajectoryGroup) else [r])]
    trajectories = [r for r in records if isinstance(r, Trajectory)]
    manifests = [r for r in records if isinstance(r, GroupClosed)]
    return trajectories, manifests, out


def trajectories_of(handled) -> list[Trajectory]:
    """The trajectories a multi-turn rollout sent, out of their TrajectoryGroup entries."""
    return [t for _, r in handled.outputs if isinstance(r, TrajectoryGroup) for t in r.trajectories]


def check_layout(t: Trajectory) -> None:
    ids, mask, lps = t.completion_token_ids(), t.completion_loss_mask(), t.completion_logprobs()
    assert len(ids) == len(mask) == len(lps) > 0
    assert all(lp < 0 for lp, m in zip(lps, mask) if m)  # model tokens carry real logprobs
    assert all(lp == 0 for lp, m in zip(lps, mask) if not m)  # inserted tokens carry none


def learner_agrees(model, trajectories) -> None:
    scored = [ScoredTrajectory(trajectory=t, rewards={}, reward=0.0) for t in trajectories]
    with torch.no_grad():
        logps = completion_logps(model, Batch(scored, [0.0] * len(scored), pad_id=0), temperature=1.0)
    for i, t in enumerate(trajectories):
        mask = torch.from_numpy(t.completion_loss_mask().copy()).bool()
        n = len(mask)
        engine = torch.from_numpy(t.completion_logprobs().copy())
        assert torch.allclose(logps[i, :n][mask], engine[mask], atol=2e-4)


async def test_math_tip_trick_multi_turn_end_to_end_and_learner_agrees(vllm_engine, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    await vllm_engine.reset_weights(tiny_model_dir)
    trajectories, [manifest], _ = await run_stage(
        vllm_engine, tiny_model_dir, cfg("math_tip_trick_multi_turn", max_turns=3), task())
    assert len(trajectories) == 4 and manifest.record_ids == [t.record_id for t in trajectories]
    tip = multi_turns["math_tip_trick_multi_turn"].tips_prompt
    tipped = [t for t in trajectories if t.rollout_infos["num_turns"] == 2]
    assert tipped, "with an impossible solution every reply that is not cut by length gets the tip"
    for t in trajectories:
        check_layout(t)
    for t in tipped:
        text = vllm_engine.tokenizer.decode(t.completion_token_ids(), skip_special_tokens=False)
        assert f"<|im_start|>user\n{tip}<|im_end|>\n<|im_start|>assistant\n" in text
        assert 0 < t.completion_loss_mask().sum() < len(t.completion_loss_mask())
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    learner_agrees(model, trajectories)


async def test_math_tip_trick_continuation(vllm_engine, tiny_model_dir):
    await vllm_engine.reset_weights(tiny_model_dir)
    trajectories, _, _ = await run_stage(vllm_engine, tiny_model_dir, cfg("math_tip_trick", max_turns=3), task())
    tip = vllm_engine.tokenizer.encode(multi_turns["math_tip_trick"].tips_prompt, add_special_tokens=False)
    tipped = [t for t in trajectories if t.rollout_infos.get("num_turns") == 2]
    assert tipped
    for t in trajectories:
        check_layout(t)
    for t in tipped:
        ids, mask = list(t.completion_token_ids()), list(t.completion_loss_mask())
        at = next(i for i in range(len(ids)) if ids[i:i + len(tip)] == tip)
        assert mask[at:at + len(tip)] == [0] * len(tip) and mask.count(0) == len(tip)
        assert multi_turns["math_tip_trick"].tips_prompt in t.completion


async def test_thinking_tips_scheduler_per_turn_records(vllm_engine, tiny_model_dir):
    await vllm_engine.reset_weights(tiny_model_dir)
    trajectories, [manifest], _ = await run_stage(
        vllm_engine, tiny_model_dir, cfg("thinking_tips_scheduler", max_turns=2, max_completion_length=8), task())
    by_request: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        by_request.setdefault(t.request_id, []).append(t)
    assert len(by_request) == 4 and manifest.record_ids == [t.record_id for t in trajectories]
    assert len(set(manifest.record_ids)) == len(manifest.record_ids)
    for records in by_request.values():
        assert [t.turn for t in records] == list(range(1, len(records) + 1))
        if len(records) > 1:  # dynamic_num_samples: the second record's prompt holds the first reply and the tip
            assert records[1].messages[-1]["content"] == multi_turns["thinking_tips_scheduler"].tips_prompt
            first = records[0]
            assert len(records[1].prompt_token_ids()) > len(first.prompt_token_ids()) + 1
        for t in records:
            check_layout(t)
            assert t.completion_loss_mask().all()


async def test_tool_call_scheduler_runs_the_calculator(vllm_engine, tiny_model_dir):
    await vllm_engine.reset_weights(tiny_model_dir)
    prefill = [{"role": "user", "content": "What is 6*7?"},
               {"role": "assistant", "content": "Action: calculator\nAction Input: 6*7\n"}]
    trajectories, _, _ = await run_stage(vllm_engine, tiny_model_dir, cfg("tool_call_scheduler", max_turns=3),
                                         task(messages=prefill))
    for t in trajectories:
        check_layout(t)
        call = t.rollout_infos["tool_calls"][0]
        assert call["tool"] == "calculator" and call["params"].startswith("6*7")
        result = t.rollout_infos["tool_results"]
        assert result.startswith(("Result: ", "Calculation error"))
        if call["params"] == "6*7":
            assert result == "Result: 42"
        observation = vllm_engine.tokenizer.encode(f"\nObservation: {result}\n", add_special_tokens=False)
        ids, mask = list(t.completion_token_ids()), list(t.completion_loss_mask())
        at = next(i for i in range(len(ids)) if ids[i:i + len(observation)] == observation)
        assert mask[at:at + len(observation)] == [0] * len(observation)
        assert f"Observation: {result}" in t.completion


async def test_plugin_scheduler_from_a_file(vllm_engine, tiny_model_dir, tmp_path):
    plugin = tmp_path / "e2e_plugin.py"
    plugin.write_text(textwrap.dedent("""
        from schedulers import MultiTurnScheduler, multi_turns

        class Twice(MultiTurnScheduler):
            def step(self, infer_request, response_choice, current_turn):
                infer_request.messages.append({"role": "user", "content": "Once more."})
                return infer_request, {"plugin_turn": current_turn}   # ms-swift's old tuple form

            def check_finished(self, infer_request, response_choice, current_turn):
                return current_turn >= 2

        multi_turns["e2e_twice"] = Twice
    """))
    load_plugins([str(plugin)])
    try:
        await vllm_engine.reset_weights(tiny_model_dir)
        trajectories, _, _ = await run_stage(vllm_engine, tiny_model_dir, cfg("e2e_twice"), task())
    finally:
        multi_turns.pop("e2e_twice", None)
    assert len(trajectories) == 4
    for t in trajectories:
        check_layout(t)
        assert t.rollout_infos == {"plugin_turn": 1, "num_turns": 2}


async def test_prompt_truncation(vllm_engine, tiny_model_dir):
    await vllm_engine.reset_weights(tiny_model_dir)
    full = vllm_engine.encode_prompt(task().messages)
    counter = metrics.PROMPTS_TRUNCATED.labels("mt", "delete")
    before = counter._value.get()
    _, _, out = await run_stage(vllm_engine, tiny_model_dir, cfg(max_length=5, truncation_strategy="delete"), task())
    [(edge, feedback)] = out.outputs
    assert edge == FEEDBACK and isinstance(feedback, Feedback)
    assert (feedback.outcome, feedback.reason, feedback.prompt_id) == ("dropped", "truncated", "e0:3")
    assert counter._value.get() == before + 1
    trajectories, _, _ = await run_stage(vllm_engine, tiny_model_dir, cfg(max_length=5), task())
    assert all(list(t.prompt_token_ids()) == full[-5:] for t in trajectories)
    # multi-turn requests start from the truncated prompt too
    trajectories, _, _ = await run_stage(vllm_engine, tiny_model_dir, cfg("math_tip_trick_multi_turn", max_turns=2,
                                                                            max_length=5), task())
    assert all(list(t.prompt_token_ids()) == full[-5:] for t in trajectories)


class AlwaysAgain(MultiTurnScheduler):
    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({"role": "user", "content": "Again."})
        return {"infer_request": infer_request}

    def check_finished(self, infer_request, response_choice, current_turn):
        return current_turn >= self.max_turns


@pytest.mark.parametrize("mode", ["pause", "drain", "in_flight"])
async def test_weight_update_lands_while_requests_are_in_flight(vllm_engine, tiny_model_dir, tmp_path, mode, monkeypatch):
    from transformers import AutoModelForCausalLM

    await vllm_engine.reset_weights(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    path = save_weights_atomically(model, tmp_path / "v1")
    turns_at_reload = []  # engine calls running when the weights changed
    reload = vllm_engine._reload

    async def spy(*args):
        turns_at_reload.append(vllm_engine.running_count("pause"))
        await reload(*args)

    monkeypatch.setattr(vllm_engine, "_reload", spy)
    multi_turns["always_again"] = AlwaysAgain
    try:
        stage = Rollout(cfg("always_again", max_turns=3, max_completion_length=24, weight_load=mode), tiny_model_dir,
                        engine=vllm_engine)
        await stage.start(FakeContext(run='mt', stage='rollout'))
        running = asyncio.create_task(stage.handle(task(generations=8), FakeContext(run='mt', stage='rollout')))
        await wait_until(lambda: vllm_engine.running_count("pause") > 0, interval_s=0.001)
        seconds = await vllm_engine.load_weights(path, 1, mode=mode)
        late = await stage.handle(task(generations=2, seed=900), FakeContext(run='mt', stage='rollout'))  # starts after the load
        out = await running
    finally:
        multi_turns.pop("always_again", None)
    assert seconds > 0 and vllm_engine.version == 1
    trajectories = trajectories_of(out)
    assert len(trajectories) == 8 and len({t.request_id for t in trajectories}) == 8  # none lost
    for t in trajectories:
        check_layout(t)
        assert t.rollout_infos["num_turns"] == 3
        assert 0 <= t.policy_version <= t.max_policy_version <= 1
    assert turns_at_reload == ([turns_at_reload[0]] if mode == "in_flight" else [0])
    if mode == "in_flight":
        # The load did not wait for the running turns, the engine runs again, and every request, the turns
        # running at the load included, went on with the new weights (whether a running turn had sampled a
        # token before the load is a race: (0, 1) or (1, 1)).
        assert turns_at_reload[0] > 0 and not await vllm_engine.engine.is_paused()
        assert all(t.max_policy_version == 1 for t in trajectories)
    elif mode == "pause":  # the load waited for the running turns, later turns used the new weights
        assert any((t.policy_version, t.max_policy_version) == (0, 1) for t in trajectories)
    else:  # drain: every in-flight request finished on the old weights
        assert all((t.policy_version, t.max_policy_version) == (0, 0) for t in trajectories)
    assert all((t.policy_version, t.max_policy_version) == (1, 1) for t in trajectories_of(late))
    await vllm_engine.reset_weights(tiny_model_dir)
    assert vllm_engine.version == 0


async def test_a_deleted_snapshot_is_skipped(vllm_engine, tiny_model_dir, tmp_path):
    from pipeline.records import WeightsPublished

    await vllm_engine.reset_weights(tiny_model_dir)
    stage = Rollout(cfg(), tiny_model_dir, engine=vllm_engine)
    await stage.start(FakeContext(run='mt', stage='rollout'))
    (tmp_path / "v000004").mkdir()  # collected after a newer snapshot: its announcement follows (#29)
    gone = WeightsPublished(version=3, path=str(tmp_path / "v000003"))
    assert await stage.on_broadcast(gone, FakeContext(run='mt', stage='rollout')) == [] and vllm_engine.version == 0

"""Rollout on the real vLLM engine: trajectories, logprobs that the learner reproduces, live weight reloads."""

from __future__ import annotations

import os

import pytest
import torch
from fake_context import FakeContext

from config import config_from_dict
from pipeline.records import GroupClosed, PromptTask, ScoredTrajectory, Trajectory, TrajectoryGroup
from stages.rollout import Rollout
from trainer.model import Batch, completion_logps
from weights.snapshots import save_weights_atomically

pytestmark = pytest.mark.e2e

OMP_NUM_THREADS = os.environ.get("OMP_NUM_THREADS")  # at collection, before the session's engine started


def rollout_cfg(max_completion_length=12, temperature=1.0):
    return config_from_dict({
        "grpo": {"max_completion_length": max_completion_length, "temperature": temperature},
        "rollout": {"max_concurrent_groups": 4, "max_model_len": 256},
        "reward": {"reward_funcs": ["accuracy"]},
    })


def task(seed=100, generations=8, min_policy_version=0):
    return PromptTask(prompt_id="e0:7", generation_batch=0, num_generations=generations,
                      messages=[{"role": "user", "content": "What is 3+4?"}], data_dict={"solution": "7"},
                      seed=seed, min_policy_version=min_policy_version)


def trajectories_of(handled):
    """The group's trajectories: a single-turn rollout sends a whole group as one TrajectoryGroup entry."""
    [(edge, entry)] = handled.outputs
    assert edge == "trajectories" and isinstance(entry, TrajectoryGroup)
    return entry.trajectories


async def make_stage(engine, tiny_model_dir, **kw):
    stage = Rollout(rollout_cfg(**kw), tiny_model_dir, engine=engine)
    await stage.start(FakeContext(stage='rollout'))
    return stage


async def test_group_of_independent_seeded_requests(vllm_engine, tiny_model_dir):
    await vllm_engine.reset_weights(tiny_model_dir)
    stage = await make_stage(vllm_engine, tiny_model_dir)
    [(_, entry)] = (await stage.handle(task(), FakeContext(stage='rollout'))).outputs
    trajectories, manifest = entry.trajectories, entry.manifest
    assert isinstance(manifest, GroupClosed) and len(trajectories) == 8
    assert all(isinstance(t, Trajectory) for t in trajectories)
    assert manifest.record_ids == [t.record_id for t in trajectories]
    assert len({t.request_id for t in trajectories}) == 8
    for t in trajectories:
        n = len(t.completion_token_ids())
        assert 0 < n <= 12 and len(t.completion_logprobs()) == n
        assert t.policy_version == 0 and t.max_policy_version == 0
        assert t.data_dict == {"solution": "7"}
        assert t.finish_reason in ("stop", "length")
    # same seeds -> same samples (reproducible); the group is not 8 copies of one sample
    again = trajectories_of(await stage.handle(task(), FakeContext(stage='rollout')))
    assert [t.completion_ids for t in again] == [t.completion_ids for t in trajectories]
    assert len({t.completion_ids for t in trajectories}) > 1


async def test_a_group_request_gives_the_samples_of_one_request_per_seed(vllm_engine, tiny_model_dir):
    """generate_group (one vLLM request with n = G) samples exactly what G requests seeded seed + i do."""
    await vllm_engine.reset_weights(tiny_model_dir)
    prompt = vllm_engine.encode_prompt([{"role": "user", "content": "What is 12+9?"}])
    group = await vllm_engine.generate_group(prompt, request_ids=[f"g/{i}" for i in range(6)], seed=40, max_tokens=12)
    alone = [await vllm_engine.generate(prompt, request_id=f"a/{i}", seed=40 + i, max_tokens=12) for i in range(6)]
    assert [s.completion_ids for s in group] == [s.completion_ids for s in alone]
    assert len({tuple(s.completion_ids) for s in group}) > 1  # six seeds, not six copies of one sample
    for g, a in zip(group, alone):
        assert g.logprobs == pytest.approx(a.logprobs, abs=1e-5) and g.finish_reason == a.finish_reason
        assert (g.min_version, g.max_version) == (0, 0)


async def test_learner_reproduces_rollout_logprobs(vllm_engine, tiny_model_dir):
    """The learner's log-probs of the sampled tokens equal vLLM's (fp32 both sides)."""
    from transformers import AutoModelForCausalLM

    await vllm_engine.reset_weights(tiny_model_dir)
    stage = await make_stage(vllm_engine, tiny_model_dir)
    trajectories = trajectories_of(await stage.handle(task(seed=5), FakeContext(stage='rollout')))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    scored = [ScoredTrajectory(trajectory=t, rewards={}, reward=0.0) for t in trajectories]
    batch = Batch(scored, [0.0] * len(scored), pad_id=0)
    with torch.no_grad():
        logps = completion_logps(model, batch, temperature=1.0)
    for i, t in enumerate(trajectories):
        n = len(t.completion_logprobs())
        assert torch.allclose(logps[i, :n], torch.from_numpy(t.completion_logprobs().copy()), atol=2e-4)


async def test_weight_reload_changes_generation_and_tags_versions(vllm_engine, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    await vllm_engine.reset_weights(tiny_model_dir)
    stage = await make_stage(vllm_engine, tiny_model_dir, temperature=1.0)
    before = trajectories_of(await stage.handle(task(seed=9), FakeContext(stage='rollout')))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    path = save_weights_atomically(model, tmp_path / "v1")
    seconds = await vllm_engine.load_weights(path, 1)
    assert seconds > 0 and vllm_engine.version == 1
    # a task that requires version 1 now runs; its trajectories are stamped with it
    after = trajectories_of(await stage.handle(task(seed=9, min_policy_version=1), FakeContext(stage='rollout')))
    assert all(t.policy_version == 1 and t.max_policy_version == 1 for t in after)
    assert [t.completion_ids for t in after] != [t.completion_ids for t in before]
    # and the engine now agrees with the perturbed weights token for token
    scored = [ScoredTrajectory(trajectory=t, rewards={}, reward=0.0) for t in after]
    with torch.no_grad():
        logps = completion_logps(model.eval(), Batch(scored, [0.0] * len(scored), pad_id=0), temperature=1.0)
    for i, t in enumerate(after):
        n = len(t.completion_logprobs())
        assert torch.allclose(logps[i, :n], torch.from_numpy(t.completion_logprobs().copy()), atol=2e-4)
    await vllm_engine.reset_weights(tiny_model_dir)
    assert vllm_engine.version == 0


async def test_the_engine_core_process_gets_its_thread_count(vllm_engine, vllm_lora_engine):
    """rollout.engine_threads reaches the engine-core process (forked: torch's thread count set in it), and
    without one the core gets vLLM's default, every core; this process's environment is as it was."""
    assert await vllm_engine.engine.collective_rpc("cpu_threads") == [1]
    default = int(OMP_NUM_THREADS.split(",")[0]) if OMP_NUM_THREADS else len(os.sched_getaffinity(0))
    assert await vllm_lora_engine.engine.collective_rpc("cpu_threads") == [default]
    assert os.environ.get("OMP_NUM_THREADS") == OMP_NUM_THREADS

"""LoRA round trip: the learner trains and publishes an adapter, the rollout engine hot-swaps it.

Real vLLM with LoRA enabled (its own engine: the shared one is started without LoRA), the real learner's
peft model and adapter snapshots, the tiny model.
"""

from __future__ import annotations

import json
import uuid

import pytest
import torch
from fake_context import FakeContext

from config import load_config
from pipeline.records import ScoredTrajectory, trajectories_in
from rollstream import train as graph
from stages.rollout import Rollout
from trainer.model import Batch, completion_logps
from trainer.trainer import Trainer
from weights.snapshots import save_weights_atomically

pytestmark = pytest.mark.e2e


def lora_config(tmp_path, *extra):
    return load_config(
        "configs/demo-lora.toml",
        [f"run.output_dir={json.dumps(str(tmp_path))}", "rollout.max_model_len=256", *extra],
    )


def task(seed, min_policy_version=0):
    from pipeline.records import PromptTask

    return PromptTask(
        prompt_id="e0:3",
        generation_batch=0,
        num_generations=8,
        messages=[{"role": "user", "content": "What is 5+9?"}],
        data_dict={"solution": "14"},
        seed=seed,
        min_policy_version=min_policy_version,
    )


async def sample(stage, seed, min_policy_version=0):
    out = await stage.handle(task(seed, min_policy_version), FakeContext(stage='rollout'))
    return trajectories_in(out.outputs)


def learner_logps(model, trajectories):
    scored = [ScoredTrajectory(trajectory=t, rewards={}, reward=0.0) for t in trajectories]
    with torch.no_grad():
        return completion_logps(model, Batch(scored, [0.0] * len(scored), pad_id=0), temperature=1.0)


async def test_engine_logprobs_under_an_adapter_match_the_learners(
    vllm_lora_engine, tiny_model_dir, tmp_path
):
    engine = vllm_lora_engine
    cfg = lora_config(tmp_path)
    await engine.reset_weights(tiny_model_dir)
    stage = Rollout(cfg, tiny_model_dir, engine=engine)
    await stage.start(FakeContext(stage='rollout'))
    base = await sample(stage, seed=11)

    # The learner's own peft model, with an adapter far from its zero start, published as the learner does.
    learner = Trainer(cfg, tiny_model_dir, tmp_path, num_batches=1)
    learner.load()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in learner.model.named_parameters():
            if "lora_B" in name:
                p.add_(0.5 * torch.randn_like(p))
    snapshot = save_weights_atomically(learner.model, tmp_path / "weights" / "v000001", adapter_only=True)
    assert not (snapshot / "model.safetensors").exists()  # the adapter alone travels
    seconds = await engine.load_weights(snapshot, 1)
    assert seconds > 0 and engine.version == 1

    adapted = await sample(stage, seed=11, min_policy_version=1)
    assert all(t.policy_version == 1 and t.max_policy_version == 1 for t in adapted)
    assert [t.completion_ids for t in adapted] != [t.completion_ids for t in base]
    logps = learner_logps(learner.model.eval(), adapted)
    for i, t in enumerate(adapted):
        n = len(t.completion_logprobs())
        assert torch.allclose(logps[i, :n], torch.from_numpy(t.completion_logprobs().copy()), atol=2e-4)
    # the adapter is what made the difference: the base model disagrees with the engine's samples
    with learner.model.disable_adapter():
        base_logps = learner_logps(learner.model, adapted)
    n = len(adapted[0].completion_logprobs())
    assert not torch.allclose(
        base_logps[0, :n], torch.from_numpy(adapted[0].completion_logprobs().copy()), atol=2e-4
    )

    # back to the base: the same seeds give the base samples again (the adapter is unloaded, not merged)
    await engine.reset_weights(tiny_model_dir)
    assert [t.completion_ids for t in await sample(stage, seed=11)] == [t.completion_ids for t in base]


async def test_a_full_weight_snapshot_is_refused_by_a_lora_engine(vllm_lora_engine, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    await vllm_lora_engine.reset_weights(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    full = save_weights_atomically(model, tmp_path / "v1")
    with pytest.raises(ValueError, match="not a LoRA adapter snapshot"):
        await vllm_lora_engine.load_weights(full, 1)
    assert vllm_lora_engine.version == 0


async def test_lora_run_trains_and_the_rollout_follows_the_adapters(vllm_lora_engine, tmp_path):
    steps = 16  # 4 generation batches of 64 samples, 4 optimizer steps each
    cfg = lora_config(tmp_path, f"run.name=e2e-lora-{uuid.uuid4().hex[:6]}", f"run.max_steps={steps}")
    result = await graph.run_pipeline(cfg, engine=vllm_lora_engine)
    assert result.exit_code == 0
    rows = [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["policy_version"] for r in rows[3::4]] == [1, 2, 3, 4]
    assert max(r["staleness/max"] for r in rows) <= cfg.grpo.max_staleness
    completions = [
        json.loads(line) for line in (result.output_dir / "completions.jsonl").read_text().splitlines()
    ]
    # later batches were sampled with published adapters, not the base
    assert max(c["policy_version"] for c in completions) >= 2
    snapshots = sorted((result.output_dir / "weights").glob("v*"))
    assert snapshots and all((s / "adapter_config.json").is_file() for s in snapshots)
    # the rollout leased the versions it sampled with; older adapters were garbage-collected
    assert snapshots[-1].name == "v000004" and snapshots[0].name >= "v000002"
    assert vllm_lora_engine.version == 3  # the final version ends the run: no rollout loads it

"""Qwen2.5-VL and Qwen3-VL tiny models: built, sampled by vLLM with an image, reproduced by the learner,
also after a weight reload (the learner's snapshot names must load into vLLM's model)."""

from __future__ import annotations

import pytest
import torch

from data.loading import load_dataset
from data.media import image_key, pil_images
from pipeline.records import ScoredTrajectory, Trajectory, pack_f32, pack_i32
from trainer.model import Batch, VisionInputs, completion_logps, load_model
from weights.snapshots import save_weights_atomically

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
async def test_arch_rollout_and_learner_agree_before_and_after_a_reload(arch, tmp_path):
    from transformers import AutoImageProcessor

    from engines.vllm_engine import VLLMEngine
    from tinymodels.text import model_path

    model_dir = model_path(f"tiny-vl-{arch}", progress=None)
    rows = load_dataset("shapes", size=4, seed=41)
    engine = await VLLMEngine.start(model_dir, max_model_len=256, kv_cache_gib=1)
    try:
        model = load_model(model_dir, torch.float32).eval()
        processor = AutoImageProcessor.from_pretrained(str(model_dir))
        pad = engine.image_token_id

        async def check(version: int) -> None:
            trajectories, images = [], {}
            for k, row in enumerate(rows):
                ids = engine.encode_prompt(row["messages"])
                s = await engine.generate(ids, request_id=f"{arch}-{version}-{k}", seed=k, max_tokens=6,
                                          images=pil_images(row["images"]))
                assert s.prompt_ids.count(pad) > 1  # expanded by the engine
                key = image_key(row["images"][0])
                images[key] = row["images"][0]
                trajectories.append(ScoredTrajectory(reward=0.0, rewards={}, trajectory=Trajectory(
                    prompt_id=f"p{k}", attempt=0, request_id=f"p{k}/0/0", generation_batch=0,
                    prompt_ids=pack_i32(s.prompt_ids), completion_ids=pack_i32(s.completion_ids),
                    logprobs=pack_f32(s.logprobs), images=[key], policy_version=version,
                    max_policy_version=version)))
            batch = Batch(trajectories, [0.0] * len(rows), pad_id=0, vision=VisionInputs(processor, pad, images))
            with torch.no_grad():
                logps = completion_logps(model, batch, temperature=1.0)
            assert float((logps - batch.rollout_logps).abs()[batch.completion_mask > 0].max()) < 1e-4

        await check(0)
        with torch.no_grad():  # new weights everywhere, vision tower included
            for param in model.parameters():
                param.add_(torch.randn_like(param) * 0.02)
        snapshot = save_weights_atomically(model, tmp_path / "v000001")
        await engine.load_weights(snapshot, 1)
        await check(1)
    finally:
        engine.shutdown()

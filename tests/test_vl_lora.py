"""LoRA on a VL model: the learner's adapter (language model only) hot-swapped into a LoRA-enabled vLLM engine."""

from __future__ import annotations

import pytest
import torch

from data.loading import load_dataset
from data.media import image_key, pil_images
from pipeline.records import ScoredTrajectory, Trajectory, pack_f32, pack_i32
from trainer.model import Batch, VisionInputs, completion_logps, language_model_linears, load_model

pytestmark = pytest.mark.e2e


async def test_vl_lora_adapter_in_the_engine_matches_the_learner(tiny_vl_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoImageProcessor

    from engines.vllm_engine import VLLMEngine

    model = load_model(tiny_vl_model_dir, torch.float32)
    peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=language_model_linears(model),
                                            task_type="CAUSAL_LM"))
    torch.manual_seed(0)
    with torch.no_grad():  # a non-zero adapter
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.add_(torch.randn_like(param) * 0.05)
    peft.save_pretrained(str(tmp_path / "v000001"))
    engine = await VLLMEngine.start(tiny_vl_model_dir, max_model_len=256, kv_cache_gib=1, max_lora_rank=8)
    try:
        await engine.load_weights(tmp_path / "v000001", 1)
        records, images = [], {}
        for k, row in enumerate(load_dataset("shapes", size=3, seed=61)):
            s = await engine.generate(engine.encode_prompt(row["messages"]), request_id=f"vl-lora-{k}", seed=k,
                                      max_tokens=5, images=pil_images(row["images"]))
            key = image_key(row["images"][0])
            images[key] = row["images"][0]
            records.append(ScoredTrajectory(reward=0.0, rewards={}, trajectory=Trajectory(
                prompt_id=f"p{k}", attempt=0, request_id=f"p{k}/0/0", generation_batch=0,
                prompt_ids=pack_i32(s.prompt_ids), completion_ids=pack_i32(s.completion_ids),
                logprobs=pack_f32(s.logprobs), images=[key], policy_version=1, max_policy_version=1)))
    finally:
        engine.shutdown()
    processor = AutoImageProcessor.from_pretrained(str(tiny_vl_model_dir))
    batch = Batch(records, [0.0] * 3, pad_id=0, vision=VisionInputs(processor, model.config.image_token_id, images))
    peft.eval()
    with torch.no_grad():
        adapted = completion_logps(peft, batch, 1.0)
        with peft.disable_adapter():
            base = completion_logps(peft, batch, 1.0)
    mask = batch.completion_mask > 0
    assert float((adapted - batch.rollout_logps).abs()[mask].max()) < 1e-4
    assert float((base - batch.rollout_logps).abs()[mask].max()) > 1e-3  # the engine really used the adapter

"""The learner on image prompts (tiny Qwen2-VL): it sees the rollout's image and reproduces vLLM's log-probs."""

from __future__ import annotations

import io

import pytest
import torch

from data.loading import load_dataset
from pipeline.records import ScoredTrajectory, Trajectory, trajectories_in
from pipeline.transport.memory import MemoryTransport
from stages.rollout import Rollout
from tests.fake_context import FakeContext
from tests.test_vl_rollout import image_task, rollout_cfg
from trainer.model import (
    Batch,
    VisionInputs,
    completion_logps,
    freeze_vision,
    load_model,
    packed_completion_logps_and_entropy,
)

pytestmark = pytest.mark.e2e


async def rollout_group(engine, model_dir, row, ctx, seed=7):
    stage = Rollout(rollout_cfg(), model_dir, engine=engine)
    await stage.start(ctx)
    task = await image_task(ctx, row, seed=seed, generations=8)
    return trajectories_in((await stage.handle(task, ctx)).outputs)


def vision_batch(trajectories, model_dir, images):
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(str(model_dir))
    model = load_model(model_dir, torch.float32).eval()
    scored = [ScoredTrajectory(trajectory=t, rewards={}, reward=0.0) for t in trajectories]
    vision = VisionInputs(processor, model.config.image_token_id, images)
    return model, Batch(scored, [0.0] * len(scored), pad_id=0, vision=vision, learner_version=0)


async def test_learner_logps_match_the_engine_and_depend_on_the_image(vllm_vl_engine, tiny_vl_model_dir):
    await vllm_vl_engine.reset_weights(tiny_vl_model_dir)
    rows = load_dataset("shapes", size=40, seed=21)
    row = rows[0]
    other = next(r for r in rows[1:] if r["messages"] == row["messages"] and r["solution"] != row["solution"])
    ctx = FakeContext(stage="rollout", transport=MemoryTransport())
    trajectories = await rollout_group(vllm_vl_engine, tiny_vl_model_dir, row, ctx)
    key = trajectories[0].images[0]
    model, batch = vision_batch(trajectories, tiny_vl_model_dir, {key: row["images"][0]})
    assert batch.vision["pixel_values"].shape[0] == 8 * 16  # 8 rows x 4 x 4 patches (56 x 56, patch 14)
    assert int(batch.vision["mm_token_type_ids"].sum()) == 8 * 4  # 4 image tokens per row, none in completions
    with torch.no_grad():
        logps = completion_logps(model, batch, temperature=1.0)
    mask = batch.completion_mask > 0
    difference = (logps - batch.rollout_logps).abs()[mask]
    assert float(difference.max()) < 1e-4
    # The same token ids with another picture: other log-probs (the image reaches the learner's LM).
    _, swapped = vision_batch(trajectories, tiny_vl_model_dir, {key: other["images"][0]})
    with torch.no_grad():
        changed = completion_logps(model, swapped, temperature=1.0)
    assert float((changed - logps).abs()[mask].max()) > 1e-2


def test_freeze_vit_and_aligner(tiny_vl_model_dir):
    model = load_model(tiny_vl_model_dir, torch.float32)
    visual = {n for n, _ in model.named_parameters() if ".visual." in f".{n}"}
    merger = {n for n in visual if "merger" in n}
    assert visual and merger and visual - merger
    freeze_vision(model, freeze_vit=True, freeze_aligner=False)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert not (visual - merger) & trainable and merger <= trainable
    assert any(".language_model." in n or "lm_head" in n for n in trainable)
    freeze_vision(model, freeze_vit=True, freeze_aligner=True)
    assert not visual & {n for n, p in model.named_parameters() if p.requires_grad}


def test_lora_all_linear_means_the_language_model_on_vl_models(tiny_vl_model_dir):
    from peft import LoraConfig, get_peft_model

    from trainer.model import language_model_linears

    model = load_model(tiny_vl_model_dir, torch.float32)
    targets = language_model_linears(model)
    assert targets and all(".language_model." in f".{t}." for t in targets)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=targets, task_type="CAUSAL_LM"))
    adapted = {n for n, _ in peft_model.named_parameters() if "lora_" in n}
    assert adapted and not {n for n in adapted if ".visual." in n or "lm_head" in n}


def test_padded_and_padding_free_batches_with_images_of_different_sizes_equal_rows_alone(tiny_vl_model_dir):
    """The learner left-pads prompts; the model builds M-RoPE positions from the mask and the image grids."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer

    from data.media import image_key, pil_images
    from pipeline.records import pack_f32, pack_i32

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_vl_model_dir))
    processor = AutoImageProcessor.from_pretrained(str(tiny_vl_model_dir))
    model = load_model(tiny_vl_model_dir, torch.float32).eval()
    pad = model.config.image_token_id
    row = load_dataset("shapes", size=1, seed=51)[0]
    big = Image.open(io.BytesIO(row["images"][0])).resize((112, 84))
    buffer = io.BytesIO()
    big.save(buffer, format="PNG")
    images = [row["images"][0], buffer.getvalue()]
    scored = []
    for k, data in enumerate(images):
        text = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        count = int(processor(images=pil_images([data]), return_tensors="pt")["image_grid_thw"].prod()) // 4
        at = ids.index(pad)
        prompt = ids[:at] + [pad] * count + ids[at + 1:]
        completion = tokenizer.encode("blue", add_special_tokens=False) + [tokenizer.eos_token_id] * (k + 1)
        scored.append(ScoredTrajectory(reward=0.0, rewards={}, trajectory=Trajectory(
            prompt_id=f"p{k}", attempt=0, request_id=f"p{k}/0/0", generation_batch=0, prompt_ids=pack_i32(prompt),
            completion_ids=pack_i32(completion), logprobs=pack_f32([0.0] * len(completion)),
            images=[image_key(data)], policy_version=0, max_policy_version=0)))
    vision = VisionInputs(processor, pad, {image_key(d): d for d in images})
    assert len(scored[0].trajectory.prompt_token_ids()) != len(scored[1].trajectory.prompt_token_ids())
    batch = Batch(scored, [0.0, 0.0], pad_id=0, vision=vision)
    with torch.no_grad():
        together = completion_logps(model, batch, 1.0)
        for k in range(2):
            alone = completion_logps(model, Batch(scored[k:k + 1], [0.0], pad_id=0, vision=vision), 1.0)
            n = alone.shape[1]
            assert torch.allclose(together[k, :n], alone[0], atol=1e-5)
        # Padding-free (learner.max_tokens_per_batch): both rows packed into one sequence, same log-probs.
        packed, _ = packed_completion_logps_and_entropy(model, batch, [0, 1], 1.0, with_entropy=False)
    mask = batch.completion_mask > 0
    assert torch.allclose(packed[mask], together[mask], atol=1e-5)

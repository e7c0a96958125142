"""Image prompts on the real vLLM engine (tiny Qwen2-VL): one placeholder per image in, expanded ids out."""

from __future__ import annotations

import pytest
from fake_context import FakeContext

from config import config_from_dict
from data.loading import load_dataset
from data.media import put_images
from engines.base import ImagePlaceholderError, check_image_placeholders
from pipeline.records import PromptTask, trajectories_in
from pipeline.transport.memory import MemoryTransport
from stages.rollout import Rollout

pytestmark = pytest.mark.e2e


def rollout_cfg():
    return config_from_dict({
        "grpo": {"max_completion_length": 6},
        "rollout": {"max_concurrent_groups": 4, "max_model_len": 256, "limit_mm_per_prompt": {"image": 1}},
        "reward": {"reward_funcs": ["accuracy"]},
    })


async def image_task(ctx, row, seed=100, generations=4):
    keys = await put_images(ctx, row["images"], ttl_s=60)
    return PromptTask(prompt_id="e0:3", generation_batch=0, num_generations=generations, messages=row["messages"],
                      data_dict={"solution": row["solution"]}, seed=seed, images=keys)


def test_one_placeholder_per_image_rule():
    check_image_placeholders([1, 7, 2], 1, 7)
    check_image_placeholders([1, 2], 0, 7)
    with pytest.raises(ImagePlaceholderError, match="already expanded"):
        check_image_placeholders([1, 7, 7, 7, 7, 2], 1, 7)
    with pytest.raises(ImagePlaceholderError, match="0 image token"):
        check_image_placeholders([1, 2], 1, 7)
    with pytest.raises(ImagePlaceholderError, match="takes no images"):
        check_image_placeholders([1, 2], 1, None)


async def test_group_keeps_expanded_prompt_ids_and_image_keys(vllm_vl_engine, tiny_vl_model_dir):
    await vllm_vl_engine.reset_weights(tiny_vl_model_dir)
    ctx = FakeContext(stage="rollout", transport=MemoryTransport())
    stage = Rollout(rollout_cfg(), tiny_vl_model_dir, engine=vllm_vl_engine)
    await stage.start(ctx)
    row = load_dataset("shapes", size=1, seed=11)[0]
    task = await image_task(ctx, row)
    trajectories = trajectories_in((await stage.handle(task, ctx)).outputs)
    assert len(trajectories) == 4
    pad = vllm_vl_engine.image_token_id
    raw = vllm_vl_engine.encode_prompt(row["messages"])
    assert raw.count(pad) == 1
    for t in trajectories:
        ids = t.prompt_token_ids().tolist()
        assert ids.count(pad) == 4 and len(ids) == len(raw) + 3  # 56 x 56 -> 2 x 2 merged patches
        assert t.images == task.images and len(t.completion_token_ids()) > 0
    assert ctx.transport.blobs_stored == 1  # the group's 4 requests share one stored image


async def test_pre_expanded_ids_are_refused_and_the_image_changes_the_samples(vllm_vl_engine, tiny_vl_model_dir):
    from data.media import pil_images

    await vllm_vl_engine.reset_weights(tiny_vl_model_dir)
    rows = load_dataset("shapes", size=40, seed=12)
    a = rows[0]
    b = next(r for r in rows if r["messages"] == a["messages"] and r["solution"] != a["solution"])
    ids = vllm_vl_engine.encode_prompt(a["messages"])
    first = await vllm_vl_engine.generate(ids, request_id="vl-a", seed=3, max_tokens=4, images=pil_images(a["images"]))
    with pytest.raises(ImagePlaceholderError, match="already expanded"):
        await vllm_vl_engine.generate(first.prompt_ids, request_id="vl-x", seed=3, max_tokens=4,
                                      images=pil_images(a["images"]))
    again = await vllm_vl_engine.generate(ids, request_id="vl-a2", seed=3, max_tokens=4, images=pil_images(a["images"]))
    other = await vllm_vl_engine.generate(ids, request_id="vl-b", seed=3, max_tokens=4, images=pil_images(b["images"]))
    assert again.logprobs == first.logprobs
    assert other.logprobs[0] != first.logprobs[0] or other.completion_ids != first.completion_ids

"""Images in a later turn: a scheduler adds a second picture in turn 2; engine and learner see both."""

from __future__ import annotations

import pytest
import torch

from config import config_from_dict
from data.loading import load_dataset, shapes_image
from engines.base import expand_image_tokens
from pipeline.records import ScoredTrajectory, TrajectoryGroup
from pipeline.transport.memory import MemoryTransport
from schedulers import MultiTurnScheduler, multi_turns
from stages.rollout import Rollout
from tests.fake_context import FakeContext
from tests.test_vl_rollout import image_task
from trainer.model import Batch, VisionInputs, completion_logps, load_model

pytestmark = pytest.mark.e2e

SECOND = shapes_image(("yellow", 3), ("green", 0))


class SecondPicture(MultiTurnScheduler):
    """Turn 1 answers about the row's picture; then the user shows another one."""

    def check_finished(self, infer_request, response_choice, current_turn):
        return current_turn >= 2

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append(
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the square?"}]})
        infer_request.images.append(SECOND)
        return {"infer_request": infer_request}


def test_expand_image_tokens():
    assert expand_image_tokens([1, 7, 2, 7], 7, [2, 3]) == [[1], [7, 7], [2], [7, 7, 7]]
    assert expand_image_tokens([7, 5], 7, [2, 4], start=1) == [[7, 7, 7, 7], [5]]


async def test_an_image_added_in_turn_two_reaches_engine_and_learner(vllm_vl_engine, tiny_vl_model_dir, monkeypatch):
    from transformers import AutoImageProcessor

    monkeypatch.setitem(multi_turns, "vl_second_picture", SecondPicture)
    await vllm_vl_engine.reset_weights(tiny_vl_model_dir)
    cfg = config_from_dict({
        "grpo": {"max_completion_length": 6},
        "rollout": {"max_concurrent_groups": 4, "max_model_len": 256, "limit_mm_per_prompt": {"image": 2},
                    "multi_turn_scheduler": "vl_second_picture", "max_turns": 2, "loss_scale": "default",
                    "use_gym_env": False},
        "reward": {"reward_funcs": ["accuracy"], "on_error": "dead_letter"},
    })
    ctx = FakeContext(stage="rollout", transport=MemoryTransport())
    stage = Rollout(cfg, tiny_vl_model_dir, engine=vllm_vl_engine)
    await stage.start(ctx)
    row = load_dataset("shapes", size=1, seed=31)[0]
    task = await image_task(ctx, row, seed=9, generations=4)
    (_, group), = (await stage.handle(task, ctx)).outputs
    assert isinstance(group, TrajectoryGroup) and len(group.trajectories) == 4
    pad = vllm_vl_engine.image_token_id
    for t in group.trajectories:
        assert len(t.images) == 2 and t.images[0] == task.images[0]
        assert t.prompt_token_ids().tolist().count(pad) == 4
        completion, mask = t.completion_token_ids().tolist(), t.completion_loss_mask().tolist()
        assert completion.count(pad) == 4 and all(m == 0 for c, m in zip(completion, mask) if c == pad)
        assert sum(mask) > 0 and t.rollout_infos["num_turns"] == 2
    assert ctx.transport.blobs_stored == 2  # the row's picture (feeder side) and the turn-2 one, once each
    # The learner, with both pictures, reproduces the engine's log-probs of both turns' sampled tokens.
    processor = AutoImageProcessor.from_pretrained(str(tiny_vl_model_dir))
    model = load_model(tiny_vl_model_dir, torch.float32).eval()
    images = {k: await ctx.transport.get_blob(k) for k in group.trajectories[0].images}
    scored = [ScoredTrajectory(trajectory=t, rewards={}, reward=0.0) for t in group.trajectories]
    batch = Batch(scored, [0.0] * 4, pad_id=0, vision=VisionInputs(processor, pad, images), learner_version=0)
    with torch.no_grad():
        logps = completion_logps(model, batch, temperature=1.0)
    mask = batch.completion_mask > 0
    assert float((logps - batch.rollout_logps).abs()[mask].max()) < 1e-4

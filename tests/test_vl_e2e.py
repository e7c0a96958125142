"""End to end on image prompts: configs/vl-demo.toml with the tiny Qwen2-VL, real vLLM, real learner."""

from __future__ import annotations

import json
import uuid

import pytest

from config import load_config
from pipeline.transport.memory import MemoryTransport
from rollstream import train as graph

pytestmark = pytest.mark.e2e

STEPS = 64  # 16 generation batches of 64 samples (8 prompt groups), 4 optimizer steps each


async def test_vl_demo_learns_on_policy_with_images_stored_once(tmp_path, vllm_vl_engine, tiny_vl_model_dir):
    await vllm_vl_engine.reset_weights(tiny_vl_model_dir)
    cfg = load_config("configs/vl-demo.toml", [
        f"run.output_dir={json.dumps(str(tmp_path))}", f"run.max_steps={STEPS}",
        f"run.name=vl-e2e-{uuid.uuid4().hex[:6]}",
    ])
    transport = MemoryTransport()
    result = await graph.run_pipeline(cfg, engine=vllm_vl_engine, transport=transport)
    assert result.exit_code == 0
    rows = [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # max_staleness 0: every sample comes from the learner's weights, so engine and learner agree (fp32)
    assert max(r["sampling/sampling_logp_difference/max"] for r in rows) < 1e-4
    assert max(r["sampling/sampling_logp_difference/mean"] for r in rows) < 1e-5
    accuracy = [r["rewards/accuracy/mean"] for r in rows]
    quarter = STEPS // 4
    assert sum(accuracy[-quarter:]) / quarter > sum(accuracy[:quarter]) / quarter
    completions = [json.loads(line) for line in (result.output_dir / "completions.jsonl").read_text().splitlines()]
    assert len(completions) == (STEPS // 4) * cfg.grpo.generation_batch_size
    keys = {k for c in completions for k in c["images"]}
    assert all(len(c["images"]) == 1 for c in completions)
    # Each distinct image crossed the transport once (content-addressed), not once per generation.
    assert transport.blobs_stored == len(keys)
    assert (result.output_dir / "final" / "preprocessor_config.json").is_file()


async def test_vl_run_over_redis_stores_each_image_once_under_the_run(tmp_path, vllm_vl_engine, tiny_vl_model_dir,
                                                                      redis_url):
    from pipeline.transport import connect

    await vllm_vl_engine.reset_weights(tiny_vl_model_dir)
    run = f"vl-e2e-redis-{uuid.uuid4().hex[:8]}"
    cfg = load_config("configs/vl-demo.toml", [
        f"run.output_dir={json.dumps(str(tmp_path))}", "run.max_steps=16", f"run.name={run}",
        "transport.kind=redis", f"transport.url={redis_url}", "transport.blob_ttl_s=600",
    ])
    transport = await connect("redis", run=run, url=redis_url)
    try:
        result = await graph.run_pipeline(cfg, engine=vllm_vl_engine)
        assert result.exit_code == 0
        rows = [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
        assert len(rows) == 16 and max(r["sampling/sampling_logp_difference/max"] for r in rows) < 1e-4
        completions = [json.loads(line) for line in (result.output_dir / "completions.jsonl").read_text().splitlines()]
        keys = {k for c in completions for k in c["images"]}
        stored = [k async for k in transport._client.scan_iter(match=f"rollstream:{run}:blob:*")]
        assert sorted(k.decode().rpartition(":blob:")[2] for k in stored) == sorted(keys)
        for key in stored:
            assert 0 < await transport._client.ttl(key) <= 600
    finally:
        await transport.delete_run()
        await transport.close()

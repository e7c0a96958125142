"""End to end: the five stages, the tiny model, real vLLM (one shared engine), real torch learning.

Marked ``e2e`` (select with ``-m e2e``, skip with ``-m 'not e2e'``).
"""

from __future__ import annotations

import json
import uuid

import pytest

from config import load_config
from rollstream import train

pytestmark = pytest.mark.e2e

STEPS = 64  # 16 generation batches of 64 samples, 4 optimizer steps each


def e2e_config(tmp_path, *extra):
    return load_config(
        "configs/demo.toml",
        [f"run.output_dir={json.dumps(str(tmp_path))}", f"run.max_steps={STEPS}", "rollout.max_model_len=256", *extra],
    )


def curve(output_dir):
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, [r["rewards/accuracy/mean"] for r in rows]


async def test_memory_transport_run_learns(tmp_path, vllm_engine):
    cfg = e2e_config(tmp_path, f"run.name=e2e-mem-{uuid.uuid4().hex[:6]}")
    result = await train.run_pipeline(cfg, engine=vllm_engine)
    assert result.exit_code == 0
    rows, acc = curve(result.output_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[-1]["policy_version"] == STEPS // 4
    # a real learning signal: the last quarter of steps beats the first quarter
    quarter = STEPS // 4
    assert sum(acc[-quarter:]) / quarter > sum(acc[:quarter]) / quarter
    assert max(r["staleness/max"] for r in rows) <= cfg.grpo.max_staleness
    assert (result.output_dir / "final" / "model.safetensors").exists()
    completions = (result.output_dir / "completions.jsonl").read_text().splitlines()
    assert len(completions) == (STEPS // 4) * cfg.grpo.generation_batch_size


async def test_redis_transport_run_learns_and_leaves_nothing_pending(tmp_path, vllm_engine, redis_url):
    from pipeline.transport import connect
    from stages import CONSUMER_GROUPS

    run = f"e2e-redis-{uuid.uuid4().hex[:8]}"
    cfg = e2e_config(tmp_path, f"run.name={run}", "transport.kind=redis", f"transport.url={redis_url}")
    transport = await connect("redis", run=run, url=redis_url)
    try:
        result = await train.run_pipeline(cfg, engine=vllm_engine)
        assert result.exit_code == 0
        rows, acc = curve(result.output_dir)
        assert len(rows) == STEPS
        quarter = STEPS // 4
        assert sum(acc[-quarter:]) / quarter > sum(acc[:quarter]) / quarter
        for edge, group in CONSUMER_GROUPS.items():
            stats = await transport.stats(edge, group)
            assert stats.pending == 0, f"{edge} has {stats.pending} pending entries"
        dead = await transport.stats("dead")
        assert dead.length == 0
    finally:
        await transport.delete_run()
        await transport.close()


async def test_on_policy_text_run_logs_the_sampling_logp_difference(tmp_path, vllm_engine, tiny_model_dir):
    """TRL's sampling/sampling_logp_difference on a text run: at max_staleness 0 every sample comes from the
    learner's weights, and fp32 vLLM and the fp32 learner agree on the sampled tokens' log-probs."""
    await vllm_engine.reset_weights(tiny_model_dir)
    cfg = load_config("configs/demo.toml", [
        f"run.output_dir={json.dumps(str(tmp_path))}", "run.max_steps=16", "rollout.max_model_len=256",
        "grpo.max_staleness=0", f"run.name=e2e-logp-{uuid.uuid4().hex[:6]}",
    ])
    result = await train.run_pipeline(cfg, engine=vllm_engine)
    assert result.exit_code == 0
    rows, _ = curve(result.output_dir)
    assert len(rows) == 16
    assert max(r["sampling/sampling_logp_difference/max"] for r in rows) < 1e-4

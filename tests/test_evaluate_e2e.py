"""Evaluation while training against the real engine (the session's shared vLLM engine, tiny model):
skipping to the newest version when behind, evaluation at the configured versions in `train` on both
transports (with its own engine, and sharing the rollout's), a separate evaluate worker, and
`rollstream eval` reproducing the in-run numbers."""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from pathlib import Path

import pytest
from fake_context import FakeContext
from polling import wait_until

from config import load_config
from data import loading
from pipeline.records import WeightsPublished
from rollstream import train as graph
from rollstream.evaluate_offline import run_offline
from stages.evaluate import Evaluate, is_due

pytestmark = pytest.mark.e2e

STEPS = 16  # 4 generation batches of 4 optimizer steps: policy versions 1..4
EVAL = [
    "data.split_dataset_ratio=0.05",
    "eval.eval_steps=2",
    "eval.eval_limit=4",
    "eval.eval_num_generations=4",
    "eval.per_device_eval_batch_size=8",
]


def eval_config(tmp_path, *extra):
    return load_config(
        "configs/demo.toml",
        [
            f"run.output_dir={json.dumps(str(tmp_path))}",
            f"run.max_steps={STEPS}",
            "rollout.max_model_len=256",
            *EVAL,
            *extra,
        ],
    )


def eval_rows(output_dir):
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("split") == "eval"], [r for r in rows if r.get("split") != "eval"]


async def test_an_evaluation_behind_training_skips_to_the_newest_version(
    tmp_path, vllm_engine, tiny_model_dir
):
    cfg = eval_config(tmp_path, "run.name=eval-skip")
    await vllm_engine.reset_weights(tiny_model_dir)
    stage = Evaluate(
        cfg, tiny_model_dir, loading.load_eval_rows(cfg), tmp_path, engine=vllm_engine, shared=False
    )
    ctx = FakeContext("eval-test", "evaluate", "evaluate-test")
    await stage.start(ctx)
    try:
        announce = lambda v, final=False: WeightsPublished(
            version=v, path=str(tiny_model_dir), step=4 * v, final=final
        )
        await stage.on_broadcast(announce(2), ctx)
        await wait_until(lambda: stage.claimed == 2, timeout_s=120)  # version 2 is being evaluated
        # Training runs ahead: versions 4 and 6 arrive while 2 is still sampling, then the final 7.
        for version, final in ((4, False), (6, False), (7, True)):
            await stage.on_broadcast(announce(version, final), ctx)
        await wait_until(lambda: ctx.stopping, timeout_s=120)
    finally:
        await stage.close()
    assert [r["policy_version"] for r in stage.results] == [2, 7]
    assert stage.skipped_versions == 2  # 4 and 6
    assert stage.results[-1]["eval_skipped_versions"] == 2
    assert "final version 7" in ctx.stop_reason
    written, _ = eval_rows(tmp_path)
    assert [r["policy_version"] for r in written] == [2, 7]
    assert written[0]["eval_samples"] == 4 * 4
    assert written[0]["eval_prompts"] == 4


async def test_a_sigterm_mid_evaluation_exits_0_at_once_and_releases_what_it_held(
    tmp_path, vllm_engine, tiny_model_dir
):
    """SIGTERM while a version is being evaluated: evaluation never holds anything up, so the worker drops
    it (no half row is written), releases its weights lease and exits 0; the engine it used still serves."""
    from pipeline.records import encode
    from pipeline.transport.memory import MemoryTransport
    from stages import WEIGHTS

    cfg = eval_config(tmp_path, "run.name=eval-sigterm")
    await vllm_engine.reset_weights(tiny_model_dir)
    stage = Evaluate(cfg, tiny_model_dir, loading.load_eval_rows(cfg), tmp_path, engine=vllm_engine, shared=False)
    transport = MemoryTransport()
    worker = graph.make_worker(stage, transport, cfg, worker_id="evaluate-sigterm")
    serving = asyncio.create_task(worker.serve())
    await transport.produce(WEIGHTS, [encode(WeightsPublished(version=2, path=str(tiny_model_dir), step=8))])
    await wait_until(lambda: stage.evaluating == 2, timeout_s=120)
    worker.request_stop("signal SIGTERM")  # what the worker's SIGTERM handler does
    assert await asyncio.wait_for(serving, timeout=60) == 0
    assert stage.results == [] and not (tmp_path / "metrics.jsonl").exists()
    assert await transport.leases(WEIGHTS) == {}
    after = Evaluate(cfg, tiny_model_dir, loading.load_eval_rows(cfg), tmp_path, engine=vllm_engine, shared=False)
    await after.prepare(("eval-test", "evaluate", "evaluate-test"))
    row = await after.evaluate(WeightsPublished(version=2, path=str(tiny_model_dir), step=8))
    assert row["eval_samples"] == 4 * 4
    await after.close()


def thread_priorities(pid: int) -> set[tuple[int, int]]:
    """(nice value, scheduling policy) of every thread of ``pid`` (fields 19 and 41 of /proc/PID/task/TID/stat)."""
    values = set()
    for task in (Path(f"/proc/{pid}/task")).iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        values.add((int(fields[16]), int(fields[38])))
    return values


async def test_train_evaluates_the_configured_versions_and_eval_reproduces_them(
    tmp_path, vllm_engine, monkeypatch
):
    from engines import vllm_engine as engines_vllm

    lowered = []  # (pid, its threads' priorities) for each engine process whose priority was lowered

    def lower_and_look(pids, nice):
        lower_cpu_priority(pids, nice)
        lowered.extend((pid, thread_priorities(pid)) for pid in pids)

    lower_cpu_priority = engines_vllm.lower_cpu_priority
    monkeypatch.setattr(engines_vllm, "lower_cpu_priority", lower_and_look)
    cfg = eval_config(tmp_path, f"run.name=eval-mem-{uuid.uuid4().hex[:6]}")
    own_nice = os.getpriority(os.PRIO_PROCESS, 0)
    result = await graph.run_pipeline(cfg, engine=vllm_engine)
    assert result.exit_code == 0
    # evaluation's own engine computes at nice 19 (eval.engine_nice) in the idle class: only on CPU time
    # training leaves idle
    assert len(lowered) == 1 and lowered[0][1] == {(19, os.SCHED_IDLE)}
    assert os.getpriority(os.PRIO_PROCESS, 0) == own_nice  # training's process keeps its priority
    assert os.sched_getscheduler(0) == os.SCHED_OTHER
    evals, steps = eval_rows(result.output_dir)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))  # training finished whole
    due = [v for v in range(1, STEPS // 4 + 1) if is_due(v, 2, final=v == STEPS // 4)]
    # Its own engine (the default): version 2 is evaluated while training goes on, the final 4 after it;
    # nothing to skip, since at most one due version (4) arrives while 2 is evaluated.
    assert [r["policy_version"] for r in evals] == due == [2, 4]
    assert evals[-1]["eval_skipped_versions"] == 0
    assert all(r["eval_samples"] == 16 and "eval_pass@4" in r for r in evals)
    assert result.summary["eval_last"] == evals[-1]["eval_rewards/accuracy/mean"]
    # `rollstream eval` on the saved snapshot: same prompts, seeds and rewards, same numbers.
    offline = await run_offline(cfg, f"{result.output_dir}:4", tmp_path / "eval.json", engine=vllm_engine)
    in_run = evals[-1]
    for key in (
        "eval_reward",
        "eval_reward_std",
        "eval_rewards/accuracy/mean",
        "eval_pass@1",
        "eval_completions/mean_length",
    ):
        assert offline[key] == pytest.approx(in_run[key]), key
    assert json.loads((tmp_path / "eval.json").read_text())["policy_version"] == 4


async def test_redis_run_and_a_separate_evaluate_worker(tmp_path, vllm_engine, tiny_model_dir, redis_url):
    from pipeline.transport import connect

    run = f"eval-redis-{uuid.uuid4().hex[:8]}"
    cfg = eval_config(
        tmp_path,
        f"run.name={run}",
        "transport.kind=redis",
        f"transport.url={redis_url}",
        "eval.share_rollout_engine=true",
    )
    transport = await connect("redis", run=run, url=redis_url)
    try:
        result = await graph.run_pipeline(cfg, engine=vllm_engine)
        assert result.exit_code == 0
        evals, _ = eval_rows(result.output_dir)
        # Sharing the rollout engine: version 2 is evaluated only if its weights held for the whole
        # evaluation (else skipped, counted); the final 4 always, once training is done.
        evaluated = [r["policy_version"] for r in evals]
        assert evaluated[-1] == 4 and set(evaluated) <= {2, 4}
        assert len(evaluated) + evals[-1]["eval_skipped_versions"] == 2
        # A late evaluate worker with its own engine (the Procfile's): it reads every announcement, skips
        # to the newest due version (the final one), evaluates it and stops, with the in-run numbers.
        await vllm_engine.reset_weights(tiny_model_dir)
        late_dir = tmp_path / "late"
        late_dir.mkdir()
        stage = Evaluate(
            cfg, tiny_model_dir, loading.load_eval_rows(cfg), late_dir, engine=vllm_engine, shared=False
        )
        worker = graph.make_worker(stage, transport, cfg, worker_id="evaluate-late")
        assert await asyncio.wait_for(worker.serve(), timeout=300) == 0
        assert [r["policy_version"] for r in stage.results] == [4]
        assert stage.skipped_versions == 1  # version 2
        for key in ("eval_reward", "eval_rewards/accuracy/mean", "eval_pass@4"):
            assert stage.results[0][key] == pytest.approx(evals[-1][key]), key
    finally:
        await transport.delete_run()
        await transport.close()

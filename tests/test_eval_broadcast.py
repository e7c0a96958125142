"""Evaluation under rollout.weight_transport = "broadcast" (#29): there are no snapshot files, so the evaluate
stage's own engine is a member of the weights group (role "eval"). It loads only the versions it evaluates,
with exactly the learner's weights, and never holds the learner's announcements back: a round that comes
during an evaluation is answered at once (the due version is skipped and counted), and the run's final
version cancels the running evaluation and is evaluated."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import pytest
from polling import wait_until
from test_broadcast import _engine_logprobs, perturbed_state
from test_evaluate_e2e import EVAL

from config import load_config
from data import loading
from pipeline.edges import WEIGHTS
from pipeline.records import WeightsPublished, encode
from rollstream import train as graph
from stages.evaluate import Evaluate

pytestmark = pytest.mark.e2e



def broadcast_eval_config(tmp_path, *extra):
    return load_config("configs/demo.toml", [
        f"run.output_dir={json.dumps(str(tmp_path))}", "rollout.max_model_len=256",
        "rollout.weight_transport=broadcast", "rollout.weight_sync_timeout_s=20", "rollout.weight_sync_chunk_mb=0.25",
        f"run.name=evbc-{uuid.uuid4().hex[:6]}", *EVAL, *extra,
    ])


class Learner:
    """The learner's end of the weights group (a Coordinator in its own Worker on the run's transport),
    sending the tiny model's weights perturbed per version, and announcing versions as the learner does."""

    def __init__(self, transport, cfg, tiny_model_dir) -> None:
        self.transport, self.cfg, self.model_dir = transport, cfg, tiny_model_dir
        self.states: dict[int, dict] = {}
        self.current = 0

    async def start(self) -> None:
        from pipeline.worker import Worker
        from weights.membership import MEMBER_LEASE, Coordinator, CoordinatorStage
        from weights.sender import BroadcastSender, state_layout

        first = perturbed_state(self.model_dir, seed=100)
        self.sender = BroadcastSender(lambda: self.states[self.current], state_layout(first), chunk_bytes=256 * 1024,
                                      timeout_s=20)
        self.stage = CoordinatorStage(lambda ctx: Coordinator(
            self.sender, lambda: ctx.leases(MEMBER_LEASE), address="127.0.0.1", timeout_s=20, run=self.cfg.run.name))
        self.worker = Worker(self.stage, self.transport, run=self.cfg.run.name, block_ms=100)
        self.task = asyncio.create_task(self.worker.serve())
        await self.stage.started.wait()

    async def publish(self, version: int, final: bool = False):
        """One round; returns (its result, the seconds until every member loaded it): what the learner waits
        for before it announces the version."""
        self.states[version] = perturbed_state(self.model_dir, seed=100 + version)
        self.current = version
        started = time.monotonic()
        result = await self.stage.coordinator.publish(version, wait_loaded=True, final=final)
        assert result.delivered, result
        return result, time.monotonic() - started

    async def announce(self, version: int, epoch: int, final: bool = False) -> None:
        await self.transport.produce(WEIGHTS, [encode(WeightsPublished(
            version=version, path=f"broadcast://epoch/{epoch}", via="broadcast", epoch=epoch, step=4 * version,
            final=final))])

    async def stop(self) -> None:
        self.worker.request_stop("test over")
        await self.task


def test_an_evaluator_on_the_rollout_servers_is_refused_under_broadcast(tmp_path, tiny_model_dir):
    """Its own engine would be the rollout's vLLM servers, loaded by the rollout worker: the config refuses
    it unless evaluation shares the rollout's engine, and an evaluate stage of its own is refused when built."""
    from config import ConfigError
    from pipeline.errors import SetupError

    servers = ("rollout.engine=server", 'rollout.server_urls=["http://127.0.0.1:8000"]')
    with pytest.raises(ConfigError, match="eval.share_rollout_engine = true"):
        broadcast_eval_config(tmp_path, *servers)
    cfg = broadcast_eval_config(tmp_path, *servers, "eval.share_rollout_engine=true")
    with pytest.raises(SetupError, match="shares the rollout's engine only within `rollstream train`"):
        Evaluate(cfg, tiny_model_dir, [], tmp_path)  # an evaluate worker with an engine of its own
    Evaluate(cfg, tiny_model_dir, [], tmp_path, engine=object(), shared=True)  # sharing the rollout's: allowed


async def test_the_eval_engine_loads_only_what_it_evaluates_and_never_holds_the_learner(
    tmp_path, vllm_engine, tiny_model_dir
):
    """The evaluate stage's own engine joins the group. Version 1 (not due) is received and dropped; version 2
    is loaded, bit-exact, and evaluated. While version 2's evaluation is held open (its scoring waits on an
    event), versions 3 and 4 go to the group and every member's load answer comes at once: 4 is skipped and
    counted, the engine keeps version 2. Version 6 is evaluated next; the final version 7 comes during
    that evaluation, cancels it (6 skipped), is loaded and evaluated, and the worker stops."""
    from safetensors.torch import save_file

    from pipeline.transport.memory import MemoryTransport

    cfg = broadcast_eval_config(tmp_path)
    await vllm_engine.reset_weights(tiny_model_dir)
    transport = MemoryTransport()
    learner = Learner(transport, cfg, tiny_model_dir)
    await learner.start()
    stage = Evaluate(cfg, tiny_model_dir, loading.load_eval_rows(cfg), tmp_path, engine=vllm_engine, shared=False)
    assert stage.joins
    scoring_open = asyncio.Event()
    scoring_reached = asyncio.Event()
    score = stage.scorer.score_requests

    async def held_scoring(groups):  # an evaluation as slow as the test wants: it ends when the event is set
        scoring_reached.set()
        await scoring_open.wait()
        return await score(groups)

    stage.scorer.score_requests = held_scoring
    worker = graph.make_worker(stage, transport, cfg, worker_id="evaluate-bc")
    serving = asyncio.create_task(worker.serve())
    logprobs = {}
    try:
        async def joined() -> bool:
            return [m.role for m in await learner.stage.coordinator.live_members()] == ["eval"]

        await wait_until(joined, "the eval engine registered in the weights group", timeout_s=60, interval_s=0.05)
        first, _ = await learner.publish(1)
        assert first.members == 1 and vllm_engine.version == 0  # not due: received and dropped

        second, _ = await learner.publish(2)
        assert vllm_engine.version == 2
        logprobs[2] = await _engine_logprobs(vllm_engine)
        await learner.announce(2, second.epoch)
        await asyncio.wait_for(scoring_reached.wait(), timeout=120)
        assert stage.evaluating == 2

        for version in (3, 4):  # during version 2's evaluation: answered at once, nothing loaded
            result, seconds = await learner.publish(version)
            assert result.attempts == 1 and seconds < 10, (version, seconds)
            assert not scoring_open.is_set() and stage.evaluating == 2 and vllm_engine.version == 2
            await learner.announce(version, result.epoch)
        assert stage.skipped_versions == 1  # 4 (3 is not due)

        scoring_reached.clear()
        scoring_open.set()  # version 2's evaluation ends, its row is written
        await wait_until(lambda: len(stage.results) == 1, "version 2 evaluated", timeout_s=120)
        scoring_open.clear()
        assert stage.skipped_versions == 1  # the announcement of 4 did not count it again

        sixth, _ = await learner.publish(6)
        assert vllm_engine.version == 6
        await learner.announce(6, sixth.epoch)
        await asyncio.wait_for(scoring_reached.wait(), timeout=120)
        scoring_reached.clear()
        final, seconds = await learner.publish(7, final=True)  # cancels version 6's evaluation
        assert seconds < 10 and vllm_engine.version == 7 and not scoring_open.is_set()
        logprobs[7] = await _engine_logprobs(vllm_engine)
        await learner.announce(7, final.epoch, final=True)
        await asyncio.wait_for(scoring_reached.wait(), timeout=120)
        scoring_open.set()
        assert await asyncio.wait_for(serving, timeout=120) == 0  # it stops after the final version
    finally:
        if not serving.done():
            worker.request_stop("test over")
            await asyncio.gather(serving, return_exceptions=True)
        await learner.stop()
    assert [r["policy_version"] for r in stage.results] == [2, 7]
    assert stage.skipped_versions == 2 and stage.results[-1]["eval_skipped_versions"] == 2  # 4, 6
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == [2, 7] and rows[0]["eval_samples"] == 16

    # The engine held exactly the learner's weights: its log-probs equal those after loading them from a file.
    try:
        for version in (2, 7):
            weights_dir = tmp_path / f"v{version}"
            weights_dir.mkdir()
            save_file(learner.states[version], str(weights_dir / "model.safetensors"))
            await vllm_engine.reset_weights(tiny_model_dir)
            await vllm_engine.load_weights(weights_dir, version)
            assert await _engine_logprobs(vllm_engine) == logprobs[version], version
            # and the evaluation of the file's weights gives the in-run row
            offline = Evaluate(cfg, tiny_model_dir, loading.load_eval_rows(cfg), None, engine=vllm_engine, shared=False)
            await offline.prepare((cfg.run.name, "evaluate", "offline"))
            row = await offline.evaluate(WeightsPublished(version=version, path=str(weights_dir)), "offline")
            await offline.close()
            in_run = stage.results[[2, 7].index(version)]
            for key in ("eval_reward", "eval_rewards/accuracy/mean", "eval_completions/mean_length"):
                assert row[key] == pytest.approx(in_run[key]), (version, key)
    finally:
        await vllm_engine.reset_weights(tiny_model_dir)


@pytest.mark.parametrize("share", ["false", "true"])
async def test_train_on_broadcast_evaluates(tmp_path, vllm_engine, tiny_model_dir, share):
    """`rollstream train` with weights by broadcast and evaluation on its own engine (a member of the group)
    or on the rollout's (eval.share_rollout_engine = true; a member already): the due versions are evaluated
    or skipped with a count, the final one always, with the numbers of an evaluation of the same weights from
    the final file."""
    cfg = broadcast_eval_config(tmp_path, "run.max_steps=16", f"eval.share_rollout_engine={share}")
    await vllm_engine.reset_weights(tiny_model_dir)
    result = await graph.run_pipeline(cfg, engine=vllm_engine)
    assert result.exit_code == 0
    rows = [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r.get("split") == "eval"]
    assert [r["step"] for r in rows if r.get("split") != "eval"] == list(range(1, 17))
    evaluated = [r["policy_version"] for r in evals]
    assert evaluated[-1] == 4 and set(evaluated) <= {2, 4}
    assert len(evaluated) + evals[-1]["eval_skipped_versions"] == 2  # 2 evaluated, or skipped and counted
    assert not (result.output_dir / "weights").exists()  # no snapshot: the weights went over the group
    final_dir = result.output_dir / "final"
    await vllm_engine.reset_weights(tiny_model_dir)  # it holds version 4 by broadcast: now from the file
    offline = Evaluate(cfg, tiny_model_dir, loading.load_eval_rows(cfg), None, engine=vllm_engine, shared=False)
    try:
        await offline.prepare((cfg.run.name, "evaluate", "offline"))
        row = await offline.evaluate(WeightsPublished(version=4, path=str(final_dir)), "offline")
        await offline.close()
        for key in ("eval_reward", "eval_rewards/accuracy/mean", "eval_completions/mean_length"):
            assert row[key] == pytest.approx(evals[-1][key]), key
    finally:
        await vllm_engine.reset_weights(tiny_model_dir)

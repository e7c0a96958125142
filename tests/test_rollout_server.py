"""Server mode against a real ``vllm serve`` process (OpenAI-compatible API server, dev mode for weight
reloads): token ids and logprobs the learner reproduces, failover past a dead server, multi-turn, and a
weight reload through the server's routes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import torch
from fake_context import FakeContext

from config import config_from_dict
from engines.server_engine import ServerEngine
from engines.weight_loader import WORKER_EXTENSION
from pipeline.records import PromptTask, ScoredTrajectory, trajectories_in
from stages.rollout import Rollout
from trainer.model import Batch, completion_logps
from weights.snapshots import save_weights_atomically

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[1]
# Start-up is 22-28 s on an idle machine; with the 2 cores shared by several test runs it took over 240 s.
SERVER_START_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, log_path: Path, deadline: float) -> None:
    """Until the `vllm serve` at ``url`` answers /health (its log's tail if it exits, or at the deadline)."""
    while True:
        assert proc.poll() is None, f"vllm serve exited: {log_path.read_text()[-3000:]}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"vllm serve did not come up in {SERVER_START_S} s"
        time.sleep(0.5)  # polling a starting process with a deadline


@contextlib.contextmanager
def running_server(model_dir, scratch):
    """A real ``vllm serve`` (dev mode, our worker extension) on a free port; yields (url, process)."""
    scratch.mkdir(parents=True, exist_ok=True)
    # vLLM's IPC sockets live in TMPDIR, whose path must be short (a Unix socket path: 107 bytes); pytest's
    # tmp_path under pytest-xdist is too long for one.
    sockets = Path(tempfile.mkdtemp(prefix="rs-srv-"))
    port = free_port()
    # The session's vLLM cache (conftest): a server's own would inspect the model's architecture again in a
    # subprocess. TORCHDYNAMO_DISABLE as the engine starts its own (engines.vllm_engine.eager_engine_process).
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TORCHDYNAMO_DISABLE": "1",
           "TMPDIR": str(sockets), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--max-model-len", "256", "--enforce-eager", "--no-enable-chunked-prefill",
           "--worker-extension-cls", WORKER_EXTENSION, "--logprobs-mode", "processed_logprobs"]
    with open(scratch / "server.log", "w") as log:
        # Its own process group: the server's engine-core child outlives a SIGKILLed server otherwise.
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, scratch / "server.log", time.monotonic() + SERVER_START_S)
        yield url, proc
    finally:
        stop_server(proc)
        shutil.rmtree(sockets, ignore_errors=True)


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM a ``vllm serve`` started in its own process group (SIGKILL past 30 s), then whatever is left of
    the group: the server's engine-core child outlives a SIGKILLed server otherwise."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def vllm_server(tiny_model_dir, tmp_path_factory):
    with running_server(tiny_model_dir, tmp_path_factory.mktemp("vllm-server")) as (url, _proc):
        yield url


def cfg(urls, scheduler=None, max_completion_length=12):
    return config_from_dict({
        "grpo": {"max_completion_length": max_completion_length},
        "rollout": {"engine": "server", "server_urls": urls, "server_timeout_s": 60.0, "max_concurrent_groups": 4,
                    "max_model_len": 256, "multi_turn_scheduler": scheduler, "max_turns": 2, "loss_scale": "default"},
        "reward": {"reward_funcs": ["accuracy"]},
    })


def task(seed=40, min_policy_version=0):
    return PromptTask(prompt_id="e0:9", generation_batch=0, num_generations=4,
                      messages=[{"role": "user", "content": "What is 2+5?"}], data_dict={"solution": "no"},
                      seed=seed, min_policy_version=min_policy_version)


def assert_learner_agrees(model, trajectories):
    scored = [ScoredTrajectory(trajectory=t, rewards={}, reward=0.0) for t in trajectories]
    with torch.no_grad():
        logps = completion_logps(model.eval(), Batch(scored, [0.0] * len(scored), pad_id=0), temperature=1.0)
    for i, t in enumerate(trajectories):
        mask = torch.from_numpy(t.completion_loss_mask().copy()).bool()
        engine = torch.from_numpy(t.completion_logprobs().copy())
        assert mask.any() and torch.allclose(logps[i, : len(mask)][mask], engine[mask], atol=2e-4)


async def test_server_mode(vllm_server, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: every request sent there fails over
    stage = Rollout(cfg([dead, vllm_server]), tiny_model_dir)
    await stage.start(FakeContext(run='srv', stage='rollout'))
    engine = stage.engine
    assert isinstance(engine, ServerEngine) and engine.model_name == "tiny"
    try:
        first = trajectories_in((await stage.handle(task(), FakeContext(run='srv', stage='rollout'))).outputs)
        assert len(first) == 4 and engine.retries >= 1
        again = trajectories_in((await stage.handle(task(), FakeContext(run='srv', stage='rollout'))).outputs)  # seeded: another server gives the same
        assert [t.completion_ids for t in again] == [t.completion_ids for t in first]
        model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
        assert_learner_agrees(model, first)

        multi = Rollout(cfg([dead, vllm_server], "math_tip_trick_multi_turn"), tiny_model_dir, engine=engine)
        await multi.start(FakeContext(run='srv', stage='rollout'))
        turns = trajectories_in((await multi.handle(task(seed=41), FakeContext(run='srv', stage='rollout'))).outputs)
        assert any(t.rollout_infos["num_turns"] == 2 for t in turns)
        assert_learner_agrees(model, turns)

        torch.manual_seed(2)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.3 * torch.randn_like(p))
        seconds = await engine.load_weights(save_weights_atomically(model, tmp_path / "v1"), 1)
        assert seconds > 0 and engine.version == 1
        after = trajectories_in((await stage.handle(task(min_policy_version=1), FakeContext(run='srv', stage='rollout'))).outputs)
        assert all((t.policy_version, t.max_policy_version) == (1, 1) for t in after)
        assert_learner_agrees(model, after)
    finally:
        # The server is the module's: give it back its own weights, or a later test's seeded samples from it
        # (the mid-request kill compares them with a fresh server's) come from these perturbed ones.
        try:
            await engine.reset_weights(tiny_model_dir)
        finally:
            await engine.client.aclose()


async def test_every_server_down_is_an_error(tiny_model_dir):
    from engines.server_engine import ServerError

    engine = ServerEngine([f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"], "tiny",
                          None, tiny_model_dir, timeout_s=5)
    try:
        with pytest.raises(ServerError, match="every vLLM server failed /v1/completions: .*ConnectError; .*ConnectError"):
            await engine.generate([1, 2, 3], request_id="x", seed=1, max_tokens=4)
    finally:
        await engine.client.aclose()


async def test_a_server_killed_mid_request_loses_nothing(vllm_server, tiny_model_dir, tmp_path):
    """Two real servers; one is SIGKILLed while it holds requests: every request it held is retried on the
    other (same seed, so the same sample), none is lost and the group completes."""
    from pipeline.records import GroupClosed

    generations = 48
    long_task = PromptTask(
        prompt_id="e0:11",
        generation_batch=0,
        num_generations=generations,
        messages=[{"role": "user", "content": "What is 8+8?"}],
        data_dict={"solution": "16"},
        seed=70,
    )
    with running_server(tiny_model_dir, tmp_path / "victim") as (victim, proc):
        # 200 tokens: long enough to be caught mid-generation
        stage = Rollout(cfg([victim, vllm_server], max_completion_length=200), tiny_model_dir)
        await stage.start(FakeContext(run='srv', stage='rollout'))
        engine = stage.engine
        # The victim is frozen (SIGSTOP) just before the client sends it its 8th request, so that request is
        # certainly unanswered when the victim dies; the earlier ones may be generating or done. Without the
        # freeze, a victim that finished its share between our look and the kill made the test flaky.
        sent_to_victim = 0
        frozen = asyncio.Event()

        async def freeze_victim_on_eighth_request(request):
            nonlocal sent_to_victim
            if str(request.url).startswith(victim) and request.url.path == "/v1/completions":
                sent_to_victim += 1
                if sent_to_victim == 8:
                    proc.send_signal(signal.SIGSTOP)
                    frozen.set()

        engine.client.event_hooks["request"].append(freeze_victim_on_eighth_request)
        try:
            handling = asyncio.create_task(stage.handle(long_task, FakeContext(run='srv', stage='rollout')))
            await asyncio.wait_for(frozen.wait(), 120)
            proc.send_signal(signal.SIGKILL)  # dies holding requests: no response, no clean close
            proc.wait(timeout=30)
            handled = await asyncio.wait_for(handling, 300)
            killed_mid_request = engine.retries
        finally:
            await engine.client.aclose()
    [(_, entry)] = handled.outputs  # the group, as one entry
    trajectories, manifest = entry.trajectories, entry.manifest
    assert isinstance(manifest, GroupClosed) and len(trajectories) == generations
    assert manifest.record_ids == [t.record_id for t in trajectories]
    assert killed_mid_request >= 1
    # Each one is the sample its seed gives on the surviving server alone: retried whole, not cut short.
    alone = Rollout(cfg([vllm_server], max_completion_length=200), tiny_model_dir)
    await alone.start(FakeContext(run='srv', stage='rollout'))
    try:
        reference = trajectories_in((await alone.handle(long_task, FakeContext(run='srv', stage='rollout'))).outputs)
    finally:
        await alone.engine.client.aclose()
    assert [t.completion_ids for t in trajectories] == [t.completion_ids for t in reference]
    assert [t.finish_reason for t in trajectories] == [t.finish_reason for t in reference]


def learner_agrees(model, trajectories) -> bool:
    try:
        assert_learner_agrees(model, trajectories)
    except AssertionError:
        return False
    return True


async def test_servers_reload_at_once_so_a_hung_one_holds_no_other_back(vllm_server, tiny_model_dir, tmp_path):
    """The engine's reload goes to every server at once: a server that accepts connections and never answers
    (listed first) does not keep the real one from taking the new weights while its own call is pending."""
    from polling import wait_until
    from transformers import AutoModelForCausalLM

    hung = socket.socket()  # the kernel accepts connections to it; nothing ever answers
    hung.bind(("127.0.0.1", 0))
    hung.listen()
    engine = await ServerEngine.start([vllm_server], tiny_model_dir, timeout_s=60.0)
    engine.urls = [f"http://127.0.0.1:{hung.getsockname()[1]}", vllm_server]
    direct = Rollout(cfg([vllm_server]), tiny_model_dir)  # asks the real server alone
    await direct.start(FakeContext(run='srv', stage='rollout'))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    reload = asyncio.create_task(engine.load_weights(save_weights_atomically(model, tmp_path / "v1"), 1))
    try:

        async def real_server_has_the_new_weights() -> bool:
            return learner_agrees(model, trajectories_in((await direct.handle(task(seed=43), FakeContext(run='srv', stage='rollout'))).outputs))

        await wait_until(real_server_has_the_new_weights, "the real server to take version 1", 120, 0.5)
        assert not reload.done(), "the reload returned although the hung server never answered"
    finally:
        reload.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reload
        try:
            await direct.engine.reset_weights(tiny_model_dir)  # the module's server: its own weights back
        finally:
            await engine.client.aclose()
            await direct.engine.client.aclose()
            hung.close()

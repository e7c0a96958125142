"""Weights by broadcast into `vllm serve` processes (rollout.engine = "server", weight_transport =
"broadcast", #29): each server's vLLM worker is a rank of the learner's one weights group, driven by the
rollout worker through the server's dev-mode routes. Real servers on the tiny model (CPU), started with the
flags docs/weight-sync.md gives; rollstream's backend reaches them through its vllm.general_plugins entry point
(engines/vllm_plugin.py), no --worker-extension-cls."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import pytest
import torch
from fake_context import FakeContext
from polling import wait_until
from test_broadcast import perturbed_state
from test_rollout_server import SERVER_START_S, free_port, stop_server, wait_healthy

from config import config_from_dict
from engines.server_engine import ServerEngine, ServerGone, ServerNotReady

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [1, 5, 9, 13, 2, 7, 11, 3, 17, 4, 8, 21]
TIMEOUT_S = 20.0  # the group's weight_sync_timeout_s



@contextlib.contextmanager
def vllm_servers(model_dir: Path, scratch: Path, count: int = 1, *, dev_mode: bool = True,
                 weight_transfer: bool = True):
    """``count`` real `vllm serve` processes started as docs/weight-sync.md says (engine core and worker in
    processes of their own, vLLM's default), or without the dev mode / the weight-transfer flag, all starting
    at once; yields [(URL, process)]."""
    # The session's vLLM cache (conftest): a server's own would inspect the model's architecture again in a
    # subprocess. TORCHDYNAMO_DISABLE as the engine starts its own (engines.vllm_engine.eager_engine_process).
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
           "TORCHDYNAMO_DISABLE": "1", "PYTHONPATH": str(ROOT)}
    env.pop("VLLM_SERVER_DEV_MODE", None)
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    servers, homes = [], []
    try:
        for i in range(count):
            # vLLM's IPC sockets live in TMPDIR, whose path must be short (a Unix socket path: 107 bytes)
            home = Path(tempfile.mkdtemp(prefix=f"rs-srv{i}-"))
            homes.append(home)
            port = free_port()
            cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                   "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                   "--max-model-len", "256", "--enforce-eager", "--no-enable-chunked-prefill",
                   "--logprobs-mode", "processed_logprobs"]
            if weight_transfer:
                cmd += ["--weight-transfer-config", '{"backend": "rollstream"}']
            with open(home / "server.log", "w") as log:
                # Its own process group: its engine-core and worker children go with it at the end.
                proc = subprocess.Popen(cmd, env={**env, "TMPDIR": str(home)},
                                        stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
            servers.append((f"http://127.0.0.1:{port}", proc, home / "server.log"))
        deadline = time.monotonic() + SERVER_START_S
        for url, proc, log_path in servers:
            wait_healthy(url, proc, log_path, deadline)
        yield [(url, proc) for url, proc, _ in servers]
    finally:
        for _, proc, _ in servers:
            stop_server(proc)
        for i, home in enumerate(homes):  # its log stays with the test's files
            with contextlib.suppress(OSError):
                scratch.mkdir(parents=True, exist_ok=True)
                shutil.copy(home / "server.log", scratch / f"server-{i}.log")
            shutil.rmtree(home, ignore_errors=True)


def server_config(urls: list[str]):
    return config_from_dict({
        "grpo": {"max_completion_length": 12},
        "rollout": {"engine": "server", "server_urls": urls, "max_model_len": 256,
                    "weight_transport": "broadcast", "weight_sync_timeout_s": TIMEOUT_S},
        "reward": {"reward_funcs": ["accuracy"]},
    })


async def server_prompt_logprobs(url: str) -> torch.Tensor:
    """The server's log-probs of PROMPT's tokens (each given the ones before it)."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
    async with httpx.AsyncClient(timeout=60) as client:
        response = await client.post(f"{url}/v1/completions", json=body)
    response.raise_for_status()
    rows = response.json()["choices"][0]["prompt_logprobs"][1:]
    return torch.tensor([row[str(token)]["logprob"] for row, token in zip(rows, PROMPT[1:], strict=True)])


def learner_prompt_logprobs(model_dir: Path, state: dict[str, torch.Tensor] | None) -> torch.Tensor:
    """The same log-probs from transformers with ``state`` loaded (None: the model's own weights)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if state is not None:
        model.load_state_dict(state)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0, :-1]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0]


@pytest.mark.e2e
async def test_servers_join_the_weights_group_beside_another_member(tiny_model_dir, tmp_path):
    """A learner (Coordinator + BroadcastSender), a rollout worker whose engine is two real vllm serve
    processes, and a second member (PlainReceiver), as workers on one transport: ONE group of four ranks
    (learner, the plain member, each server's vLLM worker at its own rank). Each version reaches every rank;
    each server's log-probs are then the learner's (transformers with those weights) to fp32 noise, and not
    the old weights'. Then one server is SIGKILLed: the next version reaches the other member, and the
    servers' rollout worker fails with ServerGone (it cannot take weights without that server) instead of
    sampling on with old ones."""
    from pipeline.records import WeightsEpoch, decode
    from pipeline.transport import connect
    from pipeline.worker import Worker
    from stages.rollout import Rollout
    from weights.membership import MEMBER_LEASE, SYNC_EDGE, Coordinator, CoordinatorStage, MemberStage
    from weights.sender import BroadcastSender, state_layout
    from weights.transfer import PlainReceiver

    states = {0: None, **{v: perturbed_state(tiny_model_dir, seed=20 + v) for v in (1, 2, 3)}}
    current = {"version": 1}
    sender = BroadcastSender(lambda: states[current["version"]], state_layout(states[1]), chunk_bytes=64 * 1024,
                             timeout_s=TIMEOUT_S)
    run = f"srv-bc-{uuid.uuid4().hex[:6]}"
    with vllm_servers(tiny_model_dir, tmp_path, count=2) as servers:
        urls = [url for url, _ in servers]
        before = [await server_prompt_logprobs(url) for url in urls]
        engine = await ServerEngine.start(urls, tiny_model_dir)
        transport = await connect("memory", run=run)
        learner_stage = CoordinatorStage(lambda ctx: Coordinator(
            sender, lambda: ctx.leases(MEMBER_LEASE), address="127.0.0.1", timeout_s=TIMEOUT_S, run=run))
        plain = PlainReceiver()
        workers = [
            Worker(learner_stage, transport, run=run, worker_id="learner", block_ms=100),
            Worker(Rollout(server_config(urls), tiny_model_dir, engine=engine), transport, run=run,
                   worker_id="rollout-srv", block_ms=100),
            Worker(MemberStage(plain), transport, run=run, worker_id="plain", block_ms=100),
        ]
        tasks = [asyncio.create_task(w.serve()) for w in workers]
        try:
            await learner_stage.started.wait()
            coordinator = learner_stage.coordinator

            async def both_registered() -> bool:
                assert not any(t.done() for t in tasks), [t.result() for t in tasks if t.done()]
                return {m.worker for m in await coordinator.live_members()} == {"plain", "rollout-srv"}

            await wait_until(both_registered, "both members registered", timeout_s=120, interval_s=0.1)
            registered = {m.worker: m for m in await coordinator.live_members()}
            assert registered["rollout-srv"].engine == "server"
            assert registered["rollout-srv"].server_urls == urls and registered["rollout-srv"].world_size == 2

            for version in (1, 2):
                current["version"] = version
                result = await coordinator.publish(version)
                assert result.delivered and result.members == 2, result
                assert engine.version == version and plain.version == version
                # the plain member holds exactly the learner's tensors (the group's bytes are exact)
                assert all(torch.equal(plain.state[n], t) for n, t in states[version].items())
                learner = learner_prompt_logprobs(tiny_model_dir, states[version])
                old = learner_prompt_logprobs(tiny_model_dir, states[version - 1])
                for url in urls:
                    async with httpx.AsyncClient() as client:
                        label = (await client.get(f"{url}/weight_info")).json()["weight_version"]
                    assert label == str(version)
                    served = await server_prompt_logprobs(url)
                    gap = (served - learner).abs().max().item()
                    assert gap < 1e-4, (url, version, gap)
                    assert (served - old).abs().max().item() > 0.05, (url, version)  # the weights did change
                    print(f"version {version} {url}: |server - learner| max {gap:.2e}, "
                          f"send {sender.last_send_seconds:.3f} s, round {result.round_seconds:.3f} s")
            for served in before:
                assert (served - learner_prompt_logprobs(tiny_model_dir, None)).abs().max().item() < 1e-4

            epochs, after = [], "0"
            while batch := await transport.read(SYNC_EDGE, after, 500, 0):
                epochs += [r for r in map(decode, (d.payload for d in batch)) if isinstance(r, WeightsEpoch)]
                after = batch[-1].id
            formed = [e for e in epochs if e.phase == "form"]
            assert len(formed) == 1 and formed[0].world_size == 4  # one group for both members
            # the plain member at rank 1; the servers' member from rank 2: its two servers take ranks 2 and 3
            assert {m.worker: (m.rank_offset, m.world_size) for m in formed[0].members} == {
                "plain": (1, 1), "rollout-srv": (2, 2)}

            url, proc = servers[1]
            os.killpg(proc.pid, signal.SIGKILL)  # one server and its engine core and worker
            current["version"] = 3
            third = await coordinator.publish(3)
            assert third.delivered and third.members == 1 and plain.version == 3, third
            rollout_worker = tasks[1]
            await asyncio.wait({rollout_worker}, timeout=30)
            assert rollout_worker.done() and isinstance(rollout_worker.exception(), ServerGone)
            assert url in str(rollout_worker.exception()) and engine.version == 2
        finally:
            for worker in workers:
                worker.request_stop("test over")
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=60)
            sender.close()
            engine.shutdown()


@pytest.mark.e2e
async def test_a_training_run_on_broadcast_into_a_server(tiny_model_dir, tmp_path):
    """`rollstream train`'s pipeline with its rollout on a vllm serve, weights by broadcast: every version
    reaches the server over the group (no snapshot written), and at max_staleness 0 the server's log-probs
    of every sampled token are the learner's."""
    import json

    from config import load_config
    from rollstream import train

    with vllm_servers(tiny_model_dir, tmp_path / "servers") as [(url, _proc)]:
        cfg = load_config("configs/demo.toml", [
            f"run.output_dir={json.dumps(str(tmp_path / 'run'))}", "run.max_steps=8", "grpo.max_staleness=0",
            "rollout.max_model_len=256", "rollout.engine=server", f"rollout.server_urls={json.dumps([url])}",
            "rollout.weight_transport=broadcast", f"rollout.weight_sync_timeout_s={TIMEOUT_S}",
            f"run.name=srv-bc-{uuid.uuid4().hex[:6]}",
        ])
        result = await train.run_pipeline(cfg)  # it starts its engine as a worker does: the servers
        async with httpx.AsyncClient() as client:
            label = (await client.get(f"{url}/weight_info")).json()["weight_version"]
    assert result.exit_code == 0
    rows = [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    last = rows[-1]["policy_version"]
    assert last >= 2 and label == str(last)
    worst = max(r["sampling/sampling_logp_difference/max"] for r in rows)
    print(f"max |server - learner| log-prob of a sampled token over the run: {worst:.2e}")
    assert worst < 1e-4
    assert not (result.output_dir / "weights").exists()  # no snapshot: the weights went over the group


@pytest.mark.e2e
async def test_a_server_not_started_for_broadcast_is_refused_at_the_workers_start(tiny_model_dir, tmp_path):
    """A dev-mode server without --weight-transfer-config: the rollout worker's start fails at once with the
    flags to start it with (it would otherwise hang in the first epoch's join)."""
    from stages.rollout import Rollout

    with vllm_servers(tiny_model_dir, tmp_path, weight_transfer=False) as [(url, _proc)]:
        engine = await ServerEngine.start([url], tiny_model_dir)
        try:
            started = time.monotonic()
            with pytest.raises(ServerNotReady) as caught:
                await Rollout(server_config([url]), tiny_model_dir, engine=engine).start(FakeContext(run='srv-bc', stage='rollout', worker='rollout-srv'))
            assert time.monotonic() - started < 60
        finally:
            engine.shutdown()
    message = str(caught.value)
    assert url in message and "weight_transfer_config backend None" in message
    assert "VLLM_SERVER_DEV_MODE=1" in message and """--weight-transfer-config '{"backend": "rollstream"}'""" in message


async def test_a_server_that_never_answers_is_an_error_within_the_start_timeout(tiny_model_dir):
    """No server at the URL (connection refused): prepare_broadcast gives up after its start timeout, with
    the URL and the flags, instead of waiting for a server forever."""
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    engine = ServerEngine([url], "tiny", None, tiny_model_dir, timeout_s=5.0)
    try:
        started = time.monotonic()
        with pytest.raises(ServerNotReady, match=r"did not answer /health within 1 s.*VLLM_SERVER_DEV_MODE=1"):
            await engine.prepare_broadcast(start_timeout_s=1.0)
        assert time.monotonic() - started < 10
    finally:
        engine.shutdown()


def test_a_servers_end_of_the_group_binds_to_an_address_the_learner_reaches():
    from engines.server_engine import server_address

    # a server on this host (a loopback URL): this host's address towards the learner
    assert server_address("http://127.0.0.1:8000", "10.0.0.2") == "10.0.0.2"
    assert server_address("http://localhost:8000", "10.0.0.2") == "10.0.0.2"
    # a server elsewhere: the address its URL names
    assert server_address("http://10.1.2.3:8000", "10.0.0.2") == "10.1.2.3"

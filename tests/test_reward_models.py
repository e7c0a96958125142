"""Reward models: a local sequence-classification model (a tiny random one built here from the project's
tiny-model tokenizer) and a remote HTTP reward service (a real local server started by the test)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from fake_context import FakeContext

from config import config_from_dict
from pipeline.records import GroupClosed, Trajectory, TrajectoryGroup, pack_f32, pack_i32
from rewards.models import RemoteReward, RemoteRewardError
from rewards.scoring import REWARD_MODEL
from stages.reward import Reward


def traj(request: int, completion: str, solution: str = "4") -> Trajectory:
    return Trajectory(
        prompt_id="e0:1",
        attempt=0,
        request_id=f"e0:1/0/{request}",
        generation_batch=0,
        prompt_ids=pack_i32([1]),
        completion_ids=pack_i32([1] * len(completion)),
        logprobs=pack_f32([0.0] * len(completion)),
        messages=[{"role": "user", "content": "2+2="}],
        completion=completion,
        data_dict={"solution": solution},
        policy_version=0,
        max_policy_version=0,
    )


# ---------------------------------------------------------------- local reward model


@pytest.fixture(scope="module")
def tiny_reward_model(tiny_model_dir, tmp_path_factory):
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(config).eval()
    out = tmp_path_factory.mktemp("tiny-rm")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out, model, tokenizer


def _direct_score(model, tokenizer, conversation) -> float:
    """The model's first logit on one conversation, unbatched (no padding involved)."""
    import torch

    text = tokenizer.apply_chat_template(conversation, tokenize=False)
    with torch.inference_mode():
        return model(**tokenizer(text, return_tensors="pt")).logits[0, 0].item()


async def test_local_reward_model_scores_batched_and_mixes_with_functions_by_weight(tiny_reward_model):
    path, model, tokenizer = tiny_reward_model
    cfg = config_from_dict(
        {
            "reward": {
                "reward_funcs": ["accuracy"],
                "reward_model": str(path),
                "reward_weights": [1.0, 0.5],
                "reward_model_batch_size": 4,
            },
        }
    )
    stage = Reward(cfg)
    records = [traj(0, "4"), traj(1, "13 and some more words"), traj(2, "no")]
    group = GroupClosed(prompt_id="e0:1", attempt=0, generation_batch=0, record_ids=[t.record_id for t in records])
    # One group entry (as a multi-turn rollout sends it): one batch, so padding is in play.
    handled = await stage.handle(TrajectoryGroup(manifest=group, trajectories=records), FakeContext(stage='reward'))
    await stage.close()
    [(_, whole)] = handled.outputs  # one ScoredGroup
    scored = whole.records
    for t, s in zip(records, scored):
        expected = _direct_score(model, tokenizer, [*t.messages, {"role": "assistant", "content": t.completion}])
        assert s.rewards[REWARD_MODEL] == pytest.approx(expected, abs=1e-4)
        assert s.reward == pytest.approx(s.rewards["accuracy"] + 0.5 * expected, abs=1e-4)
    assert len({round(s.rewards[REWARD_MODEL], 6) for s in scored}) == 3  # conversations differ, so scores do


def test_a_missing_reward_model_directory_is_a_clear_error(tmp_path):
    cfg = config_from_dict({"reward": {"reward_model": str(tmp_path / "nope")}})
    with pytest.raises(ValueError, match=r"reward.reward_model=.*nope.*config.json"):
        Reward(cfg)


# ---------------------------------------------------------------- remote reward service


class RewardService:
    """A real HTTP reward service on 127.0.0.1: reward = len(completion); can fail or stall on demand."""

    def __init__(self) -> None:
        self.fail_next = 0  # answer this many requests with 503
        self.status = 200
        self.delay_s = 0.0
        self.requests: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        service = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with service.lock:
                    service.requests.append(body)
                    service.in_flight += 1
                    service.max_in_flight = max(service.max_in_flight, service.in_flight)
                    failing = service.fail_next > 0
                    service.fail_next -= failing
                time.sleep(service.delay_s)  # the service's own work time
                status = 503 if failing else service.status
                payload = json.dumps({"rewards": [float(len(c)) for c in body["completions"]]}).encode()
                # Done before the reply is sent: once the client has it, it may send the next request at
                # once, and this thread counting down after the reply would count that one beside it.
                with service.lock:
                    service.in_flight -= 1
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client timed out and left

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def service():
    s = RewardService()
    yield s
    s.close()


def remote_cfg(url: str, **reward):
    return config_from_dict(
        {"run": {"name": f"rm-{uuid.uuid4().hex[:6]}"}, "reward": {"reward_model": url, "remote_backoff_s": 0.01, **reward}}
    )


async def test_remote_reward_end_to_end_through_the_stage(service):
    stage = Reward(remote_cfg(service.url))
    t = traj(0, "abcd", solution="x")
    manifest = GroupClosed(prompt_id=t.prompt_id, attempt=0, generation_batch=0, record_ids=[t.record_id])
    [(_, whole)] = (await stage.handle(TrajectoryGroup(manifest=manifest, trajectories=[t]), FakeContext(stage='reward'))).outputs
    [scored] = whole.records
    await stage.close()
    assert scored.rewards == {REWARD_MODEL: 4.0} and scored.reward == 4.0
    [body] = service.requests
    assert body["completions"] == ["abcd"] and body["solution"] == ["x"] and body["request_id"] == ["e0:1/0/0"]
    assert body["messages"][0][-1] == {"role": "assistant", "content": "abcd"}
    assert "completion_ids" not in body and "trajectory_inputs" not in body  # bulk data stays home


async def test_remote_retries_5xx_with_backoff_then_succeeds(service):
    remote = RemoteReward(service.url, remote_cfg(service.url, remote_retries=3))
    service.fail_next = 2
    assert await remote(["ab", "c"]) == [2.0, 1.0]
    assert len(service.requests) == 3
    service.fail_next = 10
    with pytest.raises(RemoteRewardError, match="HTTP 503"):
        await remote(["ab"])
    assert len(service.requests) == 3 + 4  # 1 + remote_retries
    await remote.aclose()


async def test_remote_client_errors_are_not_retried(service):
    remote = RemoteReward(service.url, remote_cfg(service.url))
    service.status = 422
    with pytest.raises(RemoteRewardError, match="HTTP 422"):
        await remote(["ab"])
    assert len(service.requests) == 1
    await remote.aclose()


async def test_remote_timeout_and_unreachable_service(service):
    remote = RemoteReward(service.url, remote_cfg(service.url, timeout_s=0.2, remote_retries=1))
    service.delay_s = 1.0
    with pytest.raises(RemoteRewardError, match="ReadTimeout"):
        await remote(["ab"])
    assert len(service.requests) == 2
    await remote.aclose()
    gone = RemoteReward("http://127.0.0.1:9/score", remote_cfg("http://127.0.0.1:9/score", remote_retries=0))
    with pytest.raises(RemoteRewardError, match="ConnectError"):
        await gone(["ab"])
    await gone.aclose()


async def test_remote_concurrency_is_limited(service):
    remote = RemoteReward(service.url, remote_cfg(service.url, remote_max_concurrency=2))
    service.delay_s = 0.05
    results = await asyncio.gather(*(remote(["x" * i]) for i in range(8)))
    assert results == [[float(i)] for i in range(8)]
    assert service.max_in_flight == 2
    await remote.aclose()

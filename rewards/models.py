"""Reward models, scored after the reward functions (``reward.reward_model``, as ms-swift):

- ``LocalRewardModel``: a transformers sequence-classification model (a local directory, or a Hub id fetched into
  the Hugging Face cache); the reward of a conversation is its first logit (ms-swift's reward-model
  convention), batched.
- ``RemoteReward``: an HTTP reward service, JSON in/out, through an httpx async client with a timeout,
  retries with exponential backoff and a concurrency limit.

Remote protocol: ``POST <url>`` with ``{"completions": [...], "messages": [[...], ...], "prompt_id":
[...], "request_id": [...], <dataset columns>: [...]}``; the answer is ``{"rewards": [float | null, ...]}``,
one per completion.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

from data.hub import hub_snapshot, is_hub_id

# Not sent to a remote service: bulk token ids, nested records and the in-process helpers stay home.
_LOCAL_ONLY = {"trajectory_inputs", "completion_ids", "response_token_ids", "rollout_infos", "multi_turn_infos",
               "trainer_state", "log_extra", "log_metric", "environments"}


def is_remote(spec: str) -> bool:
    return spec.startswith(("http://", "https://"))


def build_reward_model(spec: str, config: Any) -> Any:
    """``reward.reward_model`` -> a callable reward: remote for an http(s) URL, else a local model directory."""
    if is_remote(spec):
        return RemoteReward(spec, config)
    return LocalRewardModel(spec, config)


class LocalRewardModel:
    """A sequence-classification model scoring whole conversations (sync: it runs in the thread pool)."""

    def __init__(self, path: str, config: Any) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        directory = Path(path).expanduser()
        if not directory.is_dir() and is_hub_id(path):
            directory = hub_snapshot(path, field="reward.reward_model")
        if not (directory / "config.json").is_file():
            raise ValueError(
                f"reward.reward_model={path!r}: no model there (expected a directory with config.json); "
                f"give a local sequence-classification model, a Hub id or an http(s):// reward service URL"
            )
        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(directory)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(directory, torch_dtype=torch.float32).eval()
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.batch_size = config.reward.reward_model_batch_size
        self.max_length = config.rollout.max_model_len
        self._lock = threading.Lock()  # one forward at a time: pool threads share the model

    def render(self, conversation: list[dict[str, Any]]) -> str:
        if self.tokenizer.chat_template:
            return self.tokenizer.apply_chat_template(conversation, tokenize=False)
        return "\n".join(f"{m['role']}: {m['content']}" for m in conversation)

    def __call__(self, completions: list[str], messages: list[list[dict[str, Any]]], **kwargs: Any) -> list[float]:
        texts = [self.render(m) for m in messages]
        scores: list[float] = []
        with self._lock, self.torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                batch = self.tokenizer(
                    texts[start : start + self.batch_size],
                    padding=True,
                    truncation=True,
                    max_length=self.max_length,
                    return_tensors="pt",
                )
                scores += self.model(**batch).logits[:, 0].float().tolist()
        return scores


class RemoteRewardError(RuntimeError):
    pass


class RemoteReward:
    """An HTTP reward service (async). Connection errors, 429 and 5xx are retried with backoff."""

    def __init__(self, url: str, config: Any) -> None:
        import httpx

        r = config.reward
        self.url = url
        self.retries = r.remote_retries
        self.backoff_s = r.remote_backoff_s
        self.timeout_s = r.timeout_s
        self._httpx = httpx
        self._client: Any = None
        self.max_concurrency = r.remote_max_concurrency
        self._slots = asyncio.Semaphore(r.remote_max_concurrency)

    def _client_for_loop(self) -> Any:
        if self._client is None:
            limits = self._httpx.Limits(max_connections=self.max_concurrency)
            self._client = self._httpx.AsyncClient(timeout=self.timeout_s, limits=limits)
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def __call__(self, completions: list[str], **kwargs: Any) -> list[float | None]:
        body = {"completions": completions}
        body.update({k: v for k, v in kwargs.items() if k not in _LOCAL_ONLY})
        async with self._slots:
            rewards = await self._post(body)
        if not isinstance(rewards, list) or len(rewards) != len(completions):
            raise RemoteRewardError(
                f"reward service {self.url} answered {rewards!r:.200}; expected "
                f'{{"rewards": [...]}} with {len(completions)} numbers'
            )
        return [None if v is None else float(v) for v in rewards]

    async def _post(self, body: dict[str, Any]) -> Any:
        httpx = self._httpx
        client = self._client_for_loop()
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            try:
                response = await client.post(self.url, json=body)
            except httpx.TransportError as exc:  # connect/read errors and timeouts
                if last:
                    raise RemoteRewardError(f"reward service {self.url}: {type(exc).__name__}: {exc}") from exc
            else:
                if response.status_code == 429 or response.status_code >= 500:
                    if last:
                        raise RemoteRewardError(f"reward service {self.url}: HTTP {response.status_code}")
                elif response.status_code >= 400:  # our request is wrong: retrying cannot help
                    raise RemoteRewardError(
                        f"reward service {self.url}: HTTP {response.status_code}: {response.text[:200]}"
                    )
                else:
                    data = response.json()
                    return data.get("rewards") if isinstance(data, dict) else data
            await asyncio.sleep(self.backoff_s * 2**attempt)  # backoff before the next attempt
        raise AssertionError("unreachable")

"""The server engine: OpenAI-compatible ``vllm serve`` processes, started separately, asked for token ids
and logprobs over HTTP (``rollout.engine = "server"``)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

from engines.base import ENGINE_START_TIMEOUT_S, WEIGHT_LOAD_TIMEOUT_S, EngineBase, Sample
from engines.weight_loader import WORKER_EXTENSION, weights_file
from pipeline import metrics


class ServerError(RuntimeError):
    """Every configured vLLM server failed one request (the worker retries or redelivers the prompt)."""


class ServerEngine(EngineBase):
    """OpenAI-compatible ``vllm serve`` processes, started separately (README: server mode).

    A turn is ``POST /v1/completions`` with the prompt as token ids, asking for the sampled tokens' ids
    and logprobs. Requests go round-robin; a connection error, a 5xx or a timeout retries the request on
    the next server (same seed, so the same sample), and only when every server failed does it raise.
    New weights go to every server through the dev-mode routes (``/collective_rpc`` with
    ``RLWeights.reload_file``, ``/reset_prefix_cache``, ``/update_weight_version``).
    """

    def __init__(self, urls: list[str], model_name: str, tokenizer: Any, model_dir: Path, timeout_s: float) -> None:
        import httpx

        super().__init__(tokenizer, model_dir)
        self.urls = [u.rstrip("/") for u in urls]
        self.model_name = model_name
        self.timeout_s = timeout_s
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))
        self.retries = 0  # requests moved to another server (also counted in the metric)
        self.labels: tuple[str, str, str] | None = None
        self._next = 0

    @classmethod
    async def start(cls, urls: list[str], model_dir: str | Path, *, timeout_s: float = 300.0,
                    start_timeout_s: float = ENGINE_START_TIMEOUT_S) -> ServerEngine:
        """Wait until at least one server answers /health; its /v1/models names the model to ask for."""
        import httpx
        from transformers import AutoTokenizer

        deadline = time.monotonic() + start_timeout_s
        async with httpx.AsyncClient(timeout=5.0) as client:
            while True:
                for url in urls:
                    try:
                        if (await client.get(f"{url.rstrip('/')}/health")).status_code == 200:
                            models = (await client.get(f"{url.rstrip('/')}/v1/models")).json()["data"]
                            tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
                            engine = cls(urls, models[0]["id"], tokenizer, Path(model_dir), timeout_s)
                            engine.max_model_len = models[0].get("max_model_len")  # the server's context
                            return engine
                    except httpx.TransportError:
                        pass
                if time.monotonic() > deadline:
                    raise ServerError(f"no vLLM server answered /health within {start_timeout_s:.0f} s: {', '.join(urls)}")
                await asyncio.sleep(0.5)  # polling a server that is still starting

    async def generate(self, prompt_ids: list[int], *, request_id: str, seed: int | None, max_tokens: int,
                       temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, min_p: float = 0.0,
                       repetition_penalty: float = 1.0, stop: list[str] | None = None, priority: int = 0,
                       gated: bool = True, images: list[Any] | None = None) -> Sample:
        # priority: the servers' own scheduling policy decides (start them with --scheduling-policy priority).
        if images:
            raise ValueError("image prompts need rollout.engine = \"async\" (the server engine sends token ids only)")
        body = {
            "model": self.model_name, "prompt": list(prompt_ids), "max_tokens": max_tokens,
            "temperature": temperature, "top_p": top_p, "top_k": top_k if top_k > 0 else -1, "min_p": min_p,
            "repetition_penalty": repetition_penalty, "seed": seed, "stop": stop or None,
            "logprobs": 1, "return_token_ids": True, "request_id": request_id,
            **({"priority": priority} if priority else {}),
        }
        async with self.running("pause") if gated else contextlib.nullcontext():
            started_at = self.version
            choice = await self._post_with_failover("/v1/completions", body)
        token_ids = list(choice["token_ids"])
        logprobs = list(choice["logprobs"]["token_logprobs"])[: len(token_ids)]
        return Sample(token_ids, logprobs, choice.get("finish_reason") or "stop", started_at, self.version)

    async def _post_with_failover(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        import httpx

        errors = []
        first, self._next = self._next, self._next + 1  # round-robin start; then every other server once
        for attempt in range(len(self.urls)):
            url = self.urls[(first + attempt) % len(self.urls)]
            try:
                response = await self.client.post(f"{url}{route}", json=body)
                if response.status_code < 500:
                    response.raise_for_status()  # a 4xx is our request's fault: no other server will take it
                    return response.json()["choices"][0]
                errors.append(f"{url}: HTTP {response.status_code}")
            except (httpx.TransportError, httpx.TimeoutException) as exc:
                errors.append(f"{url}: {type(exc).__name__}")
            if attempt + 1 < len(self.urls):
                self.retries += 1
                if self.labels:
                    metrics.SERVER_RETRIES.labels(*self.labels).inc()
        raise ServerError(f"every vLLM server failed {route}: {'; '.join(errors)}")

    async def _reload(self, path: Path, version: int) -> None:
        """Every server reloads at once (one after another, N servers took N times as long, and a hung one
        held back all behind it); the version is loaded when each has answered or failed."""
        import httpx

        file = weights_file(path)
        results = await asyncio.gather(*(self._reload_one(url, file, version) for url in self.urls),
                                       return_exceptions=True)
        for url, result in zip(self.urls, results, strict=True):
            if isinstance(result, httpx.HTTPStatusError):
                raise ServerError(
                    f"{url}: weight reload refused ({result.response.status_code}); start the server with "
                    f"VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls {WORKER_EXTENSION}"
                ) from None
            if isinstance(result, BaseException) and not isinstance(result, httpx.TransportError):
                raise result
        # A dead server (TransportError) gets no requests that succeed either; it reloads when restarted.
        if all(isinstance(result, BaseException) for result in results):
            raise ServerError(f"no vLLM server took weights version {version}: {', '.join(self.urls)}")

    async def _reload_one(self, url: str, file: Path, version: int) -> None:
        r = await self.client.post(f"{url}/collective_rpc", json={"method": "reload_file", "args": [str(file)]},
                                   timeout=WEIGHT_LOAD_TIMEOUT_S)
        r.raise_for_status()
        (await self.client.post(f"{url}/reset_prefix_cache", params={"reset_running_requests": "true"})
         ).raise_for_status()
        (await self.client.post(f"{url}/update_weight_version", json={"new_version": str(version)})
         ).raise_for_status()

    def shutdown(self) -> None:
        if self.client is not None:
            client, self.client = self.client, None
            try:
                asyncio.get_running_loop().create_task(client.aclose())
            except RuntimeError:
                pass


"""Rollout: sample ``num_generations`` independent completions per prompt on a vLLM AsyncLLM engine.

Each sample has its own request id and seed (``task.seed + i``), so a group's samples are independent and
reproducible. Single-turn on the in-process engine, a group is one vLLM request with ``n = G`` (vLLM seeds
its i-th child ``seed + i``: the same samples as G requests, with one request's front-end cost); against
servers, and for multi-turn, each sample is its own request. A trajectory keeps prompt/completion token ids
and the sampled tokens' logprobs, and is stamped with the oldest and newest weights versions that produced
it. The group leaves as one ``TrajectoryGroup`` entry (its ``GroupClosed`` manifest and its trajectories).

With ``rollout.multi_turn_scheduler`` each request is driven by a ``schedulers.MultiTurnScheduler``
(ms-swift's API): its ``run`` returns one or more records per request (several = per-turn records that
share the request id; the group manifest lists them all).

New weights (``WeightsPublished`` on the fan-out edge) are loaded into the running engine between turns
(``weight_sync = "pause"``), once every in-flight request is done (``"drain"``), or at once between two engine
steps while requests run (``"in_flight"``), then the prefix cache is reset (its KV came from the old weights)
and the version is tagged; vLLM records which version produced each token.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pipeline.vl_compat  # noqa: F401  (first: vLLM's engine process imports this module for RLWeights)
from engines.data import prompt_token_ids
from pipeline import metrics
from pipeline.config import vllm_max_lora_rank
from pipeline.edges import FEEDBACK, TRAJECTORIES, WEIGHTS
from pipeline.media import ImageCache, pil_images
from pipeline.records import (
    Feedback,
    GroupClosed,
    PromptTask,
    Trajectory,
    TrajectoryGroup,
    WeightsPublished,
    pack_f32,
    pack_i32,
)
from pipeline.stage import FatalStageError, Handled, stop_when_run_finished
from stages.feeder import truncate_prompt

ENGINE_START_TIMEOUT_S = 600.0
MIN_VERSION_TIMEOUT_S = 600.0
WEIGHT_LOAD_TIMEOUT_S = 120.0
# How long a weight load may wait for running turns (pause) or requests (drain) to finish.
WEIGHT_DRAIN_TIMEOUT_S = 600.0
WEIGHT_SYNC_MODES = ("pause", "drain", "in_flight")


class RLWeights:
    """vLLM worker extension (``worker_extension_cls="stages.rollout.RLWeights"``): reload weights in place.

    vLLM-CPU prepacks linear weights, so ``model.load_weights`` cannot work there; ``reload_weights``
    re-materialises, loads and re-packs. With tied embeddings lm_head's prepacked copy is stale after
    the reload, so it is re-packed too (measured in NOTES-vllm.md).
    """

    def reload_file(self, path: str) -> float:
        from safetensors.torch import load_file

        started = time.perf_counter()
        self.model_runner.reload_weights(weights_iterator=iter(load_file(path).items()))
        model = self.model_runner.model
        if getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "lm_head"):
            quant = getattr(model.lm_head, "quant_method", None)
            if quant is not None:
                quant.process_weights_after_loading(model.lm_head)
        return time.perf_counter() - started


def weights_file(path: Path) -> Path:
    """A full-weights snapshot's file: ``path`` itself, or ``path/model.safetensors`` for a directory."""
    return path / "model.safetensors" if path.is_dir() else path


@dataclass(frozen=True, slots=True)
class Sample:
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    min_version: int
    max_version: int
    prompt_ids: list[int] | None = None  # the engine's prompt ids, when it changed them (images expanded)


class ImagePlaceholderError(ValueError):
    """A token-id prompt whose image tokens do not match its images one to one."""


def check_image_placeholders(prompt_ids: list[int], num_images: int, image_token_id: int | None) -> None:
    """Token-id prompts must carry exactly ONE image token per image: vLLM expands each to one token per
    merged patch itself. Already-expanded ids are silently wrong there (it expands the first pad again and
    samples from a different prompt, NOTES-vl.md), so they are refused here."""
    if image_token_id is None:
        if num_images:
            raise ImagePlaceholderError(f"{num_images} image(s) given, but this model takes no images")
        return
    count = sum(1 for t in prompt_ids if t == image_token_id)
    if count == num_images:
        return
    hint = (" (already expanded? pass the tokenised chat template, one placeholder per image; the engine "
            "expands it)" if count > num_images else "")
    raise ImagePlaceholderError(
        f"the prompt has {count} image token(s) (id {image_token_id}) for {num_images} image(s){hint}"
    )


def vl_image_token_id(model_dir: Path) -> int | None:
    """The image placeholder token id of an image-prompt model (its config's ``image_token_id``), else None."""
    import json

    config = json.loads((Path(model_dir) / "config.json").read_text())
    return config.get("image_token_id") if "vision_config" in config else None


class EngineBase:
    """What both engines share: the tokenizer side, the weights version, and the weight-sync gates.

    "pause" closes the turn gate (no new engine call starts) and loads once the running turns end;
    "drain" closes the request gate (no new request starts) and loads once whole requests end;
    "in_flight" closes no gate: the load runs beside the requests (vLLM swaps the weights between two steps).
    """

    def __init__(self, tokenizer: Any, model_dir: Path) -> None:
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self.version = 0
        self._load_lock = asyncio.Lock()
        self._open = {"pause": asyncio.Event(), "drain": asyncio.Event()}
        for gate in self._open.values():
            gate.set()
        self._running = {"pause": 0, "drain": 0}
        self._idle = asyncio.Condition()
        self.priority_scheduling = False  # may a request pass priority > 0 (vLLM's "priority" policy)?
        self.image_token_id = vl_image_token_id(model_dir)  # None: a text model

    def encode_prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        return prompt_token_ids(self.tokenizer, messages)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    @contextlib.asynccontextmanager
    async def running(self, gate: str) -> AsyncIterator[None]:
        """Hold a turn ("pause") or a whole request ("drain") open; waits while a weight load holds the gate."""
        await self._open[gate].wait()
        self._running[gate] += 1
        try:
            yield
        finally:
            self._running[gate] -= 1
            async with self._idle:
                self._idle.notify_all()

    async def generate_group(
        self, prompt_ids: list[int], *, request_ids: list[str], seed: int, **kwargs: Any
    ) -> list[Sample]:
        """One completion per request id for the same prompt, the i-th seeded with ``seed + i`` (the same
        samples as ``generate`` called once per id). Here: one request each; the vLLM engine overrides it."""
        return list(
            await asyncio.gather(
                *(self.generate(prompt_ids, request_id=rid, seed=seed + i, **kwargs) for i, rid in enumerate(request_ids))
            )
        )

    async def load_weights(self, path: str | Path, version: int, mode: str = "pause") -> float:
        """Close the mode's gate, wait until nothing runs behind it, reload, drop the prefix cache's stale
        KV, tag the version, reopen ("in_flight": reload beside the running requests, no gate). Returns the
        seconds from closing the gate to reopening it (the load's own seconds in flight)."""
        if mode not in WEIGHT_SYNC_MODES:
            raise ValueError(f"rollout.weight_sync={mode!r}; choose one of {', '.join(WEIGHT_SYNC_MODES)}")
        async with self._load_lock:
            if version <= self.version:
                return 0.0
            started = time.perf_counter()
            if mode == "in_flight":
                await self._reload_in_flight(Path(path).resolve(), version)
                self.version = version
                return time.perf_counter() - started
            self._open[mode].clear()
            try:
                async with self._idle:
                    await asyncio.wait_for(
                        self._idle.wait_for(lambda: self._running[mode] == 0), timeout=WEIGHT_DRAIN_TIMEOUT_S
                    )
                await self._reload(Path(path).resolve(), version)
                self.version = version
            finally:
                self._open[mode].set()
            return time.perf_counter() - started

    async def _reload(self, path: Path, version: int) -> None:
        """Load the snapshot at ``path`` (a directory or its model.safetensors) as ``version``."""
        raise NotImplementedError

    async def _reload_in_flight(self, path: Path, version: int) -> None:
        """``_reload`` while requests run (weight_sync = "in_flight")."""
        await self._reload(path, version)

    async def reset_weights(self, model_dir: str | Path) -> None:
        """Back to a model's own weights and version 0 (tests reuse one engine across runs)."""
        async with self._load_lock:
            self.version = -1
        await self.load_weights(model_dir, 0)


class EngineDied(FatalStageError):
    """The vLLM engine core process died. Nothing this worker retries can succeed, and retrying would
    dead-letter every prompt it holds: the worker fails instead, leaving them pending, and whatever
    supervises it (systemd, Kubernetes, the chaos test) restarts it with a fresh engine. Its in-flight
    prompts are then redelivered (XAUTOCLAIM after transport.min_idle_ms) to it or to another rollout worker."""


class VLLMEngine(EngineBase):
    """One vLLM AsyncLLM in this process, with weight reloads. Shared by tests (start costs ~8 s here).

    With ``max_lora_rank`` the engine is LoRA-enabled and loads the learner's adapter snapshots instead of
    full weights: the base stays in place, each published adapter is added under a new LoRA id and every
    turn started after the swap runs with it (version 0 = the base alone, as the learner's fresh adapter
    is zero). No prefix-cache reset is needed: vLLM keys cached blocks by the adapter's name.
    """

    def __init__(
        self, engine: Any, tokenizer: Any, model_dir: Path, max_lora_rank: int | None = None
    ) -> None:
        super().__init__(tokenizer, model_dir)
        self.engine = engine
        self.max_lora_rank = max_lora_rank  # None: full-weight snapshots only
        self._adapter: Any = None  # the vLLM LoRARequest every new turn uses; None = the base model
        self._adapters_added = 0  # LoRA ids are never reused: a shared engine sees many runs' "v1"

    @classmethod
    async def start(
        cls,
        model_dir: str | Path,
        *,
        max_model_len: int = 512,
        kv_cache_gib: float = 1.0,
        dtype: str = "float32",
        enforce_eager: bool = True,
        seed: int = 0,
        max_num_seqs: int | None = None,
        max_lora_rank: int | None = None,
        scheduling_policy: str = "fcfs",
        limit_mm_per_prompt: dict[str, int] | None = None,
        cpu_threads: int | None = None,
    ) -> VLLMEngine:
        """``cpu_threads``: OpenMP threads of the engine-core process on a CPU platform (None: vLLM's
        default, every core); see ``rollout.engine_threads``."""
        # One engine-core process instead of three: 8 s start instead of 15 s on this CPU.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(kv_cache_gib))))
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its CPU start-up warnings are noise here
        from transformers import AutoTokenizer
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        # Two adapter slots: the current one and the next, added while the current still serves.
        lora_args = (
            {"enable_lora": True, "max_lora_rank": max_lora_rank, "max_loras": 2} if max_lora_rank else {}
        )
        mm_args = {}
        if vl_image_token_id(Path(model_dir)) is not None:
            from pipeline import vl_compat

            vl_compat.register_vllm_models()  # CPU without torchvision: inspect the VL classes in-process
            mm_args = {"limit_mm_per_prompt": {"image": 1, **(limit_mm_per_prompt or {}), "video": 0}}
        args = AsyncEngineArgs(
            model=str(model_dir),
            dtype=dtype,  # "auto" would downcast fp32 checkpoints to bf16 on CPU
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            enable_chunked_prefill=False,  # seeded requests + chunked prefill kill the CPU engine
            seed=seed,
            # log-probs of the temperature-scaled distribution, the one the learner computes
            logprobs_mode="processed_logprobs",
            worker_extension_cls="stages.rollout.RLWeights",
            disable_log_stats=True,
            scheduling_policy=scheduling_policy,  # "priority": lower-priority (eval) requests wait behind others
            **({"max_num_seqs": max_num_seqs} if max_num_seqs else {}),
            **lora_args,
            **mm_args,
        )
        with engine_process_threads(cpu_threads):
            engine = await asyncio.wait_for(
                asyncio.to_thread(AsyncLLM.from_engine_args, args), timeout=ENGINE_START_TIMEOUT_S
            )
        self = cls(engine, AutoTokenizer.from_pretrained(str(model_dir)), Path(model_dir), max_lora_rank)
        self.priority_scheduling = scheduling_policy == "priority"
        await engine.update_weight_version("0")
        return self

    async def generate(
        self,
        prompt_ids: list[int],
        *,
        request_id: str,
        seed: int,
        max_tokens: int,
        priority: int = 0,
        gated: bool = True,
        images: list[Any] | None = None,
        **sampling: Any,
    ) -> Sample:
        """One completion. ``priority`` > 0 waits behind priority-0 requests (needs ``priority_scheduling``).
        ``images``: PIL images for the prompt's image tokens (one unexpanded token per image); the Sample then
        carries the engine's expanded prompt ids.
        ``gated=False`` does not hold a weight load back (evaluation): the weights may then change under
        the request, which its ``min_version`` / ``max_version`` (per-token weight versions) show.
        ``sampling``: temperature, top_p, top_k, min_p, repetition_penalty, stop."""
        params = self._sampling_params(seed, max_tokens, n=1, **sampling)
        final, started_at = await self._request(prompt_ids, params, request_id, priority, gated, images)
        return self._sample(final, final.outputs[0], started_at, expanded=bool(images))

    async def generate_group(
        self,
        prompt_ids: list[int],
        *,
        request_ids: list[str],
        seed: int,
        max_tokens: int,
        priority: int = 0,
        gated: bool = True,
        images: list[Any] | None = None,
        **sampling: Any,
    ) -> list[Sample]:
        """The group as one vLLM request with ``n = len(request_ids)``: vLLM seeds its i-th child with
        ``seed + i``, so the samples equal ``generate``'s one request per id, but the engine's front end
        handles one request instead of G (measured here: 64 -> 8 requests per generation batch of the
        demo, ~82 -> ~64 ms per batch on an idle engine). The parent's request id is the first id's."""
        params = self._sampling_params(seed, max_tokens, n=len(request_ids), **sampling)
        final, started_at = await self._request(prompt_ids, params, request_ids[0], priority, gated, images)
        outputs = sorted(final.outputs, key=lambda out: out.index)
        return [self._sample(final, out, started_at, expanded=bool(images)) for out in outputs]

    @staticmethod
    def _sampling_params(
        seed: int,
        max_tokens: int,
        *,
        n: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        stop: list[str] | None = None,
    ) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=n,
            temperature=temperature,
            top_p=top_p,
            top_k=max(0, top_k),
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            stop=stop or None,
            max_tokens=max_tokens,
            logprobs=0,  # only the sampled token's logprob
            seed=seed,
            detokenize=bool(stop),  # stop strings need text; otherwise decoded once at the end
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    async def _request(
        self, prompt_ids: list[int], params: Any, request_id: str, priority: int, gated: bool, images: list[Any] | None
    ) -> tuple[Any, int]:
        """Run one vLLM request to its end: (its final RequestOutput, the weights version when it started)."""
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.exceptions import EngineDeadError

        async with self.running("pause") if gated else contextlib.nullcontext():
            started_at = self.version
            final = None
            prompt = TokensPrompt(prompt_token_ids=prompt_ids)
            if images:
                check_image_placeholders(prompt_ids, len(images), self.image_token_id)
                prompt["multi_modal_data"] = {"image": list(images)}
            try:
                async for out in self.engine.generate(
                    prompt, params, request_id=request_id, priority=priority, lora_request=self._adapter
                ):
                    final = out
            except EngineDeadError as exc:
                raise EngineDied(f"the vLLM engine died during request {request_id}: {exc}") from exc
        return final, started_at

    def _sample(self, final: Any, choice: Any, started_at: int, *, expanded: bool) -> Sample:
        token_ids = list(choice.token_ids)
        logprobs = [choice.logprobs[i][t].logprob for i, t in enumerate(token_ids)] if choice.logprobs else []
        versions = [int(span.version) for span in (choice.weight_versions or []) if str(span.version).isdigit()]
        low = min(versions) if versions else started_at
        high = max(versions) if versions else self.version
        return Sample(token_ids, logprobs, choice.finish_reason or "stop", low, high,
                      list(final.prompt_token_ids) if expanded else None)

    def check_alive(self) -> None:
        """Raise EngineDied if the engine core process is gone. A request in flight learns it at once, but a
        weight reload (and every request paused behind it) would wait for its timeout instead."""
        if self.engine is not None and self.engine.errored:
            raise EngineDied("the vLLM engine core process died")

    async def _reload(self, path: Path, version: int) -> None:
        if self.max_lora_rank is not None:
            await self._swap_adapter(path, version)
        else:
            file = weights_file(path)
            await asyncio.wait_for(self.engine.collective_rpc("reload_file", args=(str(file),)),
                                   timeout=WEIGHT_LOAD_TIMEOUT_S)
            # Without running-request reset the cache refuses to clear while requests hold blocks.
            await self.engine.reset_prefix_cache(reset_running_requests=True)
            if self.image_token_id is not None:
                # Cached vision embeddings came from the old weights too; and a scheduler whose encoder cache
                # survives a reload while the worker's does not fails with "Encoder cache miss" (seen here).
                await self.engine.reset_encoder_cache()
        await self.engine.update_weight_version(str(version))

    async def _reload_in_flight(self, path: Path, version: int) -> None:
        """Freeze the running requests (vLLM keeps them, KV and all), reload, resume: ~20 ms without a token,
        then every token comes from the new weights and carries the new version exactly (without the freeze
        the label lags the weights by a step or two; ../shared/NOTES-vllm.md). The reload's prefix-cache reset
        recomputes the frozen requests' KV with the new weights."""
        await self.engine.pause_generation(mode="keep", clear_cache=False)
        try:
            await self._reload(path, version)
        finally:
            await self.engine.resume_generation()

    async def _swap_adapter(self, path: Path, version: int) -> None:
        """Add the adapter at ``path`` and make it the one new turns use; the model's own directory means
        the base alone (``reset_weights``). The previous adapter is removed: nothing runs with it now (the
        weight-sync gate is closed), and a request naming it would reload it from its path anyway."""
        from vllm.lora.request import LoRARequest

        previous = self._adapter
        if path == self.model_dir.resolve():
            self._adapter = None
        elif not (path / "adapter_config.json").is_file():
            raise ValueError(
                f"{path} is not a LoRA adapter snapshot (no adapter_config.json): this engine has "
                f"rollout.weight_sync_mode = \"lora\", so the learner must train with train_type = \"lora\""
            )
        else:
            self._adapters_added += 1
            adapter = LoRARequest(f"v{version}-{self._adapters_added}", self._adapters_added, str(path))
            await asyncio.wait_for(self.engine.add_lora(adapter), timeout=WEIGHT_LOAD_TIMEOUT_S)
            self._adapter = adapter
        if previous is not None:
            await self.engine.remove_lora(previous.lora_int_id)

    def core_pids(self) -> list[int]:
        """The engine-core processes that run the model (one per AsyncLLM here)."""
        manager = getattr(self.engine.engine_core.resources, "engine_manager", None)
        return [p.pid for p in getattr(manager, "processes", [])]

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            # AsyncLLM.__del__ calls shutdown() again at interpreter exit, when vLLM's module globals
            # are already gone, and prints a TypeError traceback; once is enough.
            self.engine.shutdown = lambda *args, **kwargs: None
            self.engine = None


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
                            return cls(urls, models[0]["id"], tokenizer, Path(model_dir), timeout_s)
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
        import httpx

        file = weights_file(path)
        loaded = 0
        for url in self.urls:
            try:
                r = await self.client.post(f"{url}/collective_rpc", json={"method": "reload_file", "args": [str(file)]},
                                           timeout=WEIGHT_LOAD_TIMEOUT_S)
                r.raise_for_status()
                (await self.client.post(f"{url}/reset_prefix_cache", params={"reset_running_requests": "true"})
                 ).raise_for_status()
                (await self.client.post(f"{url}/update_weight_version", json={"new_version": str(version)})
                 ).raise_for_status()
                loaded += 1
            except httpx.TransportError:
                continue  # a dead server: it gets no requests that succeed either; it reloads when restarted
            except httpx.HTTPStatusError as exc:
                raise ServerError(
                    f"{url}: weight reload refused ({exc.response.status_code}); start the server with "
                    f"VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls stages.rollout.RLWeights"
                ) from None
        if not loaded:
            raise ServerError(f"no vLLM server took weights version {version}: {', '.join(self.urls)}")

    def shutdown(self) -> None:
        if self.client is not None:
            client, self.client = self.client, None
            try:
                asyncio.get_running_loop().create_task(client.aclose())
            except RuntimeError:
                pass


def engine_process_threads(threads: int | None) -> contextlib.AbstractContextManager:
    """OMP_NUM_THREADS set to ``threads`` while the engine-core process is spawned (it reads the variable as
    it starts; this process's own thread pool was sized before), on a CPU platform only. The variable is
    process-wide: engines start one at a time (graph.run_pipeline awaits each start)."""
    from vllm.platforms import current_platform

    if threads is None or not current_platform.is_cpu():
        return contextlib.nullcontext()
    from vllm.utils.system_utils import set_env_var  # what vLLM itself sets this variable with

    return set_env_var("OMP_NUM_THREADS", str(threads))


def engine_threads(cfg: Any) -> int:
    """``rollout.engine_threads``, or its default: the cores this process may run on, less the learner's
    torch threads (a learner on the same machine keeps its cores), at least 1."""
    if cfg.rollout.engine_threads is not None:
        return cfg.rollout.engine_threads
    return max(1, len(os.sched_getaffinity(0)) - cfg.learner.torch_threads)


async def start_engine(
    cfg: Any, model_dir: Path, *, priority_scheduling: bool = False, extra_num_seqs: int = 0, nice: int = 0
) -> EngineBase:
    """The engine ``rollout.engine`` names: vLLM servers, or an AsyncLLM in this process with the
    ``[rollout]`` settings. ``priority_scheduling``: vLLM's "priority" policy, so a request may ask to wait
    behind others; ``extra_num_seqs`` more running sequences than ``rollout.max_num_seqs`` (vLLM does not
    preempt a running request for a higher-priority one, so evaluation sharing the engine brings its own).
    ``nice``: the CPU priority of the AsyncLLM's engine-core process (see ``lower_cpu_priority``)."""
    r = cfg.rollout
    if getattr(r, "engine", "async") == "server":
        return await ServerEngine.start(list(r.server_urls), model_dir, timeout_s=r.server_timeout_s)
    engine = await VLLMEngine.start(
        model_dir,
        max_model_len=r.max_model_len,
        kv_cache_gib=r.kv_cache_gib,
        dtype=r.dtype,
        enforce_eager=r.enforce_eager,
        seed=r.seed,
        max_num_seqs=(r.max_num_seqs + extra_num_seqs) if getattr(r, "max_num_seqs", None) else None,
        scheduling_policy="priority" if priority_scheduling else "fcfs",
        # LoRA training: the engine hot-swaps the published adapters on the frozen base.
        max_lora_rank=vllm_max_lora_rank(cfg.learner.lora_rank) if r.weight_sync_mode == "lora" else None,
        limit_mm_per_prompt=dict(r.limit_mm_per_prompt),
        cpu_threads=engine_threads(cfg),
    )
    if nice:
        lower_cpu_priority(engine.core_pids(), nice)
    return engine


MAX_NICE = 19


def lower_cpu_priority(pids: list[int], nice: int) -> None:
    """Set the nice value of every thread of ``pids``: Linux keeps a nice value per thread, and the engine
    core computes in threads that exist by now (later ones inherit their creator's value). At nice 19, the
    lowest, the threads also join the idle scheduling class (SCHED_IDLE): a nice-19 thread keeps a core
    until its time slice ends even when a training thread wakes, an idle-class one gives it up at once."""
    for pid in pids:
        task_dir = Path(f"/proc/{pid}/task")
        tids = [int(t) for t in os.listdir(task_dir)] if task_dir.is_dir() else [pid]
        for tid in tids:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                if nice >= MAX_NICE:
                    with contextlib.suppress(PermissionError):  # a sandbox that forbids it: nice 19 alone
                        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            except ProcessLookupError:  # a thread that ended meanwhile
                pass


class Rollout:
    """The rollout stage. ``engine`` may be shared (tests start one for the whole session)."""

    name = "rollout"
    consumes = ("prompts",)
    subscribes = (WEIGHTS,)

    def __init__(self, cfg: Any, model_dir: Path, engine: EngineBase | None = None) -> None:
        self.cfg = cfg
        self.model_dir = model_dir
        self.engine = engine
        self._owns_engine = engine is None
        self.concurrency = cfg.rollout.max_concurrent_groups
        self._version_changed = asyncio.Condition()
        self._labels: tuple[str, str, str] | None = None
        self._versions_in_use: dict[str, int] = {}  # group id -> engine version when its requests started
        self._tokens = metrics.RateMeter()
        self._images = ImageCache()
        self.infer_engine: Any = None
        self.scheduler: Any = None
        name = getattr(cfg.rollout, "multi_turn_scheduler", None)
        if name:  # an unknown name fails here, before the engine starts
            from pipeline.errors import SetupError
            from schedulers import SchedulerError, build_scheduler

            try:
                self.scheduler = build_scheduler(name, getattr(cfg.rollout, "max_turns", None), **gym_kwargs(cfg))
                if getattr(cfg.rollout, "use_gym_env", False):
                    check_gym_scheduler(self.scheduler, cfg)
            except SchedulerError as exc:
                raise SetupError(str(exc)) from None

    async def start(self, ctx: Any) -> None:
        self._labels = (ctx.run, ctx.stage, ctx.worker)
        r = self.cfg.rollout
        if self.engine is None:
            self.engine = await start_engine(self.cfg, self.model_dir)
        if isinstance(self.engine, ServerEngine):
            self.engine.labels = self._labels
        lora = getattr(r, "weight_sync_mode", "file") == "lora"
        max_lora_rank = vllm_max_lora_rank(self.cfg.learner.lora_rank) if lora else None
        engine_rank = getattr(self.engine, "max_lora_rank", None)
        if lora and (engine_rank is None or engine_rank < max_lora_rank):
            from pipeline.errors import SetupError

            raise SetupError(
                f'rollout.weight_sync_mode = "lora" needs an engine started with max_lora_rank >= '
                f"{max_lora_rank} (learner.lora_rank = {self.cfg.learner.lora_rank}); "
                f"this one has {engine_rank}"
            )
        from schedulers.engine import InferEngine

        self.infer_engine = InferEngine(self.engine, max_model_len=r.max_model_len)
        if self.scheduler is not None:
            self.scheduler.infer_engine = self.infer_engine
        metrics.ROLLOUT_VERSION.labels(*self._labels).set(self.engine.version)

    def sample_metrics(self) -> None:
        """Gauges the worker's heartbeat samples: engine queue, tokens/s, oldest version still in use, live envs."""
        if self.engine is None:
            return
        # The heartbeat's once-a-second look at the engine: a dead engine core fails the worker here.
        check_alive = getattr(self.engine, "check_alive", None)
        if check_alive is not None:
            check_alive()
        if hasattr(self.scheduler, "live_envs"):
            metrics.ENVS_LIVE.labels(*self._labels).set(self.scheduler.live_envs)
        vllm_engine = getattr(self.engine, "engine", None)  # server mode and test fakes have no vLLM inside
        if vllm_engine is not None and hasattr(vllm_engine, "get_num_unfinished_requests"):
            metrics.ENGINE_QUEUE.labels(*self._labels).set(vllm_engine.get_num_unfinished_requests())
        metrics.TOKENS_PER_SECOND.labels(*self._labels).set(self._tokens.rate(time.monotonic()))
        metrics.ROLLOUT_OLDEST_VERSION.labels(*self._labels).set(self.oldest_version_in_use())

    def oldest_version_in_use(self) -> int:
        """The oldest weights version a group in flight started with (the engine's when none is)."""
        return min(self._versions_in_use.values(), default=self.engine.version)

    def leases(self) -> dict[str, int]:
        """Leased by the worker's heartbeat: the learner keeps every snapshot from this version on."""
        return {WEIGHTS: self.oldest_version_in_use()} if self.engine is not None else {}

    async def close(self) -> None:
        shutdown = getattr(self.scheduler, "shutdown", None)  # the gym scheduler's env threads and sessions
        if shutdown is not None:
            from schedulers import maybe_await

            await maybe_await(shutdown())
        if self._owns_engine and self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    async def on_broadcast(self, record: Any, ctx: Any) -> list:
        if not isinstance(record, WeightsPublished):
            return []
        if stop_when_run_finished(record, ctx):
            return []
        if record.version > self.engine.version and not Path(record.path).exists():
            # The learner deletes a snapshot only after publishing newer ones: that newer message follows.
            return []
        mode = getattr(self.cfg.rollout, "weight_sync", "pause")
        try:
            seconds = await self.engine.load_weights(record.path, record.version, mode=mode)
        except Exception:
            if Path(record.path).exists():
                raise
            # Garbage-collected while this worker (not leasing it yet: it just started) was loading it:
            # the learner deletes only snapshots older than newer ones it published, whose message follows.
            return []
        if seconds:
            metrics.WEIGHT_SYNC_SECONDS.labels(*self._labels).observe(seconds)
        # Also when a stage sharing the engine (evaluation) loaded this version first.
        metrics.ROLLOUT_VERSION.labels(*self._labels).set(self.engine.version)
        async with self._version_changed:
            self._version_changed.notify_all()
        return []

    def _sampling(self) -> dict[str, Any]:
        g, r = self.cfg.grpo, self.cfg.rollout
        return {
            "temperature": g.temperature,
            "top_p": g.top_p,
            "top_k": g.top_k,
            "min_p": getattr(r, "min_p", 0.0),
            "repetition_penalty": g.repetition_penalty,
            "stop": list(getattr(r, "stop", [])),
        }

    def _prompt_ids(self, task: PromptTask) -> list[int] | None:
        """The prompt's token ids under data.max_length: "left" keeps the tail, "delete" gives None."""
        data = getattr(self.cfg, "data", None)
        max_length = getattr(data, "max_length", None)
        strategy = getattr(self.cfg.grpo, "truncation_strategy", "left")
        ids = self.engine.encode_prompt(task.messages)
        kept = truncate_prompt(ids, max_length, strategy)
        if kept is None or len(kept) < len(ids):
            metrics.PROMPTS_TRUNCATED.labels(self._labels[0], strategy).inc()
        return kept

    async def handle(self, task: PromptTask, ctx: Any) -> Handled:
        # Admission: never sample batch b with weights older than b - max_staleness (the feeder saw a
        # newer version than this engine may have loaded yet).
        async with self._version_changed:
            await asyncio.wait_for(
                self._version_changed.wait_for(lambda: self.engine.version >= task.min_policy_version),
                timeout=MIN_VERSION_TIMEOUT_S,
            )
        prompt_ids = self._prompt_ids(task)
        if prompt_ids is None:  # truncation_strategy = "delete" and the feeder let a long prompt through
            dropped = Feedback(prompt_id=task.prompt_id, attempt=task.attempt, generation_batch=task.generation_batch,
                               outcome="dropped", reason="truncated", learner_version=self.engine.version)
            return Handled(outputs=[(FEEDBACK, dropped)])
        request_ids = [f"{task.group_id}/{i}" for i in range(task.num_generations)]
        metrics.REQUESTS_IN_FLIGHT.labels(*self._labels).inc(len(request_ids))
        self._versions_in_use[task.group_id] = self.engine.version
        from schedulers import EnvFailed

        try:
            if self.scheduler is None:
                trajectories = await self._single_turn(task, prompt_ids, request_ids, ctx)
            else:
                trajectories = await self._multi_turn(task, prompt_ids, request_ids, ctx)
        except EnvFailed as exc:
            # The reward failure policy: dead_letter raises (the worker retries, then dead-letters the task
            # with the reason); otherwise the group is dropped and the feeder replaces it (an env failure has
            # no partial score, so "zero" drops it too).
            metrics.ENV_FAILURES.labels(*self._labels).inc()
            if self.cfg.reward.on_error == "dead_letter":
                raise
            dropped = Feedback(prompt_id=task.prompt_id, attempt=task.attempt, generation_batch=task.generation_batch,
                               outcome="dropped", reason=f"env_error: {exc}", learner_version=self.engine.version)
            return Handled(outputs=[(FEEDBACK, dropped)])
        finally:
            metrics.REQUESTS_IN_FLIGHT.labels(*self._labels).dec(len(request_ids))
            self._versions_in_use.pop(task.group_id, None)
        tokens = sum(int(t.completion_loss_mask().sum()) for t in trajectories)
        metrics.TOKENS_GENERATED.labels(*self._labels).inc(tokens)
        self._tokens.add(tokens, time.monotonic())
        for t in trajectories:
            metrics.TURNS.labels(*self._labels).observe(t.rollout_infos.get("num_turns", 1))
        manifest = GroupClosed(
            prompt_id=task.prompt_id,
            attempt=task.attempt,
            generation_batch=task.generation_batch,
            record_ids=[t.record_id for t in trajectories],
        )
        # One entry per group: one reward worker scores it with one call per reward function (as ms-swift and
        # TRL call them on a batch; a reward model runs one batched forward), and a scheduler's request split
        # into several records is scored once. Per-record entries cost ~50 ms per demo generation batch
        # (72 entries through reward and advantage instead of 8; bench/peer_trl.py).
        return Handled(outputs=[(TRAJECTORIES, TrajectoryGroup(manifest=manifest, trajectories=trajectories))])

    async def _single_turn(self, task: PromptTask, prompt_ids: list[int], request_ids: list[str],
                           ctx: Any) -> list[Trajectory]:
        # The group's images, fetched and decoded once for its G requests.
        raw_images = await self._images.get(ctx, list(task.images)) if task.images else []
        images = pil_images(raw_images) if raw_images else None
        # The engine's prompt is longer than the ids by the image tokens it expands each placeholder into.
        length = len(prompt_ids) + (sum(self._image_token_counts(raw_images)) - len(raw_images) if raw_images else 0)
        max_tokens = min(self.cfg.grpo.max_completion_length, self.cfg.rollout.max_model_len - length)
        if max_tokens <= 0:
            raise ValueError(
                f"prompt {task.prompt_id} has {length} tokens, leaving no room under "
                f"rollout.max_model_len={self.cfg.rollout.max_model_len}; raise it or set data.max_length"
            )
        sampling = self._sampling()
        if images is not None:
            limit = self.cfg.rollout.limit_mm_per_prompt.get("image", 1)
            if len(images) > limit:
                raise ValueError(f"prompt {task.prompt_id} has {len(images)} images, over "
                                 f"rollout.limit_mm_per_prompt.image = {limit}")

        async with self.engine.running("drain"):
            samples = await self.engine.generate_group(
                prompt_ids, request_ids=[f"{rid}@{ctx.worker}" for rid in request_ids],  # unique across copies
                seed=task.seed, max_tokens=max_tokens, images=images, **sampling)
        # With images: the engine's expanded prompt ids (one image token per merged patch), which the learner's
        # forward needs; the same for every request of the group.
        packed_prompt = pack_i32(samples[0].prompt_ids if images else prompt_ids)
        return [
            Trajectory(
                prompt_id=task.prompt_id,
                attempt=task.attempt,
                request_id=rid,
                generation_batch=task.generation_batch,
                prompt_ids=packed_prompt,
                completion_ids=pack_i32(s.completion_ids),
                logprobs=pack_f32(s.logprobs),
                messages=task.messages,
                completion=self.engine.decode(s.completion_ids),
                finish_reason=s.finish_reason,
                data_dict=task.data_dict,
                images=list(task.images),
                policy_version=s.min_version,
                max_policy_version=s.max_version,
            )
            for rid, s in zip(request_ids, samples)
        ]

    def _image_token_counts(self, images: list[bytes]) -> list[int]:
        """Image tokens each image expands to in this model (one per merged patch of its processed grid)."""
        if getattr(self, "_image_processor", None) is None:
            from transformers import AutoImageProcessor

            self._image_processor = AutoImageProcessor.from_pretrained(str(self.model_dir))
        merge = getattr(self._image_processor, "merge_size", 2) ** 2
        grids = self._image_processor(images=pil_images(images), return_tensors="pt")["image_grid_thw"]
        return [int(g.prod()) // merge for g in grids]

    async def _expand_images(self, parts: Any, images: list[Any], ctx: Any) -> tuple[Any, list[str]]:
        """A multi-turn record's token ids carry one image token per image (each turn's prompt went to the
        engine so); the learner needs them expanded as the engine did. Images a later turn added sit inside
        the completion (in a user turn, mask 0): their extra tokens get mask 0 and logprob 0 too. A scheduler's
        ``rollout_infos["images"]`` replaces the request's images for training (ms-swift). The images are
        stored once by content; the record carries their keys."""
        import dataclasses

        from pipeline.media import image_bytes, put_images

        infos = dict(parts.rollout_infos)
        override = infos.pop("images", None)
        data = [image_bytes(x) for x in (override if override is not None else images)]
        pad = self.engine.image_token_id
        found = parts.prompt_ids.count(pad) + parts.completion_ids.count(pad)
        if found != len(data):
            raise ValueError(f"a multi-turn record has {found} image tokens for {len(data)} image(s); each image "
                             f"in the conversation needs exactly one image placeholder")
        counts = self._image_token_counts(data) if data else []
        prompt = [t for ts in expand_image_tokens(parts.prompt_ids, pad, counts) for t in ts]
        ids, mask, logprobs = [], [], []
        expanded = expand_image_tokens(parts.completion_ids, pad, counts, start=parts.prompt_ids.count(pad))
        for ts, m, lp in zip(expanded, parts.loss_mask, parts.logprobs):
            ids += ts
            mask += [m] + [0] * (len(ts) - 1)
            logprobs += [lp] + [0.0] * (len(ts) - 1)
        keys = await put_images(ctx, data, ttl_s=getattr(getattr(self.cfg, "transport", None), "blob_ttl_s", 86400))
        parts = dataclasses.replace(parts, prompt_ids=prompt, completion_ids=ids, loss_mask=mask, logprobs=logprobs,
                                    rollout_infos=infos)
        return parts, keys

    async def _multi_turn(self, task: PromptTask, prompt_ids: list[int], request_ids: list[str],
                          ctx: Any) -> list[Trajectory]:
        from schedulers import RequestConfig, RolloutInferRequest, maybe_await
        from schedulers.engine import RequestContext, request_context
        from schedulers.results import run_results, trajectory_parts

        name = self.cfg.rollout.multi_turn_scheduler
        loss_scale = getattr(self.cfg.rollout, "loss_scale", "default")
        first_images = await self._images.get(ctx, list(task.images)) if task.images else []

        async def one(i: int, rid: str) -> list[Trajectory]:
            config = RequestConfig(max_tokens=self.cfg.grpo.max_completion_length, seed=task.seed + i,
                                   **self._sampling())
            request = RolloutInferRequest(
                messages=copy.deepcopy(task.messages),
                # The group's stored images (bytes); a scheduler may append more in later turns.
                images=list(first_images) if task.images else list(task.data_dict.get("images") or []),
                audios=list(task.data_dict.get("audios") or []),
                videos=list(task.data_dict.get("videos") or []),
                tools=task.data_dict.get("tools"),
                data_dict=copy.deepcopy(task.data_dict),
                uuid=rid,
            )
            state = RequestContext(request_id=f"{rid}@{ctx.worker}", config=config, prompt_ids=prompt_ids)
            async with self.engine.running("drain"):
                with request_context(state):
                    results = await maybe_await(self.scheduler.run(request, config))
            results = run_results(results, name, rid)
            spans = state.versions or [(self.engine.version, self.engine.version)]
            default_versions = (min(v[0] for v in spans), max(v[1] for v in spans))
            out = []
            for j, result in enumerate(results):
                parts = trajectory_parts(result, self.infer_engine, loss_scale=loss_scale, scheduler=name, index=j,
                                         default_versions=default_versions, default_messages=task.messages)
                keys: list[str] = []
                if self.engine.image_token_id is not None and (request.images or "images" in parts.rollout_infos):
                    parts, keys = await self._expand_images(parts, list(request.images), ctx)
                out.append(Trajectory(
                    prompt_id=task.prompt_id,
                    attempt=task.attempt,
                    request_id=rid,
                    turn=j + 1 if len(results) > 1 else 0,
                    generation_batch=task.generation_batch,
                    data_dict=task.data_dict,
                    images=keys,
                    **parts.record_fields(),
                ))
            return out

        # A TaskGroup, not gather: when one request fails, its siblings are cancelled (their envs closed)
        # instead of running on unobserved.
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(one(i, rid)) for i, rid in enumerate(request_ids)]
        except BaseExceptionGroup as group:
            raise _first_error(group) from None
        return [t for task in tasks for t in task.result()]


def expand_image_tokens(ids: list[int], image_token_id: int, counts: list[int], start: int = 0) -> list[list[int]]:
    """Pure: for each token of ``ids``, the tokens it becomes: the k-th image token (counting from ``start``)
    becomes ``counts[k]`` image tokens (one per merged patch, as the engine expands it), others stay."""
    out, k = [], start
    for t in ids:
        if t == image_token_id:
            out.append([t] * counts[k])
            k += 1
        else:
            out.append([t])
    return out


def _first_error(group: BaseExceptionGroup) -> BaseException:
    """The first real error of a TaskGroup (its siblings' CancelledErrors are consequences)."""
    errors = [e for e in group.exceptions if not isinstance(e, asyncio.CancelledError)] or list(group.exceptions)
    first = errors[0]
    return _first_error(first) if isinstance(first, BaseExceptionGroup) else first


def check_gym_scheduler(scheduler: Any, cfg: Any) -> None:
    """With use_gym_env the scheduler must drive envs, and a configured env name must be registered."""
    from schedulers import GYMScheduler, SchedulerError
    from schedulers.gym import env_class

    if not isinstance(scheduler, GYMScheduler):
        raise SchedulerError(
            f"rollout.use_gym_env = true needs a gym scheduler (gym_scheduler or a GYMScheduler subclass); "
            f"rollout.multi_turn_scheduler = {cfg.rollout.multi_turn_scheduler!r} is a {type(scheduler).__name__}"
        )
    if cfg.rollout.gym_env:
        env_class(cfg.rollout.gym_env)


def gym_kwargs(cfg: Any) -> dict[str, Any]:
    """The scheduler kwargs of ``rollout.use_gym_env`` (ms-swift passes gym_env / context_manager the same way)."""
    r = cfg.rollout
    if not getattr(r, "use_gym_env", False):
        return {}
    return {
        "gym_env": r.gym_env,
        "context_manager": r.context_manager,
        "env_config": dict(r.env_config),
        "env_timeout_s": r.env_timeout_s,
        "max_concurrent_envs": r.max_concurrent_envs,
        "env_max_retries": cfg.reward.max_retries,  # the reward failure policy's retries
    }

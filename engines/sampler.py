"""The group sampler: one prompt group in, its trajectories out. The rollout stage and evaluation share it.

Each of a group's ``num_generations`` samples has its own request id (``<group_id>/<i>``) and seed
(``task.seed + i``), so a group's samples are independent and reproducible. Single-turn, a group is one
engine call (``generate_group``: on the in-process engine one vLLM request with ``n = G``, whose i-th child
vLLM seeds ``seed + i``: the same samples as G requests, with one request's front-end cost; on servers G
requests). A trajectory keeps prompt/completion token ids and the sampled tokens' logprobs, and is stamped
with the oldest and newest weights versions that produced it.

With a ``schedulers.MultiTurnScheduler`` (ms-swift's API) each request is driven by the scheduler's
``run``, which returns one or more records per request (several = per-turn records that share the request
id). Image-prompt models: a multi-turn record's image tokens are expanded as the engine expanded them, and
its images stored once by content through the transport.

Prompts are rendered here (``encode_prompt``) with the run's chat template (``data.chat``: its keywords,
e.g. ``enable_thinking``, and the row's tools), and so are a multi-turn scheduler's later turns. The context
length is the engine's, and a prompt is capped (``max_prompt_length``) so that a whole completion of
``grpo.max_completion_length`` tokens always fits: none is cut short by the context.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
from typing import Any

from config import Config, ConfigError, context_budget_error, verifiers_env
from data.chat import ChatTemplate, tool_schemas
from data.media import ImageCache, image_bytes, pil_images, put_images
from engines.base import EngineBase, Sample, expand_image_tokens, max_prompt_length, resolve_max_model_len
from pipeline.records import PromptTask, Trajectory, pack_f32, pack_i32
from schedulers import (
    AgentScheduler,
    GYMScheduler,
    RequestConfig,
    RolloutInferRequest,
    RolloutScheduler,
    SchedulerError,
    ToolCallingScheduler,
    construct_scheduler,
    maybe_await,
)
from schedulers.engine import InferEngine, RequestContext, request_context
from schedulers.gym import env_class
from schedulers.results import run_results, trajectory_parts


def sampling_options(cfg: Config, *, temperature: float) -> dict[str, Any]:
    """The engine's sampling keywords from the config (``temperature``: training's or evaluation's)."""
    g, r = cfg.grpo, cfg.rollout
    return {
        "temperature": temperature,
        "top_p": g.top_p,
        "top_k": g.top_k,
        "min_p": r.min_p,
        "repetition_penalty": g.repetition_penalty,
        "stop": list(r.stop),
    }


def gym_kwargs(cfg: Config) -> dict[str, Any]:
    """The scheduler kwargs of ``rollout.use_gym_env`` (ms-swift passes use_gym_env / gym_env / context_manager
    the same way)."""
    r = cfg.rollout
    if not r.use_gym_env:
        return {}
    return {
        "use_gym_env": True,
        "gym_env": r.gym_env,
        "context_manager": r.context_manager,
        "env_config": dict(r.env_config),
        "env_timeout_s": r.env_timeout_s,
        "max_concurrent_envs": r.max_concurrent_envs,
        "env_max_retries": cfg.reward.max_retries,  # the reward failure policy's retries
    }


def check_gym_scheduler(scheduler: Any, cfg: Config) -> None:
    """With use_gym_env the scheduler (class or instance) must drive envs, and a configured env name must be
    registered."""
    cls = scheduler if isinstance(scheduler, type) else type(scheduler)
    if not issubclass(cls, GYMScheduler):
        raise SchedulerError(
            f"rollout.use_gym_env = true needs a gym scheduler (gym_scheduler or a GYMScheduler subclass); "
            f"rollout.multi_turn_scheduler = {cfg.rollout.multi_turn_scheduler!r} is a {cls.__name__}"
        )
    if cfg.rollout.gym_env:
        env_class(cfg.rollout.gym_env)


def context_length(engine: EngineBase, cfg: Config) -> int:
    """The context a group may fill: the engine's own (a server's, the in-process vLLM's) when it says, at most
    rollout.max_model_len; else resolved from the config and the model. A prompt of data.max_length plus a
    whole completion must fit in it (ConfigError otherwise)."""
    known = engine.max_model_len
    if known is None:
        return resolve_max_model_len(cfg, engine.model_dir)
    configured = cfg.rollout.max_model_len
    if configured is not None and configured <= known:
        length, where = configured, "rollout.max_model_len"
    else:
        length, where = known, f"the engine's max_model_len ({type(engine).__name__})"
    problem = context_budget_error(length, cfg.grpo.max_completion_length, cfg.data.max_length, where)
    if problem:
        raise ConfigError(problem)
    return length


def task_tools(task: PromptTask) -> list[dict[str, Any]] | None:
    """The task's tool schemas (tasks written before PromptTask.tools carried them in data_dict)."""
    return task.tools if task.tools is not None else task.data_dict.get("tools")


def tool_kwargs(cfg: Config) -> dict[str, Any]:
    """The tool_calling scheduler's settings (TRL's tools / environment_factory), when any is set."""
    r = cfg.rollout
    if not (r.tools or r.environment_factory):
        return {}
    return {
        "tools": list(r.tools),
        "environment_factory": r.environment_factory,
        "max_tool_calling_iterations": r.max_tool_calling_iterations,
        "tool_timeout_s": r.tool_timeout_s,
        "max_completion_length": cfg.grpo.max_completion_length,
        "max_concurrent_tools": max(1, r.max_concurrent_groups),
    }


def agent_kwargs(cfg: Config) -> dict[str, Any]:
    """The agent scheduler's settings (rollout.agent), when set."""
    r = cfg.rollout
    if not r.agent:
        return {}
    return {"agent": r.agent, "agent_timeout_s": r.agent_timeout_s, "agent_host": r.agent_host,
            "max_completion_length": cfg.grpo.max_completion_length}


def verifiers_kwargs(cfg: Config) -> dict[str, Any]:
    """The verifiers scheduler's settings (data.dataset = "verifiers:<env id>"), when it is one."""
    env = verifiers_env(cfg.data)
    if env is None:
        return {}
    r = cfg.rollout
    return {"verifiers_env": env, "verifiers_python": r.verifiers_python, "verifiers_taskset": dict(r.verifiers_taskset),
            "verifiers_max_episodes": r.verifiers_max_episodes, "agent_timeout_s": r.agent_timeout_s,
            "agent_host": r.agent_host, "max_completion_length": cfg.grpo.max_completion_length}


def check_tool_scheduler(scheduler: Any, cfg: Config) -> None:
    """rollout.tools / environment_factory need the tool_calling scheduler (or a subclass)."""
    cls = scheduler if isinstance(scheduler, type) else type(scheduler)
    if cfg.rollout.agent and not issubclass(cls, AgentScheduler):
        raise SchedulerError(
            f"rollout.agent runs in the agent scheduler; rollout.multi_turn_scheduler = "
            f"{cfg.rollout.multi_turn_scheduler!r} is a {cls.__name__}: leave it unset"
        )
    if (cfg.rollout.tools or cfg.rollout.environment_factory) and not issubclass(cls, ToolCallingScheduler):
        raise SchedulerError(
            f"rollout.tools / rollout.environment_factory run in the tool_calling scheduler (TRL's tool loop); "
            f"rollout.multi_turn_scheduler = {cfg.rollout.multi_turn_scheduler!r} is a {cls.__name__}: leave it "
            f"unset, or subclass schedulers.ToolCallingScheduler"
        )


def make_scheduler(cls: type[RolloutScheduler], cfg: Config, infer_engine: InferEngine) -> RolloutScheduler:
    """``cls`` built by keyword on the engine, as ms-swift's rollout builds it: ``infer_engine``, ``max_turns``,
    ``tokenizer`` (where declared) and, with use_gym_env, the gym settings (with rollout.tools /
    environment_factory, the tool settings)."""
    return construct_scheduler(cls, infer_engine=infer_engine, max_turns=cfg.rollout.max_turns,
                               tokenizer=infer_engine.tokenizer, **gym_kwargs(cfg), **tool_kwargs(cfg),
                               **agent_kwargs(cfg), **verifiers_kwargs(cfg))


class GroupSampler:
    """Samples prompt groups on ``engine`` with the config's sampling settings: single-turn, or through
    ``scheduler``: a scheduler class (built here, on this sampler's engine) or an instance (whose
    ``infer_engine`` this sets when it has none). ``temperature``: None = ``grpo.temperature``."""

    def __init__(self, engine: EngineBase, cfg: Config, *, scheduler: Any = None,
                 temperature: float | None = None) -> None:
        self.engine = engine
        self.cfg = cfg
        self.sampling = sampling_options(cfg, temperature=cfg.grpo.temperature if temperature is None else temperature)
        self.chat = ChatTemplate.from_config(cfg)
        if engine.tokenizer is not None:  # a broken template or keyword fails now, not on the first prompt
            self.chat.check(engine.tokenizer)
        self.max_model_len = context_length(engine, cfg)
        self.max_prompt_length = max_prompt_length(cfg, self.max_model_len)
        self.infer_engine = InferEngine(engine, max_model_len=self.max_model_len, chat=self.chat)
        if isinstance(scheduler, type):
            scheduler = make_scheduler(scheduler, cfg, self.infer_engine)
        elif scheduler is not None and scheduler.__dict__.get("infer_engine") is None:
            scheduler.infer_engine = self.infer_engine
        self.scheduler = scheduler
        # TRL's tools (rollout.tools and an environment's methods): shown to the model in every prompt.
        self.run_tools = scheduler.tool_schemas if isinstance(scheduler, ToolCallingScheduler) else None
        self.images = ImageCache()
        self._image_processor: Any = None

    def encode_prompt(self, task: PromptTask) -> list[int]:
        """The task's prompt ids as the engine sees them: the run's chat template with the task's tools (before
        truncation to ``max_prompt_length``)."""
        return self.engine.encode_prompt(task.messages, tools=self.tools_of(task), chat_template=self.chat)

    def tools_of(self, task: PromptTask) -> list[dict[str, Any]] | None:
        """The tool schemas the task's prompt shows: the row's ``tools`` column, then the run's tools."""
        own = tool_schemas(task_tools(task), where=f"prompt {task.prompt_id}: tools") or []
        return [*own, *(self.run_tools or [])] or None

    async def sample(
        self,
        task: PromptTask,
        prompt_ids: list[int],
        ctx: Any,
        *,
        engine_tag: str,
        what: str | None = None,
        priority: int = 0,
        gated: bool = True,
    ) -> list[Trajectory]:
        """The group's trajectories. ``prompt_ids``: the tokenised (and truncated) prompt; ``ctx``: the stage
        context that fetches and stores images (None for a group without images); ``engine_tag`` makes the
        engine's request ids unique across workers (``<request id>@<tag>``); ``what`` names the prompt in
        errors. ``priority`` / ``gated`` as ``generate`` takes them (single-turn only)."""
        request_ids = [f"{task.group_id}/{i}" for i in range(task.num_generations)]
        if self.scheduler is None:
            return await self._single_turn(task, prompt_ids, request_ids, ctx, engine_tag=engine_tag,
                                           what=what or f"prompt {task.prompt_id}", priority=priority, gated=gated)
        return await self._multi_turn(self.scheduler, task, prompt_ids, request_ids, ctx, engine_tag=engine_tag)

    async def _single_turn(self, task: PromptTask, prompt_ids: list[int], request_ids: list[str], ctx: Any, *,
                           engine_tag: str, what: str, priority: int, gated: bool) -> list[Trajectory]:
        # The group's images, fetched and decoded once for its G requests.
        raw_images = await self.images.get(ctx, list(task.images)) if task.images else []
        images = pil_images(raw_images) if raw_images else None
        # The engine's prompt is longer than the ids by the image tokens it expands each placeholder into.
        length = len(prompt_ids) + (sum(self.image_token_counts(raw_images)) - len(raw_images) if raw_images else 0)
        max_tokens = self.cfg.grpo.max_completion_length
        if length + max_tokens > self.max_model_len:  # never cut a completion short: refuse the prompt
            raise ValueError(
                f"{what} has {length} tokens{' with its images expanded' if raw_images else ''}: with "
                f"grpo.max_completion_length={max_tokens} that is {length + max_tokens} > max_model_len="
                f"{self.max_model_len}; lower data.max_length (to {self.max_model_len - max_tokens} at most) or "
                f"raise rollout.max_model_len"
            )
        if images is not None:
            limit = self.cfg.rollout.limit_mm_per_prompt.get("image", 1)
            if len(images) > limit:
                raise ValueError(f"prompt {task.prompt_id} has {len(images)} images, over "
                                 f"rollout.limit_mm_per_prompt.image = {limit}")

        # Ungated (evaluation on a shared engine): a weight load does not wait for this group.
        async with self.engine.running("drain") if gated else contextlib.nullcontext():
            samples = await self.engine.generate_group(
                prompt_ids, request_ids=[f"{rid}@{engine_tag}" for rid in request_ids],  # unique across copies
                seed=task.seed, max_tokens=max_tokens, images=images, priority=priority, gated=gated,
                **self.sampling)
        # With images: the engine's expanded prompt ids (one image token per merged patch), which the learner's
        # forward needs; the same for every request of the group.
        packed_prompt = pack_i32(samples[0].prompt_ids if images else prompt_ids)
        return [self._trajectory(task, rid, packed_prompt, s) for rid, s in zip(request_ids, samples)]

    def _trajectory(self, task: PromptTask, request_id: str, packed_prompt: bytes, s: Sample) -> Trajectory:
        return Trajectory(
            prompt_id=task.prompt_id,
            attempt=task.attempt,
            request_id=request_id,
            generation_batch=task.generation_batch,
            prompt_ids=packed_prompt,
            completion_ids=pack_i32(s.completion_ids),
            logprobs=pack_f32(s.logprobs),
            messages=task.messages,
            completion=self.engine.decode(s.completion_ids),
            finish_reason=s.finish_reason,
            data_dict=reward_columns(task),
            images=list(task.images),
            policy_version=s.min_version,
            max_policy_version=s.max_version,
        )

    def image_token_counts(self, images: list[bytes]) -> list[int]:
        """Image tokens each image expands to in this model (one per merged patch of its processed grid)."""
        if self._image_processor is None:
            from transformers import AutoImageProcessor

            self._image_processor = AutoImageProcessor.from_pretrained(str(self.engine.model_dir))
        merge = getattr(self._image_processor, "merge_size", 2) ** 2
        grids = self._image_processor(images=pil_images(images), return_tensors="pt")["image_grid_thw"]
        return [int(g.prod()) // merge for g in grids]

    async def _expand_images(self, parts: Any, images: list[Any], ctx: Any, pad: int) -> tuple[Any, list[str]]:
        """A multi-turn record's token ids carry one image token per image (each turn's prompt went to the
        engine so); the learner needs them expanded as the engine did. Images a later turn added sit inside
        the completion (in a user turn, mask 0): their extra tokens get mask 0 and logprob 0 too. A scheduler's
        ``rollout_infos["images"]`` replaces the request's images for training (ms-swift). The images are
        stored once by content; the record carries their keys."""
        infos = dict(parts.rollout_infos)
        override = infos.pop("images", None)
        data = [image_bytes(x) for x in (override if override is not None else images)]
        found = parts.prompt_ids.count(pad) + parts.completion_ids.count(pad)
        if found != len(data):
            raise ValueError(f"a multi-turn record has {found} image tokens for {len(data)} image(s); each image "
                             f"in the conversation needs exactly one image placeholder")
        counts = self.image_token_counts(data) if data else []
        prompt = [t for ts in expand_image_tokens(parts.prompt_ids, pad, counts) for t in ts]
        ids, mask, logprobs, at = [], [], [], [0]  # at[i]: where the i-th unexpanded token now starts
        expanded = expand_image_tokens(parts.completion_ids, pad, counts, start=parts.prompt_ids.count(pad))
        for ts, m, lp in zip(expanded, parts.loss_mask, parts.logprobs):
            ids += ts
            mask += [m] + [0] * (len(ts) - 1)
            logprobs += [lp] + [0.0] * (len(ts) - 1)
            at.append(len(ids))
        spans = [(at[start], at[end]) for start, end in parts.message_spans]
        keys = await put_images(ctx, data, ttl_s=self.cfg.transport.blob_ttl_s)
        parts = dataclasses.replace(parts, prompt_ids=prompt, completion_ids=ids, loss_mask=mask, logprobs=logprobs,
                                    rollout_infos=infos, message_spans=spans)
        return parts, keys

    async def _multi_turn(self, scheduler: Any, task: PromptTask, prompt_ids: list[int], request_ids: list[str],
                          ctx: Any, *, engine_tag: str) -> list[Trajectory]:
        name = self.cfg.rollout.multi_turn_scheduler or type(scheduler).__name__  # (a scheduler given directly)
        loss_scale = self.cfg.rollout.loss_scale
        first_images = await self.images.get(ctx, list(task.images)) if task.images else []

        async def one(i: int, rid: str) -> list[Trajectory]:
            config = RequestConfig(max_tokens=self.cfg.grpo.max_completion_length, seed=task.seed + i,
                                   **self.sampling)
            request = RolloutInferRequest(
                messages=copy.deepcopy(task.messages),
                # The group's stored images (bytes); a scheduler may append more in later turns.
                images=list(first_images) if task.images else list(task.data_dict.get("images") or []),
                audios=list(task.data_dict.get("audios") or []),
                videos=list(task.data_dict.get("videos") or []),
                tools=self.tools_of(task),
                data_dict=copy.deepcopy(task.data_dict),
                uuid=rid,
            )
            state = RequestContext(request_id=f"{rid}@{engine_tag}", config=config, prompt_ids=prompt_ids,
                                   tools=request.tools)
            async with self.engine.running("drain"):
                with request_context(state):
                    results = await maybe_await(scheduler.run(request, config))
            results = run_results(results, name, rid)
            spans = state.versions or [(self.engine.version, self.engine.version)]
            default_versions = (min(v[0] for v in spans), max(v[1] for v in spans))
            out = []
            for j, result in enumerate(results):
                parts = trajectory_parts(result, self.infer_engine, loss_scale=loss_scale, scheduler=name, index=j,
                                         default_versions=default_versions, default_messages=task.messages)
                keys: list[str] = []
                pad = self.engine.image_token_id
                if pad is not None and (request.images or "images" in parts.rollout_infos):
                    parts, keys = await self._expand_images(parts, list(request.images), ctx, pad)
                out.append(Trajectory(
                    prompt_id=task.prompt_id,
                    attempt=task.attempt,
                    request_id=rid,
                    turn=j + 1 if len(results) > 1 else 0,
                    generation_batch=task.generation_batch,
                    data_dict=reward_columns(task),
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
            raise first_error(group) from None
        return [t for task in tasks for t in task.result()]


def reward_columns(task: PromptTask) -> dict[str, Any]:
    """The row's columns the reward functions get: the task's data_dict, with its tools column back."""
    return task.data_dict if task.tools is None else {**task.data_dict, "tools": task.tools}


def first_error(group: BaseExceptionGroup) -> BaseException:
    """The first real error of a TaskGroup (its siblings' CancelledErrors are consequences)."""
    errors = [e for e in group.exceptions if not isinstance(e, asyncio.CancelledError)] or list(group.exceptions)
    first = errors[0]
    return first_error(first) if isinstance(first, BaseExceptionGroup) else first

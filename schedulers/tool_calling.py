"""TRL's agent training in rollstream: ``GRPOTrainer(tools=[...])`` and ``environment_factory=MyEnv``.

``rollout.tools = ["my_module:my_function", ...]`` and ``rollout.environment_factory = "my_module:MyEnv"`` select
the ``tool_calling`` scheduler, which runs TRL's tool loop (``GRPOTrainer._tool_call_loop``) per request:

1. With an environment: take an instance from the worker's pool (TRL: one per generation, built once and
   reset often), ``reset(**row)`` (the dataset row, ``prompt`` included); a returned string is appended to the
   last prompt message. The instance's public methods (not ``reset``/``get_reward``, not ``_private``) are
   tools next to ``rollout.tools``.
2. Sample a reply; parse its tool calls with transformers' response parser (``tokenizer.parse_response``) and
   the chat template family's response template (Hermes/Qwen ``<tool_call>{json}</tool_call>``, Llama 3 JSON;
   a tokenizer's own ``response_template`` wins).
3. No call, a truncated reply, or ``max_tool_calling_iterations`` reached: the episode ends. Otherwise run the
   calls (async tools awaited, sync ones in a thread, each under ``rollout.tool_timeout_s``); a raising,
   unknown or timed-out tool answers ``{'error': '...'}`` as TRL does. Append one ``tool`` message per call and
   the chat template's tokens for them, then sample again.

Token exactness: the trained sequence is the sampled tokens plus the template's tokens of the tool messages
(loss mask 0), computed as TRL does from a minimal conversation (so a template that rewrites earlier turns,
e.g. dropping old reasoning, cannot change what was sampled). Where re-rendering the whole conversation
would give other tokens than those, the request counts it (``rollout_infos["template_rewrites"]``,
``tools/template_rewrite_frequency``) and keeps the sampled ones. A tool result that would push the completion
past ``grpo.max_completion_length`` (or the context) is dropped and the episode ends there, as in TRL.

Counted per request in ``rollout_infos``: ``num_tool_calls``, ``num_tool_failures`` (TRL's
``tools/call_frequency`` and ``tools/failure_frequency`` in metrics.jsonl). A call whose text opens a tool
call but does not parse ends the episode as plain text (TRL) and counts as a failed call.

The environment's plain-data attributes and ``get_reward()`` at the end of the episode travel with the
record (``rewards.environments``), so reward functions get ``environments=[...]`` on both transports.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import inspect
import json
from collections.abc import Callable
from typing import Any

from pipeline.plugins import PluginError, load_object
from rewards.environments import environment_snapshot
from rewards.scoring import DaemonThreadPool
from schedulers.base import MultiTurnScheduler, SchedulerError
from schedulers.engine import CURRENT
from schedulers.protocol import RequestConfig, RolloutInferRequest, extract_logprobs

# Tools a plugin file registers by name (``from schedulers import registered_tools; registered_tools["add"] =
# add``), and environment classes (``environment_factories["wordle"] = WordleEnv``): rollout.tools and
# rollout.environment_factory take these names as well as "module:attribute".
registered_tools: dict[str, Callable[..., Any]] = {}
environment_factories: dict[str, Callable[[], Any]] = {}

# Response templates (transformers' declarative format, read by ``tokenizer.parse_response``) of the chat
# template families whose tool calls rollstream parses when the tokenizer brings none of its own.
HERMES_RESPONSE_TEMPLATE: dict[str, Any] = {  # Qwen2/2.5/3, Hermes: <tool_call>\n{json}\n</tool_call>
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {"open": "<think>", "close": "</think>", "content": "text"},
        "tool_calls": {
            "open_pattern": r"\s*<tool_call>",
            "close": "</tool_call>",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"\s*(?:<\|im_end\|>|<\|endoftext\|>)", "content": "text"},
    },
}
LLAMA3_RESPONSE_TEMPLATE: dict[str, Any] = {  # Llama 3.1+: {"name": ..., "parameters": {...}}<|eot_id|>
    "defaults": {"role": "assistant"},
    "start_anchor": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "fields": {
        "tool_calls": {
            "open_pattern": r"\s*(?:<\|python_tag\|>)?(?=\{\s*\"name\")",
            "close_pattern": r"(?<=\})\s*(?=<\|eot_id\|>|<\|eom_id\|>|;|$)",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": {"name": "{content.name}",
                                                           "arguments": "{content.parameters}"}},
        },
        "content": {"close_pattern": r"\s*(?:<\|eot_id\|>|<\|eom_id\|>)", "content": "text"},
    },
}
TOOL_CALL_OPENERS = {"hermes": "<tool_call>", "llama3": '{"name"'}
RESPONSE_TEMPLATES = {"hermes": HERMES_RESPONSE_TEMPLATE, "llama3": LLAMA3_RESPONSE_TEMPLATE}
ENV_METHODS_NOT_TOOLS = ("reset", "get_reward", "close")


class ToolSetupError(SchedulerError):
    """A tool or environment that cannot be used as configured (the message names the setting and the fix)."""


def resolve(spec: str, registry: dict[str, Any], setting: str) -> Any:
    """``spec``: a name in ``registry`` (registered by a plugin) or ``"module:attribute"``."""
    if spec in registry:
        return registry[spec]
    if ":" not in spec:
        known = f"; registered: {', '.join(sorted(registry))}" if registry else ""
        raise ToolSetupError(f"{setting} = {spec!r}: give \"module:name\" (e.g. \"my_tools:add\") or a name "
                             f"a plugin registered{known}")
    try:
        return load_object(spec, setting)
    except PluginError as exc:
        raise ToolSetupError(str(exc)) from None


def load_tools(specs: list[str]) -> list[Callable[..., Any]]:
    tools = [resolve(spec, registered_tools, "rollout.tools") for spec in specs]
    for spec, tool in zip(specs, tools):
        if not callable(tool):
            raise ToolSetupError(f"rollout.tools = {spec!r} is a {type(tool).__name__}, not a function")
    return tools


def load_environment_factory(spec: str) -> Callable[[], Any]:
    factory = resolve(spec, environment_factories, "rollout.environment_factory")
    if not callable(factory):
        raise ToolSetupError(f"rollout.environment_factory = {spec!r} is a {type(factory).__name__}; give a class "
                             f"(or a function) that returns an environment instance")
    return factory


def environment_tools(env: Any) -> list[Callable[..., Any]]:
    """TRL's: every public bound method of the instance but ``reset`` and ``get_reward`` (and ``close``,
    which the pool calls) is a tool."""
    return [member for name, member in inspect.getmembers(env, predicate=inspect.ismethod)
            if not name.startswith("_") and name not in ENV_METHODS_NOT_TOOLS]


def tool_schema(tool: Callable[..., Any]) -> dict[str, Any]:
    """The tool's JSON schema from its signature and Google-style docstring, by transformers' own helper
    (what ``apply_chat_template(tools=[f])`` uses)."""
    from transformers.utils.chat_template_utils import (
        DocstringParsingException,
        TypeHintParsingException,
        get_json_schema,
    )

    try:
        return get_json_schema(tool)
    except (DocstringParsingException, TypeHintParsingException) as exc:
        name = getattr(tool, "__qualname__", repr(tool))
        raise ToolSetupError(
            f"tool {name}: transformers cannot build its JSON schema ({exc}). A tool needs type hints on every "
            f"argument and a Google-style docstring with an Args: section describing each one, as TRL requires"
        ) from None


def response_family(tokenizer: Any, chat_template: str | None) -> str | None:
    """Which tool-call format the chat template writes (None: the tokenizer brings its own response_template)."""
    if getattr(tokenizer, "response_template", None) is not None:
        return None
    text = chat_template or getattr(tokenizer, "chat_template", None) or ""
    if isinstance(text, dict):
        text = "\n".join(text.values())
    if "<tool_call>" in text:
        return "hermes"
    if "<|eot_id|>" in text and ("parameters" in text or "<|python_tag|>" in text):
        return "llama3"
    raise ToolSetupError(
        "rollout.tools / rollout.environment_factory: the chat template writes no tool-call format rollstream "
        "parses (Hermes/Qwen <tool_call>{json}</tool_call>, Llama 3 JSON). Use a model whose template renders "
        "tools, set model.chat_template to one that does, or give the tokenizer a response_template "
        "(transformers' response parsing)"
    )


class ReplyParser:
    """A reply's token ids as an assistant message (``tool_calls`` when it calls tools), by transformers' response
    parser with the chat template family's response template (found on the first reply)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.family = response_family(engine.tokenizer, engine.chat.template)

    def parse(self, ids: list[int], context: list[int], tools: list[dict[str, Any]] | None) -> tuple[dict[str, Any], bool]:
        """``(message, malformed)``: ``malformed`` when the reply opened a tool call it did not write well (then
        the message is the plain text, as TRL falls back)."""
        template = RESPONSE_TEMPLATES[self.family] if self.family else None
        text = self.engine.decode(ids)
        try:
            parsed = self.engine.tokenizer.parse_response(ids, schema=template, prefix=context, tools=tools)
            if not isinstance(parsed, dict):
                raise ValueError("parse_response returned nothing")  # noqa: TRY004 (caught as a bad response)
            calls = parsed.get("tool_calls")
            if calls is not None:
                check_tool_calls(calls)
        except (ValueError, TypeError, KeyError) as exc:  # the parsers' errors on a malformed call
            opener = TOOL_CALL_OPENERS.get(self.family or "", "")
            return {"role": "assistant", "content": text}, bool(opener) and opener in text or _mentions(exc)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.get("content") or ""}
        if parsed.get("reasoning_content"):
            message["reasoning_content"] = parsed["reasoning_content"]
        if parsed.get("tool_calls"):
            message["tool_calls"] = parsed["tool_calls"]
        return message, False


class _Episode:
    """One request's tokens and counts while its tool loop runs."""

    def __init__(self, prompt_ids: list[int]) -> None:
        self.prompt_ids = prompt_ids
        self.rounds: list[list[int]] = []  # one per assistant message: its sampled ids, then the tool gap
        self.masks: list[list[int]] = []
        self.logprobs: list[list[float]] = []
        self.message_lengths: list[int] = []
        self.calls = 0
        self.failures = 0
        self.rewrites = 0

    @property
    def completion_ids(self) -> list[int]:
        return [t for r in self.rounds for t in r]

    def add_reply(self, ids: list[int], logprobs: list[float]) -> None:
        self.rounds.append(list(ids))
        self.masks.append([1] * len(ids))
        self.logprobs.append(list(logprobs))
        self.message_lengths.append(len(ids))

    def add_gap(self, ids: list[int]) -> None:
        self.rounds[-1] += ids
        self.masks[-1] += [0] * len(ids)


class ToolCallingScheduler(MultiTurnScheduler):
    """``tool_calling``: TRL's tool loop over ``tools`` and an ``environment_factory``'s instances."""

    def __init__(self, infer_engine: Any = None, max_turns: int | None = None, *, tools: list[str] | None = None,
                 environment_factory: str | None = None, max_tool_calling_iterations: int | None = None,
                 tool_timeout_s: float = 30.0, max_completion_length: int | None = None,
                 max_concurrent_tools: int = 16, **kwargs: Any) -> None:
        super().__init__(infer_engine, max_turns, **kwargs)
        self.tools = load_tools(list(tools or []))
        self.factory = load_environment_factory(environment_factory) if environment_factory else None
        self.max_iterations = max_tool_calling_iterations
        self.tool_timeout_s = tool_timeout_s
        self.max_completion_length = max_completion_length
        self._pool: list[Any] = []  # idle environment instances, reset before each episode
        self._created = 0
        self._threads = DaemonThreadPool(max_concurrent_tools, "tools")  # a hung sync tool never pins the process
        self.env_tools: list[Callable[..., Any]] = []
        self.env_has_reward = False
        if self.factory is not None:
            probe = self.factory()  # as TRL: probe one instance for its tools; it seeds the pool
            if not callable(getattr(probe, "reset", None)):
                raise ToolSetupError(f"rollout.environment_factory = {environment_factory!r}: its instances have "
                                     f"no reset method; TRL's environments define reset(**row) -> str | None")
            self.env_tools = environment_tools(probe)
            self.env_has_reward = callable(getattr(probe, "get_reward", None))
            self._pool.append(probe)
            self._created = 1
        if not self.tools and not self.env_tools:
            raise ToolSetupError("the tool_calling scheduler needs rollout.tools or an environment_factory whose "
                                 "instances have public methods (its tools)")
        names = [t.__name__ for t in [*self.tools, *self.env_tools]]
        if len(set(names)) != len(names):
            raise ToolSetupError(f"two tools share a name ({', '.join(names)}); the model calls them by name")
        self.tool_schemas = [tool_schema(t) for t in [*self.tools, *self.env_tools]]
        self._parser: ReplyParser | None = None  # made on the first reply (the engine's tokenizer)

    # ------------------------------------------------------------ the environment pool

    async def _acquire(self) -> Any:
        if self._pool:
            return self._pool.pop()
        self._created += 1
        factory = self.factory
        assert factory is not None, "only with an environment_factory"
        return await self._blocking(factory)

    async def _blocking(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A sync call off the event loop (a pool thread), an async one awaited."""
        if inspect.iscoroutinefunction(fn):
            return await fn(*args, **kwargs)
        result = await asyncio.wrap_future(self._threads.submit(fn, *args, **kwargs))
        return await result if inspect.isawaitable(result) else result

    async def shutdown(self) -> None:
        """Close the pooled environments (those that define close()) and stop the tool threads."""
        pool, self._pool = self._pool, []
        for env in pool:
            close = getattr(env, "close", None)
            if callable(close):
                with contextlib.suppress(Exception):  # one env's failing close must not keep the others open
                    await asyncio.wait_for(self._blocking(close), timeout=self.tool_timeout_s)
        self._threads.shutdown(wait=False, cancel_futures=True)

    def parse_reply(self, ids: list[int], context: list[int]) -> tuple[dict[str, Any], bool]:
        if self._parser is None:
            self._parser = ReplyParser(self.infer_engine)
        return self._parser.parse(ids, context, self.tool_schemas)

    # ------------------------------------------------------------ running tools

    async def call_tool(self, call: dict[str, Any], tools: dict[str, Callable[..., Any]]) -> tuple[str, Any, bool]:
        """``(name, result, failed)``; a failure's result is TRL's ``{"error": str(exc)}``."""
        function = call.get("function", call)
        name = str(function.get("name", "unknown"))
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):  # some formats carry the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except ValueError as exc:
                return name, {"error": f"arguments are not JSON: {exc}"}, True
        if not isinstance(arguments, dict):
            return name, {"error": f"arguments must be an object, got {type(arguments).__name__}"}, True
        tool = tools.get(name)
        if tool is None:
            return name, {"error": f"Tool {name} not found."}, True  # TRL's words
        try:
            result = await asyncio.wait_for(self._blocking(tool, **arguments), timeout=self.tool_timeout_s)
        except TimeoutError:
            return name, {"error": f"tool {name} timed out after {self.tool_timeout_s:g} s"}, True
        except Exception as exc:  # noqa: BLE001 - a tool's own failure goes back to the model, as in TRL
            return name, {"error": str(exc)}, True
        return name, result, False

    def tool_suffix_ids(self, tool_messages: list[dict[str, Any]]) -> list[int]:
        """The chat template's tokens after a reply's end-of-turn up to the next reply, for ``tool_messages``:
        TRL's ``_get_tool_suffix_ids``, from a minimal conversation (never a re-render of the episode)."""
        engine = self.infer_engine
        call = {"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}
        dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
        prefix = engine.encode(engine.render(dummy, close_last=True))
        full = engine.encode(engine.render(dummy + tool_messages))
        eos = engine.eos_token_id
        turns = sum(t == eos for t in prefix)
        if turns:
            # After the end-of-turn token that closes the assistant's reply, which the reply sampled itself
            # (Qwen renders "<|im_end|>\n"). Counted, not compared: a template that renders the closed turn
            # otherwise once a tool message follows (Qwen3's reasoning) still closes it with that token.
            ends = [i for i, t in enumerate(full) if t == eos]
            if len(ends) >= turns:
                return full[ends[turns - 1] + 1:]
        if full[: len(prefix)] != prefix:
            raise SchedulerError("tool_calling: the chat template renders tool messages by rewriting the assistant "
                                 "turn before them and has no end-of-turn token to align on; it cannot be used "
                                 "for token-exact tool calling (set model.chat_template to a prefix-preserving one)")
        return full[len(prefix):]

    # ------------------------------------------------------------ the loop

    async def run(self, infer_request: RolloutInferRequest, request_config: RequestConfig | None = None,
                  **kwargs: Any) -> dict[str, Any]:
        engine = self.infer_engine
        request = infer_request
        env = await self._acquire() if self.factory is not None else None
        try:
            return await self._episode(engine, request, env, request_config, **kwargs)
        finally:
            if env is not None:
                self._pool.append(env)

    async def _episode(self, engine: Any, request: RolloutInferRequest, env: Any,
                       request_config: RequestConfig | None, **kwargs: Any) -> dict[str, Any]:
        tools = {t.__name__: t for t in self.tools}
        prompt_ids: list[int] | None = None
        if env is not None:
            row = {**request.data_dict, "prompt": copy.deepcopy(request.messages)}
            observation = await asyncio.wait_for(self._blocking(env.reset, **row), timeout=self.tool_timeout_s)
            if observation is not None:
                last = request.messages[-1]
                request.messages[-1] = {**last, "content": _joined(last["content"], observation)}
                prompt_ids = engine.encode(engine.render(request.messages))  # the observation changed the prompt
            tools.update({m.__name__: m for m in environment_tools(env)})
        if prompt_ids is None:
            first: list[int] = engine.first_prompt_ids(request.messages)
            prompt_ids = first
        prompt_messages = copy.deepcopy(request.messages)
        ctx = CURRENT.get()
        budget = self.max_completion_length or (ctx.config.max_tokens if ctx is not None else None)
        episode = _Episode(prompt_ids)
        versions: list[tuple[int, int]] = []
        iteration = 0
        while True:
            context = prompt_ids + episode.completion_ids
            left = budget - len(episode.completion_ids) if budget else None
            config = RequestConfig(max_tokens=left) if left else request_config
            response = await engine.infer_async(request, config, prompt_token_ids=context, **kwargs)
            choice = response.choices[0]
            versions.append(choice.policy_versions)
            ids = list(choice.token_ids or [])
            episode.add_reply(ids, extract_logprobs(choice))
            message, malformed = self.parse_reply(ids, context)
            request.messages.append(message)
            calls = message.get("tool_calls") or []
            if malformed:
                episode.calls += 1
                episode.failures += 1
            if not calls or choice.finish_reason == "length":
                break
            if self.max_iterations is not None and iteration >= self.max_iterations:
                break
            if self.max_turns and iteration + 1 >= self.max_turns:
                break
            tool_messages = []
            for call in calls:
                name, result, failed = await self.call_tool(call, tools)
                episode.calls += 1
                episode.failures += failed
                tool_messages.append({"role": "tool", "name": name,
                                      "content": result if isinstance(result, list) else str(result)})
            suffix = self.tool_suffix_ids(tool_messages)
            total = len(episode.completion_ids) + len(suffix)
            if (budget and total > budget) or len(prompt_ids) + total >= engine.max_model_len:
                break  # TRL: the tool results would not fit; the episode ends with this reply
            episode.add_gap(suffix)
            request.messages += tool_messages
            if engine.encode(engine.render(request.messages)) != prompt_ids + episode.completion_ids:
                episode.rewrites += 1  # the template would render this history otherwise; the sampled tokens stay
            iteration += 1
        infos: dict[str, Any] = {"num_turns": len(episode.rounds), "num_tool_calls": episode.calls,
                                 "num_tool_failures": episode.failures, "template_rewrites": episode.rewrites}
        if env is not None:
            reward = None
            if self.env_has_reward:
                reward = await asyncio.wait_for(self._blocking(env.get_reward), timeout=self.tool_timeout_s)
            infos["environment"] = environment_snapshot(env, reward)
            if reward is not None:  # TRL: the environment owns a reward, named after its class, weight 1
                infos["rewards"] = {type(env).__name__: reward}
        return {
            "messages": request.messages,
            "prompt_messages": prompt_messages,
            "prompt_token_ids": prompt_ids,
            "response_token_ids": episode.rounds,
            "response_loss_mask": episode.masks,
            "rollout_logprobs": episode.logprobs,
            "response_message_lengths": episode.message_lengths,
            "explicit_loss_mask": False,
            "rollout_infos": infos,
            "finish_reason": choice.finish_reason,
            "policy_versions": (min(v[0] for v in versions), max(v[1] for v in versions)),
        }


def check_tool_calls(calls: Any) -> None:
    """TRL's ``_validate_tool_calls``: a list of ``{"type": "function", "function": {"name": str, ...}}``
    (missing arguments mean none). ValueError, as TRL's: the callers catch it as a malformed response."""
    if not isinstance(calls, list):
        raise ValueError("tool_calls must be a list")  # noqa: TRY004
    for call in calls:
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError("a tool call needs a function name")  # noqa: TRY004
        if function.get("arguments") is None:
            function["arguments"] = {}


def _joined(content: Any, observation: Any) -> Any:
    """TRL's: the reset observation appended to the last prompt message (text or content parts)."""
    if isinstance(content, list):
        return content + (observation if isinstance(observation, list) else [{"type": "text", "text": observation}])
    if isinstance(observation, list):
        return [{"type": "text", "text": content}, *observation]
    return content + str(observation)


def _mentions(exc: BaseException) -> bool:
    """A parser error about a tool call (rather than about the text around it)."""
    return "tool" in str(exc).lower()

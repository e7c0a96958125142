"""Any agent program, trained token-exact: an OpenAI-compatible endpoint over the rollout worker's engine, and the
``agent`` scheduler that runs the user's program per episode against it (``rollout.agent = "module:function"``).

The endpoint (aiohttp, loopback by default, one port per rollout worker) serves:

- ``POST /v1/chat/completions`` (streaming and not, tools): the messages rendered with the run's chat template,
  the reply's tool calls parsed as the tool_calling scheduler parses them (``ReplyParser``);
- ``POST /v1/completions`` (a prompt string or token ids);
- ``POST /inference/v1/generate`` (token ids in, token ids and one log-prob per token out: verifiers' route);
- ``GET /v1/models`` (the served name and ``max_model_len``).

Each episode gets its own session: a base URL and an API key (a random token, required on every call; a call
without one, or with another episode's, is refused with 401). The trainer owns the sampling: temperature,
top_p/top_k/min_p, repetition penalty and the seed are the run's, whatever the agent sends; ``max_tokens`` is at
most what is left of the episode's ``grpo.max_completion_length`` (the agent may ask for fewer).

Every call records its prompt ids, sampled ids, log-probs and weights versions. At the episode's end the calls
become records: a call whose prompt extends the previous prompt and completion (token for token; a re-rendered
history whose text extends it is spliced onto the sampled tokens) continues one sequence, its new prompt tokens
trained with mask 0; otherwise a new branch starts (as verifiers and prime-rl split), counted in
``rollout_infos["branches"]`` (``agent/branch_frequency``). The branches share the episode's request id, so they
share its reward and advantage, and no sampled token is trained twice.

The reward: the program's return value (a number, or None) under the name "agent" (weight 1), and the run's
reward functions on the last call's conversation (weights as configured).
"""

from __future__ import annotations

import asyncio
import copy
import json
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from schedulers.base import MultiTurnScheduler, SchedulerError
from schedulers.engine import CURRENT, RequestContext, request_context
from schedulers.protocol import RequestConfig, RolloutInferRequest, extract_logprobs
from schedulers.tool_calling import ReplyParser, ToolSetupError, resolve

# Agent programs a plugin registers by name (rollout.agent takes these names as well as "module:function").
registered_agents: dict[str, Callable[..., Any]] = {}
AGENT_REWARD = "agent"


class AgentFailed(SchedulerError):
    """The agent program raised, timed out or returned something that is not a reward."""


@dataclass
class Call:
    """One engine call of an episode, as sampled."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    versions: tuple[int, int]
    messages: list[dict[str, Any]] | None = None  # chat calls: the conversation, the reply last
    seed: int | None = None  # the engine's seed of this call (the request's, offset per call)


@dataclass
class Session:
    key: str
    ctx: RequestContext
    budget: int | None
    calls: list[Call] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # an episode's calls are sampled one at a time

    @property
    def sampled(self) -> int:
        return sum(len(c.completion_ids) for c in self.calls)


class EndpointError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class AgentEndpoint:
    """The OpenAI-compatible routes over one scheduler's engine (``InferEngine``)."""

    def __init__(self, engine: Any, *, host: str = "127.0.0.1", model_name: str = "policy") -> None:
        self.engine = engine
        self.host = host
        self.model_name = model_name
        self.sessions: dict[str, Session] = {}
        self.port: int | None = None
        self._runner: Any = None
        self._parser: ReplyParser | None = None
        self._starting = asyncio.Lock()

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        async with self._starting:
            if self._runner is not None:
                return
            from aiohttp import web

            app = web.Application(client_max_size=64 * 1024 * 1024)
            # Each route twice: the key as a bearer token (OpenAI clients), or in the path (``session_url``: for
            # clients whose key is fixed per process, e.g. verifiers' train client, which sends "EMPTY").
            for prefix in ("", "/s/{key}"):
                app.router.add_get(f"{prefix}/v1/models", self._route(self.models))
                app.router.add_post(f"{prefix}/v1/chat/completions", self._route(self.chat_completions))
                app.router.add_post(f"{prefix}/v1/completions", self._route(self.completions))
                app.router.add_post(f"{prefix}/inference/v1/generate", self._route(self.generate))
            runner = web.AppRunner(app, handle_signals=False, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, self.host, 0)
            await site.start()
            self.port = runner.addresses[0][1]
            self._runner = runner

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def session_url(self, session: Session) -> str:
        """A base URL that carries the episode's key itself (any API key then works)."""
        return f"http://{self.host}:{self.port}/s/{session.key}/v1"

    def open(self, ctx: RequestContext, budget: int | None) -> Session:
        key = secrets.token_urlsafe(24)
        session = self.sessions[key] = Session(key=key, ctx=ctx, budget=budget)
        return session

    def close_session(self, session: Session) -> None:
        self.sessions.pop(session.key, None)

    # ------------------------------------------------------------ plumbing

    def _route(self, handler: Callable[..., Any]) -> Callable[..., Any]:
        from aiohttp import web

        async def route(request: Any) -> Any:
            try:
                session = self._session(request)
                body = {}
                if request.method == "POST":
                    try:
                        body = json.loads(await request.read())
                    except ValueError as exc:
                        raise EndpointError(400, f"the body is not JSON: {exc}") from None
                    if not isinstance(body, dict):
                        raise EndpointError(400, "the body must be a JSON object")
                answer = await handler(session, body)
            except EndpointError as exc:
                return web.json_response({"error": {"message": str(exc), "type": "invalid_request_error"}},
                                         status=exc.status)
            if isinstance(answer, list):  # server-sent events (a streamed chat completion)
                response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await response.prepare(request)
                for event in answer:
                    await response.write(f"data: {json.dumps(event)}\n\n".encode())
                await response.write(b"data: [DONE]\n\n")
                await response.write_eof()
                return response
            return web.json_response(answer)

        return route

    def _session(self, request: Any) -> Session:
        key = request.match_info.get("key") or request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        session = self.sessions.get(key)
        if session is None:
            raise EndpointError(401, "no such session: use the api_key this episode was given")
        return session

    async def _sample(self, session: Session, prompt_ids: list[int], asked: Any,
                      messages: list[dict[str, Any]] | None = None) -> Call:
        """One engine call with the run's sampling; ``asked``: the agent's max_tokens (None: what is left)."""
        left = session.budget - session.sampled if session.budget else None
        if asked is not None and (not isinstance(asked, int) or isinstance(asked, bool) or asked < 1):
            raise EndpointError(400, f"max_tokens must be a positive integer, got {asked!r}")
        limits = [v for v in (left, asked) if v is not None]
        max_tokens = min(limits) if limits else None
        async with session.lock:
            if max_tokens is not None and max_tokens <= 0:  # the episode's completion budget is spent
                call = Call(list(prompt_ids), [], [], "length", (self.engine.backend.version,) * 2, messages)
            else:
                request = RolloutInferRequest(messages=messages or [], uuid=session.ctx.request_id)
                with request_context(session.ctx):
                    response = await self.engine.infer_async(request, RequestConfig(max_tokens=max_tokens),
                                                             prompt_token_ids=list(prompt_ids))
                choice = response.choices[0]
                seed = session.ctx.seeds[-1]  # the engine's seed of this call
                call = Call(list(prompt_ids), list(choice.token_ids or []), extract_logprobs(choice),
                            choice.finish_reason or "stop", choice.policy_versions, messages, seed)
            session.calls.append(call)
        return call

    def _splice(self, session: Session, text: str) -> list[int]:
        """``text``'s token ids: where it extends the last call's prompt and completion as text, those sampled
        tokens and the rest encoded (the agent sent back what it was given); else encoded whole."""
        if session.calls:
            last = session.calls[-1]
            before = last.prompt_ids + last.completion_ids
            seen = self.engine.decode(before, skip_special_tokens=False)
            if text.startswith(seen):
                return before + self.engine.encode(text[len(seen):])
        return self.engine.encode(text)

    # ------------------------------------------------------------ routes

    async def models(self, session: Session, body: dict[str, Any]) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "rollstream",
                                            "max_model_len": self.engine.max_model_len}]}

    async def chat_completions(self, session: Session, body: dict[str, Any]) -> Any:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise EndpointError(400, "messages must be a non-empty list of message objects")
        if body.get("n", 1) != 1:
            raise EndpointError(400, "n must be 1: one episode samples one reply per call")
        tools = body.get("tools") or None
        messages = [_plain_message(m) for m in messages]
        try:
            text = self.engine.render(messages, tools=tools)
        except Exception as exc:  # noqa: BLE001 - the template's error on the agent's messages goes back to it
            raise EndpointError(400, f"the chat template cannot render these messages: {exc}") from None
        prompt_ids = self._splice(session, text)
        call = await self._sample(session, prompt_ids, body.get("max_completion_tokens", body.get("max_tokens")))
        if tools:  # the reply's tool calls, parsed as the tool_calling scheduler parses them
            if self._parser is None:
                self._parser = ReplyParser(self.engine)
            message, _ = self._parser.parse(call.completion_ids, prompt_ids, tools)
        else:
            message = {"role": "assistant", "content": self.engine.decode(call.completion_ids)}
        call.messages = [*messages, message]
        openai_message: dict[str, Any] = {"role": "assistant", "content": message.get("content") or None}
        calls = message.get("tool_calls") or []
        if calls:
            openai_message["tool_calls"] = [
                {"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                 "function": {"name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])}}
                for c in calls]
        finish = "tool_calls" if calls and call.finish_reason == "stop" else call.finish_reason
        ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(call.completion_ids),
                 "total_tokens": len(prompt_ids) + len(call.completion_ids)}
        if body.get("stream"):
            head = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": self.model_name}
            delta: dict[str, Any] = {"role": "assistant", "content": openai_message["content"] or ""}
            if calls:
                delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(openai_message["tool_calls"])]
            return [{**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
                    {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}], "usage": usage}]
        return {"id": ident, "object": "chat.completion", "created": created, "model": self.model_name,
                "choices": [{"index": 0, "message": openai_message, "finish_reason": finish, "logprobs": None}],
                "usage": usage}

    async def completions(self, session: Session, body: dict[str, Any]) -> dict[str, Any]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = self._splice(session, prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            prompt_ids = list(prompt)
        else:
            raise EndpointError(400, "prompt must be a string or a list of token ids")
        call = await self._sample(session, prompt_ids, body.get("max_tokens"))
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name,
                "choices": [{"index": 0, "text": self.engine.decode(call.completion_ids), "logprobs": None,
                             "finish_reason": call.finish_reason}],
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(call.completion_ids),
                          "total_tokens": len(prompt_ids) + len(call.completion_ids)}}

    async def generate(self, session: Session, body: dict[str, Any]) -> dict[str, Any]:
        """verifiers' token-in/token-out route."""
        ids = body.get("token_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise EndpointError(400, "token_ids must be a non-empty list of token ids")
        sampling = body.get("sampling_params") or {}
        call = await self._sample(session, ids, sampling.get("max_tokens"))
        return {"request_id": session.ctx.request_id, "prompt_token_ids": ids,
                "choices": [{"index": 0, "token_ids": call.completion_ids, "finish_reason": call.finish_reason,
                             "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": lp}
                                                      for t, lp in zip(call.completion_ids, call.logprobs)]}}]}


def _plain_message(message: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI message as chat templates take it: tool-call arguments as objects, not JSON strings."""
    out = dict(message)
    calls = out.get("tool_calls")
    if calls:
        plain = []
        for c in calls:
            function = dict(c.get("function") or {})
            if isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"] or "{}")
                except ValueError:
                    pass  # rendered as the string it is
            plain.append({"type": "function", "function": function})
        out["tool_calls"] = plain
    if out.get("content") is None:
        out["content"] = ""
    return out


def episode_records(calls: list[Call], default_messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pure: an episode's calls as result dicts (one per branch): a call whose prompt extends the branch's tokens
    so far continues it (the new prompt tokens mask 0), any other starts a new branch."""
    branches: list[dict[str, Any]] = []
    for call in calls:
        branch = branches[-1] if branches else None
        so_far = [] if branch is None else [*branch["prompt_token_ids"], *(t for r in branch["response_token_ids"] for t in r)]
        if branch is not None and call.prompt_ids[: len(so_far)] == so_far:
            gap = call.prompt_ids[len(so_far):]
            branch["response_token_ids"][-1] += gap
            branch["response_loss_mask"][-1] += [0] * len(gap)
        else:
            branch = {"prompt_token_ids": list(call.prompt_ids), "response_token_ids": [], "response_loss_mask": [],
                      "rollout_logprobs": [], "response_message_lengths": [], "versions": []}
            branches.append(branch)
        branch["response_token_ids"].append(list(call.completion_ids))
        branch["response_loss_mask"].append([1] * len(call.completion_ids))
        branch["rollout_logprobs"].append(list(call.logprobs))
        branch["response_message_lengths"].append(len(call.completion_ids))
        branch["versions"].append(call.versions)
        branch["finish_reason"] = call.finish_reason
        branch["last"] = call
    out = []
    for branch in branches:
        last: Call = branch.pop("last")
        versions = branch.pop("versions")
        messages = last.messages
        if messages is None:  # a token or text call: the conversation is what it sampled
            messages = [*default_messages]
        prompt = default_messages if messages[: len(default_messages)] == default_messages else messages[:-1]
        out.append({**branch, "messages": messages, "prompt_messages": prompt if last.messages else None,
                    "explicit_loss_mask": False,
                    "policy_versions": (min(v[0] for v in versions), max(v[1] for v in versions))})
    return out


class AgentScheduler(MultiTurnScheduler):
    """``agent``: the user's program drives the episode through the endpoint (``rollout.agent``)."""

    def __init__(self, infer_engine: Any = None, max_turns: int | None = None, *, agent: str | None = None,
                 agent_timeout_s: float = 600.0, agent_host: str = "127.0.0.1", max_completion_length: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(infer_engine, max_turns, **kwargs)
        if not agent:
            raise ToolSetupError("the agent scheduler needs rollout.agent = \"module:function\"")
        self.agent = resolve(agent, registered_agents, "rollout.agent")
        if not callable(self.agent):
            raise ToolSetupError(f"rollout.agent = {agent!r} is a {type(self.agent).__name__}, not a function")
        self.agent_timeout_s = agent_timeout_s
        self.agent_host = agent_host
        self.max_completion_length = max_completion_length
        self.endpoint: AgentEndpoint | None = None

    async def _endpoint(self) -> AgentEndpoint:
        if self.endpoint is None:
            self.endpoint = AgentEndpoint(self.infer_engine, host=self.agent_host)
        await self.endpoint.start()
        return self.endpoint

    async def shutdown(self) -> None:
        if self.endpoint is not None:
            await self.endpoint.close()

    async def run(self, infer_request: RolloutInferRequest, request_config: RequestConfig | None = None,
                  **kwargs: Any) -> list[dict[str, Any]]:
        endpoint = await self._endpoint()
        ctx = CURRENT.get() or RequestContext(request_id=infer_request.uuid or "request",
                                              config=request_config or RequestConfig())
        budget = self.max_completion_length or ctx.config.max_tokens
        session = endpoint.open(ctx, budget)
        row = {**copy.deepcopy(infer_request.data_dict), "prompt": copy.deepcopy(infer_request.messages)}
        try:
            result = self.agent(endpoint.base_url, session.key, row)
            reward = await asyncio.wait_for(result, timeout=self.agent_timeout_s) if asyncio.iscoroutine(result) \
                else result
        except TimeoutError:
            raise AgentFailed(f"rollout.agent timed out after {self.agent_timeout_s:g} s "
                              f"(rollout.agent_timeout_s) with {len(session.calls)} call(s) made") from None
        except SchedulerError:
            raise
        except Exception as exc:
            raise AgentFailed(f"rollout.agent raised {type(exc).__name__}: {exc}") from exc
        finally:
            endpoint.close_session(session)
        if reward is not None and not (isinstance(reward, (int, float)) and not isinstance(reward, bool)):
            raise AgentFailed(f"rollout.agent returned {type(reward).__name__}; return a number (the reward) or None")
        if not session.calls:
            raise AgentFailed("rollout.agent made no call to the endpoint: there is nothing to train")
        records = episode_records(session.calls, infer_request.messages)
        infos: dict[str, Any] = {"num_turns": len(session.calls), "branches": len(records),
                                 "call_seeds": [c.seed for c in session.calls]}  # each call reproducible
        if reward is not None:
            infos["rewards"] = {AGENT_REWARD: float(reward)}
        for record in records:
            record["rollout_infos"] = dict(infos)
        return records

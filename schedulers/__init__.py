"""Multi-turn schedulers with ms-swift's API (``swift.plugin.multi_turn``): the ``MultiTurnScheduler`` base
class, the request/response objects it sees, and the ``multi_turns`` registry.

A plugin registers a scheduler as an ms-swift plugin does, by assigning into the registry, from a file
listed in ``run.external_plugins``::

    from schedulers import MultiTurnScheduler, multi_turns

    class MyScheduler(MultiTurnScheduler):
        def step(self, infer_request, response_choice, current_turn):
            infer_request.messages.append({"role": "user", "content": "Check your answer."})
            return {"infer_request": infer_request}

    multi_turns["my_scheduler"] = MyScheduler

(ms-swift's own import paths, ``from swift.plugin import MultiTurnScheduler, multi_turns`` and its v4 paths,
resolve here when ms-swift is not installed), or from an installed package, through the entry-point group
``rollstream.schedulers``
(``my_scheduler = "my_pkg.module:MyScheduler"``). ``rollout.multi_turn_scheduler = "my_scheduler"`` selects it;
the rollout stage builds it on its engine as ms-swift does (``build_scheduler``).

Gym-style environments (ms-swift's ``Env`` / ``ContextManager``, ``envs`` / ``context_managers``) live in
``schedulers/gym.py``; ``gym_scheduler`` drives them (``rollout.use_gym_env = true``).
"""

from __future__ import annotations

import difflib
import inspect
from importlib.metadata import entry_points
from typing import Any

from schedulers.agent_endpoint import AgentEndpoint, AgentFailed, AgentScheduler, registered_agents
from schedulers.base import (
    LOSS_SCALES,
    MultiTurnScheduler,
    RolloutScheduler,
    SchedulerError,
    SchedulerFailed,
    maybe_await,
    normalize_step_result,
)
from schedulers.builtin import (
    MathTipsMultiTurnScheduler,
    MathTipsScheduler,
    ThinkingModelTipsScheduler,
    ToolCallScheduler,
)
from schedulers.gym import (
    ContextManager,
    DummyContextManager,
    Env,
    EnvError,
    EnvFailed,
    GYMScheduler,
    context_managers,
    envs,
)
from schedulers.openenv import OpenEnvScheduler, OpenEnvWrapper
from schedulers.protocol import (
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatMessage,
    Messages,
    RequestConfig,
    RolloutInferRequest,
    RolloutOutput,
    UsageInfo,
    remove_response,
)
from schedulers.tool_calling import (
    ToolCallingScheduler,
    ToolSetupError,
    environment_factories,
    registered_tools,
)
from schedulers.verifiers import VerifiersScheduler

ENTRY_POINT_GROUP = "rollstream.schedulers"

# The registry: name -> MultiTurnScheduler subclass. Plugins add to it.
multi_turns: dict[str, type[RolloutScheduler]] = {
    "math_tip_trick": MathTipsScheduler,
    "math_tip_trick_multi_turn": MathTipsMultiTurnScheduler,
    "thinking_tips_scheduler": ThinkingModelTipsScheduler,
    "tool_call_scheduler": ToolCallScheduler,
    "gym_scheduler": GYMScheduler,
    "openenv_scheduler": OpenEnvScheduler,  # ms-swift 4.4+: an OpenEnv server as the gym env
    "tool_calling": ToolCallingScheduler,  # TRL's tools= / environment_factory= (rollout.tools, ...)
    "agent": AgentScheduler,  # any agent program over an OpenAI-compatible endpoint (rollout.agent)
    "verifiers": VerifiersScheduler,  # verifiers environments (data.dataset = "verifiers:<env id>")
}


class UnknownSchedulerError(SchedulerError):
    pass


def load_entry_points() -> None:
    """Register the schedulers installed packages declare under ``rollstream.schedulers`` (a name
    already in the registry, e.g. from a plugin file, wins)."""
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in multi_turns:
            multi_turns[ep.name] = ep.load()


def build_scheduler(name: str, max_turns: int | None = None, *, infer_engine: Any = None, tokenizer: Any = None,
                    **kwargs: Any) -> RolloutScheduler:
    """An instance of the scheduler registered as ``name`` (``rollout.multi_turn_scheduler``), built as
    ms-swift's rollout builds it: by keyword, ``cls(infer_engine=..., max_turns=..., **kwargs)``, with
    ``tokenizer=`` only where ``__init__`` declares it. A v3.6/3.7-style class (``__init__(self, max_turns=None,
    *args, **kwargs)``, as ms-swift 3.7 built it: ``cls(max_turns=...)``) gets ``infer_engine`` assigned after.
    ``kwargs`` (the gym settings) go to a constructor that declares them or takes ``**kwargs``."""
    return construct_scheduler(scheduler_class(name), max_turns=max_turns, infer_engine=infer_engine,
                               tokenizer=tokenizer, **kwargs)


def construct_scheduler(cls: type[RolloutScheduler], *, max_turns: int | None, infer_engine: Any = None,
                        tokenizer: Any = None, **kwargs: Any) -> RolloutScheduler:
    """``cls`` built by keyword (see ``build_scheduler``)."""
    params = inspect.signature(cls.__init__).parameters
    names = [p.name for p in params.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    legacy = names[1:2] == ["max_turns"]  # v3.6/3.7: __init__(self, max_turns=None, *args, **kwargs)
    call: dict[str, Any] = {"max_turns": max_turns}
    if not legacy:
        call["infer_engine"] = infer_engine
    if tokenizer is not None and "tokenizer" in names:
        call["tokenizer"] = tokenizer
    call.update({k: v for k, v in kwargs.items() if takes_any or k in names})
    try:
        scheduler = cls(**call)
    except TypeError as exc:
        raise SchedulerError(
            f"scheduler {cls.__name__} could not be built with {', '.join(call)} "
            f"(ms-swift builds schedulers cls(infer_engine=..., max_turns=..., **kwargs)): {exc}"
        ) from exc
    if getattr(scheduler, "__dict__", {}).get("infer_engine") is None:
        scheduler.infer_engine = infer_engine
    return scheduler


def scheduler_class(name: str) -> type[RolloutScheduler]:
    """The class registered as ``name``; an unknown name is an error listing the registered ones."""
    if name not in multi_turns:
        load_entry_points()
    cls = multi_turns.get(name)
    if cls is None:
        close = difflib.get_close_matches(name, list(multi_turns), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UnknownSchedulerError(
            f"rollout.multi_turn_scheduler = {name!r} is not registered; {hint}registered: "
            f"{', '.join(sorted(multi_turns))}. Register your own with `from schedulers import multi_turns; "
            f'multi_turns["{name}"] = MyScheduler` in a file listed in run.external_plugins'
        )
    if not (isinstance(cls, type) and issubclass(cls, RolloutScheduler)):
        raise SchedulerError(f"multi_turns[{name!r}] is {cls!r}; register a MultiTurnScheduler subclass")
    return cls


from schedulers import gym_envs as _gym_envs  # noqa: F401 - registers guess_number, gridworld
from schedulers import remote_env as _remote_env  # noqa: F401 - registers remote

__all__ = [
    "ENTRY_POINT_GROUP",
    "LOSS_SCALES",
    "AgentEndpoint",
    "AgentFailed",
    "AgentScheduler",
    "ChatCompletionResponse",
    "ChatCompletionResponseChoice",
    "ChatMessage",
    "ContextManager",
    "DummyContextManager",
    "Env",
    "EnvError",
    "EnvFailed",
    "GYMScheduler",
    "Messages",
    "MultiTurnScheduler",
    "OpenEnvScheduler",
    "OpenEnvWrapper",
    "RequestConfig",
    "RolloutInferRequest",
    "RolloutOutput",
    "RolloutScheduler",
    "SchedulerError",
    "SchedulerFailed",
    "ToolCallingScheduler",
    "ToolSetupError",
    "UnknownSchedulerError",
    "UsageInfo",
    "VerifiersScheduler",
    "build_scheduler",
    "construct_scheduler",
    "context_managers",
    "environment_factories",
    "envs",
    "load_entry_points",
    "maybe_await",
    "multi_turns",
    "normalize_step_result",
    "registered_agents",
    "registered_tools",
    "remove_response",
    "scheduler_class",
]

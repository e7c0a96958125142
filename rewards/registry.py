"""The reward registry (ms-swift's ``orms``): the ORM base classes, name -> reward, and how a name is built.

A registered class is built once per run as ms-swift builds it (``_prepare_rewards``): each ``__init__``
parameter named like an ms-swift GRPO argument gets that argument's value from the run's config
(``SwiftArgs``), ``args`` gets the whole view (ms-swift 4 style), ``tokenizer`` the run's tokenizer and
``config`` rollstream's ``Config``.
"""


from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import msgspec

from config import Config
from pipeline.errors import UserError

RewardFunc = Callable[..., Any]  # (completions, **kwargs) -> list[float | None] (or an awaitable of it)
ModelDirSource = Callable[[], Path]  # where the run's model (and tokenizer) lives, resolved on demand

ENTRY_POINT_GROUP = "rollstream.rewards"


class ORM:
    """Base class of a reward (ms-swift's ``ORM``): subclass it and implement ``__call__``.

    ``args``: ms-swift's GRPO arguments as read from the run's config (``SwiftArgs``), as ms-swift 4 passes
    them; ``None`` when the class is built by hand."""

    def __init__(self, args: Any = None, **kwargs: Any) -> None:
        self.args = swift_args(args) if isinstance(args, Config) else args

    def __call__(self, completions: list[str], **kwargs: Any) -> list[float | None]:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(completions, **kwargs)")


class AsyncORM:
    """Base class of an async reward (ms-swift's ``AsyncORM``): implement ``async def __call__``. The scorer
    awaits it on the event loop (no thread), so I/O-bound rewards run concurrently."""

    def __init__(self, args: Any = None, **kwargs: Any) -> None:
        self.args = swift_args(args) if isinstance(args, Config) else args

    async def __call__(self, completions: list[str], **kwargs: Any) -> list[float | None]:
        raise NotImplementedError(f"{type(self).__name__} must implement async __call__(completions, **kwargs)")


# The registry: name -> ORM subclass (instantiated once) or a ready callable. Plugins add to it.
orms: dict[str, type | RewardFunc] = {}

# name -> (registered object, config it was built with, callable made from it)
_instances: dict[str, tuple[Any, Any, RewardFunc]] = {}


class UnknownRewardError(UserError, KeyError):
    """A reward name that nothing registered (shown as one line, with the closest registered name)."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0])


class RewardBuildError(UserError, TypeError):
    """A reward class whose constructor rollstream cannot fill (names the class, the parameter, the fix)."""


# ---------------------------------------------------------------- ms-swift's ``args``

# The config sections whose fields are ms-swift arguments of the same name, in lookup order (``seed``
# is in run and rollout: ms-swift's ``seed`` is the training seed, run.seed).
_ARG_SECTIONS = ("run", "model", "data", "grpo", "reward", "rollout", "learner", "eval")
# rollstream-only fields with names a reward's own parameter may well have: never filled from the config.
_NOT_SWIFT_ARGS = frozenset({"name", "engine", "device", "executor", "timeout_s", "max_retries", "on_error", "stop"})


class SwiftArgs:
    """ms-swift's GRPO arguments (``GRPOConfig``, the ``args`` its trainer passes to a reward class) as read
    from the run's config: every config field under its own name (``max_completion_length``,
    ``num_generations``, ``beta``, ``temperature``, ``cosine_*``, ``repetition_*``, ``soft_cache_length``,
    ...: rollstream uses ms-swift's names), with ms-swift's derived values (``cosine_max_len`` and
    ``soft_max_length`` default to ``max_completion_length``) and renames (``vllm_max_model_len``).
    ``config`` is rollstream's whole ``Config``."""

    def __init__(self, config: Config) -> None:
        for section in _ARG_SECTIONS:
            part = getattr(config, section)
            for field in msgspec.structs.fields(part):
                if field.name not in self.__dict__ and field.name not in _NOT_SWIFT_ARGS:
                    setattr(self, field.name, getattr(part, field.name))
        grpo, reward = config.grpo, config.reward
        # as ms-swift's GRPOConfig.__post_init__: both default to max_completion_length
        self.cosine_max_len = reward.cosine_max_len or grpo.max_completion_length
        self.soft_max_length = reward.soft_max_length or grpo.max_completion_length
        self.vllm_max_model_len = config.rollout.max_model_len
        self.config = config

    def __getattr__(self, name: str) -> Any:  # only for names not set above
        raise AttributeError(f"ms-swift argument {name!r} has no equivalent in rollstream's config")

    def __repr__(self) -> str:
        return f"SwiftArgs({', '.join(sorted(k for k in vars(self) if k != 'config'))})"


def swift_args(config: Config | None = None) -> SwiftArgs:
    """The ``SwiftArgs`` view of ``config`` (every default when None)."""
    return SwiftArgs(config if config is not None else Config())


@functools.cache
def _tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer  # slow import: only for a reward that declares `tokenizer`

    return AutoTokenizer.from_pretrained(model_dir)


def run_tokenizer(config: Config, model_dir: ModelDirSource | None, who: str) -> Any:
    """The run's tokenizer (ms-swift's ``processing_class``), loaded once: from ``model_dir()`` (the run's
    resolved model directory), else from ``model.model`` when that is a local directory."""
    if model_dir is not None:
        return _tokenizer(str(model_dir()))
    local = Path(config.model.model).expanduser()
    if (local / "config.json").is_file():
        return _tokenizer(str(local.resolve()))
    raise RewardBuildError(
        f"{who} declares `tokenizer`, but this process was not told where the run's model is "
        f"(model.model = {config.model.model!r} is not a local directory); build the reward through "
        "`rollstream train` / `rollstream worker`, or give model.model as a local model directory"
    )


# ---------------------------------------------------------------- lookup and construction


def _entry_point(name: str) -> Any | None:
    found = entry_points(group=ENTRY_POINT_GROUP, name=name)
    return next(iter(found)).load() if found else None


def registered_names() -> list[str]:
    """Every reward name: the ``orms`` registry and the ``rollstream.rewards`` entry points."""
    return sorted(set(orms) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def takes_config(cls: type) -> bool:
    """Does the class's ``__init__`` accept a ``config`` argument (then it is built with the run's Config)?"""
    try:
        return "config" in inspect.signature(cls).parameters
    except (TypeError, ValueError):  # a builtin or C type without a signature
        return False


def build_reward(name: str, cls: type, config: Config, model_dir: ModelDirSource | None = None) -> Any:
    """An instance of the reward class registered as ``name``, built as ms-swift builds it (see the module
    docstring); a required parameter nothing can fill is a ``RewardBuildError``."""
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):  # a builtin or C type without a signature
        return cls()
    args = swift_args(config)
    who = f"reward {name!r} ({cls.__name__})"
    positional: list[Any] = []
    kwargs: dict[str, Any] = {}
    takes_var_keyword = False
    for param in params.values():
        if param.kind is param.VAR_KEYWORD:
            takes_var_keyword = True
            continue
        if param.kind is param.VAR_POSITIONAL:
            continue
        if param.name == "config":
            value = config
        elif param.name == "args":
            value = args
        elif param.name == "tokenizer":
            value = run_tokenizer(config, model_dir, who)
        elif param.name in vars(args):
            value = getattr(args, param.name)
        elif param.default is param.empty:
            raise RewardBuildError(
                f"{who}: __init__ parameter {param.name!r} has no default and rollstream has nothing to fill "
                f"it with. rollstream fills, as ms-swift does, parameters named like ms-swift's GRPO arguments "
                f"(the run's config under the same names: max_completion_length, num_generations, "
                f"cosine_max_len, soft_max_length, soft_cache_length, ...), plus `args`, `tokenizer` and "
                f"`config`; give {param.name!r} a default, or read it from `args` in __init__"
            )
        else:
            continue
        if param.kind is param.POSITIONAL_ONLY:
            positional.append(value)
        else:
            kwargs[param.name] = value
    if takes_var_keyword and "args" not in kwargs:
        kwargs["args"] = args  # as ms-swift 4: reward_func_class(args=args)
    return cls(*positional, **kwargs)


# Arguments the scorer gives every reward (rewards/scoring.py ``reward_kwargs``): never dataset columns.
INJECTED_ARGUMENTS = frozenset({
    "completions", "prompts", "messages", "completion_ids", "response_token_ids", "finish_reason", "is_truncated",
    "trainer_state", "trajectory_inputs", "rollout_infos", "multi_turn_infos", "trajectory_infos", "prompt_id",
    "request_id", "log_extra", "log_metric", "environments",  # environments: with rollout.environment_factory
})


def required_columns(name: str) -> tuple[str, ...]:
    """The dataset columns reward ``name`` needs in every row, without building it: its ``required_columns``
    attribute (the built-in ``accuracy`` and ``cosine`` declare ``("solution",)``), else the parameters of its
    ``__call__`` (or function) that have no default and are not arguments the scorer passes itself (TRL style:
    ``def reward(completions, solution, **kwargs)`` needs ``solution``). () for a name nothing registered."""
    registered = orms.get(name)
    if registered is None:
        registered = _entry_point(name)
    if registered is None:
        return ()
    declared = getattr(registered, "required_columns", None)
    if declared is not None:
        return (declared,) if isinstance(declared, str) else tuple(declared)
    target = registered.__call__ if isinstance(registered, type) else registered
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature
        return ()
    if isinstance(registered, type) and params:
        params = params[1:]  # self
    named = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    by_keyword = any(p.name == "completions" for p in named)
    if named and not by_keyword and named[0].kind is not named[0].KEYWORD_ONLY \
            and named[0].name not in INJECTED_ARGUMENTS:
        named = named[1:]  # it receives completions positionally (ms-swift's reward_func(completions, **kwargs))
    return tuple(p.name for p in named if p.default is p.empty and p.name not in INJECTED_ARGUMENTS)


def get_reward(name: str, config: Any = None, model_dir: ModelDirSource | None = None) -> RewardFunc:
    """The callable registered as ``name``; a class is instantiated once (per config) and reused.

    ``model_dir``: how to find the run's model directory, called only when a class declares ``tokenizer``."""
    registered = orms.get(name)
    if registered is None:
        registered = _entry_point(name)
    if registered is None:
        names = registered_names()
        close = difflib.get_close_matches(name, names, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UnknownRewardError(
            f"unknown reward function {name!r}; {hint}registered: {', '.join(names) or '(none)'}. "
            f'Add your own with `from rewards import orms; orms["{name}"] = MyReward` in a file listed '
            f"in run.external_plugins, or an entry point in the group {ENTRY_POINT_GROUP!r}"
        )
    cached = _instances.get(name)
    if cached is not None and cached[0] is registered and cached[1] is config:
        return cached[2]
    if isinstance(registered, type):
        func = build_reward(name, registered, config if config is not None else Config(), model_dir)
    elif callable(registered):
        func = registered
    else:
        raise TypeError(f"orms[{name!r}] is a {type(registered).__name__}, not a class or a callable")
    _instances[name] = (registered, config, func)
    return func

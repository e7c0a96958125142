"""The reward registry (ms-swift's ``orms``): the ORM base class, name -> reward, and how a name is built."""


from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from pipeline.config import Config
from pipeline.errors import UserError

RewardFunc = Callable[..., Any]  # (completions, **kwargs) -> list[float | None] (or an awaitable of it)

ENTRY_POINT_GROUP = "rollstream.rewards"


class ORM:
    """Base class of a reward (ms-swift's ``ORM``): subclass it and implement ``__call__``."""

    def __call__(self, completions: list[str], **kwargs: Any) -> list[float | None]:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(completions, **kwargs)")


# The registry: name -> ORM subclass (instantiated once) or a ready callable. Plugins add to it.
orms: dict[str, type | RewardFunc] = {}

# name -> (registered object, config it was built with, callable made from it)
_instances: dict[str, tuple[Any, Any, RewardFunc]] = {}


class UnknownRewardError(UserError, KeyError):
    """A reward name that nothing registered (shown as one line, with the closest registered name)."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0])


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


def get_reward(name: str, config: Any = None) -> RewardFunc:
    """The callable registered as ``name``; a class is instantiated once (per config) and reused."""
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
        if takes_config(registered):
            if config is None:
                config = Config()  # every default; the stage passes the run's config
            func = registered(config=config)
        else:
            func = registered()
    elif callable(registered):
        func = registered
    else:
        raise TypeError(f"orms[{name!r}] is a {type(registered).__name__}, not a class or a callable")
    _instances[name] = (registered, config, func)
    return func


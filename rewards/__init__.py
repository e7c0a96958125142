"""Reward functions, registered by name as in ms-swift (``swift.plugin.orm.orms``).

A reward is ms-swift's ORM protocol: a callable ``(completions: list[str], **kwargs) -> list[float | None]``,
sync or async, called once per batch with every dataset column as a list kwarg (``solution=[...]``).
``None`` means "not applicable to this sample". Register a class (instantiated once, on first use) or any
callable; a plugin file listed in ``run.external_plugins`` does::

    from rewards import ORM, orms

    class Brevity(ORM):
        def __call__(self, completions, **kwargs):
            return [1.0 if len(c) < 20 else 0.0 for c in completions]

    orms["brevity"] = Brevity
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any

RewardFunc = Callable[..., Any]  # (completions, **kwargs) -> list[float | None] (or an awaitable of it)


class ORM:
    """Base class of a reward (ms-swift's ``ORM``): subclass it and implement ``__call__``."""

    def __call__(self, completions: list[str], **kwargs: Any) -> list[float | None]:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(completions, **kwargs)")


# The registry: name -> ORM subclass (instantiated once) or a ready callable. Plugins add to it.
orms: dict[str, type | RewardFunc] = {}

_instances: dict[str, tuple[Any, RewardFunc]] = {}  # name -> (registered object, callable made from it)


class UnknownRewardError(KeyError):
    """A reward name that nothing registered (shown as one line, with the closest registered name)."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0])


def get_reward(name: str) -> RewardFunc:
    """The callable registered as ``name``; a class is instantiated once and the instance reused."""
    if name not in orms:
        close = difflib.get_close_matches(name, list(orms), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UnknownRewardError(
            f"unknown reward function {name!r}; {hint}registered: {', '.join(sorted(orms)) or '(none)'}. "
            f'Add your own with `from rewards import orms; orms["{name}"] = MyReward` in a file listed '
            f"in run.external_plugins"
        )
    registered = orms[name]
    cached = _instances.get(name)
    if cached is not None and cached[0] is registered:
        return cached[1]
    if isinstance(registered, type):
        func = registered()
    elif callable(registered):
        func = registered
    else:
        raise TypeError(f"orms[{name!r}] is a {type(registered).__name__}, not a class or a callable")
    _instances[name] = (registered, func)
    return func


from rewards import builtin as _builtin  # noqa: F401 - fills ``orms`` with the built-in rewards

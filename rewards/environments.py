"""What of a TRL ``environment_factory`` environment reaches the reward functions (``environments=[...]``).

TRL's reward functions read the episode's environment instance after the rollout (its Wordle example:
``def reward(environments, **kwargs): return [env.reward for env in environments]``). In rollstream the
rewards run later than the episode (and, over Redis, in another process), while the rollout worker reuses the
instance for its next episode, so the instance itself never crosses. What crosses, in the trajectory record:

- the instance's attributes whose values are plain data (numbers, strings, bools, None, lists and dicts of
  them), as they were when the episode ended;
- the value of its ``get_reward()`` (TRL: the environment owns a reward), taken at the end of the episode.

A reward function gets one ``EnvironmentView`` per completion: ``env.reward`` and ``env.get_reward()`` read
those values; anything else (a method, a client object) is an ``AttributeError`` that says what crossed.
"""

from __future__ import annotations

from typing import Any

import msgspec

CLASS_KEY = "__class__"
REWARD_KEY = "__get_reward__"
ATTRIBUTES_KEY = "attributes"
SKIPPED_KEY = "skipped"


def environment_snapshot(env: Any, reward: float | None = None) -> dict[str, Any]:
    """The plain-data state of ``env`` at the end of an episode (what travels to the reward stage):
    ``{"__class__": name, "attributes": {...}, "skipped": [names], "__get_reward__": value}``."""
    attributes: dict[str, Any] = {}
    skipped: list[str] = []
    for name, value in vars(env).items():
        try:
            # A round trip, so a tuple or a numpy scalar arrives as the reward would read it over Redis.
            attributes[name] = msgspec.msgpack.decode(msgspec.msgpack.encode(value))
        except (TypeError, ValueError, OverflowError):
            skipped.append(name)
    snapshot: dict[str, Any] = {CLASS_KEY: type(env).__name__, ATTRIBUTES_KEY: attributes, SKIPPED_KEY: skipped}
    if reward is not None:
        snapshot[REWARD_KEY] = reward
    return snapshot


class EnvironmentView:
    """One episode's environment as a reward function sees it (read-only)."""

    def __init__(self, snapshot: dict[str, Any]) -> None:
        object.__setattr__(self, "_snapshot", snapshot)

    def __getattr__(self, name: str) -> Any:
        snapshot = object.__getattribute__(self, "_snapshot")
        attributes = snapshot.get(ATTRIBUTES_KEY, {})
        if name in attributes:
            return attributes[name]
        cls = snapshot.get(CLASS_KEY, "environment")
        why = ("it is not plain data" if name in snapshot.get(SKIPPED_KEY, ()) else
               "the instance had no such attribute when its episode ended")
        raise AttributeError(
            f"environments[i].{name} of {cls} did not reach the reward function ({why}): rewards run after the "
            f"episode, possibly in another process, and see the instance's plain-data attributes and its "
            f"get_reward() as they were when the episode ended; store what a reward needs in an attribute "
            f"(e.g. self.reward) during the episode"
        )

    def get_reward(self) -> float | None:
        """The environment's own ``get_reward()``, taken when the episode ended."""
        snapshot = object.__getattribute__(self, "_snapshot")
        if REWARD_KEY not in snapshot:
            raise AttributeError(f"{snapshot.get(CLASS_KEY, 'the environment')} defines no get_reward()")
        return snapshot[REWARD_KEY]

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("environments passed to reward functions are read-only views of the episode's end")

    def __repr__(self) -> str:
        snapshot = object.__getattribute__(self, "_snapshot")
        return f"EnvironmentView({snapshot.get(CLASS_KEY)}, {snapshot.get(ATTRIBUTES_KEY)!r})"


def environment_views(snapshots: list[dict[str, Any] | None]) -> list[EnvironmentView | None]:
    """One view per completion (None where the rollout had no environment)."""
    return [EnvironmentView(s) if s is not None else None for s in snapshots]

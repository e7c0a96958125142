"""Tools and an environment written as TRL's docs write them (``GRPOTrainer(tools=[...])``,
``environment_factory=``): plain functions with type hints and Google-style docstrings, and a class whose
public methods are tools. Used by tests/test_tool_calling.py and the agent e2e tests."""

from __future__ import annotations

import asyncio
import threading


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.

    Returns:
        The sum of a and b.
    """
    return a + b


async def multiply(a: int, b: int) -> int:
    """Multiply two integers (an async tool).

    Args:
        a: The first number.
        b: The second number.
    """
    await asyncio.sleep(0)
    return a * b


def divide(a: int, b: int) -> float:
    """Divide a by b.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b


RELEASE_HANG = threading.Event()


def hang(seconds: int) -> str:
    """A tool that does not answer in time.

    Args:
        seconds: How long to wait at most.
    """
    RELEASE_HANG.wait(seconds)
    return "late"


class CounterEnv:
    """An environment as TRL's docs write one: reset(**row) returns the observation; public methods are tools."""

    def __init__(self) -> None:
        self.count = 0
        self.target = 0
        self.reward = 0.0
        self.lock = threading.Lock()  # not plain data: never reaches the reward stage
        self.resets = 0

    def reset(self, **kwargs) -> str | None:
        self.count = 0
        self.target = int(kwargs.get("target", 3))
        self.reward = 0.0
        self.resets += 1
        return f" Reach {self.target}."

    def increment(self, step: int) -> str:
        """Increase the counter.

        Args:
            step: How much to add.
        """
        self.count += step
        self.reward = 1.0 if self.count == self.target else 0.0
        return f"count={self.count}"

    def get_reward(self) -> float:
        return 1.0 if self.count == self.target else -1.0

    def close(self) -> None:
        self.closed = getattr(self, "closed", 0) + 1

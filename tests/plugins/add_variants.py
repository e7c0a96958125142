"""The tiny-agent model calls a tool named ``add``: these are other ``add`` tools for real runs (TRL names a tool
by its function's ``__name__``): an async one, one that raises, one that hangs."""

from __future__ import annotations

import asyncio
import threading

RELEASE = threading.Event()


async def add_async(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    await asyncio.sleep(0)
    return a + b


def add_raising(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    raise ValueError("the adder is broken")


def add_hanging(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    RELEASE.wait(30)  # longer than the run's tool_timeout_s; released when the test ends
    return a + b


for _tool in (add_async, add_raising, add_hanging):
    _tool.__name__ = "add"  # the name the model calls

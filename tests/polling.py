"""Waiting in tests for real state to change: poll a check until it holds or a deadline passes (never a
fixed sleep standing in for "long enough")."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable


async def wait_until(
    check: Callable[[], bool | Awaitable[bool]],
    what: str = "the condition",
    timeout_s: float = 30.0,
    interval_s: float = 0.01,
) -> None:
    """Until ``check()`` (sync or async) is true; AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(interval_s)  # poll interval

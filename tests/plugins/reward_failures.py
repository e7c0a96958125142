"""Rewards that fail: once, every time, or by hanging (tests/test_reward_kwargs.py)."""

import itertools
import threading
import time

from rewards import orms

_calls = {name: itertools.count(1) for name in ("flaky_once", "hang_every_third")}
_lock = threading.Lock()


def _call_number(name):
    with _lock:
        return next(_calls[name])


def flaky_once(completions, **kwargs):
    """Raises on its first call only."""
    if _call_number("flaky_once") == 1:
        raise KeyError("flaky_once: first call has no 'answer' column")
    return [0.0] * len(completions)


def hang_every_third(completions, **kwargs):
    """Sleeps an hour on every third call (the issue's reproduction, with reward.timeout_s = 2)."""
    if _call_number("hang_every_third") % 3 == 0:
        time.sleep(3600)
    return [0.0] * len(completions)


def always_raises(completions, **kwargs):
    raise ZeroDivisionError("always_raises divides by zero")


orms["flaky_once"] = flaky_once
orms["hang_every_third"] = hang_every_third
orms["always_raises"] = always_raises

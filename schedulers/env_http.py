"""The HTTP client of remote envs: one aiohttp session per event loop, shared by every remote env of a
process, and closed by the gym scheduler's shutdown (the rollout stage's close)."""

from __future__ import annotations

import asyncio
from typing import Any

_SESSIONS: dict[asyncio.AbstractEventLoop, Any] = {}


def client_session() -> Any:
    """This event loop's HTTP client session (connections are bound to a loop; tests may run several).

    aiohttp, not httpx as elsewhere in rollstream: on the 2 shared cores of the bench machine one env call
    through httpx cost 30-80 ms against 7-20 ms through aiohttp (the same server), and a remote env makes
    one call per turn, so the client's CPU per request bounds trajectories/s (bench/env.py).
    """
    import aiohttp  # late: only remote envs need it

    loop = asyncio.get_running_loop()
    session = _SESSIONS.get(loop)
    if session is None or session.closed:
        for stale in [other for other in _SESSIONS if other.is_closed()]:
            del _SESSIONS[stale]
        session = _SESSIONS[loop] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=512), trust_env=False, raise_for_status=False
        )
    return session


async def close_sessions() -> None:
    """Close this event loop's client session (the rollout stage's close)."""
    session = _SESSIONS.pop(asyncio.get_running_loop(), None)
    if session is not None:
        await session.close()

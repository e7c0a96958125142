"""Transports: the one ``Transport`` protocol (base.py) and its two implementations.

``await connect("memory", run=...)`` is the embedded default; ``await connect("redis", run=..., url=...)``
talks to a redis-server (``redis://``, ``rediss://``, ``redis://user:password@host:port/db``), or to the
primary that Sentinel names (``redis+sentinel://h1:26379,h2:26379/<master name>/<db>``).
"""

from __future__ import annotations

from typing import Any

from pipeline.transport.base import DEAD_EDGE, Delivery, EdgeStats, Transport, TransportError
from pipeline.transport.memory import MemoryTransport

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
KINDS = ("memory", "redis")

__all__ = [
    "DEAD_EDGE",
    "DEFAULT_REDIS_URL",
    "KINDS",
    "Delivery",
    "EdgeStats",
    "MemoryTransport",
    "Transport",
    "TransportError",
    "connect",
]


async def connect(
    kind: str,
    *,
    run: str,
    url: str = DEFAULT_REDIS_URL,
    max_deliveries: int = 5,
    maxlen: int = 10_000,
    **kw: Any,
) -> Transport:
    """Open a transport. ``run`` namespaces the Redis keys; ``kw`` goes to ``RedisTransport.connect``
    (``connect_timeout``, ``socket_timeout``, ``max_connections``). An unreachable or refusing Redis
    raises ``TransportError`` with a one-line message naming the url (without its password) and the fix."""
    if kind == "memory":
        return MemoryTransport(max_deliveries=max_deliveries, maxlen=maxlen)
    if kind == "redis":
        from pipeline.transport.redis import RedisTransport  # late: the memory default never imports redis

        return await RedisTransport.connect(url, run=run, max_deliveries=max_deliveries, maxlen=maxlen, **kw)
    raise TransportError(f"unknown transport kind {kind!r}; choose one of {', '.join(KINDS)}")

"""Redis Streams transport: one stream per edge, ``rollstream:{run}:{edge}``, each entry one field ``d``.

How the contract maps onto Redis (see base.py for the contract itself):
- consume: XREADGROUP ``>``; the group is created on first use at the stream start (XGROUP CREATE 0 MKSTREAM).
- ack: XADD the outputs and XACK the inputs in one MULTI/EXEC, so neither happens without the other.
- reclaim: XAUTOCLAIM entries idle >= ``min_idle_ms``; their delivery counts come from XPENDING; those
  over ``max_deliveries`` go to ``rollstream:{run}:dead`` as a ``DeadLetter`` and are XACKed in one MULTI.
- touch: XCLAIM min-idle 0 JUSTID to the same consumer (resets idle, not the delivery counter), in a Lua
  script that first checks the consumer still owns each entry, so a slow holder never steals back an
  entry that was already reclaimed by someone else.
- read (fan-out): XREAD from the caller's cursor. stats: XLEN, XINFO GROUPS, XPENDING.
- lease / leases / release: a hash ``rollstream:{run}:leases:{name}`` of holder -> value and expiry (server
  time, Lua), expired holders dropped when read.
- trim_acked: XTRIM MINID below what every group has acked; never an unacked or undelivered entry, and
  nothing on an edge without groups (fan-out edges, or a consumer that has not started yet).
  Producers call it themselves, at most every ``maxlen // 10`` entries, once an edge holds over ``maxlen``.

Every network await is bounded: connect timeout, socket timeout (blocking reads are capped below it),
and a bounded connection pool with a wait timeout. A lost connection (a Redis restart) is retried with
exponential backoff (0.1 s doubling to 2 s) for up to ``reconnect_s``, then surfaces as ``TransportError``.
A retried call is at-least-once: if the server ran a MULTI whose reply was lost, its XADDs appear twice,
and consumers are idempotent on ``record_id`` for exactly that reason.

Failover (``redis+sentinel://``): the pool asks the sentinels for the primary on every new connection, so
the reconnect above lands on the promoted replica; a demoted primary's READONLY reply counts as a lost
connection too. Groups, pending entries and acks are in the replicated streams; Lua scripts are reloaded
(NoScriptError). Replication is asynchronous, so with ``min_replicas_acked`` > 0 every produce, ack and
dead-letter returns only once that many replicas hold it (WAIT): an acknowledged write survives the primary.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.asyncio.connection import SSLConnection, parse_url
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import AuthenticationError, NoScriptError, ReadOnlyError, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pipeline.records import DeadLetter, encode
from pipeline.transport.base import (
    DEAD_EDGE,
    Delivery,
    EdgeStats,
    TransportError,
    dead_letter_for,
    exceeded_max_deliveries,
    parse_id,
)
from pipeline.transport.urls import SENTINEL_FORM, is_sentinel_url, parse_sentinel_url, redact

FIELD = b"d"  # the one field of every entry: the encoded record

START_REDIS = 'redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no'

# Reset idle (XCLAIM ... 0 JUSTID) only for entries this consumer still owns, atomically.
_TOUCH_LUA = """
local owned = {}
for i = 3, #ARGV do
  local entry = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)[1]
  if entry and entry[2] == ARGV[2] then owned[#owned + 1] = ARGV[i] end
end
if #owned == 0 then return 0 end
owned[#owned + 1] = 'JUSTID'
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, unpack(owned))
return #owned - 1
"""
# Leases: one hash per name, holder -> "<value> <expires at, server ms>"; the server's clock for both
# writing and reading, so clients' clocks never matter. The hash itself expires with its longest lease.
_LEASE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[3])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ' ' .. (now + ttl))
if redis.call('PTTL', KEYS[1]) < ttl then redis.call('PEXPIRE', KEYS[1], ttl) end
return 1
"""
_LEASES_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local all = redis.call('HGETALL', KEYS[1])
local live = {}
for i = 1, #all, 2 do
  local value, expires = string.match(all[i + 1], '^(%-?%d+) (%d+)$')
  if expires and tonumber(expires) > now then
    live[#live + 1] = all[i]
    live[#live + 1] = value
  else
    redis.call('HDEL', KEYS[1], all[i])
  end
end
return live
"""
_TOUCH_CHUNK = 500  # ids per script call: Lua's unpack() has a stack limit

_Method = TypeVar("_Method", bound=Callable[..., Awaitable[Any]])

# What redis-py's async client returns for a stream range (its stubs say a union of sync and async types;
# bytes throughout, decode_responses being off): [(entry id, {field: value})].
_Entries = list[tuple[bytes, dict[bytes, bytes]]]


RECONNECT_FIRST_S = 0.1
RECONNECT_MAX_S = 2.0


def _translate_errors(method: _Method) -> _Method:
    """A lost or timed-out connection is retried with backoff for ``reconnect_s`` (a Redis restart), then
    becomes a one-line TransportError. So is a Lua script the server does not know (NoScriptError): redis-py
    reloads it once, but a second restart between that reload and its call lost it again (seen in CI: two
    restarts 0.3 s apart killed a rollout worker). Mid-failover the sentinels name no primary yet
    (MasterNotFoundError, a ConnectionError): retried alike. And so is READONLY: the primary this connection
    knew was demoted to a replica; its connections are dropped so the next one finds the new primary."""

    @functools.wraps(method)
    async def wrapper(self: RedisTransport, *args: Any, **kwargs: Any) -> Any:
        deadline: float | None = None
        delay = RECONNECT_FIRST_S
        while True:
            try:
                result = await method(self, *args, **kwargs)
            except (RedisConnectionError, RedisTimeoutError, NoScriptError, ReadOnlyError) as exc:
                if isinstance(exc, ReadOnlyError):
                    await self._client.connection_pool.disconnect()
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.reconnect_s
                    self.outages += 1
                if now >= deadline:
                    raise TransportError(
                        f"lost redis at {self.url} during {method.__name__} and could not reconnect within "
                        f"transport.reconnect_s={self.reconnect_s:g}: {str(exc) or type(exc).__name__}; "
                        "check that redis-server is running and reachable"
                    ) from exc
                await asyncio.sleep(min(delay, deadline - now))  # backoff before the next attempt
                delay = min(delay * 2, RECONNECT_MAX_S)
                continue
            if deadline is not None:
                self.reconnects += 1
            return result

    return wrapper  # type: ignore[return-value]


class RedisTransport:
    """Use ``await RedisTransport.connect(url, run=...)`` (or ``pipeline.transport.connect("redis", ...)``)."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        run: str,
        url: str,
        max_deliveries: int = 5,
        maxlen: int = 10_000,
        socket_timeout: float = 10.0,
        reconnect_s: float = 60.0,
        min_replicas_acked: int = 0,
        replica_wait_ms: int = 1000,
    ) -> None:
        self.max_deliveries = max_deliveries
        self.min_replicas_acked = min_replicas_acked
        self.replica_waits_short = 0  # WAITs that timed out with fewer replicas than asked (then repeated)
        self.reconnect_s = reconnect_s
        self.outages = 0  # calls that found the connection lost
        self.reconnects = 0  # of those, the ones that succeeded after retrying
        self.maxlen = maxlen
        self.run = run
        self.url = redact(url)
        self._client = client
        self._prefix = f"rollstream:{run}:"
        # A blocking read must return before the socket timeout fires, or it would look like a dead server.
        self._max_block_ms = max(1, int(socket_timeout * 1000) - 1000)
        # WAIT blocks on the server too: below the socket timeout for the same reason.
        self.replica_wait_ms = min(replica_wait_ms, self._max_block_ms)
        self._groups: set[tuple[str, str]] = set()  # (key, group) known to exist
        self._trim_every = max(1, maxlen // 10)
        self._produced_since_trim: dict[str, int] = {}
        self._touch = client.register_script(_TOUCH_LUA)
        self._lease = client.register_script(_LEASE_LUA)
        self._leases = client.register_script(_LEASES_LUA)

    @classmethod
    async def connect(
        cls,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        run: str,
        max_deliveries: int = 5,
        maxlen: int = 10_000,
        connect_timeout: float = 2.0,
        socket_timeout: float = 10.0,
        max_connections: int = 64,
        reconnect_s: float = 60.0,
        min_replicas_acked: int = 0,
        replica_wait_ms: int = 1000,
    ) -> RedisTransport:
        """Open a bounded pool for ``url`` (redis://, rediss://, user:password@, /db, or the Sentinel form
        redis+sentinel://h1:26379,h2:26379/<master name>/<db>) and PING it."""
        options: dict[str, Any] = {
            "max_connections": max_connections,
            "timeout": socket_timeout,  # wait for a free connection at most this long
            "socket_connect_timeout": connect_timeout,
            "socket_timeout": socket_timeout,
            "health_check_interval": 30,
            "retry": Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), retries=3),
        }
        try:
            if is_sentinel_url(url):
                pool = _sentinel_pool(url, options)
            else:
                pool = aioredis.BlockingConnectionPool.from_url(url, **options)
        except ValueError as exc:  # a malformed URL
            raise TransportError(f"bad redis url {redact(url)}: {exc}{_form_for(url)}") from None
        client = aioredis.Redis(connection_pool=pool)
        try:
            # Retries would multiply the connect timeout; the first PING fails fast instead.
            await asyncio.wait_for(client.ping(), connect_timeout + 1.0)
        except AuthenticationError as exc:
            await _close(client, pool)
            raise TransportError(
                f"redis at {redact(url)} refused the credentials ({exc}); check user:password in the url"
            ) from None
        except ResponseError as exc:  # e.g. NOAUTH: the server wants a password the url does not carry
            await _close(client, pool)
            raise TransportError(
                f"redis at {redact(url)} refused the connection ({exc}); check the url"
            ) from None
        except (RedisError, OSError, TimeoutError) as exc:  # refused, timed out, not a redis server
            await _close(client, pool)
            raise TransportError(
                f"cannot reach redis at {redact(url)} ({str(exc) or type(exc).__name__}); {_fix_for(url)}"
            ) from None
        return cls(
            client,
            run=run,
            url=url,
            max_deliveries=max_deliveries,
            maxlen=maxlen,
            socket_timeout=socket_timeout,
            reconnect_s=reconnect_s,
            min_replicas_acked=min_replicas_acked,
            replica_wait_ms=replica_wait_ms,
        )

    def key(self, edge: str) -> str:
        return self._prefix + edge

    # ------------------------------------------------------------------ produce / consume / ack

    @_translate_errors
    async def produce(self, edge: str, payloads: list[bytes]) -> list[str]:
        if not payloads:
            return []
        key = self.key(edge)
        async with self._client.pipeline(transaction=False) as pipe:
            for payload in payloads:
                pipe.xadd(key, {FIELD: payload})
            ids = await pipe.execute()
        await self._replicated()
        await self._count_produced({edge: len(payloads)})
        return [entry_id.decode() for entry_id in ids]

    @_translate_errors
    async def consume(
        self, edge: str, group: str, consumer: str, count: int, block_ms: int
    ) -> list[Delivery]:
        key = self.key(edge)
        await self._ensure_group(key, group)
        try:
            response = await self._xreadgroup(key, group, consumer, count, block_ms)
        except ResponseError as exc:
            if not _is_nogroup(exc):
                raise
            self._groups.discard((key, group))  # deleted behind our back (reset): create it again
            await self._ensure_group(key, group)
            response = await self._xreadgroup(key, group, consumer, count, block_ms)
        return _deliveries(edge, response)

    async def _xreadgroup(self, key: str, group: str, consumer: str, count: int, block_ms: int) -> Any:
        return await self._client.xreadgroup(
            group, consumer, {key: ">"}, count=max(1, count), block=self._block(block_ms)
        )

    @_translate_errors
    async def ack(
        self, edge: str, group: str, ids: list[str], outputs: dict[str, list[bytes]] | None = None
    ) -> None:
        outputs = {out_edge: payloads for out_edge, payloads in (outputs or {}).items() if payloads}
        if not ids and not outputs:
            return
        async with self._client.pipeline(transaction=True) as pipe:
            for out_edge, payloads in outputs.items():
                out_key = self.key(out_edge)
                for payload in payloads:
                    pipe.xadd(out_key, {FIELD: payload})
            if ids:
                pipe.xack(self.key(edge), group, *ids)
            await pipe.execute()
        await self._replicated()
        await self._count_produced({out_edge: len(payloads) for out_edge, payloads in outputs.items()})

    # ------------------------------------------------------------------ redelivery

    @_translate_errors
    async def reclaim(
        self, edge: str, group: str, consumer: str, min_idle_ms: int, count: int
    ) -> list[Delivery]:
        key = self.key(edge)
        claimed: list[tuple[bytes, dict[bytes, bytes]]] = []
        cursor: bytes | str = "0-0"
        # One XAUTOCLAIM scans at most 10 * count pending entries; follow its cursor through the rest.
        while len(claimed) < count:
            try:
                cursor, entries, *_ = await self._client.xautoclaim(
                    key, group, consumer, min_idle_ms, cursor, count=count - len(claimed)
                )
            except ResponseError as exc:
                if _is_nogroup(exc):
                    return []
                raise
            claimed += [entry for entry in entries if entry and entry[1]]
            if cursor in (b"0-0", "0-0"):
                break
        if not claimed:
            return []
        # XAUTOCLAIM already counted this delivery; read the counters back.
        async with self._client.pipeline(transaction=False) as pipe:
            for entry_id, _ in claimed:
                pipe.xpending_range(key, group, entry_id, entry_id, 1)
            pending = await pipe.execute()
        alive: list[Delivery] = []
        dead: list[DeadLetter] = []
        for (entry_id, fields), info in zip(claimed, pending):
            if not info or info[0]["consumer"] != consumer.encode():
                continue  # acked or taken over meanwhile
            deliveries = int(info[0]["times_delivered"])
            delivery = Delivery(edge, entry_id.decode(), fields.get(FIELD, b""), deliveries)
            if deliveries <= self.max_deliveries:
                alive.append(delivery)
                continue
            handed_out = deliveries - 1  # this last claim is never handed to anyone
            error = exceeded_max_deliveries(handed_out, self.max_deliveries)
            dead.append(dead_letter_for(delivery, error, stage=group, worker=consumer, deliveries=handed_out))
        if dead:
            await self._move_to_dead(key, group, dead)
        return alive

    @_translate_errors
    async def touch(self, edge: str, group: str, consumer: str, ids: list[str]) -> None:
        key = self.key(edge)
        for start in range(0, len(ids), _TOUCH_CHUNK):
            try:
                await self._touch(keys=[key], args=[group, consumer, *ids[start : start + _TOUCH_CHUNK]])
            except ResponseError as exc:
                if _is_nogroup(exc):
                    return
                raise

    @_translate_errors
    async def dead_letter(self, edge: str, group: str, delivery: Delivery, error: str, origin: str) -> None:
        stage, _, worker = origin.partition("/")
        letter = dead_letter_for(delivery, error, stage=stage, worker=worker, deliveries=delivery.deliveries)
        await self._move_to_dead(self.key(edge), group, [letter])

    async def _move_to_dead(self, key: str, group: str, letters: list[DeadLetter]) -> None:
        async with self._client.pipeline(transaction=True) as pipe:
            for letter in letters:
                pipe.xadd(self.key(DEAD_EDGE), {FIELD: encode(letter)})
            pipe.xack(key, group, *[letter.entry_id for letter in letters])
            await pipe.execute()
        await self._replicated()

    # ------------------------------------------------------------------ fan-out

    @_translate_errors
    async def read(self, edge: str, after: str, count: int, block_ms: int) -> list[Delivery]:
        response = await self._client.xread(
            {self.key(edge): after}, count=max(1, count), block=self._block(block_ms)
        )
        return _deliveries(edge, response)

    @_translate_errors
    async def last_id(self, edge: str) -> str:
        newest = cast("_Entries", await self._client.xrevrange(self.key(edge), "+", "-", count=1))
        return newest[0][0].decode() if newest else "0"

    # ------------------------------------------------------------------ inspection and upkeep

    @_translate_errors
    async def stats(self, edge: str, group: str | None = None) -> EdgeStats:
        key = self.key(edge)
        if group is None:
            return EdgeStats(edge=edge, length=await self._client.xlen(key))
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.xlen(key)
            pipe.xinfo_groups(key)
            pipe.xpending(key, group)
            pipe.xpending_range(key, group, "-", "+", 1)
            length, groups, summary, oldest = await pipe.execute(raise_on_error=False)
        if isinstance(length, Exception):
            raise length
        info = None if isinstance(groups, Exception) else _find_group(groups, group)
        if info is None:  # not created yet: it will start at the stream start
            return EdgeStats(edge=edge, length=length, lag=length)
        for result in (summary, oldest):
            if isinstance(result, Exception):
                raise result
        lag = info.get("lag")
        if lag is None:  # Redis cannot always derive it (e.g. after XDEL); count the entries instead
            after = _successor(info["last-delivered-id"])
            lag = len(cast("_Entries", await self._client.xrange(key, after, "+", count=self.maxlen)))
        return EdgeStats(
            edge=edge,
            length=length,
            pending=int(summary["pending"]),
            lag=int(lag),
            oldest_pending_ms=int(oldest[0]["time_since_delivered"]) if oldest else 0,
            consumers={c["name"].decode(): int(c["pending"]) for c in summary.get("consumers") or ()},
        )

    @_translate_errors
    async def trim_acked(self, edge: str) -> int:
        key = self.key(edge)
        try:
            groups = await self._client.xinfo_groups(key)
        except ResponseError:  # no such key
            return 0
        if not groups:
            return 0  # nobody has acked anything: a consumer that starts later still needs it all
        async with self._client.pipeline(transaction=False) as pipe:
            for info in groups:
                pipe.xpending(key, info["name"])
            summaries = await pipe.execute()
        # Per group, everything below its oldest pending entry and at or below its last-delivered id is
        # acked. Each value only grows over time, so this snapshot is conservative.
        bounds = []
        for info, summary in zip(groups, summaries):
            bound = parse_id(_successor(info["last-delivered-id"]))
            if summary["pending"]:
                bound = min(bound, parse_id(summary["min"].decode()))
            bounds.append(bound)
        # Never the newest entry: a restarted producer reads where it left off from it.
        bounds.append(parse_id(await self.last_id(edge)))
        ms, seq = min(bounds)
        if (ms, seq) <= (0, 1):
            return 0
        return int(await self._client.xtrim(key, minid=f"{ms}-{seq}", approximate=False))

    @_translate_errors
    async def delete_run(self) -> int:
        """Delete every stream of this run (``rollstream reset``); returns how many."""
        keys = [k async for k in self._client.scan_iter(match=_glob_escape(self._prefix) + "*", count=500)]
        for start in range(0, len(keys), 500):
            await self._client.delete(*keys[start : start + 500])
        self._groups.clear()
        return len(keys)

    # ------------------------------------------------------------------ leases

    def _lease_key(self, name: str) -> str:
        return f"{self._prefix}leases:{name}"

    @_translate_errors
    async def lease(self, name: str, holder: str, value: int, ttl_ms: int) -> None:
        await self._lease(keys=[self._lease_key(name)], args=[holder, int(value), max(1, int(ttl_ms))])

    @_translate_errors
    async def leases(self, name: str) -> dict[str, int]:
        flat = await self._leases(keys=[self._lease_key(name)])
        return {flat[i].decode(): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    @_translate_errors
    async def release(self, name: str, holder: str) -> None:
        await self._client.hdel(self._lease_key(name), holder)

    def _blob_key(self, key: str) -> str:
        return f"{self._prefix}blob:{key}"

    @_translate_errors
    async def put_blob(self, key: str, data: bytes, ttl_s: int) -> bool:
        # SET NX: content-addressed, so bytes already there are the same bytes; only the TTL is renewed.
        stored = await self._client.set(self._blob_key(key), data, nx=True, ex=max(1, int(ttl_s)))
        if not stored:
            await self._client.expire(self._blob_key(key), max(1, int(ttl_s)))
        return bool(stored)

    @_translate_errors
    async def get_blob(self, key: str) -> bytes | None:
        return cast("bytes | None", await self._client.get(self._blob_key(key)))

    async def close(self) -> None:
        await _close(self._client, self._client.connection_pool)

    # ------------------------------------------------------------------ helpers

    def _block(self, block_ms: int) -> int | None:
        """XREAD's BLOCK 0 waits forever; here 0 means "do not wait", and waits are capped (see __init__)."""
        return min(block_ms, self._max_block_ms) if block_ms > 0 else None

    async def _replicated(self) -> None:
        """With ``min_replicas_acked`` > 0: return once that many replicas hold every write made so far.

        WAIT counts the replicas that reached the calling connection's last write, and the writes before it
        ran on some pooled connection (a MULTI cannot hold a WAIT: it would not block there). So one
        pipeline writes a marker (its offset lies past every earlier write) and WAITs on it. Too few
        replicas in ``replica_wait_ms``: the writes are on the primary, so WAIT again rather than write them
        again, until ``reconnect_s``; then the call fails (TransportError), the worker stops and a restart
        redoes the unacknowledged work (consumers are idempotent on record_id). A lost connection meanwhile
        retries the whole call (_translate_errors): the primary may be gone with the unreplicated writes."""
        if self.min_replicas_acked <= 0:
            return
        deadline = time.monotonic() + self.reconnect_s
        while True:
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.hset(self._prefix + "replicated", "at", time.time())
                pipe.execute_command("WAIT", self.min_replicas_acked, self.replica_wait_ms)
                _, acked = await pipe.execute()
            if int(acked) >= self.min_replicas_acked:
                return
            self.replica_waits_short += 1
            if time.monotonic() >= deadline:
                raise TransportError(
                    f"redis at {self.url}: only {acked} of transport.min_replicas_acked={self.min_replicas_acked} "
                    f"replicas acknowledged the writes within transport.reconnect_s={self.reconnect_s:g}; "
                    "check the replicas (INFO replication on the primary), or lower min_replicas_acked"
                )

    async def _ensure_group(self, key: str, group: str) -> None:
        if (key, group) in self._groups:
            return
        try:
            await self._client.xgroup_create(key, group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):  # another consumer created it first: fine
                raise
        self._groups.add((key, group))

    async def _count_produced(self, produced: dict[str, int]) -> None:
        """Keep streams near ``maxlen`` by trimming acked entries, checking every ``maxlen // 10`` entries."""
        for edge, count in produced.items():
            since = self._produced_since_trim.get(edge, 0) + count
            if since < self._trim_every or edge == DEAD_EDGE:
                self._produced_since_trim[edge] = since
                continue
            self._produced_since_trim[edge] = 0
            if await self._client.xlen(self.key(edge)) > self.maxlen:
                await self.trim_acked(edge)


def _form_for(url: str) -> str:
    return f"; write it as {SENTINEL_FORM}" if is_sentinel_url(url) else ""


def _fix_for(url: str) -> str:
    if is_sentinel_url(url):
        address = parse_sentinel_url(url)
        hosts = ",".join(f"{host}:{port}" for host, port in address.sentinels)
        return (
            f"check that sentinels run at {hosts}, monitor a primary named {address.master!r} "
            "(SENTINEL GET-MASTER-ADDR-BY-NAME) and that it is reachable from here"
        )
    parts = urlsplit(url)
    if parts.scheme == "redis" and parts.hostname in ("127.0.0.1", "localhost", "::1", None):
        return f"start it: {START_REDIS}"
    return "check that redis-server runs there, is reachable from here, and speaks TLS only with rediss://"


def _deliveries(edge: str, response: Any) -> list[Delivery]:
    """An XREADGROUP / XREAD reply ([(stream, entries)], or None when nothing came) as deliveries. A foreign
    entry without our field gets an empty payload: it fails to decode and is dead-lettered."""
    streams = cast("list[tuple[bytes, _Entries]] | None", response)
    return [
        Delivery(edge, entry_id.decode(), fields.get(FIELD, b""), 1)
        for _, entries in streams or ()
        for entry_id, fields in entries
    ]


def _successor(entry_id: bytes | str) -> str:
    """The smallest id after ``entry_id`` (XTRIM MINID and XRANGE bounds are inclusive)."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, seq = parse_id(text)
    return f"{ms}-{seq + 1}"


def _find_group(groups: list[dict[str, Any]], group: str) -> dict[str, Any] | None:
    name = group.encode()
    return next((info for info in groups if info["name"] == name), None)


def _is_nogroup(exc: ResponseError) -> bool:
    return str(exc).startswith("NOGROUP")


def _glob_escape(text: str) -> str:
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)


class _SentinelPool(SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """The bounded, waiting pool of a plain url, each new connection asking the sentinels for the primary."""


def _sentinel_pool(url: str, options: dict[str, Any]) -> _SentinelPool:
    """The pool for ``redis[s]+sentinel://``: the url's credentials and /db go to the data nodes, its TLS
    options (``?ssl_ca_certs=...``) to the data nodes and the sentinels alike; the sentinels get no AUTH."""
    address = parse_sentinel_url(url)
    data = parse_url(address.data_url)
    tls = data.pop("connection_class", None) is SSLConnection
    for placeholder in ("host", "port"):
        data.pop(placeholder, None)
    tls_options = {name: value for name, value in data.items() if name.startswith("ssl")}
    sentinel = Sentinel(
        address.sentinels,
        sentinel_kwargs={
            "socket_connect_timeout": options["socket_connect_timeout"],
            "socket_timeout": options["socket_connect_timeout"],  # a dead sentinel must not stall discovery
            **({"ssl": True, **tls_options} if tls else {}),
        },
    )
    return _SentinelPool(address.master, sentinel, ssl=tls, **options, **data)


async def _close(client: aioredis.Redis, pool: aioredis.ConnectionPool) -> None:
    await client.aclose()
    await pool.disconnect()
    if isinstance(pool, SentinelConnectionPool):
        await pool.sentinel_manager.aclose()

"""A Redis restart under a live transport: calls made while the server is down wait (backoff) and succeed
once it is back from its append-only file, with nothing acknowledged lost; past ``reconnect_s`` they fail
with one clear line. A test-owned redis-server with ops/redis.conf."""

from __future__ import annotations

import asyncio

import pytest
from procs import RedisServer

from pipeline.records import Feedback, decode, encode
from pipeline.transport import TransportError, connect


def fb(i: int) -> bytes:
    return encode(Feedback(prompt_id=str(i), attempt=0, generation_batch=0, outcome="trained"))


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


async def test_calls_during_a_restart_wait_and_nothing_acknowledged_is_lost(redis_server):
    transport = await connect("redis", run="reconnect", url=redis_server.url, reconnect_s=30)
    try:
        await transport.produce("in", [fb(i) for i in range(4)])
        taken = await transport.consume("in", "g", "a", 2, 100)
        await transport.ack("in", "g", [taken[0].id], {"out": [fb(100)]})
        redis_server.kill()
        # While the server is down: a produce and an ack are in flight, retrying with backoff.
        produce = asyncio.create_task(transport.produce("in", [fb(4)]))
        ack = asyncio.create_task(transport.ack("in", "g", [taken[1].id], {"out": [fb(101)]}))
        done, _ = await asyncio.wait({produce, ack}, timeout=0.5)
        assert not done  # neither failed: they wait for the server
        redis_server.start()  # the same port and dir: it loads the append-only file
        await asyncio.wait_for(asyncio.gather(produce, ack), timeout=30)
        out = [decode(d.payload).prompt_id for d in await transport.read("out", "0", 10, 0)]
        assert out == ["100", "101"]
        rest = await transport.consume("in", "g", "a", 10, 100)  # the group and its position survived
        assert [decode(d.payload).prompt_id for d in rest] == ["2", "3", "4"]
        stats = await transport.stats("in", "g")
        assert stats.pending == 3  # the two acks held; only the three just delivered are pending
    finally:
        await transport.close()


async def test_a_server_that_stays_down_fails_after_reconnect_s(redis_server):
    transport = await connect("redis", run="reconnect", url=redis_server.url, reconnect_s=0.5)
    try:
        redis_server.kill()
        with pytest.raises(TransportError) as failure:
            await asyncio.wait_for(transport.produce("in", [fb(0)]), timeout=30)
        message = str(failure.value)
        assert "transport.reconnect_s=0.5" in message and redis_server.url in message and "\n" not in message
    finally:
        await transport.close()

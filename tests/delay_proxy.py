"""A TCP forwarder that holds every chunk for a fixed delay each way: a slow link's latency where the kernel
has no netem (tests/netns.py ``TwoHosts.delay``). Order is kept per direction; throughput is not limited.

    python tests/delay_proxy.py LISTEN_PORT UPSTREAM_HOST UPSTREAM_PORT DELAY_MS

Prints "ready" once it listens on 127.0.0.1:LISTEN_PORT."""

from __future__ import annotations

import asyncio
import sys
import time


async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def deliver() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                break
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)  # the emulated latency itself
            writer.write(data)
            await writer.drain()
        writer.close()

    delivering = asyncio.create_task(deliver())
    try:
        while data := await reader.read(65536):
            queue.put_nowait((time.monotonic() + delay_s, data))
    except ConnectionError:
        pass
    queue.put_nowait((0.0, b""))
    await delivering


async def main(port: int, host: str, upstream_port: int, delay_ms: float) -> None:
    delay_s = delay_ms / 1000

    async def serve(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(host, upstream_port)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(pump(client_reader, up_writer, delay_s), pump(up_reader, client_writer, delay_s),
                             return_exceptions=True)

    server = await asyncio.start_server(serve, "127.0.0.1", port)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4])))

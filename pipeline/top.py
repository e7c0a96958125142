"""``rollstream top``: the live pipeline of a run in the terminal, read straight from its transport.

Where work waits, per edge and its consumer group: entries in the stream (length), not yet delivered
(lag), delivered but unacked (pending), how long the oldest pending entry has been idle, and which
consumers hold them; plus the newest weights the learner published. It reads only: no group is
created, nothing is acked, so watching a run never changes it.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from pipeline.records import RecordError, WeightsPublished, decode
from pipeline.transport.base import DEAD_EDGE, TransportError, newest_payload
from stages import CONSUMER_GROUPS, WEIGHTS

# Edge -> the consumer group that reads it (the stage's name), in pipeline order. The dead edge has no
# group: nothing consumes dead letters, so its length is the whole story.
EDGE_GROUPS: dict[str, str | None] = {**CONSUMER_GROUPS, DEAD_EDGE: None}
TIMEOUT_S = 10.0  # every transport call of one refresh; a hung Redis must not freeze the screen


async def snapshot(transport: Any) -> dict[str, Any]:
    """Plain data for one screen: ``edges`` (one dict per edge, EdgeStats' fields plus ``group``),
    ``weights`` (the newest WeightsPublished as a dict, or None before the first publish) and ``taken_at``."""
    edges = []
    for edge, group in EDGE_GROUPS.items():
        stats = await asyncio.wait_for(transport.stats(edge, group), TIMEOUT_S)
        edges.append(
            {
                "edge": edge,
                "group": group,
                "length": stats.length,
                "lag": stats.lag,
                "pending": stats.pending,
                "oldest_pending_ms": stats.oldest_pending_ms,
                "consumers": dict(stats.consumers),
            }
        )
    newest = await latest_weights(transport)
    weights = None
    if newest is not None:
        weights = {
            "version": newest.version,
            "step": newest.step,
            "final": newest.final,
            "published_at": newest.published_at,
        }
    return {"edges": edges, "weights": weights, "taken_at": time.time()}


async def latest_weights(transport: Any) -> WeightsPublished | None:
    """The newest record on the fan-out ``weights`` edge."""
    payload = await asyncio.wait_for(newest_payload(transport, WEIGHTS), TIMEOUT_S)
    if payload is None:
        return None
    try:
        record = decode(payload)
    except RecordError:
        return None  # not ours to judge here; the workers dead-letter or reject it
    return record if isinstance(record, WeightsPublished) else None


def render(snap: dict[str, Any], title: str = "rollstream top", note: str = "") -> Table:
    """One table: a row per edge, the learner's newest version in the caption."""
    table = Table(title=title, caption=_weights_line(snap["weights"]) + (f"\n{note}" if note else ""))
    table.add_column("edge", style="bold", no_wrap=True)
    table.add_column("group")
    for name in ("length", "lag", "pending"):
        table.add_column(name, justify="right")
    table.add_column("oldest pending", justify="right")
    table.add_column("consumers (pending)")
    for row in snap["edges"]:
        grouped = row["group"] is not None
        table.add_row(
            row["edge"],
            row["group"] or "-",
            str(row["length"]),
            str(row["lag"]) if grouped else "-",
            str(row["pending"]) if grouped else "-",
            f"{row['oldest_pending_ms'] / 1000:.1f} s" if row["pending"] else "-",
            ", ".join(f"{name} {count}" for name, count in sorted(row["consumers"].items())) or "-",
        )
    return table


def _weights_line(weights: dict[str, Any] | None) -> str:
    if weights is None:
        return "learner: no weights published yet"
    line = f"learner version {weights['version']}  step {weights['step']}"
    if weights["published_at"]:
        line += f"  published {max(0.0, time.time() - weights['published_at']):.0f} s ago"
    return line + ("  (final: the run is over)" if weights["final"] else "")


def main(cfg: Any, interval: float = 1.0, once: bool = False) -> int:
    """Show the run of ``cfg`` on its transport; ``once`` prints one table and exits (scripts, CI)."""
    if cfg.transport.kind == "memory":
        # The memory transport lives inside the `rollstream train` process: another process sees nothing.
        print(
            'error: rollstream top needs transport.kind = "redis"; '
            "a memory run shows its progress in `rollstream train` itself",
            file=sys.stderr,
        )
        return 2
    # A floor on the period: a zero interval would turn the viewer into a busy loop against Redis.
    return asyncio.run(_watch(cfg, max(interval, 0.1), once))


async def _watch(cfg: Any, interval: float, once: bool) -> int:
    from pipeline.transport import connect

    transport = await connect(cfg.transport.kind, run=cfg.run.name, url=cfg.transport.url)
    title = f"rollstream top — run {cfg.run.name}"
    console = Console()
    try:
        if once or not console.is_terminal:
            # Not a terminal: plain tables one after another, as a log would want them.
            while True:
                console.print(render(await snapshot(transport), title))
                if once:
                    return 0
                await asyncio.sleep(interval)  # refresh period
        snap = await snapshot(transport)
        with Live(render(snap, title), console=console, auto_refresh=False) as live:
            while True:
                await asyncio.sleep(interval)  # refresh period
                try:
                    snap = await snapshot(transport)
                    note = ""
                except (TimeoutError, TransportError) as exc:
                    # Keep the last numbers on screen and say why they are old: Redis may come back.
                    note = f"[red]refresh failed: {exc or type(exc).__name__}[/red]"
                live.update(render(snap, title, note), refresh=True)
    finally:
        await transport.close()

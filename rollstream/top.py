"""``rollstream top``: the live pipeline of a run in the terminal, read straight from its transport
and from its workers' /metrics endpoints.

Where work waits, per edge and its consumer group: entries in the stream (length), not yet delivered
(lag), delivered but unacked (pending), how long the oldest pending entry has been idle, and which
consumers hold them; plus the newest weights the learner published, and (weight_transport = "broadcast")
the weights group's epoch and live members. Per stage, from the metrics
endpoints (``run.metrics_port``; stage i on port + i): workers up, records in/out per second, dead
letters, and from the learner the last reward, accuracy and staleness. It reads only: no group is
created, nothing is acked, so watching a run never changes it.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from config import Config
from pipeline.edges import CONSUMER_GROUPS, STAGE_NAMES
from pipeline.run_dir import latest_weights
from pipeline.transport import connect
from pipeline.transport.base import DEAD_EDGE, TransportError, newest_record
from weights.membership import MEMBER_LEASE, SYNC_EDGE

# Edge -> the consumer group that reads it (the stage's name), in pipeline order. The dead edge is shown
# without a group: the advantage stage reads it (to drop the groups of dead letters) but nothing trims
# it, so its length is the whole story.
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
    newest = await latest_weights(transport, TIMEOUT_S)
    weights = None
    if newest is not None:
        weights = {
            "version": newest.version,
            "step": newest.step,
            "final": newest.final,
            "published_at": newest.published_at,
        }
    return {"edges": edges, "weights": weights, "group": await weights_group(transport), "taken_at": time.time()}


async def weights_group(transport: Any) -> dict[str, Any] | None:
    """The broadcast weights group: its newest epoch and live members (None when the run has none)."""
    newest = await asyncio.wait_for(newest_record(transport, SYNC_EDGE), TIMEOUT_S)
    if newest is None:
        return None
    members = await asyncio.wait_for(transport.leases(MEMBER_LEASE), TIMEOUT_S)
    return {"epoch": getattr(newest, "epoch", None), "members": sorted(members)}


async def scrape(host: str, port: int) -> str | None:
    """One GET /metrics; None when nothing answers (the worker is not running, or metrics are off)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 2)
    except (OSError, TimeoutError):
        return None
    try:
        writer.write(f"GET /metrics HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), TIMEOUT_S)
    except (OSError, TimeoutError):
        return None
    finally:
        writer.close()
    head, _, body = data.decode(errors="replace").partition("\r\n\r\n")
    return body if head.startswith("HTTP/1.1 200") else None


def stage_numbers(text: str, run: str) -> dict[str, float]:
    """The numbers ``top`` shows, summed over a scrape's series of one run (pure: tests feed it text)."""
    out = {"workers": 0.0, "in": 0.0, "out": 0.0, "dead": 0.0}
    wanted = {
        "rollstream_worker_up": "workers",
        "rollstream_records_in_total": "in",
        "rollstream_records_out_total": "out",
        "rollstream_records_dead_lettered_total": "dead",
    }
    learner = {
        "rollstream_train_reward": "reward",
        "rollstream_train_staleness_mean": "staleness",
        "rollstream_train_step": "step",
    }
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("run") != run:
                continue
            if sample.name in wanted:
                out[wanted[sample.name]] += sample.value
            elif sample.name in learner:
                out[learner[sample.name]] = sample.value
            elif sample.name == "rollstream_train_reward_func_mean" and sample.labels.get("reward") == "accuracy":
                out["accuracy"] = sample.value
    return out


async def stage_snapshot(host: str, ports: dict[str, int], run: str) -> dict[str, dict[str, float] | None]:
    """Stage -> its numbers from its metrics endpoint, or None when it does not answer."""
    texts = await asyncio.gather(*(scrape(host, port) for port in ports.values()))
    return {stage: (None if text is None else stage_numbers(text, run)) for stage, text in zip(ports, texts)}


def stage_ports(cfg: Config) -> dict[str, int]:
    """The Procfile's ports (rollstream.cli.stage_port): stage i of STAGE_NAMES on run.metrics_port + i."""
    base = cfg.run.metrics_port
    return {stage: base + i for i, stage in enumerate(STAGE_NAMES)} if base else {}


def render_stages(
    now: dict[str, dict[str, float] | None], before: dict[str, dict[str, float] | None] | None, seconds: float
) -> Table:
    """A row per stage; in/out rates from two snapshots ``seconds`` apart (blank on the first)."""
    table = Table(title="stages (from /metrics)")
    table.add_column("stage", style="bold")
    for name in ("workers", "in/s", "out/s", "dead"):
        table.add_column(name, justify="right")
    table.add_column("training")

    def rate(stage: str, numbers: dict[str, float], key: str) -> str:
        old = (before or {}).get(stage)
        if old is None or seconds <= 0:
            return "-"
        return f"{max(0.0, numbers[key] - old[key]) / seconds:.1f}"

    for stage, numbers in now.items():
        if numbers is None:
            table.add_row(stage, "[red]no answer[/red]", "-", "-", "-", "")
            continue
        training = ""
        if "step" in numbers:
            training = f"step {numbers['step']:.0f}  reward {numbers.get('reward', 0.0):.3f}"
            if "accuracy" in numbers:
                training += f"  accuracy {numbers['accuracy']:.3f}"
            training += f"  staleness {numbers.get('staleness', 0.0):.2f}"
        table.add_row(
            stage, f"{numbers['workers']:.0f}", rate(stage, numbers, "in"), rate(stage, numbers, "out"), f"{numbers['dead']:.0f}", training
        )
    return table


def render(snap: dict[str, Any], title: str = "rollstream top", note: str = "") -> Table:
    """One table: a row per edge, the learner's newest version in the caption."""
    caption = _weights_line(snap["weights"]) + _group_line(snap.get("group")) + (f"\n{note}" if note else "")
    table = Table(title=title, caption=caption)
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


def _group_line(group: dict[str, Any] | None) -> str:
    if group is None:
        return ""
    epoch = f"epoch {group['epoch']}" if group["epoch"] is not None else "no epoch yet"
    return f"\nweights group: {epoch}, {len(group['members'])} live members ({', '.join(group['members']) or '-'})"


def _weights_line(weights: dict[str, Any] | None) -> str:
    if weights is None:
        return "learner: no weights published yet"
    line = f"learner version {weights['version']}  step {weights['step']}"
    if weights["published_at"]:
        line += f"  published {max(0.0, time.time() - weights['published_at']):.0f} s ago"
    return line + ("  (final: the run is over)" if weights["final"] else "")


def main(cfg: Config, interval: float = 1.0, once: bool = False) -> int:
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


async def _watch(cfg: Config, interval: float, once: bool) -> int:
    transport = await connect(cfg.transport.kind, run=cfg.run.name, url=cfg.transport.url)
    title = f"rollstream top — run {cfg.run.name}"
    console = Console()
    ports = stage_ports(cfg)
    host = cfg.run.metrics_host if cfg.run.metrics_host not in ("0.0.0.0", "::") else "127.0.0.1"
    stages: dict[str, Any] | None = None
    taken = time.monotonic()

    async def screen(note: str = "") -> Group:
        nonlocal stages, taken
        parts: list[Any] = [render(snap, title, note)]
        if ports:
            before, seconds = stages, time.monotonic() - taken
            stages, taken = await stage_snapshot(host, ports, cfg.run.name), time.monotonic()
            parts.append(render_stages(stages, before, seconds))
        else:
            parts.append("stages: metrics are off (set run.metrics_port to see per-stage rates)")
        return Group(*parts)

    try:
        if once or not console.is_terminal:
            # Not a terminal: plain tables one after another, as a log would want them.
            while True:
                snap = await snapshot(transport)
                console.print(await screen())
                if once:
                    return 0
                await asyncio.sleep(interval)  # refresh period
        snap = await snapshot(transport)
        with Live(await screen(), console=console, auto_refresh=False) as live:
            while True:
                await asyncio.sleep(interval)  # refresh period
                try:
                    snap = await snapshot(transport)
                    note = ""
                except (TimeoutError, TransportError) as exc:
                    # Keep the last numbers on screen and say why they are old: Redis may come back.
                    note = f"[red]refresh failed: {exc or type(exc).__name__}[/red]"
                live.update(await screen(note), refresh=True)
    finally:
        await transport.close()

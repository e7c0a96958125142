"""``rollstream inspect``: what a run produced and what it lost, from its output directory or its Redis.

Three things a person asks after (or during) a run: the last completions with their rewards, the dead
letters with the reason each was given up on, and the config the run used.

- ``RUN_DIR``: ``completions.jsonl`` (the learner's), ``dead_letters.jsonl`` (written when the run
  ends, from the transport's dead edge) and ``config.toml`` (written when it starts).
- ``--redis URL --run NAME``: the tail of the ``scored`` edge (completions as scored, trained or not),
  the ``dead`` edge, and the config found in the output directory named by the newest weights record
  (weights live in ``<output_dir>/weights/vNNNNNN``), when this machine can read it.

It only reads: no consumer group is created and nothing is acked.
"""

from __future__ import annotations

import asyncio
import collections
import json
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table

from pipeline.records import DeadLetter, RecordError, ScoredTrajectory, decode
from pipeline.transport.base import DEAD_EDGE

COMPLETIONS_FILE = "completions.jsonl"
DEAD_LETTERS_FILE = "dead_letters.jsonl"
CONFIG_FILE = "config.toml"
SCORED_EDGE = "scored"
PAGE = 500  # entries per read while walking an edge to its tail
TIMEOUT_S = 30.0  # every transport call; a hung Redis must not hang the command


def dead_record_id(letter: DeadLetter) -> str:
    """The record id of a dead letter's payload; "" when it does not decode (it then names no group)."""
    try:
        return str(getattr(decode(letter.payload), "record_id", ""))
    except (RecordError, NotImplementedError):
        return ""


def dead_letter_row(letter: DeadLetter) -> dict[str, Any]:
    """Plain data for one dead letter: where it came from, why, and what it was (when it decodes)."""
    try:
        inner = decode(letter.payload)
        what = f"{type(inner).__name__} {getattr(inner, 'record_id', '')}".strip()
    except RecordError as exc:
        what = f"undecodable payload ({len(letter.payload)} bytes): {exc}"
    return {
        "record_id": dead_record_id(letter),
        "edge": letter.edge,
        "entry_id": letter.entry_id,
        "stage": letter.stage,
        "worker": letter.worker,
        "deliveries": letter.deliveries,
        "error": letter.error,
        "record": what,
    }


def completion_row(scored: ScoredTrajectory) -> dict[str, Any]:
    """The fields of completions.jsonl, from a record on the scored edge."""
    t = scored.trajectory
    return {
        "policy_version": t.policy_version,
        "prompt": t.messages[-1]["content"] if t.messages else "",
        "completion": t.completion,
        "rewards": dict(scored.rewards),
        "reward": scored.reward,
    }


def _jsonl_tail(path: Path, last: int) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    with path.open() as f:
        lines = collections.deque((line for line in f if line.strip()), maxlen=last)
    return [json.loads(line) for line in lines]


def from_run_dir(run_dir: Path, last: int = 10) -> dict[str, Any]:
    """Plain data for one screen: ``source``, ``completions`` (the last ``last``), ``dead_letters``
    (all, or None when the run has not written the file yet), ``config`` (TOML text or None)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist (a `rollstream train` output dir)")
    if not any((run_dir / name).exists() for name in (COMPLETIONS_FILE, CONFIG_FILE, "metrics.jsonl")):
        raise FileNotFoundError(
            f"{run_dir} is not a run directory: it has none of {COMPLETIONS_FILE}, {CONFIG_FILE}, metrics.jsonl"
        )
    dead_path = run_dir / DEAD_LETTERS_FILE
    config_path = run_dir / CONFIG_FILE
    return {
        "source": str(run_dir),
        "completions": _jsonl_tail(run_dir / COMPLETIONS_FILE, last),
        "dead_letters": _jsonl_tail(dead_path, 1_000_000) if dead_path.exists() else None,
        "config": config_path.read_text() if config_path.exists() else None,
    }


async def edge_tail(transport: Any, edge: str, last: int) -> list[Any]:
    """The last ``last`` decodable records of an edge, oldest first (a forward walk: streams have no
    reverse read in the Transport protocol, and are capped at transport.maxlen entries)."""
    tail: collections.deque = collections.deque(maxlen=last)
    cursor = "0"
    while True:
        page = await asyncio.wait_for(transport.read(edge, cursor, PAGE, 0), TIMEOUT_S)
        for delivery in page:
            cursor = delivery.id
            try:
                tail.append(decode(delivery.payload))
            except RecordError:
                continue  # undecodable entries are the workers' to dead-letter, not ours
        if len(page) < PAGE:
            return list(tail)


async def dead_letters(transport: Any) -> list[dict[str, Any]]:
    """Every dead letter of the run, as ``dead_letter_row`` dicts."""
    letters = await edge_tail(transport, DEAD_EDGE, 1_000_000)
    return [dead_letter_row(d) for d in letters if isinstance(d, DeadLetter)]


async def from_transport(transport: Any, last: int = 10) -> dict[str, Any]:
    """The same screen as ``from_run_dir``, from a run's streams."""
    from pipeline.top import latest_weights

    scored = [r for r in await edge_tail(transport, SCORED_EDGE, last * 4) if isinstance(r, ScoredTrajectory)]
    config = None
    newest = await latest_weights(transport)
    if newest is not None:
        config_path = Path(newest.path).parent.parent / CONFIG_FILE
        config = config_path.read_text() if config_path.exists() else None
    return {
        "source": f"transport run {getattr(transport, 'run', '?')}",
        "completions": [completion_row(s) for s in scored[-last:]],
        "dead_letters": await dead_letters(transport),
        "config": config,
    }


async def write_dead_letters(transport: Any, path: Path) -> int:
    """Keep the dead edge next to the run's other outputs (a memory run's edges die with its process)."""
    rows = await dead_letters(transport)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return len(rows)


def render(info: dict[str, Any]) -> Group:
    completions = Table(title=f"last {len(info['completions'])} completions", show_lines=True)
    for name in ("version", "prompt", "completion", "rewards", "reward"):
        completions.add_column(name, justify="right" if name in ("version", "reward") else "left")
    for row in info["completions"]:
        rewards = ", ".join(f"{k} {_num(v)}" for k, v in row.get("rewards", {}).items())
        completions.add_row(
            str(row.get("policy_version", "")), row["prompt"], row["completion"], rewards, _num(row["reward"])
        )
    if info["dead_letters"] is None:
        dead: Any = "dead letters: not written yet (the run writes dead_letters.jsonl when it ends)"
    elif not info["dead_letters"]:
        dead = "dead letters: none"
    else:
        dead = Table(title=f"{len(info['dead_letters'])} dead letters")
        for name in ("edge", "entry", "stage/worker", "deliveries", "record", "reason"):
            dead.add_column(name)
        for row in info["dead_letters"]:
            dead.add_row(
                row["edge"], row["entry_id"], f"{row['stage']}/{row['worker']}", str(row["deliveries"]),
                row["record"], row["error"],
            )
    config: Any = (
        Panel(Syntax(info["config"], "toml"), title="config")
        if info["config"]
        else "config: not found (config.toml is written into the run's output directory when it starts)"
    )
    return Group(f"[bold]rollstream inspect[/bold] {info['source']}", completions, dead, config)


def _num(value: Any) -> str:
    return "-" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)


def main(run_dir: str | None, redis_url: str | None, run: str | None, last: int = 10) -> int:
    console = Console()
    if run_dir is not None:
        console.print(render(from_run_dir(Path(run_dir), last)))
        return 0
    return asyncio.run(_from_redis(console, redis_url, run, last))


async def _from_redis(console: Console, url: str, run: str, last: int) -> int:
    from pipeline.transport import connect

    transport = await connect("redis", run=run, url=url)
    try:
        console.print(render(await from_transport(transport, last)))
    finally:
        await transport.close()
    return 0

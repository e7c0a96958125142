"""``rollstream inspect``: what a run produced and what it lost, from its output directory or its Redis.

Three things a person asks after (or during) a run: the last completions with their rewards, the dead
letters with the reason each was given up on, and the config the run used.

- ``RUN_DIR``: ``completions.jsonl`` (the learner's; none under ``run.log_completions = false``),
  ``dead_letters.jsonl`` (written when the run ends, from the transport's dead edge) and ``config.toml``
  (written when it starts).
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

from pipeline.records import ScoredGroup, ScoredTrajectory
from pipeline.run_dir import (
    COMPLETIONS_FILE,
    CONFIG_FILE,
    DEAD_LETTERS_FILE,
    SCORED_EDGE,
    completion_row,
    dead_letters,
    edge_tail,
    latest_weights,
    missing_completions,
)
from pipeline.transport import connect


def _jsonl_tail(path: Path, last: int) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    with path.open() as f:
        lines = collections.deque((line for line in f if line.strip()), maxlen=last)
    return [json.loads(line) for line in lines]


def from_run_dir(run_dir: Path, last: int = 10) -> dict[str, Any]:
    """Plain data for one screen: ``source``, ``completions`` (the last ``last``), ``completions_missing``
    (why there is no completions.jsonl, or None), ``dead_letters`` (all, or None when the run has not
    written the file yet), ``config`` (TOML text or None)."""
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
        "completions_missing": missing_completions(run_dir),
        "dead_letters": _jsonl_tail(dead_path, 1_000_000) if dead_path.exists() else None,
        "config": config_path.read_text() if config_path.exists() else None,
    }


async def from_transport(transport: Any, last: int = 10) -> dict[str, Any]:
    """The same screen as ``from_run_dir``, from a run's streams."""
    scored: list[ScoredTrajectory] = []
    for r in await edge_tail(transport, SCORED_EDGE, last * 4):  # whole groups, or hand-written single records
        scored += r.records if isinstance(r, ScoredGroup) else [r] if isinstance(r, ScoredTrajectory) else []
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


def render(info: dict[str, Any]) -> Group:
    if info.get("completions_missing"):
        return _render(info, f"completions: {info['completions_missing']}")
    completions = Table(title=f"last {len(info['completions'])} completions", show_lines=True)
    for name in ("version", "prompt", "completion", "rewards", "reward"):
        completions.add_column(name, justify="right" if name in ("version", "reward") else "left")
    for row in info["completions"]:
        rewards = ", ".join(f"{k} {_num(v)}" for k, v in row.get("rewards", {}).items())
        completions.add_row(
            str(row.get("policy_version", "")), row["prompt"], row["completion"], rewards, _num(row["reward"])
        )
    return _render(info, completions)


def _render(info: dict[str, Any], completions: Any) -> Group:
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
    if redis_url is None or run is None:  # the CLI asks for one or the other
        raise ValueError("inspect reads a run directory, or a Redis url with a run name")
    return asyncio.run(_from_redis(console, redis_url, run, last))


async def _from_redis(console: Console, url: str, run: str, last: int) -> int:
    transport = await connect("redis", run=run, url=url)
    try:
        console.print(render(await from_transport(transport, last)))
    finally:
        await transport.close()
    return 0

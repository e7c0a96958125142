"""What a run leaves behind and how to read it back: the run directory's file names, the rows of its
dead letters and completions, and reads of a run's edges (the dead letters, the newest weights).

``RUN_DIR`` holds ``completions.jsonl`` (the learner's, unless ``run.log_completions = false``), ``dead_letters.jsonl`` (written when the run
ends, from the transport's dead edge) and ``config.toml`` (written when it starts). Everything here only
reads a transport: no consumer group is created and nothing is acked.
"""

from __future__ import annotations

import asyncio
import collections
import json
import tomllib
from pathlib import Path
from typing import Any

from pipeline.edges import WEIGHTS
from pipeline.records import DeadLetter, RecordError, ScoredTrajectory, WeightsPublished, decode
from pipeline.transport.base import DEAD_EDGE, newest_record

COMPLETIONS_FILE = "completions.jsonl"
DEAD_LETTERS_FILE = "dead_letters.jsonl"
CONFIG_FILE = "config.toml"
SCORED_EDGE = "scored"
PAGE = 500  # entries per read while walking an edge to its tail
TIMEOUT_S = 30.0  # every transport call; a hung Redis must not hang the command


def missing_completions(run_dir: Path) -> str | None:
    """Why a run directory has no completions.jsonl (None when it has one): the run turned it off
    (``run.log_completions = false`` in its config.toml), or no generation batch has been trained yet."""
    run_dir = Path(run_dir)
    if (run_dir / COMPLETIONS_FILE).exists():
        return None
    try:
        logged = tomllib.loads((run_dir / CONFIG_FILE).read_text()).get("run", {}).get("log_completions", True)
    except (OSError, tomllib.TOMLDecodeError):
        logged = True  # no readable config: nothing says the run turned it off
    if logged is False:
        return (
            f"{COMPLETIONS_FILE} not written: the run has run.log_completions = false (set it to true to keep "
            "them; `rollstream inspect --redis URL --run NAME` reads the scored edge of a live run)"
        )
    return f"{COMPLETIONS_FILE} not written yet (the learner writes it after each trained generation batch)"


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


async def edge_tail(transport: Any, edge: str, last: int | None) -> list[Any]:
    """The last ``last`` (None: all) decodable records of an edge, oldest first (a forward walk: streams have
    no reverse read in the Transport protocol, and are capped at transport.maxlen entries)."""
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


async def latest_weights(transport: Any, timeout_s: float = TIMEOUT_S) -> WeightsPublished | None:
    """The newest record on the fan-out ``weights`` edge (the run's newest snapshot, and whether it is final)."""
    record = await asyncio.wait_for(newest_record(transport, WEIGHTS), timeout_s)
    return record if isinstance(record, WeightsPublished) else None


async def write_dead_letters(transport: Any, path: Path) -> int:
    """Keep the dead edge next to the run's other outputs (a memory run's edges die with its process)."""
    rows = await dead_letters(transport)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return len(rows)

"""The ledger (``run.ledger = true``): what every stage acked and produced, and the audit over it.

Writing: the worker runtime appends one ``LedgerEntry`` per atomic step (the input record ids it acked and
a ``LedgerOutput`` per output) to the stage's ledger edge, *in the same transport call* as the ack and the
outputs (Redis MULTI/EXEC), so a kill can never leave a step half-recorded. A memory run writes the edges
to ``RUN_DIR/ledger/<stage>.jsonl`` when it ends.

Checking (``rollstream ledger check RUN_DIR | --redis URL --run NAME``), from the ledger and the dead edge:

- every prompt group the feeder released was trained exactly once, or dropped with a recorded reason
  (a ``Feedback``: staleness, zero_std, truncated, reward_error, dead_letter, ...), or dead-lettered, or
  was still held when the run finished (the learner's last partial batch);
- every trained group's ``TrainGroup`` holds exactly its manifest's records (the rollout's ``GroupClosed``);
- no record id was trained twice, and no group was released twice.

Record ids name their group (``<prompt_id>/<attempt>/...``, see ``pipeline/records.py``), so an acked
input or a dead letter is traced to its group by its id alone.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from pipeline.edges import STAGE_NAMES
from pipeline.records import (
    DEAD_LETTER_DROP,
    DeadLetter,
    Feedback,
    GroupClosed,
    LedgerEntry,
    LedgerOutput,
    PromptTask,
    ScoredGroup,
    TrainGroup,
    TrajectoryGroup,
)
from pipeline.run_dir import DEAD_LETTERS_FILE, dead_record_id, edge_tail
from pipeline.transport import connect
from pipeline.transport.base import DEAD_EDGE, ledger_edge

LEDGER_DIR = "ledger"  # RUN_DIR/ledger/<stage>.jsonl for a memory run
RUN_FINISHED = "run_finished"
EXAMPLES = 5  # ids shown per violation kind

VIOLATIONS = {
    "lost": "released, never trained, dropped, dead-lettered or held at the end",
    "released_twice": "the feeder released the group more than once",
    "trained_twice": "the learner trained the group more than once",
    "trained_and_dropped": "the group was both trained and dropped",
    "dropped_without_reason": "a drop Feedback with no reason",
    "not_released": "trained or dropped, but the feeder never released it",
    "no_manifest": "trained, but the rollout never sent its manifest",
    "no_train_group": "trained, but the advantage stage never sent its TrainGroup",
    "wrong_records": "the TrainGroup's records differ from its manifest's",
    "record_trained_twice": "one record id in two trained groups, or twice in one",
    "conflicting_manifests": "two manifests of one group list different records",
}


def group_of(record_id: str) -> str:
    """The group (``prompt_id/attempt``) a record id belongs to: every record id starts with it."""
    return "/".join(record_id.split("/")[:2])


def describe(edge: str, record: Any) -> LedgerOutput:
    """What the ledger keeps of one output record."""
    members: list[str] = []
    outcome = reason = ""
    if isinstance(record, GroupClosed):
        members = list(record.record_ids)
    elif isinstance(record, (TrajectoryGroup, ScoredGroup)):
        members = list(record.manifest.record_ids)
    elif isinstance(record, TrainGroup):
        members = [r.record_id for r in record.records]
    elif isinstance(record, Feedback):
        outcome, reason = record.outcome, record.reason
    tag = type(record).__struct_config__.tag
    return LedgerOutput(
        edge=edge, type=str(tag), record_id=record.record_id, members=members, outcome=outcome, reason=reason
    )


def entry(
    stage: str, worker: str, acked: list[str], emits: list[tuple[str, Any]], note: str = ""
) -> LedgerEntry:
    """One step's entry: the inputs acked and the outputs produced together."""
    return LedgerEntry(
        stage=stage,
        worker=worker,
        acked=list(acked),
        outputs=[describe(edge, record) for edge, record in emits],
        note=note,
        at=time.time(),
    )


# ------------------------------------------------------------------------------------------ the audit


@dataclass
class Audit:
    """Counts and violations of one ledger check (``ok`` when there are no violations)."""

    entries: dict[str, int] = field(default_factory=dict)  # stage -> ledger entries
    released: int = 0
    trained: int = 0
    records_trained: int = 0
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> groups
    dead_lettered: int = 0  # groups with a dead letter (and no other fate)
    dead_letters: int = 0
    held_at_end: int = 0
    violations: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))

    @property
    def ok(self) -> bool:
        return not any(self.violations.values())

    def counts(self) -> dict[str, Any]:
        """Plain numbers, for printing and for bench/README figures."""
        return {
            "entries": dict(self.entries),
            "released": self.released,
            "trained": self.trained,
            "records_trained": self.records_trained,
            "dropped": dict(self.dropped),
            "dead_lettered": self.dead_lettered,
            "dead_letters": self.dead_letters,
            "held_at_end": self.held_at_end,
            "lost": len(self.violations.get("lost", [])),
            "duplicated": len(self.violations.get("trained_twice", []))
            + len(self.violations.get("record_trained_twice", [])),
            "violations": {kind: len(ids) for kind, ids in self.violations.items() if ids},
        }


def check(entries: list[LedgerEntry], dead: list[str]) -> Audit:
    """Pure: audit a run's ledger entries (every stage's) and its dead letters, given as the record ids
    they held ("" for an undecodable payload). See the module docstring."""
    # A write retried after a lost reply (a Redis restart) lands twice: the same step, the same record id.
    entries = list({e.record_id: e for e in entries}.values())
    audit = Audit(entries=dict(Counter(e.stage for e in entries)))
    released: Counter[str] = Counter()
    manifests: dict[str, list[str]] = {}
    train_groups: dict[str, list[str]] = {}
    trained: Counter[str] = Counter()
    dropped: dict[str, set[str]] = defaultdict(set)
    held_at_end: set[str] = set()
    bad = audit.violations

    for e in entries:
        if e.note == RUN_FINISHED:
            held_at_end.update(group_of(r) for r in e.acked)
        for out in e.outputs:
            group = group_of(out.record_id)
            if out.type == PromptTask.__struct_config__.tag:
                released[group] += 1
            elif out.type in (GroupClosed.__struct_config__.tag, TrajectoryGroup.__struct_config__.tag):
                known = manifests.setdefault(group, out.members)
                if sorted(known) != sorted(out.members):
                    bad["conflicting_manifests"].append(group)
            elif out.type == TrainGroup.__struct_config__.tag:
                # The same group emitted again (a redelivery after a restart) must carry the same records.
                known = train_groups.setdefault(group, out.members)
                if sorted(known) != sorted(out.members):
                    bad["wrong_records"].append(group)
            elif out.type == Feedback.__struct_config__.tag:
                if out.outcome == "trained" and e.stage == "learner":
                    trained[group] += 1
                elif out.outcome == "dropped":
                    dropped[group].add(out.reason)
                    if not out.reason:
                        bad["dropped_without_reason"].append(group)

    dead_groups: set[str] = set()
    for record_id in dead:
        audit.dead_letters += 1
        if record_id:  # an undecodable payload is counted but belongs to no group
            dead_groups.add(group_of(record_id))

    seen_records: Counter[str] = Counter()
    for group, times in trained.items():
        if times > 1:
            bad["trained_twice"].append(group)
        if group in dropped:
            bad["trained_and_dropped"].append(group)
        if released and group not in released:
            bad["not_released"].append(group)
        members = train_groups.get(group)
        if members is None:
            bad["no_train_group"].append(group)
            continue
        seen_records.update(members)
        manifest = manifests.get(group)
        if manifest is None:
            bad["no_manifest"].append(group)
        elif sorted(members) != sorted(manifest):
            bad["wrong_records"].append(group)
    bad["record_trained_twice"] += sorted(r for r, n in seen_records.items() if n > 1)
    if released:
        # The advantage stage announces the drop of whatever group a dead letter's payload names; a poison
        # record with made-up ids names one the feeder never released (nor replaced): no group's fate.
        for group in [g for g, why in dropped.items() if g not in released and why == {DEAD_LETTER_DROP}]:
            del dropped[group]
        bad["not_released"] += sorted(g for g in dropped if g not in released)
    for group, times in sorted(released.items()):
        if times > 1:
            bad["released_twice"].append(group)
        fates = (group in trained, group in dropped, group in dead_groups, group in held_at_end)
        if not any(fates):
            bad["lost"].append(group)

    audit.released = len(released)
    audit.trained = len(trained)
    audit.records_trained = sum(seen_records.values())
    reasons: Counter[str] = Counter(reason or "(none)" for reasons in dropped.values() for reason in reasons)
    audit.dropped = dict(reasons)
    audit.dead_lettered = len(dead_groups - set(trained) - set(dropped))
    audit.held_at_end = len(held_at_end - set(trained) - set(dropped))
    for kind in list(bad):
        bad[kind] = sorted(set(bad[kind]))
    return audit


def format_audit(audit: Audit) -> str:
    """The lines ``rollstream ledger check`` prints."""
    c = audit.counts()
    lines = [
        "ledger entries: " + (", ".join(f"{s} {n}" for s, n in c["entries"].items()) or "none"),
        f"groups released {c['released']}, trained {c['trained']} ({c['records_trained']} records), "
        f"dropped {sum(c['dropped'].values())}"
        + (f" ({', '.join(f'{r} {n}' for r, n in sorted(c['dropped'].items()))})" if c["dropped"] else "")
        + f", dead-lettered {c['dead_lettered']} ({c['dead_letters']} dead letters), held at the end {c['held_at_end']}",
        f"lost {c['lost']}, duplicated {c['duplicated']}",
    ]
    if audit.ok:
        lines.append("ledger check: OK")
        return "\n".join(lines)
    for kind, ids in audit.violations.items():
        if ids:
            shown = ", ".join(ids[:EXAMPLES]) + (" ..." if len(ids) > EXAMPLES else "")
            lines.append(f"VIOLATION {kind} ({VIOLATIONS[kind]}): {len(ids)}: {shown}")
    lines.append(f"ledger check: FAILED ({sum(len(v) for v in audit.violations.values())} violations)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ reading


async def read_transport(transport: Any) -> tuple[list[LedgerEntry], list[str]]:
    """Every stage's ledger entries and the record ids of a run's dead letters ("" when the payload does
    not decode), from its streams (nothing is acked)."""
    entries: list[LedgerEntry] = []
    for stage in STAGE_NAMES:
        entries += [r for r in await edge_tail(transport, ledger_edge(stage), None) if isinstance(r, LedgerEntry)]
    dead = [dead_record_id(r) for r in await edge_tail(transport, DEAD_EDGE, None) if isinstance(r, DeadLetter)]
    return entries, dead


async def write_run_dir(transport: Any, output_dir: Path) -> int:
    """A memory run's ledger edges as ``RUN_DIR/ledger/<stage>.jsonl`` (its edges die with the process)."""
    entries, _dead = await read_transport(transport)
    if not entries:
        return 0
    directory = output_dir / LEDGER_DIR
    directory.mkdir(parents=True, exist_ok=True)
    by_stage: dict[str, list[LedgerEntry]] = defaultdict(list)
    for e in entries:
        by_stage[e.stage].append(e)
    for stage, stage_entries in by_stage.items():
        (directory / f"{stage}.jsonl").write_bytes(
            b"".join(msgspec.json.encode(e) + b"\n" for e in stage_entries)
        )
    return len(entries)


def read_run_dir(run_dir: Path) -> tuple[list[LedgerEntry], list[str]]:
    """A memory run's ledger files and its dead_letters.jsonl."""
    directory = Path(run_dir) / LEDGER_DIR
    if not directory.is_dir():
        raise FileNotFoundError(
            f"{run_dir} has no {LEDGER_DIR}/ directory: run with `--set run.ledger=true` to write a ledger"
        )
    decoder = msgspec.json.Decoder(LedgerEntry)
    entries: list[LedgerEntry] = []
    for path in sorted(directory.glob("*.jsonl")):
        with path.open("rb") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        entries.append(decoder.decode(line))
                    except msgspec.DecodeError as exc:
                        raise ValueError(f"{path}:{number}: not a ledger entry: {exc}") from None
    dead: list[str] = []
    dead_path = Path(run_dir) / DEAD_LETTERS_FILE
    if dead_path.exists():
        rows = [json.loads(line) for line in dead_path.read_text().splitlines() if line.strip()]
        dead = [row.get("record_id", "") for row in rows]
    return entries, dead


def main(run_dir: str | None, redis_url: str | None, run: str | None) -> int:
    """``rollstream ledger check``: print the counts; exit 1 on any violation."""
    if run_dir is not None:
        entries, dead = read_run_dir(Path(run_dir))
    elif redis_url is not None and run is not None:
        entries, dead = asyncio.run(_from_redis(redis_url, run))
    else:  # the CLI asks for one or the other
        raise ValueError("ledger check reads a run directory, or a Redis url with a run name")
    if not entries:
        print("no ledger entries for this run: run it with `--set run.ledger=true`")
        return 1
    audit = check(entries, dead)
    print(format_audit(audit))
    return 0 if audit.ok else 1


async def _from_redis(url: str, run: str) -> tuple[list[LedgerEntry], list[str]]:
    transport = await connect("redis", run=run, url=url)
    try:
        return await read_transport(transport)
    finally:
        await transport.close()

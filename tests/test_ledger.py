"""The ledger: the audit over hand-built ledgers (each violation kind detected), what the worker writes
(atomically with its acks, on both transports' semantics), and the CLI over a run directory."""

from __future__ import annotations

import json

import poison_reward_plugin as poison
import pytest

from pipeline import ledger
from pipeline.records import (
    Feedback,
    GroupClosed,
    LedgerEntry,
    PromptTask,
    ScoredTrajectory,
    TrainGroup,
    Trajectory,
    decode,
    encode,
)
from pipeline.stage import Handled, Stage
from pipeline.transport.base import ledger_edge
from pipeline.transport.memory import MemoryTransport
from pipeline.worker import Worker
from rollstream.cli import main as cli

# ---------------------------------------------------------------- a clean run, built by hand


def task(group: str) -> PromptTask:
    prompt_id, attempt = group.split("/")
    return PromptTask(
        prompt_id=prompt_id, attempt=int(attempt), generation_batch=0, num_generations=2, messages=[]
    )


def traj(group: str, i: int) -> Trajectory:
    prompt_id, attempt = group.split("/")
    return Trajectory(
        prompt_id=prompt_id,
        attempt=int(attempt),
        request_id=f"{group}/{i}",
        generation_batch=0,
        prompt_ids=b"",
        completion_ids=b"",
        logprobs=b"",
        policy_version=0,
        max_policy_version=0,
    )


def manifest(group: str, ids: list[str]) -> GroupClosed:
    prompt_id, attempt = group.split("/")
    return GroupClosed(prompt_id=prompt_id, attempt=int(attempt), generation_batch=0, record_ids=ids)


def train_group(group: str, n: int = 2) -> TrainGroup:
    prompt_id, attempt = group.split("/")
    records = [ScoredTrajectory(trajectory=traj(group, i), rewards={}, reward=float(i)) for i in range(n)]
    return TrainGroup(
        prompt_id=prompt_id, attempt=int(attempt), generation_batch=0, records=records, advantages=[0.0] * n
    )


def feedback(group: str, outcome: str, reason: str = "") -> Feedback:
    prompt_id, attempt = group.split("/")
    return Feedback(
        prompt_id=prompt_id, attempt=int(attempt), generation_batch=0, outcome=outcome, reason=reason
    )


def step(stage: str, acked: list[str], *emits) -> LedgerEntry:
    return ledger.entry(stage, f"{stage}-1", acked, list(emits))


def trained_path(group: str) -> list[LedgerEntry]:
    """The entries of one group released, generated, scored, grouped and trained, as the stages write them."""
    trajs = [traj(group, i) for i in range(2)]
    ids = [t.record_id for t in trajs]
    return [
        step("feeder", [], ("prompts", task(group))),
        step(
            "rollout", [group], *[("trajectories", t) for t in trajs], ("trajectories", manifest(group, ids))
        ),
        step("advantage", ids + [f"{group}/closed"], ("train", train_group(group))),
        step("learner", [group], ("feedback", feedback(group, "trained"))),
    ]


def clean() -> list[LedgerEntry]:
    dropped = [
        step("feeder", [], ("prompts", task("e0:2/0"))),
        step("advantage", ["e0:2/0/closed"], ("feedback", feedback("e0:2/0", "dropped", "zero_std"))),
    ]
    return trained_path("e0:0/0") + trained_path("e0:1/0") + dropped


def test_a_clean_ledger_passes_with_its_counts():
    audit = ledger.check(clean(), [])
    assert audit.ok, audit.violations
    counts = audit.counts()
    assert (counts["released"], counts["trained"], counts["records_trained"]) == (3, 2, 4)
    assert counts["dropped"] == {"zero_std": 1}
    assert (counts["lost"], counts["duplicated"]) == (0, 0)
    assert counts["entries"] == {"feeder": 3, "rollout": 2, "advantage": 3, "learner": 2}


def test_a_redelivered_train_group_that_is_not_trained_again_is_clean():
    entries = clean() + [step("advantage", ["e0:0/0/0/0"], ("train", train_group("e0:0/0")))]
    entries += [step("learner", ["e0:0/0"])]  # the learner acks the duplicate and trains nothing
    assert ledger.check(entries, []).ok


def lose(entries):
    return [e for e in entries if not (e.stage == "learner" and e.acked == ["e0:1/0"])]


def duplicate_training(entries):
    return entries + [step("learner", ["e0:1/0"], ("feedback", feedback("e0:1/0", "trained")))]


def short_group(entries):
    return entries + [step("advantage", [], ("train", train_group("e0:0/0", n=1)))]


def release_twice(entries):
    return entries + [step("feeder", [], ("prompts", task("e0:0/0")))]


def drop_without_reason(entries):
    return entries + [
        step("feeder", [], ("prompts", task("e0:5/0"))),
        step("advantage", [], ("feedback", feedback("e0:5/0", "dropped"))),
    ]


def train_and_drop(entries):
    return entries + [step("learner", [], ("feedback", feedback("e0:0/0", "dropped", "staleness")))]


def train_unreleased(entries):
    return entries + trained_path("e0:9/0")[1:]


def no_manifest(entries):
    return [e for e in entries if not (e.stage == "rollout" and e.acked == ["e0:1/0"])]


def no_train_group(entries):
    return [e for e in entries if not (e.stage == "advantage" and e.outputs[0].record_id == "e0:1/0")]


def conflicting_manifests(entries):
    return entries + [step("rollout", ["e0:0/0"], ("trajectories", manifest("e0:0/0", ["e0:0/0/0/0"])))]


def record_twice_in_a_group(entries):
    group = train_group("e0:0/0")
    doubled = TrainGroup(
        prompt_id="e0:3", attempt=0, generation_batch=0, records=[group.records[0]] * 2, advantages=[0.0, 0.0]
    )
    ids = ["e0:0/0/0/0", "e0:0/0/0/0"]
    return entries + [
        step("feeder", [], ("prompts", task("e0:3/0"))),
        step("rollout", ["e0:3/0"], ("trajectories", manifest("e0:3/0", ids))),
        step("advantage", [], ("train", doubled)),
        step("learner", ["e0:3/0"], ("feedback", feedback("e0:3/0", "trained"))),
    ]


@pytest.mark.parametrize(
    ("break_it", "kind", "group"),
    [
        (lose, "lost", "e0:1/0"),
        (duplicate_training, "trained_twice", "e0:1/0"),
        (short_group, "wrong_records", "e0:0/0"),
        (release_twice, "released_twice", "e0:0/0"),
        (drop_without_reason, "dropped_without_reason", "e0:5/0"),
        (train_and_drop, "trained_and_dropped", "e0:0/0"),
        (train_unreleased, "not_released", "e0:9/0"),
        (no_manifest, "no_manifest", "e0:1/0"),
        (no_train_group, "no_train_group", "e0:1/0"),
        (conflicting_manifests, "conflicting_manifests", "e0:0/0"),
        (record_twice_in_a_group, "record_trained_twice", "e0:0/0/0/0"),
    ],
)
def test_each_violation_is_detected(break_it, kind, group):
    audit = ledger.check(break_it(clean()), [])
    assert not audit.ok
    assert audit.violations[kind] == [group]
    assert f"VIOLATION {kind}" in ledger.format_audit(audit)


def test_a_dead_lettered_group_is_accounted_for_not_lost():
    entries = clean() + [step("feeder", [], ("prompts", task("e0:7/0")))]
    assert ledger.check(entries, []).violations["lost"] == ["e0:7/0"]
    audit = ledger.check(entries, ["e0:7/0/1/0", ""])  # a trajectory of it, and an undecodable payload
    assert audit.ok
    assert (audit.counts()["dead_lettered"], audit.counts()["dead_letters"]) == (1, 2)


def test_a_group_dropped_for_a_dead_letter_is_dropped_and_a_poison_records_made_up_group_is_no_violation():
    entries = clean() + [
        step("feeder", [], ("prompts", task("e0:7/0"))),
        # A trajectory of e0:7/0 went dead: the advantage stage drops the group with what it held.
        step("advantage", ["dead/trajectories/1-0", "e0:7/0/0/0"],
             ("feedback", feedback("e0:7/0", "dropped", "dead_letter"))),
        # A poison record named a group nobody released: its drop is announced, the feeder ignores it.
        step("advantage", ["dead/trajectories/2-0"], ("feedback", feedback("poison/0", "dropped", "dead_letter"))),
    ]
    audit = ledger.check(entries, ["e0:7/0/1/0", "poison/0"])
    assert audit.ok, ledger.format_audit(audit)
    assert audit.counts()["dropped"] == {"zero_std": 1, "dead_letter": 1}
    assert audit.counts()["dead_lettered"] == 1  # the poison: a dead letter and no released group's fate
    # Any other reason for dropping a group never released is still a violation.
    entries.append(step("learner", ["x"], ("feedback", feedback("ghost/0", "dropped", "staleness"))))
    assert ledger.check(entries, []).violations["not_released"] == ["ghost/0"]


def test_a_group_held_when_the_run_finished_is_accounted_for():
    entries = clean() + [step("feeder", [], ("prompts", task("e0:8/0")))]
    entries.append(ledger.entry("learner", "learner-1", ["e0:8/0"], [], note=ledger.RUN_FINISHED))
    audit = ledger.check(entries, [])
    assert audit.ok and audit.counts()["held_at_end"] == 1


# ---------------------------------------------------------------- what the worker writes


class Collector(Stage):
    """Holds every Feedback of a group until its second one, then releases both with one output."""

    name = "collector"
    consumes = ("in",)

    def __init__(self) -> None:
        self.seen: dict[str, list[str]] = {}

    async def handle(self, record, ctx):
        group = self.seen.setdefault(record.prompt_id, [])
        if record.record_id not in group:
            group.append(record.record_id)
        if len(group) < 2:
            return Handled(hold=True)
        out = Feedback(prompt_id=record.prompt_id, attempt=0, generation_batch=0, outcome="trained")
        return Handled(outputs=[("out", out)], release=[r for r in group if r != record.record_id])


async def entries_on(transport, stage):
    return [decode(d.payload) for d in await transport.read(ledger_edge(stage), "0", 1000, 0)]


async def test_the_worker_writes_one_entry_per_step_with_acks_and_outputs():
    transport = MemoryTransport(maxlen=4)  # the ledger edge is exempt from the bound
    first, second = (
        feedback("p/0", "dropped", "x"),
        Feedback(prompt_id="p", attempt=0, generation_batch=0, outcome="trained"),
    )
    # The same held record twice (a producer retried after a lost reply), then the record that completes it.
    await transport.produce("in", [encode(first), encode(first), encode(second)])
    worker = Worker(Collector(), transport, run="t", block_ms=20, min_idle_ms=60_000, burst=True, ledger=True)
    assert await worker.serve() == 0
    entries = await entries_on(transport, "collector")
    acked = [rid for e in entries for rid in e.acked]
    assert sorted(acked) == sorted([first.record_id, first.record_id, second.record_id])
    outputs = [o for e in entries for o in e.outputs]
    assert [(o.edge, o.type, o.record_id, o.outcome) for o in outputs] == [
        ("out", "feedback", "p/0/trained", "trained")
    ]
    # Nothing left pending: the duplicate's older entry was acked, not leaked to be reclaimed forever.
    stats = await transport.stats("in", "collector")
    assert (stats.pending, stats.lag) == (0, 0)


async def test_no_ledger_is_written_unless_asked():
    transport = MemoryTransport()
    await transport.produce(
        "in", [encode(feedback("p/0", "trained")), encode(feedback("p/0", "dropped", "x"))]
    )
    await Worker(Collector(), transport, run="t", block_ms=20, min_idle_ms=60_000, burst=True).serve()
    assert await entries_on(transport, "collector") == []


async def test_ledger_files_round_trip_and_the_cli_exits_non_zero_on_a_violation(tmp_path, capsys):
    transport = MemoryTransport()
    for e in clean():
        await transport.produce(ledger_edge(e.stage), [encode(e)])
    assert await ledger.write_run_dir(transport, tmp_path) == len(clean())
    assert sorted(p.name for p in (tmp_path / "ledger").iterdir()) == [
        "advantage.jsonl",
        "feeder.jsonl",
        "learner.jsonl",
        "rollout.jsonl",
    ]
    assert cli(["ledger", "check", str(tmp_path)]) == 0
    assert "ledger check: OK" in capsys.readouterr().out
    (tmp_path / "dead_letters.jsonl").write_text("")
    with (tmp_path / "ledger" / "feeder.jsonl").open("a") as f:
        f.write(
            json.dumps(
                {
                    "type": "ledger",
                    "stage": "feeder",
                    "worker": "f",
                    "outputs": [{"edge": "prompts", "type": "prompt_task", "record_id": "e0:4/0"}],
                }
            )
            + "\n"
        )
    assert cli(["ledger", "check", str(tmp_path)]) == 1
    assert "VIOLATION lost" in capsys.readouterr().out


def test_the_cli_names_a_missing_ledger(tmp_path, capsys):
    assert cli(["ledger", "check", str(tmp_path)]) == 2
    assert "run.ledger=true" in capsys.readouterr().err


def test_a_step_written_twice_by_a_retried_call_counts_once():
    entries = clean()
    audit = ledger.check(entries + [entries[0]], [])  # the feeder's release of e0:0/0, replayed verbatim
    assert audit.ok and audit.counts()["released"] == 3


# ---------------------------------------------------------------- a real run (memory transport)


@pytest.mark.e2e
async def test_a_real_memory_run_has_a_clean_ledger(tmp_path, vllm_engine, capsys):
    import uuid

    from config import load_config
    from rollstream import train

    batches = 4
    cfg = load_config(
        "configs/demo.toml",
        [
            f"run.name=ledger-mem-{uuid.uuid4().hex[:6]}",
            f"run.output_dir={json.dumps(str(tmp_path))}",
            f"run.max_steps={batches * 4}",
            "run.ledger=true",
            "rollout.max_model_len=256",
        ],
    )
    result = await train.run_pipeline(cfg, engine=vllm_engine)
    assert result.exit_code == 0
    entries, dead = ledger.read_run_dir(tmp_path)
    assert {e.stage for e in entries} == {"feeder", "rollout", "reward", "advantage", "learner"}
    audit = ledger.check(entries, dead)
    assert audit.ok, ledger.format_audit(audit)
    groups = batches * cfg.grpo.prompt_batch_size
    assert (audit.trained, audit.records_trained) == (groups, groups * cfg.grpo.num_generations)
    capsys.readouterr()
    assert cli(["ledger", "check", str(tmp_path)]) == 0
    assert "lost 0, duplicated 0" in capsys.readouterr().out


@pytest.mark.e2e
async def test_a_dead_lettered_group_entry_drops_its_group_and_the_run_finishes(
    tmp_path, vllm_engine, capsys, monkeypatch
):
    """A reward that raises for one request, under reward.on_error = "dead_letter": its group's entry is
    dead-lettered, the advantage stage drops the group (releasing its other records), the feeder replaces
    it, and the run trains every generation batch whole; the ledger and `rollstream inspect` show it."""
    import uuid

    from config import load_config
    from rollstream import train

    batches = 2
    cfg = load_config(
        "configs/demo.toml",
        [
            f"run.name=dead-letter-{uuid.uuid4().hex[:6]}",
            f"run.output_dir={json.dumps(str(tmp_path))}",
            f"run.max_steps={batches * 4}",
            "run.ledger=true",
            "rollout.max_model_len=256",
            *poison.SETTINGS,
        ],
    )
    monkeypatch.setenv(poison.POISON_ENV, poison.first_group_request(cfg))
    result = await train.run_pipeline(cfg, engine=vllm_engine)
    assert result.exit_code == 0
    entries, dead = ledger.read_run_dir(tmp_path)
    audit = ledger.check(entries, dead)
    assert audit.ok, ledger.format_audit(audit)
    groups = batches * cfg.grpo.prompt_batch_size
    assert (audit.trained, audit.records_trained) == (groups, groups * cfg.grpo.num_generations)
    assert audit.dropped.get("dead_letter") == 1 and audit.released == groups + sum(audit.dropped.values())
    # The dropped group is the poisoned request's, and the drop reached the learner's metrics.
    [poisoned] = dead
    assert poisoned == poison.dead_entry(poison.first_group_request(cfg))  # its group's entry
    drops = [o.record_id for e in entries for o in e.outputs if o.reason == "dead_letter"]
    assert [ledger.group_of(d) for d in drops] == [ledger.group_of(poisoned)]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sum(row.get("dropped/dead_letter", 0) for row in rows) == 1
    capsys.readouterr()
    assert cli(["ledger", "check", str(tmp_path)]) == 0
    assert "dead_letter 1" in capsys.readouterr().out
    # `rollstream inspect` lists it, with the reward's error as its reason.
    from rollstream import inspect_run

    [letter] = inspect_run.from_run_dir(tmp_path)["dead_letters"]
    assert (letter["record_id"], letter["edge"], letter["stage"]) == (poisoned, "trajectories", "reward")
    assert "poisoned request" in letter["error"] and letter["record"] == f"TrajectoryGroup {poisoned}"
    assert cli(["inspect", str(tmp_path)]) == 0
    assert "1 dead letters" in capsys.readouterr().out

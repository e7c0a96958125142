"""The reward stage: kwargs, per-request scoring, NaN-aware weights, failure policy on both transports,
executors (the event loop never blocks), and two workers sharing one Redis stream."""

from __future__ import annotations

import asyncio
import math
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import msgspec
import pytest
from fake_context import FakeContext

from config import config_from_dict
from pipeline import metrics
from pipeline.errors import UserError
from pipeline.records import (
    Feedback,
    GroupClosed,
    ScoredGroup,
    ScoredTrajectory,
    Trajectory,
    TrajectoryGroup,
    decode,
    encode,
    pack_f32,
    pack_i32,
)
from pipeline.stage import FatalStageError
from pipeline.transport import connect
from pipeline.transport.memory import MemoryTransport
from pipeline.worker import Worker
from rewards import orms
from rewards.scoring import (
    RewardFunctionError,
    conversational,
    response_token_ids,
    reward_kwargs,
    weighted_total,
)
from schedulers import MultiTurnScheduler, RolloutOutput
from schedulers.results import run_results, trajectory_parts
from stages import FEEDBACK, SCORED, TRAJECTORIES
from stages.advantage import Advantage
from stages.reward import Reward
from tests.test_schedulers import AskAgain, engine_for, run_scheduler


def traj(prompt: int, request: int, completion: str = "4", turn: int = 0, **data) -> Trajectory:
    return Trajectory(
        prompt_id=f"e0:{prompt}",
        attempt=0,
        request_id=f"e0:{prompt}/0/{request}",
        turn=turn,
        generation_batch=0,
        prompt_ids=pack_i32([1, 2, 3]),
        completion_ids=pack_i32(range(len(completion))),
        logprobs=pack_f32([-0.1] * len(completion)),
        messages=[{"role": "user", "content": f"q{prompt}"}],
        completion=completion,
        finish_reason="length" if turn == 9 else "stop",
        data_dict={"solution": "4", **data},
        rollout_infos={"turn": turn},
        policy_version=0,
        max_policy_version=0,
    )


def manifest(prompt: int, records: list[Trajectory]) -> GroupClosed:
    return GroupClosed(prompt_id=f"e0:{prompt}", attempt=0, generation_batch=0, record_ids=[t.record_id for t in records])


def group_of(records: list[Trajectory]) -> TrajectoryGroup:
    """Records of one prompt as the rollout sends them: one TrajectoryGroup entry."""
    return TrajectoryGroup(manifest=GroupClosed(prompt_id=records[0].prompt_id, attempt=0, generation_batch=0,
                                                record_ids=[t.record_id for t in records]), trajectories=records)


def scored_records(entries: list) -> list[ScoredTrajectory]:
    """The scored records of the stage's ScoredGroup answers."""
    assert all(isinstance(e, ScoredGroup) for e in entries), [type(e).__name__ for e in entries]
    return [r for e in entries for r in e.records]


def _group(prompt: int, n: int = 2, **data) -> TrajectoryGroup:
    """``n`` requests of one prompt in one entry (``data``: dataset columns, e.g. misbehave's ``mode``)."""
    return group_of([traj(prompt, r, f"c{r}", **data) for r in range(n)])


async def score_alone(stage: Reward, record: Trajectory) -> ScoredTrajectory:
    """One record scored as a group of its own."""
    [(edge, whole)] = (await stage.handle(group_of([record]), FakeContext(stage='reward'))).outputs
    assert edge == SCORED
    [scored] = whole.records
    return scored


def make_cfg(funcs, run=None, **reward):
    return config_from_dict({"run": {"name": run or f"rw-{uuid.uuid4().hex[:8]}"}, "reward": {"reward_funcs": funcs, **reward}})


class Recorder:
    """Records every call's kwargs; scores 1.0."""

    def __init__(self):
        self.calls = []

    def __call__(self, completions, **kwargs):
        self.calls.append((completions, kwargs))
        return [1.0] * len(completions)


# ---------------------------------------------------------------- kwargs and totals


async def test_kwargs_hold_columns_conversation_and_request_data(monkeypatch):
    recorder = Recorder()
    monkeypatch.setitem(orms, "recorder", recorder)
    stage = Reward(make_cfg(["recorder"]))
    t = traj(1, 0, "4", extra=7)
    scored = await score_alone(stage, t)
    [(completions, kw)] = recorder.calls
    assert completions == ["4"]
    assert kw["solution"] == ["4"] and kw["extra"] == [7]
    assert kw["messages"] == [[{"role": "user", "content": "q1"}, {"role": "assistant", "content": "4"}]]
    assert kw["is_truncated"] == [False]
    assert kw["prompt_id"] == ["e0:1"] and kw["request_id"] == ["e0:1/0/0"]
    assert kw["completion_ids"] == [[0]]
    assert kw["rollout_infos"] == kw["multi_turn_infos"] == [{"turn": 0}]
    # ms-swift's trajectory_inputs: {request_id: [row per record]}, rows with the columns and request data
    [row] = kw["trajectory_inputs"]["e0:1/0/0"]
    assert row["record_id"] == "e0:1/0/0/0" and row["solution"] == "4" and row["extra"] == 7
    assert row["response_token_ids"] == [0] and row["finish_reason"] == "stop" and row["is_truncated"] is False
    assert kw["response_token_ids"] == [[0]] and kw["finish_reason"] == ["stop"] and kw["prompts"] == ["q1"]
    assert (kw["trainer_state"].global_step, kw["trainer_state"].epoch) == (0, 0.0)
    assert scored.reward == 1.0 and scored.rewards == {"recorder": 1.0} and not scored.failed
    await stage.close()


def test_weighted_total_skips_none_and_nan():
    weights = {"a": 2.0, "b": 0.5, "c": 1.0}
    assert weighted_total({"a": 1.0, "b": None, "c": math.nan}, weights) == 2.0
    assert weighted_total({"a": 0.5, "b": 4.0, "c": -1.0}, weights) == 2.0
    assert weighted_total({"a": None, "b": None, "c": None}, weights) == 0.0


async def test_weights_apply_and_nan_counts_as_not_applicable(monkeypatch):
    monkeypatch.setitem(orms, "half", lambda completions, **kw: [0.5] * len(completions))
    monkeypatch.setitem(orms, "nan", lambda completions, **kw: [math.nan] * len(completions))
    stage = Reward(make_cfg(["half", "nan", "accuracy"], reward_weights=[2.0, 3.0, 0.25]))
    scored = await score_alone(stage, traj(1, 0, "4"))
    assert scored.rewards == {"half": 0.5, "nan": None, "accuracy": 1.0}
    assert scored.reward == 2.0 * 0.5 + 0.25 * 1.0
    await stage.close()


async def test_a_split_request_is_scored_once_and_its_total_broadcast(monkeypatch):
    """A multi-turn group arrives as one TrajectoryGroup: each request is scored once, its total broadcast."""
    lengths = {}

    def by_turns(completions, trajectory_inputs, request_id, **kwargs):
        lengths.update({r: len(trajectory_inputs[r]) for r in request_id})
        return [float(len(trajectory_inputs[r])) for r in request_id]

    monkeypatch.setitem(orms, "by_turns", by_turns)
    cfg = config_from_dict({"reward": {"reward_funcs": ["by_turns"]}})
    stage = Reward(cfg)
    split = [traj(1, 0, "a", turn=0), traj(1, 0, "b", turn=1)]
    single = [traj(1, 1, "c")]
    group = manifest(1, split + single)
    final = await stage.handle(TrajectoryGroup(manifest=group, trajectories=[split[1], single[0], split[0]]), FakeContext(stage='reward'))
    assert not final.hold and final.release == []
    assert lengths == {"e0:1/0/0": 2, "e0:1/0/1": 1}  # one call, each request once
    [(edge, whole)] = final.outputs  # the group goes on whole, as one entry, with its manifest
    assert edge == SCORED and isinstance(whole, ScoredGroup) and whole.manifest == group
    scored = {s.record_id: s for s in whole.records}
    assert {rid: s.reward for rid, s in scored.items()} == {"e0:1/0/0/0": 2.0, "e0:1/0/0/1": 2.0, "e0:1/0/1/0": 1.0}
    # completions/messages are the request's last turn
    completions, kw = reward_kwargs([split, single])
    assert completions == ["b", "c"] and kw["messages"][0][-1]["content"] == "b"
    await stage.close()


# ---------------------------------------------------------------- failure policy, on both transports

RELEASE = threading.Event()  # lets hung reward threads finish when the module's tests are done


@pytest.fixture(autouse=True, scope="module")
def release_hung_threads():
    yield
    RELEASE.set()


def misbehave(completions, mode, **kwargs):
    """1.0, except for rows whose ``mode`` column says how to fail."""
    out = []
    for m in mode:
        if m == "raise":
            raise RuntimeError("reward bug")
        if m == "hang":
            RELEASE.wait()
        out.append({"none": None, "nan": math.nan}.get(m, 1.0))
    return out


@pytest.fixture(params=["memory", "redis"])
async def transport(request):
    run = f"rw-{uuid.uuid4().hex[:10]}"
    url = request.getfixturevalue("redis_url") if request.param == "redis" else "redis://127.0.0.1:6379/0"
    t = await connect(request.param, run=run, url=url)
    yield t
    if request.param == "redis":
        await t.delete_run()
    await t.close()


async def drain(transport, edge):
    out = []
    while batch := await transport.consume(edge, "check", "c", 100, 10):
        out += [decode(d.payload) for d in batch]
        await transport.ack(edge, "check", [d.id for d in batch])
    return out


def counter(metric, *labels):
    return metric.labels(*labels)._value.get()


@pytest.mark.parametrize("mode", ["raise", "hang", "none", "nan"])
@pytest.mark.parametrize("on_error", ["zero", "drop_group", "dead_letter"])
async def test_failure_policy(transport, mode, on_error, monkeypatch):
    monkeypatch.setitem(orms, "misbehave", misbehave)
    # 1 s: long enough that a healthy call on a loaded machine never times out (a timed-out good call is retried)
    # batch_groups 1: each group in its own call, so the good one's calls are its own
    cfg = make_cfg(["misbehave"], timeout_s=1.0, max_retries=1, on_error=on_error, batch_groups=1)
    bad, good = traj(1, 0, "x", mode=mode), traj(2, 1, "y", mode="ok")
    await transport.produce(TRAJECTORIES, [encode(group_of([bad])), encode(group_of([good]))])
    stage = Reward(cfg)
    worker = Worker(stage, transport, run=cfg.run.name, burst=True, block_ms=20, retry_backoff_s=0.001)
    assert await worker.serve() == 0
    out = {r.record_id: r for r in scored_records(await drain(transport, SCORED))}
    dead = await drain(transport, "dead")
    assert out[good.record_id].reward == 1.0 and not out[good.record_id].failed
    labels = (cfg.run.name, "reward", worker.worker_id)
    calls = counter(metrics.REWARD_CALLS, *labels, "misbehave")
    if mode in ("raise", "hang"):  # 1 + max_retries attempts for the bad record, 1 for the good one
        assert calls == 3 and counter(metrics.REWARD_ERRORS, *labels, "misbehave") == 2
        assert counter(metrics.REWARD_TIMEOUTS, *labels, "misbehave") == (2 if mode == "hang" else 0)
    else:  # None/NaN is an answer, not an error: no retry
        assert calls == 2 and counter(metrics.REWARD_ERRORS, *labels, "misbehave") == 0
    reason = {"raise": "raised RuntimeError: reward bug", "hang": "timed out after 1.0 s"}.get(
        mode, "every reward function returned None/NaN"
    )
    assert counter(metrics.REWARD_FAILED, *labels, on_error) == 1
    if on_error == "zero":
        assert out[bad.record_id].reward == 0.0 and not out[bad.record_id].failed and not dead
    elif on_error == "drop_group":
        assert reason in out[bad.record_id].failed and not dead
    else:
        assert bad.record_id not in out
        [letter] = dead
        assert reason in letter.error and decode(letter.payload) == group_of([bad])  # its group, whole
        if mode in ("raise", "hang"):  # the worker's own retries reuse the failure, never call again
            assert calls == 3


async def test_drop_group_makes_the_advantage_stage_drop_and_resample(monkeypatch):
    monkeypatch.setitem(orms, "misbehave", misbehave)
    cfg = make_cfg(["misbehave"], max_retries=0, on_error="drop_group")
    bad, good = traj(2, 0, "x", mode="raise"), traj(2, 1, "y", mode="ok")
    stage, advantage = Reward(cfg), Advantage(cfg)
    outputs = []
    outputs += (await stage.handle(group_of([bad, good]), FakeContext(stage='reward'))).outputs
    handled = [await advantage.handle(r, FakeContext(stage='reward')) for _, r in outputs]
    [(edge, feedback)] = handled[-1].outputs
    assert edge == FEEDBACK and isinstance(feedback, Feedback)
    assert (feedback.outcome, feedback.reason) == ("dropped", "reward_error")
    await stage.close()


# ---------------------------------------------------------------- executors: the loop never blocks


async def test_a_hanging_sync_reward_never_blocks_the_loop_and_other_groups_flow(monkeypatch):
    monkeypatch.setitem(orms, "misbehave", misbehave)
    # batch_groups 1: the hung call holds its own group only (batching is tested on its own)
    cfg = make_cfg(["misbehave"], timeout_s=1.5, max_retries=0, on_error="zero", batch_groups=1)
    transport = await connect("memory", run=cfg.run.name)
    hung = traj(0, 0, "x", mode="hang")
    good = [traj(p, r, "y", mode="ok") for p in range(1, 11) for r in range(2)]
    groups = [group_of([hung])] + [group_of(good[i : i + 2]) for i in range(0, len(good), 2)]
    await transport.produce(TRAJECTORIES, [encode(g) for g in groups])
    worker = Worker(Reward(cfg), transport, run=cfg.run.name, block_ms=20)
    serving = asyncio.create_task(worker.serve())
    lags, ticking = [], True

    async def ticker():
        while ticking:
            before = time.perf_counter()
            await asyncio.sleep(0.005)  # the probe: how late does a 5 ms sleep wake up?
            lags.append(time.perf_counter() - before - 0.005)

    probe = asyncio.create_task(ticker())
    started = time.monotonic()
    scored: list = []
    while len(scored) < len(good):  # every other record is scored while the hung call is still waiting
        assert time.monotonic() - started < 1.4, f"only {len(scored)} of {len(good)} scored"
        scored += scored_records(await drain(transport, SCORED))
    while not any(s.record_id == hung.record_id for s in scored):
        assert time.monotonic() - started < 10, "the hung record was never scored"
        scored += scored_records(await drain(transport, SCORED))
    ticking = False
    await probe
    worker.request_stop("test done")
    await serving
    assert {s.record_id: s.reward for s in scored}[hung.record_id] == 0.0
    p99 = statistics.quantiles(lags, n=100)[98]
    assert p99 < 0.050 and max(lags) < 0.250, f"loop lag p99 {p99 * 1000:.1f} ms, max {max(lags) * 1000:.1f} ms"


async def test_process_executor_kills_a_hanging_reward_and_keeps_serving(tmp_path):
    plugin = tmp_path / "slow_plugin.py"
    plugin.write_text(
        "import os, time\nfrom rewards import orms\n"
        "def sleepy(completions, mode, **kw):\n"
        "    if 'hang' in mode:\n        time.sleep(3600)\n"
        "    return [float(os.getpid()) for _ in completions]\n"
        "orms['sleepy'] = sleepy\n"
    )
    from pipeline.plugins import load_plugins

    load_plugins([str(plugin)])
    cfg = config_from_dict(
        {
            "run": {"external_plugins": [str(plugin)]},
            "reward": {"reward_funcs": ["sleepy"], "executor": "processes", "executor_workers": 1,
                       "timeout_s": 1.0, "max_retries": 0},
        }
    )
    stage = Reward(cfg)
    await stage.start(FakeContext(stage='reward'))
    try:
        first = await score_alone(stage, traj(1, 0, mode="ok"))
        hung = await score_alone(stage, traj(2, 1, mode="hang"))
        after = await score_alone(stage, traj(3, 2, mode="ok"))
    finally:
        await stage.close()
    pid = first.rewards["sleepy"]
    assert pid > 0 and pid != float(__import__("os").getpid())  # it ran in a pool process
    assert hung.reward == 0.0  # on_error = zero
    assert after.rewards["sleepy"] > 0 and after.rewards["sleepy"] != pid  # the hung process was replaced


# ---------------------------------------------------------------- scale-out on Redis


async def score_on_two_redis_workers(cfg, redis_url, inputs):
    """Two reward workers (burst) on one Redis stream holding ``inputs``: (what reached SCORED, workers)."""
    transports = [await connect("redis", run=cfg.run.name, url=redis_url) for _ in range(2)]
    await transports[0].produce(TRAJECTORIES, [encode(r) for r in inputs])
    workers = [
        Worker(Reward(cfg), t, run=cfg.run.name, worker_id=f"reward-{i}", burst=True, block_ms=50)
        for i, t in enumerate(transports)
    ]
    try:
        assert await asyncio.gather(*(w.serve() for w in workers)) == [0, 0]
        return await drain(transports[0], SCORED), workers
    finally:
        await transports[0].delete_run()
        for t in transports:
            await t.close()


async def test_two_workers_on_one_redis_stream_score_every_trajectory_exactly_once(redis_url, monkeypatch):
    requests_seen = Counter()

    def ledger(completions, request_id, **kwargs):
        time.sleep(0.002)  # some work, so both workers take a share
        requests_seen.update(request_id)
        return [1.0] * len(completions)

    monkeypatch.setitem(orms, "ledger", ledger)
    cfg = make_cfg(["ledger"])
    entries = [group_of([traj(p, r) for r in range(3)]) for p in range(40)]
    random.Random(0).shuffle(entries)
    out, workers = await score_on_two_redis_workers(cfg, redis_url, entries)
    by_id = Counter(r.record_id for r in scored_records(out))
    assert set(by_id) == {t.record_id for e in entries for t in e.trajectories} and set(by_id.values()) == {1}
    assert len(requests_seen) == 120 and set(requests_seen.values()) == {1}
    shares = [counter(metrics.RECORDS_ACKED, cfg.run.name, "reward", w.worker_id, TRAJECTORIES) for w in workers]
    assert sum(shares) == len(entries) and min(shares) > 0, shares



async def test_dead_letter_of_a_group_entry_sends_the_whole_group_to_the_dead_edge(monkeypatch):
    """Under dead_letter a failing TrajectoryGroup is one input: the worker dead-letters it whole."""
    monkeypatch.setitem(orms, "misbehave", misbehave)
    cfg = config_from_dict({"reward": {"reward_funcs": ["misbehave"], "max_retries": 0, "on_error": "dead_letter"}})
    transport = MemoryTransport()
    bad, good = traj(3, 0, "x", mode="raise"), traj(3, 1, "y", mode="ok")
    entry = TrajectoryGroup(manifest=manifest(3, [bad, good]), trajectories=[bad, good])
    await transport.produce(TRAJECTORIES, [encode(entry)])
    stage = Reward(cfg)
    worker = Worker(stage, transport, run=cfg.run.name, block_ms=20, min_idle_ms=60_000, burst=True,
                    retry_backoff_s=0.001)
    assert await worker.serve() == 0
    [letter] = [decode(d.payload) for d in await transport.read("dead", "0", 10, 0)]
    assert decode(letter.payload) == entry and "raised RuntimeError: reward bug" in letter.error
    assert (await transport.stats(SCORED)).length == 0  # nothing of the group was scored
    await stage.close()


async def test_two_workers_score_split_requests_whole_from_group_entries(redis_url, monkeypatch):
    """Multi-turn groups (each request split into two records) as TrajectoryGroup entries on one Redis
    stream with two workers: every request scored once, with both its records, every record once."""
    requests_seen = Counter()

    def whole_request(completions, request_id, trajectory_inputs, **kwargs):
        time.sleep(0.002)
        requests_seen.update(request_id)
        return [float(len(trajectory_inputs[r])) for r in request_id]  # 2.0 only if both turns met

    monkeypatch.setitem(orms, "whole_request", whole_request)
    cfg = make_cfg(["whole_request"])
    entries = []
    for p in range(30):
        records = [traj(p, r, turn=turn) for r in range(3) for turn in (1, 2)]
        entries.append(TrajectoryGroup(manifest=manifest(p, records), trajectories=records))
    out, _ = await score_on_two_redis_workers(cfg, redis_url, entries)
    scored = [s for r in out if isinstance(r, ScoredGroup) for s in r.records]
    assert Counter(r.record_id for r in scored) == Counter(t.record_id for e in entries for t in e.trajectories)
    assert {r.reward for r in scored} == {2.0}  # both records of every request scored together
    assert len(requests_seen) == 90 and set(requests_seen.values()) == {1}
    assert sorted(r.manifest.prompt_id for r in out) == sorted(e.manifest.prompt_id for e in entries)  # whole groups


# ---------------------------------------------------------------- batches of groups (reward.batch_groups)


async def run_reward_worker(cfg, entries: list) -> tuple[list, list, Reward]:
    """One reward worker (burst) over ``entries`` on a memory transport: (SCORED records, dead letters, stage)."""
    transport = MemoryTransport()
    await transport.produce(TRAJECTORIES, [encode(e) for e in entries])
    stage = Reward(cfg)
    worker = Worker(stage, transport, run=cfg.run.name, block_ms=20, min_idle_ms=60_000, burst=True,
                    retry_backoff_s=0.001)
    assert await worker.serve() == 0
    scored = [decode(d.payload) for d in await transport.read(SCORED, "0", 1000, 0)]
    dead = [decode(d.payload) for d in await transport.read("dead", "0", 1000, 0)]
    await stage.close()
    return scored, dead, stage


async def test_a_reward_is_called_once_per_batch_of_the_groups_a_worker_holds(monkeypatch):
    """As ms-swift and TRL call a reward once per local batch: 20 groups waiting, batch_groups = 8, so each
    call scores up to 8 groups' completions (never more), every group comes out whole, once."""
    calls: list[int] = []

    def counted(completions, request_id, **kwargs):
        calls.append(len({r.rsplit("/", 1)[0] for r in request_id}))  # groups in this call
        return [1.0] * len(completions)

    monkeypatch.setitem(orms, "counted", counted)
    cfg = config_from_dict({"reward": {"reward_funcs": ["counted"], "batch_groups": 8}})
    entries = [_group(p, n=4) for p in range(20)]
    scored, dead, stage = await run_reward_worker(cfg, entries)
    assert not dead and sum(calls) == 20 and max(calls) == 8 and len(calls) <= 5, calls
    assert stage.batcher.batch_sizes == calls
    assert sorted(r.manifest.prompt_id for r in scored) == sorted(e.manifest.prompt_id for e in entries)
    for r in scored:
        assert [s.record_id for s in r.records] == r.manifest.record_ids  # whole, in the manifest's order

    # batch_groups = 1: a call per group, as before
    calls.clear()
    cfg1 = config_from_dict({"reward": {"reward_funcs": ["counted"], "batch_groups": 1}})
    scored, dead, _ = await run_reward_worker(cfg1, entries[:5])
    assert calls == [1] * 5 and len(scored) == 5


async def test_a_failed_batch_is_scored_group_by_group_so_only_the_bad_group_fails(monkeypatch):
    """dead_letter: a batched call that raises is retried group by group, so the one group whose request
    raises is dead-lettered and the other groups of its batch are scored."""
    monkeypatch.setitem(orms, "misbehave", misbehave)
    cfg = config_from_dict({"reward": {"reward_funcs": ["misbehave"], "max_retries": 0, "on_error": "dead_letter",
                                       "batch_groups": 8}})
    bad = _group(3, mode="raise")
    entries = [_group(p, mode="ok") for p in range(5)] + [bad] + [_group(p, mode="ok") for p in range(6, 9)]
    scored, dead, stage = await run_reward_worker(cfg, entries)
    assert max(stage.batcher.batch_sizes) > 1  # the bad group did share a batch
    assert [decode(letter.payload) for letter in dead] == [bad]
    assert sorted(r.manifest.prompt_id for r in scored) == sorted(e.manifest.prompt_id for e in entries if e is not bad)


async def test_under_zero_a_failed_batch_zeroes_only_the_bad_group_and_does_not_stop_the_run(monkeypatch):
    """on_error = "zero" (the default): one raising call in a batch of 9 groups scores the bad group 0 with its
    error, the other 8 keep their scores, and it counts once towards run.max_consecutive_errors (3): the
    batched call used to zero every group of it and count each, so one bad request stopped the run."""
    monkeypatch.setitem(orms, "misbehave", misbehave)
    cfg = config_from_dict({"reward": {"reward_funcs": ["misbehave"], "max_retries": 0, "on_error": "zero",
                                       "batch_groups": 8}})
    bad = _group(3, mode="raise")
    entries = [_group(p, mode="ok") for p in range(3)] + [bad] + [_group(p, mode="ok") for p in range(4, 9)]
    scored, dead, stage = await run_reward_worker(cfg, entries)  # serve() == 0: the run goes on
    assert max(stage.batcher.batch_sizes) > 3 and not dead  # the bad group shared a batch of > 3 groups
    by_prompt = {g.manifest.prompt_id: g.records for g in scored}
    assert sorted(by_prompt) == sorted(e.manifest.prompt_id for e in entries)
    assert all(r.reward == 0.0 and "reward bug" in r.reward_errors["misbehave"] for r in by_prompt["e0:3"])
    assert all(r.reward == 1.0 and not r.reward_errors for p, rs in by_prompt.items() if p != "e0:3" for r in rs)


async def test_a_batched_call_that_fails_once_is_printed_though_each_group_then_succeeds(monkeypatch):
    """A function that raises on its first call only, over a batch of groups: each group is scored again on its
    own and succeeds, so no group carries the error, and the failure is still printed once (it once passed
    unseen: not printed, not counted)."""
    calls = Counter()

    def fails_first(completions, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyError("first call has no 'answer' column")
        return [1.0] * len(completions)

    monkeypatch.setitem(orms, "fails_first", fails_first)
    cfg = config_from_dict({"reward": {"reward_funcs": ["fails_first"], "max_retries": 0, "batch_groups": 8}})
    notices: list[str] = []
    stage = Reward(cfg)
    stage.scorer.announce = notices.append
    entries = [_group(p, mode="ok") for p in range(6)]
    transport = MemoryTransport()
    await transport.produce(TRAJECTORIES, [encode(e) for e in entries])
    worker = Worker(stage, transport, run=cfg.run.name, block_ms=20, min_idle_ms=60_000, burst=True)
    assert await worker.serve() == 0
    scored = [decode(d.payload) for d in await transport.read(SCORED, "0", 1000, 0)]
    await stage.close()
    assert stage.batcher.batch_sizes[0] > 1  # the first call was over a batch
    assert sorted(g.manifest.prompt_id for g in scored) == sorted(e.manifest.prompt_id for e in entries)
    assert all(r.reward == 1.0 and not r.reward_errors for g in scored for r in g.records)
    assert len(notices) == 1 and "KeyError" in notices[0] and "each group is scored again on its own" in notices[0]


# ---------------------------------------------------------------- ms-swift / TRL call forms, logs, loud failures


def _scored(handled) -> list[ScoredTrajectory]:
    return scored_records([r for _, r in handled.outputs])


async def test_trl_signatures_get_completions_by_keyword_and_conversational_ones_get_messages(monkeypatch):
    seen = {}

    def trl_full(prompts, completions, completion_ids, **kwargs):
        seen["full"] = (prompts, completions, completion_ids)
        return [1.0] * len(completions)

    def trl_ids_first(completion_ids, **kwargs):  # TRL's docs example 1: `completions` only in kwargs
        seen["ids_first"] = (completion_ids, kwargs["completions"])
        return [1.0] * len(completion_ids)

    def swift_positional(comps, solution, **kwargs):  # ms-swift passes completions first
        seen["positional"] = comps
        return [1.0] * len(comps)

    @conversational
    def trl_conversational(completions, prompts, **kwargs):
        seen["conversational"] = (completions, prompts)
        return [1.0] * len(completions)

    for f in (trl_full, trl_ids_first, swift_positional, trl_conversational):
        monkeypatch.setitem(orms, f.__name__, f)
    stage = Reward(make_cfg(["trl_full", "trl_ids_first", "swift_positional", "trl_conversational"]))
    scored = _scored(await stage.handle(_group(3), FakeContext(stage='reward')))
    assert [s.reward for s in scored] == [4.0, 4.0]
    assert seen["full"] == (["q3", "q3"], ["c0", "c1"], [[0, 1], [0, 1]])
    assert seen["ids_first"] == ([[0, 1], [0, 1]], ["c0", "c1"]) and seen["positional"] == ["c0", "c1"]
    completions, prompts = seen["conversational"]
    assert completions == [[{"role": "assistant", "content": "c0"}], [{"role": "assistant", "content": "c1"}]]
    assert prompts == [[{"role": "user", "content": "q3"}]] * 2
    await stage.close()


async def test_log_extra_and_log_metric_travel_with_the_scored_records(monkeypatch):
    def logging_reward(completions, solution, log_extra, log_metric, **kwargs):
        log_extra("golden", list(solution))
        log_extra("length", [len(c) for c in completions])
        log_metric("probe", 0.5)
        log_metric("probe", 1.5)
        return [1.0] * len(completions)

    def bad_column(completions, log_extra, **kwargs):
        log_extra("reward", [0.0] * len(completions))  # a column completions.jsonl already has
        return [1.0] * len(completions)

    monkeypatch.setitem(orms, "logging_reward", logging_reward)
    monkeypatch.setitem(orms, "bad_column", bad_column)
    notices = []
    stage = Reward(make_cfg(["logging_reward", "bad_column"], max_retries=0))
    stage.scorer.announce = notices.append
    scored = _scored(await stage.handle(_group(4), FakeContext(stage='reward')))
    assert [s.logged_extra for s in scored] == [{"golden": "4", "length": 2}] * 2
    assert [s.logged_metrics for s in scored] == [{"probe": 1.0}] * 2
    assert all(set(s.reward_errors) == {"bad_column"} and "completions.jsonl" in s.reward_errors["bad_column"]
               for s in scored)
    [notice] = notices
    assert "reward 'bad_column' raised ValueError" in notice and "rewards/bad_column/failures" in notice
    assert decode(encode(scored[0])) == scored[0]  # it travels
    await stage.close()


async def test_a_first_failure_is_announced_once_and_the_same_error_on_n_groups_stops_the_run(monkeypatch):
    calls = Counter()

    def flaky(completions, **kwargs):
        calls["n"] += 1
        if calls["n"] != 3:  # fails on groups 1, 2, (3 succeeds), 4, 5, 6
            raise KeyError("no answer")
        return [1.0] * len(completions)

    monkeypatch.setitem(orms, "flaky", flaky)
    cfg = config_from_dict({"run": {"max_consecutive_errors": 3},
                            "reward": {"reward_funcs": ["flaky"], "max_retries": 0}})
    notices = []
    stage = Reward(cfg)
    stage.scorer.announce = notices.append
    for prompt in (1, 2, 3, 4, 5):  # a success in between resets the count
        await stage.handle(_group(prompt), FakeContext(stage='reward'))
    with pytest.raises(RewardFunctionError, match=r"reward 'flaky' failed on 3 consecutive groups .*KeyError") as info:
        await stage.handle(_group(6), FakeContext(stage='reward'))
    assert isinstance(info.value, FatalStageError) and isinstance(info.value, UserError)  # stops the run, exit 2
    assert len(notices) == 1 and "KeyError" in notices[0] and "'flaky'" in notices[0]
    await stage.close()


def test_a_hung_sync_reward_never_keeps_the_process_alive(tmp_path):
    """The reward thread is a daemon: the interpreter exits although the call sleeps for an hour
    (concurrent.futures' pool would join it at exit)."""
    script = tmp_path / "hang.py"
    script.write_text(
        "import asyncio, time\n"
        "from config import config_from_dict\n"
        "from pipeline.records import Trajectory, pack_f32, pack_i32\n"
        "from rewards import orms\n"
        "from rewards.scoring import RewardScorer\n"
        "orms['sleeper'] = lambda completions, **kw: time.sleep(3600)\n"
        "t = Trajectory(prompt_id='e0:0', attempt=0, request_id='e0:0/0/0', generation_batch=0,\n"
        "    prompt_ids=pack_i32([1]), completion_ids=pack_i32([2]), logprobs=pack_f32([0.0]),\n"
        "    policy_version=0, max_policy_version=0)\n"
        "async def main():\n"
        "    scorer = RewardScorer(config_from_dict({'reward': {'reward_funcs': ['sleeper'], 'timeout_s': 0.2,\n"
        "                                                       'max_retries': 0}}), announce=print)\n"
        "    [scored] = await scorer.score_requests([[t]])\n"
        "    await scorer.close()\n"
        "    print('scored', scored.reward)\n"
        "asyncio.run(main())\n"
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(script)], cwd=root, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(root)}, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "scored 0.0" in done.stdout and "timed out after 0.2 s" in done.stdout


# ---------------------------------------------------------------- response_token_ids: the rollout's message spans


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def scheduled_record(result, engine, loss_scale: str) -> Trajectory:
    """The record the rollout makes of one scheduler result (through the wire, as the reward stage gets it)."""
    parts = trajectory_parts(result, engine, loss_scale=loss_scale, scheduler="t", index=0,
                             default_versions=(0, 0), default_messages=[])
    record = Trajectory(prompt_id="e0:1", attempt=0, request_id="e0:1/0/0", generation_batch=0,
                        **parts.record_fields())
    return decode(encode(record))


class ContinueThenAsk(MultiTurnScheduler):
    """Turn 1's message is continued (an inserted tip), then a new user turn: two assistant messages."""

    def step(self, infer_request, response_choice, current_turn):
        if current_turn == 1:
            infer_request.messages[-1]["content"] += " wait,"
        else:
            infer_request.messages.append({"role": "user", "content": "again"})
        return {"infer_request": infer_request}


class OwnMask(MultiTurnScheduler):
    """A scheduler's own response_loss_mask: the first reply is not trained (mask 0 throughout)."""

    def step(self, infer_request, response_choice, current_turn):
        ids = list(response_choice.token_ids)
        infer_request.messages.append({"role": "user", "content": "again"})
        return {"infer_request": infer_request, "response_token_ids": ids, "response_loss_mask": [0] * len(ids),
                "rollout_logprobs": []}


class TwoTurnsOutput(MultiTurnScheduler):
    """An overriding run returning one ms-swift RolloutOutput with two assistant messages."""

    async def run(self, infer_request, request_config, **kwargs):
        ids = []
        for turn in (1, 2):
            response = await self.infer_engine.infer_async(infer_request, request_config)
            infer_request.messages.append({"role": "assistant", "content": response.choices[0].message.content})
            ids.append(list(response.choices[0].token_ids))
            if turn == 1:
                infer_request.messages.append({"role": "user", "content": "again"})
        return RolloutOutput(response=response, messages=infer_request.messages, response_token_ids=ids,
                             rollout_logprobs=[[-0.1] * len(r) for r in ids])


@pytest.mark.parametrize("loss_scale", ["default", "last_round"])
async def test_response_token_ids_hold_each_assistant_message_exactly(tokenizer, loss_scale):
    """ms-swift's response_token_ids with a scheduler: one list per assistant message after the prompt (a
    continued message is one list, its inserted tokens included; the template's turn markers and an
    inserted user message in none), under every loss_scale and a scheduler's own loss mask."""
    eos = tokenizer.eos_token_id

    def reply(text):
        return [*tokenizer.encode(text, add_special_tokens=False), eos]

    def wait():
        return tokenizer.encode(" wait,", add_special_tokens=False)

    q = [{"role": "user", "content": "q"}]
    cases = [
        (AskAgain(max_turns=3), ["12", "13", "14"], [reply("12"), reply("13"), reply("14")]),
        (ContinueThenAsk(max_turns=3), ["12", "13", "14"], [reply("12")[:-1] + wait() + reply("13"), reply("14")]),
        (OwnMask(max_turns=2), ["12", "13"], [reply("12"), reply("13")]),
        (TwoTurnsOutput(), ["12", "13"], [reply("12"), reply("13")]),
    ]
    for scheduler, replies, expected in cases:
        engine = engine_for(tokenizer, replies)
        [result] = run_results(await run_scheduler(scheduler, engine, list(q)), scheduler.name, "r0")
        t = scheduled_record(result, engine, loss_scale)
        assert len(t.message_spans) == len(expected), scheduler.name
        completions, kw = reward_kwargs([[t]])
        assert kw["response_token_ids"] == [expected], scheduler.name
        assert kw["completion_ids"] == [expected[-1]] and completions == [replies[-1]]
        [row] = kw["trajectory_inputs"]["e0:1/0/0"]
        assert row["response_token_ids"] == expected
    # a record written before message_spans: rebuilt from the loss mask, one list where it cannot tell
    engine = engine_for(tokenizer, ["12", "13"])
    [result] = await run_scheduler(AskAgain(max_turns=2), engine, list(q))
    old = msgspec.structs.replace(scheduled_record(result, engine, loss_scale), message_spans=[])
    rebuilt = response_token_ids(old)
    if loss_scale == "last_round":
        assert rebuilt == [old.completion_token_ids().tolist()]
    else:
        assert rebuilt == [reply("12"), reply("13")]


async def test_process_executor_builds_a_tokenizer_reward_for_a_built_in_model_name(tmp_path, tiny_model_dir,
                                                                                   tokenizer):
    """model.model = "tiny" (a built-in name, not a directory): a pool process is handed the run's resolved
    model directory, so a reward class declaring `tokenizer` builds there too."""
    plugin = tmp_path / "tokenizer_plugin.py"
    plugin.write_text(
        "import os\nfrom rewards import ORM, orms\n"
        "class TokenCount(ORM):\n"
        "    def __init__(self, tokenizer, **kwargs):\n"
        "        super().__init__(**kwargs)\n"
        "        self.tokenizer = tokenizer\n"
        "    def __call__(self, completions, **kwargs):\n"
        "        return [float(len(self.tokenizer.encode(c, add_special_tokens=False))) for c in completions]\n"
        "def pid_of(completions, **kwargs):\n"
        "    return [float(os.getpid()) for _ in completions]\n"
        "orms['token_count'] = TokenCount\n"
        "orms['pid_of'] = pid_of\n"
    )
    from pipeline.plugins import load_plugins

    load_plugins([str(plugin)])
    cfg = config_from_dict(
        {
            "run": {"external_plugins": [str(plugin)]},
            "model": {"model": "tiny"},
            "reward": {"reward_funcs": ["token_count", "pid_of"], "executor": "processes", "executor_workers": 1,
                       "timeout_s": 60.0, "max_retries": 0, "on_error": "dead_letter"},
        }
    )
    stage = Reward(cfg, model_dir=lambda: tiny_model_dir)
    await stage.start(FakeContext(stage='reward'))
    try:
        scored = await score_alone(stage, traj(1, 0, "hello world"))
    finally:
        await stage.close()
    assert scored.rewards["token_count"] == len(tokenizer.encode("hello world", add_special_tokens=False))
    assert scored.rewards["pid_of"] != float(os.getpid())  # scored in a pool process

"""Chaos: the Procfile's workers as real processes on a test-owned redis-server (ops/redis.conf), two
rollout, two reward and two advantage workers; random non-learner workers (at least one of each stage) are
SIGKILLed and restarted while the run trains, and the ledger proves nothing was lost, nothing trained twice,
every group whole.

Marked ``slow`` (``make test`` runs it; ``-m 'not slow'`` skips it). Each test prints its figures as one
JSON line (``CHAOS {...}``): docs/reliability.md's table quotes them.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import time
import uuid

import poison_reward_plugin as poison
import pytest
from procs import RedisServer, Workers, rollstream_cli

from config import load_config
from pipeline.records import PromptTask, encode
from pipeline.transport import connect
from pipeline.transport.base import newest_record
from rollstream import inspect_run
from stages import PROMPTS, TRAJECTORIES, WEIGHTS

pytestmark = pytest.mark.slow

BATCHES = 36  # generation batches of 4 groups x 8 completions, 2 optimizer steps each: long enough for
# the engine kill and five random kills even on a quiet machine (16 left room for only 3 there once, and
# 24 did too once the engines stopped spinning a second core: rollout.engine_threads)
GROUPS_PER_BATCH = 4
NUM_GENERATIONS = 8
MIN_KILLS = 5
KILLABLE = ["feeder-0", "rollout-0", "rollout-1", "reward-0", "reward-1", "advantage-0", "advantage-1"]
MUST_KILL = {"feeder", "rollout", "reward", "advantage"}  # at least one worker of each stage
RUN_DEADLINE_S = 900  # a bound for a loaded machine; a quiet 2-core one needs about 3 minutes


def settings(run: str, out, url: str, *extra: str) -> list[str]:
    return [
        f"run.name={run}",
        f"run.output_dir={json.dumps(str(out))}",
        "run.metrics_port=0",
        "run.ledger=true",
        "run.log_level=warning",
        f"run.max_steps={BATCHES * 2}",
        f"grpo.num_generations={NUM_GENERATIONS}",
        f"grpo.generation_batch_size={GROUPS_PER_BATCH * NUM_GENERATIONS}",
        "grpo.per_device_train_batch_size=16",
        "rollout.max_model_len=256",
        f"transport.url={url}",
        "transport.min_idle_ms=3000",  # a killed worker's entries are taken over 3 s after their last touch
        *extra,
    ]


async def start_pipeline(workers: Workers, copies: int = 2) -> None:
    await workers.start("learner")
    for i in range(copies):
        await workers.start("advantage", i)
        await workers.start("rollout", i)
        await workers.start("reward", i)
    await workers.start("feeder")


def stage_of(name: str) -> str:
    return name.rsplit("-", 1)[0]


async def learner_version(transport) -> int:
    newest = await newest_record(transport, WEIGHTS)
    return newest.version if newest is not None else 0


async def run_finished(transport) -> bool:
    newest = await newest_record(transport, WEIGHTS)
    return newest is not None and newest.final


async def until(condition, deadline: float, workers: Workers, what: str) -> None:
    """Poll ``condition`` (async) until true; fail with the logs of a worker that died on its own."""
    while not await condition():
        failed = workers.failed()
        if failed:
            pytest.fail(
                f"{failed[0]} exited with an error while waiting for {what}:\n{workers.log(failed[0])}"
            )
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}; learner log:\n{workers.log('learner-0')}")
        await asyncio.sleep(0.2)  # polling another process's progress, with a deadline


async def finish_run(workers: Workers, transport, deadline: float, restarted: set[str] = frozenset()) -> None:
    """The learner ends the run; every other worker drains on the final weights and exits 0. A worker
    the driver restarted may come up after the end: it then refuses the finished run (exit 2)."""
    for name in ["learner-0", *sorted(n for n in workers.running if n != "learner-0")]:
        remaining = max(1.0, deadline - time.monotonic())
        try:
            code = await workers.wait(name, remaining)
        except TimeoutError:
            pytest.fail(f"{name} did not exit after the run finished:\n{workers.log(name)}")
        late = code == 2 and name in restarted and await run_finished(transport)
        assert code == 0 or late, f"{name} exited {code}:\n{workers.log(name)}"


async def ledger_check(url: str, run: str) -> tuple[int, str]:
    return await rollstream_cli("ledger", "check", "--redis", url, "--run", run)


def parse_counts(report: str) -> dict[str, int]:
    """``groups released 40, trained 40 (320 records), ...`` and ``lost 0, duplicated 0`` as numbers."""
    found = dict(re.findall(r"(released|lost|duplicated) (\d+)", report))
    trained = re.search(r"trained (\d+) \((\d+) records\)", report)
    counts = {k: int(v) for k, v in found.items()}
    counts["trained"], counts["records_trained"] = int(trained.group(1)), int(trained.group(2))
    return counts


class Chaos:
    """SIGKILLs random workers that hold work, kills a rollout worker's engine process, restarts whatever
    died (a supervisor's restart-on-failure), and counts the in-flight entries each kill left behind."""

    def __init__(self, workers: Workers, transport, seed: int) -> None:
        self.workers = workers
        self.transport = transport
        self.rng = random.Random(seed)
        self.kills: list[str] = []
        self.in_flight_killed = 0  # entries pending on a victim when it died: all must be redelivered
        self.crashed: list[str] = []  # exited on their own (non-zero) and restarted
        self.restarted: set[str] = set()

    async def pending_of(self, name: str, worker_id: str | None = None) -> int:
        """Entries delivered to ``name``'s consumer and not yet acknowledged; ``worker_id`` names a consumer
        whose process is gone (its entries stay pending on it until another worker claims them)."""
        stage = name.rsplit("-", 1)[0]
        stats = await self.transport.stats(INPUT_EDGE[stage], stage)
        return stats.consumers.get(worker_id or self.workers.running[name].worker_id, 0)

    async def restart(self, name: str) -> None:
        stage, index = name.rsplit("-", 1)
        await self.workers.start(stage, int(index))
        self.restarted.add(name)

    async def sigkill_one(self) -> None:
        alive = [n for n in KILLABLE if time.monotonic() - self.workers.running[n].started > 3.0]
        # A rollout worker takes a minute or more to start its engine: kill one only while the other works.
        for rollout, other in (("rollout-0", "rollout-1"), ("rollout-1", "rollout-0")):
            if rollout in alive and await self.pending_of(other) == 0:
                alive.remove(rollout)
        busy = [n for n in alive if await self.pending_of(n) > 0]
        if not (busy or alive):
            return
        # A stage none of whose workers was killed yet goes first, so every stage's copies are tried; past
        # MIN_KILLS only such a stage's worker, and only one with work in flight (a kill of an idle one
        # there would only slow the run down).
        killed = {stage_of(n) for n in self.kills}
        fresh = [n for n in (busy or alive) if stage_of(n) not in killed]
        if len(self.kills) >= MIN_KILLS:
            fresh = [n for n in busy if stage_of(n) not in killed]
            if not fresh:
                return
        await self.sigkill(self.rng.choice(fresh or busy or alive))

    async def sigkill(self, victim: str) -> None:
        worker_id = self.workers.running[victim].worker_id
        await self.workers.kill(victim)
        # Counted after the kill, on the dead consumer: exactly what it left in flight (a count taken before
        # could see entries it acknowledged in the last milliseconds; claims wait transport.min_idle_ms).
        self.in_flight_killed += await self.pending_of(victim, worker_id)
        self.kills.append(victim)
        await self.restart(victim)

    async def kill_engine(self, name: str) -> int:
        """SIGKILL the engine core process of rollout worker ``name``: the worker must fail (EngineDied)."""
        engines = self.workers.children(name)
        assert engines, f"{name} has no engine process"
        for pid in engines:
            os.kill(pid, signal.SIGKILL)
        # After the kill: the worker can finish nothing more without its engine.
        in_flight = await self.pending_of(name)
        self.in_flight_killed += in_flight
        return in_flight

    async def restart_crashed(self, allowed: tuple[str, ...]) -> list[tuple[str, int]]:
        """Restart workers that exited on their own; returns (name, code). The learner must never crash."""
        ended = []
        for name in list(self.workers.running):
            code = self.workers.running[name].process.returncode
            if code is None:
                continue
            assert name in allowed and code != 0, f"{name} exited {code}:\n{self.workers.log(name)}"
            await self.workers.wait(name, 10)
            self.crashed.append(name)
            ended.append((name, code))
            await self.restart(name)
        return ended


INPUT_EDGE = {"feeder": "feedback", "rollout": "prompts", "reward": "trajectories", "advantage": "scored"}


async def test_random_sigkills_of_stage_workers_lose_nothing_and_train_nothing_twice(tmp_path, monkeypatch):
    redis = RedisServer(tmp_path / "redis")
    redis.start()
    run = f"chaos-{uuid.uuid4().hex[:6]}"
    # A reward raises for one request of a real group (every reward worker, every delivery): its trajectory
    # is dead-lettered, the group dropped and replaced, and the run still trains every batch whole.
    run_settings = settings(run, tmp_path / "out", redis.url, *poison.SETTINGS)
    poisoned = poison.first_group_request(load_config("configs/demo-redis.toml", run_settings))
    monkeypatch.setenv(poison.POISON_ENV, poisoned)  # the workers inherit it
    workers = Workers("configs/demo-redis.toml", run_settings, tmp_path / "logs")
    transport = await connect("redis", run=run, url=redis.url)
    chaos = Chaos(workers, transport, seed=9)
    started = time.monotonic()
    deadline = started + RUN_DEADLINE_S
    try:
        await start_pipeline(workers)
        # Poison: bytes that are no record, and a record no reward worker can score (a prompt on its edge).
        wrong_edge = PromptTask(prompt_id="poison", generation_batch=0, num_generations=1, messages=[])
        await transport.produce(PROMPTS, [b"\x00\xffnot a record"])
        await transport.produce(TRAJECTORIES, [encode(wrong_edge)])
        # Chaos only once records flow (the first weights are out), so kills land mid-work.
        await until(lambda: _at_least(transport, 1), deadline, workers, "the first trained batch")
        # First, while the run is young (a quiet machine finishes it in about a minute), a rollout engine
        # dies under a live worker: the worker fails, is restarted, its prompts redelivered.
        while True:
            assert not await run_finished(transport), "the run finished before an engine could be killed"
            assert time.monotonic() < deadline, "no rollout worker took work before the deadline"
            busy = [n for n in ("rollout-0", "rollout-1") if await chaos.pending_of(n) > 0]
            if busy:
                break  # killed at once, while its prompts are still in flight
            await asyncio.sleep(0.1)  # polling for a rollout worker with prompts in flight, with a deadline
        engine_victim = busy[0]
        engine_in_flight = await chaos.kill_engine(engine_victim)
        # The other rollout worker SIGKILLed with prompts in flight while the victim is down or restarting (both
        # are down for a while: the run waits). It is the only one serving then, so it soon holds prompts;
        # waiting for the victim's restart first let the other finish the run alone.
        other = "rollout-1" if engine_victim == "rollout-0" else "rollout-0"
        engine_crash = None
        other_killed = False
        while engine_crash is None or not other_killed:
            assert time.monotonic() < deadline, "the rollout worker outlived its dead engine, or the other took no work"
            if engine_crash is None:
                ended = await chaos.restart_crashed(allowed=(engine_victim,))
                engine_crash = ended[0] if ended else None
            if not other_killed and await chaos.pending_of(other) > 0:
                await chaos.sigkill(other)
                other_killed = True
            if not other_killed:
                assert not await run_finished(transport), "the run finished before a rollout worker could be killed"
            await asyncio.sleep(0.05)  # polling the victim's exit and the other's prompts, with a deadline
        assert engine_crash == (engine_victim, 1)
        def enough() -> bool:
            return len(chaos.kills) >= MIN_KILLS and MUST_KILL <= {stage_of(n) for n in chaos.kills}

        while not enough() and not await _at_least(transport, BATCHES - 1):
            await asyncio.sleep(chaos.rng.uniform(0.3, 1.5))  # the chaos interval, not a wait for anything
            await chaos.sigkill_one()
        assert enough(), f"the run finished after only these kills: {chaos.kills}: make it longer"
        await finish_run(workers, transport, deadline, chaos.restarted)
        code, report = await ledger_check(redis.url, run)
        assert code == 0, report
        counts = parse_counts(report)
        assert counts["lost"] == 0 and counts["duplicated"] == 0, report
        assert counts["trained"] == BATCHES * GROUPS_PER_BATCH, report
        assert counts["records_trained"] == BATCHES * GROUPS_PER_BATCH * NUM_GENERATIONS, report
        assert "dead_letter 1" in report, report  # the poisoned group: dropped once, replaced
        assert chaos.in_flight_killed > 0, "no kill hit a worker with work in flight"
        # The poison went to the dead edge with its reason, and `rollstream inspect` lists it all. A killed
        # rollout worker's group is generated again, so the poisoned group's entry may go dead more than once.
        letters = (await inspect_run.from_transport(transport))["dead_letters"]
        assert {(row["edge"], row["error"].split(":")[0]) for row in letters} == {
            ("prompts", "undecodable"),
            ("trajectories", "TypeError"),
            ("trajectories", "RewardFailed"),
        }, letters
        assert {row["record_id"] for row in letters if row["edge"] == "trajectories"} == {
            wrong_edge.record_id,
            poison.dead_entry(poisoned),
        }
        code, shown = await rollstream_cli("inspect", "--redis", redis.url, "--run", run)
        assert code == 0 and f"{len(letters)} dead letters" in shown, shown
        figures = {
            "kills": len(chaos.kills),
            "killed": chaos.kills,
            "engine_deaths": 1,
            "in_flight_at_engine_death": engine_in_flight,
            "in_flight_at_kills": chaos.in_flight_killed,
            "dead_letters": len(letters),
            "poisoned_group_dropped": "dead_letter 1" in report,
            "ledger": report.splitlines()[1],
            **counts,
            "seconds": round(time.monotonic() - started, 1),
        }
        print("CHAOS " + json.dumps(figures))
    finally:
        await workers.stop_all()
        await transport.close()
        redis.stop()


async def _at_least(transport, version: int) -> bool:
    return await learner_version(transport) >= version


# Each stage's input edge and whether its worker holds inputs across records (held entries stay pending
# for a successor when it is stopped mid-run, by design; the others must leave nothing pending).
SIGTERM_ORDER = [
    ("rollout-0", "prompts", False),
    ("reward-0", "trajectories", False),
    ("advantage-0", "scored", True),
    ("feeder-0", "feedback", True),
]
GRACE_S = 60


async def test_sigterm_drains_each_stage_and_a_redis_restart_mid_run_is_survived(tmp_path):
    redis = RedisServer(tmp_path / "redis")
    redis.start()
    run = f"restart-{uuid.uuid4().hex[:6]}"
    workers = Workers(
        "configs/demo-redis.toml", settings(run, tmp_path / "out", redis.url), tmp_path / "logs"
    )
    transport = await connect("redis", run=run, url=redis.url)
    started = time.monotonic()
    deadline = started + RUN_DEADLINE_S
    drained: dict[str, float] = {}
    try:
        await start_pipeline(workers, copies=1)
        await until(lambda: _at_least(transport, 1), deadline, workers, "the first trained batch")
        # SIGTERM: in-flight work is finished and acked, the worker exits 0 within its grace period.
        for name, edge, holds in SIGTERM_ORDER:
            worker_id = workers.running[name].worker_id
            began = time.monotonic()
            code = await workers.kill(name, signal.SIGTERM, timeout_s=GRACE_S)
            drained[name] = round(time.monotonic() - began, 2)
            assert code == 0, f"{name} exited {code} on SIGTERM:\n{workers.log(name)}"
            if not holds:
                stats = await transport.stats(edge, name.rsplit("-", 1)[0])
                assert stats.consumers.get(worker_id, 0) == 0, f"{name} left {stats.consumers} pending"
            stage, index = name.rsplit("-", 1)
            await workers.start(stage, int(index))
        # Redis dies (SIGKILL: no shutdown save) and comes back from its append-only file, twice.
        version = await learner_version(transport)
        for _ in range(2):
            await until(
                lambda t=transport, v=version: _at_least(t, v + 1), deadline, workers, "training to go on"
            )
            await transport.close()
            redis.restart()
            transport = await connect("redis", run=run, url=redis.url)
            version = await learner_version(transport)
        await finish_run(workers, transport, deadline, {name for name, _, _ in SIGTERM_ORDER})
        code, report = await ledger_check(redis.url, run)
        assert code == 0, report
        counts = parse_counts(report)
        assert counts["trained"] == BATCHES * GROUPS_PER_BATCH, report
        assert counts["lost"] == 0 and counts["duplicated"] == 0, report
        figures = {
            "redis_restarts": redis.restarts,
            "sigterm_drain_seconds": drained,
            "ledger": report.splitlines()[1],
            **counts,
            "seconds": round(time.monotonic() - started, 1),
        }
        print("RESTART " + json.dumps(figures))
    finally:
        await workers.stop_all()
        await transport.close()
        redis.stop()

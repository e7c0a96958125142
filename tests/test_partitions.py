"""Partitions and slow links between two hosts (tests/netns.py; issue #36, part 3). A fault is iptables rules
inside a host's namespace on its end of the a-b link: a cut drops every packet silently (no RST, no ICMP),
so a peer's TCP connection hangs until a timeout, as when a cable or a switch fails.

- A rollout host cut off mid-run, while it holds work it has not acked, then healed: the weights group goes
  on without it and takes it back; what it held (prompts, trajectories) is redelivered to the copies on the
  other host (the ledger shows both hosts acked it: b late, after the heal, its outputs then duplicates that
  are trained once); no trajectory mixes versions; the ledger is exact.
- The learner's host cut off from Redis (and from the rollout engines): it stalls and resumes; every
  version number names one set of weights; the steps go on without a gap or a repeat.
- A lossy, slower link (1 % of packets dropped each way, 100 Mbit/s): the run completes, clean.

How long a cut lasts. What it must outlast is the timeouts that decide who is alive: a member's lease
(``max(transport.min_idle_ms, 10 s)``: 10 s here), the idle time after which another consumer reclaims a
worker's pending entries (``transport.min_idle_ms``: 3 s here) and the weights group's
``rollout.weight_sync_timeout_s`` (10 s here). A cut of ``PARTITION_S`` = 15 s outlasts all three, so the rest
of the run must have given the cut-off host up for dead by then; and it is shorter than
``transport.reconnect_s`` (60 s, the default), so the cut-off workers wait for the link instead of failing.
The rollout-host cut lasts until the group went on without it (a version delivered to a group it is not in)
as well, polled, not guessed: 15 s is a floor. Host a's rollout copy then leaves, so the rest of the run
depends on host b being taken back. 30 s, the issue's figure, would prove nothing more.

The namespace tests are marked ``slow`` (``make test`` runs them; ``-m 'not slow'`` skips them).
"""

from __future__ import annotations

import json
import shutil
import signal
import time
import uuid

import pytest
import redis.asyncio
from netns import (  # noqa: F401  (the two_hosts fixture)
    BROADCAST,
    SPLIT,
    TwoHosts,
    check_clean_run,
    finish,
    start_split,
    two_hosts_fixture,
)
from polling import wait_until
from procs import Workers, rollstream_cli

from pipeline.records import (
    LedgerEntry,
    WeightsAck,
    WeightsEpoch,
    WeightsMember,
    WeightsPublished,
    trajectories_in,
)
from pipeline.run_dir import edge_tail
from pipeline.transport import connect
from pipeline.transport.base import ledger_edge
from stages import PROMPTS, TRAJECTORIES, WEIGHTS
from weights.membership import SYNC_EDGE

PARTITION_S = 15.0  # > the lease TTL (10 s), min_idle (3 s) and weight_sync_timeout_s (10 s); < reconnect_s (60 s)
CUT_AT_MOST_S = 40.0  # the rollout-host cut, waiting for the group to go on without it (well under reconnect_s)
RUN_DEADLINE_S = 420  # engine start (10-60 s on a loaded 2-core machine) + the batches, each waiting for its broadcast
STEPS = 24  # 12 generation batches: some before the cut, some during it, the rest on host b after it
# Completions of up to 128 tokens (the config's 16 take a moment): host b holds its prompts long enough to
# be cut off while it does.
# The faults are iptables rules (Debian: apt-get install -y iptables); the kernel's netfilter is enough.
pytestmark = pytest.mark.skipif(shutil.which("iptables") is None, reason="no `iptables` command (apt-get install -y iptables)")
CUT_TRIES = 15  # under load b often acks as the cut comes: seen 5 of 5 tries missed beside a second test run
# The rollout-host cut's run: each missed try costs a generation batch, and after the cut the run needs batches
# left for host b to come back to (24 steps once ran out: cut at version 11 of 12). Cuts stop being tried past
# LAST_CUT_VERSION, which leaves 6 batches.
ROLLOUT_CUT_STEPS = 40
LAST_CUT_VERSION = ROLLOUT_CUT_STEPS // 2 - 6
# An entry counts as held by b if it was delivered (or touched by b) this long before the cut began: its reply
# crossed the veth link long before (microseconds), so b has it, and must ack it after the heal.
DELIVERED_BEFORE_CUT_MS = 50
HELD = ((PROMPTS, "rollout"), (TRAJECTORIES, "reward"))  # (edge, consumer group) of what host b's workers take
ON_B = ("rollout-0", "reward-0")  # their consumer names' start (host a's copies are rollout-1, reward-1)
PARTITION = (*BROADCAST[:2], "rollout.weight_sync_timeout_s=10", f"run.max_steps={STEPS}",
             "grpo.max_completion_length=128")


async def _tail(transport, edge: str) -> list:
    return await edge_tail(transport, edge, None)


async def _ledger_report(hosts: TwoHosts, run: str) -> dict:
    code, report = await rollstream_cli("ledger", "check", "--redis", hosts.test_url, "--run", run)
    assert code == 0, report
    return {"report": report.strip().splitlines()}


def _alive(*workers: Workers) -> None:
    for w in workers:
        failed = w.failed()
        assert not failed, f"{failed[0]} failed:\n{w.log(failed[0])}"


# Host a: the learner, the feeder, the advantage worker, and a rollout and a reward worker that take over what
# host b held. Host b: a rollout and a reward worker, the host that is cut off.
TWO_ROLLOUT_HOSTS = (*SPLIT[:2], ("a", "rollout", 1), ("a", "reward", 1), *SPLIT[2:])


@pytest.mark.slow
@pytest.mark.e2e
async def test_a_rollout_host_cut_off_is_left_out_its_work_redelivered_and_taken_back(two_hosts):
    run = f"partition-rollout-{uuid.uuid4().hex[:6]}"
    started = time.monotonic()
    a, b = await start_split(two_hosts, run, *PARTITION, f"run.max_steps={ROLLOUT_CUT_STEPS}",
                             placement=TWO_ROLLOUT_HOSTS[:-1])
    cut_off = b.running["rollout-0"].worker_id
    transport = await connect("redis", run=run, url=two_hosts.test_url)
    admin = redis.asyncio.Redis.from_url(two_hosts.test_url)
    try:

        async def both_rollouts_registered() -> bool:
            _alive(a, b)
            records = await _tail(transport, SYNC_EDGE)
            return {"a", "b"} <= {"b" if r.worker == cut_off else "a" for r in records if isinstance(r, WeightsMember)}

        # The prompts only once both rollout workers' engines are up and registered with the weights group: a
        # host b that started last could be left out of the first epoch (slow to answer under load) and the
        # tiny run end before it was served a version (seen once: 24 steps without b, no cut possible).
        await wait_until(both_rollouts_registered, "both rollout workers to register", RUN_DEADLINE_S, 0.2)
        await a.start(*TWO_ROLLOUT_HOSTS[-1][1:])

        async def b_holds_broadcast_weights() -> bool:
            _alive(a, b)
            return any(isinstance(r, WeightsAck) and r.worker == cut_off and r.step == "load" and r.ok
                       and r.version >= 1 for r in await _tail(transport, SYNC_EDGE))

        async def held_by_b() -> dict[str, int]:
            """Entries host b's workers were delivered and have not acked, by edge."""
            pending = {edge: (await transport.stats(edge, group)).consumers for edge, group in HELD}
            return {edge: sum(n for c, n in consumers.items() if c.startswith(ON_B)) for edge, consumers in
                    pending.items()}

        async def received_by_b(cut_started: float) -> dict[str, int]:
            """Entries host b's workers held since before the cut began, by edge: b has them. An entry
            delivered as the cut came may be pending at redis-server while its reply never reached b."""
            counts = {}
            for edge, group in HELD:
                pending = await admin.xpending_range(transport.key(edge), group, "-", "+", 1000)
                cut_for_ms = (time.monotonic() - cut_started) * 1000  # after the reply: an upper bound
                counts[edge] = sum(1 for p in pending if p["consumer"].decode().startswith(ON_B)
                                   and p["time_since_delivered"] >= cut_for_ms + DELIVERED_BEFORE_CUT_MS)
            return counts

        async def b_has_no_blocked_read() -> bool:
            clients = await admin.client_list()
            return not any(c["addr"].rsplit(":", 1)[0] == two_hosts.address["b"] and "b" in c["flags"]
                           for c in clients)

        async def b_holds_work() -> bool:
            _alive(a, b)
            return any((await held_by_b()).values())

        # Mid-run: host b holds a version it received over the group, and work it has not acked yet.
        await wait_until(b_holds_broadcast_weights, "host b to load version 1", RUN_DEADLINE_S, 0.2)
        for _ in range(CUT_TRIES):
            await wait_until(b_holds_work, "host b to take work", RUN_DEADLINE_S, 0.02)
            versions_at_cut = [r.version for r in await _tail(transport, WEIGHTS) if isinstance(r, WeightsPublished)]
            if max(versions_at_cut, default=0) > LAST_CUT_VERSION:
                pytest.fail(f"host b acked its work before every cut up to version {LAST_CUT_VERSION}")
            cut_started = time.monotonic()
            two_hosts.cut_off("b")
            cut_at = time.monotonic()
            held = await received_by_b(cut_started)  # after the cut: what b holds now it cannot ack until the heal
            # A read b had blocked at redis-server before the cut is still served after it; whether that reply
            # reaches b after the heal (TCP retransmits it) or not (b's client timed out) is the network's
            # say. What b can hold is settled once none of its reads is blocked there (within block_ms, 1 s).
            await wait_until(b_has_no_blocked_read, "host b's blocked reads to time out", RUN_DEADLINE_S, 0.05)
            settled = await held_by_b()
            if any(held.values()):
                break
            two_hosts.heal()  # b acked its work as the cut came (within ~0.1 s): on its next work, then
        else:
            pytest.fail(f"host b acked its work before each of {CUT_TRIES} cuts")
        print(f"PARTITION cut host b at version {max(versions_at_cut)}, holding {held}", flush=True)
        marks: dict[str, float] = {}

        async def given_up_for_dead() -> bool:
            # The rest of the run went on without b: what it held taken over by host a's copies, and a
            # version delivered to a group it is not in.
            _alive(a, b)
            if not any((await held_by_b()).values()):
                marks.setdefault("reclaimed", time.monotonic() - cut_at)
            records = await _tail(transport, SYNC_EDGE)
            formed = [r for r in records if isinstance(r, WeightsEpoch) and r.phase == "form"]
            without = [r.epoch for r in formed if all(m.worker != cut_off for m in r.members)]
            newest = max(versions_at_cut, default=0)
            delivered = [r for r in records if isinstance(r, WeightsAck) and r.step == "load" and r.ok
                         and r.version > newest and r.epoch in without]
            if delivered:
                marks.setdefault("left_out", time.monotonic() - cut_at)
            return "reclaimed" in marks and bool(delivered)

        await wait_until(given_up_for_dead, "the run to go on without host b", CUT_AT_MOST_S, 0.1)
        # Host a's rollout copy took b's work over and the group went on without b; now it leaves (SIGTERM: it
        # drains, exit 0). Without b the tiny model's batches take a fraction of a second each: the run would
        # end before b could come back. This way the rest of the run depends on the host that was cut off.
        a.running["rollout-1"].process.send_signal(signal.SIGTERM)

        def cut_long_enough() -> bool:
            # The deliberate duration of the partition (see the module docstring), watching that nothing dies.
            _alive(a, b)
            return time.monotonic() - cut_at >= PARTITION_S

        await wait_until(cut_long_enough, "the cut", CUT_AT_MOST_S, 0.2)
        two_hosts.heal()
        healed_at = time.monotonic()
        print(f"PARTITION healed after {healed_at - cut_at:.1f} s: {marks}", flush=True)

        async def b_back_in_the_group() -> bool:
            _alive(a, b)
            learner_running = a.running["learner-0"].process.returncode is None  # before the records: no race
            records = await _tail(transport, SYNC_EDGE)
            rejoined = {r.epoch for r in records if isinstance(r, WeightsAck) and r.worker == cut_off
                        and r.step == "join" and r.ok}
            back = any(isinstance(r, WeightsAck) and r.worker == cut_off and r.step == "load" and r.ok
                       and r.epoch in rejoined and r.version > max(versions_at_cut) for r in records)
            assert back or learner_running, "the run ended before host b was back in the weights group"
            return back

        await wait_until(b_back_in_the_group, "host b to load a version after the cut", RUN_DEADLINE_S, 0.2)
        rejoined_s = time.monotonic() - healed_at
        await finish({"a": a, "b": b}, time.monotonic() + RUN_DEADLINE_S)
        wall_s = time.monotonic() - started
        await check_clean_run(two_hosts, run, ROLLOUT_CUT_STEPS)
        report = await _ledger_report(two_hosts, run)

        # Host b sampled again after the cut, with the weights the group sent it.
        wall_at_heal = time.time() - (time.monotonic() - healed_at)
        rollout_steps = [e for e in await _tail(transport, ledger_edge("rollout"))
                         if isinstance(e, LedgerEntry) and e.worker == cut_off and e.outputs]
        assert any(e.at > wall_at_heal for e in rollout_steps), "host b produced nothing after the cut"
        # What b held at the cut was redelivered: host a's copies acked it, and b too, late, after the heal
        # (its outputs then were duplicates, which the ledger check shows were trained once). A prompt acked on
        # both hosts is one b held at the cut; a trajectory group may also be b's late duplicate output.
        acked = {(stage, host): set() for stage in ("rollout", "reward") for host in "ab"}
        for stage in ("rollout", "reward"):
            for e in await _tail(transport, ledger_edge(stage)):
                if isinstance(e, LedgerEntry):
                    acked[stage, "b" if e.worker.startswith(ON_B) else "a"].update(e.acked)
        replayed = {stage: acked[stage, "a"] & acked[stage, "b"] for stage in ("rollout", "reward")}
        assert held[PROMPTS] <= len(replayed["rollout"]) <= settled[PROMPTS], (replayed, held, settled)
        assert held[TRAJECTORIES] <= len(replayed["reward"]), (replayed, held)
        assert replayed["rollout"] or replayed["reward"], held
        groups = [t.request_id for t in trajectories_in(await _tail(transport, TRAJECTORIES))]
        print("PARTITION rollout host:", json.dumps({
            "held_by_b_at_cut": held, "replayed": {k: len(v) for k, v in replayed.items()}, "reclaimed_after_s": round(marks["reclaimed"], 1),
            "run_went_on_without_b_after_s": round(marks["left_out"], 1),
            "cut_s": round(healed_at - cut_at, 1), "b_loaded_a_version_after_heal_s": round(rejoined_s, 1),
            "trajectories_sampled_twice": len(groups) - len(set(groups)), "wall_s": round(wall_s, 1),
            **report}))
    finally:
        await transport.close()
        await admin.aclose()
        for workers in (a, b):
            await workers.stop_all()


# Host b: the learner alone. Host a: Redis and every other worker. Cutting b off cuts the learner off from Redis
# and from the rollout engine (its weights group).
LEARNER_ON_B = (("b", "learner", 0), ("a", "advantage", 0), ("a", "rollout", 0), ("a", "reward", 0),
                ("a", "feeder", 0))


@pytest.mark.slow
@pytest.mark.e2e
async def test_the_learners_host_cut_off_from_redis_stalls_and_resumes_without_reusing_a_version(two_hosts):
    run = f"partition-learner-{uuid.uuid4().hex[:6]}"
    started = time.monotonic()
    a, b = await start_split(two_hosts, run, *PARTITION, placement=LEARNER_ON_B)
    out = two_hosts.private["b"] / "out"
    transport = await connect("redis", run=run, url=two_hosts.test_url)

    def steps() -> int:
        metrics = out / "metrics.jsonl"
        return len(metrics.read_text().splitlines()) if metrics.exists() else 0

    try:

        async def version(at_least: int) -> bool:
            _alive(a, b)
            return any(isinstance(r, WeightsPublished) and r.version >= at_least
                       for r in await _tail(transport, WEIGHTS))

        await wait_until(lambda: version(1), "version 1", RUN_DEADLINE_S, 0.2)
        newest = max(r.version for r in await _tail(transport, WEIGHTS) if isinstance(r, WeightsPublished))
        steps_at_cut = steps()
        two_hosts.cut_off("b")
        cut_at = time.monotonic()

        def cut_long_enough() -> bool:
            # The deliberate duration of the partition (see the module docstring), watching that nothing dies.
            _alive(a, b)
            return time.monotonic() - cut_at >= PARTITION_S

        await wait_until(cut_long_enough, "the cut", PARTITION_S + 5, 0.5)
        steps_during_cut = steps() - steps_at_cut  # trained on what it had, with nothing to say so
        two_hosts.heal()
        healed_at = time.monotonic()
        await wait_until(lambda: version(newest + 1), "a version after the cut", RUN_DEADLINE_S, 0.2)
        resumed_s = time.monotonic() - healed_at
        await finish({"a": a, "b": b}, time.monotonic() + RUN_DEADLINE_S, learner_host="b")
        wall_s = time.monotonic() - started
        await check_clean_run(two_hosts, run, STEPS, learner_host="b")
        report = await _ledger_report(two_hosts, run)
        print("PARTITION learner host:", json.dumps({
            "steps_at_cut": steps_at_cut, "steps_during_cut": steps_during_cut, "cut_s": round(healed_at - cut_at, 1),
            "next_version_after_heal_s": round(resumed_s, 1), "wall_s": round(wall_s, 1), **report}))
    finally:
        await transport.close()
        for workers in (a, b):
            await workers.stop_all()


LOSS = 0.01  # of the packets each way
RATE = "100mbit"
DELAY_MS = 25  # each way on host b's connections to Redis: 50 ms more per round trip


@pytest.mark.slow
@pytest.mark.e2e
async def test_a_lossy_slow_link_between_the_hosts_still_completes_a_clean_run(two_hosts):
    """The link drops 1 % of its packets each way (iptables' statistic match) and is shaped to 100 Mbit/s
    each way (tbf); the kernel here has no netem, so host b's workers reach Redis through a forwarder on b that
    holds every chunk 25 ms each way (tests/delay_proxy.py): every call of theirs, each XREADGROUP, XADD, ack
    and lease renewal, pays 50 ms more. The weights broadcast's own TCP connections see the loss, not the delay."""
    run = f"partition-lossy-{uuid.uuid4().hex[:6]}"
    for host in ("a", "b"):
        two_hosts.limit_rate(host, RATE)
    two_hosts.lose("b", LOSS)
    sent = {host: two_hosts.tx_bytes(host) for host in ("a", "b")}
    started = time.monotonic()
    slow_url = two_hosts.delay("b", DELAY_MS)
    a, b = await start_split(two_hosts, run, *BROADCAST, on_host={"b": (f"transport.url={slow_url}",)})
    try:
        await finish({"a": a, "b": b}, time.monotonic() + RUN_DEADLINE_S)
        wall_s = time.monotonic() - started
        await check_clean_run(two_hosts, run)
        report = await _ledger_report(two_hosts, run)
        moved = {host: two_hosts.tx_bytes(host) - sent[host] for host in ("a", "b")}
        print("PARTITION lossy link:", json.dumps({"loss": LOSS, "rate": RATE, "delay_ms_each_way": DELAY_MS,
                                                     "wall_s": round(wall_s, 1),
                                                     "bytes_sent": moved, **report}))
    finally:
        for workers in (a, b):
            await workers.stop_all()

"""The weights group's control plane (``rollout.weight_transport = "broadcast"``): who is in the group,
which epoch it is in, and every round's outcome, as records on the fan-out edge ``SYNC_EDGE``.

The data plane (one collective broadcast per version) is ``weights/sender.py`` on the learner and
``weights/transfer.py`` in the engines; this module only speaks records, so the same protocol runs
on Redis between hosts and on the memory transport in one process.

    rollout worker                     weights.sync                              learner (rank 0)
    WeightsMember (nonce; its lease) ──────────────────────────────────────────► registered
                                       ◄── WeightsEpoch "open" (address, port)   binds the port first
    reach address:port? ──── WeightsAck "reach" (ok, or "unreachable a:p") ────►
                                       ◄── WeightsEpoch "form" (ranks)           those who reach it
    joins the group ──────── WeightsAck "join" ────────────────────────────────► every rank connected
                                       ◄── WeightsRound (epoch, version)         sends every chunk
    receives it whole ────── WeightsAck "recv" ────────────────────────────────►
    loads it (gate) ──────── WeightsAck "load" ────────────────────────────────► WeightsPublished(via=broadcast)

A member is alive while its lease (``MEMBER_LEASE``, value = its nonce, renewed by the worker heartbeat)
is. The learner rebuilds the group only between rounds: when the live members are not the group's, or a
round failed (it then leaves out whoever did not answer in time and sends the version again, in full). A
member left out is told at once (a ``WeightsEpoch`` "left_out" notice, with the reason) and registers again
(its ``seq`` + 1) after a backoff; the learner serves it the current version while it waits for data. One
left out of ``MAX_LEFT_OUT`` epochs in a row without joining one fails its worker with the reasons. A
round that fails half-way never touches a member's weights: the engine stages the whole version first.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pipeline import log, metrics
from pipeline.errors import SetupError
from pipeline.records import EpochMember, WeightsAck, WeightsEpoch, WeightsMember, WeightsRound
from pipeline.stage import FatalStageError, Stage, StageContext

SYNC_EDGE = "weights.sync"
"""The fan-out edge of the weights group's control records (every rollout worker and the learner read it)."""
MEMBER_LEASE = "weights.members"
"""The lease a member keeps while it is alive (holder: its worker id, value: its nonce)."""
REACH_TIMEOUT_S = 5.0  # a member's TCP connect to the learner's advertised address
MAX_ATTEMPTS = 3  # rounds (with a rebuild between) for one version before the learner gives up on it
LOAD_TIMEOUT_S = 600.0  # a member that received a version loads it under its gate: it may wait for a turn
REGROUP_WAIT_S = 120.0  # how long a new epoch waits for the group's loads of the last round (then opens anyway)
SETTLE_S = 3.0  # after a failed send: how long the survivors have to say so (the silent ones are left out)
MEMBER_ERROR_REASONS = ("unreachable", "join", "round")  # rollstream_weight_member_errors_total{reason}
ROUND_FAILURE_REASONS = ("form", "round", "load")  # rollstream_weight_rounds_failed_total{reason}
LEASE_CHECK_S = 2.0  # how often a long wait for members' answers looks whether they are still alive
MAX_LEFT_OUT = 5  # epochs in a row a member is left out of, without joining one, before its worker fails
REGISTER_BACKOFF_S = (1.0, 30.0)  # a left-out member registers again after 1 s, doubling up to 30 s


def group_backend(learner: list[str], members: list[list[str]]) -> str:
    """An epoch's collective backend: NCCL when the learner and every member are on CUDA (each lists "nccl"),
    gloo otherwise (its chain is the CPU twin: the same rounds, the same control plane)."""
    return "nccl" if "nccl" in learner and all("nccl" in m for m in members) else "gloo"


class MemberFailed(SetupError, FatalStageError):
    """A member that can never take part in the weights group (``Member.error``): its worker fails with it."""


def reach(host: str, port: int, timeout_s: float = REACH_TIMEOUT_S) -> str:
    """This host's address on the route to ``host:port``; OSError("unreachable host:port (...)") if the
    peer does not accept a TCP connection within ``timeout_s``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as conn:
            return conn.getsockname()[0]
    except OSError as exc:
        raise OSError(f"unreachable {host}:{port} ({exc.strerror or exc})") from None


def advertised_address(configured: str, transport_kind: str, transport_url: str) -> str:
    """The address the learner advertises: ``rollout.weight_sync_address``, else the local address of its
    connection to Redis (the interface its members' traffic reaches it by), else (memory) 127.0.0.1."""
    if configured:
        return configured
    if transport_kind != "redis":
        return "127.0.0.1"
    from urllib.parse import urlsplit

    parts = urlsplit(transport_url)
    if parts.scheme not in ("redis", "rediss") or not parts.hostname:
        raise OSError(f"transport.url {parts.scheme}://...: no TCP route to Redis to take the address from; "
                      "set rollout.weight_sync_address to an address of this host the rollout workers reach")
    return reach(parts.hostname, parts.port or 6379)


# ---------------------------------------------------------------------------------------------------
# The rollout worker's side


class Member:
    """A rollout worker's part in the weights group. ``engine`` takes part in rounds (``join_broadcast``,
    ``receive_broadcast``, ``commit_broadcast``: engines/vllm_engine.py, or weights/transfer.py's
    ``PlainReceiver``). Records to produce go to ``outbox`` (the stage's source)."""

    def __init__(
        self,
        worker: str,
        engine: Any,
        *,
        mode: str,
        engine_kind: str = "async",
        server_urls: list[str] | None = None,
        world_size: int = 1,
        backends: list[str] | None = None,
        labels: tuple[str, str, str] = ("", "rollout", ""),
        role: str = "rollout",
        wants: Callable[[WeightsRound], Awaitable[bool]] | None = None,
    ) -> None:
        self.worker = worker
        # "eval": an evaluate worker's own engine. It receives every round (it is a rank of the collective)
        # but loads only what ``wants`` says; the learner ranks it after the rollout engines.
        self.role = role
        self.wants = wants
        self.engine = engine
        self.mode = mode  # rollout.weight_load: the gate a received version is loaded under
        self.nonce = secrets.randbits(48)  # a lease value is an integer Redis keeps exactly (< 2**53)
        self.seq = 0
        self.engine_kind = engine_kind
        self.server_urls = list(server_urls or [])
        self.world_size = world_size
        self.backends = list(backends or ["gloo"])
        self.labels = labels
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.epoch = 0  # the epoch whose group this member is in now (0: none)
        self.learner = 0  # the incarnation of the learner whose group that is
        self.holds: tuple[int, int] | None = None  # (learner, version) of the weights this member loaded
        self.timeout_s = 60.0
        self.error: str | None = None  # set when this member can never take part (the learner is unreachable)
        # Left out of epochs in a row without joining one (why, each): the worker fails at MAX_LEFT_OUT.
        self.left_out: list[str] = []
        self.backoff_s = REGISTER_BACKOFF_S[0]  # before the next registration after one is left out
        self._last_failure = ""  # this member's own view of why its last join or round failed
        self._registering: asyncio.TimerHandle | None = None
        self._reached: dict[int, str] = {}  # epoch -> this host's address towards the learner
        self.log = log.get(run=labels[0], stage=labels[1], worker=worker)
        for reason in MEMBER_ERROR_REASONS:  # exported at 0: a first failure is a rise, which alerts see
            metrics.WEIGHT_MEMBER_ERRORS.labels(*labels, reason)

    def registration(self) -> WeightsMember:
        return WeightsMember(
            worker=self.worker, nonce=self.nonce, seq=self.seq, host=socket.gethostname(), engine=self.engine_kind,
            server_urls=self.server_urls, world_size=self.world_size, backends=self.backends, role=self.role,
        )

    def register(self) -> None:
        self.outbox.put_nowait(self.registration())

    def _ack(self, epoch: int, step: str, *, ok: bool = True, version: int = 0, error: str = "",
             seconds: float = 0.0) -> None:
        self.outbox.put_nowait(WeightsAck(epoch=epoch, worker=self.worker, nonce=self.nonce, step=step, ok=ok,
                                          version=version, error=error, seconds=seconds))

    def _me(self, members: list[EpochMember]) -> EpochMember | None:
        return next((m for m in members if m.worker == self.worker and m.nonce == self.nonce), None)

    async def on_record(self, record: Any) -> None:
        if isinstance(record, WeightsEpoch):
            await self._on_epoch(record)
        elif isinstance(record, WeightsRound):
            await self._on_round(record)

    async def _on_epoch(self, record: WeightsEpoch) -> None:
        me = self._me(record.members)
        if me is None:
            left = next((i for i, m in enumerate(record.left_out) if m.worker == self.worker
                         and m.nonce == self.nonce), None)
            if left is not None and record.left_out[left].seq == self.seq:  # left out of this registration
                reason = record.reasons[left] if left < len(record.reasons) else ""
                self._on_left_out(record.epoch, reason or self._last_failure or "left out")
            return
        self.epoch = 0  # whatever group it was in is over
        self.timeout_s = record.timeout_s
        if record.phase == "open":
            try:
                self._reached[record.epoch] = await asyncio.to_thread(reach, record.address, record.port)
            except OSError as exc:
                self.error = (
                    f"weights group: {exc} from {socket.gethostname()}: the learner advertises that address "
                    f"(rollout.weight_sync_address, or its address towards Redis); make it reachable from the "
                    f"rollout hosts (routes, firewall), or set rollout.weight_sync_address on the learner"
                )
                metrics.WEIGHT_MEMBER_ERRORS.labels(*self.labels, "unreachable").inc()
                self.log.error("weights group unreachable", error=self.error)
                self._ack(record.epoch, "reach", ok=False, error=str(exc))
                return
            self._ack(record.epoch, "reach")
            return
        local = self._reached.pop(record.epoch, None)
        if local is None:
            return  # did not answer the open phase (this worker started after it): the next epoch has it
        started = time.perf_counter()
        try:
            await self.engine.join_broadcast(record, me, local)
        except Exception as exc:  # noqa: BLE001 - any failure to join is the learner's to act on
            metrics.WEIGHT_MEMBER_ERRORS.labels(*self.labels, "join").inc()
            self.log.warning("weights group join failed", epoch=record.epoch, error=repr(exc))
            self._last_failure = f"join failed: {type(exc).__name__}: {exc}"
            self._ack(record.epoch, "join", ok=False, error=f"{type(exc).__name__}: {exc}")
            return
        self.epoch, self.learner = record.epoch, record.learner
        self.left_out, self.backoff_s, self._last_failure = [], REGISTER_BACKOFF_S[0], ""
        self.log.info("weights group joined", epoch=record.epoch, rank=me.rank_offset, world_size=record.world_size)
        self._ack(record.epoch, "join", seconds=time.perf_counter() - started)

    def _on_left_out(self, epoch: int, reason: str) -> None:
        """Left out of ``epoch`` (``reason``): register again after the backoff, or, left out of
        MAX_LEFT_OUT epochs in a row without joining one, fail the worker with the reasons."""
        self.seq += 1  # the next registration; notices about this one are answered once
        self.left_out.append(f"epoch {epoch}: {reason}")
        if self._registering is not None:
            self._registering.cancel()
        if len(self.left_out) >= MAX_LEFT_OUT:
            self.error = (
                f"weights group: left out of {len(self.left_out)} epochs in a row without joining one "
                f"(membership.MAX_LEFT_OUT): {'; '.join(self.left_out)}. This worker cannot take part in the "
                f"learner's weights group: fix what the reasons say (its engine's join, the routes between the "
                f"rollout hosts and the learner, rollout.weight_sync_timeout_s) and restart it, or set "
                f'rollout.weight_transport = "file"'
            )
            self.log.error("weights group: this member keeps being left out", error=self.error)
            return
        delay, self.backoff_s = self.backoff_s, min(self.backoff_s * 2, REGISTER_BACKOFF_S[1])
        self.log.warning("weights group left this member out: registering again", epoch=epoch, reason=reason,
                         after_s=delay, left_out=len(self.left_out))
        # A backoff, not a wait for something: a member that keeps failing must not drive the learner
        # through an epoch per record.
        self._registering = asyncio.get_running_loop().call_later(delay, self.register)

    async def _on_round(self, record: WeightsRound) -> None:
        if record.epoch != self.epoch:
            return  # not this member's group (an old round, or one it was left out of)
        started = time.perf_counter()
        # A version is new unless this member loaded it from this learner: a restarted learner's version
        # replaces what its predecessor sent, whatever the numbers (it may have resumed an older checkpoint).
        load = (self.learner, record.version) != self.holds
        if load and self.wants is not None:  # an evaluator's engine loads only the versions it evaluates
            load = await self.wants(record)
        try:
            await self.engine.receive_broadcast(record.epoch, record.version, self.timeout_s, load=load)
        except Exception as exc:  # noqa: BLE001 - the round failed: the learner rebuilds and sends it again
            self.epoch = 0
            metrics.WEIGHT_MEMBER_ERRORS.labels(*self.labels, "round").inc()
            self.log.warning("weights round failed", epoch=record.epoch, version=record.version, error=repr(exc))
            self._last_failure = f"round of version {record.version} failed: {type(exc).__name__}: {exc}"
            self._ack(record.epoch, "recv", ok=False, version=record.version, error=f"{type(exc).__name__}: {exc}")
            return
        self._ack(record.epoch, "recv", version=record.version, seconds=time.perf_counter() - started)
        try:
            seconds = await self.engine.commit_broadcast(record.version, self.mode)
        except Exception as exc:  # reported, then raised: the worker fails if its engine died
            self.epoch = 0
            self._ack(record.epoch, "load", ok=False, version=record.version, error=f"{type(exc).__name__}: {exc}")
            raise
        if load:
            self.holds = (self.learner, record.version)
        if seconds:
            metrics.WEIGHT_SYNC_SECONDS.labels(*self.labels).observe(seconds)
        self._ack(record.epoch, "load", version=record.version, seconds=seconds)


# ---------------------------------------------------------------------------------------------------
# The learner's side


@dataclass
class RoundResult:
    version: int
    epoch: int = 0
    members: int = 0
    delivered: bool = False  # every member of the group received the version whole
    attempts: int = 0
    bytes: int = 0
    send_seconds: float = 0.0
    round_seconds: float = 0.0  # until every member received it
    failures: list[str] = field(default_factory=list)
    loaded: asyncio.Task | None = None  # ends (True: all of them) once every member loaded it behind its gate


class Coordinator:
    """The learner's end: it keeps the registrations, opens epochs, runs rounds. ``sender`` is the data
    plane (weights/sender.py: ``listen``, ``form``, ``send``, ``close_group``, ``meta``); ``leases()``
    returns the live members' leases (holder -> nonce); (edge, record) pairs to produce go to ``outbox``."""

    def __init__(
        self,
        sender: Any,
        leases: Callable[[], Awaitable[dict[str, int]]],
        *,
        address: str,
        port: int = 0,
        timeout_s: float = 60.0,
        first_epoch: int = 1,
        run: str = "",
    ) -> None:
        self.sender = sender
        self.leases = leases
        self.address = address
        self.port = port
        self.timeout_s = timeout_s
        self.run = run
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.epoch = first_epoch - 1
        self.registered: dict[tuple[str, int], WeightsMember] = {}  # (worker, nonce) -> newest registration
        self.left_out: dict[tuple[str, int], int] = {}  # (worker, nonce) -> the seq it was left out at
        self.group: tuple[EpochMember, ...] = ()  # the formed group's members; () when there is none
        self.backend = "gloo"  # the newest epoch's collective backend
        self.version = 0  # the newest version published (the one a late joiner is sent)
        self.delivered: set[tuple[str, int]] = set()  # members holding self.version
        self.rounds_failed = 0
        self._acks: dict[tuple[int, str, int], dict[str, WeightsAck]] = {}  # (epoch, step, version) -> worker -> ack
        self.nonce = secrets.randbits(48)  # this learner's incarnation, in every epoch it opens
        self._opened: set[int] = set()  # epochs this learner opened whose open record came back from the edge
        self._loading: asyncio.Future | None = None  # the last delivered round's loads (RoundResult.loaded)
        self._loading_since = 0.0  # when that round was delivered (monotonic)
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self.log = log.get(run=run, stage="learner")
        for reason in ROUND_FAILURE_REASONS:
            metrics.WEIGHT_ROUNDS_FAILED.labels(run, reason)

    # -- records from the edge

    async def on_record(self, record: Any) -> None:
        if isinstance(record, WeightsMember):
            self.registered[(record.worker, record.nonce)] = record
        elif isinstance(record, WeightsAck):
            if record.epoch in self._opened:  # an ack from before this learner opened the epoch is not for it
                self._acks.setdefault((record.epoch, record.step, record.version), {})[record.worker] = record
        elif isinstance(record, WeightsEpoch):
            if record.learner == self.nonce:
                self._opened.add(record.epoch)  # our own record back from the edge: answers follow it
            else:
                self.epoch = max(self.epoch, record.epoch)  # a predecessor's epochs: ours come after them
        else:
            return
        self._wake.set()

    async def live_members(self) -> list[WeightsMember]:
        """Registered members whose lease is alive and that were not left out of this registration."""
        leases = await self.leases()
        live = []
        for (worker, nonce), member in sorted(self.registered.items()):
            if leases.get(worker) != nonce:
                continue
            if self.left_out.get((worker, nonce), -1) >= member.seq:
                continue
            live.append(member)
        return live

    async def pending_joiners(self) -> bool:
        """Whether a live member is not in the group, or misses the newest version (a late joiner)."""
        if self.version <= 0 or self._loads_pending() > 0:
            return False  # nothing yet; or the group is still loading the last round (it says so when done)
        live = {(m.worker, m.nonce) for m in await self.live_members()}
        return bool(live) and (live != {(m.worker, m.nonce) for m in self.group} or not live <= self.delivered)

    # -- publishing

    async def publish(self, version: int, wait_loaded: bool = True, final: bool = False) -> RoundResult:
        """Send ``version`` to every live member: rebuild the group first when its membership changed or a
        round failed; on a failed round leave out who did not answer, rebuild, send again (MAX_ATTEMPTS).
        Returns once every member received it whole, and (``wait_loaded``) loaded it; else ``loaded``
        ends when they have (a member loads behind its gate, which may wait for a running turn: the learner
        need not). ``final``: the run's last version (an evaluator's engine loads it to evaluate it)."""
        async with self._lock:
            if version != self.version:
                self.delivered = set()
            self.version = version
            result = RoundResult(version=version)
            started = time.perf_counter()
            for attempt in range(1, MAX_ATTEMPTS + 1):
                result.attempts = attempt
                live = await self.live_members()
                if self._regroups(live) and self._loading is not None and (wait_s := self._loads_pending()) > 0:
                    # The group's members are still loading the last round behind their gates, and a member's
                    # control records wait behind its load: it would not answer a new epoch's open in time.
                    self.log.info("weights group: waiting for the last round's loads before re-forming",
                                  version=version, at_most_s=round(wait_s))
                    await asyncio.wait({self._loading}, timeout=wait_s)
                    live = await self.live_members()  # those that did not load it are left out now
                metrics.WEIGHT_GROUP_MEMBERS.labels(self.run).set(len(self.group))
                if not live:
                    self._drop_group()
                    metrics.WEIGHT_GROUP_MEMBERS.labels(self.run).set(0)
                    self.log.info("weights group has no members: version kept for late joiners", version=version)
                    return result
                if self._regroups(live):
                    reason = await self._form(live)
                    if reason:
                        self._failed(result, f"epoch {self.epoch}: {reason}", "form")
                        continue
                reason = await self._round(version, result, final)
                if reason is None:
                    result.delivered = True
                    result.round_seconds = time.perf_counter() - started
                    metrics.WEIGHT_ROUND_SECONDS.labels(self.run).observe(result.round_seconds)
                    if result.send_seconds > 0:
                        metrics.WEIGHT_ROUND_BYTES_PER_SECOND.labels(self.run).set(result.bytes / result.send_seconds)
                    if wait_loaded and result.loaded is not None:
                        await result.loaded
                    return result
                self._failed(result, f"epoch {self.epoch} version {version}: {reason}", "round")
                self._drop_group()
            self.log.error("weights not delivered", version=version, attempts=MAX_ATTEMPTS, failures=result.failures)
            result.round_seconds = time.perf_counter() - started
            return result

    def _loads_pending(self) -> float:
        """How long a new epoch still waits for the group's loads of the last round (0: they are over, or
        REGROUP_WAIT_S passed: a member whose load takes longer may be left out of the next epoch)."""
        if self._loading is None or self._loading.done():
            return 0.0
        return max(0.0, self._loading_since + REGROUP_WAIT_S - time.monotonic())

    def _regroups(self, live: list[WeightsMember]) -> bool:
        """Whether the live members are not the formed group's (the next round opens an epoch first)."""
        return {(m.worker, m.nonce) for m in live} != {(m.worker, m.nonce) for m in self.group}

    def _failed(self, result: RoundResult, reason: str, kind: str) -> None:
        result.failures.append(reason)
        self.rounds_failed += 1
        metrics.WEIGHT_ROUNDS_FAILED.labels(self.run, kind).inc()
        self.log.warning("weights round failed", reason=reason)

    def _emit(self, record: Any) -> None:
        self.outbox.put_nowait((SYNC_EDGE, record))

    def _drop_group(self) -> None:
        if self.group:
            self.sender.close_group()
        self.group = ()

    def _leave_out(self, epoch: int, members: list[EpochMember], reasons: dict[str, str]) -> None:
        """Leave ``members`` out of this registration and tell them now (``reasons``: worker -> why): the
        next epoch may never come (no member left), and a member must not wait for it to register again."""
        if not members:
            return
        for m in members:
            self.left_out[(m.worker, m.nonce)] = m.seq
        why = [reasons.get(m.worker, "left out") for m in members]
        self.log.warning("weights group members left out", epoch=epoch, members=[m.worker for m in members],
                         reasons=why)
        self._emit(WeightsEpoch(
            epoch=epoch, phase="left_out", learner=self.nonce, address=self.address, port=0, backend="",
            timeout_s=self.timeout_s, left_out=[EpochMember(worker=m.worker, nonce=m.nonce, seq=m.seq) for m in members],
            reasons=why,
        ))

    async def _wait_acks(self, epoch: int, step: str, version: int, workers: set[str], timeout_s: float,
                         until: asyncio.Future | None = None, every: bool = False,
                         nonces: dict[str, int] | None = None, on_dead: Callable[[], bool] | None = None,
                         ) -> dict[str, WeightsAck]:
        """The acks of ``workers`` for (epoch, step, version) once all answered, one said no (unless
        ``every``: then all of them, or the time), ``until`` is done, or ``timeout_s`` passed. A worker whose lease is gone (a dead member) counts as a silent one,
        checked every LEASE_CHECK_S, so a long wait (a load behind a closed gate) does not outlast it;
        ``on_dead()`` is called then, and the wait ends if it returns True."""
        key = (epoch, step, version)
        deadline = time.monotonic() + timeout_s
        next_lease_check = time.monotonic() + LEASE_CHECK_S
        waiting = set(workers)
        while True:
            got = self._acks.get(key, {})
            answered = set(got) & waiting
            refused = not every and any(not got[w].ok for w in answered)
            if answered == waiting or refused or (until is not None and until.done()):
                break
            now = time.monotonic()
            if now >= deadline:
                break
            if now >= next_lease_check:
                next_lease_check = now + LEASE_CHECK_S
                alive = await self.leases()
                # ``nonces``: the members the wait is for (a round's loads may outlast its group, rebuilt since).
                known = nonces if nonces is not None else {m.worker: m.nonce for m in self.group}
                still = {w for w in waiting if w not in known or alive.get(w) == known[w]}
                if still != waiting and on_dead is not None and on_dead():
                    waiting = still
                    break
                waiting = still
                continue
            self._wake.clear()
            wake = asyncio.ensure_future(self._wake.wait())
            waits = {wake} | ({until} if until is not None else set())
            try:
                await asyncio.wait(waits, timeout=min(deadline, next_lease_check) - now,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                wake.cancel()
        return {w: a for w, a in self._acks.get(key, {}).items() if w in workers}

    async def _form(self, live: list[WeightsMember]) -> str | None:
        """Open an epoch for ``live``; None once the group is formed, else why not."""
        self._drop_group()
        self.epoch += 1
        epoch = self.epoch
        # Evaluators' engines take the last ranks: the weights reach every rollout engine before them (in a
        # chain, or a tree, the last ranks forward to no one), so an engine busy evaluating slows no other copy.
        live = sorted(live, key=lambda m: m.role == "eval")
        metrics.WEIGHT_GROUP_EPOCH.labels(self.run).set(epoch)
        backend = group_backend(self.sender.backends, [m.backends for m in live])
        self.backend = backend
        port = self.sender.listen(self.address, self.port)
        names, dtypes, shapes = self.sender.meta()
        chunk_bytes = self.sender.chunk_bytes
        bucket_bytes = getattr(self.sender, "bucket_bytes", 0)
        candidates = [EpochMember(worker=m.worker, nonce=m.nonce, seq=m.seq, world_size=m.world_size) for m in live]
        left_out = [EpochMember(worker=w, nonce=n, seq=s) for (w, n), s in self.left_out.items()]
        common = {"epoch": epoch, "learner": self.nonce, "address": self.address, "port": port,
                  "backend": backend, "timeout_s": self.timeout_s, "chunk_bytes": chunk_bytes, "bucket_bytes": bucket_bytes,
                  "left_out": left_out}
        self._emit(WeightsEpoch(phase="open", members=candidates, **common))
        workers = {m.worker for m in candidates}
        # Every answer, or the time: one member's "unreachable" must not leave out the others still answering.
        reach_s = REACH_TIMEOUT_S + self.timeout_s / 4
        acks = await self._wait_acks(epoch, "reach", 0, workers, reach_s, every=True)
        reached = [m for m in candidates if m.worker in acks and acks[m.worker].ok]
        for a in acks.values():
            if not a.ok:
                self.log.error("weights group member cannot reach the learner", worker=a.worker, error=a.error)
        self._leave_out(epoch, [m for m in candidates if m not in reached], {
            m.worker: f"unreachable: {acks[m.worker].error}" if m.worker in acks
            else f"no answer to the epoch's open within {reach_s:.0f} s" for m in candidates})
        if not reached:
            self.sender.abandon()
            return "no member reached " + f"{self.address}:{port}"
        members, rank = [], 1
        for m in reached:
            members.append(EpochMember(worker=m.worker, nonce=m.nonce, seq=m.seq, rank_offset=rank,
                                       world_size=m.world_size))
            rank += m.world_size
        left_out = [EpochMember(worker=w, nonce=n, seq=s) for (w, n), s in self.left_out.items()]
        common["left_out"] = left_out
        self._emit(WeightsEpoch(phase="form", members=members, world_size=rank, names=names, dtypes=dtypes,
                                shapes=shapes, **common))
        forming = asyncio.ensure_future(self.sender.form(epoch, rank, backend))
        workers = {m.worker for m in members}
        waited = time.monotonic()
        acks = await self._wait_acks(epoch, "join", 0, workers, self.timeout_s, until=forming)
        if not forming.done() and set(acks) == workers and all(a.ok for a in acks.values()):
            # Every member says it joined: the learner's own side of the rendezvous returns in a moment (its
            # thread may be scheduled after their answers arrive, on a loaded host); wait for it, not fail.
            await asyncio.wait({forming}, timeout=max(0.0, waited + self.timeout_s - time.monotonic()) + SETTLE_S)
        if forming.done() and forming.exception() is None:
            self.group = tuple(members)
            self.log.info("weights group formed", epoch=epoch, members=[m.worker for m in members], world_size=rank,
                          address=f"{self.address}:{port}", backend=backend)
            metrics.WEIGHT_GROUP_MEMBERS.labels(self.run).set(len(members))
            return None
        return await self._formation_failed(epoch, members, forming, acks)

    async def _formation_failed(self, epoch: int, members: list[EpochMember], forming: asyncio.Future,
                                acks: dict[str, WeightsAck]) -> str:
        """Why ``epoch`` did not form, leaving out only those at fault: whose lease is gone, who refused to
        join (its own error), who stayed silent for the whole wait. The others were waiting in the rendezvous
        for the missing ranks: they are in the next epoch."""
        workers = {m.worker for m in members}
        refused = {w: a.error for w, a in acks.items() if not a.ok}
        cut_short = bool(refused) and not forming.done()
        if cut_short and workers - set(acks):
            # The others are still in the rendezvous until it times out (gloo cannot be told to stop): the next
            # epoch's records would wait behind it (longer than its "open" waits for answers). Wait it out.
            await asyncio.wait({forming}, timeout=self.timeout_s + SETTLE_S)
        # Whoever was in the rendezvous comes out of it now (its timeout, or the learner's store gone): its
        # answer says it is free for the next epoch.
        await self._wait_acks(epoch, "join", 0, workers - set(refused), SETTLE_S, every=True)
        answered = self._acks.get((epoch, "join", 0), {})
        alive = await self.leases()
        reasons = {}
        for m in members:
            # Its own answer first: a member that refused says why, whether or not its lease also lapsed
            # meanwhile (a heartbeat late on a loaded host would otherwise change the reason it is told).
            if m.worker in refused:
                reasons[m.worker] = f"join refused: {refused[m.worker]}"
            elif alive.get(m.worker) != m.nonce:
                reasons[m.worker] = "its lease expired (the worker died, or stopped renewing it)"
            elif m.worker not in answered:
                reasons[m.worker] = f"no answer to the join within {self.timeout_s:.0f} s"
        if forming.done():
            error = repr(forming.exception()) if forming.exception() is not None else "formed after the wait"
        else:
            error = f"not formed within {self.timeout_s:.0f} s"
        if cut_short:
            error = f"{sorted(refused)} refused to join ({'; '.join(refused.values())}); {error}"
        self._leave_out(epoch, [m for m in members if m.worker in reasons], reasons)
        self.sender.abandon(forming)
        return error

    async def _round(self, version: int, result: RoundResult, final: bool = False) -> str | None:
        """One round for the formed group; None when every member holds ``version``, else why not."""
        epoch, members = self.epoch, self.group
        workers = {m.worker for m in members}
        self._emit(WeightsRound(epoch=epoch, version=version, bytes=self.sender.total_bytes, final=final))
        started = time.perf_counter()
        sending = asyncio.ensure_future(self.sender.send(epoch, version))

        def member_died() -> bool:
            # NCCL gives no signal on a dead peer (its broadcast waits on): the lease does. Abort the group at
            # once (ncclCommAbort), not at the round's bound. On gloo a dead member's neighbours fail the round
            # at once by themselves; a lease that lapsed for a slow but live member must not cut a round there.
            if self.backend != "nccl":
                return False
            if not sending.done():
                self.log.warning("weights round: a member's lease expired mid-round, aborting the group",
                                 epoch=epoch, version=version)
                self.sender.abort_group()
            return True

        # The send ends when every chunk is out; a member that died or stalls makes a chunk fail within the
        # group's timeout (gloo raises); a dead member's lease ends the round (NCCL hangs else); past the
        # round's bound the sender aborts the group.
        received = await self._wait_acks(epoch, "recv", version, workers, self.timeout_s * 4, until=sending,
                                         on_dead=member_died)
        if not sending.done():
            await asyncio.wait({sending}, timeout=self.timeout_s * 4)
        if not sending.done():
            self.sender.abort_group()
        try:
            result.bytes = await sending
        except Exception as exc:  # noqa: BLE001 - the reason is what the round reports
            # The sender closed the group: a survivor still inside a chunk fails at once and says so; who stays
            # silent (dead, or stalled) is left out of the next epoch.
            self.sender.close_group()
            received = await self._wait_acks(epoch, "recv", version, workers, SETTLE_S, every=True)
            silent = [m for m in members if m.worker not in received]
            self._leave_out(epoch, silent, {m.worker: f"no answer after the round of version {version} failed"
                                            for m in silent})
            return f"send failed ({type(exc).__name__}: {exc}); no answer from {[m.worker for m in silent]}"
        result.send_seconds = time.perf_counter() - started
        received = await self._wait_acks(epoch, "recv", version, workers, self.timeout_s)
        silent = [m for m in members if m.worker not in received]
        failed = [a for a in received.values() if not a.ok]
        if silent or failed:
            self._leave_out(epoch, silent, {m.worker: f"no answer to the round of version {version} within "
                                            f"{self.timeout_s:.0f} s" for m in silent})
            return (f"no answer from {[m.worker for m in silent]}" if silent else "") + "; ".join(
                f"{a.worker}: {a.error}" for a in failed)
        result.epoch, result.members = epoch, len(members)
        result.loaded = self._loading = asyncio.ensure_future(self._loads(epoch, version, members))
        self._loading_since = time.monotonic()
        return None

    async def _loads(self, epoch: int, version: int, members: tuple[EpochMember, ...]) -> bool:
        """Whether every member of a delivered round loaded it; one that did not is left out (the group is
        rebuilt before the next round) and rejoins when it registers again."""
        loaded = await self._wait_acks(epoch, "load", version, {m.worker for m in members}, LOAD_TIMEOUT_S,
                                       nonces={m.worker: m.nonce for m in members})
        if version == self.version:  # a newer version since: the members hold an older one
            self.delivered |= {(m.worker, m.nonce) for m in members if m.worker in loaded and loaded[m.worker].ok}
        failed = [m for m in members if m.worker not in loaded or not loaded[m.worker].ok]
        if failed:
            self._leave_out(epoch, failed, {
                m.worker: f"did not load version {version}: " + (loaded[m.worker].error if m.worker in loaded
                                                                 else f"no answer within {LOAD_TIMEOUT_S:.0f} s")
                for m in failed})
            metrics.WEIGHT_ROUNDS_FAILED.labels(self.run, "load").inc()
            self.log.warning("members received a version but did not load it", version=version,
                             members=[m.worker for m in failed],
                             errors=[a.error for a in loaded.values() if not a.ok])
        return not failed


class MemberStage(Stage):
    """A worker stage that is only a member of the weights group, around an engine-like ``engine``
    (``weights.transfer.PlainReceiver``): benches and tests run receivers with it."""

    name = "rollout"
    subscribes = (SYNC_EDGE,)

    def __init__(self, engine: Any, mode: str = "pause") -> None:
        self.engine = engine
        self.mode = mode
        self.member: Member | None = None

    async def start(self, ctx: StageContext) -> None:
        self.member = Member(ctx.worker, self.engine, mode=self.mode, labels=(ctx.run, ctx.stage, ctx.worker))
        self.member.register()

    async def source(self, ctx: StageContext) -> Any:
        member = self._started()
        while True:
            yield [(SYNC_EDGE, await member.outbox.get())]

    async def on_broadcast(self, record: Any, ctx: StageContext) -> list:
        await self._started().on_record(record)
        return []

    def _started(self) -> Member:
        assert self.member is not None, "the worker calls start() first"
        return self.member

    def sample_metrics(self) -> None:
        """The heartbeat's look, as the rollout stage's: a member that can never take part fails its worker."""
        if self.member is not None and self.member.error:
            raise MemberFailed(self.member.error)

    def leases(self) -> dict[str, int]:
        return {MEMBER_LEASE: self.member.nonce} if self.member is not None else {}


class CoordinatorStage(Stage):
    """A worker stage that only runs a ``Coordinator`` (``make(ctx)`` builds it at start): benches and
    tests publish through ``stage.coordinator`` while the worker carries its records."""

    name = "learner"
    subscribes = (SYNC_EDGE,)

    def __init__(self, make: Callable[[Any], Coordinator]) -> None:
        self.make = make
        self.coordinator: Coordinator | None = None
        self.started = asyncio.Event()

    async def start(self, ctx: StageContext) -> None:
        self.coordinator = self.make(ctx)
        self.started.set()

    async def source(self, ctx: StageContext) -> Any:
        coordinator = self._started()
        while True:
            yield [await coordinator.outbox.get()]

    async def on_broadcast(self, record: Any, ctx: StageContext) -> list:
        await self._started().on_record(record)
        return []

    def _started(self) -> Coordinator:
        assert self.coordinator is not None, "the worker calls start() first"
        return self.coordinator

    async def close(self) -> None:
        if self.coordinator is not None:
            self.coordinator.sender.close()

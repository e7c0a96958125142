"""Weight sync: what one version costs through the file snapshot and through one broadcast round
(rollout.weight_transport = "broadcast", gloo), for the tiny model, ``mid`` and a Qwen2.5-0.5B-shaped model
(bf16, random weights), to 1, 2 and 4 receivers, with a raw gloo broadcast (``pg.broadcast``) of the same
bytes in the same run as the baseline. Two networks:

- ``loopback``: learner and receivers on this host, over 127.0.0.1 (the file path too);
- ``veth``: two network namespaces (tests/netns.py): the learner (and Redis) on host "a", the receivers on
  host "b", the learner's end of the link shaped to ``--link-rate`` (``tc qdisc ... tbf``): the model of the
  learner's network card, the bottleneck across machines. The bytes the learner put on its link per round
  are read from its veth's counter (``link_bytes_per_payload``). Needs root, ``ip`` and ``tc``; skipped with
  the reason otherwise.

Receivers are plain processes running the engine's receive code: ``weights.transfer.PlainReceiver``
in a ``weights.membership.MemberStage`` worker (the group, chunks, staging and control plane of a vLLM
engine, over Redis; not vLLM itself, whose load from the staged tensors is the same work as its load from a
file and is checked by tests/test_broadcast.py).

Per version:
- file (loopback only): the learner writes the snapshot (``save_weights_atomically`` under ``--dir``): its
  stall; then every receiver streams it (``safe_open``, as engines/weight_loader.py) at once; publish = write
  + slowest load.
- broadcast: ``Coordinator.publish`` as the learner calls it: announce, send, every member received the
  version whole (the learner's stall: that call; ``send``: its time on the wire, which on gloo's chain ends
  when the last member holds every byte), then every member loaded it (``publish``: until then; a member
  loads behind its gate while the learner trains on).
- raw gloo: the same bytes in the same chunk size between the same processes' count, from buffers already
  packed, no control plane, until every receiver answered that it holds them (``send``);
  ``broadcast_vs_raw`` = raw seconds / broadcast send seconds.
Every broadcast version is checked bit-exact at every receiver (a digest of its state against the learner's).
Goals (issue #29): broadcast_vs_raw >= 0.8 (loopback); 4 receivers <= 1.25x the time of 1 (over the shaped
link: the learner's network card); stall <= send + 5 %; a killed member costs <= 10 s (tests/test_broadcast.py).

``--buckets 64,1024,0`` (issue #40) measures instead the receive's memory per rollout.weight_sync_bucket_mb
(0: one bucket of the whole version, the device memory of a receive before #40): one receiver process, a
group of two, ``--versions`` rounds of the model's bytes (loopback, no control plane). Per setting: the bytes of
the receive's device buffers (counted by wrapping ``transfer.device_buffer``), the peak device memory
above the model on CUDA (``torch.cuda.max_memory_allocated``; on CPU the "device" is host memory: the
receiver's peak RSS growth instead), the round's seconds at the sender and the receive's at the receiver.

    .venv/bin/python bench/weight_sync.py [--models tiny,mid,qwen2.5-0.5b] [--receivers 1,2,4] [--versions 3]
        [--networks loopback,veth] [--link-rate 1gbit] [--link-versions 2]
        [--json-out bench/results/weight_sync.json]
    .venv/bin/python bench/weight_sync.py --models qwen2.5-0.5b --buckets 64,1024,0 [--device cpu|cuda]
        --json-out bench/results/weight_sync_buckets.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import multiprocessing
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "tests"))  # netns.py: the two hosts

import torch

from bench.report_json import emit

CHUNK_MB = 64.0  # rollout.weight_sync_chunk_mb's default
TIMEOUT_S = 60.0
RAW_DONE_TAG = 7  # a raw receiver's "I hold every byte" to the root


@dataclass
class Net:
    """Where the learner and the receivers run, and how they reach each other and Redis."""

    name: str
    learner_address: str
    url: str
    hosts: Any = None  # tests/netns.py TwoHosts on the veth network

    def learner_side(self) -> contextlib.AbstractContextManager:
        return self.hosts.inside("a") if self.hosts is not None else contextlib.nullcontext()

    def member_side(self) -> contextlib.AbstractContextManager:
        return self.hosts.inside("b") if self.hosts is not None else contextlib.nullcontext()

    @property
    def member_address(self) -> str:
        return self.hosts.address["b"] if self.hosts is not None else "127.0.0.1"

    def link_bytes(self) -> int | None:
        """Bytes the learner's side has put on its link so far (None on loopback: no link of its own)."""
        return self.hosts.tx_bytes("a") if self.hosts is not None else None


@contextlib.contextmanager
def veth(root: Path, rate: str) -> Iterator[Net]:
    """Two network namespaces, Redis on the learner's, the learner's end of the link shaped to ``rate``."""
    from netns import TwoHosts, why_not

    reason = why_not()
    if reason is not None:
        raise RuntimeError(reason)
    hosts = TwoHosts(root)
    try:
        hosts.create()
        hosts.limit_rate("a", rate)
        hosts.start_redis()
        yield Net("veth", hosts.address["a"], hosts.url, hosts)
    finally:
        hosts.teardown()


def model_state(name: str) -> dict[str, torch.Tensor]:
    """The weights a learner would send (a tied head once: both paths then carry the same bytes)."""
    from transformers import AutoModelForCausalLM

    if name.startswith("qwen2.5-"):
        from transformers import Qwen2ForCausalLM

        from bench.learner import shaped_config

        torch.manual_seed(0)
        model = Qwen2ForCausalLM(shaped_config(name, "bfloat16")).to(torch.bfloat16)
    else:
        from tinymodels.text import model_path

        model = AutoModelForCausalLM.from_pretrained(str(model_path(name)), torch_dtype=torch.float32)
    state, seen = {}, set()
    for key, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            state[key] = tensor.detach().contiguous()
    return state


def bump(state: dict[str, torch.Tensor], version: int) -> None:
    """Every weight changes between versions, as after an optimizer step."""
    with torch.no_grad():
        for tensor in state.values():
            if tensor.is_floating_point():
                tensor.add_(1e-3 * version)


def digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------
# Receiver processes


def file_receiver(conn) -> None:
    """Load each snapshot it is told of, as an engine streams it (safe_open); answer the seconds."""
    from engines.weight_loader import stream_tensors

    state: dict[str, torch.Tensor] = {}
    while (path := conn.recv()) is not None:
        started = time.perf_counter()
        for name, tensor in stream_tensors(path):  # into its own tensors, as an engine into its model
            if name in state:
                state[name].copy_(tensor)
            else:
                state[name] = tensor.clone()
        conn.send((time.perf_counter() - started, len(state)))


def member_process(url: str, run: str, worker: str, out, die_at: tuple[int, int] | None = None) -> None:
    asyncio.run(_member(url, run, worker, out, die_at))


async def _member(url: str, run: str, worker_id: str, out, die_at: tuple[int, int] | None) -> None:
    from pipeline.transport import connect
    from pipeline.worker import Worker
    from weights.membership import MemberStage
    from weights.transfer import PlainReceiver

    def on_chunk(index: int) -> None:  # ``die_at`` (version, chunk): a real SIGKILL of this member, mid-round
        if die_at is not None and (receiver.receiving, index) == tuple(die_at):
            os.kill(os.getpid(), signal.SIGKILL)

    receiver = PlainReceiver(on_chunk=on_chunk)
    commit = receiver.commit_broadcast

    reports: set[asyncio.Task] = set()

    async def commit_and_report(version: int, mode: str) -> float:
        seconds = await commit(version, mode)
        if not seconds:  # nothing loaded: it held this version already (a resend after a failed round)
            return seconds
        received = receiver.receive_seconds

        async def report() -> None:  # after the member's answer: the check is not part of the round
            out.put((worker_id, version, received, seconds, await asyncio.to_thread(digest, receiver.state)))

        task = asyncio.create_task(report())
        reports.add(task)
        task.add_done_callback(reports.discard)
        return seconds

    receiver.commit_broadcast = commit_and_report
    transport = await connect("redis", run=run, url=url)
    try:
        await Worker(MemberStage(receiver), transport, run=run, worker_id=worker_id, block_ms=100,
                     lease_ttl_ms=5000).serve()
    finally:
        await transport.close()


def raw_receiver(address: str, port: int, rank: int, world: int, total: int, chunk: int, rounds: int,
                 local_address: str, out) -> None:
    from weights.transfer import Group

    group = Group(address=address, port=port, rank=rank, world_size=world, backend="gloo", timeout_s=TIMEOUT_S,
                  local_address=local_address, key="raw")
    buffer = torch.empty(total, dtype=torch.uint8)
    done = torch.zeros(1, dtype=torch.int64)
    for _ in range(rounds):
        works = [group.broadcast(buffer[start:min(start + chunk, total)]) for start in range(0, total, chunk)]
        for work in works:
            group.wait(work)
        group.wait(group.send_to(0, done, RAW_DONE_TAG))
    out.put(rank)


# ---------------------------------------------------------------------------------------------------
# The three ways


def run_file(state: dict[str, torch.Tensor], receivers: int, versions: int, work_dir: Path) -> dict:
    from weights.snapshots import save_weights_atomically

    module = torch.nn.Module()
    for i, (name, tensor) in enumerate(state.items()):
        module.register_buffer(f"b{i}", tensor)
    ctx = multiprocessing.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(receivers)]
    procs = [ctx.Process(target=file_receiver, args=(child,)) for _, child in pipes]
    for p in procs:
        p.start()
    rows = []
    try:
        for version in range(1, versions + 2):  # the first is a warm-up
            bump(state, version)
            started = time.perf_counter()
            path = save_weights_atomically(module, work_dir / "weights" / f"v{version:06d}", state=state)
            write = time.perf_counter() - started
            for parent, _ in pipes:
                parent.send(str(path / "model.safetensors"))
            loads = [parent.recv()[0] for parent, _ in pipes]
            rows.append({"stall": write, "write": write, "load_max": max(loads), "publish": write + max(loads)})
    finally:
        for parent, _ in pipes:
            parent.send(None)
        for p in procs:
            p.join(timeout=60)
    return median_rows(rows[1:])


async def run_broadcast(state: dict[str, torch.Tensor], receivers: int, versions: int, net: Net,
                        kill: bool = False) -> dict:
    """``kill``: after the measured versions, one more in whose round a member (of at least two) is SIGKILLed
    a few chunks in: the failed round, the rebuild and the full resend to the survivors (``killed_member``)."""
    from pipeline.transport import connect
    from pipeline.worker import Worker
    from weights.membership import MEMBER_LEASE, Coordinator, CoordinatorStage
    from weights.sender import BroadcastSender, state_layout
    from weights.transfer import round_chunks

    run = f"bench-ws-{uuid.uuid4().hex[:8]}"
    sender = BroadcastSender(lambda: state, state_layout(state), chunk_bytes=int(CHUNK_MB * 2**20), timeout_s=TIMEOUT_S)
    stage = CoordinatorStage(lambda ctx: Coordinator(sender, lambda: ctx.leases(MEMBER_LEASE),
                                                     address=net.learner_address, timeout_s=TIMEOUT_S, run=run))
    transport = await connect("redis", run=run, url=net.url)
    learner = Worker(stage, transport, run=run, block_ms=100)
    serving = asyncio.create_task(learner.serve())
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    names = [f"member-{i}" for i in range(receivers)]
    kill = kill and receivers >= 2
    victim = names[len(names) // 2] if kill else None  # mid-chain: both sides of it see the break
    kill_version = versions + 2
    die_at = (kill_version, len(round_chunks(sender.layout, sender.chunk_bytes, "gloo")) // 2)
    procs = [ctx.Process(target=member_process, args=(net.url, run, name, out, die_at if name == victim else None))
             for name in names]
    with net.member_side():
        for p in procs:
            p.start()
    rows, form_seconds, killed = [], 0.0, {}
    try:
        await stage.started.wait()
        deadline = time.monotonic() + 180
        while {m.worker for m in await stage.coordinator.live_members()} != set(names):
            if time.monotonic() > deadline:
                raise RuntimeError("the receivers did not register within 180 s")
            await asyncio.sleep(0.1)  # polling their registrations, with a deadline
        for version in range(1, versions + 2):  # the first forms the group (timed apart) and warms up
            bump(state, version)
            expected = digest(state)
            link_before = net.link_bytes()
            started = time.perf_counter()
            result = await stage.coordinator.publish(version, wait_loaded=False)  # as the learner stage calls it
            stall = time.perf_counter() - started
            link_after = net.link_bytes()
            if not result.delivered or not await result.loaded:
                raise RuntimeError(f"version {version} not delivered: {result.failures}")
            loaded = time.perf_counter() - started
            reports = [await asyncio.to_thread(out.get, True, 60) for _ in names]
            if any(r[1] != version or r[4] != expected for r in reports):
                raise RuntimeError(f"version {version}: a receiver's weights differ from the learner's")
            if version == 1:
                form_seconds = stall - result.send_seconds
                continue
            rows.append({"stall": stall, "send": sender.last_send_seconds,
                         "receive_max": max(r[2] for r in reports), "load_max": max(r[3] for r in reports),
                         "publish": loaded, "control": stall - sender.last_send_seconds}
                        | ({"link_bytes": link_after - link_before} if link_before is not None else {}))
        if kill:
            bump(state, kill_version)
            expected = digest(state)
            started = time.perf_counter()
            result = await stage.coordinator.publish(kill_version, wait_loaded=False)
            if not result.delivered or not await result.loaded:
                raise RuntimeError(f"version {kill_version} not delivered after the kill: {result.failures}")
            publish = time.perf_counter() - started
            survivors = [n for n in names if n != victim]
            reports = [await asyncio.to_thread(out.get, True, 60) for _ in survivors]
            if {r[0] for r in reports} != set(survivors) or any(r[4] != expected for r in reports):
                raise RuntimeError(f"version {kill_version}, {victim} killed: the survivors' reports "
                                   f"{[(r[0], r[1], r[4] == expected) for r in reports]}; {result}")
            normal = statistics.median(r["publish"] for r in rows)
            killed = {"publish": round(publish, 4), "attempts": result.attempts, "members_after": result.members,
                      "extra_seconds": round(publish - normal, 4)}
    finally:
        learner.request_stop("bench over")
        await serving
        for p in procs:
            p.kill()
            p.join(timeout=30)
        await transport.delete_run()
        await transport.close()
    out_row = median_rows(rows)
    out_row["first_round_with_group_formation"] = round(form_seconds, 4)
    if killed:
        out_row["killed_member"] = killed
    return out_row


def run_raw(total: int, receivers: int, versions: int, net: Net) -> dict:
    """gloo's own broadcast (``pg.broadcast``) of the same bytes, until every receiver holds them."""
    from weights.transfer import Group, listen

    chunk = int(CHUNK_MB * 2**20)
    sock = listen(net.learner_address)
    port = sock.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    rounds = versions + 1
    procs = [ctx.Process(target=raw_receiver, args=(net.learner_address, port, r, receivers + 1, total, chunk, rounds,
                                                    net.member_address, out))
             for r in range(1, receivers + 1)]
    with net.member_side():
        for p in procs:
            p.start()
    group = Group(address=net.learner_address, port=port, rank=0, world_size=receivers + 1, backend="gloo",
                  timeout_s=TIMEOUT_S, local_address=net.learner_address, key="raw", listen_socket=sock)
    buffer = torch.randint(0, 255, (total,), dtype=torch.uint8)
    done = torch.zeros(1, dtype=torch.int64)
    rows = []
    for _ in range(rounds):
        link_before = net.link_bytes()
        started = time.perf_counter()
        works = [group.broadcast(buffer[start:min(start + chunk, total)]) for start in range(0, total, chunk)]
        for work in works:
            group.wait(work)
        for rank in range(1, receivers + 1):
            group.wait(group.recv_from(rank, done, RAW_DONE_TAG))
        row = {"send": time.perf_counter() - started}
        if link_before is not None:
            row["link_bytes"] = net.link_bytes() - link_before
        rows.append(row)
    for _ in procs:
        out.get(timeout=120)
    for p in procs:
        p.join(timeout=30)
    group.close()
    return median_rows(rows[1:])


def peak_rss(reset: bool = False) -> int:
    """This process's peak resident bytes (VmHWM); ``reset``: restart the peak from the current RSS first
    (a spawned process's ru_maxrss starts at its parent's, from before the exec)."""
    if reset:
        Path("/proc/self/clear_refs").write_text("5")
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def bucket_receiver(port: int, meta: Any, chunk: int, bucket: int, rounds: int, device: str, out) -> None:
    """Rank 1 of a group of two: ``rounds`` receives of the version with ``bucket`` (0: the whole stream), then
    a load into a model on ``device``; answers what its receives allocated and took."""
    from weights import transfer
    from weights.transfer import Group, Layout

    layout = Layout.of(*meta)
    allocated: list[int] = []
    real = transfer.device_buffer

    def counting(nbytes: int, where: torch.device) -> torch.Tensor:
        allocated.append(nbytes)
        return real(nbytes, where)

    transfer.device_buffer = counting
    cuda = device == "cuda"
    if cuda:  # NCCL's receive path (broadcasts into a device bucket), over gloo: one GPU cannot hold two NCCL ranks
        Group.chained = property(lambda self: False)
    # The engine's model, on its device (the load copies the staged version into it in place).
    model = {name: torch.zeros(shape, dtype=transfer.dtype_of(dtype), device=device)
             for name, dtype, shape in zip(layout.names, layout.dtypes, layout.shapes, strict=True)}
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base_device = torch.cuda.memory_allocated() if cuda else 0
    rss_before = peak_rss(reset=True)
    group = Group(address="127.0.0.1", port=port, rank=1, world_size=2, backend="gloo", timeout_s=TIMEOUT_S,
                  local_address="127.0.0.1", key="buckets")
    group.device = torch.device(device)  # the receive's buffers (gloo moves CUDA tensors through the host)
    staging, receive_s, load_s = None, [], []
    for version in range(1, rounds + 1):
        started = time.perf_counter()
        staging = transfer.receive(group, layout, chunk, epoch=1, version=version, staging=staging,
                                          bucket_bytes=bucket or layout.total)
        receive_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        for name, tensor in transfer.unpack(staging, layout):
            model[name].copy_(tensor, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        load_s.append(time.perf_counter() - started)
    out.put({
        "device_buffers": allocated[:1], "device_buffer_allocations": len(allocated),
        "peak_device_above_model": torch.cuda.max_memory_allocated() - base_device if cuda else None,
        "rss_growth": peak_rss() - rss_before,
        "receive_s": round(statistics.median(receive_s[1:] or receive_s), 4),
        "load_s": round(statistics.median(load_s[1:] or load_s), 4), "pinned": bool(staging.is_pinned()),
    })
    group.close()


def run_buckets(name: str, state: dict[str, torch.Tensor], buckets_mb: list[float], versions: int,
                device: str) -> list[dict]:
    """One receiver per bucket setting (a fresh process: its memory peaks are its own)."""
    from weights.sender import state_layout
    from weights.transfer import Group, listen, send

    layout = state_layout(state)
    chunk = int(CHUNK_MB * 2**20)
    names = layout.names
    if device == "cuda":
        Group.chained = property(lambda self: False)  # as the receiver: the broadcast path
    rows = []
    for bucket_mb in buckets_mb:
        bucket = int(bucket_mb * 2**20)
        sock = listen("127.0.0.1")
        port = sock.getsockname()[1]
        ctx = multiprocessing.get_context("spawn")
        out = ctx.Queue()
        meta = (layout.names, layout.dtypes, layout.shapes)
        proc = ctx.Process(target=bucket_receiver, args=(port, meta, chunk, bucket, versions + 1, device, out))
        proc.start()
        group = Group(address="127.0.0.1", port=port, rank=0, world_size=2, backend="gloo", timeout_s=TIMEOUT_S,
                      local_address="127.0.0.1", key="buckets", listen_socket=sock)
        rounds = []
        for version in range(1, versions + 2):  # the first is a warm-up
            started = time.perf_counter()
            send(group, (state[n] for n in names), layout, chunk, epoch=1, version=version)
            rounds.append(time.perf_counter() - started)
        got = out.get(timeout=600)
        proc.join(timeout=60)
        group.close()
        row = {"model": name, "bytes": layout.total, "bucket_mb": bucket_mb or "whole version", "device": device,
               "round_s": round(statistics.median(rounds[1:]), 4)} | got
        if got["peak_device_above_model"] is not None:  # the headroom check: one bucket (+ 1 MiB of headers)
            row["within_one_bucket"] = got["peak_device_above_model"] <= (bucket or layout.total) + 2**20
        rows.append(row)
        print(f"{name} bucket {row['bucket_mb']}: device buffer {got['device_buffers']}, round {row['round_s']} s, "
              f"rss growth {got['rss_growth'] / 2**20:.0f} MiB", file=sys.stderr)
    return rows


def median_rows(rows: list[dict]) -> dict:
    return {key: round(statistics.median(r[key] for r in rows), 4) for key in rows[0]}


def measure(name: str, state: dict[str, torch.Tensor], counts: list[int], versions: int, net: Net,
            work_dir: str | None, rate: str | None) -> list[dict]:
    total_bytes = sum(t.numel() * t.element_size() for t in state.values())
    gb = total_bytes / 1e9
    rows = []
    for receivers in counts:
        file_row = None
        if net.hosts is None:  # the file path needs a shared directory: on this host only
            with tempfile.TemporaryDirectory(dir=work_dir) as work:
                file_row = run_file(state, receivers, versions, Path(work))
        with net.learner_side():
            broadcast_row = asyncio.run(run_broadcast(state, receivers, versions, net, kill=receivers == max(counts)))
            raw_row = run_raw(total_bytes, receivers, versions, net)
        row = {
            "model": name, "network": net.name if rate is None else f"{net.name} {rate}", "bytes": total_bytes,
            "receivers": receivers, "broadcast": broadcast_row, "raw_gloo": raw_row,
            "seconds_per_gb": {"broadcast": round(broadcast_row["publish"] / gb, 3)},
            "broadcast_vs_raw": round(raw_row["send"] / broadcast_row["send"], 3),
            "stall_vs_send": round(broadcast_row["stall"] / broadcast_row["send"], 3),
        }
        if file_row is not None:
            row["file"] = file_row
            row["seconds_per_gb"]["file"] = round(file_row["publish"] / gb, 3)
        if "link_bytes" in broadcast_row:
            row["link_bytes_per_payload"] = {"broadcast": round(broadcast_row["link_bytes"] / total_bytes, 3),
                                             "raw_gloo": round(raw_row["link_bytes"] / total_bytes, 3)}
        rows.append(row)
        print(f"{name} x{receivers} {row['network']}: broadcast {broadcast_row['publish']:.3f} s "
              f"(send {broadcast_row['send']:.3f}, raw {raw_row['send']:.3f})"
              + (f", file {file_row['publish']:.3f} s" if file_row else ""), file=sys.stderr)
    return rows


def ratio_max_vs_min(results: list[dict], network: str, pick: Any) -> dict[str, float]:
    """Per model on ``network``: ``pick(row)`` at the most receivers over the same at the fewest."""
    out = {}
    for model in dict.fromkeys(r["model"] for r in results if r["network"] == network):
        mine = sorted((r for r in results if r["network"] == network and r["model"] == model),
                      key=lambda r: r["receivers"])
        if len(mine) > 1:
            out[model] = round(pick(mine[-1]) / pick(mine[0]), 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,mid,qwen2.5-0.5b")
    parser.add_argument("--receivers", default="1,2,4")
    parser.add_argument("--versions", type=int, default=3)
    parser.add_argument("--networks", default="loopback,veth")
    parser.add_argument("--link-rate", default="1gbit", help="the learner's link on the veth network (tc tbf rate)")
    parser.add_argument("--link-versions", type=int, default=2, help="measured versions over the shaped link")
    parser.add_argument("--redis-url", default=os.environ.get("ROLLSTREAM_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--dir", default=None, help="where file snapshots go (default: a temp dir on disk)")
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--buckets", default=None, help="MiB per bucket, 0 = whole version: the memory bench")
    parser.add_argument("--device", default="cpu", help="--buckets: the receiving model's device")
    args = parser.parse_args()
    if args.buckets is not None:
        buckets_mb = [float(b) for b in args.buckets.split(",")]
        rows = [row for name in args.models.split(",")
                for row in run_buckets(name, model_state(name), buckets_mb, args.versions, args.device)]
        emit({
            "table": {f"{r['model']} bucket {r['bucket_mb']}": {
                "device_buffer_bytes": r["device_buffers"][0] if r["device_buffers"] else 0,
                "peak_device_above_model_bytes": r["peak_device_above_model"], "rss_growth_bytes": r["rss_growth"],
                "round_s": r["round_s"], "receive_s": r["receive_s"], "load_s": r["load_s"]} for r in rows},
            "results": rows, "chunk_mb": CHUNK_MB, "versions": args.versions,
            "machine": {"cpus": os.cpu_count(), "load_average_1m": round(os.getloadavg()[0], 2),
                        "python": platform.python_version(), "torch": torch.__version__,
                        "cuda": torch.cuda.get_device_name() if args.device == "cuda" else None},
            "command": "python bench/weight_sync.py " + " ".join(sys.argv[1:]),
        }, args.json_out)
        return
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # here, before any process starts inside a namespace (it would die with it)
    counts = [int(n) for n in args.receivers.split(",")]
    models = args.models.split(",")
    networks = args.networks.split(",")
    link_name = f"veth {args.link_rate}"
    results: list[dict] = []
    skipped: dict[str, str] = {}
    states = {name: model_state(name) for name in models}
    if "loopback" in networks:
        net = Net("loopback", "127.0.0.1", args.redis_url)
        for name in models:
            results += measure(name, states[name], counts, args.versions, net, args.dir, None)
    if "veth" in networks:
        try:
            with tempfile.TemporaryDirectory() as root, veth(Path(root), args.link_rate) as net:
                for name in models:
                    results += measure(name, states[name], counts, args.link_versions, net, None, args.link_rate)
        except RuntimeError as exc:
            skipped["veth"] = f"not measured: {exc}"
            print(f"veth: {skipped['veth']}", file=sys.stderr)
    largest = models[-1]
    loop_rows = [r for r in results if r["network"] == "loopback" and r["model"] == largest]
    link_rows = [r for r in results if r["network"] == link_name and r["model"] == largest]
    scaling = {network: ratio_max_vs_min(results, network, lambda r: r["broadcast"]["publish"])
               for network in ("loopback", link_name)}
    round_scaling = {network: ratio_max_vs_min(results, network, lambda r: r["broadcast"]["stall"])
                     for network in ("loopback", link_name)}
    # The same ratio for raw gloo: what the network (and, on loopback, this machine's shared cores) allows.
    raw_scaling = {network: ratio_max_vs_min(results, network, lambda r: r["raw_gloo"]["send"])
                   for network in ("loopback", link_name)}
    killed = [r["broadcast"]["killed_member"] for r in results
              if r["model"] == largest and "killed_member" in r["broadcast"]]
    # One flat row per configuration, for bench/report.py's tables.
    table = {}
    for r in results:
        key = f"{r['model']} x{r['receivers']}" + ("" if r["network"] == "loopback" else f" {r['network']}")
        table[key] = {
            "broadcast_publish_s": r["broadcast"]["publish"], "broadcast_stall_s": r["broadcast"]["stall"],
            "broadcast_send_s": r["broadcast"]["send"], "raw_gloo_s": r["raw_gloo"]["send"],
            "broadcast_vs_raw": r["broadcast_vs_raw"],
        }
        if "file" in r:
            table[key] |= {"file_publish_s": r["file"]["publish"], "file_stall_s": r["file"]["stall"]}
        if "link_bytes_per_payload" in r:
            table[key] |= {f"link_bytes_per_payload_{k}": v for k, v in r["link_bytes_per_payload"].items()}
    emit({
        "table": table,
        "results": results,
        "broadcast_scaling_max_vs_min_receivers": scaling,
        "broadcast_round_scaling_max_vs_min_receivers": round_scaling,
        "raw_gloo_send_scaling_max_vs_min_receivers": raw_scaling,
        "goals": {
            "broadcast_vs_raw >= 0.8 (loopback)": all(r["broadcast_vs_raw"] >= 0.8 for r in loop_rows) if loop_rows
            else None,
            f"{max(counts)} receivers <= 1.25x the time of {min(counts)} ({link_name})":
                scaling[link_name][largest] <= 1.25 if largest in scaling[link_name] else None,
            "stall <= send + 5 %": all(r["stall_vs_send"] <= 1.05 for r in loop_rows + link_rows),
            "killed member <= 10 s": all(k["extra_seconds"] <= 10 for k in killed) if killed else None,
        },
        "goals_judged_on": largest,
        "skipped": skipped,
        "chunk_mb": CHUNK_MB, "versions": args.versions, "link_versions": args.link_versions,
        "machine": {"cpus": os.cpu_count(), "load_average_1m": round(os.getloadavg()[0], 2),
                    "python": platform.python_version(), "torch": torch.__version__},
        "command": "python bench/weight_sync.py " + " ".join(sys.argv[1:]),
    }, args.json_out)


if __name__ == "__main__":
    main()

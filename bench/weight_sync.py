"""Weight sync on one CPU host: what one version costs through the file snapshot and through one broadcast
round (rollout.weight_sync_mode = "broadcast", gloo over loopback), for the tiny model, ``mid`` and a
Qwen2.5-0.5B-shaped model (bf16, random weights), to 1, 2 and 4 receivers, with a raw gloo broadcast of the
same bytes in the same run as the baseline.

Receivers are plain processes running the engine's receive code: ``engines.weight_transfer.PlainReceiver``
in a ``pipeline.membership.MemberStage`` worker (the group, chunks, staging and control plane of a vLLM
engine, over this machine's Redis; not vLLM itself, whose load from the staged tensors is the same work as
its load from a file and is checked by tests/test_broadcast.py).

Per version:
- file: the learner writes the snapshot (``save_weights_atomically`` under ``--dir``): its stall; then every
  receiver streams it (``safe_open``, as engines/weight_loader.py) at once; publish = write + slowest load.
- broadcast: ``Coordinator.publish`` as the learner calls it: announce, send, every member received the
  version whole (the learner's stall: that call; ``send``: its time on the wire), then every member loaded
  it (``publish``: until then; a member loads behind its gate while the learner trains on).
- raw gloo: the same bytes in the same chunk size between the same processes' count, from buffers already
  packed, no control plane: ``broadcast_vs_raw`` = raw seconds / broadcast send seconds (goal >= 0.8).
Every broadcast version is checked bit-exact at every receiver (a digest of its state against the learner's).
Goals (issue #29): broadcast_vs_raw >= 0.8; 4 receivers <= 1.25x the time of 1; stall <= send + 5 %.

    .venv/bin/python bench/weight_sync.py [--models tiny,mid,qwen2.5-0.5b] [--receivers 1,2,4] [--versions 3]
        [--json-out bench/results/weight_sync.json]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.report_json import emit

CHUNK_MB = 64.0  # rollout.weight_sync_chunk_mb's default
TIMEOUT_S = 60.0


def model_state(name: str) -> dict[str, torch.Tensor]:
    """The weights a learner would send (a tied head once: both paths then carry the same bytes)."""
    from transformers import AutoModelForCausalLM

    if name.startswith("qwen2.5-"):
        from transformers import Qwen2ForCausalLM

        from bench.learner import shaped_config

        torch.manual_seed(0)
        model = Qwen2ForCausalLM(shaped_config(name, "bfloat16")).to(torch.bfloat16)
    else:
        from engines.tiny_model import model_path

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


def member_process(url: str, run: str, worker: str, out) -> None:
    asyncio.run(_member(url, run, worker, out))


async def _member(url: str, run: str, worker_id: str, out) -> None:
    from engines.weight_transfer import PlainReceiver
    from pipeline.membership import MemberStage
    from pipeline.transport import connect
    from pipeline.worker import Worker

    receiver = PlainReceiver()
    commit = receiver.commit_broadcast

    reports: set[asyncio.Task] = set()

    async def commit_and_report(version: int, mode: str) -> float:
        seconds = await commit(version, mode)
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


def raw_receiver(port: int, rank: int, world: int, total: int, chunk: int, rounds: int, out) -> None:
    from engines.weight_transfer import Group

    group = Group(address="127.0.0.1", port=port, rank=rank, world_size=world, backend="gloo", timeout_s=TIMEOUT_S,
                  local_address="127.0.0.1", key="raw")
    buffer = torch.empty(total, dtype=torch.uint8)
    for _ in range(rounds):
        works = [group.broadcast(buffer[start:min(start + chunk, total)]) for start in range(0, total, chunk)]
        for work in works:
            group.wait(work)
    out.put(rank)


# ---------------------------------------------------------------------------------------------------
# The three ways


def run_file(state: dict[str, torch.Tensor], receivers: int, versions: int, work_dir: Path) -> dict:
    from trainer.snapshots import save_weights_atomically

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


async def run_broadcast(state: dict[str, torch.Tensor], receivers: int, versions: int, url: str) -> dict:
    from pipeline.membership import MEMBER_LEASE, Coordinator, CoordinatorStage
    from pipeline.transport import connect
    from pipeline.worker import Worker
    from trainer.broadcast import BroadcastSender, state_layout

    run = f"bench-ws-{uuid.uuid4().hex[:8]}"
    sender = BroadcastSender(lambda: state, state_layout(state), chunk_bytes=int(CHUNK_MB * 2**20), timeout_s=TIMEOUT_S)
    stage = CoordinatorStage(lambda ctx: Coordinator(sender, lambda: ctx.leases(MEMBER_LEASE), address="127.0.0.1",
                                                     timeout_s=TIMEOUT_S, run=run))
    transport = await connect("redis", run=run, url=url)
    learner = Worker(stage, transport, run=run, block_ms=100)
    serving = asyncio.create_task(learner.serve())
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    names = [f"member-{i}" for i in range(receivers)]
    procs = [ctx.Process(target=member_process, args=(url, run, name, out)) for name in names]
    for p in procs:
        p.start()
    rows, form_seconds = [], 0.0
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
            started = time.perf_counter()
            result = await stage.coordinator.publish(version, wait_loaded=False)  # as the learner stage calls it
            stall = time.perf_counter() - started
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
                         "publish": loaded, "control": stall - sender.last_send_seconds})
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
    return out_row


def run_raw(total: int, receivers: int, versions: int) -> dict:
    from engines.weight_transfer import Group, listen

    chunk = int(CHUNK_MB * 2**20)
    sock = listen("127.0.0.1")
    port = sock.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    rounds = versions + 1
    procs = [ctx.Process(target=raw_receiver, args=(port, r, receivers + 1, total, chunk, rounds, out))
             for r in range(1, receivers + 1)]
    for p in procs:
        p.start()
    group = Group(address="127.0.0.1", port=port, rank=0, world_size=receivers + 1, backend="gloo",
                  timeout_s=TIMEOUT_S, local_address="127.0.0.1", key="raw", listen_socket=sock)
    buffer = torch.randint(0, 255, (total,), dtype=torch.uint8)
    rows = []
    for _ in range(rounds):
        started = time.perf_counter()
        works = [group.broadcast(buffer[start:min(start + chunk, total)]) for start in range(0, total, chunk)]
        for work in works:
            group.wait(work)
        rows.append({"send": time.perf_counter() - started})
    for _ in procs:
        out.get(timeout=120)
    for p in procs:
        p.join(timeout=30)
    group.close()
    return median_rows(rows[1:])


def median_rows(rows: list[dict]) -> dict:
    return {key: round(statistics.median(r[key] for r in rows), 4) for key in rows[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,mid,qwen2.5-0.5b")
    parser.add_argument("--receivers", default="1,2,4")
    parser.add_argument("--versions", type=int, default=3)
    parser.add_argument("--redis-url", default=os.environ.get("ROLLSTREAM_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--dir", default=None, help="where file snapshots go (default: a temp dir on disk)")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    counts = [int(n) for n in args.receivers.split(",")]
    results = []
    for name in args.models.split(","):
        state = model_state(name)
        total_bytes = sum(t.numel() * t.element_size() for t in state.values())
        gb = total_bytes / 1e9
        for receivers in counts:
            with tempfile.TemporaryDirectory(dir=args.dir) as work:
                file_row = run_file(state, receivers, args.versions, Path(work))
            broadcast_row = asyncio.run(run_broadcast(state, receivers, args.versions, args.redis_url))
            raw_row = run_raw(total_bytes, receivers, args.versions)
            row = {
                "model": name, "bytes": total_bytes, "receivers": receivers,
                "file": file_row, "broadcast": broadcast_row, "raw_gloo": raw_row,
                "seconds_per_gb": {"file": round(file_row["publish"] / gb, 3),
                                   "broadcast": round(broadcast_row["publish"] / gb, 3)},
                "broadcast_vs_raw": round(raw_row["send"] / broadcast_row["send"], 3),
                "stall_vs_send": round(broadcast_row["stall"] / broadcast_row["send"], 3),
            }
            results.append(row)
            print(f"{name} x{receivers}: file {file_row['publish']:.3f} s, broadcast {broadcast_row['publish']:.3f} s "
                  f"(send {broadcast_row['send']:.3f}, raw {raw_row['send']:.3f})", file=sys.stderr)
    by = {(r["model"], r["receivers"]): r for r in results}
    scaling = {
        name: round(by[(name, max(counts))]["broadcast"]["publish"] / by[(name, min(counts))]["broadcast"]["publish"], 3)
        for name in args.models.split(",") if (name, max(counts)) in by and (name, min(counts)) in by
    }
    # The same ratio for raw gloo: what this machine's cores allow (receivers and sender share them).
    raw_scaling = {
        name: round(by[(name, max(counts))]["raw_gloo"]["send"] / by[(name, min(counts))]["raw_gloo"]["send"], 3)
        for name in scaling
    }
    largest = [r for r in results if r["model"] == args.models.split(",")[-1]]
    # One flat row per configuration, for bench/report.py's tables.
    table = {
        f"{r['model']} x{r['receivers']}": {
            "file_publish_s": r["file"]["publish"], "broadcast_publish_s": r["broadcast"]["publish"],
            "file_stall_s": r["file"]["stall"], "broadcast_stall_s": r["broadcast"]["stall"],
            "broadcast_send_s": r["broadcast"]["send"], "raw_gloo_s": r["raw_gloo"]["send"],
            "broadcast_vs_raw": r["broadcast_vs_raw"],
        }
        for r in results
    }
    emit({
        "table": table,
        "results": results,
        "broadcast_scaling_max_vs_min_receivers": scaling,
        "raw_gloo_send_scaling_max_vs_min_receivers": raw_scaling,
        "goals": {
            "broadcast_vs_raw >= 0.8": all(r["broadcast_vs_raw"] >= 0.8 for r in largest),
            f"{max(counts)} receivers <= 1.25x the time of {min(counts)}": all(v <= 1.25 for v in scaling.values()),
            "stall <= send + 5 %": all(r["stall_vs_send"] <= 1.05 for r in largest),
        },
        "goals_judged_on": args.models.split(",")[-1],
        "chunk_mb": CHUNK_MB, "versions": args.versions,
        "machine": {"cpus": os.cpu_count(), "load_average_1m": round(os.getloadavg()[0], 2),
                    "python": platform.python_version(), "torch": torch.__version__},
        "command": "python bench/weight_sync.py " + " ".join(sys.argv[1:]),
    }, args.json_out)


if __name__ == "__main__":
    main()

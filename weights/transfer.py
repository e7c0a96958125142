"""Weights by collective broadcast (``rollout.weight_transport = "broadcast"``): learner rank 0 sends each
version once to every rollout engine of one group, gloo on CPU and NCCL on GPUs through the same calls.

The one module that knows vLLM's weight-transfer API (``vllm.distributed.weight_transfer`` of vLLM 0.32; it
changed between releases): ``RollstreamTransfer`` is registered with vLLM's ``WeightTransferEngineFactory``
as ``BACKEND`` and the engines start with it (``engine_args``); the rollout side calls ``join``,
``receive_version``, ``commit`` and ``drop_staged`` here, never vLLM's names. vLLM imports this module in the engine-core process (through the
worker extension, ``engines.weight_loader``), so it imports nothing of the stages.

Wire format (``Layout``): the parameters in the order the epoch lists them, back to back in one byte
stream, each aligned to ``ALIGN`` bytes; the stream goes out in chunks (``round_chunks``: at most
``chunk_bytes``, a large parameter straight from its memory, small ones packed into a buffer), IN_FLIGHT at
once, after a header (epoch, version, bytes) that every receiver checks. A receiver takes the stream bucket by
bucket into one device buffer (``bucket_bytes``, rollout.weight_sync_bucket_mb), stages the whole of it in host
memory (pinned beside a GPU), and touches the model only once every byte is in (``commit``): a round that fails
half-way leaves the weights as they were, and a round's extra device memory is one bucket.

How the bytes travel: the learner's network card must carry each byte once, however many engines there are.
On gloo a round is a pipelined chain over point-to-point sends (a tag per chunk): rank 0 sends each chunk to
rank 1 only, rank r receives it from r - 1, acks it, and forwards it from its staging buffer to r + 1 (at most
IN_FLIGHT chunks unacked on a hop: the chain runs at its slowest hop), and the last rank answers rank 0 with
the header once it holds every byte, so the learner's send ends when every member holds
the version (gloo's own broadcast is a binomial tree: its root sends ceil(log2(world)) copies, each relay waits
for a whole buffer before it forwards). The chain's chunks are at most PIPELINE_CHUNK, so it fills in
(ranks - 1) short chunks: a round takes ~ bytes / bandwidth + (ranks - 1) * chunk / bandwidth. On NCCL a round
is ``broadcast`` calls (NCCL's ring broadcast is pipelined already); the rest is one code path.

The group: a TCPStore on a port the learner bound before advertising it, and an explicit gloo device on
the address each side reaches the other by (gloo's default device resolves the host name, which is often
127.0.0.1 and would hang a cross-host group).
"""

from __future__ import annotations

import bisect
import math
import socket
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

BACKEND = "rollstream"
"""The name ``RollstreamTransfer`` is registered under with vLLM's WeightTransferEngineFactory."""
ALIGN = 64  # every parameter starts at a multiple of this in the stream: any dtype views it in place
DIRECT_MIN = 1 << 20  # a parameter this large is sent from its own memory, not copied into a packed chunk
IN_FLIGHT = 4  # chunks posted at once on each hop (sends, receives, forwards)
PIPELINE_CHUNK = 4 << 20  # a gloo chain's chunk at most: the chain fills in (ranks - 1) of them
BUCKET_BYTES = 1 << 30  # a receive's device buffer at most (rollout.weight_sync_bucket_mb's default); peers use 0.5-1 GB
# The chain's tags (gloo matches a send to a receive by peer and tag): the header, chunk i's data, its marker
# and its ack, the last rank's answer to rank 0.
HEADER_TAG, DATA_TAG, MARKER_TAG, ACK_TAG, DONE_TAG = 0, 1, 1 << 28, 2 << 28, 3 << 28
HEADER_MAGIC = 0x52_4F_4C_4C  # "ROLL"
STAGED = Path("/rollstream-broadcast/staged")
"""The path ``EngineBase.load_weights`` is given for "the version this engine received by broadcast"."""


class BroadcastError(RuntimeError):
    """A broadcast round or a group could not complete (a peer died, stalled, or sent another round)."""


# ---------------------------------------------------------------------------------------------------
# The wire format


@dataclass(frozen=True)
class Layout:
    """Where each parameter sits in the byte stream of one version (the same on every rank)."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]  # torch dtype names, e.g. "float32"
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...] = field(init=False)
    sizes: tuple[int, ...] = field(init=False)
    total: int = field(init=False)

    def __post_init__(self) -> None:
        offsets, sizes, at = [], [], 0
        for dtype, shape in zip(self.dtypes, self.shapes, strict=True):
            size = math.prod(shape) * dtype_of(dtype).itemsize
            offsets.append(at)
            sizes.append(size)
            at = -(-(at + size) // ALIGN) * ALIGN
        object.__setattr__(self, "offsets", tuple(offsets))
        object.__setattr__(self, "sizes", tuple(sizes))
        object.__setattr__(self, "total", at)

    @classmethod
    def of(cls, names: Iterable[str], dtypes: Iterable[str], shapes: Iterable[Iterable[int]]) -> Layout:
        return cls(tuple(names), tuple(dtypes), tuple(tuple(int(d) for d in s) for s in shapes))

    @classmethod
    def of_tensors(cls, named: Iterable[tuple[str, torch.Tensor]]) -> Layout:
        pairs = list(named)
        return cls.of([n for n, _ in pairs], [dtype_name(t.dtype) for _, t in pairs], [t.shape for _, t in pairs])

    def chunks(self, chunk_bytes: int) -> list[tuple[int, int, int | None]]:
        """The broadcasts of one round, (start, end, parameter) in stream order, none over ``chunk_bytes``:
        a parameter of at least DIRECT_MIN bytes goes on its own, straight from its memory (cut in
        ``chunk_bytes`` slices; ``parameter`` is its index); smaller ones are packed together into one
        buffer (``parameter`` None). Both ends compute the same plan from the same layout."""
        plan: list[tuple[int, int, int | None]] = []
        pack_start: int | None = None
        pack_end = 0
        for index, (offset, size) in enumerate(zip(self.offsets, self.sizes, strict=True)):
            direct = size >= min(DIRECT_MIN, chunk_bytes)
            if pack_start is not None and (direct or offset + size - pack_start > chunk_bytes):
                plan.append((pack_start, pack_end, None))
                pack_start = None
            if direct:
                plan += [(start, min(start + chunk_bytes, offset + size), index)
                         for start in range(offset, offset + size, chunk_bytes)]
            elif size:
                pack_start = offset if pack_start is None else pack_start
                pack_end = offset + size
        if pack_start is not None:
            plan.append((pack_start, pack_end, None))
        return plan


def round_chunks(layout: Layout, chunk_bytes: int, backend: str) -> list[tuple[int, int, int | None]]:
    """One round's chunks on ``backend``: every rank computes the same plan. A gloo chain forwards a chunk
    only once it is whole, so its chunks are small (PIPELINE_CHUNK); ``chunk_bytes`` stays the cap."""
    return layout.chunks(min(chunk_bytes, PIPELINE_CHUNK) if backend == "gloo" else chunk_bytes)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")  # noqa: TRY004 - a bad name, not a bad type
    return dtype


def unpack(staging: torch.Tensor, layout: Layout) -> Iterator[tuple[str, torch.Tensor]]:
    """The parameters of a received stream: views into it, no copy."""
    for name, dtype, shape, offset, size in zip(
        layout.names, layout.dtypes, layout.shapes, layout.offsets, layout.sizes, strict=True
    ):
        yield name, staging[offset : offset + size].view(dtype_of(dtype)).view(shape)


def _header(epoch: int, version: int, total: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([HEADER_MAGIC, epoch, version, total], dtype=torch.int64, device=device)


# ---------------------------------------------------------------------------------------------------
# The group


def listen(address: str, port: int = 0) -> socket.socket:
    """Bind and listen on ``address:port`` (0: any free port) before the address is advertised."""
    if address in ("0.0.0.0", "::", ""):
        raise BroadcastError(
            f"cannot advertise {address!r} to the group's members: set rollout.weight_sync_address to an "
            "address they can reach"
        )
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
    except OSError as exc:
        sock.close()
        raise BroadcastError(
            f"cannot bind {address}:{port} for the weights group ({exc.strerror or exc}): set "
            "rollout.weight_sync_address to an address of this host (and weight_sync_port to a free port)"
        ) from None
    sock.listen(128)
    return sock


class Group:
    """One member's end of a weights group: a gloo or NCCL process group outside torch.distributed's
    global state. Rank 0 (the learner) owns the store on its pre-bound socket."""

    def __init__(
        self,
        *,
        address: str,
        port: int,
        rank: int,
        world_size: int,
        backend: str,
        timeout_s: float,
        local_address: str,
        key: str,
        listen_socket: socket.socket | None = None,
    ) -> None:
        from torch.distributed import PrefixStore, TCPStore  # pyright: ignore[reportPrivateImportUsage]  (public API)

        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.timeout = timedelta(seconds=timeout_s)
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        if rank == 0:
            if listen_socket is None:
                raise ValueError("rank 0 opens the group on the socket it bound before advertising it")
            store = TCPStore(address, port, world_size, is_master=True, timeout=self.timeout,
                             wait_for_workers=False, master_listen_fd=listen_socket.detach())
        else:
            store = TCPStore(address, port, world_size, is_master=False, timeout=self.timeout,
                             wait_for_workers=False)
        self.store = store
        self.pg: Any = None  # a torch ProcessGroupGloo / ProcessGroupNCCL (their methods are the C++ bindings')
        prefix = PrefixStore(f"rollstream/{key}", store)
        if backend == "gloo":
            from torch.distributed import ProcessGroupGloo

            options = ProcessGroupGloo._Options()  # pyright: ignore[reportAttributeAccessIssue]  (the binding's)
            options._timeout = self.timeout
            options._devices = [ProcessGroupGloo.create_device(hostname=local_address)]
            self.pg = ProcessGroupGloo(prefix, rank, world_size, options)
        elif backend == "nccl":
            from torch.distributed import ProcessGroupNCCL

            options = ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            self.pg = ProcessGroupNCCL(prefix, rank, world_size, options)
        else:
            raise ValueError(f"weights group backend {backend!r}: choose gloo or nccl")
        # A first collective: every rank is connected once this returns (NCCL connects lazily otherwise).
        self.broadcast(torch.zeros(1, dtype=torch.int64, device=self.device)).wait()

    @property
    def chained(self) -> bool:
        """Whether a round is a chain of point-to-point sends (gloo) rather than NCCL's broadcast."""
        return self.backend == "gloo"

    def broadcast(self, tensor: torch.Tensor) -> Any:
        from torch.distributed import BroadcastOptions

        opts = BroadcastOptions()
        opts.rootRank, opts.rootTensor, opts.timeout = 0, 0, self.timeout
        return self.pg.broadcast([tensor], opts)

    def send_to(self, rank: int, tensor: torch.Tensor, tag: int) -> Any:
        return self.pg.send([tensor], rank, tag)

    def recv_from(self, rank: int, tensor: torch.Tensor, tag: int) -> Any:
        return self.pg.recv([tensor], rank, tag)

    def wait(self, work: Any) -> None:
        if not work.wait(self.timeout):
            raise BroadcastError(f"a chunk took over {self.timeout.total_seconds():.0f} s")

    def abort(self) -> None:
        """Break off whatever runs on the group (NCCL: ncclCommAbort). Gloo's does not close its connections:
        they close once nothing refers to the group or its pending operations (``close``, ``_round_error``)."""
        for method in ("abort", "shutdown"):
            fn = getattr(self.pg, method, None)
            if fn is not None:
                try:
                    fn()
                    return
                except Exception:  # noqa: BLE001, S112 - the next way, then give up: it is going anyway
                    continue

    def close(self) -> None:
        self.abort()
        self.pg = None
        self.store = None


def send(group: Group, tensors: Iterable[torch.Tensor], layout: Layout, chunk_bytes: int, *, epoch: int,
         version: int) -> int:
    """Rank 0: the header, then ``tensors`` (``_send``); any failure raises BroadcastError, without the frames
    that hold the round's pending operations (see ``_round_error``)."""
    try:
        return _send(group, tensors, layout, chunk_bytes, epoch=epoch, version=version)
    except Exception as exc:  # noqa: BLE001 - re-raised below as BroadcastError
        error = _round_error(exc)
    raise BroadcastError(error)


def receive(group: Group, layout: Layout, chunk_bytes: int, *, epoch: int, version: int,
            on_chunk: Any = None, staging: torch.Tensor | None = None,
            bucket_bytes: int = BUCKET_BYTES) -> torch.Tensor:
    """Ranks > 0: the whole version into host staging, through a device buffer of one bucket (``_receive``);
    any failure raises BroadcastError, without the frames that hold the round's pending operations (see
    ``_round_error``)."""
    try:
        return _receive(group, layout, chunk_bytes, epoch=epoch, version=version, on_chunk=on_chunk,
                        staging=staging, bucket_bytes=bucket_bytes)
    except Exception as exc:  # noqa: BLE001 - re-raised below as BroadcastError
        error = _round_error(exc)
    raise BroadcastError(error)


def _round_error(exc: Exception) -> str:
    """The message of a failed round. The exception itself is not re-raised: its traceback's frames hold the
    round's pending sends and receives, and gloo closes a group's connections only once nothing refers to it
    (its abort does not): while they live, a closed group leaves its chain neighbours waiting out their
    timeout instead of failing at once."""
    return str(exc) if isinstance(exc, BroadcastError) else f"{type(exc).__name__}: {exc}"


class _Hop:
    """One chunk on its way to the next rank of a chain: the data, then a marker, and that rank's ack.

    gloo fails a pending operation when its connection breaks, but not one already on the wire (an unbound
    buffer being written, or being read: ``Pair::signalException`` signals neither), which would then wait
    out the group's timeout. So no rank ever blocks on those: a sender waits on the next rank's ack of a
    chunk (a small receive, pending until it comes), after which its data and marker are written whole; a
    receiver waits on the chunk's marker (sent after the data on the same connection), after which the data
    is in."""

    def __init__(self, group: Group, rank: int, data: torch.Tensor, index: int) -> None:
        self.group, self.data = group, data
        self.ack = torch.empty(1, dtype=torch.int64, device=group.device)
        self.ack_work = group.recv_from(rank, self.ack, ACK_TAG + index)
        self.data_work = group.send_to(rank, data, DATA_TAG + index)
        self.marker_work = group.send_to(rank, torch.full((1,), index, dtype=torch.int64, device=group.device),
                                         MARKER_TAG + index)

    def finish(self) -> torch.Tensor:
        """Once the next rank holds the chunk: the data tensor (a pack buffer is free again)."""
        for work in (self.ack_work, self.data_work, self.marker_work):
            self.group.wait(work)
        return self.data


def _send(group: Group, tensors: Iterable[torch.Tensor], layout: Layout, chunk_bytes: int, *, epoch: int,
          version: int) -> int:
    """Rank 0: the header, then ``tensors`` (in ``layout`` order) in the round's chunks; returns the bytes
    sent. Large parameters go straight from their memory; small ones are packed into a buffer while the
    previous chunks are on the wire (IN_FLIGHT at once). On a chain every chunk goes to rank 1 only, and the
    send ends once the last rank answers that it holds the whole version."""
    header = _header(epoch, version, layout.total, group.device)
    if group.chained and group.world_size < 2:
        return 0
    group.wait(group.send_to(1, header, HEADER_TAG) if group.chained else group.broadcast(header))
    flat = []
    for tensor, size in zip(tensors, layout.sizes, strict=True):
        view = tensor.detach().contiguous().view(-1).view(torch.uint8)
        if view.numel() != size:
            raise BroadcastError(f"a parameter has {view.numel()} bytes, the epoch's layout says {size}")
        flat.append(view if view.device == group.device else view.to(group.device))
    plan = round_chunks(layout, chunk_bytes, group.backend)
    pack_bytes = max((end - start for start, end, index in plan if index is None), default=0)
    buffers: list[torch.Tensor] = []
    in_flight: list[tuple[Any, torch.Tensor | None]] = []  # (a _Hop or a broadcast's work, the pack buffer)

    def finish(entry: tuple[Any, torch.Tensor | None]) -> None:
        work, buffer = entry
        if isinstance(work, _Hop):
            work.finish()
        else:
            group.wait(work)
        if buffer is not None:
            buffers.append(buffer)

    def post(tensor: torch.Tensor, index: int) -> Any:
        return _Hop(group, 1, tensor, index) if group.chained else group.broadcast(tensor)

    for chunk, (start, end, index) in enumerate(plan):
        if len(in_flight) >= IN_FLIGHT:
            finish(in_flight.pop(0))
        if index is not None:
            offset = layout.offsets[index]
            in_flight.append((post(flat[index][start - offset : end - offset], chunk), None))
            continue
        buffer = buffers.pop() if buffers else torch.empty(pack_bytes, dtype=torch.uint8, device=group.device)
        for i in range(bisect.bisect_left(layout.offsets, start), len(layout.offsets)):
            offset, size = layout.offsets[i], layout.sizes[i]
            if offset >= end:
                break
            buffer[offset - start : offset - start + size].copy_(flat[i])
        in_flight.append((post(buffer[: end - start], chunk), buffer))
    while in_flight:
        finish(in_flight.pop(0))
    if group.chained:  # the last rank holds every byte: the round is over for every member
        answer = _header(0, 0, 0, group.device)
        group.wait(group.recv_from(group.world_size - 1, answer, DONE_TAG))
        if not torch.equal(answer, header):
            raise BroadcastError(f"the last rank answered {answer.tolist()}, expected {header.tolist()}")
    if group.device.type == "cuda":  # NCCL's wait only orders streams: the learner must not write the weights yet
        torch.cuda.synchronize(group.device)
    return layout.total


def bucket_span(plan: list[tuple[int, int, int | None]], bucket_bytes: int) -> int:
    """The size of a receive's device buffer: ``bucket_bytes``, but never under the round's largest chunk (one
    chunk is one collective call, cut by the sender) nor over the whole stream."""
    largest = max((end - start for start, end, _ in plan), default=0)
    total = plan[-1][1] - plan[0][0] if plan else 0
    return min(max(bucket_bytes, largest), total)


def buckets(plan: list[tuple[int, int, int | None]], span: int) -> list[tuple[int, int]]:
    """The plan's chunks cut into buckets, (first, end) chunk indices: consecutive chunks whose bytes (from
    the first's start to the last's end) fit ``span``."""
    cut: list[tuple[int, int]] = []
    first = 0
    for index, (_, end, _) in enumerate(plan):
        if end - plan[first][0] > span:
            cut.append((first, index))
            first = index
    if plan:
        cut.append((first, len(plan)))
    return cut


def device_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A receive's one device-side buffer (a bucket): every byte a round receives lands here first. Tests
    wrap this to count what a receive allocates on the group's device."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def host_staging(nbytes: int, pin: bool) -> torch.Tensor:
    """The whole version, in host memory (pinned beside a CUDA group: its copies from the device bucket are
    asynchronous DMA, ~40x a pageable copy, ../shared/NOTES-gpu.md)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


def _receive(group: Group, layout: Layout, chunk_bytes: int, *, epoch: int, version: int,
             on_chunk: Any = None, staging: torch.Tensor | None = None,
             bucket_bytes: int = BUCKET_BYTES) -> torch.Tensor:
    """Ranks > 0: the header (checked), then the whole stream into host staging (``staging`` when it fits: a
    buffer reused across rounds), returned. The bytes arrive bucket by bucket into one device buffer of at
    most ``bucket_span`` bytes, each chunk copied into the host staging once whole: the extra device memory of
    a round is one bucket, whatever the model's size (a whole-model device buffer would need ~15 GB beside
    vLLM's KV cache for a 7B bf16 model). On a chain each chunk is acked to the previous rank and forwarded to
    the next one from the host staging as soon as it is whole. ``on_chunk(index)``: called as each chunk's
    receive is posted (fault tests stop there)."""
    header = _header(0, 0, 0, group.device)
    previous = group.rank - 1
    following = group.rank + 1 if group.rank + 1 < group.world_size else None
    group.wait(group.recv_from(previous, header, HEADER_TAG) if group.chained else group.broadcast(header))
    got = [int(v) for v in header.tolist()]
    want = [HEADER_MAGIC, epoch, version, layout.total]
    if got != want:
        raise BroadcastError(f"expected round (epoch {epoch}, version {version}, {layout.total} bytes), "
                             f"the sender sent (epoch {got[1]}, version {got[2]}, {got[3]} bytes)")
    cuda = group.device.type == "cuda"
    if (staging is None or staging.numel() != layout.total or staging.device.type != "cpu"
            or (cuda and not staging.is_pinned())):
        staging = host_staging(layout.total, pin=cuda)
    plan = round_chunks(layout, chunk_bytes, group.backend)
    span = bucket_span(plan, bucket_bytes)
    bucket = device_buffer(span, group.device)
    if not group.chained:
        for first, end in buckets(plan, span):
            base = plan[first][0]
            works: list[Any] = []
            for index in range(first, end):
                start, stop, _ = plan[index]
                if on_chunk is not None:
                    on_chunk(index)
                works.append(group.broadcast(bucket[start - base : stop - base]))
                if len(works) >= IN_FLIGHT:
                    group.wait(works.pop(0))
            for work in works:
                group.wait(work)
            # Queued on the current stream, after the broadcasts (their wait orders it); the next bucket's
            # broadcasts wait for it in turn (NCCL's stream waits on the current one before each collective).
            top = plan[end - 1][1]
            staging[base:top].copy_(bucket[: top - base], non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize(group.device)  # the staging is read on the host next (the load)
        return staging
    small: list[Any] = []  # the header forwarded, the acks: tiny sends, waited on at the end
    if following is not None:
        small.append(group.send_to(following, header, HEADER_TAG))
    forwards: list[_Hop] = []
    for first, end in buckets(plan, span):
        base = plan[first][0]
        receives: list[tuple[Any, Any]] = []  # (data, marker) of the chunks posted ahead
        posted = first
        for index in range(first, end):
            # Receives posted ahead (gloo moves a chunk only once its receive is posted), within the bucket: the
            # next bucket reuses its memory. A slow next rank holds the forwards back, hence the receives, hence
            # the previous rank: the chain runs at its slowest hop.
            while posted < min(end, index + IN_FLIGHT):
                if on_chunk is not None:
                    on_chunk(posted)
                chunk_start, chunk_end, _ = plan[posted]
                marker = torch.empty(1, dtype=torch.int64, device=group.device)
                receives.append((group.recv_from(previous, bucket[chunk_start - base : chunk_end - base],
                                                 DATA_TAG + posted),
                                 group.recv_from(previous, marker, MARKER_TAG + posted)))
                posted += 1
            data, marker = receives.pop(0)
            group.wait(marker)  # pending until the chunk is whole (see _Hop)
            group.wait(data)
            start, stop, _ = plan[index]
            staging[start:stop].copy_(bucket[start - base : stop - base])
            small.append(group.send_to(previous, torch.full((1,), index, dtype=torch.int64, device=group.device),
                                       ACK_TAG + index))
            if len(small) > IN_FLIGHT:
                group.wait(small.pop(0))
            if following is not None:
                forwards.append(_Hop(group, following, staging[start:stop], index))
                if len(forwards) > IN_FLIGHT:
                    forwards.pop(0).finish()
    for hop in forwards:
        hop.finish()
    for work in small:
        group.wait(work)
    if following is None:
        group.wait(group.send_to(0, header, DONE_TAG))
    return staging


class PlainReceiver:
    """The engine's side of a round without vLLM: the same group, receive and staging, into a state dict
    this process holds (``state``, ``version``; its tensors on ``device``). Benches and tests run members with
    it; ``on_chunk`` is passed to ``receive``. ``commits``: (version, seconds) of every version it loaded.
    ``bucket_bytes``: the receive's device buffer when the epoch does not say (``WeightsEpoch.bucket_bytes``)."""

    def __init__(self, on_chunk: Any = None, *, bucket_bytes: int = BUCKET_BYTES,
                 device: str | torch.device = "cpu") -> None:
        self.version = 0
        self.bucket_bytes = bucket_bytes
        self.device = torch.device(device)
        self.state: dict[str, torch.Tensor] = {}
        self.group: Group | None = None
        self.layout: Layout | None = None
        self.chunk_bytes = 0
        self.on_chunk = on_chunk
        self.staged: tuple[int, torch.Tensor] | None = None
        self.buffer: torch.Tensor | None = None  # the staging buffer, reused
        self.commits: list[tuple[int, float]] = []
        self.receive_seconds = 0.0
        self.receiving = 0  # the version of the round in progress (or the last one)

    async def join_broadcast(self, epoch: Any, me: Any, local_address: str) -> None:
        import asyncio

        def join() -> None:
            self.close()
            self.layout = Layout.of(epoch.names, epoch.dtypes, epoch.shapes)
            self.chunk_bytes = epoch.chunk_bytes
            self.bucket_bytes = getattr(epoch, "bucket_bytes", 0) or self.bucket_bytes
            self.group = Group(address=epoch.address, port=epoch.port, rank=me.rank_offset, world_size=epoch.world_size,
                               backend=epoch.backend, timeout_s=epoch.timeout_s, local_address=local_address,
                               key=f"epoch-{epoch.epoch}")

        await asyncio.to_thread(join)

    async def receive_broadcast(self, epoch: int, version: int, timeout_s: float, load: bool | None = None) -> None:
        import asyncio
        import time

        if self.group is None or self.layout is None:
            raise BroadcastError("no weights group: join an epoch first")
        self.staged = None
        self.receiving = version
        started = time.perf_counter()
        try:
            staging = await asyncio.to_thread(receive, self.group, self.layout, self.chunk_bytes, epoch=epoch,
                                              version=version, on_chunk=self.on_chunk, staging=self.buffer,
                                              bucket_bytes=self.bucket_bytes)
        except BaseException:
            self.close()
            raise
        self.receive_seconds = time.perf_counter() - started
        self.buffer = staging
        if (version > self.version) if load is None else load:
            self.staged = (version, staging)

    async def commit_broadcast(self, version: int, mode: str) -> float:
        import asyncio
        import time

        if self.staged is None or self.staged[0] != version:
            return 0.0
        started = time.perf_counter()
        _, staging = self.staged
        self.staged = None

        def load() -> None:  # into its own tensors, as an engine into its model (in a thread: the loop answers)
            assert self.layout is not None, "a round is staged only after the group formed"
            for name, tensor in unpack(staging, self.layout):
                mine = self.state.get(name)
                if mine is not None and mine.shape == tensor.shape and mine.dtype == tensor.dtype:
                    mine.copy_(tensor, non_blocking=True)
                else:
                    self.state[name] = tensor.to(self.device, copy=True)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

        await asyncio.to_thread(load)
        self.version = version
        seconds = time.perf_counter() - started
        self.commits.append((version, seconds))
        return seconds

    def close(self) -> None:
        self.staged = None
        if self.group is not None:
            self.group.close()
            self.group = None


# ---------------------------------------------------------------------------------------------------
# vLLM's side: the engine registered with its factory, and the calls the rollout makes


@dataclass
class RollstreamInitInfo:
    """One epoch's group, as each engine joins it (vLLM's ``init_weight_transfer_engine`` payload)."""

    address: str
    port: int
    rank_offset: int  # this member's first rank; an engine with several workers takes consecutive ranks
    world_size: int
    backend: str
    epoch: int
    timeout_s: float
    chunk_bytes: int
    local_address: str
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    bucket_bytes: int = 0  # the receive's device buffer at most (0: BUCKET_BYTES); rollout.weight_sync_bucket_mb


@dataclass
class RollstreamUpdateInfo:
    """One round (vLLM's ``update_weights`` payload): which version the sender is about to send."""

    epoch: int
    version: int
    load: bool = True  # False: receive and drop (this engine holds the version already)
    drop: bool = False  # receive nothing, drop what is staged (the engine will not load it)


def _transfer_engine_class() -> type:
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    class RollstreamTransfer(WeightTransferEngine):
        """Receive a whole version into host staging, one bucket at a time through the device
        (``update_weights``), load it into the model only in ``finish_weight_update``. On CPU there is no accelerator to synchronize (vLLM's base
        ``update_weights`` would call ``torch.accelerator.synchronize()`` and raise there)."""

        init_info_cls = RollstreamInitInfo
        update_info_cls = RollstreamUpdateInfo
        supports_draft_weight_update = False

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.group: Group | None = None
            self.info: RollstreamInitInfo | None = None
            self.layout: Layout | None = None
            self.staged: tuple[int, torch.Tensor] | None = None  # (version, the whole stream, in host memory)
            self.buffer: torch.Tensor | None = None  # the host staging kept for the next round (no page faults)

        def init_transfer_engine(self, init_info: RollstreamInitInfo) -> None:
            self.shutdown()
            pc = self.parallel_config
            rank = pc.data_parallel_index * pc.world_size + pc.rank + init_info.rank_offset
            self.layout = Layout.of(init_info.names, init_info.dtype_names, init_info.shapes)
            self.group = Group(
                address=init_info.address, port=init_info.port, rank=rank, world_size=init_info.world_size,
                backend=init_info.backend, timeout_s=init_info.timeout_s, local_address=init_info.local_address,
                key=f"epoch-{init_info.epoch}",
            )
            self.info = init_info

        def start_weight_update(self) -> None:
            pass  # the model is touched only once every byte is in (finish_weight_update)

        def update_weights(self, update_info: dict[str, Any]) -> None:
            self.receive_weights(self.parse_update_info(update_info))
            if self.group is not None and self.group.device.type == "cuda":
                torch.cuda.synchronize()

        def receive_weights(self, update_info: RollstreamUpdateInfo) -> None:
            if update_info.drop:
                self.staged = None
                return
            if self.group is None or self.info is None or self.layout is None:
                raise BroadcastError("no weights group: join an epoch first")
            if update_info.epoch != self.info.epoch:
                raise BroadcastError(f"round of epoch {update_info.epoch}, this engine is in epoch {self.info.epoch}")
            self.staged = None
            try:
                staging = receive(self.group, self.layout, self.info.chunk_bytes, epoch=update_info.epoch,
                                  version=update_info.version, staging=self.buffer,
                                  bucket_bytes=self.info.bucket_bytes or BUCKET_BYTES)
            except BaseException:
                self.shutdown()  # a failed collective leaves the group unusable: the learner opens another
                raise
            if update_info.load:
                self.staged = (update_info.version, staging)
            # Host memory (pinned beside a GPU): kept, the device holds one bucket only during a round.
            self.buffer = staging

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload.inplace import reload_weights

            if self.staged is None:
                return  # dropped on purpose (load = False), or the round failed: the weights stay as they were
            _, staging = self.staged
            self.staged = None
            assert self.layout is not None, "a round is staged only after the group formed"
            reload_weights(self.vllm_config, self.model, weights_iterator=unpack(staging, self.layout),
                           weights_path=None, is_checkpoint_format=True)
            repack_tied_lm_head(self.model)

        def shutdown(self) -> None:
            self.staged = None
            self.buffer = None
            if self.group is not None:
                self.group.close()
                self.group = None

    return RollstreamTransfer


def repack_tied_lm_head(model: Any) -> None:
    """vLLM-CPU prepacks linear weights: with tied embeddings lm_head's prepacked copy is stale after a
    reload (it keeps sampling from the old weights), so it is re-packed."""
    config = getattr(model, "config", None)
    if getattr(config, "tie_word_embeddings", False) and hasattr(model, "lm_head"):
        quant = getattr(model.lm_head, "quant_method", None)
        if quant is not None:
            quant.process_weights_after_loading(model.lm_head)


def register() -> None:
    """Make ``BACKEND`` known to vLLM's factory in this process (the engine core imports this module)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, _transfer_engine_class())


def engine_args() -> dict[str, Any]:
    """What an engine starts with to take broadcasts (cheap: nothing opens until an epoch is joined)."""
    from vllm.config.weight_transfer import WeightTransferConfig

    return {"weight_transfer_config": WeightTransferConfig(backend=BACKEND)}


async def join(engine: Any, init: RollstreamInitInfo, timeout_s: float) -> None:
    """The AsyncLLM ``engine`` joins an epoch's group (returns once every rank is connected)."""
    import asyncio
    from dataclasses import asdict

    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

    await asyncio.wait_for(engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=asdict(init))),
                           timeout=timeout_s)


async def receive_version(engine: Any, epoch: int, version: int, *, load: bool, timeout_s: float) -> None:
    """The AsyncLLM ``engine`` receives one version into its staging buffer (the model is not touched).
    ``load`` False: receive and drop it (a member that holds this version already still takes part, a
    broadcast being a collective); ``commit`` is then a no-op. ``timeout_s``: the whole round's bound (each
    chunk has the group's own)."""
    import asyncio

    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    await asyncio.wait_for(engine.start_weight_update(), timeout=timeout_s)
    update = WeightTransferUpdateRequest(update_info={"epoch": epoch, "version": version, "load": load})
    await asyncio.wait_for(engine.update_weights(update), timeout=timeout_s)  # vLLM ends the session if it fails


async def commit(engine: Any, timeout_s: float) -> None:
    """Load the staged version into the model (vLLM's ``finish_weight_update``)."""
    import asyncio

    await asyncio.wait_for(engine.finish_weight_update(), timeout=timeout_s)


async def drop_staged(engine: Any, timeout_s: float) -> None:
    """Drop a received version the engine will not load, and end vLLM's update session."""
    import asyncio

    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    await asyncio.wait_for(engine.update_weights(WeightTransferUpdateRequest(
        update_info={"epoch": 0, "version": 0, "drop": True})), timeout=timeout_s)
    await asyncio.wait_for(engine.finish_weight_update(), timeout=timeout_s)

"""The learner's in-memory weight publish on a GPU: one CUDA buffer another process maps once (CUDA IPC).

A file snapshot costs about 1.1 s for a 0.5 B model (GPU -> host -> safetensors -> GPU, measured on one GPU),
which would dominate a GPU cycle. Here the learner copies its weights into one preallocated device buffer (a
device-to-device copy, one fused launch) and a reader on the same GPU, which mapped that buffer once through a
CUDA IPC handle, copies them into its own parameters: a publish costs two device-memory copies, no host trip.

- ``CudaIpcPublisher(model)`` (learner side): lays every parameter of ``model`` out in one buffer (256-byte
  aligned), ``handle()`` is the ``WeightsIpcHandle`` record to send once, ``publish(version)`` rewrites it.
- ``CudaIpcReader(handle)`` (engine side): maps the buffer; ``load_into(params)`` copies a consistent version
  into the reader's tensors and says which version it got. A vLLM worker would pass ``reader.weights()`` to its
  model's ``load_weights`` the same way (not wired here: this build's rollout runs vLLM on CPU).

Consistency without a round trip: the buffer's first 8 bytes are a sequence counter, odd while the learner
writes, even (2 * version + 2) when a version is complete: a seqlock. A reader copies, then reads the counter
again, and copies again if the learner started writing in between; the learner never waits for readers.

The handle's fields are torch's own ``UntypedStorage._share_cuda_`` / ``_new_shared_cuda`` (what
torch.multiprocessing sends, minus the pickle). The learner's process must outlive the readers' mappings.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping

import torch

from pipeline.records import IpcTensor, WeightsIpcHandle

ALIGN = 256  # bytes: every weight starts on a boundary any dtype view accepts (and the GPU likes)
HEADER = ALIGN  # the sequence counter (int64) lives in the first bytes
DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                                     torch.int64, torch.int32, torch.int8, torch.uint8)}


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


class CudaIpcPublisher:
    """Learner side: the shared buffer holding ``model``'s parameters, rewritten on every ``publish``."""

    def __init__(self, model: torch.nn.Module) -> None:
        named = list(model.named_parameters())
        self.params = [p for _, p in named]
        devices = {p.device for p in self.params}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            raise ValueError(f"CUDA IPC publishes a model on one CUDA device; its parameters are on {sorted(map(str, devices))}")
        self.device = next(iter(devices))
        layout, offset = [], HEADER
        for name, p in named:
            layout.append(IpcTensor(name=name, dtype=str(p.dtype).removeprefix("torch."), shape=list(p.shape), offset=offset))
            offset = _aligned(offset + p.numel() * p.element_size())
        self.layout = layout
        self.buffer = torch.zeros(offset, dtype=torch.uint8, device=self.device)
        self.sequence = self.buffer[:8].view(torch.int64)
        self.views = _views(self.buffer, layout)

    def handle(self) -> WeightsIpcHandle:
        """The record a reader maps the buffer with (send it once; it stays valid while this object lives)."""
        (device, handle, size, offset, counter_handle, counter_offset, event_handle,
         event_sync) = self.buffer.untyped_storage()._share_cuda_()
        return WeightsIpcHandle(device=device, handle=handle, size_bytes=size, offset_bytes=offset,
                                ref_counter_handle=counter_handle, ref_counter_offset=counter_offset,
                                event_handle=event_handle or b"", event_sync_required=bool(event_sync),
                                tensors=self.layout)

    def publish(self, version: int) -> None:
        """Copy the current parameters into the buffer as ``version``; returns when the copy is complete on the
        device, so a reader that sees the even counter sees all of this version."""
        self.sequence.fill_(2 * version + 1)  # odd: writing
        torch.cuda.synchronize(self.device)  # the odd mark lands before any weight changes
        with torch.no_grad():
            torch._foreach_copy_(list(self.views), [p.detach() for p in self.params])
        torch.cuda.synchronize(self.device)
        self.sequence.fill_(2 * version + 2)
        torch.cuda.synchronize(self.device)


class CudaIpcReader:
    """Engine side: the learner's buffer, mapped from a ``WeightsIpcHandle`` (same GPU, another process)."""

    def __init__(self, handle: WeightsIpcHandle) -> None:
        unknown = sorted({t.dtype for t in handle.tensors} - set(DTYPES))
        if unknown:
            raise ValueError(f"weights_ipc handle: unsupported dtype(s) {unknown}; known: {sorted(DTYPES)}")
        torch.cuda.init()
        storage = torch.UntypedStorage._new_shared_cuda(
            handle.device, handle.handle, handle.size_bytes, handle.offset_bytes, handle.ref_counter_handle,
            handle.ref_counter_offset, handle.event_handle, handle.event_sync_required,
        )
        self.buffer = torch.empty(0, dtype=torch.uint8, device=f"cuda:{handle.device}").set_(storage)
        if self.buffer.numel() < max((_end(t) for t in handle.tensors), default=HEADER):
            raise ValueError(f"weights_ipc handle: its layout runs past the {self.buffer.numel()}-byte buffer")
        self.sequence = self.buffer[:8].view(torch.int64)
        self.views = dict(zip((t.name for t in handle.tensors), _views(self.buffer, handle.tensors), strict=True))

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) views of the shared buffer, no copy (a reader that holds them sees later versions)."""
        return iter(self.views.items())

    def load_into(self, params: Mapping[str, torch.Tensor], *, timeout: float = 10.0) -> int:
        """Copy every weight into ``params`` (same names and shapes) from one complete version; returns it.
        Copies again while the learner writes (a seqlock), for at most ``timeout`` seconds."""
        missing = sorted(set(self.views) - set(params))
        if missing:
            raise KeyError(f"weights_ipc: the reader has no parameter(s) {missing[:5]} of the learner's layout")
        names = list(self.views)
        targets, sources = [params[n] for n in names], [self.views[n] for n in names]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            before = int(self.sequence.item())
            if before == 0:
                raise LookupError("weights_ipc: the learner has published no version into this buffer yet")
            if before % 2:  # being written: a copy takes milliseconds, look again
                continue
            with torch.no_grad():
                torch._foreach_copy_(targets, sources)
            torch.cuda.synchronize(self.buffer.device)
            if int(self.sequence.item()) == before:
                return before // 2 - 1
        raise TimeoutError(f"weights_ipc: no complete version within {timeout} s (the learner kept writing)")


def _end(t: IpcTensor) -> int:
    numel = 1
    for size in t.shape:
        numel *= size
    return t.offset + numel * DTYPES[t.dtype].itemsize


def _views(buffer: torch.Tensor, layout: list[IpcTensor]) -> list[torch.Tensor]:
    return [buffer[t.offset : _end(t)].view(DTYPES[t.dtype]).view(t.shape) for t in layout]

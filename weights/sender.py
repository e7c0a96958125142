"""The learner's end of the weights group (``rollout.weight_transport = "broadcast"``): rank 0 of every
epoch. It binds its port before the epoch is advertised, forms the group, and sends each version as one
round of packed chunks (the wire format of ``weights/transfer.py``): on gloo (CPU) a pipelined chain
through the members, so the learner's network card carries each byte once however many members there are;
on NCCL (the learner and every member on CUDA) NCCL's own broadcast. ``weights/membership.py`` (the ``Coordinator``) decides
when; this class only moves bytes, in threads of its own, so the learner's event loop stays free.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from weights import transfer
from weights.transfer import Group, Layout


class BroadcastSender:
    """``weights()`` returns the state to send (name -> tensor; called in a sender thread at each round,
    on every learner rank when it is a collective); ``layout`` its names, dtypes and shapes."""

    def __init__(
        self,
        weights: Callable[[], Mapping[str, torch.Tensor]],
        layout: Layout,
        *,
        chunk_bytes: int,
        timeout_s: float,
        cuda: bool = False,
        bucket_bytes: int = transfer.BUCKET_BYTES,
    ) -> None:
        self.weights = weights
        self.layout = layout
        self.chunk_bytes = chunk_bytes
        self.bucket_bytes = bucket_bytes  # told to the members in each epoch: their receive's device buffer
        self.timeout_s = timeout_s
        self.backends = ["nccl", "gloo"] if cuda else ["gloo"]
        self.group: Group | None = None
        self.last_send_seconds = 0.0
        self._socket: socket.socket | None = None
        self._address = ""
        self._port = 0
        # Threads of its own: a group that never forms blocks one until its timeout, and must not take the
        # default executor's threads the trainer runs in.
        self._threads = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="weights-group")

    @property
    def total_bytes(self) -> int:
        return self.layout.total

    def meta(self) -> tuple[list[str], list[str], list[list[int]]]:
        return list(self.layout.names), list(self.layout.dtypes), [list(s) for s in self.layout.shapes]

    def listen(self, address: str, port: int = 0) -> int:
        """Bind ``address:port`` (0: a free port) for the next epoch; returns the port to advertise."""
        self._close_socket()
        self._socket = transfer.listen(address, port)
        self._address, self._port = address, self._socket.getsockname()[1]
        return self._port

    async def form(self, epoch: int, world_size: int, backend: str = "gloo") -> None:
        """Open the group as rank 0 on the bound socket; returns once every member is connected."""
        sock, self._socket = self._socket, None
        if sock is None:
            raise transfer.BroadcastError("listen() first: the port is bound before it is advertised")

        def open_group() -> Group:
            return Group(address=self._address, port=self._port, rank=0, world_size=world_size, backend=backend,
                         timeout_s=self.timeout_s, local_address=self._address, key=f"epoch-{epoch}",
                         listen_socket=sock)

        self.group = await asyncio.get_running_loop().run_in_executor(self._threads, open_group)

    def abandon(self, forming: asyncio.Future | None = None) -> None:
        """Give up an epoch that did not form: its socket closes; a group that forms after all is closed."""
        self._close_socket()
        if forming is not None:
            def close_late(future: asyncio.Future) -> None:
                if not future.cancelled() and future.exception() is None and self.group is not None:
                    self.close_group()

            forming.add_done_callback(close_late)

    async def send(self, epoch: int, version: int) -> int:
        """One round: the state as packed chunks to every member; returns the bytes sent (on gloo once the
        chain's last member answered that it holds them all)."""
        group = self.group
        if group is None:
            raise transfer.BroadcastError("no weights group formed")

        def run() -> int:
            nonlocal group
            assert group is not None  # (checked above; cleared only after the send)
            state = self.weights()
            tensors = (state[name] for name in self.layout.names)
            started = time.perf_counter()
            try:
                sent = transfer.send(group, tensors, self.layout, self.chunk_bytes, epoch=epoch,
                                            version=version)
            except Exception as exc:  # noqa: BLE001 - re-raised below, without the frames that hold the group
                error = str(exc) if isinstance(exc, transfer.BroadcastError) else f"{type(exc).__name__}: {exc}"
            else:
                self.last_send_seconds = time.perf_counter() - started
                return sent
            # Drop every reference to the group (a traceback's frames would keep it): gloo then closes its
            # connections and the survivors' receives fail at once instead of at their timeout.
            group = None
            self.close_group()
            raise transfer.BroadcastError(error)

        return await asyncio.get_running_loop().run_in_executor(self._threads, run)

    def abort_group(self) -> None:
        """Break off a round that outlived its bound (NCCL has no timeout of its own here)."""
        if self.group is not None:
            self.group.abort()

    def close_group(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.close()

    def close(self) -> None:
        self.close_group()
        self._close_socket()
        self._threads.shutdown(wait=False, cancel_futures=True)

    def _close_socket(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def state_layout(state: Mapping[str, Any]) -> Layout:
    """The wire layout of a model's state (global shapes: an FSDP DTensor's shape is the whole one)."""
    return Layout.of_tensors((name, tensor) for name, tensor in state.items())

"""The trainer in a child process (``learner.own_process``): the same ``Trainer``, behind a pipe.

Why: in a one-process run (memory transport, ``make demo``) every stage's event loop and the learner's Python
share one interpreter lock. On a small model the learner's forward and backward are mostly Python dispatch,
so that process could never use more than one core, whatever the machine has. Here the learner's compute runs
in a process of its own and the learner stage keeps everything else: buffering, staleness, acks, the
checkpoint schedule, metrics.jsonl, the announcements.

``TrainerProcess`` has the methods and counters the learner stage uses (``load``, ``train_generation_batch``,
``publish``, ``write_snapshot``, ``save_checkpoint``, ``close``; ``step``, ``last_checkpoint_step``,
``accumulating``, ``version``, ``run``), each call one request over a pipe and one reply, in msgpack (no
pickle crosses the boundary). Snapshots, checkpoints and ``final/`` are written by the child into the same
``output_dir``. The training gauges and the staleness histogram are set here from the rows and groups, so
``/metrics`` reads as with the trainer in process.

The child is started in its own session, so the terminal's Ctrl-C reaches only the worker, which then drains
(a checkpoint, written by the child). It exits when its request pipe closes: the worker exited or was killed.
A child that dies (killed, out of memory) fails the next call with its exit status, which stops the learner
stage with the resume hint.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, BinaryIO

import msgspec

from config import Config
from pipeline import metrics
from pipeline.records import TrainGroup
from pipeline.stage import FatalStageError

_HEADER = struct.Struct("!I")  # each message: its length, then msgpack


class TrainerProcessError(FatalStageError):
    """The trainer's child process failed a call or exited."""


class _Call(msgspec.Struct, kw_only=True):
    method: str
    run: str = ""
    version: int = 0
    groups: list[TrainGroup] = []
    images: dict[str, bytes] = {}
    final: bool = False
    leased: list[int] = []
    snapshot: bool = True
    state: dict[str, Any] | None = None
    resume_path: str | None = None
    resume_state: dict[str, Any] | None = None


class _Reply(msgspec.Struct, kw_only=True):
    result: Any = None
    error: str | None = None  # the exception's type name
    message: str = ""
    step: int = 0
    last_checkpoint_step: int = 0
    accumulating: bool = False
    version: int = 0


class _Start(msgspec.Struct, kw_only=True):
    config: Config
    model_dir: str
    output_dir: str
    num_batches: int


def _send(pipe: BinaryIO, payload: bytes) -> None:
    pipe.write(_HEADER.pack(len(payload)) + payload)
    pipe.flush()


def _receive(pipe: BinaryIO) -> bytes | None:
    """One message, or None at the end of the pipe (the other side exited)."""
    header = pipe.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    payload = pipe.read(size)
    return payload if len(payload) == size else None


class TrainerProcess:
    """A ``trainer.trainer.Trainer`` in a child process, with the surface the learner stage uses."""

    EXIT_TIMEOUT_S = 30.0  # close(): how long the child may take to exit before it is killed

    def __init__(self, cfg: Config, model_dir: Path, output_dir: Path, num_batches: int) -> None:
        self.cfg = cfg
        self.run = cfg.run.name
        self.version = 0
        self.step = 0
        self.last_checkpoint_step = 0
        self.accumulating = False
        self._start = _Start(config=cfg, model_dir=str(model_dir), output_dir=str(output_dir), num_batches=num_batches)
        self._process: subprocess.Popen[bytes] | None = None
        self._requests: BinaryIO | None = None
        self._replies: BinaryIO | None = None
        self._decoder = msgspec.msgpack.Decoder(_Reply)
        self._lock = threading.Lock()  # one call at a time: the stage calls from executor threads

    # ------------------------------------------------------------------ the stage's surface

    def load(self, resume_from: Any = None) -> None:
        """Start the child, which loads the model (and the checkpoint ``resume_from``, a trainer.checkpoint
        Checkpoint, when resuming). Its environment is this process's: libraries quieted here stay quiet."""
        self._spawn()
        self._call(_Call(
            method="load",
            run=self.run,
            version=-1,  # the version the checkpoint restores, not one of ours
            resume_path=str(resume_from.path) if resume_from is not None else None,
            resume_state=resume_from.state if resume_from is not None else None,
        ))

    def train_generation_batch(
        self, groups: list[TrainGroup], version: int, images: dict[str, bytes] | None = None
    ) -> list[dict[str, Any]]:
        rows = self._call(_Call(method="train", run=self.run, version=version, groups=groups, images=images or {}))
        for group in groups:  # the trainer sets these in its own process; /metrics is this one's
            for record in group.records:
                metrics.STALENESS.labels(self.run).observe(version - record.trajectory.policy_version)
        for row in rows:
            metrics.set_train_gauges(self.run, row)
        return rows

    def publish(self, version: int, final: bool = False, leased: Any = (), snapshot: bool = True) -> Path | None:
        path = self._call(_Call(method="publish", run=self.run, version=version, final=final,
                                leased=list(leased), snapshot=snapshot))
        return Path(path) if path is not None else None

    def write_snapshot(self, version: int) -> Path | None:
        path = self._call(_Call(method="write_snapshot", run=self.run, version=version))
        return Path(path) if path is not None else None

    def save_checkpoint(self, state: dict[str, Any] | None = None) -> Path | None:
        path = self._call(_Call(method="save_checkpoint", run=self.run, version=self.version, state=state))
        return Path(path) if path is not None else None

    def follow(self, resume_from: Any = None) -> int:
        raise TrainerProcessError("learner.own_process is for one learner process (grpo.world_size = 1)")

    def close(self) -> None:
        """Ask the child to stop, wait for it, and kill it if it does not exit in time."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            try:
                self._call(_Call(method="close", version=self.version))
            except TrainerProcessError:
                pass  # it died already; its exit status is read below
        for pipe in (self._requests, self._replies):
            if pipe is not None:
                pipe.close()
        try:
            process.wait(timeout=self.EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        self._process = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    # ------------------------------------------------------------------ the pipe

    def _spawn(self) -> None:
        to_child_read, to_child_write = os.pipe()
        from_child_read, from_child_write = os.pipe()
        # This process's working directory (relative paths in the config mean the same there), and the
        # project's packages importable from it as they are here.
        root = str(Path(__file__).resolve().parents[1])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "trainer.process", str(to_child_read), str(from_child_write)],
                pass_fds=(to_child_read, from_child_write),
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # the terminal's Ctrl-C is the worker's to handle (it drains)
            )
        finally:
            os.close(to_child_read)
            os.close(from_child_write)
        self._requests = os.fdopen(to_child_write, "wb")
        self._replies = os.fdopen(from_child_read, "rb")
        _send(self._requests, msgspec.msgpack.encode(self._start))

    def _call(self, call: _Call) -> Any:
        with self._lock:
            process, requests, replies = self._process, self._requests, self._replies
            if process is None or requests is None or replies is None:
                raise TrainerProcessError("the trainer process is not started (load() first)")
            try:
                _send(requests, msgspec.msgpack.encode(call))
                payload = _receive(replies)
            except (BrokenPipeError, OSError):
                payload = None
            if payload is None:
                code = process.wait()
                raise TrainerProcessError(
                    f"the learner's trainer process (pid {process.pid}) exited with code {code} during "
                    f"{call.method!r}; its output is above")
            reply = self._decoder.decode(payload)
        self.step, self.last_checkpoint_step = reply.step, reply.last_checkpoint_step
        self.accumulating, self.version = reply.accumulating, reply.version
        if reply.error is not None:
            raise _error(reply.error, reply.message)
        return reply.result


def _error(name: str, message: str) -> Exception:
    """The child's exception as the stage expects it: the trainer's own non-finite error by type (it
    triggers the last-good-step checkpoint), anything else as TrainerProcessError naming the type."""
    from trainer.trainer import NonFiniteTrainingError

    if name == "NonFiniteTrainingError":
        return NonFiniteTrainingError(message)
    return TrainerProcessError(f"{name}: {message}")


# ---------------------------------------------------------------------------------------------- the child


def _serve(requests: BinaryIO, replies: BinaryIO) -> int:
    from trainer import checkpoint as checkpoints
    from trainer.trainer import Trainer

    start_payload = _receive(requests)
    if start_payload is None:
        return 0
    start = msgspec.msgpack.decode(start_payload, type=_Start)
    trainer = Trainer(start.config, Path(start.model_dir), Path(start.output_dir), start.num_batches)
    trainer.export_metrics = False  # the worker sets them (TrainerProcess.train_generation_batch)
    decoder = msgspec.msgpack.Decoder(_Call)

    def path(value: Path | None) -> str | None:
        return str(value) if value is not None else None

    handlers = {
        "load": lambda c: trainer.load(
            checkpoints.Checkpoint(Path(c.resume_path), c.resume_state or {}) if c.resume_path else None),
        "train": lambda c: trainer.train_generation_batch(c.groups, c.version, c.images),
        "publish": lambda c: path(trainer.publish(c.version, c.final, c.leased, c.snapshot)),
        "write_snapshot": lambda c: path(trainer.write_snapshot(c.version)),
        "save_checkpoint": lambda c: path(trainer.save_checkpoint(c.state)),
        "close": lambda c: trainer.close(),
    }
    while (payload := _receive(requests)) is not None:
        call = decoder.decode(payload)
        if call.run:
            trainer.run = call.run
        if call.version >= 0:  # the stage may renumber (a restarted learner): its number holds
            trainer.version = call.version
        reply = _Reply()
        try:
            reply.result = handlers[call.method](call)
        except Exception as exc:  # noqa: BLE001  (sent back to the stage, which stops the run with it; printed here)
            traceback.print_exc()
            reply.error, reply.message = type(exc).__name__, str(exc)
        reply.step, reply.last_checkpoint_step = trainer.step, trainer.last_checkpoint_step
        reply.accumulating, reply.version = trainer.accumulating, trainer.version
        _send(replies, msgspec.msgpack.encode(reply))
        if call.method == "close":
            break
    return 0


def main(argv: list[str]) -> int:
    return _serve(os.fdopen(int(argv[0]), "rb"), os.fdopen(int(argv[1]), "wb"))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""What a run leaves behind and how to read it back: the run directory's file names, the rows of its
dead letters and completions, and reads of a run's edges (the dead letters, the newest weights).

``RUN_DIR`` holds ``completions.jsonl`` (the learner's, unless ``run.log_completions = false``), ``dead_letters.jsonl`` (written when the run
ends, from the transport's dead edge) and ``config.toml`` (written when it starts). Everything here only
reads a transport: no consumer group is created and nothing is acked.

Writing: ``atomic_dir`` and ``atomic_write_text`` are the one way the learner puts a file or directory in place
that a reader (a resume, a rollout worker) may open: written under a hidden temp name, fsynced, renamed, the
directory fsynced; a failure (a full disk) leaves the previous version untouched and no temp behind.
``writing(path)`` turns any ``OSError`` of a write into ``OutputWriteError``: one line naming the path, and
fatal to the stage, so a learner that cannot save stops with its unsaved work unacked instead of retrying.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import json
import os
import shutil
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.edges import WEIGHTS
from pipeline.errors import UserError
from pipeline.records import DeadLetter, RecordError, ScoredTrajectory, WeightsPublished, decode
from pipeline.stage import FatalStageError
from pipeline.transport.base import DEAD_EDGE, newest_record

COMPLETIONS_FILE = "completions.jsonl"
DEAD_LETTERS_FILE = "dead_letters.jsonl"
CONFIG_FILE = "config.toml"
SCORED_EDGE = "scored"
PAGE = 500  # entries per read while walking an edge to its tail
TIMEOUT_S = 30.0  # every transport call; a hung Redis must not hang the command


# ----------------------------------------------------------------------------- writing

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class OutputWriteError(UserError, FatalStageError):
    """A write under the run's output directory failed (a full disk, above all). Fatal: retrying the record
    cannot free space, and the learner's work since its last checkpoint must stay unacked for ``--resume``."""

    def __init__(self, path: Path, cause: BaseException, no_space: bool = False) -> None:
        self.path = Path(path)
        self.errno = cause.errno if isinstance(cause, OSError) else (errno.ENOSPC if no_space else None)
        if self.errno in _NO_SPACE:
            what = "no space left on device" if self.errno == errno.ENOSPC else "disk quota exceeded"
            message = f"{what} writing {path}; free space and run again with --resume"
        else:
            why = cause.strerror if isinstance(cause, OSError) and cause.strerror else f"{type(cause).__name__}: {cause}"
            message = f"cannot write {path}: {why}; fix it and run again with --resume"
        super().__init__(message)


def _nearly_full(directory: Path) -> bool:
    """Whether the filesystem of ``directory`` has (almost) no space left: torch.save reports a full disk as a
    RuntimeError ("unexpected pos"), safetensors as a SafetensorError, neither an OSError with ENOSPC."""
    try:
        s = os.statvfs(directory)
    except OSError:
        return False
    return s.f_bavail * s.f_frsize < _FULL_BELOW


_FULL_BELOW = 1 << 20  # bytes free under which a failed write is put down to a full disk


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """Any ``OSError`` inside becomes an ``OutputWriteError`` naming ``path``."""
    try:
        yield
    except OutputWriteError:
        raise
    except OSError as exc:
        raise OutputWriteError(path, exc) from exc


def fsync_dir(directory: Path) -> None:
    """Make the names in ``directory`` (a rename into it) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(directory: Path) -> None:
    for root, _dirs, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(root))


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a hidden temp directory beside ``final`` to fill; then fsync it, rename it to ``final`` (an existing
    ``final`` is moved aside first and removed after) and fsync the parent. Any failure removes the temp
    directory (a full disk gets its space back) and leaves ``final`` as it was; an ``OSError``, or any error of
    the writer inside (torch.save and safetensors have their own), is raised as ``OutputWriteError``. A reader sees the old directory or the new one, never part of one."""
    final = Path(final)
    with writing(final):
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    old: Path | None = None  # where an existing ``final`` waits while the new one is renamed in
    try:
        with writing(final):
            try:
                yield tmp
            except (OSError, OutputWriteError):
                raise
            except Exception as exc:  # a writer library's own error: fatal too, and named after the path
                no_space = os.strerror(errno.ENOSPC) in str(exc) or _nearly_full(final.parent)
                raise OutputWriteError(final, exc, no_space=no_space) from exc
            _fsync_tree(tmp)
            if final.exists():  # the same name written again (a final checkpoint right after a periodic one)
                old = Path(tempfile.mkdtemp(prefix=f".{final.name}-old-", dir=final.parent))
                os.replace(final, old / final.name)
            os.replace(tmp, final)
            fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not final.exists() and (old / final.name).exists():
            os.replace(old / final.name, final)  # put the previous one back
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def atomic_write_text(path: Path, text: str) -> None:
    """Replace ``path``'s content with ``text`` all at once (temp file, fsync, rename, fsync the directory);
    a failure leaves the old content and no temp file."""
    path = Path(path)
    with writing(path):
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        fsync_dir(path.parent)


def remove_stale_temps(directory: Path, targets: tuple[str, ...]) -> list[Path]:
    """Remove the temps ``atomic_dir`` / ``atomic_write_text`` left in ``directory`` for names starting with one
    of ``targets`` when a kill cut their write short (a cut-short checkpoint holds gigabytes a freed disk needs).
    Only for a directory one process writes (the learner's output_dir, at its start). Returns what it removed."""
    if not directory.is_dir():
        return []
    stale = [p for p in directory.iterdir() if p.name.startswith(tuple(f".{t}" for t in targets))]
    for path in stale:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return stale


def missing_completions(run_dir: Path) -> str | None:
    """Why a run directory has no completions.jsonl (None when it has one): the run turned it off
    (``run.log_completions = false`` in its config.toml), or no generation batch has been trained yet."""
    run_dir = Path(run_dir)
    if (run_dir / COMPLETIONS_FILE).exists():
        return None
    try:
        logged = tomllib.loads((run_dir / CONFIG_FILE).read_text()).get("run", {}).get("log_completions", True)
    except (OSError, tomllib.TOMLDecodeError):
        logged = True  # no readable config: nothing says the run turned it off
    if logged is False:
        return (
            f"{COMPLETIONS_FILE} not written: the run has run.log_completions = false (set it to true to keep "
            "them; `rollstream inspect --redis URL --run NAME` reads the scored edge of a live run)"
        )
    return f"{COMPLETIONS_FILE} not written yet (the learner writes it after each trained generation batch)"


def dead_record_id(letter: DeadLetter) -> str:
    """The record id of a dead letter's payload; "" when it does not decode (it then names no group)."""
    try:
        return str(getattr(decode(letter.payload), "record_id", ""))
    except (RecordError, NotImplementedError):
        return ""


def dead_letter_row(letter: DeadLetter) -> dict[str, Any]:
    """Plain data for one dead letter: where it came from, why, and what it was (when it decodes)."""
    try:
        inner = decode(letter.payload)
        what = f"{type(inner).__name__} {getattr(inner, 'record_id', '')}".strip()
    except RecordError as exc:
        what = f"undecodable payload ({len(letter.payload)} bytes): {exc}"
    return {
        "record_id": dead_record_id(letter),
        "edge": letter.edge,
        "entry_id": letter.entry_id,
        "stage": letter.stage,
        "worker": letter.worker,
        "deliveries": letter.deliveries,
        "error": letter.error,
        "record": what,
    }


def completion_row(scored: ScoredTrajectory) -> dict[str, Any]:
    """The fields of completions.jsonl, from a record on the scored edge."""
    t = scored.trajectory
    return {
        "policy_version": t.policy_version,
        "prompt": t.messages[-1]["content"] if t.messages else "",
        "completion": t.completion,
        "rewards": dict(scored.rewards),
        "reward": scored.reward,
    }


async def edge_tail(transport: Any, edge: str, last: int | None) -> list[Any]:
    """The last ``last`` (None: all) decodable records of an edge, oldest first (a forward walk: streams have
    no reverse read in the Transport protocol, and are capped at transport.maxlen entries)."""
    tail: collections.deque = collections.deque(maxlen=last)
    cursor = "0"
    while True:
        page = await asyncio.wait_for(transport.read(edge, cursor, PAGE, 0), TIMEOUT_S)
        for delivery in page:
            cursor = delivery.id
            try:
                tail.append(decode(delivery.payload))
            except RecordError:
                continue  # undecodable entries are the workers' to dead-letter, not ours
        if len(page) < PAGE:
            return list(tail)


async def dead_letters(transport: Any) -> list[dict[str, Any]]:
    """Every dead letter of the run, as ``dead_letter_row`` dicts."""
    letters = await edge_tail(transport, DEAD_EDGE, 1_000_000)
    return [dead_letter_row(d) for d in letters if isinstance(d, DeadLetter)]


async def latest_weights(transport: Any, timeout_s: float = TIMEOUT_S) -> WeightsPublished | None:
    """The newest record on the fan-out ``weights`` edge (the run's newest snapshot, and whether it is final)."""
    record = await asyncio.wait_for(newest_record(transport, WEIGHTS), timeout_s)
    return record if isinstance(record, WeightsPublished) else None


async def write_dead_letters(transport: Any, path: Path) -> int:
    """Keep the dead edge next to the run's other outputs (a memory run's edges die with its process)."""
    rows = await dead_letters(transport)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return len(rows)

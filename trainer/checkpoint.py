"""Learner checkpoints: what a restarted run needs to continue as if it had never stopped.

A checkpoint is a directory ``<output_dir>/checkpoint-<step>`` (transformers' name) holding

    model.safetensors      the policy's weights
    ref_model.safetensors  the reference model, only when it moves (sync_ref_model)
    optimizer.pt           AdamW's state_dict (moments, step counts)
    scheduler.pt           the learning-rate scheduler's state_dict
    rng_state.pth          python, numpy and torch RNG states
    trainer_state.json     counters (policy version, optimizer step, batches trained, NaN skips), the
                           feeder position of the first untrained generation batch, the byte lengths
                           of metrics.jsonl / completions.jsonl at save time, and every file's size

It is written into a hidden temp directory, fsynced and renamed into place (``pipeline.run_dir.atomic_dir``),
so a crash or a full disk mid-write leaves no ``checkpoint-*`` and the previous ones intact (a failed write
raises ``OutputWriteError`` naming the path); trainer_state.json lists each file's size, so a checkpoint damaged afterwards (a
truncated file) is detected, reported and skipped when looking for the newest. At most
``save_total_limit`` checkpoints are kept (oldest removed first), as transformers' Trainer.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import msgspec
import numpy as np
import torch

from pipeline import log
from pipeline.errors import UserError
from pipeline.records import FeederPosition
from pipeline.run_dir import atomic_dir

STATE_FILE = "trainer_state.json"
PREFIX = "checkpoint-"
_NAME = re.compile(rf"{PREFIX}(\d+)")


class CheckpointError(UserError, RuntimeError):
    """No usable checkpoint where the user pointed (the message says where and why)."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    path: Path
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["step"])

    @property
    def feeder_position(self) -> FeederPosition | None:
        raw = self.state.get("feeder_position")
        return None if raw is None else msgspec.convert(raw, FeederPosition)


# ----------------------------------------------------------------------------- RNG


def rng_states() -> dict[str, Any]:
    """Python, numpy and torch RNG states, in a form ``torch.load(weights_only=True)`` accepts."""
    kind, keys, pos, has_gauss, cached = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state())
    return {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
        # A GPU learner's dropout (LoRA) draws from the CUDA generators.
        **({"cuda": torch.cuda.get_rng_state_all()} if torch.cuda.is_initialized() else {}),
    }


def set_rng_states(states: dict[str, Any]) -> None:
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    n = states["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


# ----------------------------------------------------------------------------- writing


def save(
    output_dir: Path,
    step: int,
    state: dict[str, Any],
    write_files: Callable[[Path], None],
    save_total_limit: int | None,
) -> Path:
    """Write ``checkpoint-<step>`` atomically: ``write_files(tmp)`` fills a temp dir, then trainer_state.json
    (with every file's size) is written last and the directory renamed into place. Then old ones are pruned
    (only after the new one is in place: a full disk never costs the previous checkpoint)."""
    final = output_dir / f"{PREFIX}{step}"
    with atomic_dir(final) as tmp:  # a failure (a full disk) leaves the previous checkpoints as they were
        write_files(tmp)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        (tmp / STATE_FILE).write_text(json.dumps({**state, "step": step, "files": files}, indent=1))
    prune(output_dir, save_total_limit)
    return final


def prune(output_dir: Path, save_total_limit: int | None) -> list[Path]:
    """Keep the newest ``save_total_limit`` checkpoints (None = all); returns the removed ones."""
    if save_total_limit is None:
        return []
    found = listed(output_dir)
    removed = found[: max(0, len(found) - save_total_limit)]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


# ----------------------------------------------------------------------------- reading


def listed(output_dir: Path) -> list[Path]:
    """``checkpoint-<step>`` directories under ``output_dir``, oldest step first (valid or not)."""
    if not output_dir.is_dir():
        return []
    found = [(int(m[1]), p) for p in output_dir.iterdir() if p.is_dir() and (m := _NAME.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


def problem(path: Path) -> str | None:
    """Why ``path`` is not a usable checkpoint, or None when it is complete."""
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except FileNotFoundError:
        return f"no {STATE_FILE} (an incomplete checkpoint)"
    except (OSError, ValueError) as exc:
        return f"unreadable {STATE_FILE}: {exc}"
    for name, size in state.get("files", {}).items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} is {file.stat().st_size} bytes, {size} were written (truncated or damaged)"
    return None


def load(path: Path) -> Checkpoint:
    why = problem(path)
    if why is not None:
        raise CheckpointError(f"checkpoint {path} is not usable: {why}; resume from an older one or `latest`")
    return Checkpoint(path, json.loads((path / STATE_FILE).read_text()))


def latest(output_dir: Path) -> Checkpoint | None:
    """The newest complete checkpoint under ``output_dir``; damaged ones are logged and skipped."""
    for path in reversed(listed(output_dir)):
        why = problem(path)
        if why is None:
            return load(path)
        log.get(stage="learner").warning("skipping checkpoint", path=str(path), reason=why)
    return None


def resolve(spec: str, output_dir: Path | None, run_name: str, runs_root: Path = Path("runs")) -> Checkpoint:
    """``--resume`` argument -> a checkpoint. ``latest``: the newest complete one in ``output_dir`` (when
    run.output_dir is set) or else in the newest ``runs/<run.name>-*`` directory that has one. A path: a
    checkpoint directory, or an output directory (its newest complete checkpoint)."""
    if spec == "latest":
        if output_dir is not None:
            candidates = [output_dir]
        else:
            candidates = sorted(runs_root.glob(f"{run_name}-*"), key=lambda p: p.name, reverse=True)
        for directory in candidates:
            found = latest(directory)
            if found is not None:
                return found
        where = str(output_dir) if output_dir is not None else f"{runs_root}/{run_name}-*"
        raise CheckpointError(
            f"--resume latest: no complete checkpoint in {where}; set learner.save_steps to write some, "
            f"or give a checkpoint directory (--resume runs/<run>/checkpoint-<step>)"
        )
    path = Path(spec).expanduser()
    if _NAME.fullmatch(path.name):
        return load(path)
    found = latest(path)
    if found is None:
        raise CheckpointError(
            f"--resume {spec}: not a checkpoint directory ({PREFIX}<step>) and no complete checkpoint inside it"
        )
    return found

"""Weight snapshots: ``<output_dir>/weights/v<version>`` written so no reader sees half of one, and the
garbage collection of those no worker uses any more."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from pipeline.run_dir import atomic_dir


def save_weights_atomically(
    model: Any, directory: Path, adapter_only: bool = False, state: dict[str, torch.Tensor] | None = None
) -> Path:
    """Write ``directory/model.safetensors`` so a reader never sees a half-written snapshot. ``adapter_only``
    (a peft model): the LoRA adapter alone, as peft writes it (adapter_model.safetensors, adapter_config.json).
    ``state``: the weights to write instead of ``model.state_dict()`` (a distributed learner's gathered ones)."""
    from safetensors.torch import save_file

    with atomic_dir(directory) as tmp:  # a failure (a full disk) raises OutputWriteError and leaves no temp
        if adapter_only:
            model.save_pretrained(str(tmp))
        else:
            whole: dict[str, torch.Tensor] = model.state_dict() if state is None else state
            on_cpu = {k: v.detach().contiguous().cpu() for k, v in whole.items()}
            save_file(on_cpu, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return directory


def unused_snapshots(versions: list[int], leased: Sequence[int], keep: str = "") -> list[int]:
    """Pure: the snapshot versions to delete: those older than the oldest version a worker leases
    (``leased``; a dead worker's lease has expired). The newest is always kept (a worker that starts now
    loads it), and so is the directory named ``keep`` (the one being announced). Checkpoints and ``final``
    hold their own copies of the weights, so no snapshot is kept for them."""
    if not versions:
        return []
    floor = min([*leased, max(versions)])
    return sorted(v for v in versions if v < floor and f"v{v:06d}" != keep)

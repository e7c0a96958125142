"""Weight snapshots: ``<output_dir>/weights/v<version>`` written so no reader sees half of one, and the
garbage collection of those no worker uses any more."""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.run_dir import atomic_dir


def save_weights_atomically(
    model: torch.nn.Module, directory: Path, adapter_only: bool = False, state: dict[str, torch.Tensor] | None = None
) -> Path:
    """Write ``directory/model.safetensors`` so a reader never sees a half-written snapshot. ``adapter_only``
    (a peft model): the LoRA adapter alone, as peft writes it (adapter_model.safetensors, adapter_config.json).
    ``state``: the weights to write instead of ``model.state_dict()`` (a distributed learner's gathered ones)."""
    from safetensors.torch import save_file

    with atomic_dir(directory) as tmp:  # a failure (a full disk) raises OutputWriteError and leaves no temp
        if adapter_only:
            model.save_pretrained(str(tmp))
        else:
            state = model.state_dict() if state is None else state
            state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
            save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return directory


def unused_snapshots(versions: list[int], leased: list[int], keep: str = "") -> list[int]:
    """Pure: the snapshot versions to delete: those older than the oldest version a worker leases
    (``leased``; a dead worker's lease has expired). The newest is always kept (a worker that starts now
    loads it), and so is the directory named ``keep`` (the one being announced). Checkpoints and ``final``
    hold their own copies of the weights, so no snapshot is kept for them."""
    if not versions:
        return []
    floor = min([*leased, max(versions)])
    return sorted(v for v in versions if v < floor and f"v{v:06d}" != keep)

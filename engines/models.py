"""Where a run's model comes from: a built-in model the project builds, or a local directory."""

from __future__ import annotations

from pathlib import Path

from engines.tiny_model import model_path
from engines.tiny_recipes import MODEL_RECIPES, Progress
from pipeline.errors import SetupError


def resolve_model_dir(spec: str, progress: Progress | None = print) -> Path:
    """``"tiny"`` / ``"tiny-gym"`` (the gym demo's) / ``"mid"`` -> a model the project builds (on first use);
    else a local model directory. Models are never downloaded."""
    if spec in MODEL_RECIPES:
        return model_path(spec, progress=progress)
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise SetupError(
            f"model.model = {spec!r}: no model there (expected a directory with config.json); "
            f"give a local model directory, or one of the built-in models {sorted(MODEL_RECIPES)} (models are never "
            "downloaded)"
        )
    return path.resolve()

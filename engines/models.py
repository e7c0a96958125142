"""Where a run's model comes from: a built-in model the project builds, a local directory, or a Hub id.

A Hub id (``Qwen/Qwen2.5-0.5B-Instruct``) is fetched by the hub's own library into its own cache, as ms-swift's
``safe_snapshot_download`` does: ``huggingface_hub.snapshot_download`` (HF_HOME / HF_HUB_CACHE decide where;
HF_HUB_OFFLINE=1 reads the cache only), or ModelScope's ``snapshot_download`` with ``model.use_hf = false``.
Every consumer (vLLM, the learner, tokenizers) is then given the local snapshot directory.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from data.hub import hub_snapshot, is_hub_id
from pipeline.errors import SetupError
from tinymodels.recipes import MODEL_RECIPES, Progress
from tinymodels.text import model_path


def resolve_model_dir(
    spec: str, progress: Progress | None = print, *, revision: str | None = None, use_hf: bool = True,
    field: str = "model.model",
) -> Path:
    """``"tiny"`` / ``"tiny-gym"`` (the gym demo's) / ``"tiny-agent"`` / ``"mid"`` -> a model the project builds;
    a local model directory -> itself; a Hub id ``org/name`` (ms-swift's ``org/name:subfolder`` too) -> its
    snapshot directory in the hub's cache (downloaded when missing and the machine is online).

    ``revision``: model.model_revision; ``use_hf``: model.use_hf (false = ModelScope). A model that cannot be
    found is a ``SetupError`` naming ``field``, the id, the cache directory and the fix."""
    if spec in MODEL_RECIPES:
        return model_path(spec, progress=progress)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SetupError(f"{field} = {spec!r}: no model there (expected a directory with config.json)")
        return path.resolve()
    repo_id, _, subfolder = spec.partition(":")
    if not is_hub_id(repo_id):
        close = difflib.get_close_matches(spec, list(MODEL_RECIPES), n=1)
        hint = f" (did you mean the built-in {close[0]!r}?)" if close else ""
        raise SetupError(
            f"{field} = {spec!r}: no model there and not a Hub id{hint}; give a local model directory (with "
            f"config.json), a Hub id such as 'Qwen/Qwen2.5-0.5B-Instruct', or one of the built-in models "
            f"{sorted(MODEL_RECIPES)}"
        )
    directory = hub_snapshot(repo_id, revision=revision, use_hf=use_hf, field=field,
                             allow_patterns=[f"{subfolder.strip('/')}/*"] if subfolder else None)
    if subfolder:
        directory = directory / subfolder.strip("/")
    if not (directory / "config.json").is_file():
        raise SetupError(f"{field} = {spec!r}: the Hub snapshot {directory} has no config.json; is it a model repository?")
    return directory


def model_dir_of(cfg: Any, progress: Progress | None = print) -> Path:
    """The run's model directory from its config: model.model with model.model_revision and model.use_hf."""
    m = cfg.model
    return resolve_model_dir(m.model, progress, revision=m.model_revision, use_hf=m.use_hf)

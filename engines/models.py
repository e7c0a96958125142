"""Where a run's model comes from: a built-in model the project builds, a local directory, or a Hub id.

A Hub id (``Qwen/Qwen2.5-0.5B-Instruct``) is fetched by the hub's own library into its own cache, as ms-swift's
``safe_snapshot_download`` does: ``huggingface_hub.snapshot_download`` (HF_HOME / HF_HUB_CACHE decide where;
HF_HUB_OFFLINE=1 reads the cache only), or ModelScope's ``snapshot_download`` with ``model.use_hf = false``.
Every consumer (vLLM, the learner, tokenizers) is then given the local snapshot directory.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

from engines.tiny_model import model_path
from engines.tiny_recipes import MODEL_RECIPES, Progress
from pipeline.errors import SetupError

# ms-swift's safe_snapshot_download skips these: other formats of the same weights.
HUB_IGNORE_PATTERNS = ["*.zip", "*.gguf", "*.pth", "*.pt", "consolidated*", "onnx/*", "*.safetensors.md", "*.msgpack",
                       "*.onnx", "*.ot", "*.h5"]
# huggingface_hub's repo id rule: namespace/name, letters, digits, - _ . (no -- or .. inside).
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_model_dir(
    spec: str, progress: Progress | None = print, *, revision: str | None = None, use_hf: bool = True,
    field: str = "model.model",
) -> Path:
    """``"tiny"`` / ``"tiny-gym"`` (the gym demo's) / ``"mid"`` -> a model the project builds (on first use);
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


def is_hub_id(text: str) -> bool:
    """``namespace/name`` as the Hub spells a repository (a path like ``./x/y`` or ``/a/b`` is not one)."""
    return bool(_REPO_ID.match(text)) and ".." not in text and "--" not in text


def hub_cache_dir(use_hf: bool = True) -> str:
    """Where the hub's library keeps its snapshots (read when called: HF_HOME / HF_HUB_CACHE, MODELSCOPE_CACHE)."""
    if use_hf:
        from huggingface_hub import constants

        return str(constants.HF_HUB_CACHE)
    try:
        from modelscope.hub.utils.utils import get_cache_dir
    except ImportError:
        return "(modelscope is not installed)"
    return str(get_cache_dir())


def hub_snapshot(
    repo_id: str, *, revision: str | None = None, use_hf: bool = True, field: str = "model.model",
    allow_patterns: list[str] | None = None,
) -> Path:
    """The local directory of Hub model ``repo_id`` (downloaded into the hub's cache when missing)."""
    if not use_hf:
        return _modelscope_snapshot(repo_id, revision, field, allow_patterns)
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = hub_cache_dir()
    name = f"{field} = {repo_id!r}" + (f" (revision {revision!r})" if revision else "")
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=allow_patterns,
                                      ignore_patterns=HUB_IGNORE_PATTERNS))
    except GatedRepoError:  # before RepositoryNotFoundError: it is a subclass
        raise SetupError(
            f"{name}: a gated model; accept its terms on https://huggingface.co/{repo_id} and log in "
            "(`hf auth login`, or HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        raise SetupError(f"{name}: no such revision on the Hub; fix model.model_revision (a branch, tag or commit)") from None
    except RepositoryNotFoundError:
        raise SetupError(
            f"{name}: no such model on the Hugging Face Hub (or it is private: log in with `hf auth login` or "
            "HF_TOKEN); check the id, or set model.use_hf = false for a ModelScope id"
        ) from None
    except LocalEntryNotFoundError:  # offline (HF_HUB_OFFLINE or no network) and not in the cache
        why = "HF_HUB_OFFLINE=1 is set" if constants.HF_HUB_OFFLINE else "the Hub could not be reached"
        raise SetupError(
            f"{name}: not in the Hugging Face cache {cache} and {why}; download it once where there is network "
            f"(`hf download {repo_id}`, or any run with this id), point HF_HOME / HF_HUB_CACHE at the cache that "
            "holds it, or give a local model directory"
        ) from None
    except (HfHubHTTPError, OSError) as exc:
        raise SetupError(f"{name}: the download into {cache} failed ({type(exc).__name__}: {exc})") from None


def _modelscope_snapshot(repo_id: str, revision: str | None, field: str, allow_patterns: list[str] | None) -> Path:
    try:
        from modelscope import snapshot_download
    except ImportError:
        raise SetupError(
            f"{field} = {repo_id!r} with model.use_hf = false is a ModelScope id, which needs the modelscope "
            "package: pip install modelscope (or set model.use_hf = true for the Hugging Face Hub, rollstream's "
            "default)"
        ) from None
    kwargs: dict[str, Any] = {"ignore_patterns": HUB_IGNORE_PATTERNS}
    if allow_patterns:
        kwargs["allow_patterns"] = allow_patterns
    try:  # as ms-swift's MSHub.download_model: ModelScope calls main "master"
        return Path(snapshot_download(repo_id, revision=revision if revision not in (None, "main") else "master",
                                      **kwargs))
    except Exception as exc:  # noqa: BLE001 - modelscope raises many types (HTTP, not found, offline); all mean this
        raise SetupError(
            f"{field} = {repo_id!r}: not found on ModelScope nor in its cache {hub_cache_dir(False)} "
            f"({type(exc).__name__}: {exc}); check the id, or set model.use_hf = true for a Hugging Face id"
        ) from None


def model_dir_of(cfg: Any, progress: Progress | None = print) -> Path:
    """The run's model directory from its config: model.model with model.model_revision and model.use_hf."""
    m = cfg.model
    return resolve_model_dir(m.model, progress, revision=m.model_revision, use_hf=m.use_hf)

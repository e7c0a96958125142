"""Hub ids: a model repository fetched by the hub's own library into its own cache, as ms-swift's
``safe_snapshot_download`` does: ``huggingface_hub.snapshot_download`` (HF_HOME / HF_HUB_CACHE decide where;
HF_HUB_OFFLINE=1 reads the cache only), or ModelScope's ``snapshot_download`` (``use_hf = false``). One home for
the policy model (engines/models.py) and reward models (rewards/models.py) alike."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pipeline.errors import SetupError

# ms-swift's safe_snapshot_download skips these: other formats of the same weights.
HUB_IGNORE_PATTERNS = ["*.zip", "*.gguf", "*.pth", "*.pt", "consolidated*", "onnx/*", "*.safetensors.md", "*.msgpack",
                       "*.onnx", "*.ot", "*.h5"]
# huggingface_hub's repo id rule: namespace/name, letters, digits, - _ . (no -- or .. inside).
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(text: str) -> bool:
    """``namespace/name`` as the Hub spells a repository (a path like ``./x/y`` or ``/a/b`` is not one)."""
    return bool(_REPO_ID.match(text)) and ".." not in text and "--" not in text


def hub_cache_dir(use_hf: bool = True) -> str:
    """Where the hub's library keeps its snapshots (read when called: HF_HOME / HF_HUB_CACHE, MODELSCOPE_CACHE)."""
    if use_hf:
        from huggingface_hub import constants

        return str(constants.HF_HUB_CACHE)
    try:
        from modelscope.hub.utils.utils import get_cache_dir  # pyright: ignore[reportMissingImports]  (optional: ModelScope)
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
        from modelscope import snapshot_download  # pyright: ignore[reportMissingImports]  (optional: ModelScope)
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

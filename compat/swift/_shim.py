"""The few ms-swift names rollstream has no object for: helpers that behave as ms-swift's do
(``get_logger``, ``to_device``), and names that import but need ms-swift's own inference engine or
template, which raise a clear error naming rollstream's alternative when used."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from rewards import ORM

_ALTERNATIVE = (
    "rollstream scores with reward models through reward.reward_model (a local sequence-classification model "
    "directory or an http(s) reward service: rewards/models.py), or with an ORM / AsyncORM reward that calls "
    "your own model or server"
)


class _CurrentStderr:
    """Whatever ``sys.stderr`` is when a line is written (pytest and the CLI swap it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


_FORMAT = logging.Formatter("[%(levelname)s:%(name)s] %(message)s")


def get_logger(log_file: str | None = None, log_level: int | None = None, file_mode: str = "w") -> logging.Logger:
    """ms-swift's ``swift.utils.get_logger``: the ``swift`` logger, printing to the console (stderr, where
    rollstream's progress and errors go) at ``log_level`` (default: env ``LOG_LEVEL``, else INFO), and to
    ``log_file`` too when given; with ms-swift's ``info_once`` / ``warning_once``."""
    if log_level is None:
        log_level = getattr(logging, os.getenv("LOG_LEVEL", "INFO").upper(), logging.INFO)
    logger = logging.getLogger("swift")
    logger.propagate = False
    if not any(getattr(h, "rollstream_console", False) for h in logger.handlers):
        console = logging.StreamHandler(_CurrentStderr())
        console.rollstream_console = True
        console.setFormatter(_FORMAT)
        logger.addHandler(console)
        logger.info_once = _once(logger.info)
        logger.warning_once = _once(logger.warning)
    if log_file is not None and not any(
        isinstance(h, logging.FileHandler) and h.baseFilename == os.path.abspath(log_file) for h in logger.handlers
    ):
        file_handler = logging.FileHandler(log_file, file_mode)
        file_handler.setFormatter(_FORMAT)
        logger.addHandler(file_handler)
    for handler in logger.handlers:
        handler.setLevel(log_level)
    logger.setLevel(log_level)
    return logger


def _once(method: Any) -> Any:
    seen: set[str] = set()

    def log_once(msg: str, *args: Any, **kwargs: Any) -> None:
        key = kwargs.pop("hash_id", None) or msg
        if key not in seen:
            seen.add(key)
            method(msg, *args, **kwargs)

    return log_once


def to_device(data: Any, device: Any, non_blocking: bool = False) -> Any:
    """ms-swift's ``to_device``: move every tensor in nested dicts/lists/tuples to ``device``."""
    if isinstance(data, dict):
        return type(data)({k: to_device(v, device, non_blocking) for k, v in data.items()})
    if isinstance(data, (tuple, list)):
        return type(data)(to_device(v, device, non_blocking) for v in data)
    if hasattr(data, "to") and type(data).__module__.startswith("torch"):
        return data.to(device=device, non_blocking=non_blocking)
    return data


class _NeedsMsSwift:
    """A name an ms-swift plugin imports (so the file loads) for something only ms-swift itself can do."""

    _what = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            f"{type(self).__name__}: {self._what} needs ms-swift itself, which rollstream does not run. "
            f"{_ALTERNATIVE}; or install ms-swift (then its own `swift` package is used)"
        )


class PtEngine(_NeedsMsSwift):
    """ms-swift 3's transformers inference engine (GenRM reward-model plugins build one)."""

    _what = "ms-swift's transformers inference engine (used by reward-model plugins)"

    @classmethod
    def from_model_template(cls, *args: Any, **kwargs: Any) -> PtEngine:
        return cls(*args, **kwargs)


class TransformersEngine(PtEngine):
    """ms-swift 4's name for ``PtEngine``."""


class Template(_NeedsMsSwift):
    """ms-swift's chat template object: plugins name it in annotations; rollstream renders prompts with the
    model's tokenizer chat template instead (schedulers see ``self.tokenizer``)."""

    _what = "ms-swift's Template (rollstream renders with the tokenizer's chat template)"


class DefaultRMPlugin(_NeedsMsSwift):
    """ms-swift's reward-model plugin base (``rm_plugins``): rollstream does not run reward-model plugins."""

    _what = "a reward-model plugin (rm_plugins, DefaultRMPlugin)"


class GenRMPlugin(DefaultRMPlugin):
    """ms-swift's generative reward-model plugin."""


# ms-swift's registry of reward-model plugins: plugins may register into it; rollstream never builds them
# (there is no reward_model_plugin setting), reward.reward_model is the alternative.
rm_plugins: dict[str, type] = {"default": DefaultRMPlugin, "genrm": GenRMPlugin}


class ReactORM(ORM):
    """ms-swift's ``toolbench`` reward (ReAct action vs ground truth): no rollstream equivalent."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "ReactORM (ms-swift's toolbench reward) has no rollstream equivalent; copy its class into your "
            "plugin file and register it with orms['toolbench'] = ReactORM"
        )

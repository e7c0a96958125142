"""Load user plugin files (``run.external_plugins``), as ms-swift does with ``--external_plugins``.

A plugin file is plain Python that fills the registries (``from rewards import orms; orms["x"] = X``).
It is the user's own code on their own disk, loaded once at start-up: nothing that crossed a process
boundary is ever executed.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from pipeline.errors import UserError

_loaded: set[Path] = set()


class PluginError(UserError, RuntimeError):
    pass


def load_plugins(paths: list[str]) -> None:
    for raw in paths:
        path = Path(raw).expanduser().resolve()
        if path in _loaded:
            continue
        if not path.is_file():
            raise PluginError(f"run.external_plugins: {raw} does not exist; give the path of a .py file")
        if path.suffix != ".py":  # importlib has no loader for other suffixes (it returned no spec)
            raise PluginError(f"run.external_plugins: {raw} is not a .py file")
        spec = importlib.util.spec_from_file_location(f"rollstream_plugin_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        try:
            spec.loader.exec_module(module)
        except (OSError, SyntaxError) as exc:  # unreadable, not Python (a plugin bug keeps its traceback)
            sys.modules.pop(spec.name, None)
            if isinstance(exc, SyntaxError):
                where, reason = (f" line {exc.lineno}" if exc.lineno else ""), exc.msg
            else:
                where, reason = "", str(exc)
            raise PluginError(f"run.external_plugins: {raw}{where}: {reason}") from None
        _loaded.add(path)

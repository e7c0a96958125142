"""Load user plugin files (``run.external_plugins``), as ms-swift does with ``--external_plugins``.

A plugin file is plain Python that fills the registries (``from rewards import orms; orms["x"] = X``).
It is the user's own code on their own disk, loaded once at start-up: nothing that crossed a process
boundary is ever executed.

An ms-swift plugin file loads unchanged: when no ``swift`` package is installed, ``compat/`` (rollstream's
``swift`` shim: ``swift.plugin``, ``swift.rewards``, ``swift.rollout``, ``swift.llm``, ... re-exporting
rollstream's own registries and classes) goes at the end of ``sys.path``. An installed ms-swift, or any other
top-level ``swift``, always wins: the shim only fills a gap.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from pathlib import Path

from pipeline.errors import UserError

# Not a package: a directory holding the shim's top-level ``swift`` package, on sys.path only when needed.
SWIFT_SHIM_DIR = Path(__file__).resolve().parent.parent / "compat"

_loaded: set[Path] = set()


class PluginError(UserError, RuntimeError):
    pass


def add_swift_shim() -> bool:
    """Make ``import swift`` find rollstream's shim when nothing else provides ``swift``; True when the shim
    is (now) what ``import swift`` gives. Appended, never prepended: a real ms-swift always wins."""
    spec = importlib.util.find_spec("swift")
    if spec is None:
        sys.path.append(str(SWIFT_SHIM_DIR))
        importlib.invalidate_caches()
        spec = importlib.util.find_spec("swift")
    return spec is not None and _is_shim(spec.origin)


def _is_shim(origin: str | None) -> bool:
    return origin is not None and Path(origin).resolve().is_relative_to(SWIFT_SHIM_DIR)


def _swift_import_error(raw: str, exc: ImportError) -> PluginError | None:
    """A clear error for a plugin's failed ``swift`` import (None when the import was not of ``swift``)."""
    module = exc.name or ""
    if module != "swift" and not module.startswith("swift."):
        return None
    found = sys.modules.get("swift")
    origin = getattr(found, "__file__", None)
    if _is_shim(origin):
        missing = f"has no module {module!r}" if isinstance(exc, ModuleNotFoundError) else f"lacks a name ({exc})"
        return PluginError(
            f"run.external_plugins: {raw}: rollstream's ms-swift compatibility layer {missing}. It covers "
            "the plugin API (swift.plugin, swift.rewards, swift.rollout, swift.infer_engine, swift.llm, "
            "swift.template, swift.utils; see docs/rewards.md, 'Bring your ms-swift / TRL plugin'); import "
            "anything else from rollstream's own modules (rewards, schedulers), or install ms-swift"
        )
    try:
        importlib.metadata.version("ms-swift")
    except importlib.metadata.PackageNotFoundError:
        where = origin or "an unknown location"
        return PluginError(
            f"run.external_plugins: {raw}: `import {module}` failed ({exc}); the `swift` package this Python "
            f"finds ({where}) is not ms-swift (OpenStack Swift installs a `swift` package too), and rollstream's "
            "ms-swift shim steps aside for any installed `swift`. Uninstall that package in this environment, "
            "install ms-swift, or import from rollstream's own modules (rewards, schedulers)"
        )
    return None  # a real ms-swift that lacks the name: its own error says it best


def load_plugins(paths: list[str]) -> None:
    if paths:
        add_swift_shim()
    for raw in paths:
        path = Path(raw).expanduser().resolve()
        if path in _loaded:
            continue
        if not path.is_file():
            raise PluginError(f"run.external_plugins: {raw} does not exist; give the path of a .py file")
        if path.suffix != ".py":  # importlib has no loader for other suffixes (it returned no spec)
            raise PluginError(f"run.external_plugins: {raw} is not a .py file")
        spec = importlib.util.spec_from_file_location(f"rollstream_plugin_{path.stem}", path)
        if spec is None or spec.loader is None:  # not after the checks above; said plainly if it ever is
            raise PluginError(f"run.external_plugins: {raw} cannot be imported (no module loader for it)")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        try:
            spec.loader.exec_module(module)
        except ImportError as exc:
            sys.modules.pop(spec.name, None)
            error = _swift_import_error(raw, exc)
            if error is None:
                raise
            raise error from exc
        except (OSError, SyntaxError) as exc:  # unreadable, not Python (a plugin bug keeps its traceback)
            sys.modules.pop(spec.name, None)
            if isinstance(exc, SyntaxError):
                where, reason = (f" line {exc.lineno}" if exc.lineno else ""), exc.msg
            else:
                where, reason = "", str(exc)
            raise PluginError(f"run.external_plugins: {raw}{where}: {reason}") from None
        _loaded.add(path)


def load_object(spec: str, setting: str) -> object:
    """The object a ``"module:attribute"`` setting names (rollout.tools, rollout.environment_factory,
    rollout.agent): the module imported as any import would (it must be on the path), the attribute read
    (dotted for a nested one). The user names the module, as with run.external_plugins."""
    import importlib

    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise PluginError(f'{setting} = {spec!r}: give "module:name" (e.g. "my_tools:add")')
    try:
        obj: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise PluginError(f"{setting} = {spec!r}: cannot import {module_name!r} ({exc}); is it on PYTHONPATH "
                          f"(or in the run's directory)?") from None
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise PluginError(f"{setting} = {spec!r}: module {module_name!r} has no {attribute!r}")
        obj = getattr(obj, part)
    return obj

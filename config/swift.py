"""ms-swift's (and TRL's) argument names inside a config: translated to rollstream's fields through the tables
in ``config/swift_args.py`` and ``config/trl_args.py``, a field set twice an error naming both."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from config import swift_args, trl_args
from config.schema import FIELDS, SECTIONS, ConfigError, field_default, fits


def swift_in_section(section: str, name: str) -> bool:
    """Is ``name`` an ms-swift argument that may stand in [section]: its rollstream fields live there, or it
    sets none (refused or not needed: its value is checked wherever it stands)."""
    arg = trl_args.known(name)  # ms-swift's names, and TRL's that ms-swift lacks
    if arg is None:
        return False
    homes = trl_args.known_homes(name)
    return not homes or all(h.split(".")[0] == section for h in homes)


def translate_swift(name: str, value: Any, given: Mapping[str, Any], where: str) -> dict[str, Any]:
    """{"section.field": value} of one ms-swift argument, each value fitted to its field's type."""
    try:
        assigned = trl_args.translate_known(name, value, given)
    except swift_args.SwiftArgError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return {dotted: _fit_swift(dotted, new) for dotted, new in assigned.items()}


def _fit_swift(dotted: str, value: Any) -> Any:
    """ms-swift writes one value where rollstream takes a list, and lists of one where it takes one value."""
    section, field = dotted.split(".")
    type_ = FIELDS[section][field]
    if value is None or isinstance(value, swift_args.Deferred) or fits(value, type_):
        return value
    if not isinstance(value, list) and fits([value], type_):
        return [value]
    if isinstance(value, list) and len(value) == 1 and fits(value[0], type_):
        return value[0]
    return value  # msgspec explains the mismatch at build time


def swift_names(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A nested copy of ``data`` with ms-swift's names (top-level keys, or keys inside the section of their
    rollstream field) translated; a field set twice (two names, or a name and its section's field) is an
    error naming both. Unknown keys stay for check_keys to report."""
    out: dict[str, Any] = {}
    origin: dict[str, str] = {}
    flat = {k: v for k, v in data.items() if not (k in SECTIONS and isinstance(v, dict)) and trl_args.known(k)}

    def put(dotted: str, value: Any, who: str) -> None:
        if dotted in origin:
            raise ConfigError(
                f"{where}: {origin[dotted]} and {who} both set {dotted}; give it once"
            )
        origin[dotted] = who
        section, field = dotted.split(".")
        out.setdefault(section, {})[field] = value

    for key, value in data.items():
        if key in flat:
            for dotted, new in translate_swift(key, value, flat, where).items():
                put(dotted, new, f"{key} (ms-swift's name)")
        elif key in SECTIONS and isinstance(value, dict):
            out.setdefault(key, {})
            given = {k: v for k, v in value.items() if k not in FIELDS[key]}
            for field, v in value.items():
                if field in FIELDS[key] or not swift_in_section(key, field):
                    put(f"{key}.{field}", v, f"{key}.{field}")
                    continue
                for dotted, new in translate_swift(field, v, given, f"{where}: [{key}] {field}").items():
                    put(dotted, new, f"[{key}] {field} (ms-swift's name)")
        else:
            out[key] = value
    return out


def apply_swift(data: dict[str, Any], args: Mapping[str, Any], where: str) -> None:
    """ms-swift arguments (the command line's) over ``data``: they override its values; two of them that set
    the same field are an error naming both."""
    setters: dict[str, str] = {}
    for name, value in args.items():
        for dotted, new in translate_swift(name, value, args, where).items():
            if dotted in setters:
                raise ConfigError(f"{where}: --{setters[dotted]} and --{name} both set {dotted}; give one of them")
            setters[dotted] = name
            section, field = dotted.split(".")
            data.setdefault(section, {})[field] = new


def resolve_deferred(data: Mapping[str, Any]) -> dict[str, Any]:
    """Fill the values an ms-swift argument derives from the rest of the config (padding_free's budget)."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}

    def get(dotted: str) -> Any:
        section, field = dotted.split(".")
        value = out.get(section, {}).get(field, _MISSING_VALUE)
        return field_default(section, field) if value is _MISSING_VALUE else value

    for table in out.values():
        if not isinstance(table, dict):
            continue
        for field, value in table.items():
            if isinstance(value, swift_args.Deferred):
                try:
                    table[field] = value.resolve(get)
                except ValueError as exc:
                    raise ConfigError(str(exc)) from None
    return out


_MISSING_VALUE = object()

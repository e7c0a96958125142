"""Loading: a TOML file, ms-swift's flags and ``--set`` overrides into one validated, derived Config;
msgspec's type errors rewritten to name the field, the value and what would be valid."""

from __future__ import annotations

import difflib
import re
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, get_origin

import msgspec

from config import swift_args, trl_args
from config.derive import derive
from config.schema import (
    ALIASES,
    FIELDS,
    READ_ONLY,
    SECTIONS,
    Config,
    ConfigError,
    Section,
    did_you_mean,
    fits,
    input_type,
    literal_choices,
    meta_of,
    range_text,
    type_name,
)
from config.swift import apply_swift, resolve_deferred, swift_in_section, swift_names, translate_swift
from config.validate import check


def parse_override(text: str) -> tuple[str, str, Any]:
    """``"section.key=value"`` -> ``(section, key, value)``; the value parses as TOML.

    A value that is not valid TOML is a string (``run.name=demo-2``), and a bare ``none`` means unset
    (``grpo.generation_batch_size=none``; quote it for the string: ``'data.system="none"'``).
    A deeper key (``data.columns.query=prompt``) comes back as ``key = "columns.query"``.
    """
    section, key, raw = _split_override(text)
    return section, key, _parse_value(raw)


def _split_override(text: str) -> tuple[str, str, str]:
    lhs, sep, raw = text.partition("=")
    parts = [p.strip() for p in lhs.split(".")]
    if not sep or len(parts) < 2 or not all(re.fullmatch(r"[A-Za-z0-9_-]+", p) for p in parts):
        raise ConfigError(
            f"--set {text!r}: expected section.key=value, e.g. --set grpo.num_generations=8 "
            f"or --set 'reward.reward_weights=[1.0, 0.5]'"
        )
    return parts[0], ".".join(parts[1:]), raw.strip()


def _parse_value(raw: str) -> Any:
    if raw == "none":
        return None
    try:
        doc = tomllib.loads(f"value = {raw}")
    except tomllib.TOMLDecodeError:
        return raw
    # "1\nother = 2" parses, but as two keys: that is not one value.
    return doc["value"] if doc.keys() == {"value"} else raw


def _apply_override(data: dict[str, Any], text: str) -> None:
    section, key, raw = _split_override(text)
    value = _parse_value(raw)
    field, *subkeys = key.split(".")
    field = ALIASES.get(f"{section}.{field}", f"{section}.{field}").split(".")[1]  # a former name: its field
    if section in SECTIONS and field not in FIELDS[section] and not subkeys and swift_in_section(section, field):
        # an ms-swift name whose rollstream field lives in this section (--set rollout.vllm_max_model_len=2048)
        for dotted, new in translate_swift(field, value, {field: value}, f"--set {text}").items():
            data.setdefault(dotted.split(".")[0], {})[dotted.split(".")[1]] = new
        return
    check_keys({section: {field: None}}, where=f"--set {text}")
    field_type = FIELDS[section][field]
    table = data.setdefault(section, {})
    if subkeys:  # data.columns.query=prompt sets one entry of a table field
        if get_origin(field_type) is not dict or len(subkeys) > 1:
            raise ConfigError(f"--set {text}: {section}.{field} has no key {'.'.join(subkeys)} to set")
        current = table.get(field)
        table[field] = {**(current if isinstance(current, dict) else {}), subkeys[0]: value}
        return
    if not fits(value, field_type) and fits(raw, field_type):
        value = raw  # the shell ate the quotes: run.name=2024 means the string "2024"
    table[field] = value


def load_config(
    path: str | Path | None, overrides: Iterable[str] = (), swift: Mapping[str, Any] | None = None
) -> Config:
    """Read a TOML file (None = every default), apply ms-swift-named arguments (``swift``: the command line's
    ``--reward_funcs accuracy ...``, config/swift_args.py), then ``--set`` overrides in order; validate, derive.
    With no file, ``--rlhf_type`` marks the flags as an ms-swift command: ms-swift's train_type (lora) then.

    The TOML may use ms-swift's names at its top level (``num_generations = 8``) or inside the section that
    holds the rollstream field (``[rollout] vllm_max_model_len = 4096``); one field given twice is an error.
    The command line's ms-swift flags override the file; ``--set`` overrides both."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file {str(path)!r} not found (see configs/ for examples)") from None
        except IsADirectoryError:
            raise ConfigError(f"config file {str(path)!r} is a directory; give a .toml file") from None
        except OSError as exc:  # unreadable: permissions, a broken device
            raise ConfigError(f"config file {str(path)!r} cannot be read: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:  # TOML is UTF-8; tomllib does not wrap this one
            raise ConfigError(
                f"{path}: not valid TOML: not UTF-8 text ({exc.reason} at byte {exc.start})"
            ) from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
        data = swift_names(resolve_aliases(data, where=str(path)), where=str(path))
        check_keys(data, where=str(path))
    if swift:
        apply_swift(data, swift, where="command line")
        if path is None and "rlhf_type" in swift:
            # `--rlhf_type grpo ...` without -c is an ms-swift command: what it leaves out takes ms-swift's
            # default where that changes what trains (train_type lora, not the TOML's full; README's table)
            for dotted, value in swift_args.command_defaults(swift).items():
                section, field = dotted.split(".")
                data.setdefault(section, {}).setdefault(field, value)
    for text in overrides:
        _apply_override(data, text)
    return config_from_dict(data)


def config_from_dict(data: Mapping[str, Any]) -> Config:
    """Validate a nested ``{section: {key: value}}`` mapping (as TOML gives it; ms-swift's names too, see
    load_config) into a resolved Config."""
    data = swift_names(resolve_aliases(data, where="config"), where="config")
    check_keys(data, where="config")
    data = resolve_deferred(data)
    sections = {name: _build_section(name, cls, data.get(name, {})) for name, cls in SECTIONS.items()}
    cfg = Config(**sections)  # pyright: ignore[reportArgumentType]  (each its own struct: SECTIONS)
    derive(cfg)
    check(cfg)
    return cfg


def resolve_aliases(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``data`` with every former field name (``ALIASES``) under its field's name. Both names with different
    values is an error naming the two."""
    out = dict(data)
    for old, new in ALIASES.items():
        section, old_key = old.split(".")
        new_key = new.split(".")[1]
        table = out.get(section)
        if not isinstance(table, Mapping) or old_key not in table:
            continue
        table = dict(table)
        value = table.pop(old_key)
        if new_key in table and table[new_key] != value:
            raise ConfigError(
                f"{where}: {old} = {value!r} and {new} = {table[new_key]!r}: {old} is the former name of {new}; "
                f"give {new} only"
            )
        table[new_key] = value
        out[section] = table
    return out


def check_keys(data: Mapping[str, Any], where: str) -> None:
    for section, table in data.items():
        if section not in SECTIONS:
            homes = [f"{s}.{section}" for s, fields in FIELDS.items() if section in fields]
            if homes and not isinstance(table, dict):
                hint = f"; settings live in sections: did you mean {' or '.join(homes)}?"
            elif not isinstance(table, dict):  # a top-level key: ms-swift's names are taken there
                close = difflib.get_close_matches(section, trl_args.known_names(), n=1, cutoff=0.6)
                kind = "an ms-swift" if close and swift_args.lookup(close[0]) else "a TRL"
                hint = (
                    (f"; did you mean {close[0]} ({kind} argument)?" if close else "")
                    or "; it is neither a section nor an ms-swift or TRL argument (docs/swift-arguments.md, "
                    "docs/trl-arguments.md)"
                )
                raise ConfigError(f"{where}: unknown key {section}{hint}")
            else:
                hint = (
                    did_you_mean(section, SECTIONS, fmt="[{}]") or f"; valid sections: {', '.join(SECTIONS)}"
                )
            raise ConfigError(f"{where}: unknown section [{section}]{hint}")
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: {section} must be a table ([{section}] with key = value lines)")
        for key in table:
            if key not in FIELDS[section]:
                raise ConfigError(f"{where}: {_unknown_key(section, key)}")


def _unknown_key(section: str, key: str) -> str:
    dotted = f"{section}.{key}"
    if dotted in READ_ONLY:
        return f"{dotted} {READ_ONLY[dotted]}"
    hint = did_you_mean(key, FIELDS[section])
    if not hint:
        homes = [f"{s}.{key}" for s, fields in FIELDS.items() if key in fields]
        hint = f"; it lives elsewhere: did you mean {' or '.join(homes)}?" if homes else ""
    if not hint and trl_args.known_homes(key):
        hint = f"; ms-swift's {key} is {' and '.join(trl_args.known_homes(key))}: set it there, or as {key} at the top level"
    return f"unknown key {dotted}{hint or f'; valid keys in [{section}]: ' + ', '.join(FIELDS[section])}"


def _build_section(section: str, cls: type[Section], table: Mapping[str, Any]) -> Section:
    values = {key: _convert(f"{section}.{key}", value, input_type(section, key)) for key, value in table.items()}
    return cls(**values)


def _convert(name: str, value: Any, type_: Any) -> Any:
    try:
        return msgspec.convert(value, type_)
    except msgspec.ValidationError as exc:
        raise ConfigError(_explain(name, value, type_, str(exc))) from None


def _explain(name: str, value: Any, type_: Any, message: str) -> str:
    """Turn msgspec's validation message into ours: the field first, then what is wrong."""
    if m := re.fullmatch(r"Expected `([^`]+)`, got `([^`]+)`(?: - at `\$([^`]*)`)?", message):
        at = m[3] or ""
        if at == "[...]" and isinstance(value, dict):  # msgspec does not name the bad key of a table
            at = next((f".{k}" for k, v in value.items() if not fits({k: v}, type_)), at)
        shown = "" if at or isinstance(value, (list, dict)) else f" ({value!r})"
        return f"{name}{at}: expected {type_name(m[1])}, got {type_name(m[2])}{shown}"
    if message.startswith("Invalid enum value"):
        choices = literal_choices(type_)
        return f"{name}={value!r} is not one of {', '.join(choices)}{did_you_mean(str(value), choices)}"
    if meta := meta_of(type_):
        return f"{name}={value!r} is out of range; valid range: {range_text(name.split('.')[-1], meta)}"
    return f"{name}: {message}"

"""Using a loaded config: ``replace`` (re-derived), the resolved dict, the TOML text of ``config show`` and
the run's output directory."""

from __future__ import annotations

import math
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec

from config.load import check_keys, config_from_dict
from config.schema import FORMULAS, READ_ONLY, SECTIONS, Config, ConfigError


def replace(cfg: Config, section: str, **changes: Any) -> Config:
    """A new, re-validated Config with ``changes`` in ``section``, as if they were ``--set`` overrides:
    derived values are derived again (``replace(cfg, "grpo", num_generations=4)`` updates
    prompt_batch_size)."""
    data = _inputs(cfg)
    check_keys({section: changes}, where="replace()")
    data[section].update(changes)
    return config_from_dict(data)


def _derived_keys(cfg: Config) -> frozenset[str]:
    derived = getattr(cfg, "_derived", None)
    if derived is not None:
        return derived
    # Built by hand, not by load_config: keep what wins anyway (generation_batch_size over
    # steps_per_generation, effective_batch_size over gradient_accumulation_steps).
    g, keys = cfg.grpo, set()
    if g.generation_batch_size is not None and g.steps_per_generation is not None:
        keys.add("grpo.steps_per_generation")
    if g.effective_batch_size is not None and g.gradient_accumulation_steps is not None:
        keys.add("grpo.gradient_accumulation_steps")
    return frozenset(keys)


def _inputs(cfg: Config) -> dict[str, dict[str, Any]]:
    """The given values (derived ones left out) that rebuild ``cfg`` through ``config_from_dict``."""
    data = {name: msgspec.to_builtins(getattr(cfg, name)) for name in SECTIONS}
    for dotted in _derived_keys(cfg):
        section, key = dotted.split(".")
        data[section][key] = None
    return data


def resolved(cfg: Config) -> dict[str, dict[str, Any]]:
    """Every section as a nested dict, with the derived values (prompt_batch_size, drop_last) included."""
    data = {name: msgspec.to_builtins(getattr(cfg, name)) for name in SECTIONS}
    data["grpo"]["prompt_batch_size"] = cfg.grpo.prompt_batch_size
    data["grpo"]["drop_last"] = cfg.grpo.drop_last
    return data


def format_config(cfg: Config) -> str:
    """TOML text for ``rollstream config show``. Derived and unset values are comments, so the text
    loads back into the same Config."""
    derived = _derived_keys(cfg)
    lines = ["# rollstream config, resolved; derived values are shown as comments"]
    for name, values in resolved(cfg).items():
        lines += ["", f"[{name}]"]
        for key, value in values.items():
            dotted = f"{name}.{key}"
            if dotted in derived or dotted in READ_ONLY:
                lines.append(f"# {key} = {toml_value(value)}  (derived: {FORMULAS[dotted]})")
            elif value is None:
                lines.append(f"# {key} = (unset)")
            else:
                lines.append(f"{key} = {toml_value(value)}")
    return "\n".join(lines) + "\n"


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        return '"' + re.sub(r"[\x00-\x1f\x7f]", lambda c: f"\\u{ord(c[0]):04x}", escaped) + '"'
    if isinstance(value, list):
        return "[" + ", ".join(map(toml_value, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_value(str(k))} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def resolve_output_dir(cfg: Config, now: datetime | None = None) -> Path:
    """``run.output_dir``, or ``runs/<name>-<YYYYmmdd-HHMMSS>`` when it is empty. Call it once per run.

    Over Redis (``transport.kind = "redis"``) a run's workers are separate processes, maybe on several
    hosts: each would stamp its own time into an empty output_dir, and a relative one means each process's
    working directory. So there the directory must be named (an error otherwise), and a relative one is made
    absolute here, so the paths the learner announces name the same place in every process."""
    if cfg.transport.kind == "redis":
        if not cfg.run.output_dir:
            raise ConfigError(
                'run.output_dir is empty with transport.kind = "redis": the workers of a run over Redis are '
                "separate processes and each would pick a directory of its own; set run.output_dir to one "
                "directory for the run (the learner writes its snapshots, checkpoints and metrics there; with "
                'rollout.weight_transport = "file" every rollout worker must be able to read it)'
            )
        return Path(cfg.run.output_dir).expanduser().absolute()
    if cfg.run.output_dir:
        return Path(cfg.run.output_dir).expanduser()
    return Path("runs") / f"{cfg.run.name}-{(now or datetime.now()).strftime('%Y%m%d-%H%M%S')}"

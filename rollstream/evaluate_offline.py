"""``rollstream eval``: evaluate saved weights once, offline, exactly as the evaluate stage does in a run
(same held-out prompts, seeds, sampling and rewards)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from config import Config
from data.loading import load_eval_rows
from engines.base import EngineBase
from engines.models import model_dir_of
from pipeline.errors import SetupError
from pipeline.plugins import load_plugins
from pipeline.records import WeightsPublished
from rollstream.train import quiet_libraries
from stages.evaluate import Evaluate


def snapshot_version(path: Path) -> int | None:
    """The policy version of a weights directory: ``weights/v000004`` -> 4, a checkpoint's trainer_state."""
    if m := re.fullmatch(r"v(\d+)", path.name):
        return int(m[1])
    state = path / "trainer_state.json"
    if state.is_file():
        return int(json.loads(state.read_text()).get("policy_version", 0))
    return None


def resolve_weights(spec: str) -> tuple[Path, int]:
    """``DIR|RUN_DIR[:VERSION]`` -> (weights directory, policy version). A run directory gives its newest
    snapshot (``weights/v*``) or the one ``:VERSION`` names; raises SetupError naming what exists."""
    base, sep, tail = spec.rpartition(":")
    path, version = (Path(base), int(tail)) if sep and tail.isdigit() else (Path(spec), None)
    path = path.expanduser()
    if (path / "weights").is_dir():  # a run directory
        snapshots = sorted(p for p in (path / "weights").glob("v*") if snapshot_version(p) is not None)
        if version is not None:
            snapshots = [p for p in snapshots if snapshot_version(p) == version]
        if not snapshots:
            kept = ", ".join(p.name for p in sorted((path / "weights").glob("v*"))) or "none"
            raise SetupError(
                f"--weights {spec}: no snapshot of that version in {path / 'weights'} (kept: {kept})"
            )
        path = snapshots[-1]
    if not (path / "model.safetensors").is_file():
        raise SetupError(
            f"--weights {spec}: {path} holds no model.safetensors; give a weights snapshot "
            f"(RUN_DIR/weights/v000004), a checkpoint-<step> directory, or a run directory"
        )
    found = snapshot_version(path)
    if found is None:
        raise SetupError(
            f"--weights {spec}: cannot tell which policy version {path} holds; give RUN_DIR[:VERSION], a "
            f"RUN_DIR/weights/v* snapshot or a checkpoint-<step> directory"
        )
    if version is not None and found != version:
        raise SetupError(f"--weights {spec}: {path} holds version {found}, not {version}")
    return path, found


async def run_offline(
    cfg: Config, weights: str, out: Path | None = None, *, engine: EngineBase | None = None
) -> dict[str, Any]:
    """``rollstream eval``: load the weights into a fresh engine (or ``engine``, reset to the model's own
    weights first), evaluate the held-out set as the eval stage does (same prompts, seeds, sampling and
    rewards), print a table and write JSON. Returns the row."""
    quiet_libraries()
    load_plugins(cfg.run.external_plugins)
    path, version = resolve_weights(weights)
    rows = load_eval_rows(cfg)
    model_dir = model_dir_of(cfg)
    if engine is not None:
        await engine.reset_weights(model_dir)
    stage = Evaluate(cfg, model_dir, rows, output_dir=None, engine=engine, shared=False)

    await stage.prepare((cfg.run.name, "evaluate", "offline"))
    try:
        row = await stage.evaluate(WeightsPublished(version=version, path=str(path)), "offline")
    finally:
        await stage.close()
    row["weights"] = str(path)
    out = out or path.parent / f"eval-v{version:06d}.json"
    out.write_text(json.dumps(row, indent=2) + "\n")
    width = max(len(k) for k in row)
    for key, value in row.items():
        shown = f"{value:.4f}" if isinstance(value, float) else str(value)
        print(f"{key:<{width}}  {shown}")
    print(f"written: {out}")
    return row

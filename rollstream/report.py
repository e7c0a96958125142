"""``run.report_to``: send each optimizer step's metrics.jsonl row to TensorBoard and/or Weights & Biases,
as ms-swift's ``report_to`` does. Neither package is a dependency: asking for one that is not installed
is a ``ReportError`` at start-up that says how to install it.

The learner calls ``Reporters.log(row)`` (its ``on_step`` callback) with ms-swift's metric names, so the
curves carry the same names as metrics.jsonl (``rewards/accuracy/mean``, ``completions/mean_length``, ...).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from config import Config, resolved
from pipeline.errors import UserError


class ReportError(UserError, RuntimeError):
    """A ``run.report_to`` entry that cannot be used here; the message names the package and the fix."""


def _scalars(row: dict[str, Any]) -> dict[str, float]:
    # step and time index the row; they are not curves of their own.
    return {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and k not in ("step", "time")}


class TensorBoard:
    """Event files under ``<output_dir>/tensorboard`` (``tensorboard --logdir RUN_DIR/tensorboard``)."""

    def __init__(self, cfg: Config, output_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ReportError(
                'run.report_to includes "tensorboard" but the tensorboard package is not installed: '
                "pip install tensorboard, or remove it from run.report_to"
            ) from exc
        self.log_dir = Path(output_dir) / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=10)

    def log(self, row: dict[str, Any]) -> None:
        for key, value in _scalars(row).items():
            self.writer.add_scalar(key, value, global_step=row["step"])

    def close(self) -> None:
        self.writer.close()


class Wandb:
    """One W&B run named after ``run.name`` (project: $WANDB_PROJECT, else "rollstream"); the resolved
    config is its config. Offline or online as wandb's own settings say ($WANDB_MODE)."""

    def __init__(self, cfg: Config, output_dir: Path) -> None:
        try:
            import wandb  # pyright: ignore[reportMissingImports]  (optional: run.report_to = ["wandb"])
        except ImportError as exc:
            raise ReportError(
                'run.report_to includes "wandb" but the wandb package is not installed: '
                "pip install wandb, or remove it from run.report_to"
            ) from exc
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "rollstream"),
            name=cfg.run.name,
            dir=str(output_dir),
            config=resolved(cfg),
        )

    def log(self, row: dict[str, Any]) -> None:
        self.run.log(_scalars(row), step=row["step"])

    def close(self) -> None:
        self.run.finish()


REPORTERS: dict[str, type] = {"tensorboard": TensorBoard, "wandb": Wandb}


class Reporters:
    """The configured reporters, fed one metrics row at a time."""

    def __init__(self, cfg: Config, output_dir: Path) -> None:
        self.reporters = []
        try:
            for name in cfg.run.report_to:
                self.reporters.append(REPORTERS[name](cfg, output_dir))
        except BaseException:
            self.close()
            raise

    def log(self, row: dict[str, Any]) -> None:
        for reporter in self.reporters:
            reporter.log(row)

    def close(self) -> None:
        for reporter in self.reporters:
            reporter.close()
        self.reporters = []

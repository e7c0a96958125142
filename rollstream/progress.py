"""Live progress for ``rollstream train`` (rich on a terminal, plain lines otherwise) and the summary."""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any, Self

from rich.console import Console
from rich.live import Live
from rich.table import Table

from config import Config
from pipeline.edges import CONSUMER_GROUPS
from pipeline.run_dir import COMPLETIONS_FILE
from pipeline.transport.base import Transport
from rollstream.plot import split_rows
from stages.feeder import BatchPlan

EDGES = ("prompts", "trajectories", "scored", "train")
LOG_EVERY = 10  # optimizer steps between two plain progress lines and two completion tables


def accuracy_key(cfg: Config) -> str:
    """The metric the summary follows: the accuracy reward if configured, else the total reward."""
    return "rewards/accuracy/mean" if "accuracy" in cfg.reward.reward_funcs else "reward"


class LiveProgress:
    """Step, version, reward, accuracy, samples/s, staleness and queue depths, refreshed twice a second."""

    def __init__(self, cfg: Config, plan: BatchPlan, output_dir: Path, transport: Transport) -> None:
        self.cfg = cfg
        self.total_steps = cfg.run.max_steps or plan.num_batches * plan.optimizer_steps_per_batch
        self.output_dir = output_dir
        self.transport = transport
        self.console = Console(stderr=False)
        self.interactive = self.console.is_terminal
        self.last: dict[str, Any] = {}
        self.depths: dict[str, int] = {}
        self.started = time.monotonic()
        self._task: asyncio.Task | None = None
        self._live: Live | None = None
        self._printed_step = 0
        self._table_step = 0

    def on_step(self, row: dict[str, Any]) -> None:
        self.last = row
        if not self.interactive and (row["step"] - self._printed_step >= LOG_EVERY or row["step"] == self.total_steps):
            self._printed_step = row["step"]
            print(self._line(), flush=True)

    def on_completions(self, rows: list[dict[str, Any]]) -> None:
        """A trained batch's completions.jsonl rows: every LOG_EVERY steps, print run.num_completions_to_print of them."""
        n = self.cfg.run.num_completions_to_print
        step = rows[-1]["step"] if rows else 0
        if n == 0 or not rows or (step - self._table_step < LOG_EVERY and step != self.total_steps):
            return
        self._table_step = step
        table = completions_table(completions_to_print(rows, n, self.cfg.run.seed + step), step)
        (self._live.console if self._live is not None else self.console).print(table)

    def _line(self) -> str:
        r = self.last
        acc = r.get(accuracy_key(self.cfg), 0.0)
        queues = " ".join(f"{e}={self.depths.get(e, 0)}" for e in EDGES)
        return (
            f"step {r.get('step', 0)}/{self.total_steps}  version {r.get('policy_version', 0)}  "
            f"reward {r.get('reward', 0.0):.3f}  accuracy {acc:.3f}  samples/s {r.get('samples_per_second', 0.0):.1f}  "
            f"staleness {r.get('staleness/mean', 0.0):.2f}  kl {r.get('kl', 0.0):.4f}  queues {queues}  "
            f"elapsed {time.monotonic() - self.started:.0f}s"
        )

    def _table(self) -> Table:
        r = self.last
        table = Table(title=f"rollstream train — {self.cfg.run.name}  ({self.output_dir})", show_header=False)
        table.add_column("metric", style="bold")
        table.add_column("value")
        table.add_row("step", f"{r.get('step', 0)} / {self.total_steps}")
        table.add_row("policy version", str(r.get("policy_version", 0)))
        table.add_row("reward", f"{r.get('reward', 0.0):.3f}  (std {r.get('reward_std', 0.0):.3f})")
        table.add_row("accuracy", f"{r.get(accuracy_key(self.cfg), 0.0):.3f}")
        table.add_row("samples/s", f"{r.get('samples_per_second', 0.0):.1f}")
        table.add_row("staleness", f"mean {r.get('staleness/mean', 0.0):.2f}  max {r.get('staleness/max', 0)}")
        table.add_row("kl / loss", f"{r.get('kl', 0.0):.4f} / {r.get('loss', 0.0):.4f}")
        table.add_row("queues", "  ".join(f"{e} {self.depths.get(e, 0)}" for e in EDGES))
        table.add_row("elapsed", f"{time.monotonic() - self.started:.0f} s")
        return table

    async def _refresh(self) -> None:
        while True:
            for edge in EDGES:
                try:
                    stats = await self.transport.stats(edge, edge_group(edge))
                    self.depths[edge] = stats.lag + stats.pending
                except Exception:  # noqa: BLE001, S110 - a display must never stop training
                    pass
            if self._live is not None:
                self._live.update(self._table())
            await asyncio.sleep(0.5)  # refresh period

    async def __aenter__(self) -> Self:
        if self.interactive:
            self._live = Live(self._table(), console=self.console, refresh_per_second=4)
            self._live.start()
        else:
            print(f"training {self.cfg.run.name}: {self.total_steps} optimizer steps, output in {self.output_dir}", flush=True)
        self._task = asyncio.create_task(self._refresh())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._live is not None:
            self._live.update(self._table())
            self._live.stop()


def completions_to_print(rows: list[dict[str, Any]], n: int, seed: int) -> list[dict[str, Any]]:
    """Pure: the completions a table shows (TRL's num_completions_to_print): a seeded random sample of ``n`` of
    ``rows`` in their order, all of them when ``n`` is at least their number; each as prompt, completion, one
    column per reward function, reward and advantage."""
    if n < len(rows):
        rows = [rows[i] for i in sorted(random.Random(seed).sample(range(len(rows)), n))]
    return [
        {"prompt": r["prompt"], "completion": r["completion"], **r["rewards"], "reward": r["reward"], "advantage": r["advantage"]}
        for r in rows
    ]


def completions_table(rows: list[dict[str, Any]], step: int) -> Table:
    table = Table(title=f"completions at step {step}", show_lines=True, expand=True)
    columns = list(dict.fromkeys(key for row in rows for key in row))
    for name in columns:
        table.add_column(name, justify="left" if name in ("prompt", "completion") else "right")
    for row in rows:
        table.add_row(*(_cell(row.get(name)) for name in columns))
    return table


def _cell(value: Any) -> str:
    return "-" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)


def edge_group(edge: str) -> str:
    """The consumer group that reads an edge (the stage's name)."""
    return CONSUMER_GROUPS[edge]


def summarize(output_dir: Path, cfg: Config, seconds: float) -> dict[str, float]:
    """Print and return accuracy over the first 10 % of steps -> the last 10 %."""
    path = output_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    rows, evals = split_rows(rows)
    key = accuracy_key(cfg)
    if not rows:
        print(f"no optimizer step finished; see {output_dir / 'train.log'}", file=sys.stderr)
        return {}
    tenth = max(1, len(rows) // 10)
    first = sum(r[key] for r in rows[:tenth]) / tenth
    last = sum(r[key] for r in rows[-tenth:]) / tenth
    versions = rows[-1]["policy_version"]
    samples = versions * cfg.grpo.generation_batch_size
    # Steady state: from the first published version to the last, without start-up and model build.
    first_publish = next(r["time"] for r in rows if r["policy_version"] == rows[0]["policy_version"])
    steady_seconds = rows[-1]["time"] - first_publish
    steady = (samples - cfg.grpo.generation_batch_size) / steady_seconds if steady_seconds > 0 else 0.0
    completions = output_dir / COMPLETIONS_FILE if cfg.run.log_completions else "not written (run.log_completions = false)"
    final = output_dir / "final"  # written at the run's end only: a stopped run has its checkpoint instead
    weights = final if final.exists() else "none (stopped early: `--resume latest` goes on from the last checkpoint)"
    print(
        f"\n{key}: first 10% of steps {first:.3f} -> last 10% {last:.3f} ({last - first:+.3f})\n"
        f"{len(rows)} optimizer steps, policy version {versions}, {samples} samples in {seconds:.0f} s "
        f"(steady state {steady:.1f} samples/s after start-up)\n"
        f"metrics: {path}\ncompletions: {completions}\nfinal weights: {weights}",
        flush=True,
    )
    summary = {"first": first, "last": last, "steps": len(rows)}
    eval_key = f"eval_{key}"
    evals = [r for r in evals if eval_key in r]
    if evals:
        summary.update(eval_first=evals[0][eval_key], eval_last=evals[-1][eval_key], evaluations=len(evals))
        print(
            f"held-out {eval_key}: version {evals[0]['policy_version']} {evals[0][eval_key]:.3f} -> "
            f"version {evals[-1]['policy_version']} {evals[-1][eval_key]:.3f} ({len(evals)} evaluations)",
            flush=True,
        )
    return summary

"""``rollstream plot RUN_DIR``: the training curves of a run as one PNG, from its metrics.jsonl.

One panel per question a person asks of a GRPO run, over optimizer steps, with ms-swift's metric names:
is the reward going up (``reward``, ``reward_std``), which reward functions move (``rewards/<func>/mean``),
how far the policy drifts from the reference (``kl``), what the completions look like
(``completions/{mean,min,max}_length``), how stale the trained samples were (``staleness/mean|max``),
and how fast the pipeline runs (``samples_per_second``); with evaluation on, train vs held-out reward
against policy version (``"split": "eval"`` rows). ``rollstream train`` writes ``plot.png`` at the end.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

# (title, [(metrics.jsonl key, legend label)]); per-function rewards are found in the rows.
PANELS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("reward", (("reward", "reward"), ("reward_std", "reward_std"))),
    ("reward per function", ()),
    ("kl", (("kl", "kl"),)),
    (
        "completion length",
        (("completions/mean_length", "mean"), ("completions/min_length", "min"), ("completions/max_length", "max")),
    ),
    ("staleness", (("staleness/mean", "mean"), ("staleness/max", "max"))),
    ("samples/s", (("samples_per_second", "samples/s"),)),
    ("train vs eval reward", ()),
)
PANEL_TITLES = tuple(title for title, _ in PANELS)
_REWARD_FUNC = re.compile(r"rewards/(?P<func>.+)/mean")


def split_rows(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(optimizer-step rows, evaluation rows)`` of one metrics.jsonl (eval rows carry ``"split": "eval"``)."""
    return [r for r in rows if r.get("split") != "eval"], [r for r in rows if r.get("split") == "eval"]


def read_rows(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: plot needs a run directory written by `rollstream train`")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise FileNotFoundError(f"{path} has no rows yet: no optimizer step has finished")
    return rows


def reward_functions(rows: list[dict[str, Any]]) -> list[str]:
    """Reward function names in first-seen order, from the ``rewards/<func>/mean`` keys."""
    names: dict[str, None] = {}
    for row in rows:
        for key in row:
            match = _REWARD_FUNC.fullmatch(key)
            if match:
                names.setdefault(match["func"])
    return list(names)


def figure(rows: list[dict[str, Any]], title: str = "") -> Any:
    """A matplotlib Figure, one axes per entry of PANELS (a panel shows "not logged" when its metric
    is absent, e.g. kl with beta = 0), steps on the x axes."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display is needed or wanted
    from matplotlib.figure import Figure

    fig = Figure(figsize=(20, 8), layout="constrained")
    axes = fig.subplots(2, 4).flatten()
    rows, evals = split_rows(rows)
    steps = [row.get("step", i + 1) for i, row in enumerate(rows)]
    for ax in axes[len(PANELS) :]:
        fig.delaxes(ax)
    for ax, (panel_title, series) in zip(axes, PANELS):
        if panel_title == "train vs eval reward":
            _train_vs_eval(ax, rows, evals)
            continue
        if panel_title == "reward per function":
            series = tuple((f"rewards/{name}/mean", name) for name in reward_functions(rows))
        drawn = 0
        for key, label in series:
            points = [(s, row[key]) for s, row in zip(steps, rows) if isinstance(row.get(key), (int, float))]
            if points:
                ax.plot(*zip(*points), label=label, linewidth=1.2)
                drawn += 1
        ax.set_title(panel_title)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(loc="best", fontsize="small")
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    if title:
        fig.suptitle(title)
    return fig


def _train_vs_eval(ax: Any, rows: list[dict[str, Any]], evals: list[dict[str, Any]]) -> None:
    """Reward (and accuracy, when logged) on the training batches and on the held-out set, by policy version."""
    drawn = 0
    for key, label in (("reward", "reward"), ("rewards/accuracy/mean", "accuracy")):
        for split, split_rows_, name in (("train", rows, key), ("eval", evals, f"eval_{key}")):
            points = [(r["policy_version"], r[name]) for r in split_rows_ if isinstance(r.get(name), (int, float))]
            if points:
                ax.plot(*zip(*points), label=f"{split} {label}", linewidth=1.2, marker="o" if split == "eval" else None)
                drawn += 1
    ax.set_title("train vs eval reward")
    ax.set_xlabel("policy version")
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(loc="best", fontsize="small")
    else:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")


def write(run_dir: Path, out: Path | None = None) -> Path:
    """Render ``run_dir/metrics.jsonl`` to ``out`` (default ``run_dir/plot.png``); returns the path."""
    run_dir = Path(run_dir)
    out = Path(out) if out is not None else run_dir / "plot.png"
    fig = figure(read_rows(run_dir), title=run_dir.name)
    fig.savefig(out, dpi=100)
    return out

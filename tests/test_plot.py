"""``rollstream plot``: the figure's panels and what they draw, the PNG on disk, the CLI, and its errors."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from rollstream import plot
from rollstream.cli import main


def write_metrics(run_dir: Path, steps: int = 20, with_kl: bool = True) -> list[dict]:
    rows = []
    for step in range(1, steps + 1):
        row = {
            "step": step,
            "reward": 0.1 + 0.04 * step,
            "reward_std": 0.3,
            "rewards/accuracy/mean": 0.02 * step,
            "rewards/format/mean": 1.0,
            "completions/mean_length": 6.0 + step % 3,
            "completions/min_length": 2.0,
            "completions/max_length": 16.0,
            "staleness/mean": 0.5,
            "staleness/max": 1,
            "samples_per_second": 100.0 + step,
            "policy_version": (step + 3) // 4,
        }
        if with_kl:
            row["kl"] = 0.001 * step
        rows.append(row)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])  # the IHDR chunk: width, height


def lines_of(ax) -> dict[str, tuple[list, list]]:
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}


def test_figure_has_the_expected_panels_and_draws_the_rows(tmp_path) -> None:
    rows = write_metrics(tmp_path / "run")
    fig = plot.figure(plot.read_rows(tmp_path / "run"))
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == [
        "reward",
        "reward per function",
        "kl",
        "completion length",
        "staleness",
        "samples/s",
        "train vs eval reward",
    ]
    axes = dict(zip(titles, fig.axes))
    reward = lines_of(axes["reward"])
    assert reward["reward"] == (list(range(1, 21)), [r["reward"] for r in rows])
    assert set(reward) == {"reward", "reward_std"}
    per_func = lines_of(axes["reward per function"])
    assert set(per_func) == {"accuracy", "format"}  # found from the rewards/<func>/mean keys
    assert per_func["accuracy"][1][-1] == pytest.approx(0.4)
    assert set(lines_of(axes["completion length"])) == {"mean", "min", "max"}
    assert lines_of(axes["samples/s"])["samples/s"][1][0] == 101.0
    assert all(ax.get_xlabel() == "optimizer step" for ax in fig.axes[:-1])


def test_a_metric_that_was_not_logged_says_so(tmp_path) -> None:
    write_metrics(tmp_path / "run", with_kl=False)  # beta = 0: no kl column
    fig = plot.figure(plot.read_rows(tmp_path / "run"))
    kl = next(ax for ax in fig.axes if ax.get_title() == "kl")
    assert kl.get_lines() == []
    assert [t.get_text() for t in kl.texts] == ["not logged"]


def test_write_and_cli_produce_a_png(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    write_metrics(run)
    path = plot.write(run)
    assert path == run / "plot.png"
    assert png_size(path) == (2000, 800)  # figsize 20x8 inches at 100 dpi
    assert path.stat().st_size > 20_000  # six panels of lines and text, not an empty canvas
    out = tmp_path / "elsewhere.png"
    assert main(["plot", str(run), "-o", str(out)]) == 0
    assert png_size(out) == (2000, 800)
    assert capsys.readouterr().out.strip() == str(out)


def test_plot_of_a_directory_without_metrics_is_a_one_line_error(tmp_path, capsys) -> None:
    assert main(["plot", str(tmp_path)]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text("")
    assert main(["plot", str(tmp_path)]) == 2
    assert "no optimizer step has finished" in capsys.readouterr().err

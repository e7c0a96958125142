"""``run.report_to``: rows reach a real TensorBoard event file; a reporter whose package is missing is a
clear error; the config accepts only known reporters. (Neither package is a dependency: the tests that
need one skip, saying so, where it is not installed.)"""

from __future__ import annotations

import importlib.util
import json

import pytest

from config import ConfigError, load_config
from rollstream.report import ReportError, Reporters

ROWS = [
    {"step": step, "reward": 0.1 * step, "rewards/accuracy/mean": 0.05 * step, "policy_version": 1, "time": 1.7e9}
    for step in (1, 2, 3)
]


def config(tmp_path, *report_to: str):
    return load_config(
        "configs/demo.toml",
        [f"run.output_dir={json.dumps(str(tmp_path))}", f"run.report_to={json.dumps(list(report_to))}"],
    )


def test_no_reporters_by_default(tmp_path) -> None:
    cfg = load_config("configs/demo.toml", [])
    assert cfg.run.report_to == []
    reporters = Reporters(cfg, tmp_path)
    reporters.log(ROWS[0])  # nothing configured: nothing written
    reporters.close()
    assert list(tmp_path.iterdir()) == []


def test_unknown_reporter_is_a_config_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match="report_to"):
        config(tmp_path, "mlflow")


def test_tensorboard_event_file_has_every_row(tmp_path) -> None:
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (optional: pip install tensorboard)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reporters = Reporters(config(tmp_path, "tensorboard"), tmp_path)
    for row in ROWS:
        reporters.log(row)
    reporters.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"reward", "rewards/accuracy/mean", "policy_version"}
    reward = events.Scalars("reward")
    assert [e.step for e in reward] == [1, 2, 3]
    assert [e.value for e in reward] == pytest.approx([0.1, 0.2, 0.3])
    assert [e.value for e in events.Scalars("rewards/accuracy/mean")] == pytest.approx([0.05, 0.1, 0.15])


@pytest.mark.parametrize("name", ["tensorboard", "wandb"])
def test_missing_package_says_how_to_install_it(tmp_path, name) -> None:
    if importlib.util.find_spec(name) is not None:
        pytest.skip(f"{name} is installed here, so the missing-package error cannot happen")
    with pytest.raises(ReportError, match=f"pip install {name}, or remove it from run.report_to"):
        Reporters(config(tmp_path, name), tmp_path)

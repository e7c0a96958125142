"""Bad input at the command line: every mistake is exit code 2 and one line on stderr that names the field
and what would be valid (the range, or the registered names), before any model, engine or connection."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rollstream.cli import main


def train(tmp_path, *overrides: str, config: str = "configs/demo.toml") -> list[str]:
    return [
        "train",
        "-c",
        config,
        "--set",
        f"run.output_dir={json.dumps(str(tmp_path / 'out'))}",
        *[arg for o in overrides for arg in ("--set", o)],
    ]


def one_line(capsys, argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    "override,expected",
    [
        (
            "grpo.per_device_train_batch_size=-4",
            ["grpo.per_device_train_batch_size=-4", "per_device_train_batch_size >= 1"],
        ),
        ("grpo.num_generations=0", ["grpo.num_generations=0", "num_generations >= 1"]),
        ("grpo.max_completion_length=-1", ["grpo.max_completion_length", ">= 1"]),
        ("rollout.max_model_len=0", ["rollout.max_model_len", ">= 1"]),
        ("transport.maxlen=-10", ["transport.maxlen", ">= 1"]),
        ("reward.timeout_s=-1.5", ["reward.timeout_s", "> 0"]),
        ("grpo.max_staleness=-1", ["grpo.max_staleness", ">= 0"]),
        # demo.toml has two rewards (accuracy, format): three weights do not match
        (
            "reward.reward_weights=[1.0, 0.5, 2.0]",
            ["reward.reward_weights", "one weight per reward, 2", "accuracy"],
        ),
        ("reward.reward_weights=[1.0]", ["reward.reward_weights", "holds 1"]),
        ("grpo.loss_type=grpoo", ["grpo.loss_type", "grpo, bnpo, dr_grpo, dapo", "did you mean grpo"]),
    ],
)
def test_config_mistakes(tmp_path, capsys, override, expected):
    line = one_line(capsys, train(tmp_path, override))
    assert line.startswith("config error: ")
    for text in expected:
        assert text in line


def test_unknown_reward_lists_the_registered_ones(tmp_path, capsys):
    line = one_line(capsys, train(tmp_path, "reward.reward_funcs=['acuracy']", "reward.reward_weights=none"))
    assert "reward.reward_funcs" in line and "'acuracy'" in line and "did you mean 'accuracy'" in line
    assert "registered: " in line and "format" in line


def test_unknown_scheduler_lists_the_registered_ones(tmp_path, capsys):
    line = one_line(capsys, train(tmp_path, "rollout.multi_turn_scheduler=thinking_tip"))
    assert "rollout.multi_turn_scheduler" in line and "'thinking_tip'" in line
    assert "did you mean 'thinking_tips_scheduler'" in line and "tool_call_scheduler" in line


def test_missing_dataset_file(tmp_path, capsys):
    line = one_line(capsys, train(tmp_path, f"data.dataset={json.dumps(str(tmp_path / 'nope.jsonl'))}"))
    assert "data.dataset" in line and "nope.jsonl" in line and "no such file" in line and "arithmetic" in line


def test_unreadable_dataset_file(tmp_path, capsys):
    data = tmp_path / "latin1.jsonl"
    data.write_bytes(b'{"prompt": "caf\xe9", "solution": "1"}\n')
    line = one_line(capsys, train(tmp_path, f"data.dataset={json.dumps(str(data))}"))
    assert "data.dataset" in line and "latin1.jsonl" in line and "cannot be read" in line


@pytest.mark.parametrize(
    "name,content,expected",
    [
        ("missing.py", None, "does not exist"),
        ("plugin.txt", "x = 1\n", "is not a .py file"),
        ("broken.py", "def f(:\n", "line 1"),
        ("latin1.py", b"x = '\xe9'\n", "latin1.py"),
    ],
)
def test_plugin_files(tmp_path, capsys, name, content, expected):
    path = tmp_path / name
    if isinstance(content, str):
        path.write_text(content)
    elif content is not None:
        path.write_bytes(content)
    line = one_line(capsys, train(tmp_path, f"run.external_plugins=[{json.dumps(str(path))}]"))
    assert "run.external_plugins" in line and name in line and expected in line


def test_config_file_not_utf8_and_a_directory(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b'[run]\nname = "caf\xe9"\n')
    line = one_line(capsys, ["train", "-c", str(bad)])
    assert "bad.toml" in line and "not UTF-8" in line
    line = one_line(capsys, ["train", "-c", str(tmp_path)])
    assert "is a directory" in line


def test_as_a_real_process(tmp_path):
    """The same through the console entry point: exit status 2, one line."""
    result = subprocess.run(
        [sys.executable, "-m", "rollstream.cli", *train(tmp_path, "grpo.num_generations=0")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "grpo.num_generations" in lines[0] and "num_generations >= 1" in lines[0]

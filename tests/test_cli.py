"""The command line as a user meets it: help, config show, and one-line errors for bad input."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

ROLLSTREAM = [sys.executable, "-m", "rollstream.cli"]


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*ROLLSTREAM, *args], check=False, capture_output=True, text=True, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_help_lists_the_commands():
    result = run("--help")
    assert result.returncode == 0
    for command in ("train", "worker", "config", "tiny-model", "reset"):
        assert command in result.stdout


def test_config_show_prints_derived_values():
    result = run("config", "show", "-c", "configs/demo.toml", "--set", "grpo.generation_batch_size=128")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "generation_batch_size = 128" in text
    assert "steps_per_generation" in text and "prompt_batch_size" in text and "max_staleness" in text


@pytest.mark.parametrize(
    "override,expected",
    [
        ("grpo.num_generation=4", "did you mean num_generations"),
        ("grpo.generation_batch_size=60", "nearest valid"),
        ("grpo.temperature=0", "temperature"),
    ],
)
def test_bad_config_is_one_line_naming_the_field(override, expected):
    result = run("config", "show", "-c", "configs/demo.toml", "--set", override)
    assert result.returncode == 2
    assert expected in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.strip().splitlines() if line.startswith("error")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    return lines[0]


def test_missing_model_dir(tmp_path):
    result = run("train", "-c", "configs/demo.toml", "--set", f"run.output_dir={json.dumps(str(tmp_path))}",
                 "--set", f"model.model={json.dumps(str(tmp_path / 'nope'))}")
    line = one_line_error(result)
    assert "model.model" in line and "nope" in line


def test_dataset_without_solution_column(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "What is 1+1?", "gold": "2"}\n')  # "answer" would be mapped (ms-swift's aliases)
    result = run("train", "-c", "configs/demo.toml", "--set", f"run.output_dir={json.dumps(str(tmp_path / 'out'))}",
                 "--set", f"data.dataset={json.dumps(str(data))}")
    line = one_line_error(result)
    assert "solution" in line and "data.columns" in line


def test_dataset_smaller_than_one_generation_batch(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "What is 1+1?", "solution": "2"}\n')
    result = run("train", "-c", "configs/demo.toml", "--set", f"run.output_dir={json.dumps(str(tmp_path / 'out'))}",
                 "--set", f"data.dataset={json.dumps(str(data))}")
    line = one_line_error(result)
    assert "1 prompts" in line and "grpo.prompt_batch_size" in line


def test_redis_that_does_not_answer(tmp_path):
    url = f"redis://127.0.0.1:{free_port()}/0"
    result = run("train", "-c", "configs/demo-redis.toml", "--set", f"run.output_dir={json.dumps(str(tmp_path))}",
                 "--set", f"transport.url={json.dumps(url)}")
    line = one_line_error(result)
    assert url.rsplit("/", 1)[0] in line and "redis-server" in line


def test_train_resume_defaults_to_latest_and_says_when_there_is_no_checkpoint(tmp_path, capsys):
    from rollstream.cli import build_parser, main

    parser = build_parser()
    assert parser.parse_args(["train", "-c", "x.toml", "--resume"]).resume == "latest"
    assert parser.parse_args(["train", "-c", "x.toml", "--resume", "runs/a/checkpoint-8"]).resume == "runs/a/checkpoint-8"
    assert parser.parse_args(["train", "-c", "x.toml"]).resume is None
    # in this process: the error comes before any model or transport is touched
    code = main(["train", "-c", "configs/demo.toml", "--set", f"run.output_dir={json.dumps(str(tmp_path))}", "--resume"])
    assert code == 2
    assert capsys.readouterr().err.startswith("error: --resume latest: no complete checkpoint in " + str(tmp_path))


def test_eval_bad_input_is_one_line(tmp_path):
    split = ["--set", "data.split_dataset_ratio=0.05"]
    result = run("eval", "-c", "configs/demo.toml", *split, "--weights", str(tmp_path))
    assert "holds no model.safetensors" in one_line_error(result)
    result = run("eval", "-c", "configs/demo.toml", *split, "--set", "eval.per_device_eval_batch_size=6", "--weights", "x")
    assert result.returncode == 2 and "nearest valid per_device_eval_batch_size: 8" in result.stderr
    missing = json.dumps(str(tmp_path / "nope.jsonl"))
    result = run("worker", "evaluate", "-c", "configs/demo.toml", "--set", f"data.val_dataset={missing}")
    assert "nope.jsonl" in one_line_error(result) and "no such file" in result.stderr


def test_worker_resume_is_for_the_learner_and_says_when_there_is_no_checkpoint(tmp_path, capsys):
    from rollstream.cli import build_parser, main

    parser = build_parser()
    assert parser.parse_args(["worker", "learner", "-c", "x.toml", "--resume"]).resume == "latest"
    assert parser.parse_args(["worker", "learner", "-c", "x.toml"]).resume is None
    output_dir = f"run.output_dir={json.dumps(str(tmp_path))}"
    assert main(["worker", "feeder", "-c", "configs/demo-redis.toml", "--set", output_dir, "--resume"]) == 2
    assert capsys.readouterr().err.startswith("error: --resume: only the learner worker resumes from a checkpoint")
    # the checkpoint is looked up before the transport is opened
    code = main(["worker", "learner", "-c", "configs/demo-redis.toml", "--set", output_dir, "--resume"])
    assert code == 2
    assert capsys.readouterr().err.startswith("error: --resume latest: no complete checkpoint in " + str(tmp_path))


# --- ms-swift's argument names as flags (config/swift_args.py; more in tests/test_swift_args.py) ---


@pytest.mark.parametrize(
    "command",
    [["train"], ["worker", "feeder"], ["eval", "--weights", "x"], ["config", "show"], ["reset"], ["top", "--once"]],
)
def test_every_command_that_reads_a_config_takes_ms_swift_flags(command):
    # the flags reach the config: a refused one and a batch that cannot divide fail before anything starts
    result = run(*command, "-c", "configs/demo.toml", "--deepspeed", "zero3")
    assert "ms-swift's deepspeed='zero3' is refused: DeepSpeed is not available" in config_error(result)
    result = run(*command, "-c", "configs/demo.toml", "--num_generations", "3", "--rlhf_type", "grpo")
    assert "must be divisible by num_generations=3" in config_error(result)


def config_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr[-2000:]
    (line,) = [line for line in result.stderr.strip().splitlines() if not line.startswith("note: ")]
    assert line.startswith("config error: ")
    return line


def test_flags_alone_make_a_config_and_a_command_without_any_is_refused():
    result = run("config", "show", "--reward_funcs", "accuracy", "--num_generations", "4", "--max_steps", "-1",
                 "--logging_steps", "1")
    assert result.returncode == 0, result.stderr
    assert 'reward_funcs = ["accuracy"]' in result.stdout and "max_steps = 0" in result.stdout
    assert result.stderr.startswith("note: --logging_steps has no effect in rollstream: every optimizer step")
    result = run("train")
    assert result.returncode == 2 and "give a config: -c FILE, and/or ms-swift flags" in result.stderr
    result = run("plot", "x", "--num_generations", "4")  # a command without a config takes none
    assert result.returncode == 2 and "unrecognized arguments: --num_generations 4" in result.stderr

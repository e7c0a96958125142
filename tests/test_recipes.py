"""The recipes in configs/ as a user starts from them (issue #28): every one loads with the real
``rollstream config show``; the one-GPU GSM8K recipe trains 2 steps through ``rollstream train`` with the tiny
model and a small GSM8K-shaped file put in place of the Hub model and dataset; and an ms-swift args.json,
converted by ``rollstream config from-swift``, trains 2 steps the same way.

Each run is a real subprocess: the CLI, a real vLLM engine (CPU) on the tiny model, the real torch learner."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RECIPES = sorted((ROOT / "configs").glob("*.toml"))
REAL_MODEL_RECIPES = [p for p in RECIPES if p.name.startswith("qwen")]


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollstream.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, check=False)


def gsm8k_file(path: Path, rows: int = 32) -> Path:
    """GSM8K's shape (question, answer ending in '#### N'), with sums the tiny model can read."""
    lines = []
    for i in range(rows):
        a, b = i % 7 + 1, i % 5 + 2
        lines.append(json.dumps({"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}))
    path.write_text("\n".join(lines) + "\n")
    return path


def steps_of(output_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def test_there_are_real_model_recipes():
    names = {p.name for p in REAL_MODEL_RECIPES}
    assert {"qwen2.5-0.5b-gsm8k.toml", "qwen2.5-7b-numina-1node.toml", "qwen2.5-3b-numina-2nodes.toml"} <= names
    for path in REAL_MODEL_RECIPES:  # each says what it runs on and how to start it
        header = path.read_text().split("\n[", 1)[0]
        assert "Hardware assumed" in header and "rollstream" in header, path.name


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_loads_with_config_show(path):
    result = cli("config", "show", "-c", str(path.relative_to(ROOT)))
    assert result.returncode == 0, result.stderr
    assert "[grpo]" in result.stdout


# Keeps a recipe CPU-fast: the tiny model, fp32, eager vLLM, short prompts and completions, 2 steps of one
# 16-completion generation batch.
TINY = [
    "model.model=tiny", "model.torch_dtype=float32", "rollout.dtype=float32", "rollout.enforce_eager=true",
    "rollout.max_model_len=256", "data.max_length=64", "data.system=none", "grpo.max_completion_length=16",
    "grpo.per_device_train_batch_size=8", "run.max_steps=2",
]


@pytest.mark.e2e
def test_the_gsm8k_recipe_trains_two_steps_with_the_tiny_model(tmp_path):
    data = gsm8k_file(tmp_path / "gsm8k.jsonl")
    out = tmp_path / "run"
    sets = [*TINY, f"data.dataset={json.dumps(str(data))}", "data.val_dataset=none", f"run.output_dir={json.dumps(str(out))}",
            f"run.name=recipe-{uuid.uuid4().hex[:6]}", "grpo.steps_per_generation=2",
            "rollout.engine=async", "rollout.server_urls=[]"]  # the in-process engine instead of a GPU server
    args = [a for s in sets for a in ("--set", s)]
    result = cli("train", "-c", "configs/qwen2.5-0.5b-gsm8k.toml", *args, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert steps_of(out) == [1, 2]


@pytest.mark.e2e
def test_an_ms_swift_args_json_converted_by_from_swift_trains_two_steps(tmp_path, tiny_model_dir):
    # The v3.12.6 args.json (DeepSpeed, 4 processes, the 7B model), as the same run on the tiny model and a
    # small local file would have written it.
    args = json.loads((ROOT / "tests" / "data_swift" / "args_v3.12.6.json").read_text())
    data = gsm8k_file(tmp_path / "gsm8k.jsonl")
    args.update({
        "model": str(tiny_model_dir), "ref_model": str(tiny_model_dir), "dataset": [str(data)],
        "torch_dtype": "float32", "max_completion_length": 16, "max_new_tokens": 16, "response_length": 16,
        "max_length": 64, "vllm_max_model_len": 256, "vllm_enforce_eager": True, "num_generations": 4,
        "per_device_train_batch_size": 4, "global_world_size": 2, "gradient_accumulation_steps": 2,
        "max_steps": 2, "learning_rate": 1e-4,
    })
    args_json = tmp_path / "args.json"
    args_json.write_text(json.dumps(args, indent=2))
    converted = tmp_path / "converted.toml"
    name = f"swift-{uuid.uuid4().hex[:6]}"
    result = cli("config", "from-swift", str(args_json), "-o", str(converted), "--name", name)
    assert result.returncode == 3 and not converted.exists()  # DeepSpeed, 2 processes, bf16: not silently
    result = cli("config", "from-swift", str(args_json), "-o", str(converted), "--name", name, "--accept-changes")
    assert result.returncode == 0, result.stderr
    assert "deepspeed=" in result.stderr and "global_world_size=2: ms-swift trained in 2 processes" in result.stderr
    out = tmp_path / "run"
    result = cli("train", "-c", str(converted), "--set", f"run.output_dir={json.dumps(str(out))}", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert steps_of(out) == [1, 2]
    config = (out / "config.toml").read_text()
    # 4 per device x 2 processes = 8 per mini-batch; 2 mini-batches per step and per generation batch
    assert "per_device_train_batch_size = 8" in config and "gradient_accumulation_steps = 2" in config

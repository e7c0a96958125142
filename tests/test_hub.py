"""Hub ids, through the Hugging Face libraries' own caches and offline (HF_HUB_OFFLINE=1): the tiny model in the
hub cache layout (``models--org--name/snapshots/<rev>/``) loaded by its id, a dataset in the ``datasets`` cache
loaded by its id (with ``:subset`` and ``#N``), and the errors when an id is in neither the cache nor reachable.

huggingface_hub and datasets read HF_HOME / HF_HUB_OFFLINE at import, so each load runs in a fresh process
with its environment; nothing here reaches the network."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from data.loading import DatasetError, load_dataset
from engines.models import resolve_model_dir
from pipeline.errors import SetupError

ROOT = Path(__file__).resolve().parents[1]
REPO = "testorg/tiny-chat"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def offline_env(hf_home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    return {**env, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "PYTHONPATH": str(ROOT), **extra}


def python(code: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def last_json(result: subprocess.CompletedProcess):
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def place_in_hub_cache(home: Path, repo_id: str, model_dir: Path, subfolder: str = "") -> Path:
    """``model_dir`` as ``hf download repo_id`` leaves it: blobs named by content hash, a snapshot of symlinks to
    them under the commit (in ``subfolder``), and refs/main naming the commit. Returns the snapshot."""
    repo = home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    (repo / "blobs").mkdir(parents=True)
    for path in sorted(p for p in Path(model_dir).rglob("*") if p.is_file()):
        content = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(content).hexdigest()
        blob.write_bytes(content)
        link = snapshot / subfolder / path.relative_to(model_dir)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, tiny_model_dir) -> Path:
    """A Hugging Face home whose hub cache holds the tiny model as testorg/tiny-chat, under model/ in
    testorg/nested, and as testorg/tiny-rm (a causal LM loads as a sequence classifier with a new head)."""
    home = tmp_path_factory.mktemp("hf-home")
    place_in_hub_cache(home, REPO, tiny_model_dir)
    place_in_hub_cache(home, "testorg/nested", tiny_model_dir, subfolder="model")
    place_in_hub_cache(home, "testorg/tiny-rm", tiny_model_dir)
    return home


def test_model_id_resolves_offline_to_its_snapshot_and_loads(hf_home):
    code = f"""
import json
from transformers import AutoModelForCausalLM, AutoTokenizer
from engines.models import model_dir_of, resolve_model_dir
from config import load_config
directory = resolve_model_dir({REPO!r}, progress=None)
cfg = load_config("configs/demo.toml", ["model.model={REPO}", "model.model_revision={REVISION}"])
tokenizer = AutoTokenizer.from_pretrained(directory)
model = AutoModelForCausalLM.from_pretrained(directory)
print(json.dumps({{"dir": str(directory), "pinned": str(model_dir_of(cfg, progress=None)),
                  "ids": tokenizer.encode("What is 1+2?"), "params": sum(p.numel() for p in model.parameters())}}))
"""
    out = last_json(python(code, offline_env(hf_home)))
    snapshot = hf_home / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / REVISION
    assert out["dir"] == out["pinned"] == str(snapshot)
    assert out["ids"] and out["params"] > 0


def test_subfolder_ids_and_reward_models_by_id(hf_home):
    code = """
import json
from engines.models import resolve_model_dir
from config import load_config
from rewards.models import build_reward_model
cfg = load_config("configs/demo.toml", ["reward.reward_model=testorg/tiny-rm", "reward.reward_weights=none"])
reward = build_reward_model(cfg.reward.reward_model, cfg)
scores = reward(["3"], messages=[[{"role": "user", "content": "What is 1+2?"}, {"role": "assistant", "content": "3"}]])
print(json.dumps({"nested": str(resolve_model_dir("testorg/nested:model", progress=None)), "scores": scores}))
"""
    out = last_json(python(code, offline_env(hf_home)))
    assert out["nested"] == str(hf_home / "hub" / "models--testorg--nested" / "snapshots" / REVISION / "model")
    assert len(out["scores"]) == 1 and isinstance(out["scores"][0], float)


def test_model_id_missing_from_the_cache_names_the_id_the_cache_and_the_fix(hf_home, tmp_path):
    code = """
from engines.models import resolve_model_dir
from pipeline.errors import SetupError
try:
    resolve_model_dir("testorg/not-downloaded")
except SetupError as exc:
    print(exc)
"""
    empty = tmp_path / "empty-home"
    message = python(code, offline_env(empty)).stdout.strip()
    assert "model.model = 'testorg/not-downloaded'" in message
    assert str(empty / "hub") in message and "HF_HUB_OFFLINE=1" in message
    assert "hf download testorg/not-downloaded" in message and "HF_HOME" in message
    # a revision the cache does not hold is the same: offline, nothing else can be looked up
    code = code.replace('"testorg/not-downloaded"', f'"{REPO}", revision="v9"')
    assert f"model.model = '{REPO}' (revision 'v9'): not in the Hugging Face cache" in python(
        code, offline_env(hf_home)).stdout


def test_names_that_are_neither_built_in_local_nor_ids():
    with pytest.raises(SetupError, match=r"'tinyy': no model there and not a Hub id \(did you mean the built-in 'tiny'"):
        resolve_model_dir("tinyy")
    with pytest.raises(SetupError, match="no model there"):
        resolve_model_dir("./models/none")


def test_modelscope_ids_need_the_modelscope_package():
    try:
        import modelscope  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("modelscope is installed here: the error is for machines without it")
    with pytest.raises(SetupError, match=r"model.use_hf = false .*pip install modelscope"):
        resolve_model_dir("Qwen/Qwen2.5-0.5B-Instruct", use_hf=False)


# --- Hub datasets ------------------------------------------------------------------------------------------

# What an online ``load_dataset("someorg/toy-math", "main")`` leaves in the datasets cache: the prepared Arrow
# tables under <HF_DATASETS_CACHE>/someorg___toy-math/<subset>/0.0.0/<commit>/. The json builder is what the Hub
# module runs for a repository of .jsonl files; its configs are the repository's subsets.
PREPARE = """
import json, sys
from pathlib import Path
from datasets.data_files import DataFilesDict
from datasets.packaged_modules.json.json import Json, JsonConfig

src = Path(sys.argv[1])
subsets = {"main": [{"question": f"What is {i}+1?", "answer": str(i + 1), "grade": i} for i in range(5)],
           "hard": [{"problem": f"Solve x*{i}=0.", "solution": "0"} for i in range(3)]}
for name, rows in subsets.items():
    (src / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in rows))

class ToyMath(Json):
    BUILDER_CONFIGS = [JsonConfig(name=n, data_files=DataFilesDict.from_patterns({"train": [str(src / f"{n}.jsonl")]}))
                       for n in subsets]

for name in subsets:
    builder = ToyMath(dataset_name="toy-math", config_name=name, hash=sys.argv[2])
    builder.repo_id = "someorg/toy-math"  # the Hub module names its cache folder <namespace>___<name>
    builder._cache_dir = builder._output_dir = builder._build_cache_dir()
    builder.download_and_prepare()
"""


@pytest.fixture(scope="module")
def datasets_home(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("hf-datasets-home")
    src = tmp_path_factory.mktemp("toy-math-files")
    result = subprocess.run([sys.executable, "-c", PREPARE, str(src), REVISION], cwd=ROOT, env=offline_env(home),
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    for path in src.iterdir():
        path.unlink()  # the load below can only come from the cache
    return home


def test_hub_dataset_loads_offline_from_the_datasets_cache_by_id(datasets_home):
    code = """
import json
from data.loading import load_dataset
from data.loading import load_rows
from config import load_config
rows = load_dataset(["someorg/toy-math:main#3", "someorg/toy-math:hard"], seed=0, require_solution=True)
cfg = load_config("configs/demo.toml", ['data.dataset=["someorg/toy-math:main#3", "someorg/toy-math:hard"]',
                                        "data.data_seed=0"])
print(json.dumps([rows, load_rows(cfg)]))
"""
    rows, through_config = last_json(python(code, offline_env(datasets_home)))
    assert through_config == rows
    assert len(rows) == 3 + 3
    assert all(r["messages"][0]["content"].startswith("What is") for r in rows[:3])  # GSM8K-style, no columns
    assert {r["solution"] for r in rows[:3]} <= {str(i + 1) for i in range(5)} and "grade" in rows[0]
    assert rows[3:] == [{"messages": [{"role": "user", "content": f"Solve x*{i}=0."}], "solution": "0"}
                        for i in range(3)]  # NuminaMath-style


def test_hub_dataset_errors_name_the_id_the_subsets_and_the_cache(datasets_home, tmp_path):
    code = """
from data.loading import DatasetError, load_dataset
try:
    load_dataset(SPEC)
except DatasetError as exc:
    print(exc)
"""
    several = python(code.replace("SPEC", '"someorg/toy-math"'), offline_env(datasets_home)).stdout
    assert "someorg/toy-math" in several and "main" in several and "hard" in several and "id:subset" in several
    assert len(several.strip().splitlines()) == 1
    empty = tmp_path / "empty-home"
    missing = python(code.replace("SPEC", '"someorg/never-loaded"'), offline_env(empty)).stdout
    assert "'someorg/never-loaded' is not in the datasets cache" in missing and str(empty / "datasets") in missing
    assert "HF_HUB_OFFLINE=1" in missing and "HF_DATASETS_CACHE" in missing


def test_relative_names_are_files_not_ids():
    with pytest.raises(DatasetError, match="no such file or folder"):
        load_dataset("./someorg/toy-math")


@pytest.mark.e2e
def test_train_two_steps_on_a_hub_model_id_with_open_prompts(hf_home, tmp_path):
    """``rollstream train --set model.model=testorg/tiny-chat`` offline: vLLM, the learner and the tokenizers all
    get the snapshot directory; the prompts have no solution column and only the format reward scores them."""
    data = tmp_path / "open.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i % 10}+{i // 10}?"}) + "\n" for i in range(64)))
    out = tmp_path / "run"
    settings = [f"model.model={REPO}", f"data.dataset={json.dumps(str(data))}", 'reward.reward_funcs=["format"]',
                "reward.reward_weights=none", "run.max_steps=2", f"run.output_dir={json.dumps(str(out))}",
                "rollout.max_model_len=256", "run.name=hub-e2e"]
    command = [sys.executable, "-m", "rollstream.cli", "train", "-c", "configs/demo.toml"]
    for setting in settings:
        command += ["--set", setting]
    result = subprocess.run(command, cwd=ROOT, env=offline_env(hf_home), capture_output=True, text=True,
                            timeout=540, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]


@pytest.mark.e2e
def test_an_ms_swift_command_line_runs_on_hub_ids(hf_home, datasets_home, tmp_path):
    """The shape of an ms-swift user's ``swift rlhf --rlhf_type grpo --model ... --dataset ...#N --reward_funcs
    accuracy format`` command, given to ``rollstream train`` as it is: a Hub model id and a Hub dataset id with
    ms-swift's ``:subset#N``, GSM8K-style columns mapped with no data.columns, offline from the caches."""
    out = tmp_path / "run"
    command = [sys.executable, "-m", "rollstream.cli", "train", "--rlhf_type", "grpo", "--model", REPO,
               "--dataset", "someorg/toy-math:main#32", "--reward_funcs", "accuracy", "format",
               "--reward_weights", "1.0", "0.2", "--num_generations", "4", "--per_device_train_batch_size", "16",
               "--generation_batch_size", "32", "--max_completion_length", "16", "--learning_rate", "1e-4",
               "--max_steps", "2", "--output_dir", str(out), "--vllm_max_model_len", "256"]
    env = offline_env(hf_home, HF_DATASETS_CACHE=str(datasets_home / "datasets"))
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=540, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    assert all("rewards/accuracy/mean" in s and "rewards/format/mean" in s for s in steps)
    # no --train_type: ms-swift's default, LoRA, as the same command trains in ms-swift (README's table)
    assert 'train_type = "lora"' in (out / "config.toml").read_text()

"""ms-swift's GRPO argument names (issue #28): the table (config/swift_args.py), the names in a TOML and on the
command line, and ``rollstream config from-swift`` on the args.json files ms-swift v3.12.6 and main write
(tests/data_swift/: every argument of RLHFArguments with its value, most at ms-swift's defaults, the values
its start-up fills in, nested dicts, lists and None).

The runs these configs train: tests/test_recipes.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from config import FIELDS, ConfigError, config_from_dict, load_config, swift_args
from config.swift_args import ACCEPTED, MAPPED, NOT_NEEDED, REFUSED, SwiftArgError

ROOT = Path(__file__).resolve().parent.parent
ARGS_JSON = sorted((ROOT / "tests" / "data_swift").glob("args_*.json"))
TABLE = swift_args.table()


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollstream.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, check=False)


# --- the table ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ARGS_JSON, ids=lambda p: p.name)
def test_every_argument_an_ms_swift_run_writes_is_in_the_table(path):
    args = json.loads(path.read_text())
    assert len(args) > 450  # the whole RLHFArguments, not a hand-picked few
    assert [name for name in args if name not in TABLE] == []


def test_every_rollstream_field_the_table_names_exists():
    for arg in TABLE.values():
        assert arg.kind in (ACCEPTED, MAPPED) or not arg.targets, arg
        for target in arg.targets:
            section, field = target.split(".")
            assert field in FIELDS[section], f"{arg.name} -> {target}"
        if arg.kind == ACCEPTED:
            assert arg.targets == (f"{arg.targets[0].split('.')[0]}.{arg.name}",), arg  # same name
        if arg.kind in (REFUSED, NOT_NEEDED):
            assert arg.why, arg.name


def test_refused_arguments_take_their_default_and_refuse_anything_else():
    for arg in TABLE.values():
        if arg.kind != REFUSED:
            continue
        assert swift_args.translate(arg.name, arg.default) == {}, arg.name  # the default asks for nothing
    for name, value in (("deepspeed", "zero3"), ("sequence_parallel_size", 2), ("use_liger_kernel", True),
                        ("template", "qwen2_5"), ("adapters", ["ckpt"]), ("num_beams", 4), ("packing", True)):
        with pytest.raises(SwiftArgError, match=rf"^ms-swift's {name}=.* is refused: \S"):
            swift_args.translate(name, value)


def test_counts_add_up_and_the_docs_page_is_the_table():
    counts = swift_args.counts()
    assert sum(counts.values()) == len(TABLE) and min(counts.values()) > 30
    page = (ROOT / "docs" / "swift-arguments.md").read_text()
    assert page == swift_args.render_markdown(), "regenerate: .venv/bin/python -m config.swift_args > docs/swift-arguments.md"
    for name in TABLE:
        assert f"| `{name}` |" in page
    grouped = swift_args.render_grouped()  # the short form, for release notes
    assert f"{len(TABLE)} ms-swift arguments: {counts[ACCEPTED]} accepted" in grouped
    assert all(f"`{name}`" in grouped for name in TABLE)


@pytest.mark.parametrize(
    "name,value,expected",
    [
        ("stop_words", ["</answer>"], {"rollout.stop": ["</answer>"]}),
        ("num_generations_eval", 4, {"eval.eval_num_generations": 4}),
        ("tuner_type", "lora", {"learner.train_type": "lora"}),
        ("train_type", "full", {"learner.train_type": "full"}),
        ("max_steps", -1, {"run.max_steps": 0}),
        ("num_train_epochs", 3.0, {"data.num_train_epochs": 3}),
        ("vllm_mode", "colocate", {"rollout.engine": "async"}),
        ("vllm_mode", "server", {"rollout.engine": "server"}),
        ("torch_dtype", "bfloat16", {"model.torch_dtype": "bfloat16", "rollout.dtype": "bfloat16"}),
        ("loss_type", ["dapo"], {"grpo.loss_type": "dapo"}),
        ("scale_rewards", True, {"grpo.scale_rewards": "group"}),
        ("scale_rewards", False, {"grpo.scale_rewards": "none"}),
        ("async_generate", False, {"grpo.max_staleness": 0}),
        ("async_generate", True, {"grpo.max_staleness": 1}),
        ("vllm_enable_lora", True, {"rollout.weight_transport": "lora"}),
        ("sleep_level", 1, {"rollout.colocate": True}),
        ("report_to", ["none"], {"run.report_to": []}),
        ("columns", '{"problem": "query"}', {"data.columns": {"problem": "query"}}),
        ("reward_model", ["/models/rm"], {"reward.reward_model": "/models/rm"}),
        ("lr_scheduler_type", "constant_with_warmup", {"learner.lr_scheduler_type": "constant"}),
        ("warmup_steps", 0.1, {"learner.warmup_ratio": 0.1}),
        ("use_cpu", True, {"learner.device": "cpu"}),
        ("vllm_server_base_url", ["http://a:8000/"], {"rollout.server_urls": ["http://a:8000"]}),
        ("beta", None, {}),  # None: ms-swift's "its default", rollstream's stays
    ],
)
def test_converters(name, value, expected):
    assert swift_args.translate(name, value) == expected


@pytest.mark.parametrize(
    "name,value,message",
    [
        ("num_train_epochs", 1.5, "whole epochs"),
        ("report_to", ["swanlab"], "tensorboard and wandb"),
        ("loss_type", "fipo", "grpo, bnpo, dr_grpo, dapo, cispo, sapo"),
        ("train_type", "adalora", "full weights or a LoRA adapter"),
        ("rlhf_type", "dpo", "GRPO and its variants only"),
        ("reward_model", ["a", "b"], "one reward model"),
        ("lr_scheduler_type", "cosine_with_min_lr", "constant, linear and cosine"),
        ("warmup_steps", 100, "warmup_ratio"),
        ("truncation_strategy", "right", "left or deleted"),
        ("eval_strategy", "epoch", "every eval_steps"),
        ("completion_length_limit_scope", "total", "per turn"),
    ],
)
def test_values_rollstream_cannot_take_are_refused_with_the_reason(name, value, message):
    with pytest.raises(SwiftArgError, match=message):
        swift_args.translate(name, value)


def test_vllm_server_host_and_port_make_the_server_urls():
    given = {"vllm_server_host": ["10.0.0.1", "10.0.0.2"], "vllm_server_port": [8000, 8001]}
    assert swift_args.translate("vllm_server_host", given["vllm_server_host"], given) == {
        "rollout.server_urls": ["http://10.0.0.1:8000", "http://10.0.0.2:8001"]}
    assert swift_args.translate("vllm_server_port", [8000, 8001], given) == {}  # joined by the host
    one_port = {"vllm_server_host": ["a", "b"], "vllm_server_port": 8000}
    assert swift_args.translate("vllm_server_host", ["a", "b"], one_port) == {
        "rollout.server_urls": ["http://a:8000", "http://b:8000"]}
    with pytest.raises(SwiftArgError, match="needs vllm_server_host"):
        swift_args.translate("vllm_server_port", 9000, {"vllm_server_port": 9000})
    with pytest.raises(SwiftArgError, match="one port per host"):
        swift_args.translate("vllm_server_host", ["a", "b", "c"], {"vllm_server_port": [1, 2]})


# --- in a TOML ---------------------------------------------------------------------------------------


def test_ms_swift_names_at_the_top_level_and_in_their_section(tmp_path):
    cfg = load_config(write(tmp_path, """
rlhf_type = "grpo"
model = "Qwen/Qwen2.5-0.5B-Instruct"
dataset = ["a.jsonl", "b.jsonl#100"]
reward_funcs = ["accuracy", "format"]
num_generations = 4
stop_words = ["</answer>"]
tuner_type = "lora"
vllm_mode = "colocate"
max_steps = -1
logging_steps = 1          # not needed: every step is logged
deepspeed = ""             # refused only when it asks for something
[rollout]
vllm_max_model_len = 2048  # an ms-swift name in the section of its rollstream field
[learner]
lora_rank = 16
"""))
    assert cfg.model.model == "Qwen/Qwen2.5-0.5B-Instruct"
    assert cfg.data.dataset == ["a.jsonl", "b.jsonl#100"]
    assert cfg.reward.reward_funcs == ["accuracy", "format"] and cfg.grpo.num_generations == 4
    assert cfg.rollout.stop == ["</answer>"] and cfg.rollout.max_model_len == 2048 and cfg.rollout.engine == "async"
    assert (cfg.learner.train_type, cfg.learner.lora_rank, cfg.run.max_steps) == ("lora", 16, 0)


@pytest.mark.parametrize(
    "text,message",
    [
        ('num_generations = 4\n[grpo]\nnum_generations = 4\n',
         "num_generations (ms-swift's name) and grpo.num_generations both set grpo.num_generations; give it once"),
        ('stop_words = ["a"]\n[rollout]\nstop = ["b"]\n', "stop_words (ms-swift's name) and rollout.stop both set"),
        ('train_type = "lora"\ntuner_type = "lora"\n', "train_type (ms-swift's name) and tuner_type (ms-swift's name)"),
        ('max_new_tokens = 64\nmax_completion_length = 64\n', "both set grpo.max_completion_length"),
        ('deepspeed = "zero2"\n', "deepspeed='zero2' is refused: DeepSpeed is not available"),
        ('sequence_parallel_size = 2\n', "sequence parallelism is not available"),
        ('[grpo]\nstop_words = ["x"]\n', "ms-swift's stop_words is rollout.stop: set it there, or as stop_words at the top"),
        ('num_generation = 4\n', "unknown key num_generation; did you mean num_generations (an ms-swift argument)?"),
        ('[learner]\ndeepspeed = "zero3"\n', "[learner] deepspeed: ms-swift's deepspeed='zero3' is refused"),
        ('padding_free = true\nreward_funcs = ["accuracy"]\n', "padding_free = true packs each mini-batch"),
    ],
)
def test_a_field_given_twice_or_a_refused_name_is_an_error_naming_it(tmp_path, text, message):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_padding_free_is_a_token_budget_of_one_packed_mini_batch(tmp_path):
    cfg = load_config(write(tmp_path, 'padding_free = true\nmax_length = 100\nreward_funcs = ["accuracy"]\n'
                                      "[grpo]\nper_device_train_batch_size = 4\nnum_generations = 4\nmax_completion_length = 28\n"))
    assert cfg.learner.max_tokens_per_batch == 4 * (100 + 28)


def test_set_takes_an_ms_swift_name_in_its_fields_section():
    cfg = load_config("configs/demo.toml", ["rollout.vllm_max_model_len=300", "grpo.num_generations=4"])
    assert cfg.rollout.max_model_len == 300
    with pytest.raises(ConfigError, match="did you mean learner.learning_rate"):
        load_config("configs/demo.toml", ["grpo.learning_rate=1e-5"])


def test_command_line_names_override_the_file_and_set_overrides_them():
    cfg = load_config("configs/demo.toml", ["grpo.temperature=0.7"], swift={"num_generations": 4, "temperature": 0.9})
    assert cfg.grpo.num_generations == 4 and cfg.grpo.temperature == 0.7
    with pytest.raises(ConfigError, match="--train_type and --tuner_type both set learner.train_type"):
        load_config("configs/demo.toml", swift={"train_type": "full", "tuner_type": "lora"})


# --- as flags ----------------------------------------------------------------------------------------


def test_flags_parse_as_ms_swift_writes_them():
    flags = swift_args.parse_flags([
        "--reward_funcs", "accuracy", "format", "--num_generations", "8", "--learning_rate=1e-6", "--use_vllm",
        "true", "--log_completions", "False", "--beta", "None", "--top_k", "-1", "--columns", '{"q": "query"}',
        "--dataset", "AI-MO/NuminaMath-TIR#5000", "--overlong_filter",
    ])
    assert flags == {"reward_funcs": ["accuracy", "format"], "num_generations": 8, "learning_rate": 1e-6,
                     "use_vllm": True, "log_completions": False, "beta": None, "top_k": -1,
                     "columns": {"q": "query"}, "dataset": "AI-MO/NuminaMath-TIR#5000", "overlong_filter": True}
    with pytest.raises(SwiftArgError, match="did you mean num_generations"):
        swift_args.parse_flags(["--num_generation", "8"])
    with pytest.raises(SwiftArgError, match="--seed is given twice"):
        swift_args.parse_flags(["--seed", "1", "--seed", "2"])
    with pytest.raises(SwiftArgError, match="unexpected argument 'x'"):
        swift_args.parse_flags(["x"])


def test_config_show_takes_ms_swift_flags_alone():
    result = cli("config", "show", "--rlhf_type", "grpo", "--reward_funcs", "accuracy", "format", "--num_generations",
                 "4", "--stop_words", "</answer>", "--vllm_max_model_len", "1024", "--tuner_type", "full")
    assert result.returncode == 0, result.stderr
    for line in ('reward_funcs = ["accuracy", "format"]', "num_generations = 4", 'stop = ["</answer>"]',
                 "max_model_len = 1024", 'train_type = "full"'):
        assert line in result.stdout


# --- args.json -----------------------------------------------------------------------------------------


def test_from_args_json_v3_carries_the_run_and_lists_what_it_drops():
    args = json.loads((ROOT / "tests" / "data_swift" / "args_v3.12.6.json").read_text())
    conv = swift_args.from_args_json(args)
    v = conv.values
    assert v["model.model"] == "Qwen/Qwen2.5-7B-Instruct" and v["data.dataset"] == ["AI-MO/NuminaMath-TIR#5000"]
    assert v["reward.reward_funcs"] == ["accuracy", "format"] and v["grpo.num_generations"] == 8
    # 2 per device x 4 processes: one learner process takes the same global mini-batch
    assert v["grpo.per_device_train_batch_size"] == 8 and v["grpo.gradient_accumulation_steps"] == 2
    assert (v["grpo.temperature"], v["grpo.top_p"], v["grpo.top_k"]) == (0.9, 0.9, 50)
    assert v["grpo.max_staleness"] == 0  # async_generate false: on-policy, as ms-swift
    assert v["rollout.engine"] == "async" and v["rollout.max_model_len"] == 4096 and v["run.max_steps"] == 0
    assert "run.output_dir" not in v and "learner.ref_model" not in v and "data.max_length" not in v
    refused = {name for name, _, _ in conv.refused}
    # (the template ms-swift filled in from the model type is a note, not a refusal)
    assert refused == {"deepspeed", "vllm_gpu_memory_utilization"}
    assert {"bf16", "logging_steps", "dataloader_num_workers"} <= {n for n, _, _ in conv.no_effect} | set(
        conv.at_default)
    assert conv.unknown == []
    # a 4-GPU ZeRO-3 run is not what one learner process trains: each difference is a change
    assert {name: value for name, value, _ in conv.changes if name != "deepspeed"} == {
        "vllm_gpu_memory_utilization": 0.5, "global_world_size": 4}
    assert next(name for name, _, _ in conv.changes) == "deepspeed"
    # every argument lands in exactly one group
    grouped = set(conv.carried) | refused | {n for n, _, _ in conv.no_effect} | set(conv.at_default)
    noted = {note.split("=")[0].split(":")[0] for note in conv.notes}
    assert grouped | noted >= set(args) - {"per_device_train_batch_size", "per_device_eval_batch_size"}
    config_from_dict({s: {f: val for d, val in v.items() if d.startswith(s + ".") for f in [d.split(".")[1]]}
                      for s in {d.split(".")[0] for d in v}})


def test_from_args_json_main_reads_v4_names():
    args = json.loads((ROOT / "tests" / "data_swift" / "args_main.json").read_text())
    conv = swift_args.from_args_json(args)
    v = conv.values
    assert v["learner.train_type"] == "lora" and v["learner.lora_rank"] == 16
    assert v["rollout.server_urls"] == ["http://127.0.0.1:8000"] and v["rollout.engine"] == "server"
    assert v["learner.max_tokens_per_batch"] == 8 * (1024 + 512)  # padding_free
    assert v["grpo.steps_per_generation"] == 2 and "grpo.generation_batch_size" not in v
    assert v["eval.eval_num_generations"] == 4 and v["rollout.stop"] == ["</answer>"]
    assert v["data.columns"] == {"question": "query", "answer": "solution"} and v["data.enable_thinking"] is False
    with pytest.raises(SwiftArgError, match="GRPO runs only"):
        swift_args.from_args_json({**args, "rlhf_type": "dpo"})
    chosen = swift_args.from_args_json({**args, "template": "qwen3_nothinking"})  # not the model type's own
    assert ("template", "qwen3_nothinking") in [(n, v) for n, v, _ in chosen.refused]
    # TRL's num_completions_to_print at its default (None) is not carried: run.num_completions_to_print is an int
    trl_default = swift_args.from_args_json({**args, "num_completions_to_print": None})
    assert "run.num_completions_to_print" not in trl_default.values


def test_config_from_swift_writes_a_toml_that_config_show_loads(tmp_path):
    out = tmp_path / "run.toml"
    args_json = str(ROOT / "tests" / "data_swift" / "args_v3.12.6.json")
    # a 4-GPU ZeRO-3 run: not converted silently into a one-process learner
    result = cli("config", "from-swift", args_json, "-o", str(out))
    assert result.returncode == 3 and not out.exists() and result.stdout == ""
    changes = result.stderr.split("changes what trains (ms-swift's value: what rollstream does instead): 3\n")[1]
    assert [line.split("=")[0].strip() for line in changes.splitlines()[:3]] == [
        "deepspeed", "vllm_gpu_memory_utilization", "global_world_size"]
    assert "global_world_size=4: ms-swift trained in 4 processes" in changes and "grpo.world_size = 4" in changes
    assert "not converted: 3 difference(s) in what trains" in result.stderr and "--accept-changes" in result.stderr
    result = cli("config", "from-swift", args_json, "-o", str(out), "--name", "from-swift", "--accept-changes")
    assert result.returncode == 0, result.stderr
    assert "changes what trains" in result.stderr and "deepspeed=" in result.stderr
    assert "at ms-swift's default, or nothing to carry" in result.stderr
    shown = cli("config", "show", "-c", str(out))
    assert shown.returncode == 0, shown.stderr
    assert 'name = "from-swift"' in shown.stdout and 'model = "Qwen/Qwen2.5-7B-Instruct"' in shown.stdout
    assert "deepspeed=" in out.read_text()  # the report heads the file too


def test_config_from_swift_says_when_the_result_does_not_load(tmp_path):
    # LoRA with vLLM servers: rollstream loads adapters only into its in-process engine
    result = cli("config", "from-swift", str(ROOT / "tests" / "data_swift" / "args_main.json"), "-o",
                 str(tmp_path / "x.toml"))
    assert result.returncode == 1
    assert "does not load as it is" in result.stderr and 'engine = "async"' in result.stderr
    assert (tmp_path / "x.toml").is_file()
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    result = cli("config", "from-swift", str(bad))
    assert result.returncode == 2 and "expected a JSON object" in result.stderr


def test_config_from_swift_reads_an_ms_swift_launch_yaml(tmp_path):
    # `swift rlhf grpo.yaml`: the arguments given, and ENV for the environment
    launch = tmp_path / "grpo.yaml"
    launch.write_text(
        "rlhf_type: grpo\nmodel: Qwen/Qwen2.5-0.5B-Instruct\ndataset: ['openai/gsm8k:main#500']\n"
        "reward_funcs: [accuracy]\nnum_generations: 4\nper_device_train_batch_size: 4\ntorch_dtype: float32\n"
        "logging_steps: 1\nENV:\n  MAX_PIXELS: '1003520'\n"
    )
    out = tmp_path / "run.toml"
    result = cli("config", "from-swift", str(launch), "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert "ENV not carried: set these in the environment of every rollstream process: MAX_PIXELS=1003520" in (
        result.stderr)
    assert "logging_steps=1: every optimizer step is logged" in result.stderr
    shown = cli("config", "show", "-c", str(out))
    assert shown.returncode == 0, shown.stderr
    assert "num_generations = 4" in shown.stdout and 'dataset = ["openai/gsm8k:main#500"]' in shown.stdout
    # no train_type: ms-swift trains LoRA, and so does the converted run
    assert 'train_type = "lora"' in shown.stdout and "learning_rate = 0.0001" in shown.stdout
    launch.write_text("model: [unclosed\n")
    result = cli("config", "from-swift", str(launch))
    assert result.returncode == 2 and "not a readable YAML file" in result.stderr


# --- what trains: never changed silently -----------------------------------------------------------------


def changes(args: dict) -> dict:
    return {name: value for name, value, _ in swift_args.from_args_json(args).changes}


def test_a_conversion_lists_each_change_in_what_trains():
    args = json.loads((ROOT / "tests" / "data_swift" / "args_main.json").read_text())
    assert changes(args) == {}  # one process, bf16 weights as trained, nothing refused
    # precision: fp16 mixed precision over float32 weights is not rollstream's float32 learner
    assert changes({**args, "torch_dtype": "float32", "fp16": True, "bf16": False}) == {"fp16": True}
    assert changes({**args, "torch_dtype": "bfloat16", "bf16": True}) == {}
    assert changes({k: v for k, v in args.items() if k != "torch_dtype"}) == {"torch_dtype": None}
    # train_type: a refused tuner is a change; left out, it is ms-swift's lora
    assert changes({**args, "tuner_type": "adalora"}) == {"tuner_type": "adalora"}
    conv = swift_args.from_args_json({k: v for k, v in args.items() if k not in ("tuner_type", "train_type")})
    assert conv.values["learner.train_type"] == "lora" and conv.changes == []
    # parallelism: the training processes, from args.json or a launch file's environment
    assert changes({**args, "global_world_size": 8}) == {"global_world_size": 8}
    assert changes({**args, "ENV": {"NPROC_PER_NODE": "2"}}) == {"NPROC_PER_NODE": 2}
    # any refused argument, and an unknown one set to something (another ms-swift version's)
    assert changes({**args, "sequence_parallel_size": 2, "new_thing": True, "other_new": None}) == {
        "sequence_parallel_size": 2, "new_thing": True}


def test_config_from_swift_refuses_a_changed_launch_file_until_accepted(tmp_path):
    launch = tmp_path / "grpo.yaml"
    launch.write_text("rlhf_type: grpo\nmodel: Qwen/Qwen2.5-0.5B-Instruct\nreward_funcs: [accuracy]\n"
                      "tuner_type: full\nENV:\n  NPROC_PER_NODE: 4\n")
    out = tmp_path / "run.toml"
    result = cli("config", "from-swift", str(launch), "-o", str(out))
    assert result.returncode == 3 and not out.exists()
    assert "NPROC_PER_NODE=4: ms-swift trained in 4 processes" in result.stderr
    assert "torch_dtype=None: ms-swift trains in the model's own dtype (config.json); rollstream's learner and " \
           "engine in float32" in result.stderr
    result = cli("config", "from-swift", str(launch), "-o", str(out), "--accept-changes")
    assert result.returncode == 0, result.stderr
    assert "# changes what trains" in out.read_text()  # the accepted changes head the file
    assert cli("config", "show", "-c", str(out)).returncode == 0


def test_ms_swift_flags_that_change_what_trains_are_an_error_naming_the_fix():
    result = cli("config", "show", "--rlhf_type", "grpo", "--reward_funcs", "accuracy", "--bf16", "true")
    assert result.returncode == 2
    assert "config error: --bf16 true: ms-swift trains with bfloat16 mixed precision; rollstream's learner trains " \
           "in model.torch_dtype = float32: give --torch_dtype bfloat16" in result.stderr
    result = cli("config", "show", "--rlhf_type", "grpo", "--reward_funcs", "accuracy", "--bf16", "true",
                 "--torch_dtype", "bfloat16")
    assert result.returncode == 0, result.stderr
    env = {**os.environ, "NPROC_PER_NODE": "4"}
    result = subprocess.run([sys.executable, "-m", "rollstream.cli", "config", "show", "--rlhf_type", "grpo",
                             "--reward_funcs", "accuracy"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 2 and "NPROC_PER_NODE=4: ms-swift's launcher starts 4 training processes" in (
        result.stderr)

"""Datasets as ms-swift reads them: its syntax (``id:subset#N``), CSV, folders, save_to_disk, several datasets
in one run, its automatic column mapping (NuminaMath / GSM8K / alpaca / ShareGPT rows with no data.columns),
the columns the rewards need, ``data.system`` from a file and a row's ``tools``. Hub datasets: tests/test_hub.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from config import ConfigError, load_config
from data import loading
from data.loading import DatasetError, DatasetSyntax, load_dataset, parse_dataset
from rewards import orms


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def user(text):
    return [{"role": "user", "content": text}]


DEMO = Path(__file__).resolve().parents[1] / "configs" / "demo.toml"


def cfg_with(*overrides):
    return load_config(DEMO, list(overrides))


# --- ms-swift's syntax -------------------------------------------------------------------------------


def test_parse_follows_ms_swifts_dataset_syntax(tmp_path):
    assert parse_dataset("AI-MO/NuminaMath-TIR#5000") == DatasetSyntax("AI-MO/NuminaMath-TIR", (), 5000, None,
                                                                       "AI-MO/NuminaMath-TIR#5000")
    parsed = parse_dataset("hf::openai/gsm8k:main/socratic#10")
    assert (parsed.dataset, parsed.subsets, parsed.sample, parsed.use_hf) == ("openai/gsm8k", ("main", "socratic"), 10, True)
    assert parse_dataset("ms::swift/x").use_hf is False
    # An existing path is taken whole: a file name may hold ':' or '#'.
    odd = tmp_path / "a:b#3.jsonl"
    odd.write_text("{}\n")
    assert parse_dataset(str(odd)) == DatasetSyntax(str(odd), (), None, None, str(odd))
    for bad, message in (("x/y#abc", "not a row count"), ("x/y#0", "not a row count"), ("xx::a/b", "hub prefix"),
                         ("a/b:main/", "empty subset")):
        with pytest.raises(DatasetError, match=message):
            parse_dataset(bad)


def test_sample_is_ms_swifts_sample_dataset(tmp_path):
    """#N: whole copies in order, then N % len rows of one RandomState(seed)'s permutation, the state shared by
    the datasets in order (as ms-swift's load_dataset passes one RandomState through them)."""
    a = write_jsonl(tmp_path / "a.jsonl", [{"query": f"a{i}", "solution": str(i)} for i in range(10)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"query": f"b{i}", "solution": str(i)} for i in range(7)])
    rows = load_dataset([f"{a}#4", f"{b}#9"], seed=42)
    state = np.random.RandomState(42)
    expected = [f"a{i}" for i in state.permutation(10)[:4]]
    expected += [f"b{i}" for i in range(7)] + [f"b{i}" for i in state.permutation(7)[:2]]
    assert [r["messages"][-1]["content"] for r in rows] == expected
    unshuffled = load_dataset(f"{a}#4", seed=42, shuffle=False)  # data.dataset_shuffle = false: the first rows
    assert [r["messages"][-1]["content"] for r in unshuffled] == ["a0", "a1", "a2", "a3"]
    assert len(load_dataset(str(a))) == 10  # no #N: every row once


def test_a_list_of_datasets_concatenates_in_order(tmp_path):
    first = write_jsonl(tmp_path / "gsm.jsonl", [{"question": "What is 1+1?", "answer": "2"}])
    second = tmp_path / "more.csv"
    second.write_text("problem,solution,level\nWhat is 2+2?,4,3\n")
    rows = load_dataset([str(first), str(second), "arithmetic#2"], seed=0)
    assert [r["messages"] for r in rows[:2]] == [user("What is 1+1?"), user("What is 2+2?")]
    assert [r["solution"] for r in rows[:2]] == ["2", 4] and rows[1]["level"] == 3
    assert len(rows) == 4 and rows[2]["messages"][0]["content"].startswith("What is")


def test_data_dataset_size_only_sizes_builtins(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"query": f"q{i}", "solution": "1"} for i in range(10)])
    cfg = cfg_with(f"data.dataset={json.dumps(str(path))}", "data.dataset_size=3")
    assert len(loading.load_rows(cfg)) == 10
    assert len(loading.load_rows(cfg_with("data.dataset=arithmetic", "data.dataset_size=30"))) == 30
    assert len(loading.load_rows(cfg_with('data.dataset=["arithmetic#5", "arithmetic#6"]'))) == 11


# --- files and folders ---------------------------------------------------------------------------------


def test_csv_reads_as_ms_swift_reads_it(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text('question,answer,note\n"What is 1+1, exactly?",2,\nWhat is 3+4?,7,hard\n')
    rows = load_dataset(str(path))
    assert rows == [
        {"messages": user("What is 1+1, exactly?"), "solution": "2", "note": ""},  # na_filter=False: "" not NaN
        {"messages": user("What is 3+4?"), "solution": "7", "note": "hard"},  # the reference answer's text
    ]


def test_txt_reads_as_ms_swift_reads_it(tmp_path):
    """ms-swift reads .txt with the datasets library's "text" builder: one row per line in a `text` column
    (line breaks stripped, other whitespace kept, an empty line a row with ""); `text` is a response alias, so
    a prompt per line needs `text` renamed to `query` (ms-swift's --columns '{"text": "query"}' too)."""
    path = tmp_path / "prompts.txt"
    path.write_text("What is 1+1?\n\nWhat is 2+3?  \r\n")
    with pytest.raises(DatasetError, match=r'row 0 has no prompt.*\(columns: text\).*data.columns = \{text = "query"\}'):
        load_dataset(str(path), require_solution=False)
    rows = load_dataset(str(path), columns={"text": "query"}, require_solution=False, shuffle=False)
    assert rows == [{"messages": user("What is 1+1?")}, {"messages": user("")}, {"messages": user("What is 2+3?  ")}]
    assert load_dataset(f"{path}#2", columns={"text": "query"}, require_solution=False, shuffle=False) == rows[:2]
    # a folder of .txt files reads the same way (datasets' folder builder), its splits by file name
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "train.txt").write_text("a\nb\n")
    assert load_dataset(str(folder), columns={"text": "query"}, require_solution=False,
                        shuffle=False) == [{"messages": user("a")}, {"messages": user("b")}]
    cfg = cfg_with(f"data.dataset={json.dumps(str(path))}", 'data.columns={text = "query"}',
                   'reward.reward_funcs=["format"]', "reward.reward_weights=[1.0]")
    assert [r["messages"] for r in loading.load_rows(cfg)] == [r["messages"] for r in rows]


# ms-swift's registered GRPO datasets (ms-swift main: swift/dataset/data/dataset_info.json and
# swift/dataset/dataset/*.py, tag "grpo"/"rlvr", plus gsm8k and Countdown), one row each in the dataset's own
# column layout, and what rollstream's automatic mapping makes of it (docs/data.md's table).
REGISTERED = {
    # plain registrations: ms-swift applies its automatic mapping, as rollstream does
    "AI-MO/NuminaMath-CoT": (
        {"source": "amc", "problem": "Find x.", "solution": "\\boxed{2}",
         "messages": [{"role": "user", "content": "Find x."}, {"role": "assistant", "content": "\\boxed{2}"}]},
        {"messages": user("Find x."), "solution": "\\boxed{2}", "source": "amc", "problem": "Find x."}),
    "AI-MO/NuminaMath-1.5": (
        {"problem": "Find x.", "solution": "x is 2", "answer": "2", "problem_type": "Algebra", "source": "amc"},
        {"messages": user("Find x."), "solution": "x is 2", "answer": "2", "problem_type": "Algebra", "source": "amc"}),
    "open-r1/DAPO-Math-17k-Processed": (
        {"prompt": "Find x.", "solution": "2", "data_source": "dapo", "ability": "MATH"},
        {"messages": user("Find x."), "solution": "2", "data_source": "dapo", "ability": "MATH"}),
    "modelscope/gsm8k (openai/gsm8k)": (
        {"question": "Janet has 3 eggs...", "answer": "She has 3.\n#### 3"},
        {"messages": user("Janet has 3 eggs..."), "solution": "She has 3.\n#### 3"}),
    # the registry renames problem -> query, which is one of rollstream's query aliases anyway
    "AI-ModelScope/MATH-lighteval": (
        {"problem": "Find x.", "level": "Level 1", "type": "Algebra", "solution": "\\boxed{2}"},
        {"messages": user("Find x."), "solution": "\\boxed{2}", "level": "Level 1", "type": "Algebra"}),
    # ClevrPreprocessor appends an instruction to the problem; rollstream's prompt is the problem alone
    "AI-ModelScope/clevr_cogen_a_train": (
        {"problem": "How many cubes?", "solution": "<answer> 3 </answer>"},
        {"messages": user("How many cubes?"), "solution": "<answer> 3 </answer>"}),
    # XlamFunctionCallingGRPOPreprocessor: solution "Action: name\nAction Input: {args}"; here the answers' text
    "LLM-Research/xlam-function-calling-60k:grpo": (
        {"id": 1, "query": "Weather in Paris?", "answers": '[{"name": "weather", "arguments": {"city": "Paris"}}]',
         "tools": '[{"name": "weather", "parameters": {"city": {"type": "str"}}}]'},
        {"messages": user("Weather in Paris?"), "solution": '[{"name": "weather", "arguments": {"city": "Paris"}}]',
         "id": 1, "tools": [{"name": "weather", "parameters": {"city": {"type": "str"}}}]}),
}


@pytest.mark.parametrize("name", list(REGISTERED))
def test_ms_swift_registered_grpo_datasets_columns(tmp_path, name):
    row, expected = REGISTERED[name]
    path = write_jsonl(tmp_path / "d.jsonl", [row])
    assert load_dataset(str(path), require_solution=False) == [expected]


def test_ms_swift_registered_datasets_rollstream_does_not_map(tmp_path):
    # open-r1/verifiable-coding-problems-python: the registry renames problem_statement -> query
    coding = write_jsonl(tmp_path / "coding.jsonl", [{"problem_statement": "Print 1.", "verification_info": "{}"}])
    with pytest.raises(DatasetError, match=r"row 0 has no prompt.*problem_statement, verification_info"):
        load_dataset(str(coding), require_solution=False)
    assert load_dataset(str(coding), columns={"problem_statement": "query"}, require_solution=False) == [
        {"messages": user("Print 1."), "verification_info": "{}"}]
    # zouxuhong/Countdown-Tasks-3to4: ms-swift's preprocessor writes the query from nums and target
    countdown = write_jsonl(tmp_path / "countdown.jsonl", [{"nums": [2, 3, 4], "target": 24}])
    with pytest.raises(DatasetError, match=r"row 0 has no prompt.*\(columns: nums, target\)"):
        load_dataset(str(countdown), require_solution=False)


def test_save_to_disk_folders(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"problem": f"What is {i}+1?", "solution": str(i + 1)} for i in range(4)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))
    loaded = load_dataset(str(tmp_path / "one"))
    assert [r["messages"] for r in loaded] == [user(r["problem"]) for r in rows]
    assert [r["solution"] for r in loaded] == [r["solution"] for r in rows]
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:3]),
                                   "test": datasets.Dataset.from_list(rows[3:])})
    splits.save_to_disk(str(tmp_path / "dict"))
    assert len(load_dataset(str(tmp_path / "dict"))) == 3
    assert load_dataset(str(tmp_path / "dict"), split="test")[0]["solution"] == "4"
    with pytest.raises(DatasetError, match="no split 'dev' .*train, test.*data.split"):
        load_dataset(str(tmp_path / "dict"), split="dev")


def test_a_folder_of_data_files_has_splits_by_file_name(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")  # read at call time
    folder = tmp_path / "gsm"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", [{"question": f"q{i}", "answer": str(i)} for i in range(3)])
    write_jsonl(folder / "test.jsonl", [{"question": "t0", "answer": "0"}])
    assert [r["messages"] for r in load_dataset(str(folder))] == [user("q0"), user("q1"), user("q2")]
    assert [r["messages"] for r in load_dataset(str(folder), split="test")] == [user("t0")]
    cfg = cfg_with(f"data.dataset={json.dumps(str(folder))}", f"data.val_dataset={json.dumps(str(folder))}",
                   'data.val_split="test"')
    assert [r["messages"] for r in loading.load_eval_rows(cfg)] == [user("t0")]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DatasetError, match="empty.*cannot be read as a dataset"):
        load_dataset(str(empty))


def test_missing_paths_and_non_ids_are_missing_files(tmp_path):
    with pytest.raises(DatasetError, match="no such file or folder"):
        load_dataset(str(tmp_path / "nope" / "d.jsonl"))
    with pytest.raises(DatasetError, match="no such file or folder"):
        load_dataset("data/gsm8k.jsonl")  # a relative file name is not a Hub id
    with pytest.raises(DatasetError, match="a file has no subsets"):
        load_dataset(f"{write_jsonl(tmp_path / 'd.jsonl', [{'query': 'q', 'solution': '1'}])}:main")


# --- ms-swift's automatic column mapping ---------------------------------------------------------------


def test_numina_and_gsm8k_rows_need_no_columns(tmp_path):
    numina = write_jsonl(tmp_path / "numina.jsonl", [
        {"problem": "Find x if x+1=3.", "solution": "x = \\boxed{2}",
         "messages": [{"role": "user", "content": "Find x if x+1=3."},
                      {"role": "assistant", "content": "x = \\boxed{2}"}]},
    ])
    (row,) = load_dataset(str(numina))
    # ms-swift: the messages column wins; problem and solution stay columns (solution reaches the rewards).
    assert row == {"messages": user("Find x if x+1=3."), "solution": "x = \\boxed{2}", "problem": "Find x if x+1=3."}
    bare = write_jsonl(tmp_path / "bare.jsonl", [{"problem": "Find x.", "solution": "2", "source": "amc"}])
    assert load_dataset(str(bare)) == [{"messages": user("Find x."), "solution": "2", "source": "amc"}]
    gsm = write_jsonl(tmp_path / "gsm.jsonl", [{"question": "Janet has 3 eggs...", "answer": "... #### 3"}])
    assert load_dataset(str(gsm)) == [{"messages": user("Janet has 3 eggs..."), "solution": "... #### 3"}]
    both = write_jsonl(tmp_path / "both.jsonl", [{"question": "q", "answer": "long", "solution": "3"}])
    # answer and solution are both response aliases: neither is renamed (ms-swift), solution stays, answer too
    assert load_dataset(str(both)) == [{"messages": user("q"), "solution": "3", "answer": "long"}]


def test_alpaca_sharegpt_history_and_trl_prompts(tmp_path):
    alpaca = write_jsonl(tmp_path / "alpaca.jsonl", [
        {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
        {"instruction": "Say hi.", "input": "", "output": "hi"},
    ])
    assert [r["messages"] for r in load_dataset(str(alpaca))] == [user("Add the numbers.\n2 and 3"), user("Say hi.")]
    sharegpt = write_jsonl(tmp_path / "sharegpt.jsonl", [{
        "system": "Be brief.",
        "conversations": [{"from": "human", "value": "1+1?"}, {"from": "gpt", "value": "2"},
                          {"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}],
    }])
    (row,) = load_dataset(str(sharegpt))
    assert row["messages"] == [{"role": "system", "content": "Be brief."}, *user("1+1?"),
                               {"role": "assistant", "content": "2"}, *user("2+2?")]
    assert row["solution"] == "4"
    history = write_jsonl(tmp_path / "history.jsonl", [
        {"query": "and 2+2?", "response": "4", "history": [["1+1?", "2"]]},
        {"query": "and 3+3?", "response": "6", "history": "[['1+1?', '2']]"},  # text, as ms-swift reads it
    ])
    for r in load_dataset(str(history)):
        assert r["messages"][:2] == [*user("1+1?"), {"role": "assistant", "content": "2"}]
    trl = write_jsonl(tmp_path / "trl.jsonl", [{"prompt": [{"role": "user", "content": "1+1?"}], "solution": "2"}])
    assert load_dataset(str(trl)) == [{"messages": user("1+1?"), "solution": "2"}]
    trl = write_jsonl(tmp_path / "trl2.jsonl", [
        {"prompt": [{"role": "user", "content": "2+2?"}], "completion": [{"role": "assistant", "content": "4"}]},
    ])
    assert load_dataset(str(trl)) == [{"messages": user("2+2?"), "solution": "4"}]


def test_ambiguous_and_missing_prompts_are_errors_naming_the_columns(tmp_path):
    both = write_jsonl(tmp_path / "two.jsonl", [{"question": "a", "problem": "b", "solution": "1"}])
    with pytest.raises(DatasetError, match=r"row 0 has no prompt.*problem, question, solution.*data.columns"):
        load_dataset(str(both))  # ms-swift renames neither: pick one
    assert load_dataset(str(both), columns={"problem": "query"})[0]["messages"] == user("b")
    # query wins over prompt when both are there (ms-swift keeps the column already named query)
    assert load_dataset(str(write_jsonl(tmp_path / "qp.jsonl", [{"query": "q", "prompt": "p", "solution": "1"}])))[0][
        "messages"] == user("q")


def test_disable_auto_column_mapping_needs_ms_swifts_own_names(tmp_path):
    gsm = write_jsonl(tmp_path / "gsm.jsonl", [{"question": "q", "answer": "1"}])
    cfg = cfg_with(f"data.dataset={json.dumps(str(gsm))}", "data.disable_auto_column_mapping=true")
    with pytest.raises(DatasetError, match="row 0 has no prompt"):
        loading.load_rows(cfg)
    cfg = cfg_with(f"data.dataset={json.dumps(str(gsm))}", "data.disable_auto_column_mapping=true",
                   'data.columns={question = "query", answer = "response"}')
    assert loading.load_rows(cfg) == [{"messages": user("q"), "solution": "1"}]


def test_solution_reaches_the_rewards_as_a_column(tmp_path):
    """ms-swift's GRPO contract: ``solution`` (and every other column) is kept beside the messages, for the
    reward functions' kwargs, even when the mapping also made it the reference answer."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "solution": "7", "difficulty": "easy"}])
    assert load_dataset(str(path)) == [{"messages": user("p"), "solution": "7", "difficulty": "easy"}]


# --- the columns rewards need ---------------------------------------------------------------------------


def test_format_only_and_reward_model_runs_load_open_prompts(tmp_path):
    path = write_jsonl(tmp_path / "open.jsonl", [{"prompt": "Write a haiku."}, {"prompt": "Tell a joke."}])
    for overrides in (['reward.reward_funcs=["format"]', "reward.reward_weights=none"],
                      ["reward.reward_funcs=[]", "reward.reward_weights=none", 'reward.reward_model="http://x/r"']):
        cfg = cfg_with(f"data.dataset={json.dumps(str(path))}", *overrides)
        rows = loading.load_rows(cfg)
        assert rows == [{"messages": user("Write a haiku.")}, {"messages": user("Tell a joke.")}]


def test_a_missing_needed_column_names_the_reward_the_column_and_the_row(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "q1", "solution": "1"}, {"prompt": "q2"}])
    cfg = cfg_with(f"data.dataset={json.dumps(str(path))}")  # demo: accuracy and format
    with pytest.raises(DatasetError) as err:
        loading.load_rows(cfg)
    message = str(err.value)
    assert "row 1 has no 'solution'" in message and "'accuracy'" in message and str(path) in message
    assert 'data.columns = {your_column = "solution"}' in message and "reward.reward_funcs" in message

    def needs_level(completions, level, **kwargs):  # TRL style: the signature names the column
        return [float(x) for x in level]

    orms["needs_level"] = needs_level
    try:
        cfg = cfg_with(f"data.dataset={json.dumps(str(path))}", 'reward.reward_funcs=["needs_level"]',
                       "reward.reward_weights=none")
        with pytest.raises(DatasetError, match=r"row 0 has no 'level'.*the reward 'needs_level' needs it"):
            loading.load_rows(cfg)
    finally:
        del orms["needs_level"]


# --- system prompt, tools, validation sets --------------------------------------------------------------


def test_system_prompt_from_a_txt_file_or_a_string(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "system.txt").write_text("You are a careful\nmathematician.")
    rows = loading.load_rows(cfg_with('data.system="system.txt"', "data.dataset=arithmetic#2"))
    assert rows[0]["messages"][0] == {"role": "system", "content": "You are a careful\nmathematician."}
    rows = loading.load_rows(cfg_with('data.system="Line one\\\\nline two"', "data.dataset=arithmetic#1"))
    assert rows[0]["messages"][0]["content"] == "Line one\nline two"  # ms-swift: a literal \n is a newline
    with pytest.raises(DatasetError, match=r"data.system = 'missing.txt'.*cannot be read"):
        loading.load_rows(cfg_with('data.system="missing.txt"'))


def test_tools_are_kept_parsed(tmp_path):
    tool = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {}}}}
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"query": "q", "solution": "1", "tools": [tool]},
        {"query": "q", "solution": "1", "tools": json.dumps([tool])},
        {"query": "q", "solution": "1"},
    ])
    rows = load_dataset(str(path))
    assert rows[0]["tools"] == rows[1]["tools"] == [tool] and "tools" not in rows[2]
    for bad, message in (("not json", "'tools' is not valid JSON"), (["x"], "'tools' must be a list of tool schemas")):
        write_jsonl(path, [{"query": "q", "solution": "1", "tools": bad}])
        with pytest.raises(DatasetError, match=f"row 0: {message}"):
            load_dataset(str(path))


def test_val_dataset_takes_the_first_rows_and_is_never_repeated(tmp_path):
    val = write_jsonl(tmp_path / "val.jsonl", [{"query": f"v{i}", "solution": str(i)} for i in range(5)])
    cfg = cfg_with(f"data.val_dataset={json.dumps(f'{val}#3')}")
    assert [r["messages"][-1]["content"] for r in loading.load_eval_rows(cfg)] == ["v0", "v1", "v2"]
    with pytest.raises(DatasetError, match="#9 asks for more rows than the 5 it has.*data.val_dataset"):
        loading.load_eval_rows(cfg_with(f"data.val_dataset={json.dumps(f'{val}#9')}"))
    assert cfg_with("data.val_dataset=[]").data.val_dataset is None  # ms-swift's args.json: [] = none
    with pytest.raises(ConfigError, match="data.dataset"):
        cfg_with("data.dataset=[]")


def test_modelscope_datasets_need_the_package(tmp_path):
    try:
        import modelscope  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("modelscope is installed here: the error is for machines without it")
    for spec, use_hf in (("ms::swift/gsm8k", True), ("swift/gsm8k", False)):
        with pytest.raises(DatasetError, match="pip install modelscope"):
            load_dataset(spec, use_hf=use_hf)


def test_required_columns_from_declarations_and_signatures():
    from rewards import ORM
    from rewards.registry import required_columns

    class Declared(ORM):
        required_columns = ("verification_info",)

        def __call__(self, completions, **kwargs):
            return [0.0] * len(completions)

    class Signed(ORM):  # ms-swift style: completions positionally, the column by name
        def __call__(self, comps, answer_key, hint=None, **kwargs):
            return [0.0] * len(comps)

    def trl(prompts, completions, completion_ids, solution, trainer_state, **kwargs):
        return [0.0] * len(completions)

    def optional(completions, solution=None, **kwargs):
        return [0.0] * len(completions)

    orms.update(declared=Declared, signed=Signed, trl=trl, optional=optional)
    try:
        assert required_columns("accuracy") == required_columns("cosine") == ("solution",)
        assert required_columns("format") == required_columns("soft_overlong") == ()
        assert required_columns("declared") == ("verification_info",)
        assert required_columns("signed") == ("answer_key",)  # hint has a default
        assert required_columns("trl") == ("solution",)  # prompts, completion_ids, trainer_state: the scorer's
        assert required_columns("optional") == ()
    finally:
        for name in ("declared", "signed", "trl", "optional"):
            del orms[name]


def test_an_image_column_is_ms_swifts_images(tmp_path):
    from data.loading import shapes_image

    png = shapes_image(("red", 0), ("blue", 1))
    (tmp_path / "a.png").write_bytes(png)
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "<image>Which colour is the square?", "answer": "red",
                                               "image": "a.png"}])
    (row,) = load_dataset(str(path))
    assert row["images"] == [png] and row["solution"] == "red"
    assert row["messages"] == [{"role": "user", "content": [{"type": "image"},
                                                            {"type": "text", "text": "Which colour is the square?"}]}]


def test_image_features_of_a_saved_dataset_arrive_as_file_bytes(tmp_path):
    datasets = pytest.importorskip("datasets")
    from data.loading import shapes_image

    png = shapes_image(("green", 2), ("red", 3))
    table = datasets.Dataset.from_dict({
        "messages": [[{"role": "user", "content": "<image>Colour of the square?"}]],
        "images": [[{"bytes": png, "path": None}]], "solution": ["green"],
    }).cast_column("images", [datasets.Image()])
    table.save_to_disk(str(tmp_path / "vl"))
    (row,) = load_dataset(str(tmp_path / "vl"))
    assert row["images"] == [png] and row["solution"] == "green"

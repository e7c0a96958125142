"""Datasets: the built-in arithmetic task and ms-swift-style local files (JSONL, JSON, Parquet, CSV)."""

import json
import re

import pytest

from data.loading import ARITHMETIC_MAX_OPERAND, DatasetError, builtin_dataset, load_dataset


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_arithmetic_rows_are_correct_and_seeded():
    rows = builtin_dataset("arithmetic", 300, seed=7)
    assert len(rows) == 300
    for row in rows:
        a, b = map(int, re.fullmatch(r"What is (\d+)\+(\d+)\?", row["prompt"]).groups())
        assert 0 <= a <= ARITHMETIC_MAX_OPERAND and 0 <= b <= ARITHMETIC_MAX_OPERAND
        assert row["solution"] == str(a + b)
    assert builtin_dataset("arithmetic", 300, seed=7) == rows
    assert builtin_dataset("arithmetic", 300, seed=8) != rows
    assert len({r["prompt"] for r in rows}) > 50  # covers most of the 100 problems


def test_builtin_through_load_dataset_gives_chat_rows():
    rows = load_dataset("arithmetic", columns={}, system=None, size=20, seed=1)
    raw = builtin_dataset("arithmetic", 20, seed=1)
    assert [r["messages"] for r in rows] == [[{"role": "user", "content": r["prompt"]}] for r in raw]
    assert [r["solution"] for r in rows] == [r["solution"] for r in raw]
    assert set(rows[0]) == {"messages", "solution"}
    with_system = load_dataset("arithmetic", columns={}, system="Answer with a number.", size=3, seed=1)
    assert with_system[0]["messages"][0] == {"role": "system", "content": "Answer with a number."}
    assert len(load_dataset("arithmetic#7", size=20, seed=1)) == 7  # ms-swift's "#N" wins


def test_messages_rows_drop_the_final_assistant_turn(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {
                "messages": [
                    {"role": "user", "content": "1+1?"},
                    {"role": "assistant", "content": "2"},
                ],
                "level": 3,
            },
            {"messages": [{"role": "user", "content": "2+2?"}], "solution": "4"},
        ],
    )
    rows = load_dataset(str(path), columns={}, system=None, size=0, seed=0)
    assert rows[0] == {"messages": [{"role": "user", "content": "1+1?"}], "solution": "2", "level": 3}
    assert rows[1] == {"messages": [{"role": "user", "content": "2+2?"}], "solution": "4"}


def test_solution_column_wins_over_the_assistant_turn(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "long answer"},
                ],
                "solution": "7",
            }
        ],
    )
    (row,) = load_dataset(str(path), columns={}, system=None, size=0, seed=0)
    assert row["solution"] == "7"
    assert row["messages"] == [{"role": "user", "content": "q"}]


def test_query_rows_with_column_mapping_and_system(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"question": "What is 2+3?", "answer": "5", "source": "x"},
            {"question": "What is 1+3?", "answer": "4", "source": "y", "system": "Be brief."},
        ],
    )
    rows = load_dataset(
        str(path),
        columns={"question": "query", "answer": "solution"},
        system="Default system.",
        size=0,
        seed=0,
    )
    assert rows[0] == {
        "messages": [
            {"role": "system", "content": "Default system."},
            {"role": "user", "content": "What is 2+3?"},
        ],
        "solution": "5",
        "source": "x",
    }
    # The row's own system prompt wins over the configured default, as in ms-swift.
    assert rows[1]["messages"][0] == {"role": "system", "content": "Be brief."}
    assert len(rows[1]["messages"]) == 2


def test_system_message_inside_messages_is_not_duplicated(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {
                "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}],
                "solution": "1",
            }
        ],
    )
    (row,) = load_dataset(str(path), columns={}, system="Default.", size=0, seed=0)
    assert row["messages"] == [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}]


def test_parquet_and_json_files(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"prompt": ["What is 1+2?", "What is 3+4?"], "solution": ["3", "7"], "id": [10, 11]})
    pq.write_table(table, tmp_path / "d.parquet")
    rows = load_dataset(str(tmp_path / "d.parquet"), columns={}, system=None, size=0, seed=0)
    assert rows == [
        {"messages": [{"role": "user", "content": "What is 1+2?"}], "solution": "3", "id": 10},
        {"messages": [{"role": "user", "content": "What is 3+4?"}], "solution": "7", "id": 11},
    ]
    (tmp_path / "d.json").write_text(json.dumps([{"prompt": "p", "solution": 3}]))
    assert load_dataset(str(tmp_path / "d.json"), size=0)[0]["solution"] == 3


def test_size_samples_with_a_seed_and_repeats_small_data(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}", "solution": str(i)} for i in range(10)])
    four = load_dataset(str(path), size=4, seed=3)
    assert len(four) == 4 and four == load_dataset(str(path), size=4, seed=3)
    assert len({r["solution"] for r in four}) == 4
    many = load_dataset(f"{path}#25", size=0, seed=3)
    counts = [sum(r["solution"] == str(i) for r in many) for i in range(10)]
    assert len(many) == 25 and min(counts) >= 2  # two whole copies, then 5 sampled
    assert len(load_dataset(str(path), size=0, seed=0)) == 10


def test_missing_solution_names_file_columns_and_fix(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"prompt": "What is 1+1?", "gold": "2"}])
    with pytest.raises(DatasetError) as err:
        load_dataset(str(path), columns={}, system=None, size=0, seed=0)
    message = str(err.value)
    assert isinstance(err.value, ValueError)
    assert "\n" not in message
    assert str(path) in message and "gold" in message and "prompt" in message and "row 0" in message
    assert 'data.columns = {your_column = "solution"}' in message
    # ... and the fix it suggests works.
    assert load_dataset(str(path), columns={"gold": "solution"}, size=0)[0]["solution"] == "2"
    # ms-swift's response aliases (answer, output, response, ...) are the reference answer by themselves.
    answered = write_jsonl(tmp_path / "qa2.jsonl", [{"prompt": "What is 1+1?", "answer": "2"}])
    assert load_dataset(str(answered))[0] == {"messages": [{"role": "user", "content": "What is 1+1?"}], "solution": "2"}


def test_errors_for_missing_file_empty_data_and_bad_rows(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DatasetError, match=re.escape(str(missing))):
        load_dataset(str(missing), size=0)
    with pytest.raises(DatasetError, match="built-in 'arithmetic'"):
        load_dataset("arithmetc", size=0)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DatasetError, match="no rows"):
        load_dataset(str(tmp_path / "empty.jsonl"), size=0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "solution": "1"}\n{not json\n')
    with pytest.raises(DatasetError, match=re.escape(f"{bad}:2")):
        load_dataset(str(bad), size=0)
    no_prompt = write_jsonl(tmp_path / "np.jsonl", [{"text": "a", "solution": "1"}])
    with pytest.raises(DatasetError, match="no prompt"):
        load_dataset(str(no_prompt), size=0)
    with pytest.raises(DatasetError, match="'typo'"):
        load_dataset(str(no_prompt), columns={"typo": "prompt"}, size=0)
    (tmp_path / "d.csv").write_text("prompt,solution\n")
    with pytest.raises(DatasetError, match="no rows"):
        load_dataset(str(tmp_path / "d.csv"), size=0)
    (tmp_path / "d.xml").write_text("<prompt/>\n")  # .txt is read since #39 (tests/test_data_formats.py)
    with pytest.raises(DatasetError, match="unsupported file type"):
        load_dataset(str(tmp_path / "d.xml"), size=0)

"""Datasets as ms-swift users know them: a built-in task or a local JSONL / JSON / Parquet file.

Every row comes out as ``{"messages": [...chat up to the assistant turn...], "solution": ..., **other}``.
The other columns travel with the prompt and reach the reward functions as keyword lists, as in
ms-swift / TRL (``reward(completions, solution=[...], **columns)``).

Row formats understood (ms-swift's standard ones), after ``columns`` renamed the file's columns:

- ``messages``: a list of ``{"role", "content"}``. A trailing assistant message is the reference
  answer: it is dropped from the prompt and becomes ``solution`` when there is no ``solution`` column.
- ``prompt`` or ``query`` (+ optional ``system``, + optional ``response``, used like the trailing
  assistant message above).

``system`` (the config's default system prompt) is prepended to rows that have none of their own.
A dataset spec may end in ``#N`` (ms-swift's syntax) to take a seeded sample of N rows.
"""

from __future__ import annotations

import difflib
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The built-in task: single-digit addition, which the ~0.4 M-parameter tiny model can learn on CPU
# in minutes. The tiny model's tokenizer and warm start are built from the same generator.
ARITHMETIC_MAX_OPERAND = 9
DEFAULT_BUILTIN_SIZE = 1000

_PROMPT_KEYS = ("prompt", "query")
_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


class DatasetError(ValueError):
    """A dataset the user must fix (missing file, missing column, bad row): one line, no traceback."""


def arithmetic_prompt(a: int, b: int) -> str:
    return f"What is {a}+{b}?"


def arithmetic_rows(size: int, seed: int) -> list[dict[str, Any]]:
    """``size`` rows ``{"prompt": "What is 7+5?", "solution": "12"}``, operands drawn uniformly from
    0..ARITHMETIC_MAX_OPERAND by ``random.Random(seed)`` (so the same seed gives the same rows)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(size):
        a, b = rng.randint(0, ARITHMETIC_MAX_OPERAND), rng.randint(0, ARITHMETIC_MAX_OPERAND)
        rows.append({"prompt": arithmetic_prompt(a, b), "solution": str(a + b)})
    return rows


BUILTIN_DATASETS: dict[str, Callable[[int, int], list[dict[str, Any]]]] = {"arithmetic": arithmetic_rows}


def prompt_token_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """The prompt as the engine sees it: the chat template with the generation prompt, tokenized; a
    trailing assistant message is continued (a pre-filled reply) instead."""
    if messages and messages[-1]["role"] == "assistant":
        text = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    else:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def builtin_dataset(name: str, size: int, seed: int) -> list[dict[str, Any]]:
    """The raw rows (``prompt``, ``solution``) of a built-in task."""
    if name not in BUILTIN_DATASETS:
        raise DatasetError(
            f"unknown built-in dataset {name!r}; built-in: {', '.join(sorted(BUILTIN_DATASETS))}"
        )
    if size <= 0:
        raise DatasetError(f"built-in dataset {name!r}: size must be positive, got {size}")
    return BUILTIN_DATASETS[name](size, seed)


def load_dataset(
    spec: str,
    *,
    columns: dict[str, str] | None = None,
    system: str | None = None,
    size: int | None = None,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Rows ready for the feeder: ``{"messages": [...], "solution": ..., **other columns}``.

    ``spec`` is a built-in name (``"arithmetic"``) or a local ``.jsonl`` / ``.json`` / ``.parquet``
    path, optionally with ``#N``. ``size`` (or ``#N``, which wins) > 0 takes a seeded sample of that many
    rows (repeating the data when it has fewer, as ms-swift); for built-ins it is the number generated
    (default 1000). ``columns`` renames the file's columns first (``{"answer": "solution"}``).
    """
    spec = spec.strip()
    source, sep, count = spec.rpartition("#")
    if sep and count.isdigit():
        spec, size = source, int(count)
    if spec in BUILTIN_DATASETS:
        rows = builtin_dataset(spec, size if size and size > 0 else DEFAULT_BUILTIN_SIZE, seed)
        where = f"built-in dataset {spec!r}"
    else:
        path = _resolve_path(spec)
        rows = _read_rows(path)
        where = str(path)
        if size and size > 0:
            rows = _sample(rows, size, seed)
    if not rows:
        raise DatasetError(f"{where}: the dataset has no rows")
    columns = dict(columns or {})
    _check_mapping(rows, columns, where)
    return [_normalize(row, columns, system, where, index) for index, row in enumerate(rows)]


def _resolve_path(spec: str) -> Path:
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    hint = ""
    close = difflib.get_close_matches(spec, list(BUILTIN_DATASETS), n=1)
    if close:
        hint = f" (did you mean the built-in {close[0]!r}?)"
    raise DatasetError(
        f"dataset {spec!r}: no such file{hint}; give a local {'/'.join(_FILE_SUFFIXES)} file "
        f"or a built-in dataset ({', '.join(sorted(BUILTIN_DATASETS))}); datasets are never downloaded"
    )


def _read_rows(path: Path) -> list[dict[str, Any]]:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise DatasetError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from exc
        try:
            return pq.read_table(path).to_pylist()
        except Exception as exc:
            raise DatasetError(f"{path}: not a readable Parquet file ({type(exc).__name__}: {exc})") from exc
    if suffix == ".jsonl":
        rows = []
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DatasetError(f"{path}:{number}: not valid JSON ({exc.msg})") from exc
                if not isinstance(row, dict):
                    raise DatasetError(
                        f"{path}:{number}: each line must be a JSON object, got {type(row).__name__}"
                    )
                rows.append(row)
        return rows
    if suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from exc
        if not isinstance(data, list) or not all(isinstance(row, dict) for row in data):
            raise DatasetError(f"{path}: a .json dataset must be a list of objects (or use .jsonl)")
        return data
    raise DatasetError(f"{path}: unsupported file type {suffix!r}; use {', '.join(_FILE_SUFFIXES)}")


def _sample(rows: list[dict[str, Any]], size: int, seed: int) -> list[dict[str, Any]]:
    """ms-swift's ``dataset#N``: whole copies while N exceeds the data, then a seeded random subset."""
    if not rows:
        return rows
    rng = random.Random(seed)
    copies, rest = divmod(size, len(rows))
    picked = list(range(len(rows))) * copies + sorted(rng.sample(range(len(rows)), rest))
    return [rows[i] for i in picked]


def _check_mapping(rows: list[dict[str, Any]], columns: dict[str, str], where: str) -> None:
    found = sorted({key for row in rows for key in row})
    for old in columns:
        if old not in found:
            raise DatasetError(
                f"{where}: data.columns maps {old!r}, which is not a column here (columns: {', '.join(found)})"
            )


def _normalize(
    raw: dict[str, Any], columns: dict[str, str], system: str | None, where: str, index: int
) -> dict[str, Any]:
    row = dict(raw)
    for old, new in columns.items():
        if old in row:
            row[new] = row.pop(old)
    reference: Any = None
    if row.get("messages") is not None:
        messages = _check_messages(row.pop("messages"), where, index)
        if messages and messages[-1]["role"] == "assistant":
            reference = messages.pop()["content"]
        own_system = row.pop("system", None)  # a system message inside ``messages`` wins over the column
        if own_system is not None and not (messages and messages[0]["role"] == "system"):
            messages.insert(0, {"role": "system", "content": str(own_system)})
    else:
        key = next((k for k in _PROMPT_KEYS if row.get(k) is not None), None)
        if key is None:
            raise DatasetError(
                f"{where}: row {index} has no prompt: it needs a 'messages', 'prompt' or 'query' column "
                f'(columns: {", ".join(sorted(row))}); rename yours with data.columns = {{your_column = "prompt"}}'
            )
        messages = [{"role": "user", "content": str(row.pop(key))}]
        for other in _PROMPT_KEYS:
            row.pop(other, None)
        reference = row.pop("response", None)
        own_system = row.pop("system", None)
        if own_system is not None:
            messages.insert(0, {"role": "system", "content": str(own_system)})
    if system is not None and not (messages and messages[0]["role"] == "system"):
        messages.insert(0, {"role": "system", "content": system})
    if not any(m["role"] == "user" for m in messages):
        raise DatasetError(f"{where}: row {index} has no user message to answer")
    if row.get("solution") is None:
        if reference is None:
            raise DatasetError(
                f"{where}: row {index} has no 'solution' (columns: {', '.join(sorted(raw))}); the accuracy "
                f'reward needs one: map a column with data.columns = {{answer = "solution"}} or end each '
                f"row's messages with the assistant's reference answer"
            )
        row["solution"] = reference
    return {"messages": messages, **row}


def _check_messages(messages: Any, where: str, index: int) -> list[dict[str, str]]:
    if not isinstance(messages, list):
        raise DatasetError(f"{where}: row {index}: 'messages' must be a list of {{role, content}} objects")
    out = []
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DatasetError(f"{where}: row {index}: each message needs 'role' and 'content', got {m!r}")
        if m["role"] not in ("system", "user", "assistant", "tool"):
            raise DatasetError(
                f"{where}: row {index}: unknown role {m['role']!r} (system, user, assistant, tool)"
            )
        out.append({"role": str(m["role"]), "content": "" if m["content"] is None else str(m["content"])})
    return out

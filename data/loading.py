"""Datasets as ms-swift reads them: built-in tasks, local JSONL / JSON / Parquet / CSV / TXT files, folders (data
files, or a ``datasets`` save_to_disk folder) and Hub datasets (``datasets.load_dataset`` and its cache), one
or a list of them, each with ms-swift's ``id_or_path:subset1/subset2#N`` syntax (``parse_dataset``).

Every row comes out as ``{"messages": [...chat up to the assistant turn...], "solution": ..., **other}``.
The other columns travel with the prompt and reach the reward functions as keyword lists, as in
ms-swift / TRL (``reward(completions, solution=[...], **columns)``); ``solution`` keeps its name (ms-swift's
GRPO contract), and a row's ``tools`` (tool schemas) is kept as a parsed list.

Columns are mapped as ms-swift's ``AutoPreprocessor`` maps them, after ``data.columns`` renamed them
(``map_columns``):

- ``messages`` / ``conversation`` / ``conversations``: a list of ``{"role", "content"}`` (or ShareGPT's
  ``{"from", "value"}`` with human / gpt roles). A trailing assistant message is the reference answer: it is
  dropped from the prompt and becomes ``solution`` when there is no ``solution`` column.
- else a query column (``query``, ``prompt``, ``input``, ``instruction``, ``question``, ``problem``; alpaca's
  ``instruction`` + ``input`` joined), an optional response column (``response``, ``answer``, ``output``,
  ``solution``, ...: used like the trailing assistant message above), ``system`` / ``system_prompt`` and
  ``history``.

``system`` (the config's default system prompt) is prepended to rows that have none of their own. Which
columns every row must have comes from the rewards (``rewards.registry.required_columns``): ``accuracy``
needs ``solution``, ``format`` nothing.
"""

from __future__ import annotations

import ast
import difflib
import hashlib
import io
import json
import os
import random
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from config import Config, verifiers_env
from data.chat import ChatTemplate
from pipeline.errors import UserError
from rewards.registry import required_columns
from schedulers.verifiers import TASK_KEY, VerifiersError, load_tasks

# The built-in task: single-digit addition, which the ~0.4 M-parameter tiny model can learn on CPU
# in minutes. The tiny model's tokenizer and warm start are built from the same generator.
ARITHMETIC_MAX_OPERAND = 9
DEFAULT_BUILTIN_SIZE = 1000

_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".txt")


class DatasetError(UserError, ValueError):
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


# The built-in tool-use task (the tiny-agent model, tinymodels/agent.py): the same question over
# three-digit operands, whose sum the tiny model cannot work out but can get from an ``add`` tool.
ADD_TOOL_MIN_OPERAND, ADD_TOOL_MAX_OPERAND = 100, 999


def add_tool_rows(size: int, seed: int) -> list[dict[str, Any]]:
    """``size`` rows ``{"prompt": "What is 482+391?", "solution": "873"}``, operands drawn uniformly from
    ADD_TOOL_MIN_OPERAND..ADD_TOOL_MAX_OPERAND by ``random.Random(seed)``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(size):
        a = rng.randint(ADD_TOOL_MIN_OPERAND, ADD_TOOL_MAX_OPERAND)
        b = rng.randint(ADD_TOOL_MIN_OPERAND, ADD_TOOL_MAX_OPERAND)
        rows.append({"prompt": arithmetic_prompt(a, b), "solution": str(a + b)})
    return rows


def guess_number_rows(size: int, seed: int) -> list[dict[str, Any]]:
    """``size`` rows for the ``guess_number`` env (configs/gym-demo.toml): a placeholder prompt (the env's
    reset writes the real one) and ``env_config = {"seed": ...}``, the hidden number's seed."""
    rng = random.Random(seed)
    return [{"prompt": "Play guess the number.", "env_config": {"seed": rng.randrange(2**31)}} for _ in range(size)]


# The built-in image task (tiny VL models): a picture of a square and a circle of different colours, in
# different quadrants, and the question which colour the square (or the circle) has. 56 x 56 pixels give
# 4 image tokens (one per 2 x 2 merged 14-pixel patches, i.e. one per quadrant).
SHAPE_COLOURS = {"red": (220, 30, 30), "green": (30, 180, 30), "blue": (30, 60, 220), "yellow": (230, 210, 20)}
SHAPE_NAMES = ("square", "circle")
SHAPES_IMAGE_SIZE = 56


def shapes_question(shape: str) -> str:
    return f"What colour is the {shape}?"


def shapes_image(square: tuple[str, int], circle: tuple[str, int], size: int = SHAPES_IMAGE_SIZE) -> bytes:
    """PNG bytes: a square and a circle, each ``(colour, quadrant 0-3)``, on a grey background."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), (128, 128, 128))
    draw = ImageDraw.Draw(image)
    half, margin = size // 2, size // 10
    for (colour, quadrant), shape in ((square, "square"), (circle, "circle")):
        x, y = (quadrant % 2) * half, (quadrant // 2) * half
        box = (x + margin, y + margin, x + half - margin, y + half - margin)
        fill = SHAPE_COLOURS[colour]
        (draw.rectangle if shape == "square" else draw.ellipse)(box, fill=fill)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def shapes_rows(size: int, seed: int) -> list[dict[str, Any]]:
    """``size`` rows in ms-swift's multimodal form: ``{"messages": [{"role": "user", "content":
    "<image>What colour is the square?"}], "images": [png bytes], "solution": "red"}``, drawn by
    ``random.Random(seed)``: two different colours, two different quadrants, and which shape is asked about."""
    rng = random.Random(seed)
    colours = list(SHAPE_COLOURS)
    rows = []
    for _ in range(size):
        square_colour, circle_colour = rng.sample(colours, 2)
        square_at, circle_at = rng.sample(range(4), 2)
        shape = "square" if rng.random() < 0.5 else "circle"
        image = shapes_image((square_colour, square_at), (circle_colour, circle_at))
        rows.append({
            "messages": [{"role": "user", "content": f"<image>{shapes_question(shape)}"}],
            "images": [image],
            "solution": square_colour if shape == "square" else circle_colour,
        })
    return rows


BUILTIN_DATASETS: dict[str, Callable[[int, int], list[dict[str, Any]]]] = {
    "arithmetic": arithmetic_rows,
    "add_tool": add_tool_rows,
    "guess_number": guess_number_rows,
    "shapes": shapes_rows,
}


def prompt_token_ids(tokenizer: Any, messages: list[dict[str, Any]], *, tools: Any = None,
                     chat_template: ChatTemplate | None = None) -> list[int]:
    """The prompt as the engine sees it: the chat template (``chat_template``: the run's, from
    ``ChatTemplate.from_config``; None = the tokenizer's own) with the generation prompt and ``tools``,
    tokenized; a trailing assistant message is continued (a pre-filled reply) instead."""
    return (chat_template or ChatTemplate()).token_ids(tokenizer, messages, tools=tools)


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
    spec: str | list[str],
    *,
    columns: dict[str, str] | None = None,
    system: str | None = None,
    size: int | None = None,
    seed: int = 0,
    require_solution: bool = True,
    needs: Mapping[str, Sequence[str]] | None = None,
    max_image_bytes: int | None = None,
    builtin_size: int | None = None,
    shuffle: bool = True,
    split: str = "train",
    use_hf: bool = True,
    validation: bool = False,
    field: str = "data.dataset",
    auto_columns: bool = True,
) -> list[dict[str, Any]]:
    """Rows ready for the feeder: ``{"messages": [...], "solution": ..., **other columns}``.

    ``spec``: one dataset or a list, concatenated in order (``field`` names it in errors); each entry is parsed
    with ms-swift's syntax (``parse_dataset``) and is a built-in task, a local file or folder, or a Hub id
    (``use_hf``: Hugging Face, else ModelScope; ``split``: the split read from Hub datasets, folders and
    DatasetDicts). ``#N`` (or ``size`` for an entry without it) takes N rows as ms-swift's ``sample_dataset``:
    whole copies while N exceeds the data, then ``N % len`` rows drawn by one ``numpy`` ``RandomState(seed)``
    shared by the entries in order (the first ``N % len`` rows when ``shuffle`` is false); ``validation``: the
    first N, and N above the data is an error (ms-swift's val set). A built-in generates N rows (else ``size``,
    ``builtin_size``, 1000). ``columns`` renames columns first (``{"gold": "solution"}``), then ms-swift's
    automatic mapping applies (``map_columns``; ``auto_columns = False`` is ms-swift's disable_auto_column_mapping).

    ``needs``: columns every row must have, each with the rewards that need it (``{"solution": ["accuracy"]}``);
    None = ``{"solution": [...]}`` when ``require_solution`` (a missing solution is an error), else nothing.
    Rows with images (ms-swift's multimodal forms, see ``_images``) come out with content-list messages and
    ``images`` = the images' bytes; ``max_image_bytes`` caps each image's size.
    """
    entries = [spec] if isinstance(spec, str) else list(spec)
    if not entries:
        raise DatasetError(f"{field} is empty: give a dataset (a name, path or Hub id) or a list of them")
    if needs is None:
        needs = {"solution": ["accuracy"]} if require_solution else {}
    state = np.random.RandomState(seed)
    sources = [
        _open(parse_dataset(entry, field), field=field, size=size, builtin_size=builtin_size, seed=seed,
              split=split, use_hf=use_hf)
        for entry in entries
    ]
    columns = dict(columns or {})
    found = {key for source in sources for key in source.columns}
    for old in columns:
        if old not in found and old.lower() not in {key.lower() for key in found}:
            where = sources[0].where if len(sources) == 1 else f"{field} ({len(sources)} datasets)"
            raise DatasetError(
                f"{where}: data.columns maps {old!r}, which is not a column here (columns: {', '.join(sorted(found))})"
            )
    out: list[dict[str, Any]] = []
    for source in sources:
        indices = list(range(source.length))
        if source.sample is not None and not source.builtin:
            indices = _sample_indices(source.length, source.sample, shuffle and not validation, state,
                                      validation=validation, where=source.where, field=field)
        raw = source.rows(indices)
        kind, rows = map_columns(raw, columns, source.columns, auto=auto_columns)
        for index, row, original in zip(indices, rows, raw):
            out.append(_normalize(row, kind, system, source.where, index, needs, sorted(original), base=source.base,
                                  max_image_bytes=max_image_bytes))
    return out


# ------------------------------------------------------------------------------ ms-swift's dataset syntax


@dataclass(frozen=True)
class DatasetSyntax:
    """One ``data.dataset`` entry: ``[hf::|ms::]id_or_path[:subset1/subset2][#N]`` (ms-swift's ``DatasetSyntax``)."""

    dataset: str
    subsets: tuple[str, ...] = ()
    sample: int | None = None
    use_hf: bool | None = None  # the hf:: / ms:: prefix; None = model.use_hf
    raw: str = ""


def parse_dataset(spec: str, field: str = "data.dataset") -> DatasetSyntax:
    """ms-swift's ``DatasetSyntax.parse``: an existing path is taken whole at each step (a path may hold ``:``
    or ``#``); else an ``hf::`` / ``ms::`` prefix, a ``#N`` suffix and ``:subset1/subset2`` split off in turn."""
    text = spec.strip()
    use_hf = None
    if not os.path.exists(text) and "::" in text:
        prefix, _, text = text.partition("::")
        if prefix.lower() not in ("hf", "ms"):
            raise DatasetError(f"{field} = {spec!r}: unknown hub prefix {prefix + '::'!r}; use hf:: or ms::")
        use_hf = prefix.lower() == "hf"
    sample = None
    if not os.path.exists(text) and "#" in text:
        text, _, count = text.rpartition("#")
        if not count.strip().isdigit() or int(count) == 0:
            raise DatasetError(f"{field} = {spec!r}: '#{count}' is not a row count; ms-swift's syntax is name#N, N > 0")
        sample = int(count)
    subsets: tuple[str, ...] = ()
    if not os.path.exists(text) and ":" in text:
        text, _, names = text.partition(":")
        subsets = tuple(name.strip() for name in names.split("/"))
        if not all(subsets):
            raise DatasetError(f"{field} = {spec!r}: an empty subset name; the syntax is id:subset1/subset2")
    return DatasetSyntax(text.strip(), subsets, sample, use_hf, spec)


@dataclass
class _Source:
    """One opened entry: its columns and length, and ``rows(indices)`` (a Hub dataset stays Arrow until then)."""

    where: str
    columns: list[str]
    length: int
    rows: Callable[[list[int]], list[dict[str, Any]]]
    base: Path
    sample: int | None
    builtin: bool = False


def _listed(rows: list[dict[str, Any]]) -> Callable[[list[int]], list[dict[str, Any]]]:
    return lambda indices: [rows[i] for i in indices]


def _open(syntax: DatasetSyntax, *, field: str, size: int | None, builtin_size: int | None, seed: int, split: str,
          use_hf: bool) -> _Source:
    name, raw = syntax.dataset, syntax.raw
    sample = syntax.sample if syntax.sample is not None else (size if size and size > 0 else None)
    if name in BUILTIN_DATASETS and not os.path.exists(name):
        if syntax.subsets:
            raise DatasetError(f"{field} = {raw!r}: the built-in dataset {name!r} has no subsets")
        count = sample or builtin_size or DEFAULT_BUILTIN_SIZE
        rows = builtin_dataset(name, count, seed)
        return _Source(f"built-in dataset {name!r}", _keys(rows), len(rows), _listed(rows), Path.cwd(), None, True)
    path = Path(name).expanduser()
    if path.is_file():
        if syntax.subsets:
            raise DatasetError(f"{field} = {raw!r}: a file has no subsets (':' names a Hub dataset's subsets)")
        try:
            rows = _read_rows(path)
        except (OSError, UnicodeDecodeError) as exc:  # unreadable, or not UTF-8 text
            raise DatasetError(f"{field} = {raw!r}: cannot be read ({exc})") from None
        return _checked(_Source(str(path), _keys(rows), len(rows), _listed(rows), path.parent, sample))
    if path.is_dir():
        return _checked(_hf_source(_open_folder(path, syntax, split, field), str(path), path, sample))
    if _looks_like_hub_id(name, syntax):
        hub = syntax.use_hf if syntax.use_hf is not None else use_hf
        dataset = _open_hub(name, syntax, split, hub, field)
        return _checked(_hf_source(dataset, f"{'Hub' if hub else 'ModelScope'} dataset {name!r}", Path.cwd(), sample))
    close = difflib.get_close_matches(name, list(BUILTIN_DATASETS), n=1)
    hint = f" (did you mean the built-in {close[0]!r}?)" if close else ""
    raise DatasetError(
        f"{field} = {raw!r}: no such file or folder{hint}; give a local {'/'.join(_FILE_SUFFIXES)} file, a folder, "
        f"a Hub dataset id (namespace/name), or a built-in dataset ({', '.join(sorted(BUILTIN_DATASETS))})"
    )


def _keys(rows: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(key for row in rows for key in row))


def _checked(source: _Source) -> _Source:
    if source.length == 0:
        raise DatasetError(f"{source.where}: the dataset has no rows")
    return source


def _looks_like_hub_id(name: str, syntax: DatasetSyntax) -> bool:
    """``namespace/name`` (or any name after an explicit ``hf::`` / ``ms::``); a missing ``x.jsonl`` or ``./x``
    is a missing file, not an id."""
    if syntax.use_hf is not None:
        return True
    if name.startswith(("/", ".", "~")) or name.lower().endswith(_FILE_SUFFIXES):
        return False
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name))


def _hf_source(dataset: Any, where: str, base: Path, sample: int | None) -> _Source:
    """A ``datasets.Dataset`` as a source; images stay file bytes (ms-swift casts them to decode=False too)."""
    import datasets

    for column, feature in dataset.features.items():
        inner = getattr(feature, "feature", None)
        if isinstance(feature, datasets.Image) or isinstance(inner, datasets.Image):
            image = datasets.Image(decode=False)
            dataset = dataset.cast_column(column, image if isinstance(feature, datasets.Image) else [image])

    def rows(indices: list[int]) -> list[dict[str, Any]]:
        whole = len(indices) == len(dataset) and indices == list(range(len(dataset)))
        return (dataset if whole else dataset.select(indices)).to_list()

    return _Source(where, list(dataset.column_names), len(dataset), rows, base, sample)


def _open_folder(path: Path, syntax: DatasetSyntax, split: str, field: str) -> Any:
    """A ``save_to_disk`` folder (``datasets.load_from_disk``; a DatasetDict gives ``split``), else a folder of
    data files read by ``datasets.load_dataset`` (its splits by file name: train / test ...; subsets = configs)."""
    import datasets

    raw = syntax.raw
    saved = (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()
    try:
        if saved:
            if syntax.subsets:
                raise DatasetError(f"{field} = {raw!r}: a save_to_disk folder has no subsets; choose its split with "
                                   f"data.split / data.val_split")
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                return _pick_split(loaded, split, f"{field} = {raw!r}")
            return loaded
        return _concat([datasets.load_dataset(str(path), name=subset, split=split)
                        for subset in (syntax.subsets or (None,))])
    except DatasetError:
        raise
    except Exception as exc:  # noqa: BLE001 - datasets raises many types for one bad folder
        raise DatasetError(f"{field} = {raw!r}: the folder cannot be read as a dataset ({type(exc).__name__}: "
                           f"{_one_line(exc)}); it needs .jsonl / .json / .parquet / .csv / .txt files or a save_to_disk dataset") from None


def _one_line(exc: BaseException) -> str:
    """The datasets library's messages span lines; ours are one line."""
    return " ".join(str(exc).split())


def _pick_split(loaded: Any, split: str, name: str) -> Any:
    if split in loaded:
        return loaded[split]
    if len(loaded) == 1:
        return next(iter(loaded.values()))
    raise DatasetError(f"{name}: no split {split!r} (it has {', '.join(loaded)}); set data.split / data.val_split")


def _concat(parts: list[Any]) -> Any:
    import datasets

    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def _open_hub(repo: str, syntax: DatasetSyntax, split: str, use_hf: bool, field: str) -> Any:
    """``datasets.load_dataset(repo, name=subset, split=split)`` per subset, concatenated (as ms-swift); the
    datasets cache serves it offline (HF_HUB_OFFLINE=1 / HF_DATASETS_OFFLINE=1) once it was loaded online."""
    raw = syntax.raw
    if not use_hf:
        return _open_modelscope(repo, syntax, split, field)
    import datasets
    import datasets.config

    cache = datasets.config.HF_DATASETS_CACHE
    subsets: tuple[str | None, ...] = syntax.subsets or (None,)
    parts = []
    for subset in subsets:
        try:
            parts.append(datasets.load_dataset(repo, name=subset, split=split))
        except ConnectionError as exc:  # offline (or no network) and not in the cache
            offline = ("offline mode is on (HF_HUB_OFFLINE=1 or HF_DATASETS_OFFLINE=1)" if datasets.config.HF_HUB_OFFLINE
                       else "the Hub cannot be reached")
            raise DatasetError(
                f"{field} = {raw!r}: the Hub dataset {repo!r} is not in the datasets cache {cache} and {offline} "
                f"({_one_line(exc)}); load it once where there is network, point HF_HOME / HF_DATASETS_CACHE at the cache "
                "that holds it, or download its files and give their local path"
            ) from None
        except Exception as exc:  # noqa: BLE001 - not found, gated, a missing subset or split: datasets' message says which
            raise DatasetError(
                f"{field} = {raw!r}: cannot load the Hub dataset {repo!r}"
                f"{f' subset {subset!r}' if subset else ''} split {split!r} ({type(exc).__name__}: {_one_line(exc)}); "
                "pick a subset with id:subset (ms-swift's syntax) and a split with data.split / data.val_split"
            ) from None
    return _concat(parts)


def _open_modelscope(repo: str, syntax: DatasetSyntax, split: str, field: str) -> Any:
    try:
        from modelscope import MsDataset  # pyright: ignore[reportMissingImports]  (optional: ModelScope)
    except ImportError:
        raise DatasetError(
            f"{field} = {syntax.raw!r} is a ModelScope dataset (model.use_hf = false or ms::), which needs the "
            "modelscope package: pip install modelscope (or use the Hugging Face Hub: model.use_hf = true / hf::)"
        ) from None
    parts = []
    for subset in syntax.subsets or ("default",):
        try:  # as ms-swift's MSHub.load_dataset
            loaded = MsDataset.load(repo, subset_name=subset, split=split, version="master")
        except Exception as exc:  # noqa: BLE001 - modelscope raises many types for one missing dataset
            raise DatasetError(f"{field} = {syntax.raw!r}: cannot load the ModelScope dataset {repo!r} "
                               f"({type(exc).__name__}: {_one_line(exc)})") from None
        parts.append(getattr(loaded, "_hf_ds", loaded))
    return _concat(parts)


def _sample_indices(length: int, size: int, shuffle: bool, state: Any, *, validation: bool, where: str,
                    field: str) -> list[int]:
    """ms-swift's ``sample_dataset``: ``size // length`` whole copies in order, then ``size % length`` rows of
    ``state.permutation(length)`` (the first ones when not shuffling). A validation set is never repeated."""
    if validation and size > length:
        raise DatasetError(
            f"{where}: #{size} asks for more rows than the {length} it has; a validation set is not repeated (as "
            f"ms-swift), so use at most #{length} in {field}"
        )
    copies, rest = divmod(size, length)
    picked = list(range(length)) * copies
    if rest:
        picked += (state.permutation(length)[:rest] if shuffle else np.arange(rest)).tolist()
    return picked


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
            raise DatasetError(f"{path}: not a readable Parquet file ({type(exc).__name__}: {_one_line(exc)})") from exc
    if suffix == ".csv":
        import pandas as pd

        try:  # as ms-swift (datasets' csv builder with na_filter=False): empty cells stay "", not NaN
            return pd.read_csv(path, na_filter=False).to_dict("records")
        except pd.errors.EmptyDataError:
            return []
        except (pd.errors.ParserError, ValueError) as exc:
            raise DatasetError(f"{path}: not a readable CSV file ({_one_line(exc)})") from None
    if suffix == ".txt":
        import datasets

        # As ms-swift (DatasetLoader._load_dataset_path maps .txt to the datasets library's "text" builder): one
        # row per line in a `text` column, line breaks stripped, an empty line kept as a row with "".
        try:
            return datasets.load_dataset("text", data_files=str(path), split="train").to_list()
        except Exception as exc:  # noqa: BLE001 - datasets raises many types for one bad file
            raise DatasetError(f"{path}: not a readable text file ({type(exc).__name__}: {_one_line(exc)})") from None
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


# ------------------------------------------------------------------- ms-swift's automatic column mapping

_MEDIA_KEYS = {"images": "images", "image": "images", "audios": "audios", "audio": "audios", "videos": "videos",
               "video": "videos"}
_SYSTEM_KEYS = ("system", "system_prompt")
_QUERY_KEYS = ("query", "prompt", "input", "instruction", "question", "problem")
_RESPONSE_KEYS = ("response", "answer", "output", "targets", "target", "answer_key", "answers", "solution", "text",
                  "completion", "content")
_MESSAGES_KEYS = ("messages", "conversation", "conversations")
_USER_ROLES, _ASSISTANT_ROLES = ("user", "human"), ("assistant", "gpt", "bot")
_TOOL_CALL_ROLES, _TOOL_RESPONSE_ROLES = ("function_call", "tool_call"), (
    "function_response", "observation", "observations", "tool_response", "tool")


def safe_renames(features: Sequence[str], mapping: Mapping[str, str]) -> dict[str, str]:
    """ms-swift's ``safe_rename_columns`` as a plan: ``{column: new name}`` for the columns ``mapping`` names
    (case-insensitively), leaving out every target two columns would share (``problem`` and ``question`` both
    present: neither becomes the query) and the columns already named so (``query`` then wins over ``prompt``)."""
    by_lower = {key.lower(): key for key in features}
    plan = {by_lower[old.lower()]: new for old, new in mapping.items() if old.lower() in by_lower}
    counts = Counter(plan.values())
    return {old: new for old, new in plan.items() if counts[new] == 1 and old != new}


def columns_kind(features: Sequence[str]) -> str:
    """ms-swift's ``AutoPreprocessor``: ``messages`` (a messages / conversation(s) column), ``alpaca``
    (instruction + input), else ``response`` (query/response aliases)."""
    if any(key in features for key in _MESSAGES_KEYS):
        return "messages"
    if "instruction" in features and "input" in features:
        return "alpaca"
    return "response"


def map_columns(
    rows: list[dict[str, Any]], columns: Mapping[str, str], features: Sequence[str], *, auto: bool = True
) -> tuple[str, list[dict[str, Any]]]:
    """``columns`` (the user's renames), then ms-swift's automatic mapping: ``(kind, rows)``, ``kind`` as
    ``columns_kind`` gives it; rows come out with ``messages`` (``messages`` kind) or ``query`` / ``response`` /
    ``system`` / ``history`` (``response`` kind, which alpaca rows become), media columns as
    ``images`` / ``audios`` / ``videos``, and every other column as it was. ``solution`` is kept under its own
    name too (ms-swift's GRPO contract: it reaches the reward functions). ``auto = False``: no aliases (ms-swift's
    disable_auto_column_mapping), only ``columns``."""
    user = safe_renames(features, columns)
    features = [user.get(key, key) for key in features]
    kind = columns_kind(features)
    mapping: dict[str, str] = dict(_MEDIA_KEYS)
    if kind == "messages":
        mapping.update({key: "messages" for key in _MESSAGES_KEYS})
        mapping.update({key: "system" for key in _SYSTEM_KEYS})
    else:
        mapping.update({key: "system" for key in _SYSTEM_KEYS})
        mapping.update({key: "query" for key in _QUERY_KEYS})
        mapping.update({key: "response" for key in _RESPONSE_KEYS})
    auto_renames = safe_renames(features, mapping) if auto else {}
    out = []
    for raw in rows:
        row = {user.get(key, key): value for key, value in raw.items()}
        solution = row.get("solution")
        row = {auto_renames.get(key, key): value for key, value in row.items()}
        if solution is not None:
            row["solution"] = solution
        if kind == "alpaca":  # ms-swift's AlpacaPreprocessor: instruction and input joined into the query
            instruction, input_ = row.pop("instruction", None), row.pop("input", None)
            row["query"] = f"{instruction}\n{input_}" if instruction and input_ else instruction or input_
        out.append(row)
    return ("messages" if kind == "messages" else "response"), out


def _parse_text(value: Any, what: str, where: str, index: int) -> Any:
    """A column stored as text (JSON, or the Python literal ms-swift's ``ast.literal_eval`` reads): parsed."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        pass
    try:
        return ast.literal_eval(value)  # literals only: no names, calls or attributes are evaluated
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        raise DatasetError(f"{where}: row {index}: {what} is a string that is neither JSON nor a Python literal: "
                           f"{value!r:.80}") from None


def _standard_messages(messages: Any, system: Any, where: str, index: int) -> list[dict[str, Any]]:
    """ms-swift's ``MessagesPreprocessor``: role/content or ShareGPT's from/value keys, its role names
    (human, gpt, bot, function_call, observation...), ShareGPT pair rows ``{"human": q, "gpt": a}``, and the
    ``system`` column unless the messages open with their own."""
    messages = _parse_text(messages, "'messages'", where, index)
    if not isinstance(messages, list) or not messages:
        raise DatasetError(f"{where}: row {index}: 'messages' must be a non-empty list of {{role, content}} objects")
    out: list[dict[str, Any]] = []
    for m in messages:
        if not isinstance(m, dict):
            raise DatasetError(f"{where}: row {index}: each message needs 'role' and 'content', got {m!r:.80}")
        m = dict(m)
        for std, keys in (("role", ("role", "from")), ("content", ("content", "value"))):
            for key in keys:
                if key in m and std not in m:
                    m[std] = m.pop(key)
        out.append(m)
    if "role" not in out[0] and "content" not in out[0]:  # ShareGPT pairs: [{"human": q, "gpt": a}, ...]
        pairs = out
        out = []
        for pair in pairs:
            user = next((pair[k] for k in _USER_ROLES if k in pair), None)
            reply = next((pair[k] for k in _ASSISTANT_ROLES if k in pair), None)
            out += [{"role": "user", "content": user}] + ([{"role": "assistant", "content": reply}] if reply else [])
    for m in out:
        if "role" not in m or "content" not in m:
            raise DatasetError(f"{where}: row {index}: each message needs 'role' and 'content', got {m!r:.80}")
        role = str(m["role"]).replace("-", "_")
        if role in _USER_ROLES:
            m["role"] = "user"
        elif role in _ASSISTANT_ROLES or role in _TOOL_CALL_ROLES:
            m["role"] = "assistant"  # a tool call is the assistant's turn as chat templates render it
        elif role in _TOOL_RESPONSE_ROLES:
            m["role"] = "tool"
    if system is not None and out[0]["role"] != "system":
        out.insert(0, {"role": "system", "content": str(system)})
    return out


def _history_messages(row: dict[str, Any], where: str, index: int) -> list[dict[str, Any]]:
    """ms-swift's ``ResponsePreprocessor``: ``system``, ``history`` ([[query, response], ...]), ``query``,
    ``response`` -> messages (a TRL conversational ``prompt``, already a message list, is taken as is)."""
    query, response = row.pop("query", None), row.pop("response", None)
    system = row.pop("system", None)
    if isinstance(response, list | tuple):  # ms-swift takes the first of several responses
        response = response[0] if response else None
    if isinstance(response, dict) and "content" in response:  # TRL's conversational completion: a message
        response = response["content"]
    history = _parse_text(row.pop("history", None) or [], "'history'", where, index)
    if isinstance(query, list) and query and all(isinstance(m, dict) for m in query):
        messages = _standard_messages(query, system, where, index)
        if response is not None:
            messages.append({"role": "assistant", "content": response})
        return messages
    messages: list[dict[str, Any]] = [] if system is None else [{"role": "system", "content": str(system)}]
    if not isinstance(history, list):
        raise DatasetError(f"{where}: row {index}: 'history' must be a list of [query, response] pairs")
    for pair in [*history, [query, response]]:
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            raise DatasetError(f"{where}: row {index}: 'history' must be a list of [query, response] pairs, "
                               f"got {pair!r:.80}")
        if pair[0] is not None:
            messages.append({"role": "user", "content": pair[0]})
        if pair[1] is not None:
            messages.append({"role": "assistant", "content": pair[1]})
    return messages


def _tools(value: Any, where: str, index: int) -> list[dict[str, Any]]:
    """A row's ``tools``: a list of JSON-schema dicts (or one), or the JSON text of them (ms-swift stores text)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{where}: row {index}: 'tools' is not valid JSON ({exc.msg}); it must be a list "
                               "of tool schemas ({\"type\": \"function\", \"function\": {...}})") from None
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(tool, dict) for tool in value):
        raise DatasetError(f"{where}: row {index}: 'tools' must be a list of tool schemas (JSON objects), got "
                           f"{type(value).__name__}")
    return value


def _normalize(
    row: dict[str, Any], kind: str, system: str | None, where: str, index: int, needs: Mapping[str, Sequence[str]],
    columns: list[str], *, base: Path | None = None, max_image_bytes: int | None = None,
) -> dict[str, Any]:
    """One mapped row (``map_columns``) -> ``{"messages", "solution"?, **other columns}``; ``columns``: the
    row's own column names, for the errors."""
    if kind == "messages":
        raw_messages = row.pop("messages", None)
        if raw_messages is None:
            raise DatasetError(f"{where}: row {index} has no 'messages' (columns: {', '.join(columns)})")
        messages = _check_messages(_standard_messages(raw_messages, row.pop("system", None), where, index),
                                   where, index)
    else:
        messages = _check_messages(_history_messages(row, where, index), where, index)
    reference: Any = None
    if messages and messages[-1]["role"] == "assistant":  # the reference answer: not part of the prompt
        reference = messages.pop()["content"]
    if system is not None and not (messages and messages[0]["role"] == "system"):
        messages.insert(0, {"role": "system", "content": system})
    if not any(m["role"] == "user" for m in messages):
        raise DatasetError(
            f"{where}: row {index} has no prompt: it needs a 'messages' column, or a query column (query, prompt, "
            f"question, problem, instruction, input) (columns: {', '.join(columns)}); rename yours with "
            + ('data.columns = {text = "query"} (a `text` column, as a .txt file\'s lines, is the response to '
               "ms-swift's mapping, which its --columns '{\"text\": \"query\"}' renames the same way)"
               if columns == ["text"] else 'data.columns = {your_column = "query"}')
        )
    if row.get("solution") is None and reference is not None:
        row["solution"] = reference
    for column, rewards in needs.items():
        if row.get(column) is None:
            who = " and ".join(repr(r) for r in rewards) if rewards else "a reward"
            raise DatasetError(
                f"{where}: row {index} has no {column!r} (columns: {', '.join(columns)}); the reward {who} needs it: "
                f'add the column, rename yours with data.columns = {{your_column = "{column}"}}'
                + (", or end each row's messages with the assistant's reference answer" if column == "solution" else "")
                + f", or drop {who} from reward.reward_funcs"
            )
    if row.get("tools") is not None:
        row["tools"] = _tools(row["tools"], where, index)
    else:
        row.pop("tools", None)
    if row.get("images") is not None or any(not isinstance(m["content"], str) or IMAGE_PLACEHOLDER in m["content"]
                                            for m in messages):
        messages, row["images"] = _images(messages, row.pop("images", None), where, index,
                                          base or Path.cwd(), max_image_bytes)
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
        content = m["content"]
        if isinstance(content, list):
            content = _check_parts(content, where, index)
        else:
            content = "" if content is None else str(content)
        out.append({"role": str(m["role"]), "content": content})
    return out


# ---------------------------------------------------------------- images (ms-swift's multimodal rows)

IMAGE_PLACEHOLDER = "<image>"
DEFAULT_MAX_IMAGE_BYTES = 8 * 1024 * 1024


def _check_parts(parts: list[Any], where: str, index: int) -> list[dict[str, Any]]:
    """A content list: ``{"type": "text", "text": ...}`` and ``{"type": "image"}`` (optionally with its own
    ``image``: a path or bytes, as transformers' chat format)."""
    out = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            out.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind == "image":
            out.append({k: v for k, v in part.items() if k in ("type", "image")})
        else:
            raise DatasetError(
                f"{where}: row {index}: a content part must be {{\"type\": \"text\", \"text\": ...}} or "
                f"{{\"type\": \"image\"}}, got {part!r:.80}"
            )
    return out


def _images(
    messages: list[dict[str, Any]], column: Any, where: str, index: int, base: Path, max_image_bytes: int | None
) -> tuple[list[dict[str, Any]], list[bytes]]:
    """ms-swift's two forms, to content lists + image bytes in order of appearance: string contents with
    ``<image>`` placeholders plus an ``images`` column (paths or bytes), or content lists whose image
    parts are matched, in order, with the ``images`` column (or carry their own ``image``)."""
    sources = [] if column is None else list(column) if isinstance(column, list | tuple) else [column]
    out, placeholders, own = [], 0, []
    for m in messages:
        content = m["content"]
        if isinstance(content, str):
            if IMAGE_PLACEHOLDER not in content:
                out.append(m)
                continue
            parts: list[dict[str, Any]] = []
            for k, text in enumerate(content.split(IMAGE_PLACEHOLDER)):
                if k:
                    parts.append({"type": "image"})
                if text:
                    parts.append({"type": "text", "text": text})
            content = parts
        new_parts = []
        for part in content:
            if part["type"] == "image":
                placeholders += 1
                if "image" in part:
                    own.append(part["image"])
                new_parts.append({"type": "image"})
            else:
                new_parts.append(part)
        out.append({"role": m["role"], "content": new_parts})
    if own and not sources:
        sources = own
    if placeholders != len(sources):
        raise DatasetError(
            f"{where}: row {index} has {placeholders} image placeholder(s) (<image> or {{\"type\": \"image\"}}) "
            f"but {len(sources)} image(s) in its 'images' column; they must match one to one"
        )
    limit = DEFAULT_MAX_IMAGE_BYTES if max_image_bytes is None else max_image_bytes
    return out, [_image_bytes(source, where, index, k, base, limit) for k, source in enumerate(sources)]


def _image_bytes(source: Any, where: str, index: int, k: int, base: Path, limit: int) -> bytes:
    """One image as its file's bytes (a path, relative to the dataset's directory; bytes; or a
    ``{"bytes", "path"}`` dict as HF datasets store images), checked to decode and to fit ``limit``."""
    name = f"{where}: row {index}, image {k}"
    if isinstance(source, dict):
        source = source.get("bytes") or source.get("path")
    if isinstance(source, bytes | bytearray):
        data = bytes(source)
    elif isinstance(source, str) and source:
        path = Path(source).expanduser()
        path = path if path.is_absolute() or not (base / path).exists() else base / path
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise DatasetError(f"{name}: cannot read {source!r} ({exc.strerror or exc})") from None
    else:
        raise DatasetError(f"{name}: expected a file path or bytes, got {type(source).__name__}")
    if len(data) > limit:
        raise DatasetError(
            f"{name}: {len(data):,} bytes is over data.max_image_bytes = {limit:,}; shrink it or raise the limit"
        )
    try:
        from PIL import Image

        with Image.open(io.BytesIO(data)) as image:
            image.verify()
    except Exception as exc:  # noqa: BLE001 - PIL raises many types for a bad file; all mean the same here
        raise DatasetError(f"{name}: not a readable image ({type(exc).__name__}: {_one_line(exc)})") from None
    return data


def prompt_key(row: dict[str, Any]) -> str:
    """What makes two rows the same prompt: their messages (system prompt included) and images."""
    key = json.dumps(row["messages"], sort_keys=True, ensure_ascii=False)
    if row.get("images"):
        key += "".join(hashlib.sha256(image).hexdigest() for image in row["images"])
    return key


def split_dataset(
    rows: list[dict[str, Any]], ratio: float, seed: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Pure: ``(train, held_out)``, ms-swift's ``split_dataset_ratio``, by prompt instead of by row.

    ``round(ratio * distinct prompts)`` distinct prompts, drawn by ``random.Random(seed)``, are held out
    with every row that carries them, so no prompt is on both sides (a built-in task repeats prompts).
    Both sides keep the rows' original order. Raises DatasetError when either side would be empty.
    """
    if not 0 < ratio < 1:
        raise DatasetError(f"data.split_dataset_ratio={ratio} must be in (0, 1) to split")
    keys = list(dict.fromkeys(prompt_key(row) for row in rows))
    count = round(ratio * len(keys))
    if count == 0 or count == len(keys):
        side = "held-out" if count == 0 else "train"
        raise DatasetError(
            f"data.split_dataset_ratio={ratio} leaves the {side} set empty: the dataset has {len(keys)} distinct "
            f"prompts, and {ratio} of them rounds to {count}; choose a ratio between {0.5 / len(keys):.3g} and "
            f"{1 - 0.5 / len(keys):.3g}, or give data.val_dataset"
        )
    held = set(random.Random(seed).sample(keys, count))
    train = [row for row in rows if prompt_key(row) not in held]
    held_out = [row for row in rows if prompt_key(row) in held]
    return train, held_out


# ------------------------------------------------------------------------------------- a run's data


def load_rows(cfg: Config) -> list[dict[str, Any]]:
    """The train set: the dataset, less the prompts ``data.split_dataset_ratio`` holds out."""
    return load_splits(cfg)[0]


def load_eval_rows(cfg: Config) -> list[dict[str, Any]]:
    """The held-out prompts (``data.val_dataset``, or the split of the train set), each once (the first
    row that carries it: a built-in task repeats prompts), at most ``eval.eval_limit``; raises
    DatasetError when there are none."""
    first: dict[str, dict[str, Any]] = {}
    for row in load_splits(cfg)[1]:
        first.setdefault(prompt_key(row), row)
    rows = list(first.values())
    if not rows:
        raise DatasetError(
            "evaluation is on but there is no held-out data: set data.val_dataset or data.split_dataset_ratio"
        )
    limit = cfg.eval.eval_limit
    return rows[:limit] if limit else rows


def load_splits(cfg: Config) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(train rows, held-out rows)``; the held-out side is [] without data.val_dataset or a split."""
    d = cfg.data
    seed = d.data_seed if d.data_seed is not None else cfg.run.seed
    common: dict[str, Any] = {
        "columns": dict(d.columns), "system": system_prompt(d.system), "needs": reward_needs(cfg),
        "max_image_bytes": d.max_image_bytes, "use_hf": cfg.model.use_hf,
        "auto_columns": not d.disable_auto_column_mapping,
    }
    env = verifiers_env(d)
    if env is not None:  # a verifiers environment's taskset (its own venv lists it: schedulers/verifiers.py)
        try:
            rows = [{"messages": row["prompt"], TASK_KEY: row[TASK_KEY]}
                    for row in load_tasks(cfg.rollout.verifiers_python, env, dict(cfg.rollout.verifiers_taskset))]
        except VerifiersError as exc:
            raise DatasetError(f"data.dataset = {d.dataset!r}: {exc}") from None
    else:
        rows = load_dataset(d.dataset, builtin_size=d.dataset_size, seed=seed, shuffle=d.dataset_shuffle,
                            split=d.split, **common)
    if d.val_dataset is not None:
        val = load_dataset(d.val_dataset, seed=seed + 1, split=d.val_split, validation=True,
                           field="data.val_dataset", **common)
        return rows, val
    if d.split_dataset_ratio > 0:
        return split_dataset(rows, d.split_dataset_ratio, seed)
    return rows, []


def reward_needs(cfg: Config) -> dict[str, list[str]]:
    """``{column: [reward names]}``: the columns the run's reward functions need in every row (load the
    plugins first: a plugin's reward declares its own)."""
    needs: dict[str, list[str]] = {}
    for name in cfg.reward.reward_funcs:
        for column in required_columns(name):
            needs.setdefault(column, []).append(name)
    return needs


def system_prompt(value: str | None) -> str | None:
    """``data.system`` as ms-swift's ``--system`` reads it: a path ending in .txt is the file's text; else the
    string, with a literal ``\\n`` as a newline."""
    if value is None or not value.endswith(".txt"):
        return None if value is None else value.replace("\\n", "\n")
    try:
        return Path(value).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(
            f"data.system = {value!r}: a system prompt ending in .txt is read from that file (as ms-swift's "
            f"--system), and it cannot be read ({exc}); fix the path, or give the prompt text itself"
        ) from None

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
import hashlib
import io
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.config import Config
from pipeline.errors import UserError

# The built-in task: single-digit addition, which the ~0.4 M-parameter tiny model can learn on CPU
# in minutes. The tiny model's tokenizer and warm start are built from the same generator.
ARITHMETIC_MAX_OPERAND = 9
DEFAULT_BUILTIN_SIZE = 1000

_PROMPT_KEYS = ("prompt", "query")
_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


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
    "guess_number": guess_number_rows,
    "shapes": shapes_rows,
}


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
    require_solution: bool = True,
    max_image_bytes: int | None = None,
) -> list[dict[str, Any]]:
    """Rows ready for the feeder: ``{"messages": [...], "solution": ..., **other columns}``.

    ``spec`` is a built-in name (``"arithmetic"``) or a local ``.jsonl`` / ``.json`` / ``.parquet``
    path, optionally with ``#N``. ``size`` (or ``#N``, which wins) > 0 takes a seeded sample of that many
    rows (repeating the data when it has fewer, as ms-swift); for built-ins it is the number generated
    (default 1000). ``columns`` renames the file's columns first (``{"answer": "solution"}``).
    ``require_solution = False`` (environment rollouts, which the env scores) accepts rows without one.
    Rows with images (ms-swift's multimodal forms, see ``_images``) come out with content-list messages and
    ``images`` = the images' bytes; ``max_image_bytes`` caps each image's size.
    """
    spec = spec.strip()
    source, sep, count = spec.rpartition("#")
    if sep and count.isdigit():
        spec, size = source, int(count)
    base = Path.cwd()
    if spec in BUILTIN_DATASETS:
        rows = builtin_dataset(spec, size if size and size > 0 else DEFAULT_BUILTIN_SIZE, seed)
        where = f"built-in dataset {spec!r}"
    else:
        path = _resolve_path(spec)
        try:
            rows = _read_rows(path)
        except (OSError, UnicodeDecodeError) as exc:  # unreadable, or not UTF-8 text
            raise DatasetError(f"data.dataset = {spec!r}: cannot be read ({exc})") from None
        where = str(path)
        base = path.parent
        if size and size > 0:
            rows = _sample(rows, size, seed)
    if not rows:
        raise DatasetError(f"{where}: the dataset has no rows")
    columns = dict(columns or {})
    _check_mapping(rows, columns, where)
    return [
        _normalize(row, columns, system, where, index, require_solution, base=base, max_image_bytes=max_image_bytes)
        for index, row in enumerate(rows)
    ]


def _resolve_path(spec: str) -> Path:
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    hint = ""
    close = difflib.get_close_matches(spec, list(BUILTIN_DATASETS), n=1)
    if close:
        hint = f" (did you mean the built-in {close[0]!r}?)"
    raise DatasetError(
        f"data.dataset = {spec!r}: no such file{hint}; give a local {'/'.join(_FILE_SUFFIXES)} file "
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
    raw: dict[str, Any], columns: dict[str, str], system: str | None, where: str, index: int,
    require_solution: bool = True, *, base: Path | None = None, max_image_bytes: int | None = None,
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
    if row.get("solution") is None and (require_solution or reference is not None):
        if reference is None:
            raise DatasetError(
                f"{where}: row {index} has no 'solution' (columns: {', '.join(sorted(raw))}); the accuracy "
                f'reward needs one: map a column with data.columns = {{answer = "solution"}} or end each '
                f"row's messages with the assistant's reference answer"
            )
        row["solution"] = reference
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
        raise DatasetError(f"{name}: not a readable image ({type(exc).__name__}: {exc})") from None
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
    # Env rollouts are scored by the environment: their rows need no solution column (ms-swift's gym datasets).
    need_solution = not cfg.rollout.use_gym_env
    rows = load_dataset(
        d.dataset, columns=dict(d.columns), system=d.system, size=d.dataset_size, seed=seed,
        require_solution=need_solution, max_image_bytes=d.max_image_bytes,
    )
    if d.val_dataset is not None:
        val = load_dataset(
            d.val_dataset, columns=dict(d.columns), system=d.system, seed=seed + 1, require_solution=need_solution,
            max_image_bytes=d.max_image_bytes,
        )
        return rows, val
    if d.split_dataset_ratio > 0:
        return split_dataset(rows, d.split_dataset_ratio, seed)
    return rows, []

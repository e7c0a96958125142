"""Write tests/data_swift/swift_defaults.json: ms-swift's own argument defaults at a pinned release, read from
its source (tests/test_swift_defaults.py checks rollstream's defaults and the README's table against it).

    pip download ms-swift==3.12.6 transformers==4.57.6 --no-deps -d /tmp/swift
    python tests/data_swift/make_swift_defaults.py /tmp/swift/ms_swift-3.12.6-py3-none-any.whl \\
        /tmp/swift/transformers-4.57.6-py3-none-any.whl > tests/data_swift/swift_defaults.json

ms-swift's packages import torch, vLLM and the rest, so nothing is imported: the arguments dataclasses are
parsed (``ast``) out of the wheels, their bases followed as Python orders them (``RLHFArguments`` and the
transformers ``Seq2SeqTrainingArguments`` under it; transformers 4.57 is the newest ms-swift 3.12.6 allows), and
each field's default is the first class in that order that declares it, as ``dataclasses`` does.

``defaults`` are the dataclass fields' values; ``grpo`` are the values ms-swift's ``__post_init__`` puts where a
GRPO run leaves a field at None (``beta = 0.04``), each with the source line it was read from: the script
fails when that line is no longer in the source, so a new release cannot change one unseen.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
import sys
import zipfile
from pathlib import Path
from typing import Any

# What ms-swift's start-up does to a GRPO run's None defaults (RLHFArguments._init_grpo / _set_default /
# _init_max_completion_length, Seq2SeqTrainingOverrideArguments.__post_init__ / _init_eval_strategy), with the
# source each value is read from; None = "depends on other arguments", stated in ``why``.
GRPO_POST_INIT = [
    ("beta", 0.04, "swift/llm/argument/rlhf_args.py", r"if self\.beta is None:\s+self\.beta = 0\.04", ""),
    ("truncation_strategy", "left", "swift/llm/argument/rlhf_args.py",
     r"if self\.truncation_strategy is None:\s+self\.truncation_strategy = 'left'", ""),
    ("kl_in_reward", False, "swift/llm/argument/rlhf_args.py",
     r"if self\.advantage_estimator == 'grpo':\s+self\.kl_in_reward = False", "advantage_estimator grpo"),
    ("scale_rewards", "group", "swift/llm/argument/rlhf_args.py",
     r"if self\.advantage_estimator == 'grpo':\s+self\.scale_rewards = 'group'", "advantage_estimator grpo"),
    ("gradient_accumulation_steps", 1, "swift/llm/argument/rlhf_args.py",
     r"if self\.rlhf_type == 'grpo':\s+self\.gradient_accumulation_steps = 1", ""),
    ("loss_type", "grpo", "swift/llm/argument/rlhf_args.py",
     r"elif self\.rlhf_type == 'grpo':\s+self\.loss_type = 'grpo'", ""),
    ("learning_rate", None, "swift/llm/argument/train_args.py",
     r"if self\.train_type == 'full':\s+self\.learning_rate = 1e-5\s+else:\s+self\.learning_rate = 1e-4",
     "1e-5 under train_type full, 1e-4 otherwise"),
    ("eval_strategy", None, "swift/llm/argument/train_args.py",
     r"if self\.eval_strategy is None:\s+self\.eval_strategy = self\.save_strategy",
     "save_strategy's (steps), no when there is no validation data"),
    ("eval_steps", None, "swift/llm/argument/train_args.py",
     r"elif self\.eval_strategy == 'steps' and self\.eval_steps is None:\s+self\.eval_steps = self\.save_steps",
     "save_steps' (500)"),
    ("max_completion_length", 512, "swift/llm/argument/rlhf_args.py",
     r"max_completion_length = self\.response_length or self\.max_new_tokens or self\.max_completion_length", ""),
]
LEARNING_RATE = {"full": 1e-5, "lora": 1e-4}  # read with learning_rate's line above


def read_wheel(path: Path, prefixes: tuple[str, ...]) -> dict[str, str]:
    with zipfile.ZipFile(path) as wheel:
        return {name: wheel.read(name).decode() for name in wheel.namelist()
                if name.endswith(".py") and name.startswith(prefixes)}


def module_name(path: str) -> str:
    parts = path[:-3].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def literal(node: ast.AST, scope: dict[str, Any]) -> Any:
    """A default's value: a literal, a name assigned a literal earlier in the class body, list/dict factories."""
    if isinstance(node, ast.Name) and node.id in scope:
        return scope[node.id]
    if isinstance(node, ast.Name) and node.id in ("list", "dict"):
        return [] if node.id == "list" else {}
    if isinstance(node, ast.Lambda):
        return literal(node.body, scope)
    try:
        value = ast.literal_eval(node)
    except ValueError:
        return {"expr": ast.unparse(node)}
    return list(value) if isinstance(value, tuple) else value


def dataclass_fields(tree: ast.ClassDef) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    scope: dict[str, Any] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            name = stmt.targets[0].id
            if name not in scope:  # transformers: default_optim, then an override under an `if`
                scope[name] = literal(stmt.value, scope)
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        if "ClassVar" in ast.unparse(stmt.annotation):
            continue
        value = stmt.value
        if value is None:
            fields[stmt.target.id] = {"required": True}
            continue
        if isinstance(value, ast.Call) and ast.unparse(value.func) in ("field", "dataclasses.field"):
            keywords = {k.arg: k.value for k in value.keywords}
            if "init" in keywords and ast.unparse(keywords["init"]) == "False":
                continue  # not an argument (transformers' _n_gpu)
            if "default" in keywords:
                fields[stmt.target.id] = literal(keywords["default"], scope)
            elif "default_factory" in keywords:
                fields[stmt.target.id] = literal(keywords["default_factory"], scope)
            else:
                fields[stmt.target.id] = {"required": True}
            continue
        fields[stmt.target.id] = literal(value, scope)
    return fields


def main(swift_wheel: Path, transformers_wheel: Path) -> dict[str, Any]:
    sources = read_wheel(swift_wheel, ("swift/llm/argument/", "swift/trainers/arguments.py", "swift/version.py"))
    sources |= read_wheel(transformers_wheel, ("transformers/training_args.py", "transformers/training_args_seq2seq.py"))
    version = re.search(r"__version__ = '([^']+)'", sources["swift/version.py"])[1]
    classes: dict[tuple[str, str], ast.ClassDef] = {}
    imports: dict[str, dict[str, tuple[str, str]]] = {}
    for path, text in sources.items():
        module = module_name(path)
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        imports[module] = {}
        for node in ast.parse(text).body:
            if isinstance(node, ast.ClassDef):
                classes[(module, node.name)] = node
            elif isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                source = f"{base}.{node.module}" if node.level and node.module else base if node.level else node.module
                for alias in node.names:
                    imports[module][alias.asname or alias.name] = (source, alias.name)

    def resolve(module: str, name: str) -> tuple[str, str]:
        if (module, name) in classes:
            return module, name
        source, original = imports[module][name]
        found = [key for key in classes if key[1] == original and key[0].startswith(source)]
        if len(found) != 1:
            raise SystemExit(f"{module}: base {name} (from {source}) resolves to {found}; read the imports by hand")
        return found[0]

    made: dict[tuple[str, str], type] = {}

    def make(key: tuple[str, str]) -> type:  # a stand-in class per dataclass, for Python's own base order
        if key not in made:
            bases = tuple(make(resolve(key[0], ast.unparse(b).split(".")[-1])) for b in classes[key].bases
                          if ast.unparse(b) not in ("object", "ExplicitEnum", "Enum"))
            made[key] = type(key[1], bases or (object,), {"key": key})
        return made[key]

    root = make(("swift.llm.argument.rlhf_args", "RLHFArguments"))
    defaults: dict[str, Any] = {}
    for cls in root.__mro__[:-1]:
        for name, value in dataclass_fields(classes[cls.key]).items():
            defaults.setdefault(name, value)
    grpo = {}
    for name, value, path, pattern, why in GRPO_POST_INIT:
        match = re.search(pattern, sources[path])
        if match is None:
            raise SystemExit(f"{name}: {path} no longer has {pattern!r}; read the new rule and update GRPO_POST_INIT")
        grpo[name] = {"value": value, "why": why, "source": f"{path}: {' '.join(match[0].split())}"}
    return {
        "ms_swift": version,
        "transformers": re.search(r"transformers-([\d.]+)-", transformers_wheel.name)[1],
        "wheels": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (swift_wheel, transformers_wheel)},
        "class": "swift.llm.argument.rlhf_args.RLHFArguments, bases in Python's order: "
        + " > ".join(c.__name__ for c in root.__mro__[1:-1]),
        "learning_rate": LEARNING_RATE,
        "grpo": grpo,
        "defaults": dict(sorted(defaults.items())),
    }


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    snapshot = main(Path(sys.argv[1]), Path(sys.argv[2]))
    head = {k: v for k, v in snapshot.items() if k != "defaults"}
    text = json.dumps(head, indent=1)[:-2] + ',\n "defaults": {\n'  # one argument a line: readable diffs
    text += ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in snapshot["defaults"].items())
    print(text + "\n }\n}")

"""The layout keeps its layers: every import points down, and no module imports itself back in a circle.

framework (pipeline) -> configuration (config) -> algorithm and data (grpo, rewards, schedulers, data) ->
engines, trainer, weights and tiny models -> stage shells -> application (rollstream). Read from the source with ``ast``, so a function-local import counts as much as a
top-level one (a local import hides a circle from Python, not from this test).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {
    "pipeline": 1, "ops": 1,
    "config": 2,
    "grpo": 3, "rewards": 3, "schedulers": 3, "data": 3,
    "engines": 4, "trainer": 4, "tinymodels": 4, "weights": 4,
    "stages": 5,
    "rollstream": 6,
}


def _modules() -> dict[str, Path]:
    found = {}
    for package in LAYERS:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts).removesuffix(".__init__")] = path
    return found


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports (resolved to the longest known module name)."""

    def known(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    edges: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # each name resolves to the longest known module: a submodule (from config import swift_args)
                # or the package itself (from config import Config)
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            targets |= {known(n) for n in names if n.split(".")[0] in LAYERS}
        edges[module] = targets - {"", module}
    return edges


def test_every_import_points_down():
    edges = _imports(_modules())
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in edges.items()
        for target in targets
        if LAYERS[target.split(".")[0]] > LAYERS[module.split(".")[0]]
    )
    assert upward == [], "imports that point up a layer:\n" + "\n".join(upward)


def test_no_import_circle():
    edges = _imports(_modules())
    circles = []
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(edges.get(module, ())):
            if state.get(target) == 1:
                circles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module)
    assert circles == [], "import circles:\n" + "\n".join(circles)


def test_the_worker_extension_imports_nothing_of_the_stages():
    """vLLM's engine process imports the worker extension: it must not pull in a stage (or the trainer)."""
    edges = _imports(_modules())
    seen, todo = set(), ["engines.weight_loader"]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(edges.get(module, ()))
    assert not {m for m in seen if m.split(".")[0] in ("stages", "trainer", "rollstream")}, sorted(seen)

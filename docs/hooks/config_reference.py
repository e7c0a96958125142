"""mkdocs hook: the configuration reference page, generated at build time from ``config/schema.py``.

Every section of ``Config`` is a msgspec Struct whose fields carry their documentation as the string
literal under each field (and ``# ...`` comment lines above a group of fields). Python keeps neither at
run time, so the page is built from the module's syntax tree: it can never disagree with the schema.

``python docs/hooks/config_reference.py`` prints the page.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "config" / "schema.py"
PAGE = "configuration-reference.md"


def _aliases(tree: ast.Module, source: str) -> dict[str, str]:
    """Module-level type aliases (``PositiveInt = Annotated[int, Meta(ge=1)]``) -> their source text."""
    out = {}
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Subscript)
        ):
            out[node.targets[0].id] = ast.get_source_segment(source, node.value) or ""
    return out


def _comments(source: str) -> dict[int, str]:
    """Line number -> the text of a comment that is alone on its line."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and not tok.line[: tok.start[1]].strip():
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def _formulas(tree: ast.Module) -> dict[str, str]:
    """``FORMULAS``: how a value left unset is derived ("section.field" -> text)."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "FORMULAS" for t in node.targets):
            return ast.literal_eval(node.value)
    return {}


def _cell(text: str) -> str:
    """One Markdown table cell: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def render(config_py: Path = CONFIG) -> str:
    source = config_py.read_text()
    tree = ast.parse(source)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    comments = _comments(source)
    formulas = _formulas(tree)
    aliases = _aliases(tree, source)
    sections = [  # Config's fields, in order: section name -> its Struct
        (item.target.id, ast.unparse(item.annotation))
        for item in classes["Config"].body
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
    ]
    lines = [
        "# Configuration reference",
        "",
        "<!-- generated at build time by docs/hooks/config_reference.py from config/schema.py; edit there -->",
        "",
        "One TOML file, one table per section; every field below can also be set on the command line with",
        "`--set section.field=value`. An unknown key is an error naming the nearest valid one; a value out of",
        "range is an error naming the range. Fields marked *derived when unset* are filled in at load time",
        "(`rollstream config show -c FILE` prints every resolved value). The field documentation below is the",
        "schema's own (`config/schema.py`), generated when the site is built.",
        "",
        "Range types used below:",
        "",
        "| type | meaning |",
        "|---|---|",
    ]
    lines += [f"| `{name}` | `{_cell(text)}` |" for name, text in aliases.items()]
    for section, struct in sections:
        cls = classes[struct]
        lines += ["", f"## [{section}]", ""]
        doc = ast.get_docstring(cls)
        if doc:
            lines += [" ".join(doc.split()), ""]
        rows_open = False
        body = cls.body
        for index, item in enumerate(body):
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            after = body[index - 1].end_lineno if index else cls.lineno
            group = [comments[n] for n in range(after + 1, item.lineno) if n in comments]
            if group:  # a "# Sampling." line above a run of fields: a sub-heading
                lines += ["", f"**{group[-1].rstrip('.')}**", ""]
                rows_open = False
            if not rows_open:
                lines += ["| field | type | default | meaning |", "|---|---|---|---|"]
                rows_open = True
            name = item.target.id
            nxt = body[index + 1] if index + 1 < len(body) else None
            doc = (
                nxt.value.value
                if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)
                else ""
            )
            default = ast.get_source_segment(source, item.value) if item.value is not None else "required"
            default = "(derived)" if default == "DERIVED" else default  # see the schema's DERIVED
            derived = formulas.get(f"{section}.{name}")
            if derived:
                doc += f" *Derived when unset: {derived}.*"
            lines.append(
                f"| `{name}` | `{_cell(ast.unparse(item.annotation))}` | `{_cell(default or '')}` | {_cell(doc)} |"
            )
        derived_only = [  # read-only properties (grpo.prompt_batch_size, ...)
            item
            for item in cls.body
            if isinstance(item, ast.FunctionDef) and any(ast.unparse(d) == "property" for d in item.decorator_list)
        ]
        if derived_only:
            lines += ["", "Read-only (derived, not settable):", ""]
            lines += [f"- `{section}.{f.name}`: {' '.join((ast.get_docstring(f) or '').split())}" for f in derived_only]
    text = "\n".join(lines) + "\n"
    while "\n\n\n" in text:
        text = text.replace("\n\n\n", "\n\n")
    return text


def on_files(files, config):  # mkdocs calls it with its Files and config; it imports mkdocs only then
    from mkdocs.structure.files import File

    files.append(File.generated(config, PAGE, content=render()))
    return files


if __name__ == "__main__":
    print(render(), end="")

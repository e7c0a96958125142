"""The docs stay true to what generates them: the README is a first screen that names the two commands and
links only to files that exist; docs/performance.md is what bench/report.py renders from bench/results now;
the generated configuration reference documents every field of the config schema."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from config import FIELDS, SECTIONS

ROOT = Path(__file__).resolve().parents[1]
README_LIMIT_BYTES = 12 * 1024


def load(path: Path):
    """A script that is not part of a package (bench/, docs/hooks/), imported by its path."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_is_a_first_screen_with_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_bytes()
    assert len(readme) <= README_LIMIT_BYTES, f"README.md is {len(readme)} bytes; the manual belongs in docs/"
    text = readme.decode()
    assert re.search(r"^make demo\b", text, re.MULTILINE) and re.search(r"^make test\b", text, re.MULTILINE)


def test_readme_links_resolve() -> None:
    text = (ROOT / "README.md").read_text()
    targets = [t for t in re.findall(r"\]\(([^)#\s]+)", text) if "://" not in t]
    assert targets
    assert [t for t in targets if not (ROOT / t).exists()] == []


def test_performance_page_is_current() -> None:
    report = load(ROOT / "bench" / "report.py")
    files = report.load_results(report.RESULTS)
    png = (report.RESULTS / "accuracy_vs_wall.png").exists()
    expected = report.performance_page(files, png=png)
    assert report.PERFORMANCE_PAGE.read_text() == expected, "stale: run `make docs-performance`"
    if png:
        assert (report.PERFORMANCE_PAGE.parent / report.PAGE_PNG).read_bytes() == (
            report.RESULTS / "accuracy_vs_wall.png"
        ).read_bytes()


def test_configuration_reference_documents_every_field() -> None:
    page = load(ROOT / "docs" / "hooks" / "config_reference.py").render()
    headings = re.findall(r"^## \[(\w+)\]$", page, re.MULTILINE)
    assert headings == list(SECTIONS)
    for section, fields in FIELDS.items():
        body = page.split(f"## [{section}]", 1)[1].split("\n## [", 1)[0]
        cells = [re.split(r"(?<!\\)\|", line)[1:-1] for line in body.splitlines() if line.startswith("| `")]
        rows = {cell[0].strip().strip("`"): cell[3] for cell in cells}
        assert set(rows) == set(fields), section
        assert [name for name, doc in rows.items() if not doc.strip()] == [], f"[{section}] fields without a docstring"

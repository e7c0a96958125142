"""The one way a bench script reports: JSON on stdout, and the same text in a file with --json-out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(results: Any, json_out: str | Path | None) -> None:
    text = json.dumps(results, indent=2)
    print(text)
    if json_out:
        path = Path(json_out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")

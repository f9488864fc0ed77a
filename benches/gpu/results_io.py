"""Reading a bench folder's records: what the report scripts share. Standard library only."""

from __future__ import annotations

import json
from pathlib import Path

GIB = 2**30


def lines(path: Path) -> list[dict]:
    """The JSON objects of a JSON-lines file, skipping lines that are not one; [] if absent."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def load(path: Path):
    """A JSON document, or None when it is absent or not JSON."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None

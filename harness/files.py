"""Small file helpers shared by the run directory's writers."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomically(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` so that a reader (or a crash) sees the old file or the
    new one, never half of one: a temporary name of this process, then a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path

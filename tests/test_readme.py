"""The README's generated tables (configuration reference, failure classes) match the code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_tables_are_up_to_date() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "update_readme.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_every_config_key_and_failure_class_is_in_the_readme() -> None:
    from harness.config import describe
    from harness.failures import FAILURE_CLASSES

    readme = (ROOT / "README.md").read_text()
    assert all(f"| `{key}` |" in readme for key, *_ in describe())
    assert all(c.what in readme for c in FAILURE_CLASSES)

#!/usr/bin/env python3
"""Regenerate the README's tables that come from the code: the configuration
reference (``harness.config.describe``) and the failure classes
(``harness.failures.FAILURE_CLASSES``). Each sits between marker comments.

    python scripts/update_readme.py           rewrite README.md in place
    python scripts/update_readme.py --check   exit 1 if README.md is out of date (tests run this)
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.config import describe  # noqa: E402
from harness.failures import markdown_table  # noqa: E402


def config_table() -> str:
    lines = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for key, type_name, default, doc in describe():
        lines.append(f"| `{key}` | {type_name.replace('|', 'or')} | `{default}` | {doc.replace('|', 'or')} |")
    return "\n".join(lines)


TABLES = {"config-reference": config_table, "failure-classes": markdown_table}


def render(text: str) -> str:
    for name, make in TABLES.items():
        pattern = re.compile(rf"(<!-- {name} -->)\n.*?(<!-- /{name} -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"README.md has no <!-- {name} --> ... <!-- /{name} --> markers")
        text = pattern.sub(lambda m: f"{m.group(1)}\n{make()}\n{m.group(2)}", text)
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check; exit 1 when out of date")
    args = parser.parse_args()
    path = ROOT / "README.md"
    old = path.read_text()
    new = render(old)
    if args.check:
        if new != old:
            print("README.md is out of date; run: python scripts/update_readme.py", file=sys.stderr)
            return 1
        return 0
    path.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Smoke run of scripts/soak.py: a short median sweep with actor kills, sandbox kills and
hanging graders injected; it must end with every episode one row, nothing leaked."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from harness_fixtures import needs_sandbox

ROOT = Path(__file__).resolve().parents[1]


def _figure(out: str, label: str) -> int:
    m = re.search(rf"^{re.escape(label)}\s+(\d+)", out, re.MULTILINE)
    assert m, f"{label!r} missing from the soak's output:\n{out}"
    return int(m.group(1))


@needs_sandbox
def test_quick_soak_loses_nothing_and_leaks_nothing() -> None:
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "soak.py"), "--quick", "--episodes", "36",
                        "--fault-every", "1", "--seed", "7"],
                       capture_output=True, text=True, timeout=240, cwd=ROOT, check=False)
    out = p.stdout
    assert p.returncode == 0, f"exit {p.returncode}\n{out}\n{p.stderr[-3000:]}"
    assert _figure(out, "episodes expected") == 36
    assert _figure(out, "rows written") == 36
    assert _figure(out, "unique episode ids") == 36
    assert _figure(out, "duplicates") == 0
    assert _figure(out, "lost (expected ids without a row)") == 0
    for kind in ("actor", "sandbox", "grade"):
        assert _figure(out, f"faults injected: {kind}") >= 1, out
    for label in ("leaked sandboxes after run (live jails)", "leaked sandbox records after run",
                  "leaked mounts after run (besides run tmpfs)", "leaked processes after run (state dir)",
                  "leaked child processes after run (Ray...)", "leaked cgroups after run",
                  "leaked tmpfs dirs after run (uppers, fork layers)",
                  "left after provider.shutdown()"):
        assert _figure(out, label) == 0, out
    assert _figure(out, "rows: grade timeout (NOT planted)") == 0, out
    assert "soak: PASS: lost 0, duplicated 0, leaked 0" in out

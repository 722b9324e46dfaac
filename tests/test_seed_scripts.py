"""The seed's own build and episode scripts (scripts/seed/, from ../shared/seed/ with
`sbx` replaced by `harness sandbox`) run unchanged and give the seed's results.

The build pip-installs pytest inside the sandbox through its outbound network, so
this test needs PyPI, as the seed does (reachable here and in CI)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEED = ROOT / "scripts" / "seed"
ID = r"sb_[a-z0-9]{10}"


def test_seed_build_and_episodes(tmp_path, state_dir, local_provider):
    snap = f"aeo-rl-env-v1-{uuid.uuid4().hex[:6]}"  # the seed's name, unique per run
    env = {k: v for k, v in os.environ.items() if not k.startswith("HARNESS_SANDBOX_")}
    env.update(
        HARNESS_HOME=str(state_dir),
        PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}",
        SNAP=snap,
    )
    env.pop("SBX", None)
    src = None
    try:
        build = subprocess.run([str(SEED / "build.sh")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
        src_file = tmp_path / "src.id"
        src = src_file.read_text().strip() if src_file.exists() else None
        assert build.returncode == 0, build.stderr
        assert re.fullmatch(ID, src or ""), src
        lines = build.stdout.splitlines()
        assert "pytest 8.3.3" in lines
        baseline = json.loads(next(line for line in lines if line.startswith('{"passed"')))
        assert (baseline["passed"], baseline["failed"], baseline["reward"]) == (2, 2, 0.5)
        record = json.loads(lines[-1])
        assert record["ok"] is True and record["type"] == "snapshot.named.info"
        assert (record["snapshot"]["name"], record["snapshot"]["sourceSandboxId"]) == (snap, src)
        assert record["snapshot"]["status"] == "ready"

        episodes = subprocess.run([str(SEED / "episodes.sh")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert episodes.returncode == 0, episodes.stderr
        assert episodes.stderr == "", episodes.stderr
        out = episodes.stdout.splitlines()

        rows = (tmp_path / "results.txt").read_text().splitlines()
        assert rows[0] == "episode method id startSeconds policy result"
        assert len(rows) == 4, rows
        expected = [("1", "new--from", "0", 0.75), ("2", "new--from", "1", 1.0), ("3", "fork", "2", 1.0)]
        ids = []
        for row, (ep, method, policy, reward) in zip(rows[1:], expected):
            fields = row.split(" ", 5)
            assert (fields[0], fields[1], fields[4]) == (ep, method, policy), row
            assert re.fullmatch(ID, fields[2]) and fields[2] != src, row
            assert float(fields[3]) > 0
            result = json.loads(fields[5])
            assert result["reward"] == reward, row
            assert result["passed"] + result["failed"] == 4
            ids.append(fields[2])
        assert len(set(ids)) == 3

        # Per episode: "clean-start", the info line, "deleted <id>"; then results.txt again.
        for ep, sandbox_id in enumerate(ids, start=1):
            i = out.index("clean-start", 3 * (ep - 1))
            info = json.loads(out[i + 1])
            assert info["name"] == f"aeo-rl-ep{ep}"
            assert info["memoryRestored"] is False
            assert info["resumedFrom"] == (src if ep == 3 else None)
            assert out[i + 2] == f"deleted {sandbox_id}"
        assert out.count("clean-start") == 3
        assert out[-4:] == rows
        live = {i.id for i in local_provider.list()}
        assert not live & set(ids), "an episode's sandbox was not deleted"
        assert src in live
    finally:
        if src and src in {i.id for i in local_provider.list()}:
            local_provider.get(src).delete()
        if snap in {s.name for s in local_provider.snapshots()}:
            local_provider.delete_snapshot(snap)

"""The `harness sandbox` command, run as users run it: the installed console script
in a subprocess, with every verb the seed's scripts use, and its errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

HARNESS = Path(sys.executable).parent / "harness"
ID_RE = re.compile(r"^sb_[a-z0-9]{10}$")
INFO_KEYS = {"id", "name", "type", "status", "createdAt", "expiresAt", "fromSnapshot", "resumedFrom", "memoryRestored"}


class Cli:
    """Runs `harness sandbox ...` against the session's state directory and
    remembers what it created, so that the test can clean up in every outcome."""

    def __init__(self, state_dir: Path):
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("HARNESS_SANDBOX_")}
        self.env["HARNESS_HOME"] = str(state_dir)
        self.sandboxes: list[str] = []
        self.snapshots: list[str] = []

    def __call__(self, *args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(HARNESS), "sandbox", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env or self.env,
            stdin=subprocess.DEVNULL,
        )

    def ok(self, *args: str, **kwargs) -> subprocess.CompletedProcess:
        proc = self(*args, **kwargs)
        assert proc.returncode == 0, f"harness sandbox {' '.join(args)}: exit {proc.returncode}: {proc.stderr}"
        return proc

    def json(self, *args: str) -> dict:
        return json.loads(self.ok(*args).stdout)

    def track(self, sandbox_id: str) -> str:
        assert ID_RE.match(sandbox_id), sandbox_id
        self.sandboxes.append(sandbox_id)
        return sandbox_id


@pytest.fixture
def cli(state_dir, local_provider):
    c = Cli(state_dir)
    yield c
    live = {i.id for i in local_provider.list()}
    for sandbox_id in c.sandboxes:
        if sandbox_id in live:
            local_provider.get(sandbox_id).delete()
    existing = {s.name for s in local_provider.snapshots()}
    for name in c.snapshots:
        if name in existing:
            local_provider.delete_snapshot(name)


def test_seed_verbs_end_to_end(cli, local_provider):
    tag = uuid.uuid4().hex[:6]
    snap = f"cli-snap-{tag}"

    # new: prints only the id.
    new = cli.ok("new", "--name", f"cli-src-{tag}", "--type", "small", "--ttl", "3600")
    assert new.stdout.count("\n") == 1 and new.stderr == ""
    src = cli.track(new.stdout.strip())
    assert src in {i.id for i in local_provider.list()}

    # exec: both streams passed through, the command's exit code is the CLI's.
    proc = cli("exec", src, "echo out; echo err >&2; exit 3")
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "out\n", "err\n")
    cli.ok("exec", src, "echo hi > ~/f && mkdir -p ~/d && echo deep > ~/d/g")

    # exec --timeout: killed, exit 124, one line saying so.
    started = time.monotonic()
    proc = cli("exec", src, "--timeout", "1", "sleep 5")
    assert proc.returncode == 124
    assert time.monotonic() - started < 4.5
    assert len(proc.stderr.splitlines()) == 1 and "timed out" in proc.stderr

    # info of a fresh sandbox.
    info = cli.json("info", src)
    assert INFO_KEYS <= set(info)
    assert (info["id"], info["name"], info["type"], info["status"]) == (src, f"cli-src-{tag}", "small", "running")
    assert info["fromSnapshot"] is None and info["resumedFrom"] is None and info["memoryRestored"] is False
    assert info["expiresAt"] == pytest.approx(info["createdAt"] + 3600, abs=1)
    assert info["createdAt"] == pytest.approx(time.time(), abs=120)

    # snapshot: the seed's record.
    out = cli.json("snapshot", src, snap)
    cli.snapshots.append(snap)
    assert out["ok"] is True and out["type"] == "snapshot.named.info"
    record = out["snapshot"]
    assert {"name", "sizeBytes", "snapshotId", "sourceSandboxId", "status", "type"} <= set(record)
    assert (record["name"], record["sourceSandboxId"], record["status"], record["type"]) == (snap, src, "ready", "small")
    assert isinstance(record["sizeBytes"], int) and record["sizeBytes"] >= len("hi\ndeep\n")
    assert record["snapshotId"]

    # new --from --json: JSON lines, one per event, the last one "ready" with the id.
    proc = cli.ok("new", "--from", snap, "--name", f"cli-ep-{tag}", "--type", "small", "--ttl", "600", "--json")
    events = [json.loads(line) for line in proc.stdout.splitlines()]
    assert events and events[-1]["event"] == "ready"
    child = cli.track(events[-1]["id"])
    assert cli.ok("exec", child, "cat ~/f ~/d/g").stdout == "hi\ndeep\n"
    info = cli.json("info", child)
    assert (info["name"], info["fromSnapshot"], info["resumedFrom"], info["memoryRestored"]) == (f"cli-ep-{tag}", snap, None, False)
    assert info["expiresAt"] == pytest.approx(info["createdAt"] + 600, abs=1)

    # fork --wait --json: one JSON object with the id; then rename it.
    proc = cli.ok("fork", src, "--type", "small", "--ttl", "600", "--wait", "--json")
    fork = cli.track(json.loads(proc.stdout)["id"])
    assert fork not in (src, child)
    cli.ok("rename", fork, "--name", f"cli-fork-{tag}")
    info = cli.json("info", fork)
    assert (info["name"], info["resumedFrom"], info["memoryRestored"]) == (f"cli-fork-{tag}", src, False)
    assert cli.ok("exec", fork, "cat ~/f && echo forked > ~/f").stdout == "hi\n"
    assert cli.ok("exec", src, "cat ~/f").stdout == "hi\n"

    # ls and snapshots list what exists.
    listing = cli.ok("ls").stdout
    for sandbox_id, name in ((src, "cli-src"), (child, "cli-ep"), (fork, "cli-fork")):
        assert re.search(rf"^{sandbox_id}\s+{name}-{tag}\s", listing, re.M), listing
    assert snap in cli.ok("snapshots").stdout
    assert {src, child, fork} <= {i["id"] for i in cli.json("ls", "--json")}

    # delete --yes, then the id is gone.
    for sandbox_id in (child, fork):
        cli.ok("delete", sandbox_id, "--yes")
        assert sandbox_id not in {i.id for i in local_provider.list()}
    proc = cli("info", child)
    assert proc.returncode != 0 and len(proc.stderr.splitlines()) == 1

    gc = cli.json("gc")
    assert gc["ok"] is True
    assert src in cli.ok("ls").stdout, "gc deleted a live sandbox"
    cli.ok("delete", src, "--yes")
    cli.ok("delete-snapshot", snap, "--yes")
    assert snap not in cli.ok("snapshots").stdout


def test_exec_streams_output_as_it_is_produced(cli):
    src = cli.track(cli.ok("new", "--no-network", "--ttl", "600").stdout.strip())
    proc = subprocess.Popen(
        [str(HARNESS), "sandbox", "exec", src, "echo first; sleep 1; echo second"],
        stdout=subprocess.PIPE,
        text=True,
        env=cli.env,
    )
    try:
        assert proc.stdout.readline() == "first\n"
        assert proc.poll() is None, "the first line came only once the command had ended"
        assert proc.stdout.read() == "second\n"
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()
    cli.ok("delete", src, "--yes")


@pytest.mark.parametrize(
    "args",
    [
        ["info", "sb_0000000000"],
        ["exec", "sb_0000000000", "true"],
        ["exec", "not-an-id", "true"],
        ["fork", "sb_0000000000", "--wait", "--json"],
        ["new", "--from", "no-such-snapshot", "--name", "x", "--ttl", "60"],
        ["delete-snapshot", "no-such-snapshot", "--yes"],
        ["new", "--bogus-flag"],
        ["new", "--type", "huge"],
        ["new", "--ttl", "soon"],
        ["delete", "sb_0000000000"],
        ["exec", "sb_0000000000"],
    ],
    ids=["unknown-id", "exec-unknown-id", "malformed-id", "fork-unknown-id", "unknown-snapshot",
         "delete-unknown-snapshot", "bad-flag", "bad-type", "bad-ttl", "delete-without-yes", "exec-without-command"],
)
def test_errors_are_one_line_without_traceback(cli, local_provider, args):
    before = {i.id for i in local_provider.list()}
    proc = cli(*args)
    assert proc.returncode != 0
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr
    assert proc.stdout == ""
    assert {i.id for i in local_provider.list()} == before


def test_delete_without_yes_keeps_the_sandbox(cli, local_provider):
    src = cli.track(cli.ok("new", "--no-network", "--ttl", "600").stdout.strip())
    proc = cli("delete", src)
    assert proc.returncode != 0 and "--yes" in proc.stderr and len(proc.stderr.splitlines()) == 1
    assert cli.ok("exec", src, "echo still here").stdout == "still here\n"
    cli.ok("delete", src, "--yes")


def test_missing_system_package_names_the_install_command(cli):
    env = {**cli.env, "PATH": "/nonexistent"}  # no bwrap, nsenter... on the PATH
    proc = cli("ls", env=env)
    assert proc.returncode != 0
    assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr
    assert "apt-get install" in proc.stderr, proc.stderr

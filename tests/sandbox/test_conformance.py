"""The conformance suite of the sandbox seam: every backend must pass it unchanged.

Backends are listed in ``tests/conftest.py``; the ``provider`` fixture runs each
test once per backend.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from harness.errors import (
    ConfigError,
    SandboxError,
    SandboxFileError,
    SandboxNotFound,
    SnapshotExists,
    SnapshotNotFound,
)
from harness.sandbox import TIMEOUT_EXIT_CODE, SandboxSpec


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def sandbox(provider):
    with provider.create(SandboxSpec(ttl_s=600)) as sb:
        yield sb


# -- exec ------------------------------------------------------------------------


def test_exec_returns_exit_code_and_both_streams(sandbox):
    result = sandbox.exec("echo out; echo err >&2; exit 7")
    assert result.exit_code == 7
    assert result.stdout == b"out\n"
    assert result.stderr == b"err\n"
    assert not result.timed_out
    assert 0 < result.duration_s < 10


def test_exec_runs_as_the_sandbox_user_in_home(sandbox):
    out = sandbox.exec('id -u; pwd; echo "$HOME"; echo ~/x').text()
    uid, cwd, home, tilde = out.split()
    assert uid != "0"
    assert cwd == home == "/home/user"
    assert tilde == "/home/user/x"


def test_exec_env_and_cwd(sandbox):
    sandbox.exec("mkdir -p work/sub")
    result = sandbox.exec('echo "$GREETING"; pwd', env={"GREETING": "hello there"}, cwd="/home/user/work/sub")
    assert result.text().split("\n")[:2] == ["hello there", "/home/user/work/sub"]


def test_spec_env_applies_to_every_command(provider):
    with provider.create(SandboxSpec(env={"RUN_ID": "r1"}, ttl_s=600)) as sb:
        assert sb.exec("echo $RUN_ID").text().strip() == "r1"
        assert sb.exec("echo $RUN_ID", env={"RUN_ID": "r2"}).text().strip() == "r2"


def test_exec_passes_stdin(sandbox):
    data = bytes(range(256)) * 1000
    result = sandbox.exec("cat > blob && wc -c < blob", stdin=data)
    assert result.text().strip() == str(len(data))
    assert sandbox.read_file("blob") == data


def test_exec_timeout_kills_the_tree_and_reports_124(sandbox):
    started = time.monotonic()
    result = sandbox.exec("sleep 30 & sleep 30; echo never", timeout=0.5)
    assert result.timed_out
    assert result.exit_code == TIMEOUT_EXIT_CODE
    assert b"never" not in result.stdout
    assert time.monotonic() - started < 10
    # Nothing of that command is left: only the holder sleeps (pid namespace view).
    procs = sandbox.exec("cat /proc/[0-9]*/cmdline | tr '\\0' ' '").text()
    assert "sleep 30" not in procs


def test_exec_timeout_kills_setsid_daemons(sandbox):
    script = "setsid sh -c 'while :; do date +%s%N > ~/tick; sleep 0.05; done' > /dev/null 2>&1 & sleep 30"
    result = sandbox.exec(script, timeout=0.5)
    assert result.timed_out
    first = sandbox.read_file("tick")
    time.sleep(0.3)
    assert sandbox.read_file("tick") == first, "the daemon outlived its command's timeout"


def test_background_process_survives_between_execs(sandbox):
    sandbox.exec("nohup sh -c 'sleep 0.3; echo done > ~/bg' > /dev/null 2>&1 &")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if sandbox.exec("cat bg").text().strip() == "done":
            break
        time.sleep(0.1)
    assert sandbox.exec("cat bg").text().strip() == "done"


def test_concurrent_execs_share_one_filesystem(sandbox):
    results = {}

    def write(i: int) -> None:
        results[i] = sandbox.exec(f"echo {i} > f{i} && sleep 0.2 && cat f{i}")

    threads = [threading.Thread(target=write, args=(i,)) for i in range(6)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - started < 6 * 0.2 + 5
    assert all(results[i].text().strip() == str(i) for i in range(6))
    assert sorted(sandbox.exec("ls f*").text().split()) == sorted(f"f{i}" for i in range(6))


def test_output_is_streamed_as_produced(sandbox):
    seen: list[tuple[str, bytes, float]] = []
    started = time.monotonic()
    sandbox.exec(
        "echo first; sleep 0.5; echo second >&2",
        on_output=lambda stream, chunk: seen.append((stream, chunk, time.monotonic() - started)),
    )
    assert [(s, c) for s, c, _ in seen] == [("stdout", b"first\n"), ("stderr", b"second\n")]
    assert seen[0][2] < seen[1][2] - 0.3, "the first line arrived only at the end"


def test_output_cap_truncates_and_says_so(sandbox):
    result = sandbox.exec("head -c 100000 /dev/zero", max_output_bytes=1000)
    assert len(result.stdout) == 1000
    assert result.truncated


def test_binary_and_non_utf8_output(sandbox):
    result = sandbox.exec("printf '\\377\\376ok'")
    assert result.stdout == b"\xff\xfeok"
    assert "ok" in result.text()


# -- files -----------------------------------------------------------------------


def test_write_and_read_files(sandbox):
    payload = b"\x00\x01binary\xff" * 1000
    sandbox.write_file("dir/sub/data.bin", payload)
    assert sandbox.read_file("dir/sub/data.bin") == payload
    assert sandbox.read_file("/home/user/dir/sub/data.bin") == payload
    sandbox.write_file("run.sh", b"#!/bin/sh\necho ran\n", mode=0o755)
    assert sandbox.exec("./run.sh").text() == "ran\n"


def test_reading_a_missing_file_raises(sandbox):
    with pytest.raises(SandboxFileError):
        sandbox.read_file("no/such/file")


def test_writing_outside_writable_places_raises(sandbox):
    with pytest.raises(SandboxFileError):
        sandbox.write_file("/usr/evil", b"x")


# -- lifecycle -------------------------------------------------------------------


def test_info_rename_list_and_delete(provider):
    name = unique("conf")
    sb = provider.create(SandboxSpec(name=name, type="small", ttl_s=600))
    try:
        info = sb.info()
        assert (info.id, info.name, info.type, info.status) == (sb.id, name, "small", "running")
        assert info.expires_at == pytest.approx(info.created_at + 600, abs=1)
        assert info.from_snapshot is None and info.resumed_from is None
        assert info.memory_restored is False
        assert sb.id in [i.id for i in provider.list()]
        renamed = sb.rename(name + "-b")
        assert renamed.name == name + "-b" and provider.get(sb.id).info().name == name + "-b"
    finally:
        sb.delete()
    sb.delete()  # twice is fine
    assert sb.id not in [i.id for i in provider.list()]
    with pytest.raises(SandboxNotFound):
        provider.get(sb.id)
    with pytest.raises(SandboxNotFound):
        sb.exec("true")


def test_unknown_ids_and_bad_specs(provider):
    with pytest.raises(SandboxNotFound):
        provider.get("sb_0000000000")
    with pytest.raises(SandboxNotFound):
        provider.get("../../etc")
    with pytest.raises(ConfigError):
        SandboxSpec(type="huge")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        SandboxSpec(ttl_s=-1)


def test_ttl_expiry_deletes_the_sandbox(provider):
    sb = provider.create(SandboxSpec(ttl_s=1))
    assert sb.exec("true").ok
    time.sleep(1.2)
    with pytest.raises(SandboxNotFound, match="expired"):
        sb.exec("true")
    assert sb.id not in [i.id for i in provider.list()]


def test_gc_reaps_expired_sandboxes(provider):
    sb = provider.create(SandboxSpec(ttl_s=1))
    time.sleep(1.2)
    report = provider.gc()
    assert sb.id in report.deleted_sandboxes


# -- snapshots -------------------------------------------------------------------


def test_snapshot_and_start_from_it(provider, sandbox):
    name = unique("snap")
    sandbox.write_file("state.txt", b"v1")
    sandbox.exec("mkdir -p d && head -c 100000 /dev/urandom > d/blob")
    info = sandbox.snapshot(name)
    try:
        assert info.name == name and info.status == "ready"
        assert info.source_sandbox_id == sandbox.id
        assert info.size_bytes >= 100000
        assert provider.snapshot_info(name).snapshot_id == info.snapshot_id
        assert name in [s.name for s in provider.snapshots()]
        blob = sandbox.read_file("d/blob")
        sandbox.write_file("state.txt", b"v2")  # later changes are not in the snapshot
        with provider.create(SandboxSpec(ttl_s=600), from_snapshot=name) as restored:
            assert restored.read_file("state.txt") == b"v1"
            assert restored.read_file("d/blob") == blob
            assert restored.info().from_snapshot == name
            restored.write_file("state.txt", b"changed in restored")
        with provider.create(SandboxSpec(ttl_s=600), from_snapshot=name) as again:
            assert again.read_file("state.txt") == b"v1", "a restore changed the snapshot"
    finally:
        provider.delete_snapshot(name)


def test_snapshot_keeps_deletions_over_lower_layers(provider, sandbox):
    base, child = unique("base"), unique("child")
    sandbox.exec("mkdir -p keep gone && echo k > keep/f && echo g > gone/f && echo x > file")
    sandbox.snapshot(base)
    try:
        with provider.create(SandboxSpec(ttl_s=600), from_snapshot=base) as sb:
            # A deleted file, a deleted directory and a directory replaced by a new one.
            sb.exec("rm file && rm -r gone && rm -r keep && mkdir keep && echo new > keep/g")
            info = sb.snapshot(child)
            assert info.parent == base
            assert len(info.layers) == 2
        with provider.create(SandboxSpec(ttl_s=600), from_snapshot=child) as sb:
            listing = sb.exec("find . -path ./.cache -prune -o -print | sort").text().split()
            assert listing == [".", "./keep", "./keep/g"]
    finally:
        provider.delete_snapshot(child)
        provider.delete_snapshot(base)


def test_snapshot_names_are_unique_and_checked(provider, sandbox):
    name = unique("dup")
    sandbox.snapshot(name)
    try:
        with pytest.raises(SnapshotExists):
            sandbox.snapshot(name)
        with pytest.raises(SandboxError):
            sandbox.snapshot("bad/name")
    finally:
        provider.delete_snapshot(name)
    with pytest.raises(SnapshotNotFound):
        provider.snapshot_info(name)
    with pytest.raises(SnapshotNotFound):
        provider.create(SandboxSpec(), from_snapshot=name)
    with pytest.raises(SnapshotNotFound):
        provider.delete_snapshot(name)


# -- forks -----------------------------------------------------------------------


def test_fork_copies_files_and_both_stay_independent(provider, sandbox):
    sandbox.write_file("shared.txt", b"before fork")
    sandbox.exec("nohup sleep 60 > /dev/null 2>&1 &")  # a live process in the source
    with sandbox.fork() as child:
        info = child.info()
        assert info.resumed_from == sandbox.id
        assert info.memory_restored is False
        assert child.read_file("shared.txt") == b"before fork"
        child.write_file("shared.txt", b"child")
        child.write_file("only-child.txt", b"c")
        sandbox.write_file("only-source.txt", b"s")
        assert sandbox.read_file("shared.txt") == b"before fork"
        assert not sandbox.exec("test -e only-child.txt").ok
        assert not child.exec("test -e only-source.txt").ok
        # Processes are not carried over: memory is not part of a fork.
        assert "sleep 60" not in child.exec("cat /proc/[0-9]*/cmdline | tr '\\0' ' '").text()
    assert sandbox.exec("true").ok  # the source keeps running


def test_fork_of_a_sandbox_started_from_a_snapshot(provider, sandbox):
    name = unique("forkbase")
    sandbox.write_file("base.txt", b"base")
    sandbox.snapshot(name)
    try:
        with provider.create(SandboxSpec(ttl_s=600), from_snapshot=name) as src:
            src.write_file("delta.txt", b"delta")
            with src.fork() as child:
                assert child.read_file("base.txt") == b"base"
                assert child.read_file("delta.txt") == b"delta"
                assert child.info().from_snapshot == name
    finally:
        provider.delete_snapshot(name)

"""Local-backend specifics: state on disk, layer chains, garbage collection, limits."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest

from harness.sandbox import SANDBOX_TYPES, SandboxSpec, open_provider
from harness.sandbox import _jail
from harness.sandbox._store import MAX_CHAIN


def test_sandboxes_and_snapshots_survive_a_new_provider(local_provider, state_dir):
    name = f"persist-{uuid.uuid4().hex[:6]}"
    sb = local_provider.create(SandboxSpec(ttl_s=600))
    try:
        sb.exec("echo kept > f && (nohup sleep 120 > /dev/null 2>&1 &)")
        sb.snapshot(name)
        # A second process (here: a second provider) finds both.
        other = open_provider("local", state_dir=state_dir)
        again = other.get(sb.id)
        assert again.read_file("f") == b"kept\n"
        assert "sleep 120" in again.exec("cat /proc/[0-9]*/cmdline | tr '\\0' ' '").text()
        assert other.snapshot_info(name).source_sandbox_id == sb.id
    finally:
        sb.delete()
        local_provider.delete_snapshot(name)


def test_long_snapshot_chains_are_squashed(local_provider):
    names = []
    sb = local_provider.create(SandboxSpec(ttl_s=600))
    try:
        for i in range(MAX_CHAIN + 1):
            sb.exec(f"echo {i} > f{i} && rm -f f{i - 2}")
            name = f"chain-{uuid.uuid4().hex[:6]}-{i}"
            info = sb.snapshot(name)
            names.append(name)
            sb.delete()
            sb = local_provider.create(SandboxSpec(ttl_s=600), from_snapshot=name)
        assert len(info.layers) == 1, "the chain was not squashed"
        assert sorted(sb.exec("ls").text().split()) == [f"f{MAX_CHAIN - 1}", f"f{MAX_CHAIN}"]
    finally:
        sb.delete()
        for name in names:
            local_provider.delete_snapshot(name)


def test_gc_removes_layers_nothing_uses(local_provider):
    name = f"gc-{uuid.uuid4().hex[:6]}"
    with local_provider.create(SandboxSpec(ttl_s=600)) as sb:
        sb.exec(f"echo {uuid.uuid4().hex} > unique")
        layer = sb.snapshot(name).layers[-1]
    assert local_provider.layers.path(layer).is_dir()
    local_provider.gc()
    assert local_provider.layers.path(layer).is_dir(), "gc removed a layer a snapshot uses"
    local_provider.delete_snapshot(name)
    assert layer in local_provider.gc().removed_layers
    assert not local_provider.layers.path(layer).exists()


def test_identical_content_shares_one_layer(local_provider):
    a, b = (f"same-{uuid.uuid4().hex[:6]}" for _ in range(2))
    layers = []
    for name in (a, b):
        with local_provider.create(SandboxSpec(ttl_s=600)) as sb:
            sb.exec("mkdir -p d && echo same > d/f && touch -d 2020-01-01 d/f d")
            layers.append(sb.snapshot(name).layers)
    try:
        assert layers[0] == layers[1]
    finally:
        local_provider.delete_snapshot(a)
        local_provider.delete_snapshot(b)


@pytest.mark.parametrize("kind", ["small", "large"])
def test_type_limits_are_applied(local_provider, kind):
    res = SANDBOX_TYPES[kind]
    with local_provider.create(SandboxSpec(type=kind, ttl_s=600)) as sb:
        size = sb.exec("df -B1 --output=size /tmp | tail -n +2").text().strip()
        assert int(size) == res.tmp_bytes
        cg = local_provider.cgroup(sb.id)
        layout = cg.layout
        if layout.version == 1:
            dirs = cg._v1_dirs()
            assert int((dirs["memory"] / "memory.limit_in_bytes").read_text()) == res.memory_bytes
            assert int((dirs["pids"] / "pids.max").read_text()) == res.pids
        elif layout.version == 2:
            d = cg._v2_dir()
            assert int((d / "memory.max").read_text()) == res.memory_bytes
            assert int((d / "pids.max").read_text()) == res.pids
        else:
            pytest.fail("no cgroups on this machine: limits cannot be checked")


def test_a_crashed_create_is_cleaned_by_gc(local_provider):
    # A directory without a record is what a create killed half-way leaves.
    stray = local_provider.sandboxes_dir / "sb_crashed000"
    (stray / "rw").mkdir(parents=True)
    import os
    import time

    old = time.time() - 120
    os.utime(stray, (old, old))
    local_provider.gc()
    assert not stray.exists()
    assert not any(p.name.startswith(".trash-") for p in Path(local_provider.sandboxes_dir).iterdir())


def test_idle_fork_shares_an_in_memory_layer_instead_of_copying(local_provider):
    src = local_provider.create(SandboxSpec(ttl_s=600))
    children = []
    try:
        src.exec("head -c 1000000 /dev/urandom > big && echo v1 > f")
        children.append(src.fork())
        layers = local_provider._load(src.id).layers
        assert layers[-1].startswith("eph/"), "an idle source's changes were not promoted to a layer"
        assert local_provider._load(children[0].id).layers == layers
        # Unchanged source: the next fork reuses the layers, no new promotion.
        children.append(src.fork())
        assert local_provider._load(src.id).layers == layers
        # The source keeps its files and both sides stay independent.
        assert src.read_file("f") == b"v1\n"
        src.write_file("f", b"v2")
        children[0].write_file("f", b"child")
        assert children[1].read_file("f") == b"v1\n"
        assert src.read_file("f") == b"v2"
        src.exec("rm big")
        assert children[0].exec("wc -c < big").text().strip() == "1000000"
        # A change after a fork leads to one more layer at the next fork.
        children.append(src.fork())
        assert len(local_provider._load(src.id).layers) == len(layers) + 1
        assert not children[2].exec("test -e big").ok
    finally:
        for sb in [src, *children]:
            sb.delete()


def test_snapshot_of_a_fork_persists_its_in_memory_layers(local_provider):
    name = f"fromfork-{uuid.uuid4().hex[:6]}"
    src = local_provider.create(SandboxSpec(ttl_s=600))
    src.exec("echo from-source > s")
    child = src.fork()
    child.exec("echo from-child > c")
    info = child.snapshot(name)
    assert not any(layer.startswith("eph/") for layer in info.layers)
    src.delete()
    child.delete()
    local_provider.gc()
    assert not any((local_provider.run_dir / "eph").iterdir()), "gc kept unused in-memory layers"
    try:
        with local_provider.create(SandboxSpec(ttl_s=600), from_snapshot=name) as sb:
            assert sb.exec("cat s c").text() == "from-source\nfrom-child\n"
    finally:
        local_provider.delete_snapshot(name)


def test_warm_pool_hands_out_sandboxes_equal_to_cold_ones(state_dir, local_provider):
    name = f"pool-{uuid.uuid4().hex[:6]}"
    with local_provider.create(SandboxSpec(ttl_s=600)) as sb:
        sb.exec("echo from-snapshot > f")
        sb.snapshot(name)
    pooled = open_provider("local", state_dir=state_dir, pool_size=2)
    try:
        import time

        first = pooled.create(SandboxSpec(ttl_s=600), from_snapshot=name)  # cold: starts the pool
        deadline = time.monotonic() + 20
        key = ("small", False, local_provider.snapshot_info(name).snapshot_id)
        while len(pooled._pool._ready.get(key, ())) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        warm_ids = set(pooled._pool._ready[key])
        assert len(warm_ids) == 2
        assert not warm_ids & {i.id for i in pooled.list()}, "warm jails must not be listed"
        warm = pooled.create(SandboxSpec(name="claimed", ttl_s=300, env={"K": "v"}), from_snapshot=name)
        assert warm.id in warm_ids
        info = warm.info()
        assert (info.name, info.from_snapshot, info.status) == ("claimed", name, "running")
        assert info.expires_at == pytest.approx(info.created_at + 300, abs=2)
        assert warm.exec("cat f; echo $K; pwd").text() == "from-snapshot\nv\n/home/user\n"
        warm.write_file("g", b"x")
        with warm.fork() as child:
            assert child.exec("cat f g").text() == "from-snapshot\nx"
        empty = pooled.create(SandboxSpec(ttl_s=600))
        assert empty.exec("ls -A | grep -v '^.cache$' | wc -l").text().strip() == "0"
        for sb in (first, warm, empty):
            sb.delete()
    finally:
        pooled.close()
        local_provider.delete_snapshot(name)
    assert not any(
        local_provider._load(p.name).pooled
        for p in local_provider.sandboxes_dir.iterdir()
        if p.name.startswith("sb_")
    ), "close() left warm jails behind"


def test_shutdown_leaves_a_removable_state_dir(tmp_path):
    import shutil

    state = tmp_path / "state"
    provider = open_provider("local", state_dir=state)
    sb = provider.create(SandboxSpec(ttl_s=600))
    sb.exec("echo x > f")
    provider.shutdown()
    assert str(state) not in Path("/proc/self/mountinfo").read_text()
    with pytest.raises(Exception):
        sb.exec("true")
    shutil.rmtree(state)
    assert not state.exists()


def _wait_dead(meta, seconds: float) -> bool:
    import time

    from harness.sandbox._jail import alive

    deadline = time.monotonic() + seconds
    while alive(meta.init_pid, meta.init_start) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not alive(meta.init_pid, meta.init_start)


def test_a_jail_ends_by_itself_when_its_record_is_lost(local_provider, monkeypatch):
    import shutil

    from harness.sandbox import _jail

    monkeypatch.setattr(_jail, "HOLDER_CHECK_S", 1)
    sb = local_provider.create(SandboxSpec(ttl_s=600))
    meta = local_provider._load(sb.id)
    # Lose every trace the backend keeps (as when a state directory is deleted).
    shutil.rmtree(local_provider._dir(sb.id))
    assert _wait_dead(meta, 10), "the jail outlived its record"
    local_provider.gc()  # the cgroup of a sandbox without a record goes too
    assert not local_provider.cgroup(sb.id)._freezer_dir(None).exists()


def test_a_jail_ends_by_itself_after_its_ttl(local_provider, monkeypatch):
    from harness.sandbox import _jail
    from harness.sandbox import local as local_mod

    monkeypatch.setattr(_jail, "HOLDER_CHECK_S", 1)
    monkeypatch.setattr(local_mod, "DEADLINE_GRACE_S", 0.0)
    sb = local_provider.create(SandboxSpec(ttl_s=1))
    meta = local_provider._load(sb.id)
    # Nobody calls the backend: the kernel ends the jail all the same.
    assert _wait_dead(meta, 10), "the jail outlived its time-to-live"
    local_provider.gc()
    assert sb.id not in [i.id for i in local_provider.list()]


def test_warm_jails_die_with_the_process_that_pooled_them(state_dir):
    import json
    import subprocess
    import sys
    import time

    from harness.sandbox._jail import alive

    script = f"""
import json, time
from harness.sandbox import SandboxSpec, open_provider
p = open_provider("local", state_dir={str(state_dir)!r}, pool_size=2)
p.create(SandboxSpec(ttl_s=60)).delete()  # starts filling the pool
deadline = time.monotonic() + 20
while sum(map(len, p._pool._ready.values())) < 2 and time.monotonic() < deadline:
    time.sleep(0.05)
ids = [i for q in p._pool._ready.values() for i in q]
print(json.dumps([[p._load(i).init_pid, p._load(i).init_start] for i in ids]), flush=True)
import os; os._exit(0)  # no close(): as when a worker is killed
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    jails = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(jails) == 2
    deadline = time.monotonic() + 10
    while any(alive(pid, start) for pid, start in jails) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid, start) for pid, start in jails), "warm jails outlived their process"
    open_provider("local", state_dir=state_dir).gc()


def test_the_jail_init_reaps_orphans_and_ends_with_its_holder(local_provider):
    """The holder is the jail's PID 1: orphans are re-parented to it, and it must
    reap them, or their zombies would fill the sandbox's pids limit (512 for
    small); and killing it alone ends the jail, background processes and all."""
    import signal
    import time

    from harness.sandbox import _jail

    sb = local_provider.create(SandboxSpec(type="small", ttl_s=600))
    try:
        meta = local_provider._load(sb.id)
        assert _jail._holder_pid(meta.init_pid) == meta.init_pid
        assert sb.exec("cat /proc/1/comm").text() == "sh\n"
        # 700 orphans (each `( ... &)` leaves its child to PID 1) that exit at once.
        result = sb.exec("for i in $(seq 700); do (sh -c 'exit 0' &); done; echo forked", timeout=120)
        assert result.exit_code == 0 and result.text() == "forked\n"
        assert result.stderr == b"", result.text("stderr")[-500:]  # no fork failed
        count_zombies = "grep -l '^State:.*Z' /proc/[0-9]*/status 2>/dev/null | wc -l"
        deadline = time.monotonic() + 10
        while (zombies := int(sb.exec(count_zombies).text())) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert zombies == 0, f"{zombies} zombies were left unreaped by the jail's init"
        sb.exec("(setsid sleep 600 > /dev/null 2>&1 &)")
        os.kill(meta.init_pid, signal.SIGKILL)
        assert _wait_dead(meta, 5), "the jail outlived its PID 1"
        leaf_pids = sb.provider.cgroup(sb.id).exec_pids()
        deadline = time.monotonic() + 5
        while leaf_pids and time.monotonic() < deadline:
            time.sleep(0.05)
            leaf_pids = sb.provider.cgroup(sb.id).exec_pids()
        assert not leaf_pids, "a daemon outlived its jail's PID 1"
    finally:
        sb.delete()


def test_a_delete_cut_short_is_finished_by_the_next_list(local_provider):
    """A process killed mid-delete (after the rename to .trash-<id>) leaves its jail, cgroup
    and in-memory upper dir: the next list() (which the driver's end-of-run reap calls)
    finishes the job, not only gc."""
    sb = local_provider.create()
    sb.exec("sleep 300 &")
    meta = local_provider._load(sb.id)
    trash = local_provider.sandboxes_dir / f".trash-{sb.id}"
    os.rename(local_provider.sandboxes_dir / sb.id, trash)  # where a killed _destroy stops first
    assert sb.id not in {i.id for i in local_provider.list()}
    assert not trash.exists() and not (local_provider.run_dir / sb.id).exists()
    deadline = time.monotonic() + 5
    while _jail.alive(meta.init_pid, meta.init_start) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _jail.alive(meta.init_pid, meta.init_start)

"""Faults from outside the sandbox layer, with real jails and a real server.

Each test does to the backend what a hostile admin, the OOM killer, a full
disk, a stampede of callers or a crash would, then asserts what callers see
(every call returns or raises a one-line SandboxError, within a bound) and
what is left on the host (no jail process, cgroup, mount or state entry).
Providers on a state directory of their own are checked by ``assert_clean``;
the session's ``local_provider`` also gets the autouse leak check.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_isolation import wait_until as isolation_wait_until
from sandbox.server_fixture import (
    kill_server,
    restart_server,
    start_server,
    stop_server,
)

from harness.errors import (
    ConfigError,
    SandboxError,
    SandboxNotFound,
    SandboxStartError,
    SandboxTimeout,
    SandboxUnavailable,
)
from harness.sandbox import SandboxSpec, _jail
from harness.sandbox import local as local_mod
from harness.sandbox.local import LocalProvider

CGROUP_ROOT = Path("/sys/fs/cgroup")


# -- helpers ------------------------------------------------------------------------


def wait_until(predicate: Callable[[], object], timeout: float = 5.0, interval: float = 0.02):
    """The isolation suite's poll, with a longer default: faults take longer to settle."""
    return isolation_wait_until(predicate, timeout, interval)


def host_cmdlines() -> dict[int, str]:
    out: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if stat[0] in ("Z", "X"):
                    continue
                out[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
    return out


def mounts_under(path: Path) -> list[str]:
    """Mount points below ``path`` (not ``path`` itself: a test may mount it)."""
    points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    return [m for m in points if m.startswith(f"{path}/")]


def cgroups_of(provider: LocalProvider, sandbox_id: str = "sb_*") -> list[Path]:
    pattern = f"{provider._cg_prefix}-{sandbox_id}"
    return [*CGROUP_ROOT.glob(f"*/harness/{pattern}"), *CGROUP_ROOT.glob(f"harness/{pattern}")]


def leftovers(provider: LocalProvider, *tokens: str) -> list[str]:
    """Whatever of the provider's sandboxes is still on the host. A jail's
    bubblewrap and holder have the state dir on their command lines."""
    state = str(provider.state_dir)
    found = [f"process {pid}: {line[:150]}" for pid, line in host_cmdlines().items()
             if pid != os.getpid() and (state in line or any(t in line for t in tokens))]
    found += [f"cgroup {p}" for p in cgroups_of(provider)]
    found += [f"mount {m}" for m in mounts_under(provider.state_dir) if m != str(provider.run_dir)]
    found += [f"record {p.name}" for p in provider.sandboxes_dir.iterdir() if p.name.startswith(("sb_", ".trash-"))]
    if os.path.ismount(provider.run_dir):
        found += [f"run dir {p.name}" for p in provider.run_dir.iterdir() if p.name.startswith("sb_")]
    return found


def assert_clean(provider: LocalProvider, *tokens: str, timeout: float = 5.0) -> None:
    left = wait_until(lambda: not leftovers(provider, *tokens), timeout=timeout)
    assert left, leftovers(provider, *tokens)


def shutdown_clean(provider: LocalProvider) -> None:
    """Delete everything of a test's own provider and check nothing stayed."""
    provider.shutdown()
    assert_clean(provider)
    assert not mounts_under(provider.state_dir), "shutdown left a mount under the state dir"


def unique_sleep() -> str:
    return f"3000.{secrets.randbelow(10**9):09d}"


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert text and "\n" not in text, f"not a one-line message: {text!r}"
    return text


@pytest.fixture
def own_provider(tmp_path) -> Iterator[LocalProvider]:
    """A provider on a state directory of its own (its limits and leftovers are the test's)."""
    provider = LocalProvider(tmp_path / "state")
    yield provider
    shutdown_clean(provider)


# -- 1. a sandbox killed from outside -------------------------------------------------


def _kill_from_outside(provider: LocalProvider, sandbox_id: str, how: str) -> None:
    meta = provider._load(sandbox_id)
    if how == "init":  # the jail's PID 1: the kernel kills its whole PID namespace
        os.kill(meta.init_pid, signal.SIGKILL)
    elif how == "cgroup":  # as `kill -9 $(cat cgroup.procs)` or the OOM killer would
        pids = {int(x) for g in cgroups_of(provider, sandbox_id) for f in g.rglob("cgroup.procs") for x in f.read_text().split()}
        assert meta.init_pid in pids and len(pids) >= 3, pids  # init, holder and the running command
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    else:  # pragma: no cover
        raise AssertionError(how)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["init", "cgroup"])
def test_a_sandbox_killed_from_outside_mid_exec_fails_fast_and_leaves_nothing(provider, local_provider, how):
    """Beyond test_isolation's idle kill: a command is running when the jail is
    killed, by its init or its whole cgroup, over both backends."""
    daemon, running = unique_sleep(), unique_sleep()
    sb = provider.create(SandboxSpec(ttl_s=600))
    sb.write_file("keep.txt", b"x")
    sb.exec(f"(setsid sleep {daemon} > /dev/null 2>&1 &)", timeout=30)
    started = threading.Event()
    outcome: dict = {}

    def in_flight() -> None:
        t0 = time.monotonic()
        try:
            outcome["result"] = sb.exec(
                f"echo go; sleep {running}", timeout=120, on_output=lambda stream, chunk: started.set()
            )
        except BaseException as exc:  # noqa: BLE001 - asserted below
            outcome["error"] = exc
        outcome["seconds"] = time.monotonic() - t0

    worker = threading.Thread(target=in_flight)
    worker.start()
    assert started.wait(20), "the command never started"
    _kill_from_outside(local_provider, sb.id, how)
    worker.join(timeout=15)
    assert not worker.is_alive(), "exec hung after its jail was killed"
    assert outcome["seconds"] < 10
    # The command did not fail by itself: the caller is told the sandbox is gone.
    assert isinstance(outcome.get("error"), SandboxNotFound), outcome
    assert "stopped" in one_line(outcome["error"])
    for call in (
        lambda: sb.exec("true"),
        lambda: sb.info(),
        lambda: sb.read_file("keep.txt"),
        lambda: sb.write_file("more.txt", b"y"),
        lambda: sb.snapshot(f"dead-{secrets.token_hex(4)}"),
        lambda: sb.fork(),
        lambda: provider.get(sb.id),
    ):
        with pytest.raises(SandboxNotFound):
            call()
    assert sb.id not in [i.id for i in provider.list()]
    assert sb.id not in local_provider.gc().deleted_sandboxes  # already removed by the calls above
    assert_clean_sandbox(local_provider, sb.id, daemon, running)
    sb.delete()  # deleting what is gone is fine


def assert_clean_sandbox(provider: LocalProvider, sandbox_id: str, *tokens: str) -> None:
    def left() -> list[str]:
        return [x for x in leftovers(provider, *tokens) if sandbox_id in x or any(t in x for t in tokens)]

    assert wait_until(lambda: not left(), timeout=5), left()


@pytest.mark.timeout(60)
def test_list_and_gc_drop_sandboxes_whose_jails_were_killed(own_provider):
    """The first call after the kill may be list() or gc(): neither shows a dead
    sandbox as "stopped"; both remove it."""
    a, b, alive = (own_provider.create(SandboxSpec(name=n, ttl_s=600)) for n in ("a", "b", "alive"))
    for sb in (a, b):
        meta = own_provider._load(sb.id)
        os.kill(meta.init_pid, signal.SIGKILL)
        assert wait_until(lambda m=meta: not _jail.alive(m.init_pid, m.init_start))
    listed = own_provider.list()
    assert [i.id for i in listed] == [alive.id] and listed[0].status == "running"
    assert not own_provider._dir(a.id).exists() and not own_provider._dir(b.id).exists()
    c = own_provider.create(SandboxSpec(name="c", ttl_s=600))
    os.kill(own_provider._load(c.id).init_pid, signal.SIGKILL)
    assert wait_until(lambda: c.id in own_provider.gc().deleted_sandboxes or not own_provider._dir(c.id).exists())
    assert [i.id for i in own_provider.list()] == [alive.id]
    assert alive.exec("echo ok").text() == "ok\n"
    alive.delete()
    assert_clean(own_provider)


def daemon_pids(token: str) -> list[int]:
    return [pid for pid, line in host_cmdlines().items() if token in line]


@pytest.mark.timeout(60)
def test_a_jail_with_a_daemon_ends_by_itself_after_its_ttl(own_provider, monkeypatch):
    """The jail's own last resort (its holder exits at TTL + grace) must end it
    with background processes too, whether or not a harness process runs again."""
    monkeypatch.setattr(_jail, "HOLDER_CHECK_S", 1)
    monkeypatch.setattr(local_mod, "DEADLINE_GRACE_S", 0.0)
    token = unique_sleep()
    sb = own_provider.create(SandboxSpec(ttl_s=2))
    sb.exec(f"(setsid sleep {token} > /dev/null 2>&1 &)", timeout=30)
    assert daemon_pids(token), "the daemon did not start"
    meta = own_provider._load(sb.id)
    holder = _jail._holder_pid(meta.init_pid)
    assert holder
    # Nobody calls the backend: the holder exits after the TTL...
    assert wait_until(lambda: _jail.process_start_time(holder) is None, timeout=10), "the holder outlived the TTL"
    # ...and with it the jail ends, daemon and all.
    assert wait_until(lambda: not _jail.alive(meta.init_pid, meta.init_start), timeout=3), (
        "the jail's init (so the jail, its daemon and its namespaces) outlived the holder"
    )
    assert wait_until(lambda: not daemon_pids(token), timeout=3), "the daemon outlived its jail"
    # The next call finds the sandbox gone and removes what is left of it.
    with pytest.raises(SandboxNotFound):
        sb.exec("true")
    assert_clean(own_provider, token)


@pytest.mark.timeout(60)
def test_a_claimed_warm_jail_ends_by_itself_after_its_own_ttl(tmp_path, monkeypatch):
    """A warm jail is started with the pool's long deadline; claimed, its own last
    resort must be the TTL it was claimed with (plus grace), not the pool's."""
    monkeypatch.setattr(_jail, "HOLDER_CHECK_S", 1)
    monkeypatch.setattr(local_mod, "DEADLINE_GRACE_S", 0.0)
    provider = LocalProvider(tmp_path / "state", pool_size=1)
    token = unique_sleep()
    try:
        provider.create(SandboxSpec(ttl_s=600)).delete()  # cold: the pool starts filling
        assert wait_until(lambda: sum(map(len, provider._pool._ready.values())) == 1, timeout=20)
        [warm_id] = [i for q in provider._pool._ready.values() for i in q]
        warm = provider._load(warm_id)
        assert warm.deadline - time.time() > 3000  # the pool's
        sb = provider.create(SandboxSpec(ttl_s=2))
        assert sb.id == warm_id, "the create did not claim the warm jail"
        meta = provider._load(sb.id)
        assert meta.deadline == pytest.approx(meta.expires_at)  # TTL + grace (0 here)
        assert jail_deadline(provider, sb.id) == pytest.approx(meta.deadline, abs=2)
        sb.exec(f"(setsid sleep {token} > /dev/null 2>&1 &)", timeout=30)
        # Nobody calls the backend: the jail ends, daemon and all, soon after the TTL.
        assert wait_until(lambda: not _jail.alive(meta.init_pid, meta.init_start), timeout=10), (
            "a claimed warm jail outlived its own TTL's deadline"
        )
        assert wait_until(lambda: not daemon_pids(token), timeout=3)
        assert sb.id not in [i.id for i in provider.list()]
    finally:
        shutdown_clean(provider)


# -- 2. a full disk under the state directory ---------------------------------------


@pytest.fixture(params=["tmpfs", "ext4"])
def small_state(request, tmp_path) -> Iterator[Path]:
    """A 64 MB filesystem as a provider's state dir, unmounted afterwards."""
    mnt = tmp_path / "state"
    mnt.mkdir()
    if request.param == "tmpfs":
        cmd = ["mount", "-t", "tmpfs", "-o", "size=64m,mode=0700", "tmpfs", str(mnt)]
    else:
        image = tmp_path / "state.img"
        with open(image, "wb") as f:
            f.truncate(64 << 20)
        subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True)
        cmd = ["mount", "-o", "loop", str(image), str(mnt)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a {request.param} here: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-R", str(mnt)], capture_output=True, check=False)
        if os.path.ismount(mnt):
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, check=False)
        assert not os.path.ismount(mnt)


def fill_up(path: Path, prefix: str = "filler") -> list[Path]:
    """Take every free block of the filesystem at ``path`` (root's reserve too):
    one big file, then small ones (``prefix-N``, 4 KiB each) to the last block."""
    st = os.statvfs(path)
    big = path / prefix
    subprocess.run(["fallocate", "-l", str(max(st.f_bfree - 16, 1) * st.f_frsize), str(big)], capture_output=True, check=False)
    files = [big]
    chunk = b"\0" * 4096
    for i in range(100_000):
        f = path / f"{prefix}-{i}"
        files.append(f)
        try:
            with open(f, "wb") as out:
                out.write(chunk)
        except OSError:
            break
    probe = path / "probe"
    with pytest.raises(OSError), open(probe, "wb") as out:
        out.write(b"x" * 65536)
    probe.unlink(missing_ok=True)
    return files


def state_entries(provider: LocalProvider) -> dict[str, set[str]]:
    return {
        "layers": {p.name for p in provider.layers.root.iterdir()},
        "snapshots": {p.name for p in provider.snapshot_store.root.iterdir()},
        "sandboxes": {p.name for p in provider.sandboxes_dir.iterdir()},
        "run": {p.name for p in provider.run_dir.iterdir()},
    }


FULL = re.compile(r"the disk holding \S+ is full \(No space left on device\); free space there .*and retry$")


@pytest.mark.timeout(120)
def test_a_full_state_disk_fails_cleanly_and_loses_nothing(small_state, monkeypatch):
    provider = LocalProvider(small_state)
    fillers: list[Path] = []
    try:
        src = provider.create(SandboxSpec(name="src", ttl_s=600))
        src.exec("mkdir -p env && head -c 3000000 /dev/urandom > env/blob && echo v1 > env/version", timeout=60)
        want = src.exec("sha256sum env/blob").text()
        s1 = provider.snapshot_info(src.snapshot("s1").name)
        other = provider.create(SandboxSpec(name="other", ttl_s=600), from_snapshot="s1")
        other.write_file("note.txt", b"written before the disk filled")
        src.exec("head -c 2000000 /dev/urandom > env/new && echo v2 > env/version", timeout=60)
        snap_file = (provider.snapshot_store.root / "s1.json").read_bytes()

        fillers = fill_up(small_state)
        before = state_entries(provider)

        # A snapshot needs the disk: one line that says it is full and what to do,
        # and neither a half-written layer nor a record stays behind.
        with pytest.raises(SandboxError) as err:
            src.snapshot("s2")
        assert FULL.search(one_line(err.value)), err.value
        assert "snapshot 's2'" in str(err.value)
        assert state_entries(provider) == before
        assert "s2" not in [s.name for s in provider.snapshots()]
        # Creating needs a record on the disk: a clear error, nothing half-made, and
        # a fork's source is left as it was.
        for create, error in (
            (lambda: provider.create(SandboxSpec(ttl_s=600), from_snapshot="s1"), SandboxStartError),
            (lambda: provider.create(SandboxSpec(ttl_s=600)), SandboxStartError),
            (lambda: src.fork(), SandboxError),
        ):
            with pytest.raises(error) as err:
                create()
            assert FULL.search(one_line(err.value)), err.value
            after = state_entries(provider)
            assert after["sandboxes"] == before["sandboxes"] and after["snapshots"] == before["snapshots"]
            assert not {x for x in after["run"] - before["run"] if x.startswith("sb_")}
        # The first create on a state dir also writes the jails' /etc files. Free
        # the disk a block at a time: each create fails in one line and leaves
        # nothing, wherever it stops (its record, /etc, ...), until one fits.
        etc_failures = []
        real_write_etc = _jail.write_etc

        def counted_write_etc(*args, **kwargs):
            try:
                return real_write_etc(*args, **kwargs)
            except OSError as exc:
                etc_failures.append(exc)
                raise

        monkeypatch.setattr(_jail, "write_etc", counted_write_etc)
        shutil.rmtree(small_state / "etc")
        fillers += fill_up(small_state, prefix="refill")
        big = small_state / "filler"  # the first fill_up's big file: shrunk a block at a time
        fitted = None
        for _ in range(256):
            os.truncate(big, max(0, big.stat().st_size - 4096))
            os.sync()  # ext4 reuses freed blocks once its journal has committed
            try:
                fitted = provider.create(SandboxSpec(ttl_s=600))
                break
            except SandboxStartError as exc:
                assert FULL.search(one_line(exc)), exc
            etc = small_state / "etc"
            assert not etc.exists() or {p.name for p in etc.iterdir()} <= {"nonet"}, list(etc.iterdir())
            after = state_entries(provider)
            assert after["sandboxes"] == before["sandboxes"]
            assert not {x for x in after["run"] - before["run"] if x.startswith("sb_")}
        assert fitted is not None, "no create fitted in 1 MiB freed"
        assert fitted.exec("id -un").text() == "user\n"  # its /etc is whole
        fitted.delete()
        assert etc_failures, "no create stopped at writing /etc: the test missed that step"
        monkeypatch.undo()
        fillers += fill_up(small_state, prefix="again")

        # What sandboxes write lives in memory: files still work, and gc does.
        src.write_file("env/during.txt", b"disk full on the host\n")
        assert src.read_file("env/during.txt") == b"disk full on the host\n"
        report = provider.gc()
        assert not report.deleted_sandboxes and not set(s1.layers) & set(report.removed_layers)
        # Nothing written before is lost or corrupted.
        assert (provider.snapshot_store.root / "s1.json").read_bytes() == snap_file
        assert provider.snapshot_info("s1") == s1
        assert other.read_file("note.txt") == b"written before the disk filled"
        assert other.exec("cat env/version").text() == "v1\n"
        assert src.exec("cat env/version").text() == "v2\n"

        # Space freed: everything works again, and what was there before still is.
        for f in fillers:
            f.unlink(missing_ok=True)
        fillers = []
        s2 = src.snapshot("s2")
        fresh = provider.create(SandboxSpec(ttl_s=600), from_snapshot="s1")
        assert fresh.exec("sha256sum env/blob").text() == want
        assert fresh.exec("cat env/version").text() == "v1\n"
        later = provider.create(SandboxSpec(ttl_s=600), from_snapshot=s2.name)
        assert later.exec("cat env/version; cat env/during.txt; test -s env/new && echo new").text() == (
            "v2\ndisk full on the host\nnew\n"
        )
        child = src.fork()
        assert child.exec("cat env/version").text() == "v2\n"
        for sb in (src, other, fresh, later, child):
            sb.delete()
        provider.delete_snapshot("s2")
        provider.gc()
        assert not [p for p in provider.layers.root.iterdir() if p.name.startswith(".tmp-")]
        assert sorted(provider.layers.all()) == sorted({*s1.layers, "empty"})
    finally:
        for f in fillers:
            f.unlink(missing_ok=True)
        shutdown_clean(provider)


# -- 3. hundreds of sandboxes at once ------------------------------------------------


def _stampede(create: Callable[[int], object], n: int, workers: int) -> tuple[list, float]:
    """``n`` calls of ``create`` from ``workers`` threads at once; (outcomes, seconds).
    Each outcome is (sandbox or exception, seconds the call took)."""
    gate = threading.Barrier(workers)

    def one(i: int):
        if i < workers:
            gate.wait(timeout=30)
        t0 = time.monotonic()
        try:
            return create(i), time.monotonic() - t0
        except Exception as exc:  # noqa: BLE001 - asserted by the caller
            return exc, time.monotonic() - t0

    started = time.monotonic()
    with ThreadPoolExecutor(workers) as pool:
        outcomes = list(pool.map(one, range(n)))
    return outcomes, time.monotonic() - started


def _delete_all(sandboxes: list, workers: int = 16) -> None:
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda sb: sb.delete(), sandboxes))


N_AT_ONCE = 200


@pytest.mark.timeout(90)
def test_200_creates_at_once_are_bounded_and_all_succeed(own_provider, monkeypatch):
    starting = {"now": 0, "peak": 0}
    lock = threading.Lock()
    real_start = _jail.start

    def counted_start(*args, **kwargs):
        with lock:
            starting["now"] += 1
            starting["peak"] = max(starting["peak"], starting["now"])
        try:
            return real_start(*args, **kwargs)
        finally:
            with lock:
                starting["now"] -= 1

    monkeypatch.setattr(_jail, "start", counted_start)
    outcomes, seconds = _stampede(lambda i: own_provider.create(SandboxSpec(type="small", ttl_s=600)), N_AT_ONCE, N_AT_ONCE)
    errors = [o for o, _ in outcomes if isinstance(o, Exception)]
    sandboxes = [o for o, _ in outcomes if not isinstance(o, Exception)]
    slowest = max(t for _, t in outcomes)
    print(f"\n{N_AT_ONCE} concurrent local creates: {seconds:.2f} s in all, slowest call {slowest:.2f} s, "
          f"peak {starting['peak']} jails starting at once (cap {local_mod.MAX_STARTS})")
    try:
        assert not errors, errors[:3]
        assert len({sb.id for sb in sandboxes}) == N_AT_ONCE
        assert 2 <= starting["peak"] <= local_mod.MAX_STARTS, starting
        assert slowest < 45, f"a create took {slowest:.1f} s"
        listed = {i.id for i in own_provider.list()}
        assert listed == {sb.id for sb in sandboxes}
        for sb in sandboxes[:: N_AT_ONCE // 10]:
            assert sb.exec("echo $HOSTNAME", timeout=30).text() == f"{sb.id}\n"
    finally:
        _delete_all(sandboxes)
    assert own_provider.list() == []
    assert_clean(own_provider)


@pytest.mark.timeout(90)
def test_creates_beyond_max_sandboxes_fail_with_a_clear_error(tmp_path):
    cap = 40
    provider = LocalProvider(tmp_path / "state", max_sandboxes=cap)
    sandboxes: list = []
    try:
        outcomes, _ = _stampede(lambda i: provider.create(SandboxSpec(ttl_s=600)), N_AT_ONCE, 100)
        sandboxes = [o for o, _ in outcomes if not isinstance(o, Exception)]
        errors = [o for o, _ in outcomes if isinstance(o, Exception)]
        assert len(sandboxes) == cap, "the cap was overshot or not reached"
        assert len(errors) == N_AT_ONCE - cap
        for exc in errors:
            assert isinstance(exc, SandboxStartError), repr(exc)
            assert re.fullmatch(
                rf"{cap} sandboxes are live, the limit is {cap}; delete some .*raise max_sandboxes \(HARNESS_MAX_SANDBOXES\)",
                one_line(exc),
            ), exc
        assert not [p for p in provider.sandboxes_dir.iterdir() if p.name.startswith("sb_")][cap:]
        # Deleting one makes room for one; a sandbox whose jail died makes room too.
        sandboxes.pop().delete()
        sandboxes.append(provider.create(SandboxSpec(ttl_s=600)))
        with pytest.raises(SandboxStartError):
            provider.create(SandboxSpec(ttl_s=600))
        dead = sandboxes.pop()
        os.kill(provider._load(dead.id).init_pid, signal.SIGKILL)
        assert wait_until(lambda: not provider._load(dead.id).running())
        sandboxes.append(provider.create(SandboxSpec(ttl_s=600)))
        # The environment sets the default; a bad value is a clear error.
        os.environ["HARNESS_MAX_SANDBOXES"] = "7"
        try:
            assert LocalProvider(tmp_path / "state").max_sandboxes == 7
            os.environ["HARNESS_MAX_SANDBOXES"] = "lots"
            with pytest.raises(ConfigError, match="HARNESS_MAX_SANDBOXES='lots' is not a positive whole number"):
                LocalProvider(tmp_path / "state")
        finally:
            del os.environ["HARNESS_MAX_SANDBOXES"]
        assert LocalProvider(tmp_path / "state").max_sandboxes == local_mod.DEFAULT_MAX_SANDBOXES
    finally:
        _delete_all(sandboxes)
        shutdown_clean(provider)


@pytest.mark.timeout(120)
def test_200_creates_at_once_through_the_server(tmp_path):
    """One server, 200 client threads at once; its state dir allows 150 sandboxes:
    every call answers within the bound, 150 with a sandbox and 50 with the cap's error."""
    cap = 150
    state = tmp_path / "state"
    state.mkdir()
    server = start_server(state, env={"HARNESS_MAX_SANDBOXES": str(cap)})
    client = server.provider(timeout=60, max_connections=N_AT_ONCE)
    sandboxes: list = []
    try:
        outcomes, seconds = _stampede(lambda i: client.create(SandboxSpec(type="small", ttl_s=600)), N_AT_ONCE, N_AT_ONCE)
        sandboxes = [o for o, _ in outcomes if not isinstance(o, Exception)]
        errors = [o for o, _ in outcomes if isinstance(o, Exception)]
        slowest = max(t for _, t in outcomes)
        print(f"\n{N_AT_ONCE} concurrent creates through the server: {seconds:.2f} s in all, slowest call {slowest:.2f} s")
        assert slowest < 55
        assert len(sandboxes) == cap, [repr(e) for e in errors[:3]]
        assert all(isinstance(e, SandboxStartError) and "the limit is 150" in one_line(e) for e in errors), errors[:3]
        assert {i.id for i in client.list()} == {sb.id for sb in sandboxes}
        for sb in sandboxes[:: cap // 10]:
            assert sb.exec("echo ok", timeout=30).text() == "ok\n"
        _delete_all(sandboxes, workers=32)
        sandboxes = []
        assert client.list() == []
    finally:
        _delete_all(sandboxes, workers=32)
        client.close()
        stop_server(server)
        shutdown_clean(LocalProvider(state))


# -- 4. a provider process killed while it holds sandboxes ------------------------------


_HOLDER = """
import json, sys, time
from harness.sandbox import SandboxSpec, open_provider
p = open_provider("local", state_dir=sys.argv[1], pool_size=2)
ttl = float(sys.argv[2])
def ready(n):
    deadline = time.monotonic() + 20
    while sum(map(len, p._pool._ready.values())) < n and time.monotonic() < deadline:
        time.sleep(0.02)
named = [p.create(SandboxSpec(name="k0", ttl_s=ttl)).id]  # cold: the pool starts filling
ready(1)
named += [p.create(SandboxSpec(name=f"k{i}", ttl_s=ttl)).id for i in (1, 2)]  # k1 from the pool
ready(2)
pooled = [i for q in p._pool._ready.values() for i in q]
def jail(i):
    m = p._load(i)
    return {"id": i, "pid": m.init_pid, "start": m.init_start, "expires": m.expires_at, "deadline": m.deadline}
print(json.dumps({"named": [jail(i) for i in named], "pooled": [jail(i) for i in pooled]}), flush=True)
time.sleep(600)
"""


def _from_pool(init_pid: int) -> bool:
    """Was the jail started by a warm pool (so bound to its process's life)?"""
    ppid = int(Path(f"/proc/{init_pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return b"--die-with-parent" in Path(f"/proc/{ppid}/cmdline").read_bytes()


def jail_deadline(provider: LocalProvider, sandbox_id: str) -> float:
    """When the jail's holder will end it (wall clock): its ``deadline`` file if
    there is one, else the deadline on its command line (both on the boot clock)."""
    meta = provider._load(sandbox_id)
    holder = _jail._holder_pid(meta.init_pid)
    assert holder
    try:
        boot = int((provider._dir(sandbox_id) / _jail.DEADLINE_FILE).read_text())
    except FileNotFoundError:
        argv = Path(f"/proc/{holder}/cmdline").read_bytes().split(b"\0")
        match = re.search(rb"; d=(\d+); ", argv[2])
        assert match, argv
        boot = int(match.group(1))
    return time.time() + boot - _jail.boot_clock()


@pytest.mark.timeout(90)
def test_a_provider_killed_while_holding_sandboxes_leaks_nothing(tmp_path):
    state = tmp_path / "state"
    try:
        _provider_killed_while_holding_sandboxes(state, ttl=6.0)
    finally:  # a failed assertion must not leave the child's jails running
        if state.is_dir():
            shutdown_clean(LocalProvider(state))


def _provider_killed_while_holding_sandboxes(state: Path, ttl: float) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(state), str(ttl)], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        jails = json.loads(line)
        named, pooled = jails["named"], jails["pooled"]
        assert len(pooled) == 2 and all(_from_pool(j["pid"]) for j in pooled)
        cold = [j for j in named if not _from_pool(j["pid"])]
        claimed = [j for j in named if j not in cold]
        assert named[0] in cold and named[1] in claimed
        # While held, a jail's own last resort is due at TTL + DEADLINE_GRACE_S,
        # whatever happens to the process: a cold one's and a claimed warm one's
        # (which also dies with the process). Unclaimed ones keep the pool's.
        provider = LocalProvider(state)
        for j in named:
            assert j["deadline"] == pytest.approx(j["expires"] + local_mod.DEADLINE_GRACE_S)
            assert jail_deadline(provider, j["id"]) == pytest.approx(j["deadline"], abs=2)
        for j in pooled:
            assert j["deadline"] - j["expires"] > local_mod.DEADLINE_GRACE_S + 3000
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # Warm jails belong to their process: they die with it, claimed or not.
    bound = pooled + claimed
    assert wait_until(lambda: not any(_jail.alive(j["pid"], j["start"]) for j in bound), timeout=10), (
        "warm jails outlived their process"
    )
    provider = LocalProvider(state)
    # Cold ones outlive the process until their TTL: listed and usable till then.
    assert all(_jail.alive(j["pid"], j["start"]) for j in cold)
    if time.time() < min(j["expires"] for j in cold) - 0.5:
        assert {i.id for i in provider.list()} == {j["id"] for j in cold}
        assert provider.get(named[0]["id"]).exec("echo alive").text() == "alive\n"
    # Once expired, the next call reaps them; gc finds nothing more to do.
    time.sleep(max(0.0, max(j["expires"] for j in named) - time.time()) + 0.2)
    assert provider.list() == []
    assert not any(_jail.alive(j["pid"], j["start"]) for j in named + pooled)
    assert provider.gc().deleted_sandboxes == ()
    assert_clean(provider)


_KILLED_MID_START = """
import os, signal, sys
from harness.sandbox import SandboxSpec, _jail
from harness.sandbox.local import LocalProvider
p = LocalProvider(sys.argv[1], pool_size=int(sys.argv[2]))
def die(*args, **kwargs):  # the overlay is mounted on the host, bubblewrap is starting
    os.kill(os.getpid(), signal.SIGKILL)
_jail._await_ready = die
p.create(SandboxSpec(ttl_s=600))
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pooled", [False, True], ids=["cold", "warm-pool"])
def test_a_process_killed_while_starting_a_jail_leaves_nothing_after_the_next_call(tmp_path, pooled):
    """SIGKILL between the host mount of a new jail's overlay and its detach (an
    actor killed while its warm pool was starting a jail): the record has no jail
    yet, its starter is dead; the next list() removes it, its mount and its jail."""
    state = tmp_path / "state"
    proc = subprocess.run([sys.executable, "-c", _KILLED_MID_START, str(state), str(int(pooled))], timeout=30, check=False)
    assert proc.returncode == -signal.SIGKILL
    provider = LocalProvider(state)
    try:
        # With a pool, its thread may have been starting a jail too.
        records = [p for p in provider.sandboxes_dir.iterdir() if p.name.startswith("sb_")]
        assert 1 <= len(records) <= 1 + pooled
        assert all(provider._load(r.name).init_pid is None for r in records)
        assert mounts_under(provider.sandboxes_dir), "the start was not killed mid-way (no host mount)"
        assert provider.list() == []
        assert not any(r.exists() for r in records)
        assert not mounts_under(provider.sandboxes_dir)
        # Its jail, if bubblewrap got that far, ends as its record is gone.
        assert_clean(provider, timeout=3 * _jail.HOLDER_CHECK_S)
    finally:
        shutdown_clean(provider)


# -- 5. a server killed and restarted while a client holds sandboxes -------------------


@pytest.mark.timeout(120)
def test_a_server_killed_and_restarted_keeps_its_sandboxes(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    server = start_server(state)
    client = server.provider(timeout=5, retries=2, backoff_s=0.1)
    token = unique_sleep()
    try:
        sb = client.create(SandboxSpec(name="kept", ttl_s=600))
        sb.write_file("data.txt", b"before the crash")
        started = threading.Event()
        outcome: dict = {}

        def in_flight() -> None:
            t0 = time.monotonic()
            try:
                outcome["result"] = sb.exec(f"echo go; sleep {token}", timeout=300, on_output=lambda s, c: started.set())
            except BaseException as exc:  # noqa: BLE001 - asserted below
                outcome["error"] = exc
            outcome["seconds"] = time.monotonic() - t0

        worker = threading.Thread(target=in_flight)
        worker.start()
        assert started.wait(20)
        kill_server(server)
        worker.join(timeout=15)
        assert not worker.is_alive(), "an exec in flight hung when its server died"
        assert isinstance(outcome.get("error"), SandboxUnavailable), outcome
        assert "lost the connection" in one_line(outcome["error"]) or "cannot reach" in str(outcome["error"])

        # During the outage every call fails fast with SandboxUnavailable.
        for call in (
            client.list,
            sb.info,
            lambda: sb.exec("true"),
            lambda: sb.read_file("data.txt"),
            lambda: client.create(SandboxSpec(ttl_s=60)),
            lambda: sb.snapshot("during-outage"),
        ):
            t0 = time.monotonic()
            with pytest.raises(SandboxUnavailable, match="cannot reach the sandbox server"):
                call()
            assert time.monotonic() - t0 < 3, "a call during the outage took too long"

        # The same port and state: the same sandbox works again, its files intact.
        server = restart_server(server)
        info = sb.info()
        assert info.id == sb.id and info.name == "kept" and info.status == "running"
        assert sb.read_file("data.txt") == b"before the crash"
        assert sb.exec("echo again").text() == "again\n"
        assert [i.id for i in client.list()] == [sb.id]
        snap = sb.snapshot(f"after-restart-{secrets.token_hex(3)}")
        with client.create(SandboxSpec(ttl_s=60), from_snapshot=snap.name) as copy:
            assert copy.read_file("data.txt") == b"before the crash"
        client.delete_snapshot(snap.name)

        # A server that hangs (stopped, not dead) costs the configured timeout, no more.
        server.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(SandboxTimeout):
                sb.info()
            assert time.monotonic() - t0 < client.timeout + 3
        finally:
            server.proc.send_signal(signal.SIGCONT)
        assert sb.info().status == "running"
        sb.delete()
        assert client.list() == []
    finally:
        client.close()
        stop_server(server)
        shutdown_clean(LocalProvider(state))


@pytest.mark.timeout(90)
def test_a_command_in_flight_dies_with_its_server(tmp_path):
    """A server SIGKILLed mid-exec: nobody will read that command's result, so it
    dies, with what it started; a daemon left by an exec that had finished is the
    sandbox's and lives on, as does the sandbox."""
    state = tmp_path / "state"
    state.mkdir()
    server = start_server(state)
    client = server.provider(timeout=5, retries=0)
    running, its_daemon, kept = unique_sleep(), unique_sleep(), unique_sleep()
    try:
        sb = client.create(SandboxSpec(ttl_s=600))
        sb.exec(f"(setsid sleep {kept} > /dev/null 2>&1 &)", timeout=30)
        started = threading.Event()
        outcome: dict = {}

        def in_flight() -> None:
            try:
                outcome["result"] = sb.exec(
                    f"(setsid sleep {its_daemon} > /dev/null 2>&1 &); echo go; sleep {running}",
                    on_output=lambda s, c: started.set(),
                )
            except BaseException as exc:  # noqa: BLE001 - asserted below
                outcome["error"] = exc

        worker = threading.Thread(target=in_flight)
        worker.start()
        assert started.wait(20)
        assert all(daemon_pids(t) for t in (running, its_daemon, kept))
        kill_server(server)
        worker.join(timeout=15)
        assert not worker.is_alive(), "the exec hung when its server died"
        assert isinstance(outcome.get("error"), SandboxError), outcome
        # The client was told the call failed; the command (and its nsenter, whose
        # command line holds it) must not run on unseen, nor what it started.
        assert wait_until(lambda: not daemon_pids(running) and not daemon_pids(its_daemon), timeout=5), (
            "the command of a failed exec is still running in the sandbox"
        )
        assert daemon_pids(kept), "a daemon of a finished exec died with the server"
        server = restart_server(server)
        assert sb.exec("echo alive").text() == "alive\n"
        assert kept in sb.exec("cat /proc/[0-9]*/cmdline | tr '\\0' ' '").text()
        sb.delete()
        assert not daemon_pids(kept)
    finally:
        client.close()
        stop_server(server)
        shutdown_clean(LocalProvider(state))


_RUNNER = """
import sys
from harness.sandbox import SandboxSpec
from harness.sandbox.local import LocalProvider
p = LocalProvider(sys.argv[1])
sb = p.create(SandboxSpec(ttl_s=600))
sb.exec(f"echo go; sleep {sys.argv[2]}", on_output=lambda s, c: print(sb.id, flush=True))
"""


def _children(pid: int) -> list[int]:
    return [int(x) for t in Path(f"/proc/{pid}/task").iterdir() for x in (t / "children").read_text().split()]


@pytest.mark.timeout(60)
def test_gc_stops_the_commands_of_a_dead_process_whose_watchdog_died_too(tmp_path):
    """The watchdog that stops a dead process's commands is killed first (say by
    an admin), then the process: gc, or the next provider's start, stops them."""
    state = tmp_path / "state"
    token = unique_sleep()
    proc = subprocess.Popen([sys.executable, "-c", _RUNNER, str(state), token], stdout=subprocess.PIPE, text=True)
    try:
        sandbox_id = proc.stdout.readline().strip()  # type: ignore[union-attr]
        assert sandbox_id.startswith("sb_")
        [reaper] = [c for c in _children(proc.pid) if b"reap_owner" in Path(f"/proc/{c}/cmdline").read_bytes()]
        os.kill(reaper, signal.SIGKILL)
        proc.kill()
        proc.wait(timeout=10)
        time.sleep(0.5)
        assert daemon_pids(token), "the command died although nothing was left to stop it"
        provider = LocalProvider(state)  # its start finds the orphaned command
        assert wait_until(lambda: not daemon_pids(token), timeout=5), "an orphaned command survived a provider's start"
        sb = provider.get(sandbox_id)
        assert sb.exec("echo ok").text() == "ok\n"  # the sandbox itself is fine
        assert provider.gc().deleted_sandboxes == ()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutdown_clean(LocalProvider(state))

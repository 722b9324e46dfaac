"""Hostile code in a local sandbox is contained.

Each test does from inside a sandbox what a misbehaving policy might (read the
host's files, write its system directories, look at another sandbox, reach a
server on the host's loopback, signal host processes, fork, allocate or write
without end, leave a daemon behind), then asserts on what actually happened,
inside the sandbox and on the host. Where an attempt is expected to fail, a
positive control shows that the probe itself works.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from harness.sandbox._jail import HOLDER_CHECK_S

from harness.errors import SandboxNotFound
from harness.sandbox import SandboxSpec

CGROUP_ROOT = Path("/sys/fs/cgroup")
SANDBOX_UID = 1000


# -- helpers ------------------------------------------------------------------------


def run(sb, command: str, timeout: float = 60, **kwargs):
    """exec with a generous safety timeout; returns the ExecResult."""
    return sb.exec(command, timeout=timeout, **kwargs)


def start_time(pid: int) -> int | None:
    """The kernel's start time of a live (non-zombie) process, None otherwise."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def host_cmdlines() -> dict[int, list[str]]:
    """Every host process's argv (zombies and vanished processes left out)."""
    out: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
            except OSError:
                continue
            if argv:
                out[int(entry.name)] = argv
    return out


def sandbox_cgroups(sandbox_id: str) -> list[Path]:
    """The sandbox's cgroup directories on cgroup v1 (one per controller) or v2."""
    return [*CGROUP_ROOT.glob(f"*/harness/*{sandbox_id}"), *CGROUP_ROOT.glob(f"harness/*{sandbox_id}")]


def slirp_of(init_pid: int) -> list[int]:
    return [pid for pid, argv in host_cmdlines().items() if "slirp4netns" in argv[0] and str(init_pid) in argv]


def leftovers(provider, sandbox_id: str, init_pid: int, init_start: int | None, token: str | None = None) -> list[str]:
    """Whatever of a sandbox is still on the host: processes, cgroups, mounts, dirs."""
    found = []
    if start_time(init_pid) == init_start:
        found.append(f"init pid {init_pid} is alive")
    for pid, argv in host_cmdlines().items():
        line = " ".join(argv)
        if pid != os.getpid() and (sandbox_id in line or (token and token in line)):
            found.append(f"process {pid}: {line[:120]}")
    found += [f"pid {pid}: slirp4netns of the jail" for pid in slirp_of(init_pid)]
    found += [f"cgroup {p}" for p in sandbox_cgroups(sandbox_id)]
    found += [f"mount: {line}" for line in Path("/proc/self/mountinfo").read_text().splitlines() if sandbox_id in line]
    for parent in (provider.sandboxes_dir, getattr(provider, "run_dir", None)):
        if parent is not None and parent.is_dir():
            found += [f"directory {p}" for p in parent.iterdir() if sandbox_id in p.name]
    return found


def wait_until(predicate: Callable[[], object], timeout: float = 3.0, interval: float = 0.02):
    """Poll until ``predicate()`` is truthy; return its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)


def cgroup_counter(sandbox_id: str, controller: str, filename: str, key: str) -> int | None:
    """A ``key value`` counter of one of the sandbox's cgroup files (v1 or v2), if any."""
    candidates = [*CGROUP_ROOT.glob(f"{controller}/harness/*{sandbox_id}/{filename}")]
    candidates += [*CGROUP_ROOT.glob(f"harness/*{sandbox_id}/{filename}")]
    for path in candidates:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    return None


def unique_sleep() -> str:
    """A sleep duration no other process has on its command line."""
    return f"3000.{secrets.randbelow(10**9):09d}"


def visible_cmdlines(sb) -> list[str]:
    """The command lines of every process the sandbox can see, from inside, but
    the holder's periodic `sleep` (see harness.sandbox._jail._holder_script)."""
    result = run(sb, "for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f; echo; done 2>/dev/null")
    holder_sleep = f"sleep {HOLDER_CHECK_S} "
    return [line for line in result.text().splitlines() if line.strip() and line != holder_sleep]


# -- fixtures -----------------------------------------------------------------------


@pytest.fixture
def sandbox(local_provider) -> Iterator:
    sb = local_provider.create(SandboxSpec(name="hostile", ttl_s=600))
    try:
        yield sb
    finally:
        sb.delete()


@pytest.fixture
def net_sandbox(local_provider) -> Iterator:
    sb = local_provider.create(SandboxSpec(name="hostile-net", ttl_s=600, network=True))
    try:
        yield sb
    finally:
        sb.delete()


@contextlib.contextmanager
def accepting(srv: socket.socket) -> Iterator[tuple[int, list]]:
    """Accept (and close) connections on a listening socket in a thread; yields its port
    and the peers it accepted, and closes it at the end."""
    accepted: list = []

    def serve() -> None:
        while True:
            try:
                conn, peer = srv.accept()
            except OSError:
                return
            accepted.append(peer)
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield srv.getsockname()[1], accepted
    finally:
        srv.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        srv.close()
        thread.join(timeout=2)


@pytest.fixture
def loopback_server() -> Iterator[tuple[int, list]]:
    """A TCP server on the host's 127.0.0.1; yields its port and the peers it accepted."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    with accepting(srv) as server:
        yield server


def connect_probe(host: str, port: int) -> str:
    return (
        "python3 -c 'import socket, sys\n"
        f"socket.create_connection((sys.argv[1], {port}), timeout=3)\n"
        f"print(\"connected\")' {host}"
    )


# -- the host's files ----------------------------------------------------------------


def test_host_files_outside_the_jail_cannot_be_read(sandbox, tmp_path, state_dir):
    token = secrets.token_hex(8)
    markers = [tmp_path / f"marker-{token}"]
    if Path("/root").is_dir():
        markers.append(Path("/root") / f".harness-marker-{token}")
    for marker in markers:
        marker.write_text(f"secret {token}\n")
    try:
        probe = "; ".join(f"cat {m} && echo READ-{i}" for i, m in enumerate(markers))
        result = run(sandbox, f"{probe}; ls /work /root {state_dir}; wc -c < /etc/shadow")
        found = run(sandbox, f"find / -path /proc -prune -o -name '*{token}*' -print 2>/dev/null")
    finally:
        for marker in markers:
            marker.unlink()
    assert token not in result.text() and "READ-" not in result.text()
    assert "No such file or directory" in result.text("stderr")
    assert result.text().split() == ["0"], "/etc/shadow is not empty in the sandbox"
    if Path("/etc/shadow").exists():
        assert Path("/etc/shadow").stat().st_size > 0  # so the empty view above is the jail's doing
    assert found.text() == ""
    # The probe does find a file that is there.
    run(sandbox, f"echo {token} > ~/mine-{token}")
    again = run(sandbox, f"find / -path /proc -prune -o -name '*{token}*' -print 2>/dev/null")
    assert again.text().split() == [f"/home/user/mine-{token}"]


def test_usr_and_etc_are_read_only(sandbox):
    token = secrets.token_hex(6)
    attempts = [f"touch /usr/{token}", f"touch /usr/bin/{token}", f"touch /etc/{token}", f"mkdir /bin/{token}",
                "echo x >> /etc/passwd", "echo x >> /etc/hosts", "rm -f /usr/bin/env", "chmod 777 /usr/bin"]
    for attempt in attempts:
        result = run(sandbox, attempt)
        assert result.exit_code != 0, attempt
        assert any(e in result.text("stderr") for e in ("Read-only file system", "Permission denied")), result
    for path in (f"/usr/{token}", f"/usr/bin/{token}", f"/etc/{token}", f"/bin/{token}"):
        assert not Path(path).exists()
    assert Path("/usr/bin/env").exists()
    check = run(sandbox, "test -x /usr/bin/env && ! grep -q '^x$' /etc/passwd /etc/hosts && stat -c %a /usr/bin")
    assert check.exit_code == 0 and check.text() == "755\n"


# -- other sandboxes ----------------------------------------------------------------


def test_another_sandbox_files_and_processes_are_invisible(local_provider):
    token = secrets.token_hex(8)
    nap = unique_sleep()
    a = local_provider.create(SandboxSpec(name="victim", ttl_s=600))
    b = local_provider.create(SandboxSpec(name="snoop", ttl_s=600))
    try:
        run(a, f"echo {token} > ~/marker-{token} && echo {token} > /tmp/marker-{token}"
               f" && (sleep {nap} > /dev/null 2>&1 &)")
        # Positive controls: A sees its own files and process.
        assert run(a, f"cat ~/marker-{token} /tmp/marker-{token}").text().split() == [token, token]
        assert any(nap in line for line in visible_cmdlines(a))

        found = run(b, f"find / -path /proc -prune -o -name '*{token}*' -print 2>/dev/null; "
                       f"cat /home/user/marker-{token} /tmp/marker-{token}")
        assert token not in found.text()
        assert found.text("stderr").count("No such file or directory") == 2
        seen = visible_cmdlines(b)
        assert not any(token in line or nap in line for line in seen), seen
        # B's /proc holds B's processes only: its init, the holder, this very probe.
        assert len(seen) <= 4, seen
    finally:
        a.delete()
        b.delete()


# -- the host's loopback --------------------------------------------------------------


@pytest.mark.parametrize("network", [False, True], ids=["no-network", "network"])
def test_host_loopback_server_is_unreachable(local_provider, loopback_server, network):
    port, accepted = loopback_server
    # The probe works: from the host, the server answers.
    socket.create_connection(("127.0.0.1", port), timeout=3).close()
    assert wait_until(lambda: len(accepted) == 1)
    accepted.clear()
    with local_provider.create(SandboxSpec(ttl_s=600, network=network)) as sb:
        interfaces = run(sb, "python3 -c 'import socket; print(*sorted(n for _, n in socket.if_nameindex()))'")
        assert interfaces.text().split() == (["lo", "tap0"] if network else ["lo"])
        for host in ("127.0.0.1", "10.0.2.2", "localhost"):
            result = run(sb, connect_probe(host, port), timeout=20)
            assert result.exit_code != 0, f"{host}:{port} answered from inside the sandbox"
            assert "connected" not in result.text()
            assert any(e in result.text("stderr") for e in ("Connection refused", "Network is unreachable")), result.text("stderr")
    assert accepted == []


def host_addresses() -> list[str]:
    """The host's own non-loopback IPv4 addresses."""
    try:
        out = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True).stdout
    except FileNotFoundError:
        return []
    return [line.split()[3].split("/")[0] for line in out.splitlines()]


def test_host_non_loopback_addresses_are_unreachable_with_network(net_sandbox):
    addresses = host_addresses()
    if not addresses:
        pytest.skip("no global IPv4 address on this host")
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]  # closed everywhere (no server is started): any answer comes from the host's stack
    probe.close()
    for address in addresses:
        result = run(net_sandbox, connect_probe(address, port), timeout=20)
        stderr = result.text("stderr")
        # Refused locally by the sandbox's own routes, never by the host's stack.
        assert "No route to host" in stderr or "Network is unreachable" in stderr, f"{address}: {stderr.splitlines()[-1:]}"


def test_network_sandbox_resolves_pypi(net_sandbox):
    """Needs DNS for pypi.org (reachable here and in CI): the only test that does."""
    result = run(net_sandbox, "getent hosts pypi.org", timeout=30)
    assert result.exit_code == 0 and "pypi.org" in result.text()


# -- host processes, privileges ----------------------------------------------------------


def test_host_processes_are_invisible_and_unsignalable(sandbox):
    duration = unique_sleep()
    helper = subprocess.Popen(["sleep", duration])
    try:
        seen = visible_cmdlines(sandbox)
        assert not any("pytest" in line or duration in line for line in seen), seen
        for pid in (os.getpid(), helper.pid):
            result = run(sandbox, f"kill -0 {pid} && echo SIGNALLED; test -e /proc/{pid}/root/work && echo ESCAPED")
            assert "SIGNALLED" not in result.text() and "ESCAPED" not in result.text()
        assert helper.poll() is None
    finally:
        helper.kill()
        helper.wait()


def test_no_capabilities_and_no_mounts(sandbox):
    status = run(sandbox, "grep -E '^(Uid|Gid|Cap(Inh|Prm|Eff|Amb)):' /proc/self/status").text()
    fields = {line.split(":")[0]: line.split()[1:] for line in status.splitlines()}
    for cap in ("CapInh", "CapPrm", "CapEff", "CapAmb"):
        assert int(fields[cap][0], 16) == 0, status
    assert fields["Uid"] == [str(SANDBOX_UID)] * 4
    assert fields["Gid"] == [str(SANDBOX_UID)] * 4
    mount = run(sandbox, "mkdir -p ~/m && mount -t tmpfs none ~/m && echo MOUNTED")
    assert mount.exit_code != 0 and "MOUNTED" not in mount.text()
    # setuid binaries cannot give root back: every mount in the jail is nosuid.
    mounts = run(sandbox, "cat /proc/self/mountinfo").text().splitlines()
    assert mounts and all("nosuid" in line.split(" - ")[0].split()[5] for line in mounts), mounts
    chown = run(sandbox, "touch ~/f && chown 0:0 ~/f")
    assert chown.exit_code != 0


# -- exhaustion -----------------------------------------------------------------------


def test_fork_bomb_is_contained_by_the_pids_limit(sandbox):
    result = run(sandbox, "bomb() { bomb | bomb & }; bomb; sleep 60", timeout=3)
    assert result.timed_out and result.exit_code == 124
    assert "fork" in result.text("stderr").lower()  # "Cannot fork": the limit stopped it
    hit = cgroup_counter(sandbox.id, "pids", "pids.events", "max")
    assert hit is None or hit > 0, "the pids limit was never reached"
    # The host still forks, and the sandbox, its bomb killed with the timeout, still runs commands.
    assert subprocess.run(["true"]).returncode == 0
    after = run(sandbox, "echo alive", timeout=20)
    assert after.exit_code == 0 and after.text() == "alive\n"
    assert wait_until(lambda: len(visible_cmdlines(sandbox)) <= 4), visible_cmdlines(sandbox)


def test_memory_bomb_is_killed_and_the_host_is_unaffected(sandbox):
    def host_rss() -> int:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS:"))
        return int(line.split()[1]) * 1024

    rss_before = host_rss()
    oom_before = cgroup_counter(sandbox.id, "memory", "memory.oom_control", "oom_kill")
    if oom_before is None:
        oom_before = cgroup_counter(sandbox.id, "memory", "memory.events", "oom_kill")
    bomb = "python3 -c 'x = []\nwhile True: x.append(bytearray(64 << 20))'"  # bytearray() writes its pages
    result = run(sandbox, bomb, timeout=60)
    assert not result.timed_out
    assert result.exit_code == 137 or "MemoryError" in result.text("stderr"), result
    oom_after = cgroup_counter(sandbox.id, "memory", "memory.oom_control", "oom_kill")
    if oom_after is None:
        oom_after = cgroup_counter(sandbox.id, "memory", "memory.events", "oom_kill")
    if oom_before is not None and result.exit_code == 137:
        assert oom_after > oom_before, "the kill was not the sandbox's memory limit"
    assert host_rss() - rss_before < 64 << 20
    assert run(sandbox, "echo alive").text() == "alive\n"


def test_tmp_fill_stops_at_its_cap(sandbox):
    result = run(sandbox, "dd if=/dev/zero of=/tmp/fill bs=1M count=1024", timeout=60)
    assert result.exit_code != 0
    assert "No space left on device" in result.text("stderr")
    size = int(run(sandbox, "stat -c %s /tmp/fill").text())
    assert 500 << 20 <= size <= 512 << 20
    assert run(sandbox, "rm /tmp/fill && echo ok > ~/still-writable && cat ~/still-writable").text() == "ok\n"


def test_home_fill_beyond_its_cap_is_contained(sandbox):
    """The home lives in memory: filling it past 2 GiB ends in ENOSPC or the OOM
    killer, never in more than the cap, and the sandbox recovers once it is freed."""
    result = run(sandbox, "dd if=/dev/zero of=$HOME/fill bs=4M count=600", timeout=90)  # 2.3 GiB
    assert result.exit_code != 0
    assert result.exit_code == 137 or "No space left on device" in result.text("stderr"), result
    size = int(run(sandbox, "stat -c %s ~/fill").text())
    assert size <= 2 << 30
    assert run(sandbox, "rm ~/fill && echo ok > ~/after && cat ~/after").text() == "ok\n"


# -- daemons, delete, external kill ----------------------------------------------------------


def test_setsid_daemon_dies_with_its_command_timeout(sandbox):
    daemon = "setsid sh -c 'trap \"\" HUP TERM; while :; do touch ~/beat; sleep 0.1; done' > /dev/null 2>&1"
    result = run(sandbox, f"( {daemon} & ); sleep 60", timeout=1)
    assert result.timed_out and result.exit_code == 124

    def mtime() -> str:
        return run(sandbox, "stat -c %y ~/beat").text()

    first = mtime()
    assert first, "the daemon never ran"
    time.sleep(0.4)  # four of its beats
    assert mtime() == first, "the daemon still touches its file after the timeout"
    assert not any("beat" in line for line in visible_cmdlines(sandbox))
    # Nothing of the command lingers as a zombie either: one orphaned to the
    # host's init would hold the jail's PID namespace, and so its delete.
    def zombies() -> list[str]:
        stats = run(sandbox, "cat /proc/[0-9]*/stat 2>/dev/null").text().splitlines()
        return [line for line in stats if line.rsplit(")", 1)[1].split()[0] == "Z"]

    assert wait_until(lambda: not zombies(), timeout=0.5), zombies()


def test_delete_leaves_nothing_behind(local_provider):
    token = unique_sleep()
    sb = local_provider.create(SandboxSpec(ttl_s=600, network=True))
    run(sb, f"echo x > ~/f; echo y > /tmp/f; (setsid sleep {token} > /dev/null 2>&1 &)")
    init_pid = sb.init_pid
    init_start = start_time(init_pid)
    assert init_start is not None and slirp_of(init_pid)
    assert sandbox_cgroups(sb.id)
    assert wait_until(lambda: any(token in " ".join(a) for a in host_cmdlines().values()))
    sb.delete()
    left = wait_until(lambda: not leftovers(local_provider, sb.id, init_pid, init_start, token), timeout=3)
    assert left, leftovers(local_provider, sb.id, init_pid, init_start, token)
    sb.delete()  # twice is fine
    with pytest.raises(SandboxNotFound):
        local_provider.get(sb.id)


def test_sigkill_of_init_from_outside_removes_the_sandbox(local_provider):
    token = unique_sleep()
    sb = local_provider.create(SandboxSpec(ttl_s=600, network=True))
    run(sb, f"(setsid sleep {token} > /dev/null 2>&1 &)")
    init_pid = sb.init_pid
    init_start = start_time(init_pid)
    os.kill(init_pid, signal.SIGKILL)
    assert wait_until(lambda: start_time(init_pid) != init_start)
    with pytest.raises(SandboxNotFound):
        sb.exec("true")
    with pytest.raises(SandboxNotFound):
        local_provider.get(sb.id)
    with pytest.raises(SandboxNotFound):
        sb.info()
    assert sb.id not in [i.id for i in local_provider.list()]
    left = wait_until(lambda: not leftovers(local_provider, sb.id, init_pid, init_start, token), timeout=3)
    assert left, leftovers(local_provider, sb.id, init_pid, init_start, token)

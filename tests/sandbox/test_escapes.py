"""Escapes: what hostile policy code would try from inside a sandbox, each contained.

test_isolation.py covers reading the host's files, read-only /usr and /etc, other
sandboxes' files and processes, the host's loopback, signals to host processes,
capabilities, exhaustion and daemons left by a timeout. This file adds writes into
what the jail binds from the host, device nodes, the kernel's interfaces (/proc,
keyrings, perf, bpf, modules), nested user namespaces (refused by the commands'
seccomp filter, see harness.sandbox._seccomp.confine_thread), Ray-like ports on every
host address, ptrace and ``kill -9 -1``, the home filling the host's disk, daemons
that try to outlive a delete, and the HTTP server's tokens and file paths.

Every test asserts what happened on the host as well as inside the sandbox, and
where an attempt must fail, a positive control shows that the probe works.
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_isolation import (  # the helpers and fixtures of the isolation suite
    accepting,
    host_addresses,
    host_cmdlines,
    run,
    sandbox,  # noqa: F401  (fixture)
    sandbox_cgroups,
    start_time,
    unique_sleep,
    visible_cmdlines,
    wait_until,
)

from harness.sandbox import SandboxSpec

SANDBOX_UID = 1000


def probe_py(body: str) -> str:
    """A python3 one-off in the sandbox; ``body`` is indented Python source."""
    return "python3 - <<'EOF'\n" + body.strip("\n") + "\nEOF"


def fingerprint(path: Path) -> tuple[int, int, str]:
    """What would change if anything wrote to ``path``: mtime, size, content hash."""
    st = path.stat()
    return st.st_mtime_ns, st.st_size, hashlib.sha256(path.read_bytes()).hexdigest()


def tree_fingerprint(root: Path) -> dict[str, tuple]:
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            p = Path(dirpath, name)
            try:
                out[str(p)] = fingerprint(p)
            except OSError:
                pass
    return out


# -- writes into what the jail holds of the host ------------------------------------------


def test_bound_host_paths_cannot_be_written_or_listed(sandbox, local_provider):  # noqa: F811
    """The jail binds the state directories (run, layers, records) and the generated
    /etc files from the host at their host paths; none is writable, nor listable."""
    token = secrets.token_hex(6)
    state = local_provider.state_dir
    bound = [local_provider.run_dir, local_provider.layers.root, local_provider.sandboxes_dir]
    etc = [p for p in (state / "etc").rglob("*") if p.is_file()]
    assert etc, "no generated /etc files to guard"
    before = {p: fingerprint(p) for p in etc}
    own_record = local_provider.sandboxes_dir / sandbox.id / "meta.json"
    record_before = fingerprint(own_record)
    attempts = []
    for d in bound:
        attempts += [f"ls {d}", f"touch {d}/{token}", f"mkdir {d}/{token}"]
    attempts += [
        f"echo x >> {own_record}",
        f"rm -f {own_record}",
        f"ls {local_provider.run_dir}/{sandbox.id}",
        "echo x >> /etc/passwd", "echo x > /etc/resolv.conf", "echo x > /etc/shadow",
    ]
    for attempt in attempts:
        result = run(sandbox, attempt)
        assert result.exit_code != 0, attempt
        assert any(e in result.text("stderr") for e in ("Permission denied", "Read-only file system")), (attempt, result)
    for d in bound:
        assert not (d / token).exists()
    assert {p: fingerprint(p) for p in etc} == before
    assert fingerprint(own_record) == record_before
    # Positive control: the home takes writes.
    assert run(sandbox, f"echo {token} > ~/ok && cat ~/ok").text() == f"{token}\n"


def test_device_nodes_sys_and_proc_sys_are_out_of_reach(sandbox):  # noqa: F811
    hostname = Path("/proc/sys/kernel/hostname").read_text()
    core_pattern = Path("/proc/sys/kernel/core_pattern").read_text()
    result = run(sandbox, probe_py(r"""
import os, stat
for path, kind, dev in (("/home/user/mem", stat.S_IFCHR, os.makedev(1, 1)),
                        ("/tmp/disk", stat.S_IFBLK, os.makedev(254, 0)),
                        ("/dev/kmsg", stat.S_IFCHR, os.makedev(1, 11))):
    try:
        os.mknod(path, 0o666 | kind, dev)
        print("MKNOD", path)
    except OSError as e:
        print("mknod", path, e.errno)
for path in ("/proc/sys/kernel/hostname", "/proc/sys/kernel/core_pattern", "/proc/sys/vm/drop_caches",
             "/proc/sysrq-trigger", "/dev/null-x", "/dev/shm/x", "/sys/kernel/uevent_helper"):
    try:
        with open(path, "w") as f:
            f.write("|/tmp/pwn\n")
        print("WROTE", path)
    except OSError as e:
        print("write", path, e.errno)
for path in ("/proc/kcore", "/dev/core", "/proc/kmsg", "/dev/mem", "/dev/vda", "/proc/1/mem", "/proc/1/environ"):
    try:
        with open(path, "rb") as f:
            f.read(1)
        print("READ", path)
    except OSError as e:
        print("read", path, e.errno)
print("sys", os.path.exists("/sys"))
print("dev", *sorted(os.listdir("/dev")))
"""))
    out = result.text()
    assert result.exit_code == 0, result
    assert "MKNOD" not in out and "WROTE" not in out and "READ" not in out, out
    lines = {" ".join(line.split()[:2]): line.split()[2:] for line in out.splitlines() if not line.startswith("dev ")}
    devices = next(line.split()[1:] for line in out.splitlines() if line.startswith("dev "))
    assert lines["mknod /home/user/mem"] == [str(errno.EPERM)]  # no CAP_MKNOD
    assert lines["mknod /tmp/disk"] == [str(errno.EPERM)]
    assert lines["write /proc/sys/kernel/core_pattern"][0] in (str(errno.EACCES), str(errno.EROFS))
    assert lines["sys False"] == []  # no sysfs in the jail at all
    # /dev holds bubblewrap's minimal set: no disks, no memory, no kernel log.
    assert set(devices) <= {"core", "fd", "full", "null", "ptmx", "pts", "random", "shm", "stderr",
                                 "stdin", "stdout", "tty", "urandom", "zero"}, devices
    assert Path("/proc/sys/kernel/hostname").read_text() == hostname
    assert Path("/proc/sys/kernel/core_pattern").read_text() == core_pattern
    # Positive control: the probe reads and writes where it may.
    ok = run(sandbox, "head -c 4 /dev/zero | wc -c && echo x > /dev/null && echo ok")
    assert ok.text().split() == ["4", "ok"]


def test_another_sandbox_upper_dir_and_state_are_unreachable(local_provider):
    """B knows (or guesses) the host path of A's upper dir and record, and
    looks for A through /proc: nothing of A is reached."""
    token = secrets.token_hex(8)
    a = local_provider.create(SandboxSpec(name="victim", ttl_s=600))
    b = local_provider.create(SandboxSpec(name="snoop", ttl_s=600))
    try:
        run(a, f"echo {token} > ~/secret-{token}")
        upper = a.upper_dir
        assert (upper / f"secret-{token}").read_text() == f"{token}\n"  # the guess is right
        record = local_provider.sandboxes_dir / a.id / "meta.json"
        probes = [
            f"cat {upper}/secret-{token}",
            f"ls {upper}",
            f"cat {record}",
            f"ls {local_provider.run_dir}/{a.id}",
            f"echo x > {upper}/secret-{token}",
            f"cat /proc/{a.init_pid}/root/home/user/secret-{token}",
            f"cat /proc/1/root/home/user/secret-{token}",  # B's own init, root-owned
            "ls /proc/1/cwd /proc/1/root",
        ]
        for probe in probes:
            result = run(b, probe)
            assert result.exit_code != 0, probe
            assert token not in result.text(), probe
            assert any(e in result.text("stderr") for e in ("Permission denied", "No such file or directory")), (probe, result)
        found = run(b, f"grep -rls {token} /home /tmp /run /var /dev/shm 2>/dev/null; true")
        assert token not in found.text() and found.text() == ""
        assert (upper / f"secret-{token}").read_text() == f"{token}\n"
        assert run(a, f"cat ~/secret-{token}").text() == f"{token}\n"
    finally:
        a.delete()
        b.delete()


# -- Ray's ports ----------------------------------------------------------------------------


@pytest.fixture
def ray_like_listener() -> Iterator[tuple[int, list]]:
    """A TCP listener on every host address (as Ray's GCS and dashboard listen) at a
    Ray port if free (6379, 8265, 10001), else any; yields the port and its peers."""
    srv = None
    for port in (6379, 8265, 10001, 0):
        for family, addr in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
            try:
                s = socket.socket(family, socket.SOCK_STREAM)
            except OSError:
                continue
            try:
                if family == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # v4 and v6 alike
                s.bind((addr, port))
                s.listen(16)
                srv = s
                break
            except OSError:
                s.close()
        if srv:
            break
    assert srv is not None
    with accepting(srv) as server:
        yield server


@pytest.mark.parametrize("network", [False, True], ids=["no-network", "network"])
def test_ray_ports_on_every_host_address_are_unreachable(local_provider, ray_like_listener, network):
    port, accepted = ray_like_listener
    targets = ["127.0.0.1", "localhost", "10.0.2.2", "0.0.0.0", "::1", *host_addresses()]
    # Positive control: from the host, the listener answers on loopback and on each host address.
    for host in ["127.0.0.1", *host_addresses()]:
        socket.create_connection((host, port), timeout=3).close()
    assert wait_until(lambda: len(accepted) == 1 + len(host_addresses()))
    accepted.clear()
    with local_provider.create(SandboxSpec(ttl_s=600, network=network)) as sb:
        result = run(sb, probe_py(f"""
import socket
for host in {targets!r}:
    try:
        socket.create_connection((host, {port}), timeout=3).close()
        print(host, "CONNECTED")
    except OSError as e:
        print(host, type(e).__name__, e.errno)
"""), timeout=60)
    assert result.exit_code == 0, result
    outcome = dict(line.split(" ", 1) for line in result.text().splitlines())
    assert set(outcome) == set(targets), result.text()
    for host, what in outcome.items():
        assert "CONNECTED" not in what, f"{host}:{port} answered from inside the sandbox"
        refused = {errno.ECONNREFUSED, errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL}
        assert what.split()[-1] in {str(e) for e in refused} or what.startswith("gaierror"), (host, what)
    assert accepted == []


# -- processes: ptrace, kill -1, kernel interfaces, nested namespaces ---------------------


def test_ptrace_reaches_only_the_sandbox_own_processes_and_kill_minus_one_stays_inside(local_provider):
    """The sandbox user is uid 1000 of the host's user namespace: a host process
    of that uid, and another sandbox's, would be fair game without the PID
    namespace. ptrace of them fails; ``kill -9 -1`` kills the sandbox's own only."""
    nap = unique_sleep()
    host_twin = subprocess.Popen(["sleep", nap], user=SANDBOX_UID, group=SANDBOX_UID, extra_groups=[])
    a = local_provider.create(SandboxSpec(name="attacker", ttl_s=600))
    b = local_provider.create(SandboxSpec(name="bystander", ttl_s=600))
    try:
        run(b, f"(sleep {nap} > /dev/null 2>&1 &)")
        b_sleep = wait_until(lambda: [p for p, argv in host_cmdlines().items() if argv == ["sleep", nap] and p != host_twin.pid])
        assert b_sleep, "the bystander's sleep did not start"
        result = run(a, probe_py(f"""
import ctypes, os, subprocess, time
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
def attach(pid):
    r = libc.ptrace(16, pid, None, None)  # PTRACE_ATTACH
    err = ctypes.get_errno()
    if r == 0:
        os.waitpid(pid, 0)
        libc.ptrace(17, pid, None, None)  # PTRACE_DETACH
        return "ATTACHED"
    return os.strerror(err)
own = subprocess.Popen(["sleep", "30"])
time.sleep(0.05)
print("own", attach(own.pid))
own.kill()
for name, pid in (("host-twin", {host_twin.pid}), ("bystander", {b_sleep[0]}), ("pytest", {os.getpid()}), ("init", 1)):
    print(name, attach(pid))
"""))
        out = dict(line.split(" ", 1) for line in result.text().splitlines())
        assert out["own"] == "ATTACHED", result  # positive control: ptrace itself works
        for name in ("host-twin", "bystander", "pytest"):
            assert out[name] in ("No such process",), (name, out[name])  # not even visible
        assert out["init"] == "Operation not permitted"  # the jail's init is root's
        # kill -9 -1: every process the sandbox user may signal, which is its own only.
        run(a, f"(sleep {nap} > /dev/null 2>&1 &); (setsid sleep {nap} > /dev/null 2>&1 &)")
        assert sum(nap in line for line in visible_cmdlines(a)) == 2
        killed = run(a, "kill -9 -1; echo survived")
        assert killed.text() == "survived\n"  # kill(-1) spares the caller
        assert wait_until(lambda: not any(nap in line for line in visible_cmdlines(a)))
        assert host_twin.poll() is None, "kill -9 -1 in a sandbox killed a host process of the sandbox uid"
        assert start_time(b_sleep[0]) is not None, "kill -9 -1 in a sandbox killed another sandbox's process"
        assert any(nap in line for line in visible_cmdlines(b))
        assert run(a, "echo alive").text() == "alive\n"  # the jail itself (root's) is untouched
    finally:
        host_twin.kill()
        host_twin.wait()
        a.delete()
        b.delete()


SYSCALL_PROBE = r"""
import ctypes, os, errno
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
NR = {"x86_64": dict(add_key=248, keyctl=250, request_key=249, perf_event_open=298, bpf=321, clone3=435,
                     init_module=175, finit_module=313, delete_module=176, kexec_load=246, unshare=272, getppid=110),
      "aarch64": dict(add_key=217, keyctl=219, request_key=218, perf_event_open=241, bpf=280, clone3=435,
                      init_module=105, finit_module=273, delete_module=106, kexec_load=104, unshare=97, getppid=173)}[os.uname().machine]
def call(name, *args):
    r = libc.syscall(NR[name], *args)
    return "OK" if r >= 0 else errno.errorcode[ctypes.get_errno()]
attr = (ctypes.c_uint32 * 32)()
attr[0], attr[1], attr[2] = 1, 128, 0  # PERF_TYPE_SOFTWARE, size, PERF_COUNT_SW_CPU_CLOCK
attr[10] = 0b1100000  # exclude_kernel | exclude_hv
print("add_key", call("add_key", b"user", b"leak", b"secret", 6, ctypes.c_long(-4)))  # KEY_SPEC_USER_KEYRING
print("request_key", call("request_key", b"user", b"leak", None, ctypes.c_long(-4)))
print("keyctl", call("keyctl", 0, ctypes.c_long(-4), 0))  # KEYCTL_GET_KEYRING_ID
print("perf_event_open", call("perf_event_open", attr, 0, -1, -1, 0))
print("bpf", call("bpf", 0, attr, 72))
print("clone3", call("clone3", None, 0))
print("init_module", call("init_module", None, 0, b""))
print("finit_module", call("finit_module", 0, b"", 0))
print("delete_module", call("delete_module", b"loop", 0))
print("kexec_load", call("kexec_load", 0, 0, None, 0))
print("unshare-user", call("unshare", 0x10000000))
print("unshare-uts", call("unshare", 0x04000000))
print("getppid", call("getppid"))
"""


def test_kernel_interfaces_are_denied(local_provider):
    """Keyrings (shared by every process of a uid in a user namespace: a channel
    between sandboxes and to the host's user 1000), perf, bpf, modules, kexec."""
    a = local_provider.create(SandboxSpec(ttl_s=600))
    b = local_provider.create(SandboxSpec(ttl_s=600))
    try:
        result = run(a, probe_py(SYSCALL_PROBE))
        assert result.exit_code == 0, result
        got = dict(line.split() for line in result.text().splitlines())
        assert got == {
            "add_key": "EPERM", "request_key": "EPERM", "keyctl": "EPERM", "perf_event_open": "EPERM",
            "bpf": "EPERM", "clone3": "ENOSYS", "init_module": "EPERM", "finit_module": "EPERM",
            "delete_module": "EPERM", "kexec_load": "EPERM", "unshare-user": "EPERM",
            # Positive controls: the calls the filter lets through reach the kernel,
            # which refuses a UTS namespace (no CAP_SYS_ADMIN) and answers getppid.
            "unshare-uts": "EPERM", "getppid": "OK",
        }, got
        # Nothing reached B through the keyring of uid 1000.
        search = run(b, probe_py(r"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
print(libc.syscall(250, 10, ctypes.c_long(-4), b"user", b"leak", 0), ctypes.get_errno())  # KEYCTL_SEARCH
"""))
        assert search.text().split() == ["-1", str(errno.EPERM)], search
    finally:
        a.delete()
        b.delete()


def test_nested_user_namespaces_are_refused(sandbox):  # noqa: F811
    """A user namespace would make the sandbox user root over its own mounts:
    ``unshare -U`` fails in every form, and nothing else that programs need does."""
    for attempt in ("unshare -U true", "unshare -Ur true", "unshare -Urm sh -c 'mount -t tmpfs x /tmp'",
                    "unshare -Urmpf --mount-proc true", "unshare --user --map-root-user --net true"):
        result = run(sandbox, attempt)
        assert result.exit_code != 0, attempt
        assert "Operation not permitted" in result.text("stderr"), (attempt, result)
    status = run(sandbox, "grep -E '^(Seccomp|Seccomp_filters|NoNewPrivs):' /proc/self/status").text()
    fields = dict(line.split(":\t") for line in status.splitlines())
    assert fields["Seccomp"] == "2" and int(fields["Seccomp_filters"]) >= 1, status
    # Threads (glibc tries clone3 first, then falls back to clone), fork, vfork and
    # posix_spawn, background jobs, pipes: all as before.
    ok = run(sandbox, probe_py(r"""
import os, subprocess, threading
out = []
t = threading.Thread(target=out.append, args=("thread",)); t.start(); t.join()
pid = os.fork()
if pid == 0:
    os._exit(3)
out.append("fork%d" % os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
out.append(subprocess.run(["echo", "spawn"], capture_output=True, text=True).stdout.strip())
out.append(str(os.posix_spawnp("true", ["true"], os.environ) > 0))
print(*out)
"""))
    assert ok.text().split() == ["thread", "fork3", "spawn", "True"], ok
    assert run(sandbox, "(sleep 0.05 &) && echo pipe | cat && wait").text() == "pipe\n"
    # The filter is the commands' only: this process, and its other threads, keep no filter.
    assert "Seccomp:\t0" in Path("/proc/self/status").read_text()
    assert subprocess.run(["unshare", "-U", "true"], check=False).returncode == 0


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the i386 and x32 system call ABIs are x86_64's")
def test_nested_user_namespace_through_the_i386_and_x32_abis_is_refused(sandbox):  # noqa: F811
    """A 64-bit process may still make i386 system calls (``int 0x80``, other
    numbers) and x32 ones (a flag bit on the number): the filter checks both."""
    result = run(sandbox, probe_py(r"""
import ctypes, mmap, os
# push rbx; mov eax, NR; mov ebx, ARG; int 0x80; pop rbx; ret
def int80(nr, arg):
    code = b"\x53\xb8" + nr.to_bytes(4, "little") + b"\xbb" + arg.to_bytes(4, "little") + b"\xcd\x80\x5b\xc3"
    buf = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    buf.write(code)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    return ctypes.CFUNCTYPE(ctypes.c_int)(addr)()
print("i386-getpid", int80(20, 0) == os.getpid())
print("i386-unshare-user", int80(310, 0x10000000))
print("i386-clone-user", int80(120, 0x10000000 | 17))
print("i386-add_key", int80(286, 0))
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
print("x32-unshare-user", libc.syscall(0x40000000 | 272, 0x10000000), ctypes.get_errno())
print("userns", os.readlink("/proc/self/ns/user"))
"""))
    assert result.exit_code == 0, result
    got = dict(line.split(" ", 1) for line in result.text().splitlines())
    assert got["i386-getpid"] == "True", got  # positive control: the i386 ABI is there and answers
    assert got["i386-unshare-user"] == str(-errno.EPERM), got
    assert got["i386-clone-user"] == str(-errno.EPERM), got
    assert got["i386-add_key"] == str(-errno.EPERM), got
    assert got["x32-unshare-user"] == f"-1 {errno.ENOSYS}", got
    assert got["userns"] == os.readlink("/proc/self/ns/user")  # still the host's, not a new one


# -- the host's disk ----------------------------------------------------------------------


def test_home_fill_does_not_reach_the_state_disk(sandbox, state_dir):  # noqa: F811
    """The home is an overlay whose writable layer lives in memory (the provider's
    run tmpfs): a sandbox filling it takes nothing of the state directory's disk."""
    free_before = shutil.disk_usage(state_dir).free
    run_before = shutil.disk_usage(sandbox.provider.run_dir).used
    size = 768 << 20
    result = run(sandbox, f"head -c {size} /dev/zero > ~/fill && stat -c %s ~/fill", timeout=60)
    assert result.text().strip() == str(size), result
    grown = shutil.disk_usage(sandbox.provider.run_dir).used - run_before
    free_after = shutil.disk_usage(state_dir).free
    assert grown >= size * 0.9, "the home did not land on the run tmpfs"
    # Other processes may write to this disk meanwhile: a margin well under the size.
    assert free_before - free_after < size // 3, (free_before, free_after)
    assert run(sandbox, "rm ~/fill && echo ok").text() == "ok\n"


# -- daemons that try to outlive delete ---------------------------------------------------


def host_pids_in(pid_ns: str, cgroup_name: str) -> list[str]:
    """Host processes in the given PID namespace or in a cgroup of that name."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ns = os.readlink(entry / "ns" / "pid")
            cgroups = (entry / "cgroup").read_text()
        except OSError:
            continue
        if ns == pid_ns or cgroup_name in cgroups:
            found.append(f"{entry.name}: {ns} {cgroups.strip().splitlines()[:1]}")
    return found


def test_daemons_ignoring_sigterm_do_not_survive_delete(local_provider):
    nap = unique_sleep()
    sb = local_provider.create(SandboxSpec(ttl_s=600))
    init_pid = sb.init_pid
    init_start = start_time(init_pid)
    pid_ns = os.readlink(f"/proc/{init_pid}/ns/pid")
    assert pid_ns != os.readlink("/proc/self/ns/pid")
    daemons = (
        # double fork + setsid + nohup, ignoring every catchable signal
        f"(setsid nohup sh -c 'trap \"\" HUP INT TERM QUIT USR1 USR2; (sleep {nap} & wait) & wait' > /dev/null 2>&1 &)",
        # a daemon that closes its standard streams, forks again and starts a session of its own
        (
            "(setsid python3 -c 'import os, signal, time\n"
            "[signal.signal(s, signal.SIG_IGN) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)]\n"
            "os.closerange(0, 3)\nif os.fork(): os._exit(0)\nos.setsid()\ntime.sleep(3000)' > /dev/null 2>&1 &)"
        ),
    )
    for daemon in daemons:
        assert run(sb, daemon).exit_code == 0
    cgroup_name = sandbox_cgroups(sb.id)[0].name
    # Positive control: the scan finds the daemons (and the jail) while the sandbox lives.
    alive = wait_until(lambda: len(host_pids_in(pid_ns, cgroup_name)) >= 6)
    assert alive, host_pids_in(pid_ns, cgroup_name)
    assert any(nap in line for line in visible_cmdlines(sb))
    sb.delete()
    left = wait_until(lambda: not host_pids_in(pid_ns, cgroup_name) and start_time(init_pid) != init_start, timeout=5)
    assert left, host_pids_in(pid_ns, cgroup_name)
    assert not any(nap in " ".join(argv) for argv in host_cmdlines().values())
    assert not sandbox_cgroups(sb.id)


# -- over HTTP ------------------------------------------------------------------------------


def near_misses(token: str) -> list[str]:
    flip = lambda i: token[:i] + ("A" if token[i] != "A" else "B") + token[i + 1 :]
    return [flip(0), flip(len(token) // 2), flip(len(token) - 1), token[:-1], token + "x", token * 2,
            token.upper() if token.upper() != token else token.lower()]


def test_http_rejects_missing_wrong_and_near_miss_tokens(sandbox_server, http_provider, local_provider):
    url, token = sandbox_server.url, sandbox_server.token
    good = {"Authorization": f"Bearer {token}"}
    with http_provider.create(SandboxSpec(ttl_s=600)) as sb:
        marker = f"probe-{secrets.token_hex(4)}"
        files = f"{url}/v1/sandboxes/{sb.id}/files"
        before = sorted(i.id for i in local_provider.list())
        headers_list = [{}] + [{"Authorization": f"Bearer {t}"} for t in near_misses(token)] + [
            {"Authorization": "Bearer"}, {"Authorization": f"Basic {token}"}, {"Authorization": token},
            {"X-Token": token}]
        for headers in headers_list:
            responses = [
                httpx.put(files, params={"path": marker}, content=b"x", headers=headers),
                httpx.get(files, params={"path": ".bashrc"}, headers=headers),
                httpx.post(f"{url}/v1/sandboxes/{sb.id}/exec", json={"command": f"touch ~/{marker}-exec"}, headers=headers),
                httpx.post(f"{url}/v1/sandboxes", json={}, headers=headers),
                httpx.delete(f"{url}/v1/sandboxes/{sb.id}", headers=headers),
                httpx.get(f"{url}/healthz/../v1/sandboxes", headers=headers),
                httpx.get(f"{url}/v1/sandboxes", headers=headers),
            ]
            for response in responses:
                assert response.status_code in (401, 403), (headers, response.request.url, response.status_code)
        # Nothing happened: no file, no command, no new sandbox, none deleted.
        assert sorted(i.id for i in local_provider.list()) == before
        check = httpx.post(f"{url}/v1/sandboxes/{sb.id}/exec", json={"command": f"ls ~/{marker}*"}, headers=good)
        assert check.status_code == 200 and '"exit_code": 2' in check.text, check.text
        # Positive control: the right token works for the same write.
        assert httpx.put(files, params={"path": marker}, content=b"x", headers=good).status_code == 204
        assert sb.read_file(marker) == b"x"


def test_http_file_paths_cannot_climb_out_of_the_sandbox(sandbox_server, http_provider, tmp_path):
    token = secrets.token_hex(8)  # the marker's content, in no path or message
    marker = tmp_path / f"host-marker-{secrets.token_hex(4)}"
    marker.write_text(f"host secret {token}\n")
    marker.chmod(0o666)  # even a world-writable host file stays out of reach
    before = fingerprint(marker)
    shadow = Path("/etc/shadow")
    shadow_before = fingerprint(shadow) if shadow.exists() else None
    url = sandbox_server.url
    auth = {"Authorization": f"Bearer {sandbox_server.token}"}
    with http_provider.create(SandboxSpec(ttl_s=600)) as sb:
        files = f"{url}/v1/sandboxes/{sb.id}/files"
        sb.exec(f"ln -s / ~/rootlink; ln -s /proc/1/root ~/p1; ln -s /proc/self/root ~/self; ln -s {marker} ~/mlink")
        climbs = [str(marker), f"../../../../..{marker}", f"/home/user/../..{marker}", f"rootlink{marker}",
                  f"p1{marker}", f"self{marker}", "mlink", f"/proc/1/root{marker}", f"/proc/self/cwd/../..{marker}"]
        for path in climbs:
            response = httpx.get(files, params={"path": path}, headers=auth)
            assert token.encode() not in response.content, path
            assert response.status_code in (404, 422), (path, response.status_code)
        # URL-encoded dots, sent raw (decoded once by the server, as a client cannot help).
        for raw in (f"%2e%2e/%2e%2e/%2e%2e/%2e%2e{marker}", f"%2e%2e%2f%2e%2e%2f%2e%2e%2f%2e%2e{marker}"):
            response = httpx.get(f"{files}?path={raw}", headers=auth)
            assert token.encode() not in response.content and response.status_code == 422, raw
        shadow_read = httpx.get(files, params={"path": "../../etc/shadow"}, headers=auth)
        assert shadow_read.status_code == 200 and shadow_read.content == b""  # the jail's empty one
        # Writes that climb: into the marker, /etc, /usr, the host through /proc.
        writes = [*climbs, "../../etc/shadow", "/etc/passwd", "../../../usr/bin/evil", "/proc/1/root/etc/passwd",
                  "/proc/sys/kernel/core_pattern", f"%2e%2e/%2e%2e{marker}"]
        for path in writes:
            httpx.put(files, params={"path": path}, content=b"pwned " + token.encode(), headers=auth)
        assert fingerprint(marker) == before, "a write through the server reached a host file"
        if shadow_before:
            assert fingerprint(shadow) == shadow_before
        assert not Path("/usr/bin/evil").exists()
        assert token not in Path("/proc/sys/kernel/core_pattern").read_text()
        # The sandbox id and snapshot names do not climb either.
        for sid in ("..", "..%2f..%2fetc", "sb_0000000000%2f..%2f..", "%2e%2e"):
            assert httpx.get(f"{url}/v1/sandboxes/{sid}/files?path=x", headers=auth).status_code in (404, 422), sid
        decoy = tmp_path / "decoy.json"
        decoy.write_text('{"name": "decoy"}')
        rel = os.path.relpath(decoy.with_suffix(""), sandbox_server.state_dir / "snapshots")
        for name in (rel, rel.replace("/", "%2f"), str(decoy.with_suffix(""))):
            assert httpx.delete(f"{url}/v1/snapshots/{name}", headers=auth).status_code >= 400, name
            assert httpx.get(f"{url}/v1/snapshots/{name}", headers=auth).status_code >= 400, name
        assert decoy.exists()
        # Positive control: paths inside the sandbox work, through a symlink too.
        sb.write_file("inside/f", token.encode())
        sb.exec("ln -s inside/f ~/flink")
        assert httpx.get(files, params={"path": "flink"}, headers=auth).content == token.encode()

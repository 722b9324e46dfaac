"""Starting, entering and killing one jail: bubblewrap over an overlayfs home.

The jail is a long-lived init (a sleeping holder shell, the PID 1 of the jail)
that owns the sandbox's PID, mount, IPC, UTS and network namespaces. Commands enter
those namespaces with nsenter as the sandbox user, so many execs share one
filesystem view and background processes live on between them, as in a VM.

The home is an overlay of read-only layers under an upper dir that lives on
the provider's in-memory "run" filesystem. The overlay is mounted on the host
only long enough for bubblewrap to bind it, then detached: from then on it
exists only inside the jail and vanishes with it. The run and layer
directories are also bound, root-only and at the same paths, into the jail, so
that the backend can later stack a new overlay there (see ``restack``): that is
what makes a fork O(1) whatever the size of the sandbox's changes.
"""

from __future__ import annotations

import ctypes
import ipaddress
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from harness.errors import MissingDependency, SandboxStartError, SandboxUnavailable

SANDBOX_UID = 1000
SANDBOX_GID = 1000
_MS_NOSUID = 2
_MS_NODEV = 4
_MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]

# Tools the jail needs, with the Debian package that ships each.
REQUIRED_TOOLS = {"bwrap": "bubblewrap", "nsenter": "util-linux", "unshare": "util-linux"}
NETWORK_TOOLS = {"slirp4netns": "slirp4netns", "ip": "iproute2"}


def check_host(network: bool = False) -> None:
    """Raise a one-line error naming the fix if this host cannot run jails."""
    if os.geteuid() != 0:
        raise SandboxUnavailable(
            "the local sandbox backend needs root (it mounts overlayfs and manages cgroups): run as root or with sudo"
        )
    tools = {**REQUIRED_TOOLS, **(NETWORK_TOOLS if network else {})}
    for tool, package in tools.items():
        if shutil.which(tool) is None:
            raise MissingDependency(tool, f"apt-get install -y {package}")
    try:
        has_overlay = "overlay" in Path("/proc/filesystems").read_text()
    except OSError:
        has_overlay = False
    if not has_overlay:
        subprocess.run(["modprobe", "overlay"], capture_output=True)
        if "overlay" not in Path("/proc/filesystems").read_text():
            raise SandboxUnavailable("the kernel has no overlayfs: load it with `modprobe overlay`")


def process_start_time(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (clock ticks since boot), to guard against pid reuse."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat_line.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):  # a zombie is dead, whatever its parent has not reaped yet
        return None
    return int(fields[19])


def alive(pid: int | None, start_time: int | None) -> bool:
    return bool(pid) and process_start_time(pid) == start_time  # type: ignore[arg-type]


@dataclass(frozen=True)
class JailPaths:
    merged: Path  # where the overlay is mounted on the host while the jail starts
    upper: Path
    work: Path
    lowers: tuple[Path, ...]  # top first, as overlayfs wants them
    etc: Path  # generated passwd, group, hosts, resolv.conf
    state_binds: tuple[Path, ...]  # root-only dirs bound at the same path (run, layers, records)
    record: Path  # the sandbox's record directory: the jail ends soon after it disappears


@dataclass(frozen=True)
class Jail:
    init_pid: int
    init_start: int
    slirp_pid: int | None = None
    slirp_start: int | None = None


def overlay_options(lowers: Sequence[Path], upper: Path, work: Path) -> str:
    # redirect_dir/index/metacopy off: a layer must stay valid on its own when
    # it is later stacked under other layers (snapshots, forks).
    lower = ":".join(str(p) for p in lowers)
    return f"lowerdir={lower},upperdir={upper},workdir={work},redirect_dir=off,index=off,metacopy=off"


def mount_tmpfs(target: Path, size_bytes: int) -> None:
    _mount("tmpfs", target, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={size_bytes},mode=0700")


def _mount(source: str, target: Path, fstype: str, flags: int, options: str) -> None:
    if _libc.mount(source.encode(), str(target).encode(), fstype.encode(), flags, options.encode()) != 0:
        err = ctypes.get_errno()
        raise SandboxStartError(f"mounting {fstype} on {target} failed: {os.strerror(err)}")


def detach(target: Path) -> None:
    """Lazily unmount ``target``; nothing happens if it is not a mount point."""
    _libc.umount2(str(target).encode(), _MNT_DETACH)


def detach_leftovers(sandbox_dir: Path) -> None:
    """Detach a host mount that a start interrupted by a crash may have left."""
    detach(sandbox_dir / "merged")


def restack(init_pid: int, lowers: Sequence[Path], upper: Path, work: Path) -> None:
    """Mount a new overlay over a running jail's home, inside its mount namespace.
    The paths are the same there as on the host (see ``state_binds``)."""
    proc = subprocess.run(
        ["nsenter", "-t", str(init_pid), "-m", "--", "mount", "-t", "overlay", "overlay",
         "-o", overlay_options(lowers, upper, work), "/home/user"],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SandboxStartError(f"restacking the home of jail {init_pid} failed: {proc.stderr.strip()}")


def _root_links() -> list[str]:
    """Mirror the host's top-level /bin, /lib... : symlinks on merged-/usr systems, binds elsewhere."""
    args: list[str] = []
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = Path("/") / name
        if host.is_symlink():
            args += ["--symlink", os.readlink(host), f"/{name}"]
        elif host.is_dir():
            args += ["--ro-bind", str(host), f"/{name}"]
    return args


def bwrap_args(
    paths: JailPaths,
    *,
    hostname: str,
    tmp_bytes: int,
    info_fd: int,
    lifetime_s: float | None = None,
    die_with_parent: bool = False,
) -> list[str]:
    """``lifetime_s``: the holder exits after that long (or at the deadline in the
    record's ``deadline`` file, see ``write_deadline``), which ends the jail (see
    ``_holder_script``).

    ``--as-pid-1``: the holder itself is the jail's PID 1, not a child of
    bubblewrap's own init. That init only exits once it has no children left, so
    a daemon that called setsid (re-parented to it) kept the jail, its namespaces
    and the daemon alive after the holder had exited. When a PID 1 exits, the
    kernel kills every process of its namespace: now the holder's exit ends the
    jail, whatever runs in it. As PID 1 the holder also reaps the orphans
    re-parented to it: dash waits for its foreground ``sleep`` with
    ``wait3(-1)``, which reaps any child and discards the unknown ones, so the
    zombies of daemons do not pile up against the pids limit (see
    test_local's zombie test)."""
    args = [
        "bwrap",
        "--unshare-pid", "--as-pid-1", "--unshare-ipc", "--unshare-uts", "--unshare-net",
        "--hostname", hostname,
        "--cap-drop", "ALL",
        *(["--die-with-parent"] if die_with_parent else []),
        "--ro-bind", "/usr", "/usr",
        *_root_links(),
        "--ro-bind", "/etc", "/etc",
    ]
    for name in ("passwd", "group", "hosts", "resolv.conf"):
        args += ["--ro-bind", str(paths.etc / name), f"/etc/{name}"]
    for secret in ("shadow", "gshadow", "shadow-", "gshadow-"):
        if Path("/etc", secret).exists():
            args += ["--ro-bind", str(paths.etc / "empty"), f"/etc/{secret}"]
    args += [
        "--proc", "/proc",
        "--dev", "/dev",
        "--size", str(tmp_bytes), "--perms", "1777", "--tmpfs", "/tmp",
        "--dir", "/var", "--symlink", "../tmp", "/var/tmp",
        "--dir", "/run",
        "--perms", "755", "--dir", "/home",
        "--bind", str(paths.merged), "/home/user",
    ]
    for path in paths.state_binds:
        args += ["--bind", str(path), str(path)]
    args += [
        "--chdir", "/home/user",
        "--info-fd", str(info_fd),
        "--", "/bin/sh", "-c", _holder_script(paths.record, lifetime_s),
    ]
    return args


#: How often a jail's holder checks that its sandbox still has a record and
#: that its deadline has not passed.
HOLDER_CHECK_S = 5
#: The file in a sandbox's record directory that holds the jail's deadline, in
#: whole seconds of the boot clock (``/proc/uptime``, which the holder can read
#: without starting a process), read by the holder at every check.
DEADLINE_FILE = "deadline"


def boot_clock() -> float:
    """Seconds since boot (including suspend), the clock of ``/proc/uptime``."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def boot_deadline(lifetime_s: float) -> int:
    """The boot-clock second at which a jail that must live ``lifetime_s`` more ends."""
    return math.ceil(boot_clock() + max(lifetime_s, 0.0))


def write_deadline(record: Path, lifetime_s: float) -> None:
    """Move a running jail's deadline to ``lifetime_s`` from now (atomically: the
    holder reads the file at every check). Raises OSError (e.g. a full disk)."""
    tmp = record / f".{DEADLINE_FILE}-{os.getpid()}-{time.monotonic_ns()}"
    try:
        tmp.write_text(f"{boot_deadline(lifetime_s)}\n")
        os.rename(tmp, record / DEADLINE_FILE)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _holder_script(record: Path, lifetime_s: float | None) -> str:
    """The jail's holder: it lives while the sandbox's record exists and, with a
    TTL, until its deadline; when it exits, the jail ends (it is the jail's PID 1,
    see ``bwrap_args``). So a sandbox whose record was lost (its state directory
    deleted, a create killed half-way) cannot outlive it by more than a few
    seconds, whether or not any harness process ever runs again. The deadline
    starts as ``lifetime_s`` from now; a ``deadline`` file in the record directory
    overrides it (a claimed warm jail gets its own TTL's deadline that way).
    Everything but ``sleep`` is a shell builtin: no process per check. The records
    directory is bound root-only into the jail at its host path; only the holder,
    uid 0 without capabilities, reads it. Its stderr goes to /dev/null: the pipe it
    inherits from bubblewrap is closed once the jail has started."""
    r = shlex.quote(str(record))
    d = "" if lifetime_s is None else str(boot_deadline(lifetime_s))
    return (  # one line: it is the jail's PID 1 command line, as `ps` shows it
        f"exec 2>/dev/null; r={r}; d={d}; "
        f"while [ -d \"$r\" ]; do "
        f"read x < \"$r/{DEADLINE_FILE}\" && case $x in ''|*[!0-9]*) ;; *) d=$x;; esac; "
        f"if [ -n \"$d\" ]; then read u _ < /proc/uptime; [ \"${{u%.*}}\" -lt \"$d\" ] || break; fi; "
        f"sleep {HOLDER_CHECK_S}; "
        f"done"
    )


def write_etc(etc: Path, network: bool) -> None:
    """Write the jail's own passwd, group, hosts and resolv.conf (atomically: many
    sandboxes may start at once)."""
    tmp = etc.with_name(f".{etc.name}-{os.getpid()}-{time.monotonic_ns()}")
    files = {
        "passwd": f"root:x:0:0:root:/root:/bin/sh\nuser:x:{SANDBOX_UID}:{SANDBOX_GID}:user:/home/user:/bin/sh\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
        "group": f"root:x:0:\nuser:x:{SANDBOX_GID}:\nnogroup:x:65534:\n",
        "hosts": "127.0.0.1\tlocalhost\n::1\tlocalhost\n",
        "resolv.conf": "nameserver 10.0.2.3\n" if network else "",
        "empty": "",
    }
    tmp.mkdir(parents=True)
    try:
        for name, text in files.items():
            (tmp / name).write_text(text)
        os.rename(tmp, etc)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk leaves no half-written copy
        if not etc.is_dir():
            raise
        # else another process won the race; its files are the same
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def start(
    paths: JailPaths,
    *,
    hostname: str,
    tmp_bytes: int,
    network: bool,
    cgroup_procs: Sequence[Path],
    lifetime_s: float | None = None,
    die_with_parent: bool = False,
    ready_timeout: float = 30.0,
) -> Jail:
    """Start a jail over existing upper and work dirs; return once commands can enter it."""
    _mount("overlay", paths.merged, "overlay", 0, overlay_options(paths.lowers, paths.upper, paths.work))
    fds: list[int] = []
    try:
        info_r, info_w = os.pipe()
        fds += [info_r, info_w]
        exit_r = None
        pass_fds = [info_w]
        if network:
            # slirp4netns exits when every copy of exit_w is closed, i.e. with the jail.
            exit_r, exit_w = os.pipe()
            fds += [exit_r, exit_w]
            pass_fds.append(exit_w)
        try:
            proc = subprocess.Popen(
                bwrap_args(
                    paths, hostname=hostname, tmp_bytes=tmp_bytes, info_fd=info_w,
                    lifetime_s=lifetime_s, die_with_parent=die_with_parent,
                ),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                pass_fds=pass_fds,
                start_new_session=True,
                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"},
            )
        except OSError as exc:
            raise SandboxStartError(f"could not start the jail: {exc}") from exc
        os.close(info_w)
        fds.remove(info_w)
        return _await_ready(proc, info_r, exit_r, network, ready_timeout, cgroup_procs)
    finally:
        # Once bubblewrap has bound it (or failed), the host needs the mount no more.
        detach(paths.merged)
        for fd in fds:
            os.close(fd)


def join_cgroups_argv(cgroup_procs: Sequence[Path]) -> list[str]:
    """A tiny host shell that moves itself into the cgroups, then execs the rest,
    so no process of the command ever runs outside them. Cheaper than a Python
    preexec hook, which would force fork() of this whole process over vfork()."""
    if not cgroup_procs:
        return []
    joins = "; ".join(f"echo 0 > {shlex.quote(str(p))}" for p in cgroup_procs)
    return ["/bin/sh", "-c", f'{joins} && exec "$@"', "join"]


def _holder_pid(init_pid: int) -> int | None:
    """The pid of the jail's holder (its PID 1, so ``init_pid`` itself) once
    bubblewrap has finished setting up and exec'd it (its name turns from bwrap
    to sh)."""
    try:
        if Path(f"/proc/{init_pid}/comm").read_text().strip() == "sh":
            return init_pid
    except OSError:
        pass
    return None


def _await_ready(
    proc: subprocess.Popen,
    info_r: int,
    exit_r: int | None,
    network: bool,
    timeout: float,
    cgroup_procs: Sequence[Path],
) -> Jail:
    try:
        info = _read_json(info_r, timeout)
        init_pid = int(info["child-pid"]) if info else 0
        holder = None
        deadline = time.monotonic() + timeout
        pause = 0.00005
        while init_pid and proc.poll() is None and time.monotonic() < deadline:
            holder = _holder_pid(init_pid)
            if holder:
                break
            time.sleep(pause)
            pause = min(pause * 2, 0.001)
        if not holder:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            err = proc.stderr.read().decode(errors="replace").strip()  # type: ignore[union-attr]
            raise SandboxStartError(f"the jail did not start: {err or 'timed out'}")
        # Only the sleeping holder exists yet, so moving it into the cgroups
        # now is as safe as starting there, and cheaper.
        for procs in cgroup_procs:
            procs.write_text(str(init_pid))
        init_start = process_start_time(init_pid) or 0
        slirp_pid = slirp_start = None
        if network:
            assert exit_r is not None
            slirp_pid = _start_slirp(init_pid, exit_r, timeout)
            slirp_start = process_start_time(slirp_pid)
            _block_local_networks(init_pid)
        return Jail(
            init_pid=init_pid,
            init_start=init_start,
            slirp_pid=slirp_pid,
            slirp_start=slirp_start,
        )
    except BaseException:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        raise
    finally:
        if proc.stderr is not None:
            proc.stderr.close()
        # The Popen object is dropped; subprocess reaps bubblewrap on a later call.


def _read_json(fd: int, timeout: float) -> dict | None:
    import select

    buf = b""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 4096)
        if not chunk:
            return None
        buf += chunk
        try:
            return json.loads(buf)
        except ValueError:
            continue


#: Destinations a networked sandbox must not reach even though slirp4netns would
#: carry them: private ranges (a cluster's other nodes and services), CGNAT and
#: link-local (cloud metadata endpoints). The host's own addresses and subnets
#: are added at start. slirp's own 10.0.2.0/24 stays reachable: its route is
#: more specific.
BLOCKED_PREFIXES = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "169.254.0.0/16")


def _host_prefixes() -> list[str]:
    """The host's IPv4 addresses and the subnets they are on."""
    proc = subprocess.run(["ip", "-j", "-4", "addr", "show"], capture_output=True, text=True)
    out: list[str] = []
    try:
        for link in json.loads(proc.stdout or "[]"):
            for addr in link.get("addr_info", []):
                local, plen = addr.get("local"), addr.get("prefixlen")
                if local and not local.startswith("127."):
                    out.append(f"{local}/32")
                    if plen:
                        out.append(str(ipaddress.ip_network(f"{local}/{plen}", strict=False)))
    except (ValueError, TypeError):
        pass
    return out


def _block_local_networks(init_pid: int) -> None:
    """Unreachable routes in the sandbox's own network namespace: services on the
    host's non-loopback addresses (Ray's GCS listens on all of them) and on the
    local network stay out of reach. The sandbox user cannot change its routes."""
    prefixes = dict.fromkeys([*_host_prefixes(), *BLOCKED_PREFIXES])
    script = "".join(f"route add unreachable {p}\n" for p in prefixes)
    proc = subprocess.run(
        ["nsenter", "-t", str(init_pid), "-n", "--", "ip", "-batch", "-"],
        input=script,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SandboxStartError(f"could not fence the sandbox network off the host's: {proc.stderr.strip()}")


def _start_slirp(init_pid: int, exit_fd: int, timeout: float) -> int:
    ready_r, ready_w = os.pipe()
    try:
        proc = subprocess.Popen(
            [
                "slirp4netns", "--configure", "--mtu=65520", "--disable-host-loopback", "--enable-sandbox", "--enable-seccomp",
                f"--exit-fd={exit_fd}", f"--ready-fd={ready_w}", str(init_pid), "tap0",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            pass_fds=[exit_fd, ready_w],
            start_new_session=True,
        )
    finally:
        os.close(ready_w)
    import select

    try:
        ok = bool(select.select([ready_r], [], [], timeout)[0]) and os.read(ready_r, 1) == b"1"
    finally:
        os.close(ready_r)
    if not ok:
        proc.kill()
        err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""  # type: ignore[union-attr]
        proc.wait()
        raise SandboxStartError(f"slirp4netns did not configure the sandbox network: {err or 'timed out'}")
    if proc.stderr is not None:
        proc.stderr.close()
    return proc.pid


def enter_argv(init_pid: int, command: str, cwd: str | None, cgroup_procs: Sequence[Path] = ()) -> list[str]:
    """argv that runs ``sh -c command`` inside the jail as the sandbox user.

    Every mount in the jail is nosuid (bubblewrap's rule), so after nsenter drops
    to the sandbox uid no capability can come back. The command starts with a
    ``cd`` on a line of its own: the home may have been restacked since the
    jail started, and a path lookup is what finds the top overlay."""
    prologue = f"cd -- {shlex.quote(cwd or '/home/user')} || exit 2\n"
    return join_cgroups_argv(cgroup_procs) + [
        "nsenter", "-t", str(init_pid), "-m", "-u", "-i", "-n", "-p", "-r",
        "-S", str(SANDBOX_UID), "-G", str(SANDBOX_GID), "--",
        "/bin/sh", "-c", prologue + command,
    ]


def kill(jail_init_pid: int | None, init_start: int | None, *, wait_s: float = 5.0) -> None:
    """SIGKILL the jail's PID 1: the kernel then kills every process in its PID namespace."""
    if not jail_init_pid or not alive(jail_init_pid, init_start):
        return
    try:
        os.kill(jail_init_pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + wait_s
    while alive(jail_init_pid, init_start) and time.monotonic() < deadline:
        time.sleep(0.002)


def kill_unrecorded(sandbox_dir: Path) -> None:
    """SIGKILL the bubblewrap processes of a jail whose start was abandoned before
    its pid was recorded (its starter was killed): they name the sandbox's
    ``merged`` dir on their command line. One may wait forever for its dead
    launcher, in the jail's namespaces but in no cgroup yet. If bubblewrap got as
    far as starting the holder (the jail's PID 1, which names the record dir), it
    is killed too, which ends the PID namespace at once rather than at its next
    check of the record."""
    needle = str(sandbox_dir / "merged").encode()
    holder = f"r={shlex.quote(str(sandbox_dir))};".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if (argv[0] == b"bwrap" and needle in argv) or (len(argv) > 2 and holder in argv[2]):
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ValueError):
            continue


def kill_pid(pid: int | None, start_time: int | None) -> None:
    if pid and alive(pid, start_time):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

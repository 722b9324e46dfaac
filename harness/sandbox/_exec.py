"""Running one command in a jail: spawn, stream, time out, collect.

The command's processes live in a fresh cgroup leaf of the sandbox, so a
timeout can kill exactly them, daemons that left the session included. They are
spawned by a host thread that carries the sandbox's seccomp filter (see
``_seccomp.confine_thread``), so every one of them inherits it.

A command in flight dies with the process that runs it (see "Commands die with
their caller" below).
"""

from __future__ import annotations

import logging
import os
import secrets
import selectors
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from harness.errors import HarnessError, SandboxError
from harness.sandbox import _jail, _seccomp
from harness.sandbox._cgroup import PARENT, Layout, SandboxCgroup, _pids_in
from harness.sandbox.base import TIMEOUT_EXIT_CODE, ExecResult, OutputCallback

log = logging.getLogger(__name__)

#: After a command exits, how long to keep reading output that its background
#: children may still hold open before giving up on them.
_DRAIN_GRACE_S = 0.05


#: Threads that spawn commands: each carries the seccomp filter, the rest of the
#: process does not. A spawn takes a millisecond or so, so a few serve many callers.
_SPAWNERS = 4
_spawner: tuple[int, ThreadPoolExecutor] | None = None
_spawner_lock = threading.Lock()
_confined = threading.local()


def _spawn(argv: list[str], **popen_kwargs) -> Future[subprocess.Popen]:
    """``subprocess.Popen`` on a confined spawner thread (the child inherits its filter)."""
    global _spawner
    with _spawner_lock:
        if _spawner is None or _spawner[0] != os.getpid():  # none yet, or a forked copy of this process
            _spawner = (os.getpid(), ThreadPoolExecutor(_SPAWNERS, "sandbox-spawn"))
        pool = _spawner[1]
    return pool.submit(_confined_popen, argv, popen_kwargs)


def _confined_popen(argv: list[str], popen_kwargs: dict) -> subprocess.Popen:
    if not getattr(_confined, "done", False):
        _seccomp.confine_thread()  # raises, and spawns nothing, if the filter cannot be installed
        _confined.done = True
    return subprocess.Popen(argv, **popen_kwargs)


# -- Commands die with their caller -------------------------------------------------
#
# A command runs as nsenter (a host process, child of this one) and, below it
# in the jail, the command's shell and whatever that starts. If this process
# dies mid-call (a `harness serve` SIGKILLed, a worker OOM-killed), nobody reads
# the result: the command must not run on unseen. A parent-death signal cannot
# do it: nsenter would get it, but it neither forwards signals nor kills its
# child when it dies (util-linux 2.38), a PDEATHSIG set in the jail reaches one
# process and not its children or setsid daemons, and it fires on the death of
# the parent *thread*. What finds every process of a command, daemons included,
# is its cgroup leaf, and only root on the host can kill that.
#
# So each process that runs commands starts one watchdog ("reaper", a shell
# waiting in a session of its own) holding the read end of a pipe whose
# only write end this process keeps (close-on-exec, closed in forked children).
# The kernel closes it when this process dies, however it dies, and the reaper
# reads EOF: then it kills the commands this process had in flight. Every leaf's
# name carries its spawner (``x<pid>-<start time>-<random>``), and a command is
# in flight while its nsenter, the one process of the leaf in the host's PID
# namespace, lives: a finished command's leaf keeps only the background
# processes it left on purpose, and those live on as after any exec. The kill
# spares nsenter (it exits once its child has died; see ``SandboxCgroup.kill``).
# ``reap_orphans`` is also run by gc and at provider start, for a reaper that
# was itself killed. One process per caller process, none per command: the
# exec round trip costs nothing more.

# The reaper waits in sh (a shell's start costs ~1 ms, against ~20 ms of CPU for
# Python's: every `harness sandbox exec` from a script starts one) and runs Python
# only when its caller has died.
_REAPER_WAIT = 'trap "" INT HUP TERM; while read -r _; do :; done; exec "$@"'
_REAPER_SOURCE = """
import sys
sys.path.insert(0, sys.argv[2])
from harness.sandbox._exec import reap_owner
reap_owner(sys.argv[1])
"""
#: The reaper's name in `ps` ($0 of its shell).
REAPER_NAME = "harness-exec-reaper"

_reaper: tuple[int, str, int | None] | None = None  # (pid, owner tag, write end of the pipe)
_reaper_lock = threading.Lock()


def _owner_tag() -> str:
    """``<pid>-<start time>`` of this process, after making sure its reaper runs."""
    global _reaper
    with _reaper_lock:
        if _reaper is None or _reaper[0] != os.getpid():
            pid = os.getpid()
            tag = f"{pid}-{_jail.process_start_time(pid)}"
            _reaper = (pid, tag, _start_reaper(tag))
        return _reaper[1]


def _start_reaper(tag: str) -> int | None:
    read_end, write_end = os.pipe()  # neither is inherited by other children
    try:
        subprocess.Popen(
            ["/bin/sh", "-c", _REAPER_WAIT, REAPER_NAME,
             sys.executable, "-I", "-c", _REAPER_SOURCE, tag, str(Path(__file__).resolve().parents[2])],
            stdin=read_end,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            cwd="/",  # pins no directory (a mount point someone wants to unmount)
        )
    except OSError as exc:  # commands still run; gc kills those of a dead caller
        log.warning("could not start the watchdog that stops this process's commands when it dies: %s", exc)
        os.close(write_end)
        return None
    finally:
        os.close(read_end)
    return write_end


def _forget_reaper_in_child() -> None:
    """A forked child gets its own reaper on its first command; the parent's pipe
    must close when the parent dies, not when the child does."""
    global _reaper
    if _reaper is not None and _reaper[2] is not None:
        try:
            os.close(_reaper[2])
        except OSError:
            pass
    _reaper = None


os.register_at_fork(after_in_child=_forget_reaper_in_child)


def _exec_leaves(layout: Layout, groups: str) -> list[Path]:
    if layout.version == 2 and layout.v2_root is not None:
        base = layout.v2_root / PARENT
    elif layout.version == 1:
        base = dict(layout.v1)["freezer"] / PARENT
    else:
        return []
    leaves: list[Path] = []
    try:
        sandboxes = list(base.glob(groups))
    except FileNotFoundError:
        return leaves
    for group in sandboxes:
        try:
            leaves += group.glob("x*-*-*")
        except FileNotFoundError:
            continue  # the sandbox was deleted meanwhile, by this or another process
    return leaves


def _host_side(pids: list[int]) -> list[int]:
    """The processes among ``pids`` in this (the host's) PID namespace: nsenter."""
    try:
        ours = os.readlink("/proc/self/ns/pid")
    except OSError:
        return []
    out = []
    for pid in pids:
        try:
            if os.readlink(f"/proc/{pid}/ns/pid") == ours:
                out.append(pid)
        except OSError:
            continue
    return out


def reap_orphans(layout: Layout, groups: str = "*", owner: str | None = None) -> int:
    """Kill the commands in flight whose spawning process is dead (or, with
    ``owner``, those of that process); returns how many leaves still had one.
    ``groups`` globs the sandbox cgroups to look at."""
    found = 0
    for leaf in _exec_leaves(layout, groups):
        pid, start, _ = leaf.name[1:].split("-", 2)
        if owner is not None:
            if f"{pid}-{start}" != owner:
                continue
        elif not pid.isdigit() or not start.isdigit() or _jail.alive(int(pid), int(start)):
            continue
        cg = SandboxCgroup(layout, leaf.parent.name)
        nsenter = _host_side(_pids_in(leaf))
        if not nsenter:  # finished: what it left running in the background stays
            cg.remove_leaf(leaf.name)
            continue
        found += 1
        cg.kill(leaf.name, spare=nsenter[0])
    return found


def reap_owner(owner: str, wait_s: float = 10.0) -> None:
    """The reaper's work once its process died: kill that process's commands in
    flight until none is left (one may have been starting as it died)."""
    layout = Layout.detect()
    deadline = time.monotonic() + wait_s
    while reap_orphans(layout, owner=owner) and time.monotonic() < deadline:
        time.sleep(0.05)
    reap_orphans(layout, owner=owner)  # drops the leaves emptied meanwhile


def run_in_jail(
    init_pid: int,
    cg: SandboxCgroup,
    command: str,
    *,
    env: Mapping[str, str],
    cwd: str | None,
    stdin: bytes | None,
    timeout: float | None,
    on_output: OutputCallback | None,
    max_output_bytes: int,
) -> ExecResult:
    leaf = f"x{_owner_tag()}-{secrets.token_hex(6)}"
    started = time.monotonic()
    spawned = _spawn(
        _jail.enter_argv(init_pid, command, cwd, cg.leaf_procs(leaf)),
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(env),
        start_new_session=True,
    )
    try:
        proc = spawned.result()
    except OSError as exc:
        cg.remove_leaf(leaf)
        raise SandboxError(f"could not run a command in the jail of pid {init_pid}: {exc}") from exc
    except BaseException:
        # Interrupted (e.g. Ctrl-C) while the spawner worked: the command must not
        # then run unattended, so it dies with us as below.
        try:
            late = spawned.result(timeout=10)
        except (OSError, HarnessError, TimeoutError):  # it never started: nothing to stop
            late = None
        if late is not None:
            cg.kill(leaf, spare=late.pid)
            late.wait()
        cg.remove_leaf(leaf)
        raise
    try:
        out, err, timed_out, truncated = _collect(proc, stdin, timeout, on_output, max_output_bytes, lambda: cg.kill(leaf, spare=proc.pid))
    finally:
        if proc.poll() is None:  # interrupted (e.g. Ctrl-C): the command dies with us
            cg.kill(leaf, spare=proc.pid)
            proc.wait()
        cg.remove_leaf(leaf)
    code = proc.returncode
    if timed_out:
        code = TIMEOUT_EXIT_CODE
    elif code < 0:
        code = 128 - code
    return ExecResult(
        exit_code=code,
        stdout=out,
        stderr=err,
        duration_s=time.monotonic() - started,
        timed_out=timed_out,
        truncated=truncated,
    )


def _collect(proc, stdin, timeout, on_output, cap, kill):
    """Read both pipes until they close, the timeout fires, or the command has
    exited and its background children still hold them after a short grace."""
    if stdin is not None:

        def feed() -> None:
            try:
                proc.stdin.write(stdin)
            except (BrokenPipeError, OSError):
                pass
            finally:
                try:
                    proc.stdin.close()
                except OSError:
                    pass

        threading.Thread(target=feed, daemon=True).start()
    bufs = {"stdout": bytearray(), "stderr": bytearray()}
    truncated = False
    timed_out = False
    deadline = time.monotonic() + timeout if timeout else None
    exited_at: float | None = None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
        sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
        while sel.get_map():
            now = time.monotonic()
            if deadline is not None and now >= deadline and not timed_out:
                timed_out = True
                kill()
                deadline = now + 5  # the pipes close once the tree is dead
            elif timed_out and deadline is not None and now >= deadline:
                break
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > _DRAIN_GRACE_S:
                break
            wait = 0.05 if exited_at is None else _DRAIN_GRACE_S
            if deadline is not None:
                wait = min(wait, max(0.0, deadline - now))
            for key, _ in sel.select(wait):
                chunk = os.read(key.fileobj.fileno(), 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                if on_output is not None:
                    on_output(key.data, chunk)
                buf = bufs[key.data]
                room = cap - len(buf)
                if room > 0:
                    buf += chunk[:room]
                if len(chunk) > room:
                    truncated = True
    proc.stdout.close()
    proc.stderr.close()
    proc.wait()
    return bytes(bufs["stdout"]), bytes(bufs["stderr"]), timed_out, truncated

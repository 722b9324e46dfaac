"""Running one command in a jail: spawn, stream, time out, collect.

The command's processes live in a fresh cgroup leaf of the sandbox, so a
timeout can kill exactly them, daemons that left the session included. They are
spawned by a host thread that carries the sandbox's seccomp filter (see
``_jail.confine_thread``), so every one of them inherits it.
"""

from __future__ import annotations

import os
import secrets
import selectors
import subprocess
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor

from harness.errors import HarnessError, SandboxError
from harness.sandbox import _jail
from harness.sandbox._cgroup import SandboxCgroup
from harness.sandbox.base import TIMEOUT_EXIT_CODE, ExecResult, OutputCallback

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
        _jail.confine_thread()  # raises, and spawns nothing, if the filter cannot be installed
        _confined.done = True
    return subprocess.Popen(argv, **popen_kwargs)


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
    leaf = "x" + secrets.token_hex(6)
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

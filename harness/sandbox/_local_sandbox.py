"""A handle on one local sandbox: commands, files, snapshots and forks."""

from __future__ import annotations

import os
import shlex
import shutil
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from harness.errors import SandboxFileError, SandboxNotFound
from harness.sandbox import _jail
from harness.sandbox._exec import run_in_jail
from harness.sandbox._record import SandboxRecord
from harness.sandbox._store import LayerStore, check_name, copy_tree
from harness.sandbox.base import (
    HOME,
    ExecResult,
    OutputCallback,
    Sandbox,
    SandboxInfo,
    SandboxSpec,
    SnapshotInfo,
)

if TYPE_CHECKING:
    from harness.sandbox.local import LocalProvider

_BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": HOME,
    "USER": "user",
    "LOGNAME": "user",
    "SHELL": "/bin/sh",
    "LANG": "C.UTF-8",
}


class LocalSandbox(Sandbox):
    """A handle on one local sandbox; cheap to make, holds no resources itself."""

    def __init__(self, provider: LocalProvider, sandbox_id: str):
        self.provider = provider
        self.id = sandbox_id

    def exec(
        self,
        command: str,
        *,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | None = None,
        on_output: OutputCallback | None = None,
        max_output_bytes: int = 16 << 20,
    ) -> ExecResult:
        meta = self.provider._live(self.id)
        full_env = {**_BASE_ENV, "HOSTNAME": self.id, **meta.env, **(env or {})}
        result = run_in_jail(
            meta.init_pid or 0,
            self.provider.cgroup(self.id),
            command,
            env=full_env,
            cwd=cwd,
            stdin=stdin,
            timeout=timeout,
            on_output=on_output,
            max_output_bytes=max_output_bytes,
        )
        if result.exit_code >= 128 and not result.timed_out and _jail_ended(meta, result.exit_code):
            # Killed with its whole jail (from outside: an admin, the OOM killer),
            # not by its own doing: the sandbox is gone, say so rather than
            # hand back a plain "killed" exit code.
            self.provider._destroy(self.id)
            raise SandboxNotFound(
                f"sandbox {self.id} stopped while running a command (its processes were killed) and was removed"
            )
        return result

    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        q = shlex.quote(path)
        script = f'd=$(dirname -- {q}) && mkdir -p -- "$d" && cat > {q} && chmod {mode:o} -- {q}'
        result = self.exec(script, stdin=data, timeout=300)
        if result.exit_code != 0:
            raise SandboxFileError(f"cannot write {path} in {self.id}: {_first_line(result)}")

    def read_file(self, path: str) -> bytes:
        result = self.exec(f"cat -- {shlex.quote(path)}", timeout=300, max_output_bytes=1 << 40)
        if result.exit_code != 0:
            raise SandboxFileError(f"cannot read {path} in {self.id}: {_first_line(result)}")
        return result.stdout

    def snapshot(self, name: str) -> SnapshotInfo:
        check_name(name)
        provider = self.provider
        store = provider.snapshot_store
        store.check_free(name)
        doing = f"snapshot {name!r} of {self.id}"
        with provider._locked(self.id):
            meta = provider._live(self.id)
            tmp = provider.layers.new_tmp(doing)
            try:
                with self._frozen():
                    copy_tree(provider.upper_dir(meta), tmp, doing=doing, where=provider.layers.root)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)  # no half-written layer stays behind
                raise
        try:
            chain = [self._persist(layer, doing) for layer in meta.layers]
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        # add() consumes tmp, failed or not. Layers already stored whole are left
        # for gc: another snapshot may be sharing them by now.
        if top := provider.layers.add(tmp, doing):
            chain.append(top)
        chain = [x for x in chain if x != LayerStore.EMPTY] or [LayerStore.EMPTY]
        return store.put(name, chain, source=self.id, type_=meta.type, parent=meta.from_snapshot)

    def _persist(self, layer: str, doing: str) -> str:
        """An on-disk layer with the content of ``layer`` (itself if it is on disk)."""
        if not layer.startswith("eph/"):
            return layer
        layers = self.provider.layers
        tmp = layers.new_tmp(doing)
        try:
            copy_tree(self.provider.layer_path(layer), tmp, doing=doing, where=layers.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return layers.add(tmp, doing) or LayerStore.EMPTY

    def fork(self, spec: SandboxSpec | None = None) -> LocalSandbox:
        provider = self.provider
        with provider._locked(self.id):
            meta = provider._live(self.id)
            spec = spec or SandboxSpec(type=meta.type, network=meta.network, env=meta.env)  # type: ignore[arg-type]
            cg = provider.cgroup(self.id)
            cg.freeze()
            try:
                if cg.exec_pids():
                    # Commands are running: their open files pin the current home,
                    # so it cannot be restacked; copy the changes instead.
                    child = provider._new_meta(spec, meta.layers, from_snapshot=meta.from_snapshot, resumed_from=self.id)
                    try:
                        copy_tree(provider.upper_dir(meta), provider.upper_dir(child))
                    except BaseException:
                        provider._destroy(child.id)
                        raise
                else:
                    meta = self._promote(meta)
                    child = provider._new_meta(spec, meta.layers, from_snapshot=meta.from_snapshot, resumed_from=self.id)
            finally:
                cg.thaw()
        return provider._start_new(child)

    def _promote(self, meta: SandboxRecord) -> SandboxRecord:
        """Freeze the source's changes into an ephemeral layer (a rename: O(1)) and
        restack its home over it, so source and children share it read-only."""
        provider = self.provider
        upper, _ = provider._rw(meta)
        if not any(upper.iterdir()):
            return meta  # nothing changed since the last fork: reuse the layers
        layer = f"eph/{uuid.uuid4().hex}"
        promoted = replace(meta, layers=(*meta.layers, layer), generation=meta.generation + 1)
        new_upper, new_work = provider._new_rw(promoted)
        record = provider._dir(self.id) / "meta.json"
        # The record first: it is the step that can fail (a full disk), and until
        # the rename below nothing the source uses has changed.
        try:
            promoted.save(record)
        except BaseException:
            shutil.rmtree(new_upper, ignore_errors=True)
            shutil.rmtree(new_work, ignore_errors=True)
            raise
        os.rename(upper, provider.layer_path(layer))
        lowers = [provider.layer_path(x) for x in reversed(promoted.layers)]
        try:
            _jail.restack(meta.init_pid or 0, lowers, new_upper, new_work)
        except BaseException:
            # The jail still writes to its old upper dir (a mount keeps it whatever
            # its path): put it back where the old record says it is.
            os.rename(provider.layer_path(layer), upper)
            meta.save(record)
            raise
        return promoted

    @contextmanager
    def _frozen(self) -> Iterator[None]:
        """Hold the sandbox's processes still so a copy of its files is consistent."""
        cg = self.provider.cgroup(self.id)
        if not cg.exec_pids():
            yield  # only the idle holder: nothing can change the files
            return
        cg.freeze()
        try:
            yield
        finally:
            cg.thaw()

    def rename(self, name: str) -> SandboxInfo:
        check_name(name, "sandbox")
        with self.provider._locked(self.id):
            meta = replace(self.provider._live(self.id), name=name)
            meta.save(self.provider._dir(self.id) / "meta.json")
        return self.provider._info(meta)

    def info(self) -> SandboxInfo:
        return self.provider._info(self.provider._live(self.id))

    def delete(self) -> None:
        self.provider._destroy(self.id)

    # Local extras, not part of the seam.
    @property
    def init_pid(self) -> int | None:
        return self.provider._load(self.id).init_pid

    @property
    def upper_dir(self) -> Path:
        return self.provider.upper_dir(self.provider._load(self.id))


_PF_EXITING = 0x4  # /proc/PID/stat flags: the task has begun to exit


def _jail_dying(meta: SandboxRecord) -> bool:
    """The jail's init is gone, or exiting: when the kernel kills a PID namespace
    because its init was killed, the other processes (the command) die before
    the init itself is gone, but after it has been marked as exiting."""
    try:
        fields = Path(f"/proc/{meta.init_pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return True
    return fields[0] in ("Z", "X") or int(fields[19]) != meta.init_start or bool(int(fields[6]) & _PF_EXITING)


def _jail_ended(meta: SandboxRecord, exit_code: int) -> bool:
    """Did a command that died of a signal die because its whole jail was killed?"""
    if _jail_dying(meta):
        return True
    if exit_code != 137:
        return False
    # SIGKILLs sent to each of the sandbox's processes (a kill of its cgroup)
    # may reach the command a moment before the init: look once more.
    time.sleep(0.02)
    return _jail_dying(meta)


def _first_line(result: ExecResult) -> str:
    text = result.text("stderr").strip() or result.text("stdout").strip() or f"exit code {result.exit_code}"
    return text.splitlines()[-1]

"""Per-sandbox cgroups on cgroup v2, v1 (and hybrid), or none.

A sandbox gets one cgroup that carries its limits (memory, pids, cpu) and,
below it, one leaf per exec call so that a timeout can kill exactly that
command's process tree, daemons that called setsid included. Processes join
a cgroup by writing "0" to an already opened ``cgroup.procs`` from the child
between fork and exec, so no process ever runs outside its group.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from harness.sandbox.base import Resources

ROOT = Path("/sys/fs/cgroup")
PARENT = "harness"
_V1_LIMIT_CONTROLLERS = ("memory", "pids", "cpu")


def _mounts() -> dict[str, Path]:
    """Controller name -> mount point of its v1 hierarchy, plus '' for the v2 one."""
    found: dict[str, Path] = {}
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        left, _, right = line.partition(" - ")
        fstype, _src, opts = (right.split() + ["", "", ""])[:3]
        mount_point = Path(left.split()[4])
        if fstype == "cgroup2":
            found.setdefault("", mount_point)
        elif fstype == "cgroup":
            for opt in opts.split(","):
                if opt in ("memory", "pids", "cpu", "freezer"):
                    found.setdefault(opt, mount_point)
    return found


@dataclass(frozen=True)
class Layout:
    """Where the controllers live on this machine."""

    version: int  # 2, 1, or 0 for "no usable cgroups"
    v2_root: Path | None = None
    v1: tuple[tuple[str, Path], ...] = ()

    @classmethod
    def detect(cls) -> Layout:
        if os.geteuid() != 0:
            return cls(version=0)
        mounts = _mounts()
        v2 = mounts.get("")
        if v2 is not None:
            controllers = (v2 / "cgroup.controllers").read_text().split() if (v2 / "cgroup.controllers").exists() else []
            if {"memory", "pids"} <= set(controllers):
                return cls(version=2, v2_root=v2)
        if "memory" in mounts and "pids" in mounts and "freezer" in mounts:
            return cls(version=1, v1=tuple(sorted((k, v) for k, v in mounts.items() if k)))
        return cls(version=0)

    def describe(self) -> str:
        return {2: "cgroup v2", 1: "cgroup v1", 0: "none (limits by rlimit only)"}[self.version]


def _write(path: Path, value: str) -> None:
    path.write_text(value)


def _subgroups(group: Path) -> list[Path]:
    return [p for p in group.rglob("*") if p.is_dir()]


def _pids_in(group: Path) -> list[int]:
    pids: list[int] = []
    try:
        subs = _subgroups(group)
    except FileNotFoundError:
        return pids  # removed meanwhile, with its processes
    for sub in [group, *subs]:
        try:
            pids.extend(int(x) for x in (sub / "cgroup.procs").read_text().split())
        except (OSError, ValueError):
            continue
    return pids


def _rmdir_tree(group: Path, wait_s: float = 2.0) -> None:
    """Remove a cgroup directory and its children once their processes are gone."""
    if not group.exists():
        return
    deadline = time.monotonic() + wait_s
    try:
        children = sorted(_subgroups(group), key=lambda p: len(p.parts), reverse=True)
    except FileNotFoundError:
        return  # removed meanwhile by another process
    for path in [*children, group]:
        while True:
            try:
                path.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    return
                time.sleep(0.01)


class SandboxCgroup:
    """The cgroup(s) of one sandbox. Safe to construct for an existing sandbox."""

    def __init__(self, layout: Layout, sandbox_id: str):
        self.layout = layout
        self.sandbox_id = sandbox_id

    # -- paths ---------------------------------------------------------------
    def _v2_dir(self) -> Path:
        assert self.layout.v2_root is not None
        return self.layout.v2_root / PARENT / self.sandbox_id

    def _v1_dirs(self) -> dict[str, Path]:
        return {name: root / PARENT / self.sandbox_id for name, root in self.layout.v1}

    def _leaf_dirs(self, leaf: str) -> list[Path]:
        """The directories a process of ``leaf`` ('init' or an exec id) must join."""
        if self.layout.version == 2:
            return [self._v2_dir() / leaf]
        if self.layout.version == 1:
            dirs = self._v1_dirs()
            # Limits sit on the sandbox group; the freezer gets one leaf per exec
            # so a timeout can find every process of that command. v1 allows
            # processes in inner groups, so the init stays at the top.
            freezer = dirs["freezer"] if leaf == "init" else dirs["freezer"] / leaf
            return [dirs[c] for c in dirs if c != "freezer"] + [freezer]
        return []

    def exec_pids(self) -> list[int]:
        """Processes started by exec calls that are still running (background ones too)."""
        base = self._freezer_dir(None)
        if base is None or not base.is_dir():
            return []
        try:
            leaves = [d for d in base.iterdir() if d.is_dir() and d.name != "init"]
        except FileNotFoundError:
            return []  # removed meanwhile
        return [pid for d in leaves for pid in _pids_in(d)]

    # -- lifecycle -----------------------------------------------------------
    def create(self, res: Resources) -> None:
        if self.layout.version == 2:
            root = self.layout.v2_root
            assert root is not None
            parent = root / PARENT
            parent.mkdir(exist_ok=True)
            wanted = "+memory +pids +cpu"
            for ctl in (root / "cgroup.subtree_control", parent / "cgroup.subtree_control"):
                try:
                    _write(ctl, wanted)
                except OSError:
                    _write(ctl, "+memory +pids")
            group = self._v2_dir()
            group.mkdir(exist_ok=True)
            _write(group / "memory.max", str(res.memory_bytes))
            if (group / "memory.swap.max").exists():
                _write(group / "memory.swap.max", "0")
            _write(group / "pids.max", str(res.pids))
            if (group / "cpu.max").exists():
                _write(group / "cpu.max", f"{int(res.cpus * 100_000)} 100000")
            _write(group / "cgroup.subtree_control", "+memory +pids" + (" +cpu" if (group / "cpu.max").exists() else ""))
            (group / "init").mkdir(exist_ok=True)
        elif self.layout.version == 1:
            for name, path in self._v1_dirs().items():
                path.parent.mkdir(exist_ok=True)
                path.mkdir(exist_ok=True)
                if name == "memory":
                    _write(path / "memory.limit_in_bytes", str(res.memory_bytes))
                    if (path / "memory.memsw.limit_in_bytes").exists():
                        try:
                            _write(path / "memory.memsw.limit_in_bytes", str(res.memory_bytes))
                        except OSError:
                            pass
                elif name == "pids":
                    _write(path / "pids.max", str(res.pids))
                elif name == "cpu":
                    _write(path / "cpu.cfs_period_us", "100000")
                    _write(path / "cpu.cfs_quota_us", str(int(res.cpus * 100_000)))

    def leaf_procs(self, leaf: str) -> list[Path]:
        """Create ``leaf`` and return its procs files: a process writes "0" to join."""
        paths = []
        for d in self._leaf_dirs(leaf):
            d.mkdir(exist_ok=True)
            paths.append(d / "cgroup.procs")
        return paths

    def _freezer_dir(self, leaf: str | None) -> Path | None:
        if self.layout.version == 2:
            return self._v2_dir() / leaf if leaf else self._v2_dir()
        if self.layout.version == 1:
            base = self._v1_dirs()["freezer"]
            return base / leaf if leaf else base
        return None

    def freeze(self, leaf: str | None = None) -> None:
        """Stop every process of the sandbox (or of one leaf) until thaw()."""
        d = self._freezer_dir(leaf)
        if d is None or not d.exists():
            return
        try:
            if self.layout.version == 2:
                _write(d / "cgroup.freeze", "1")
                deadline = time.monotonic() + 2
                while "frozen 1" not in (d / "cgroup.events").read_text() and time.monotonic() < deadline:
                    time.sleep(0.0005)
            else:
                _write(d / "freezer.state", "FROZEN")
                deadline = time.monotonic() + 2
                while (d / "freezer.state").read_text().strip() != "FROZEN" and time.monotonic() < deadline:
                    time.sleep(0.0005)
        except FileNotFoundError:
            pass  # removed meanwhile (another process deleted the sandbox): nothing left to freeze

    def thaw(self, leaf: str | None = None) -> None:
        d = self._freezer_dir(leaf)
        if d is None or not d.exists():
            return
        try:
            _write(d / ("cgroup.freeze" if self.layout.version == 2 else "freezer.state"),
                   "0" if self.layout.version == 2 else "THAWED")
        except FileNotFoundError:
            pass  # removed meanwhile: nothing left to thaw

    def kill(self, leaf: str | None = None, *, spare: int | None = None) -> int:
        """SIGKILL every process in the sandbox (or one leaf); returns how many.

        ``spare`` is an exec's nsenter (host side): while it has company in the
        group, its child in the jail is alive or unreaped, so it is left to reap
        that child and exit. Killed with it, it would orphan the child to the
        host's init, and the jail's PID namespace (so its delete) would wait,
        seconds here and forever on a host whose init does not reap, for that
        zombie to be reaped."""
        d = self._freezer_dir(leaf)
        if d is None or not d.exists():
            return 0
        if spare is None and self.layout.version == 2 and (d / "cgroup.kill").exists():
            pids = _pids_in(d)
            try:
                _write(d / "cgroup.kill", "1")
            except FileNotFoundError:
                return 0  # removed meanwhile, with its processes
            return len(pids)
        # Freeze first so nothing forks between reading the list and the kill.
        self.freeze(leaf)
        killed = 0
        try:
            pids = _pids_in(d)
            if spare in pids and len(pids) > 1:
                pids.remove(spare)
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
                except ProcessLookupError:
                    pass
        finally:
            self.thaw(leaf)
        return killed

    def remove_leaf(self, leaf: str) -> None:
        """Drop an exec leaf if its processes are gone (background ones keep it)."""
        for d in self._leaf_dirs(leaf)[-1:]:
            try:
                d.rmdir()
            except OSError:
                pass

    def remove(self) -> None:
        if self.layout.version == 2:
            _rmdir_tree(self._v2_dir())
        elif self.layout.version == 1:
            for d in self._v1_dirs().values():
                _rmdir_tree(d)

"""Content-addressed layers and named snapshots on disk (the local backend's state).

A layer is an immutable directory tree in overlayfs upper-dir format (whiteouts
included) named by the SHA-256 of its content. A snapshot is a named record
pointing at an ordered chain of layers, bottom first. Starting a sandbox from a
snapshot mounts the chain read-only under a fresh upper dir, so it costs the
same for 10 MB and 10 GB. Chains longer than ``MAX_CHAIN`` are squashed into
one layer, since each layer adds a path to the overlay mount options.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import time
import uuid
from pathlib import Path

from harness.errors import SandboxError, SnapshotExists, SnapshotNotFound
from harness.sandbox.base import SnapshotInfo

MAX_CHAIN = 32
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_OPAQUE = "trusted.overlay.opaque"


def check_name(name: str, what: str = "snapshot") -> str:
    if not _NAME_RE.match(name or ""):
        raise SandboxError(
            f"invalid {what} name {name!r}: use letters, digits, '.', '_' and '-' (at most 128)"
        )
    return name


_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_TEXTS = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))


def storage_error(
    exc: OSError | str, doing: str, where: Path, cls: type[SandboxError] = SandboxError
) -> SandboxError:
    """One line for a failed write of the backend's own state: a full disk says so
    and what to do; anything else names the path and the system's reason."""
    reason = exc if isinstance(exc, str) else (exc.strerror or str(exc))
    full = reason in _FULL_TEXTS or (isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS)
    if full:
        return cls(
            f"{doing} failed: the disk holding {where} is full ({reason}); free space there "
            "(delete snapshots you no longer need, then run `harness sandbox gc`) and retry"
        )
    return cls(f"{doing} failed: {where}: {reason}")


def copy_tree(src: Path, dst: Path, *, doing: str | None = None, where: Path | None = None) -> None:
    """Copy a directory's contents with owners, modes, xattrs and whiteouts kept;
    reflinks where the filesystem has them (xfs, btrfs), so a copy can be O(1).
    ``doing`` and ``where`` word the error (default: copying ``src`` to ``dst``)."""
    dst.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        ["cp", "-a", "--reflink=auto", f"{src}/.", f"{dst}/"],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or [f"cp exited {proc.returncode}"]
        full = next((t for t in _FULL_TEXTS if any(t in line for line in lines)), None)
        raise storage_error(full or lines[-1], doing or f"copying {src}", where or dst)


def tree_digest(root: Path) -> tuple[str, int]:
    """SHA-256 over paths, types, modes, owners, xattr flags and contents; and the size."""
    h = hashlib.sha256()
    size = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        base = Path(dirpath)
        for name in sorted([*dirnames, *filenames]):
            path = base / name
            st = path.lstat()
            rel = str(path.relative_to(root))
            h.update(f"{rel}\0{st.st_mode:o}\0{st.st_uid}\0{st.st_gid}\0".encode())
            if stat.S_ISREG(st.st_mode):
                size += st.st_size
                with open(path, "rb") as f:
                    h.update(hashlib.file_digest(f, "sha256").digest())
            elif stat.S_ISLNK(st.st_mode):
                h.update(os.readlink(path).encode())
            elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                h.update(str(st.st_rdev).encode())
            elif stat.S_ISDIR(st.st_mode):
                try:
                    h.update(os.getxattr(path, _OPAQUE, follow_symlinks=False))
                except OSError:
                    pass
            h.update(b"\n")
    return h.hexdigest(), size


class LayerStore:
    """Immutable layers under ``<state>/layers/<sha256>``."""

    EMPTY = "empty"

    def __init__(self, root: Path):
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        empty = self.root / self.EMPTY
        if not empty.exists():
            tmp = self.root / f".tmp-{uuid.uuid4().hex}"
            tmp.mkdir()
            os.replace(tmp, empty)

    def path(self, layer: str) -> Path:
        return self.root / layer

    def size(self, layer: str) -> int:
        meta = self.root / f"{layer}.json"
        try:
            return int(json.loads(meta.read_text())["size_bytes"])
        except (OSError, ValueError, KeyError):
            return 0

    def new_tmp(self, doing: str = "making a layer") -> Path:
        tmp = self.root / f".tmp-{uuid.uuid4().hex}"
        try:
            tmp.mkdir()
        except OSError as exc:
            raise storage_error(exc, doing, self.root) from exc
        return tmp

    def add(self, tmp: Path, doing: str = "storing a layer") -> str | None:
        """Turn a filled temporary dir into a layer; None if it holds nothing.
        ``tmp`` is consumed: on failure too, nothing half-written stays behind."""
        try:
            if not any(tmp.iterdir()):
                return None
            digest, size = tree_digest(tmp)
            final = self.root / digest
            if final.exists():
                return digest
            meta = self.root / f"{digest}.json"
            meta_tmp = self.root / f".tmp-{uuid.uuid4().hex}.json"
            try:
                meta_tmp.write_text(json.dumps({"size_bytes": size}))
                os.replace(meta_tmp, meta)
                os.replace(tmp, final)
            except OSError as exc:
                meta_tmp.unlink(missing_ok=True)
                if final.is_dir():
                    return digest  # the same content was stored by someone else meanwhile
                meta.unlink(missing_ok=True)
                raise storage_error(exc, doing, self.root) from exc
            return digest
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def squash(self, chain: list[str]) -> str:
        """Merge a chain (bottom first) into one layer by copying its merged view."""
        tmp = self.new_tmp()
        if len(chain) == 1:
            try:
                copy_tree(self.path(chain[0]), tmp)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        else:
            lower = ":".join(str(self.path(layer)) for layer in reversed(chain))
            mnt = self.root / f".mnt-{uuid.uuid4().hex}"
            mnt.mkdir()
            script = 'mount -t overlay overlay -o "lowerdir=$1" "$2" && cp -a "$2/." "$3/"'
            proc = subprocess.run(
                ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "squash", lower, str(mnt), str(tmp)],
                capture_output=True,
                text=True,
            )
            mnt.rmdir()
            if proc.returncode != 0:
                shutil.rmtree(tmp, ignore_errors=True)
                lines = proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"]
                full = next((t for t in _FULL_TEXTS if any(t in line for line in lines)), None)
                raise storage_error(full or lines[-1], f"squashing {len(chain)} layers", self.root)
        return self.add(tmp) or self.EMPTY

    def all(self) -> list[str]:
        return [p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")]

    def remove(self, layer: str) -> None:
        if layer == self.EMPTY:
            return
        shutil.rmtree(self.root / layer, ignore_errors=True)
        (self.root / f"{layer}.json").unlink(missing_ok=True)

    def clean_tmp(self, older_than_s: float = 3600) -> None:
        now = time.time()
        for p in self.root.glob(".*-*"):
            try:
                if now - p.stat().st_mtime > older_than_s:
                    shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink()
            except OSError:
                pass


class SnapshotStore:
    """Named snapshot records under ``<state>/snapshots/<name>.json``."""

    def __init__(self, root: Path, layers: LayerStore):
        self.root = root
        self.layers = layers
        self.root.mkdir(parents=True, exist_ok=True)

    def _file(self, name: str) -> Path:
        return self.root / f"{check_name(name)}.json"

    def get(self, name_or_id: str) -> SnapshotInfo:
        if _NAME_RE.match(name_or_id or ""):
            path = self.root / f"{name_or_id}.json"
            if path.exists():
                return SnapshotInfo.from_dict(json.loads(path.read_text()))
        for info in self.list():
            if info.snapshot_id == name_or_id:
                return info
        raise SnapshotNotFound(
            f"no snapshot named {name_or_id!r}; `harness sandbox snapshots` lists them"
        )

    def list(self) -> list[SnapshotInfo]:
        out = []
        for path in sorted(self.root.glob("*.json")):
            try:
                out.append(SnapshotInfo.from_dict(json.loads(path.read_text())))
            except (OSError, ValueError):
                continue
        return sorted(out, key=lambda s: s.created_at)

    def check_free(self, name: str) -> None:
        if self._file(name).exists():
            raise SnapshotExists(f"a snapshot named {name!r} exists; pick another name or delete it first")

    def put(self, name: str, chain: list[str], *, source: str | None, type_: str, parent: str | None) -> SnapshotInfo:
        path = self._file(name)
        if len(chain) > MAX_CHAIN:
            chain = [self.layers.squash(chain)]
        chain_id = hashlib.sha256("\n".join(chain).encode()).hexdigest()
        info = SnapshotInfo(
            name=name,
            snapshot_id=f"{chain_id[:8]}-{chain_id[8:12]}-{chain_id[12:16]}-{chain_id[16:20]}-{chain_id[20:32]}",
            size_bytes=sum(self.layers.size(layer) for layer in chain),
            source_sandbox_id=source,
            type=type_,
            created_at=time.time(),
            layers=tuple(chain),
            parent=parent,
        )
        tmp = path.with_suffix(f".tmp-{uuid.uuid4().hex}")
        try:
            tmp.write_text(json.dumps(info.to_dict()))
            # link() fails if the name exists: two snapshots racing for one name
            # cannot both win, and an existing snapshot is never overwritten.
            os.link(tmp, path)
        except FileExistsError:
            raise SnapshotExists(
                f"a snapshot named {name!r} exists; pick another name or delete it first"
            ) from None
        except OSError as exc:
            raise storage_error(exc, f"saving snapshot {name!r}", self.root) from exc
        finally:
            tmp.unlink(missing_ok=True)
        return info

    def delete(self, name: str) -> None:
        path = self._file(name)
        if not path.exists():
            raise SnapshotNotFound(f"no snapshot named {name!r}; `harness sandbox snapshots` lists them")
        path.unlink()

"""A snapshot store shared by hosts: push and pull snapshots as content-addressed archives.

Any filesystem pyarrow reaches works as a store: a local or mounted directory,
``s3://bucket/prefix``, ``gs://...``, ``hdfs://...``. Layout under the store root::

    layers/<sha256>.tar       one layer, a tar archive (owners, modes, xattrs, whiteouts)
    snapshots/<name>.json     the snapshot record: its chain of layer ids

A layer is uploaded only if the store lacks it, and after download it is
unpacked and hashed again: a layer whose content does not match its name is
refused. Pulls of one snapshot on one host are serialised by a file lock, so
concurrent first uses fetch it once.
"""

from __future__ import annotations

import fcntl
import json
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow.fs as pafs

from harness.errors import SandboxError, SnapshotNotFound
from harness.sandbox._store import LayerStore, check_name, tree_digest
from harness.sandbox.base import SnapshotInfo

if TYPE_CHECKING:
    from harness.sandbox.local import LocalProvider

_TAR_FLAGS = ["--numeric-owner", "--xattrs", "--xattrs-include=*"]
_CHUNK = 1 << 20


class SnapshotArchive:
    """The store at ``uri`` (a path or a URI pyarrow understands)."""

    def __init__(self, uri: str):
        try:
            self.fs, root = pafs.FileSystem.from_uri(uri)
        except (pafs.ArrowInvalid, ValueError, OSError) as exc:  # type: ignore[attr-defined]
            raise SandboxError(f"cannot open the snapshot store {uri!r}: {exc}") from exc
        self.uri = uri
        self.root = root.rstrip("/")

    def _path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def _exists(self, path: str) -> bool:
        return self.fs.get_file_info(path).type != pafs.FileType.NotFound

    def has_snapshot(self, name: str) -> bool:
        return self._exists(self._path("snapshots", f"{check_name(name)}.json"))

    def record(self, name: str) -> SnapshotInfo:
        path = self._path("snapshots", f"{check_name(name)}.json")
        if not self._exists(path):
            raise SnapshotNotFound(f"the snapshot store {self.uri} has no snapshot named {name!r}")
        with self.fs.open_input_stream(path) as f:
            return SnapshotInfo.from_dict(json.loads(f.read()))

    # -- push ----------------------------------------------------------------------
    def push(self, provider: LocalProvider, name: str) -> SnapshotInfo:
        """Upload a local snapshot's missing layers, then its record (last, so a
        reader never sees a record whose layers are not all there)."""
        info = provider.snapshot_store.get(name)
        self.fs.create_dir(self._path("layers"), recursive=True)
        self.fs.create_dir(self._path("snapshots"), recursive=True)
        for layer in info.layers:
            target = self._path("layers", f"{layer}.tar")
            if layer == LayerStore.EMPTY or self._exists(target):
                continue
            self._upload_layer(provider.layers.path(layer), target)
        tmp = self._path("snapshots", f".{name}.json.tmp")
        with self.fs.open_output_stream(tmp) as f:
            f.write(json.dumps(info.to_dict()).encode())
        self.fs.move(tmp, self._path("snapshots", f"{name}.json"))
        return info

    def _upload_layer(self, layer_dir: Path, target: str) -> None:
        tmp = target + ".tmp"
        proc = subprocess.Popen(
            ["tar", *_TAR_FLAGS, "-C", str(layer_dir), "-cf", "-", "."],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert proc.stdout is not None
        with self.fs.open_output_stream(tmp) as out:
            while chunk := proc.stdout.read(_CHUNK):
                out.write(chunk)
        err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
        if proc.wait() != 0:
            self.fs.delete_file(tmp)
            raise SandboxError(f"archiving layer {layer_dir.name} failed: {err.strip()}")
        self.fs.move(tmp, target)

    # -- pull ----------------------------------------------------------------------
    def pull(self, provider: LocalProvider, name: str) -> SnapshotInfo:
        """Make snapshot ``name`` local: fetch the layers this host lacks, verify
        each against its content hash, then record the snapshot. Idempotent."""
        check_name(name)
        lock_path = provider.state_dir / f".pull-{name}.lock"
        with open(lock_path, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                return provider.snapshot_store.get(name)  # another puller got it first
            except SnapshotNotFound:
                pass
            info = self.record(name)
            for layer in info.layers:
                if layer != LayerStore.EMPTY and not provider.layers.path(layer).is_dir():
                    self._fetch_layer(provider.layers, layer)
            return provider.snapshot_store.put(
                name, list(info.layers), source=info.source_sandbox_id, type_=info.type, parent=info.parent
            )

    def _fetch_layer(self, layers: LayerStore, layer: str) -> None:
        source = self._path("layers", f"{layer}.tar")
        if not self._exists(source):
            raise SandboxError(f"the snapshot store {self.uri} lacks layer {layer}; push the snapshot again")
        tmp = layers.new_tmp()
        try:
            with tempfile.TemporaryFile(dir=layers.root) as spool:
                with self.fs.open_input_stream(source) as f:
                    while chunk := f.read(_CHUNK):
                        spool.write(chunk)
                spool.seek(0)
                proc = subprocess.run(
                    ["tar", *_TAR_FLAGS, "--same-permissions", "-C", str(tmp), "-xf", "-"],
                    stdin=spool,
                    capture_output=True,
                )
            if proc.returncode != 0:
                raise SandboxError(f"unpacking layer {layer} failed: {proc.stderr.decode(errors='replace').strip()}")
            digest, _ = tree_digest(tmp)
            if digest != layer:
                raise SandboxError(
                    f"layer {layer} from {self.uri} is corrupt (its content hashes to {digest}); push it again"
                )
            added = layers.add(tmp)
            if added != layer:  # an empty layer has no directory; nothing else can differ
                raise SandboxError(f"layer {layer} could not be stored")
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

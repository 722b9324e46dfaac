"""The snapshot store: push on one host, pull on another, verified and fetched once."""

from __future__ import annotations

import shutil
import threading
import uuid
from pathlib import Path

import pytest

from harness.errors import SandboxError, SnapshotNotFound
from harness.sandbox import SandboxSpec, open_provider
from harness.sandbox.archive import SnapshotArchive


@pytest.fixture
def other_host(tmp_path):
    """A second state directory: another host or Ray node, as far as snapshots go."""
    provider = open_provider("local", state_dir=tmp_path / "other")
    yield provider
    provider.shutdown()


@pytest.fixture
def pushed(local_provider, tmp_path):
    name = f"arch-{uuid.uuid4().hex[:6]}"
    store = str(tmp_path / "store")
    with local_provider.create(SandboxSpec(ttl_s=600)) as sb:
        sb.exec("mkdir -p d gone && echo base > d/f && echo x > gone/x && head -c 200000 /dev/urandom > blob")
        sb.snapshot(name + "-base")
    with local_provider.create(SandboxSpec(ttl_s=600), from_snapshot=name + "-base") as sb:
        sb.exec("rm -r gone && echo top > d/g")  # a whiteout in the top layer
        blob = sb.read_file("blob")
        sb.snapshot(name)
    local_provider.push_snapshot(name, store)
    yield name, store, blob
    local_provider.delete_snapshot(name)
    local_provider.delete_snapshot(name + "-base")


def test_push_then_pull_on_another_host(other_host, pushed):
    name, store, blob = pushed
    with pytest.raises(SnapshotNotFound):
        other_host.snapshot_info(name)
    info = other_host.pull_snapshot(name, store)
    assert len(info.layers) == 2
    with other_host.create(SandboxSpec(ttl_s=600), from_snapshot=name) as sb:
        assert sb.exec("cat d/f d/g; test -e gone && echo still-there").text() == "base\ntop\n"
        assert sb.read_file("blob") == blob


def test_a_host_pulls_a_missing_snapshot_on_first_use(tmp_path, pushed):
    name, store, _ = pushed
    host = open_provider("local", state_dir=tmp_path / "auto", snapshot_store=store)
    try:
        with host.create(SandboxSpec(ttl_s=600), from_snapshot=name) as sb:
            assert sb.exec("cat d/g").text() == "top\n"
        assert host.snapshot_info(name).layers == SnapshotArchive(store).record(name).layers
    finally:
        host.shutdown()


def test_pushing_twice_uploads_each_layer_once(local_provider, pushed):
    name, store, _ = pushed
    layer_files = sorted(p.name for p in (Path(store) / "layers").iterdir())
    mtimes = {p.name: p.stat().st_mtime_ns for p in (Path(store) / "layers").iterdir()}
    local_provider.push_snapshot(name, store)
    assert sorted(p.name for p in (Path(store) / "layers").iterdir()) == layer_files
    assert {p.name: p.stat().st_mtime_ns for p in (Path(store) / "layers").iterdir()} == mtimes


def test_a_corrupt_layer_is_refused(other_host, pushed, tmp_path):
    name, store, _ = pushed
    record = SnapshotArchive(store).record(name)
    top = Path(store) / "layers" / f"{record.layers[-1]}.tar"
    # Replace the top layer by another one's archive: valid tar, wrong content.
    shutil.copy(Path(store) / "layers" / f"{record.layers[0]}.tar", top)
    with pytest.raises(SandboxError, match="corrupt"):
        other_host.pull_snapshot(name, store)
    with pytest.raises(SnapshotNotFound):
        other_host.snapshot_store.get(name)
    assert not other_host.layers.path(record.layers[-1]).exists()


def test_concurrent_pulls_fetch_once(other_host, pushed, monkeypatch):
    name, store, _ = pushed
    fetched: list[str] = []
    original = SnapshotArchive._fetch_layer

    def counting(self, layers, layer):
        fetched.append(layer)
        return original(self, layers, layer)

    monkeypatch.setattr(SnapshotArchive, "_fetch_layer", counting)
    results = []
    threads = [threading.Thread(target=lambda: results.append(other_host.pull_snapshot(name, store))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and len({r.snapshot_id for r in results}) == 1
    assert sorted(fetched) == sorted(set(fetched)) and len(fetched) == 2


def test_unknown_snapshot_in_store(other_host, tmp_path):
    with pytest.raises(SnapshotNotFound):
        other_host.pull_snapshot("nope", str(tmp_path / "empty-store"))

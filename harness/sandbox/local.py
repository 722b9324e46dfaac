"""The embedded default backend: sandboxes on this Linux machine, no service needed.

Each sandbox is a bubblewrap jail with its own PID, mount, IPC, UTS and network
namespaces over an overlayfs home (see ``_jail``), limited by a cgroup (see
``_cgroup``), started empty or from a snapshot's layers (see ``_store``).
Records live on disk under the state directory, so sandboxes and snapshots
outlive the process that made them; time-to-live is enforced on every call and
by ``gc``.

What a sandbox writes lives in memory, on the provider's "run" tmpfs, and
counts against the sandbox's memory limit. That buys O(1) forks: forking an
idle sandbox turns its upper dir into a read-only "ephemeral" layer by a rename
on that tmpfs, restacks the source's home over it, and starts the child over the
same layers. A source with commands still running is frozen and copied instead.

State layout::

    <state>/layers/<sha256>/           immutable layers on disk (overlayfs upper format)
    <state>/snapshots/<name>.json      snapshot records
    <state>/sandboxes/<id>/meta.json   one sandbox's record (and merged/, lock)
    <state>/sandboxes/.trash-<id>/     a sandbox being deleted (list, gc and every call that reaps finish it)
    <state>/run/                       tmpfs: <id>/upper-N, <id>/work-N, eph/<uuid>/
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from harness.errors import (
    ConfigError,
    SandboxError,
    SandboxNotFound,
    SandboxStartError,
    SandboxUnavailable,
    SnapshotNotFound,
)
from harness.sandbox import _jail
from harness.sandbox._cgroup import Layout, SandboxCgroup
from harness.sandbox._exec import reap_orphans
from harness.sandbox._local_sandbox import LocalSandbox
from harness.sandbox._pool import POOL_CLAIM_MAX_TTL_S, POOL_TTL_S, WarmPool
from harness.sandbox._record import ID_RE, SandboxRecord, new_id
from harness.sandbox._store import LayerStore, SnapshotStore, check_name, storage_error
from harness.sandbox.base import (
    SANDBOX_TYPES,
    GcReport,
    Provider,
    SandboxInfo,
    SandboxSpec,
    SnapshotInfo,
)

#: A jail ends by itself this long after its TTL if no call or gc removed it first.
DEADLINE_GRACE_S = 60.0


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"{name}={raw!r} is not a positive whole number")
    return value


#: Live sandboxes (warm pooled jails included) one state directory may hold;
#: ``LocalProvider(max_sandboxes=...)`` or ``HARNESS_MAX_SANDBOXES`` change it. An
#: idle jail costs little (4 processes, under 1 MiB), but each may use up to its
#: type's limits: the cap is there so that a runaway caller gets a clear error
#: instead of exhausting the machine's processes and memory.
DEFAULT_MAX_SANDBOXES = 1024
#: Jails starting at once in one process (``HARNESS_MAX_STARTS``); more wait for
#: a turn. Starting is kernel work (namespaces, mounts) that more parallelism
#: than the machine has cores only slows down, and hundreds of simultaneous
#: starts would otherwise contend for the same locks until some time out.
MAX_STARTS = _env_int("HARNESS_MAX_STARTS", 2 * (os.cpu_count() or 1))
#: How long a start waits for its turn before it fails with SandboxStartError.
START_WAIT_S = 120.0
_start_slots = threading.BoundedSemaphore(MAX_STARTS)


class LocalProvider(Provider):
    """Sandboxes on this machine under ``state_dir`` (default: see ``default_state_dir``)."""

    name = "local"

    def __init__(
        self,
        state_dir: str | Path | None = None,
        *,
        pool_size: int = 0,
        snapshot_store: str | None = None,
        max_sandboxes: int | None = None,
    ):
        """``pool_size`` > 0 keeps that many started jails ready per (type, network,
        snapshot) in a background thread, for processes that create many sandboxes.
        ``snapshot_store`` (default ``$HARNESS_SNAPSHOT_STORE``) is a store URI
        that snapshots missing here are pulled from on first use.
        ``max_sandboxes`` (default ``$HARNESS_MAX_SANDBOXES``, else
        ``DEFAULT_MAX_SANDBOXES``) caps the live sandboxes of the state directory:
        a create beyond it fails with SandboxStartError."""
        from harness.sandbox import default_state_dir

        if max_sandboxes is None:
            max_sandboxes = _env_int("HARNESS_MAX_SANDBOXES", DEFAULT_MAX_SANDBOXES)
        if max_sandboxes < 1:
            raise ConfigError(f"max_sandboxes must be at least 1, not {max_sandboxes}")
        self.max_sandboxes = max_sandboxes
        _jail.check_host()
        self.state_dir = Path(state_dir) if state_dir else default_state_dir()
        self.layers = LayerStore(self.state_dir / "layers")
        self.snapshot_store = SnapshotStore(self.state_dir / "snapshots", self.layers)
        self.sandboxes_dir = self.state_dir / "sandboxes"
        self.sandboxes_dir.mkdir(parents=True, exist_ok=True)
        self.sandboxes_dir.chmod(0o700)
        self.layers.root.chmod(0o700)
        self.run_dir = self.state_dir / "run"
        self._mount_run()
        self.cgroup_layout = Layout.detect()
        if not self.cgroup_layout.version:
            raise SandboxUnavailable(
                "no usable cgroups (memory, pids and freezer controllers) were found, so sandbox limits "
                "cannot be enforced: mount cgroup v2 at /sys/fs/cgroup"
            )
        # Several state dirs (tests, users) may share a machine: cgroup names carry
        # a prefix of this one's so gc never touches another's groups.
        self._cg_prefix = hashlib.sha256(str(self.state_dir.resolve()).encode()).hexdigest()[:8]
        self._pool = WarmPool(self, pool_size) if pool_size > 0 else None
        self.snapshot_store_uri = snapshot_store or os.environ.get("HARNESS_SNAPSHOT_STORE") or None
        self._reap_orphaned_execs()

    # -- helpers ---------------------------------------------------------------
    def _mount_run(self) -> None:
        """Mount the in-memory run filesystem once per boot (half the RAM at most)."""
        self.run_dir.mkdir(exist_ok=True)
        with open(self.state_dir / ".run.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not os.path.ismount(self.run_dir):
                pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
                _jail.mount_tmpfs(self.run_dir, pages // 2)
            (self.run_dir / "eph").mkdir(exist_ok=True)

    def layer_path(self, layer: str) -> Path:
        return self.run_dir / layer if layer.startswith("eph/") else self.layers.path(layer)

    def _rw(self, meta: SandboxRecord) -> tuple[Path, Path]:
        """The sandbox's current upper and work dirs."""
        base = self.run_dir / meta.id
        return base / f"upper-{meta.generation}", base / f"work-{meta.generation}"

    def _new_rw(self, meta: SandboxRecord) -> tuple[Path, Path]:
        upper, work = self._rw(meta)
        upper.mkdir(parents=True, mode=0o755)
        os.chown(upper, _jail.SANDBOX_UID, _jail.SANDBOX_GID)
        work.mkdir(mode=0o700)
        return upper, work

    def _etc(self, network: bool) -> Path:
        """Generated /etc files, shared by all sandboxes with the same network setting."""
        etc = self.state_dir / "etc" / ("net" if network else "nonet")
        if not (etc / "resolv.conf").exists():
            _jail.write_etc(etc, network)
        return etc

    def _dir(self, sandbox_id: str) -> Path:
        return self.sandboxes_dir / sandbox_id

    def cgroup(self, sandbox_id: str) -> SandboxCgroup:
        return SandboxCgroup(self.cgroup_layout, f"{self._cg_prefix}-{sandbox_id}")

    @contextmanager
    def _locked(self, sandbox_id: str) -> Iterator[None]:
        lock = self._dir(sandbox_id) / "lock"
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}; `harness sandbox ls` lists them") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _load(self, sandbox_id: str) -> SandboxRecord:
        if not ID_RE.match(sandbox_id or ""):
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}: ids look like sb_0123456789")
        try:
            return SandboxRecord.load(self._dir(sandbox_id) / "meta.json")
        except (OSError, ValueError, TypeError):
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}; `harness sandbox ls` lists them") from None

    def _live(self, sandbox_id: str) -> SandboxRecord:
        """The sandbox's record after the TTL and liveness checks. A sandbox whose
        jail died (killed from outside, or the machine restarted) has lost its
        processes, and with a restart its files too (they live in memory), so it
        is removed rather than shown half alive."""
        meta = self._load(sandbox_id)
        if meta.expired():
            self._destroy(sandbox_id)
            raise SandboxNotFound(f"sandbox {sandbox_id} expired (ttl) and was deleted")
        if (meta.init_pid is not None and not meta.running()) or meta.start_abandoned():
            self._destroy(sandbox_id)
            raise SandboxNotFound(f"sandbox {sandbox_id} stopped (its processes were killed) and was removed")
        return meta

    def upper_dir(self, meta: SandboxRecord) -> Path:
        """The host path of a sandbox's writable layer."""
        return self._rw(meta)[0]

    def _info(self, meta: SandboxRecord) -> SandboxInfo:
        status = "expired" if meta.expired() else ("running" if meta.running() else "stopped")
        return SandboxInfo(
            id=meta.id,
            name=meta.name,
            type=meta.type,
            status=status,
            created_at=meta.created_at,
            expires_at=meta.expires_at,
            from_snapshot=meta.from_snapshot,
            resumed_from=meta.resumed_from,
            network=meta.network,
            memory_restored=False,
            backend=self.name,
        )

    def _new_meta(self, spec: SandboxSpec, layers: tuple[str, ...], **extra) -> SandboxRecord:
        now = time.time()
        meta = SandboxRecord(
            id=new_id(),
            name=spec.name,
            type=spec.type,
            network=spec.network,
            created_at=now,
            expires_at=now + spec.ttl_s if spec.ttl_s else None,
            layers=layers,
            env=dict(spec.env),
            starter_pid=os.getpid(),
            starter_start=_jail.process_start_time(os.getpid()),
            **extra,
        )
        if meta.deadline is None and meta.expires_at is not None:
            meta = replace(meta, deadline=meta.expires_at + DEADLINE_GRACE_S)
        d = self._dir(meta.id)
        try:
            self._admit(d)
            meta.save(d / "meta.json")
            self._new_rw(meta)
        except BaseException as exc:
            # Nothing half-made stays behind (a full disk, a refused admission).
            shutil.rmtree(d, ignore_errors=True)
            shutil.rmtree(self.run_dir / meta.id, ignore_errors=True)
            if isinstance(exc, SandboxStartError) or not isinstance(exc, (OSError, SandboxError)):
                raise
            if isinstance(exc, SandboxError):
                raise SandboxStartError(str(exc)) from exc
            in_run = str(exc.filename or "").startswith(str(self.run_dir))
            raise storage_error(exc, "creating a sandbox", self.run_dir if in_run else self.state_dir, SandboxStartError) from exc
        return meta

    def _live_count(self) -> int:
        return sum(1 for name in os.listdir(self.sandboxes_dir) if ID_RE.match(name))

    def _admit(self, d: Path) -> None:
        """Make a new sandbox's directory if the state dir is below ``max_sandboxes``.
        Counting and making happen under one lock, so concurrent creates (threads
        or processes) cannot overshoot; dead and expired sandboxes are reaped
        before a create is refused."""
        for attempt in range(2):
            fd = os.open(self.state_dir / ".create.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                live = self._live_count()
                if live < self.max_sandboxes:
                    (d / "merged").mkdir(parents=True)
                    return
            finally:
                os.close(fd)
            if attempt == 0:
                self._reap()
        raise SandboxStartError(
            f"{live} sandboxes are live, the limit is {self.max_sandboxes}; delete some "
            "(`harness sandbox ls`, `harness sandbox delete ID`) or raise max_sandboxes (HARNESS_MAX_SANDBOXES)"
        )

    def _launch(self, meta: SandboxRecord) -> SandboxRecord:
        """Start the jail of a sandbox whose directory exists; saves its pids."""
        if meta.network:
            _jail.check_host(network=True)
        d = self._dir(meta.id)
        try:
            etc = self._etc(meta.network)
        except OSError as exc:  # the first start on a state dir writes them: a full disk fails here
            raise storage_error(exc, "creating a sandbox", self.state_dir, SandboxStartError) from exc
        res = SANDBOX_TYPES[meta.type]
        cg = self.cgroup(meta.id)
        cg.create(res)
        upper, work = self._rw(meta)
        paths = _jail.JailPaths(
            merged=d / "merged",
            upper=upper,
            work=work,
            lowers=tuple(self.layer_path(layer) for layer in reversed(meta.layers)),
            etc=etc,
            state_binds=(self.run_dir, self.layers.root, self.sandboxes_dir),
            record=d,
        )
        try:
            if not _start_slots.acquire(timeout=START_WAIT_S):
                raise SandboxStartError(
                    f"no turn to start a jail within {START_WAIT_S:.0f} s ({MAX_STARTS} start at once, "
                    "and they are slow): the machine is overloaded; retry later or start fewer sandboxes at once"
                )
            try:
                jail = _jail.start(
                    paths,
                    hostname=meta.id,
                    tmp_bytes=res.tmp_bytes,
                    network=meta.network,
                    cgroup_procs=cg.leaf_procs("init"),
                    lifetime_s=None if meta.deadline is None else meta.deadline - time.time(),
                    # A warm jail belongs to the process whose pool started it: if that
                    # process dies, even before it recorded the jail, the jail dies too.
                    die_with_parent=meta.pooled,
                )
            finally:
                _start_slots.release()
        except BaseException:
            cg.remove()
            raise
        meta = replace(
            meta,
            init_pid=jail.init_pid,
            init_start=jail.init_start,
            slirp_pid=jail.slirp_pid,
            slirp_start=jail.slirp_start,
        )
        try:
            meta.save(d / "meta.json")
        except SandboxNotFound:
            raise
        except SandboxError as exc:  # a full disk: the create fails as a start (the caller destroys the jail)
            raise SandboxStartError(str(exc)) from exc
        return meta

    def _start_new(self, meta: SandboxRecord) -> LocalSandbox:
        try:
            meta = self._launch(meta)
        except BaseException:
            self._destroy(meta.id)
            raise
        return LocalSandbox(self, meta.id)

    def _destroy(self, sandbox_id: str) -> bool:
        """Kill everything of a sandbox and remove its directory and cgroup. Idempotent."""
        d = self._dir(sandbox_id)
        trash = self.sandboxes_dir / f".trash-{sandbox_id}"
        try:
            os.rename(d, trash)  # atomic: from here on, nobody finds it
        except FileNotFoundError:
            if not trash.exists():
                return False
        try:
            meta: SandboxRecord | None = SandboxRecord.load(trash / "meta.json")
        except (OSError, ValueError, TypeError):
            meta = None
        if meta is not None:
            _jail.kill(meta.init_pid, meta.init_start)
            _jail.kill_pid(meta.slirp_pid, meta.slirp_start)
            if meta.init_pid is None and meta.starter_pid is not None:
                _jail.kill_unrecorded(d)  # a start cut short (its starter died or it failed)
        cg = self.cgroup(sandbox_id)
        cg.kill()
        cg.remove()
        _jail.detach_leftovers(trash)
        shutil.rmtree(trash, ignore_errors=True)
        shutil.rmtree(self.run_dir / sandbox_id, ignore_errors=True)
        return True

    # -- Provider --------------------------------------------------------------
    def create(self, spec: SandboxSpec | None = None, *, from_snapshot: str | None = None) -> LocalSandbox:
        spec = spec or SandboxSpec()
        if spec.name:
            check_name(spec.name, "sandbox")
        snap = self.snapshot_info(from_snapshot) if from_snapshot else None
        if self._pool is not None:
            # Keyed by the snapshot's content id: a name reused for new content
            # never hands out a jail prepared from the old one.
            warm = self._pool.take((spec.type, spec.network, snap.snapshot_id if snap else None))
            if warm is not None and (claimed := self._claim(warm, spec)) is not None:
                return claimed
        if snap is not None:
            meta = self._new_meta(spec, snap.layers, from_snapshot=snap.name)
        else:
            meta = self._new_meta(spec, (LayerStore.EMPTY,))
        return self._start_new(meta)

    def _start_pooled(self, type_: str, network: bool, snapshot_id: str | None) -> str:
        """A started jail, prepared from a snapshot (or empty), waiting to be claimed."""
        spec = SandboxSpec(type=type_, network=network, ttl_s=POOL_TTL_S)  # type: ignore[arg-type]
        # The jail must outlive its wait in the pool plus the TTL it is claimed with.
        deadline = time.time() + POOL_TTL_S + POOL_CLAIM_MAX_TTL_S
        if snapshot_id is None:
            meta = self._new_meta(spec, (LayerStore.EMPTY,), pooled=True, deadline=deadline)
        else:
            snap = self.snapshot_store.get(snapshot_id)
            meta = self._new_meta(spec, snap.layers, from_snapshot=snap.name, pooled=True, deadline=deadline)
        return self._start_new(meta).id

    def _claim(self, sandbox_id: str, spec: SandboxSpec) -> LocalSandbox | None:
        """Hand out a warm jail as the sandbox asked for; None if it is no longer usable.
        Nothing ran in it, so it is exactly what a cold start would give."""
        try:
            with self._locked(sandbox_id):
                meta = self._load(sandbox_id)
                now = time.time()
                if not meta.running() or meta.expired():
                    raise SandboxNotFound(sandbox_id)
                if meta.deadline is not None and (not spec.ttl_s or now + spec.ttl_s + DEADLINE_GRACE_S > meta.deadline):
                    raise SandboxNotFound(sandbox_id)  # it would end before the TTL asked for: start one cold
                expires_at = now + spec.ttl_s if spec.ttl_s else None
                deadline = meta.deadline
                if expires_at is not None:
                    # The jail's own last resort moves from the pool's deadline to
                    # this TTL's, as a cold start's would be (the holder reads it).
                    deadline = expires_at + DEADLINE_GRACE_S
                    _jail.write_deadline(self._dir(sandbox_id), deadline - now)
                replace(
                    meta,
                    name=spec.name,
                    created_at=now,
                    expires_at=expires_at,
                    env=dict(spec.env),
                    pooled=False,
                    deadline=deadline,
                ).save(self._dir(sandbox_id) / "meta.json")
            return LocalSandbox(self, sandbox_id)
        except (SandboxError, OSError):
            self._destroy(sandbox_id)
            return None

    def close(self) -> None:
        """Delete this provider's warm jails (sandboxes it handed out keep running)."""
        if self._pool is not None:
            self._pool.close()

    def shutdown(self) -> None:
        """Delete every sandbox of this state dir and unmount its in-memory
        filesystem, so that the directory can be removed (tests, uninstall)."""
        self.close()
        for d in list(self.sandboxes_dir.iterdir()):
            if ID_RE.match(d.name) or d.name.startswith(".trash-"):
                self._destroy(d.name.removeprefix(".trash-"))
        self._gc_cgroups()
        _jail.detach(self.run_dir)

    def get(self, sandbox_id: str) -> LocalSandbox:
        self._live(sandbox_id)
        return LocalSandbox(self, sandbox_id)

    def list(self) -> list[SandboxInfo]:
        live, _ = self._sweep()
        return sorted((self._info(meta) for meta in live if not meta.pooled), key=lambda i: i.created_at)

    def _sweep(self) -> tuple[list[SandboxRecord], list[str]]:
        """Delete the sandboxes that are gone (and finish deletes cut short: a process
        killed after renaming to .trash-<id>); returns the live records and the ids deleted."""
        live, deleted = [], []
        for d in sorted(self.sandboxes_dir.iterdir()):
            if d.name.startswith(".trash-"):
                self._destroy(d.name.removeprefix(".trash-"))
                continue
            if not ID_RE.match(d.name):
                continue
            try:
                meta = self._load(d.name)
            except SandboxNotFound:
                continue
            if self._gone(meta):
                self._destroy(meta.id)
                deleted.append(meta.id)
            else:
                live.append(meta)
        return live, deleted

    @staticmethod
    def _gone(meta: SandboxRecord) -> bool:
        """Expired, or its jail died (killed from outside, the OOM killer, a reboot,
        or the death of the process whose warm pool started it), or the process
        that was starting it died first."""
        return meta.expired() or (meta.init_pid is not None and not meta.running()) or meta.start_abandoned()

    def _reap(self) -> list[str]:
        """Delete the sandboxes that are expired or whose jail died; their ids."""
        return self._sweep()[1]

    def snapshots(self) -> list[SnapshotInfo]:
        return self.snapshot_store.list()

    def snapshot_info(self, name: str) -> SnapshotInfo:
        try:
            return self.snapshot_store.get(name)
        except SnapshotNotFound:
            if not self.snapshot_store_uri:
                raise
        return self.pull_snapshot(name)

    def push_snapshot(self, name: str, store: str | None = None) -> SnapshotInfo:
        """Upload a snapshot to a store (see ``harness.sandbox.archive``)."""
        return self._archive(store).push(self, name)

    def pull_snapshot(self, name: str, store: str | None = None) -> SnapshotInfo:
        """Download a snapshot from a store, verifying every layer's content hash."""
        return self._archive(store).pull(self, name)

    def _archive(self, store: str | None):
        from harness.sandbox.archive import SnapshotArchive

        uri = store or self.snapshot_store_uri
        if not uri:
            raise SandboxError("no snapshot store given: pass --store URI or set HARNESS_SNAPSHOT_STORE")
        return SnapshotArchive(uri)

    def delete_snapshot(self, name: str) -> None:
        self.snapshot_store.delete(name)

    def gc(self) -> GcReport:
        deleted = []
        for d in list(self.sandboxes_dir.iterdir()):
            if d.name.startswith(".trash-"):
                self._destroy(d.name.removeprefix(".trash-"))
            elif ID_RE.match(d.name):
                try:
                    meta = self._load(d.name)
                except SandboxNotFound:
                    # A directory without a readable record is a crashed create.
                    if time.time() - d.stat().st_mtime > 60:
                        self._destroy(d.name)
                        deleted.append(d.name)
                    continue
                if self._gone(meta):
                    self._destroy(meta.id)
                    deleted.append(meta.id)
        self._reap_orphaned_execs()
        self._gc_cgroups()
        used = {layer for s in self.snapshot_store.list() for layer in s.layers}
        for d in self.sandboxes_dir.iterdir():
            if ID_RE.match(d.name):
                try:
                    used.update(self._load(d.name).layers)
                except SandboxNotFound:
                    continue
        for d in self.run_dir.iterdir():
            if ID_RE.match(d.name) and not self._dir(d.name).exists():
                shutil.rmtree(d, ignore_errors=True)
        for eph in (self.run_dir / "eph").iterdir():
            if f"eph/{eph.name}" not in used:
                shutil.rmtree(eph, ignore_errors=True)
        removed = []
        for layer in self.layers.all():
            if layer not in used and layer != LayerStore.EMPTY:
                self.layers.remove(layer)
                removed.append(layer)
        self.layers.clean_tmp()
        return GcReport(deleted_sandboxes=tuple(deleted), removed_layers=tuple(removed))

    def _reap_orphaned_execs(self) -> None:
        """Kill commands still running for a process that died mid-call, in case
        its watchdog died too (see ``_exec``: normally it kills them at once)."""
        reap_orphans(self.cgroup_layout, f"{self._cg_prefix}-sb_*")

    def _gc_cgroups(self) -> None:
        """Remove this state dir's cgroups whose sandbox no longer exists."""
        layout = self.cgroup_layout
        roots = [layout.v2_root] if layout.version == 2 else [p for _, p in layout.v1]
        for root in roots:
            parent = Path(root) / "harness" if root else None
            if parent is None or not parent.is_dir():
                continue
            for group in parent.glob(f"{self._cg_prefix}-sb_*"):
                sandbox_id = group.name.split("-", 1)[1]
                if not self._dir(sandbox_id).exists():
                    cg = self.cgroup(sandbox_id)
                    cg.kill()
                    cg.remove()

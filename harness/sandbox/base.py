"""The sandbox seam: a Provider makes Sandboxes; every call returns a frozen record.

Backends (``local``, later ``http``) implement these two abstract classes and
nothing else; the rest of the harness only ever talks to this module. Records
are plain frozen dataclasses with ``to_dict``/``from_dict`` so that they cross
process boundaries (Ray, HTTP) and become dataset columns unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

SandboxType = Literal["small", "medium", "large"]
OutputStream = Literal["stdout", "stderr"]
OutputCallback = Callable[[OutputStream, bytes], None]

#: Exit code reported when a command is killed by its timeout (as coreutils' timeout).
TIMEOUT_EXIT_CODE = 124
#: Where a sandbox's writable home lives; ``~`` in commands means this.
HOME = "/home/user"


class _Record:
    """Mixin for frozen records: dict round trip for JSON, Ray and Arrow."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]):
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True)
class Resources(_Record):
    """Limits that a sandbox type stands for."""

    cpus: float
    memory_bytes: int
    pids: int
    tmp_bytes: int


#: The sandbox types and their limits. Memory includes what the sandbox writes to
#: /tmp and to its home: both are in memory (tmpfs), which makes forks cheap.
SANDBOX_TYPES: dict[str, Resources] = {
    "small": Resources(cpus=1.0, memory_bytes=2 << 30, pids=512, tmp_bytes=512 << 20),
    "medium": Resources(cpus=2.0, memory_bytes=4 << 30, pids=1024, tmp_bytes=1 << 30),
    "large": Resources(cpus=4.0, memory_bytes=8 << 30, pids=4096, tmp_bytes=2 << 30),
}


@dataclass(frozen=True)
class SandboxSpec(_Record):
    """What to create: every field has a default, so ``SandboxSpec()`` is valid."""

    name: str | None = None
    type: SandboxType = "small"
    #: Seconds until the sandbox is deleted; None keeps it until deleted.
    ttl_s: float | None = 3600.0
    #: Outbound network (the host's loopback stays unreachable either way).
    network: bool = False
    #: Extra environment variables for every command run in the sandbox.
    env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.type not in SANDBOX_TYPES:
            from harness.errors import ConfigError

            raise ConfigError(
                f"unknown sandbox type {self.type!r}; use one of: {', '.join(SANDBOX_TYPES)}"
            )
        if self.ttl_s is not None and not (math.isfinite(self.ttl_s) and self.ttl_s > 0):
            from harness.errors import ConfigError

            raise ConfigError(f"ttl must be a positive, finite number of seconds (or None), got {self.ttl_s}")

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data["env"] = dict(self.env)
        return data


@dataclass(frozen=True)
class ExecResult(_Record):
    """The outcome of one command. A command killed by its timeout has
    ``timed_out=True`` and ``exit_code == 124``; output is kept up to the cap."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    duration_s: float
    timed_out: bool = False
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def text(self, stream: OutputStream = "stdout") -> str:
        return getattr(self, stream).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class SandboxInfo(_Record):
    """A sandbox as ``harness sandbox info`` shows it. Times are Unix seconds."""

    id: str
    name: str | None
    type: str
    status: str  # "running" | "stopped" | "expired"
    created_at: float
    expires_at: float | None
    from_snapshot: str | None
    resumed_from: str | None
    network: bool
    memory_restored: bool = False
    backend: str = "local"

    JSON_KEYS: ClassVar[dict[str, str]] = {
        "created_at": "createdAt",
        "expires_at": "expiresAt",
        "from_snapshot": "fromSnapshot",
        "resumed_from": "resumedFrom",
        "memory_restored": "memoryRestored",
    }

    def to_json(self) -> dict[str, Any]:
        """The camelCase form the command line prints (the seed's `sbx info`)."""
        return {self.JSON_KEYS.get(k, k): v for k, v in self.to_dict().items()}


@dataclass(frozen=True)
class SnapshotInfo(_Record):
    """A named, immutable snapshot: an ordered chain of content-addressed layers."""

    name: str
    snapshot_id: str
    size_bytes: int
    source_sandbox_id: str | None
    type: str
    created_at: float
    layers: tuple[str, ...]
    parent: str | None = None
    status: str = "ready"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "snapshotId": self.snapshot_id,
            "sizeBytes": self.size_bytes,
            "sourceSandboxId": self.source_sandbox_id,
            "status": self.status,
            "type": self.type,
            "createdAt": self.created_at,
            "parent": self.parent,
            "layers": list(self.layers),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SnapshotInfo:
        data = dict(data)
        data["layers"] = tuple(data.get("layers", ()))
        return super().from_dict(data)


@dataclass(frozen=True)
class GcReport(_Record):
    """What a garbage collection removed."""

    deleted_sandboxes: tuple[str, ...] = ()
    removed_layers: tuple[str, ...] = ()


class Sandbox(ABC):
    """A live sandbox. Use it as a context manager to delete it in every outcome."""

    id: str

    @abstractmethod
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
        """Run ``command`` under ``sh -c`` in the sandbox, as its user, in ``cwd``
        (default the home directory). ``on_output`` sees output as it is produced.
        A timeout kills the command's whole process tree, daemons included."""

    @abstractmethod
    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Write ``data`` to ``path`` in the sandbox (relative paths are under home)."""

    @abstractmethod
    def read_file(self, path: str) -> bytes:
        """Read ``path`` from the sandbox; SandboxFileError if it is not readable."""

    @abstractmethod
    def snapshot(self, name: str) -> SnapshotInfo:
        """Capture the sandbox's files as an immutable named snapshot."""

    @abstractmethod
    def fork(self, spec: SandboxSpec | None = None) -> Sandbox:
        """A new sandbox with a copy of this one's files; both stay independent."""

    @abstractmethod
    def rename(self, name: str) -> SandboxInfo: ...

    @abstractmethod
    def info(self) -> SandboxInfo: ...

    @abstractmethod
    def delete(self) -> None:
        """Stop every process and remove every trace; deleting twice is fine."""

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.delete()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id}>"


class Provider(ABC):
    """Creates, finds and lists sandboxes and snapshots of one backend."""

    name: str

    @abstractmethod
    def create(self, spec: SandboxSpec | None = None, *, from_snapshot: str | None = None) -> Sandbox:
        """A new running sandbox: empty home, or the files of snapshot ``from_snapshot``."""

    @abstractmethod
    def get(self, sandbox_id: str) -> Sandbox:
        """The live sandbox with this id; SandboxNotFound if it is gone or expired."""

    def fork(self, sandbox_id: str, spec: SandboxSpec | None = None) -> Sandbox:
        return self.get(sandbox_id).fork(spec)

    @abstractmethod
    def list(self) -> list[SandboxInfo]: ...

    @abstractmethod
    def snapshots(self) -> list[SnapshotInfo]: ...

    @abstractmethod
    def snapshot_info(self, name: str) -> SnapshotInfo:
        """SnapshotNotFound if there is no snapshot with this name (or id)."""

    @abstractmethod
    def delete_snapshot(self, name: str) -> None: ...

    @abstractmethod
    def gc(self) -> GcReport:
        """Delete expired or dead sandboxes and layers no snapshot or sandbox uses."""

    def close(self) -> None:
        """Release client resources; sandboxes keep running."""

    def __enter__(self) -> Provider:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

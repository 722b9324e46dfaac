"""The record the local backend keeps on disk about one sandbox."""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from harness.errors import SandboxNotFound
from harness.sandbox import _jail
from harness.sandbox._store import storage_error

ID_RE = re.compile(r"^sb_[a-z0-9]{10}$")


def new_id() -> str:
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    return "sb_" + "".join(secrets.choice(alphabet) for _ in range(10))


@dataclass(frozen=True)
class SandboxRecord:
    """What the backend keeps on disk about one sandbox."""

    id: str
    name: str | None
    type: str
    network: bool
    created_at: float
    expires_at: float | None
    layers: tuple[str, ...]  # bottom first: a sha256 (on disk) or "eph/<uuid>" (in memory)
    generation: int = 0  # which upper-N/work-N is the sandbox's current writable layer
    from_snapshot: str | None = None
    resumed_from: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    init_pid: int | None = None
    init_start: int | None = None
    slirp_pid: int | None = None
    slirp_start: int | None = None
    pooled: bool = False  # a warm, unclaimed jail (see _pool)
    deadline: float | None = None  # when the jail ends by itself, whatever happens (see _jail.bwrap_args)
    starter_pid: int | None = None  # the process starting the jail, until init_pid is recorded
    starter_start: int | None = None

    @classmethod
    def load(cls, path: Path) -> SandboxRecord:
        data = json.loads(path.read_text())
        data["layers"] = tuple(data["layers"])
        return cls(**data)

    def save(self, path: Path) -> None:
        tmp = path.with_name(f".meta-{secrets.token_hex(4)}")
        try:
            tmp.write_text(json.dumps(asdict(self)))
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if isinstance(exc, FileNotFoundError):
                raise SandboxNotFound(f"sandbox {self.id} was deleted meanwhile") from None
            raise storage_error(exc, f"saving the record of sandbox {self.id}", path.parent.parent) from exc

    def expired(self, now: float | None = None) -> bool:
        return self.expires_at is not None and (now or time.time()) >= self.expires_at

    def running(self) -> bool:
        return _jail.alive(self.init_pid, self.init_start)

    def start_abandoned(self) -> bool:
        """A jail that was never recorded as started, and whose starter died: a
        create killed half-way (its overlay may still be mounted on the host)."""
        return self.init_pid is None and self.starter_pid is not None and not _jail.alive(
            self.starter_pid, self.starter_start
        )

"""The sandbox layer: one seam (``base``), one module per backend."""

from __future__ import annotations

import os
from pathlib import Path

from harness.sandbox.base import (
    HOME,
    SANDBOX_TYPES,
    TIMEOUT_EXIT_CODE,
    ExecResult,
    GcReport,
    Provider,
    Sandbox,
    SandboxInfo,
    SandboxSpec,
    SnapshotInfo,
)

__all__ = [
    "HOME",
    "SANDBOX_TYPES",
    "TIMEOUT_EXIT_CODE",
    "ExecResult",
    "GcReport",
    "Provider",
    "Sandbox",
    "SandboxInfo",
    "SandboxSpec",
    "SnapshotInfo",
    "open_provider",
]


def open_provider(backend: str = "local", *, state_dir: str | Path | None = None, **options) -> Provider:
    """The Provider of ``backend``: ``local`` (embedded, the default) or ``http``."""
    if backend == "local":
        from harness.sandbox.local import LocalProvider

        return LocalProvider(state_dir=state_dir, **options)
    if backend == "http":
        from harness.sandbox.http import HttpProvider  # type: ignore[import-not-found]

        return HttpProvider(**options)
    from harness.errors import ConfigError

    raise ConfigError(f"unknown sandbox backend {backend!r}; use 'local' or 'http'")


def default_state_dir() -> Path:
    """``$HARNESS_HOME``, else ``$XDG_DATA_HOME/harness``, else ``~/.local/share/harness``."""
    if home := os.environ.get("HARNESS_HOME"):
        return Path(home)
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data) / "harness"

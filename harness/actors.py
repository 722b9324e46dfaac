"""The worker that owns sandbox lifecycles: plain Python, wrapped by Ray in the driver.

Each worker opens its own Provider (providers are not shared across processes)
and, for ``method: fork``, keeps one warm source sandbox started from the
environment's snapshot, forking it for every episode. Tests use this class
directly, without Ray.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
from collections.abc import Mapping
from typing import Any

from harness.env import GradeSpec
from harness.episode import METHODS, EpisodeRequest, EpisodeResult, run_episode
from harness.errors import ConfigError, SandboxNotFound
from harness.sandbox import open_provider
from harness.sandbox.base import Provider, Sandbox, SandboxSpec

#: The fork source lives this long, then is replaced on the next fork; a crashed
#: run's source is thus removed by the backend's TTL instead of leaking.
SOURCE_TTL_S = 3600.0
#: Started sandboxes a local worker keeps ready (see harness.sandbox._pool).
WARM_POOL_SIZE = 2


def ray_node_id() -> str | None:
    """The Ray node this process runs on, or None outside Ray."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # pragma: no cover - Ray missing or not connected
        return None


def where() -> str:
    """The ``host`` column: the machine's name, plus the Ray node id inside Ray
    (several nodes may share a machine, e.g. in tests)."""
    node = ray_node_id()
    return f"{socket.gethostname()}/{node}" if node else socket.gethostname()


class EpisodeWorker:
    """Runs episodes one at a time against one provider and one snapshot."""

    def __init__(
        self,
        snapshot: str,
        grade: GradeSpec | Mapping[str, Any],
        *,
        backend: str = "local",
        provider_options: Mapping[str, Any] | None = None,
        provider: Provider | None = None,
        name: str = "",
    ):
        self.snapshot = snapshot
        self.grade = grade if isinstance(grade, GradeSpec) else GradeSpec(**grade)
        options = dict(provider_options or {})
        if backend == "local":
            # Jails for the next episodes start while this one runs (new_from).
            options.setdefault("pool_size", WARM_POOL_SIZE)
        self.provider = provider or open_provider(backend, **options)
        self.name = name or f"worker-{os.getpid()}"
        self.source: Sandbox | None = None
        self.source_key: tuple[str, bool] | None = None
        self.current: Sandbox | None = None  # the episode's sandbox, for close() on interrupt
        self.lock = threading.Lock()
        self.closed = False
        self.host = where()

    def ready(self) -> str:
        """Cheap call the driver awaits to know the actor is up."""
        return self.name

    def node_id(self) -> str | None:
        """The Ray node this worker runs on (the driver reaps leftovers there)."""
        return ray_node_id()

    def _source(self, request: EpisodeRequest) -> Sandbox:
        key = (request.sandbox_type, request.network)
        if self.source is not None and self.source_key != key:
            self._drop_source()
        if self.source is None:
            spec = SandboxSpec(name=f"{self.name}-source"[:60], type=request.sandbox_type,  # type: ignore[arg-type]
                               ttl_s=SOURCE_TTL_S, network=request.network)
            self.source = self.provider.create(spec, from_snapshot=self.snapshot)
            self.source_key = key
        return self.source

    def _drop_source(self) -> None:
        source, self.source, self.source_key = self.source, None, None
        if source is not None:
            try:
                source.delete()
            except Exception:  # best effort: the TTL removes it otherwise
                pass

    def _acquire(self, request: EpisodeRequest) -> Sandbox:
        if request.method == "new_from":
            sb = self.provider.create(request.spec(), from_snapshot=self.snapshot)
        elif request.method == "fork":
            try:
                sb = self._source(request).fork(request.spec())
            except SandboxNotFound:
                # The warm source expired or was collected: start a new one, once.
                self._drop_source()
                sb = self._source(request).fork(request.spec())
        else:
            raise ConfigError(f"unknown method {request.method!r}; use one of: {', '.join(METHODS)}")
        with self.lock:
            self.current = sb
        return sb

    def run(self, request: EpisodeRequest) -> EpisodeResult:
        try:
            result = run_episode(request, self._acquire, self.grade, actor=self.name)
            return dataclasses.replace(result, host=self.host)
        finally:
            with self.lock:
                self.current = None

    def close(self) -> None:
        """Delete the warm source and any episode sandbox still alive (Ctrl-C, shutdown)."""
        if self.closed:
            return
        self.closed = True
        with self.lock:
            current, self.current = self.current, None
        if current is not None:
            try:
                current.delete()
            except Exception:
                pass
        self._drop_source()
        self.provider.close()  # deletes the warm pool's jails

"""The http backend: sandboxes of a remote `harness serve`, over one pooled httpx client.

``HttpProvider(url, token)`` implements the seam exactly as the local backend
does (the same conformance suite runs against both). Errors the server reports
come back as the same exception classes; a server that cannot be reached is
``SandboxUnavailable``. Idempotent calls (reads, deletes, renames, file writes,
gc) are retried with backoff on connection errors; calls that make something
(create, fork, snapshot) and ``exec`` are never retried: a retry could run a
command twice or leak a sandbox.

The url and token default to ``HARNESS_SANDBOX_URL`` and ``HARNESS_SANDBOX_TOKEN``.
"""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any
from urllib.parse import quote

import httpx

from harness import errors
from harness.errors import (
    ConfigError,
    HarnessError,
    SandboxAuthError,
    SandboxError,
    SandboxNotFound,
    SandboxTimeout,
    SandboxUnavailable,
)
from harness.sandbox.base import (
    ExecResult,
    GcReport,
    OutputCallback,
    Provider,
    Sandbox,
    SandboxInfo,
    SandboxSpec,
    SnapshotInfo,
)

#: Transport errors after which an idempotent call is retried: the connection
#: failed or broke, as opposed to a timeout or an answer.
_RETRYABLE = (httpx.NetworkError, httpx.RemoteProtocolError, httpx.ConnectTimeout)
#: The read timeout of an exec stream; the server sends a heartbeat every 5 s.
_EXEC_READ_TIMEOUT_S = 60.0


class HttpProvider(Provider):
    """Sandboxes of the `harness serve` at ``url``."""

    name = "http"

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout: float = 300.0,
        retries: int = 3,
        backoff_s: float = 0.2,
        max_connections: int = 256,
    ):
        """``timeout``: seconds for one call to answer (exec streams have no overall
        limit: their commands have their own); ``retries`` of idempotent calls on
        connection errors, waiting ``backoff_s``, then twice as long each time."""
        url = url or os.environ.get("HARNESS_SANDBOX_URL")
        if not url:
            raise ConfigError("the http sandbox backend needs a server url: pass url= or set HARNESS_SANDBOX_URL")
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"sandbox server url {url!r} must start with http:// or https://")
        self.url = url.rstrip("/")
        self.token = token if token is not None else os.environ.get("HARNESS_SANDBOX_TOKEN")
        self.timeout = timeout
        self.retries = max(0, retries)
        self.backoff_s = backoff_s
        self.max_connections = max_connections
        headers = {"User-Agent": "harness-http-backend"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        self._client = httpx.Client(
            base_url=self.url,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=64),
        )

    def __reduce__(self):  # picklable (Ray): the client is rebuilt on the other side
        return (
            _rebuild_provider,
            (self.url, self.token, self.timeout, self.retries, self.backoff_s, self.max_connections),
        )

    def __repr__(self) -> str:
        return f"<HttpProvider {self.url}>"

    # -- transport -------------------------------------------------------------
    def request(self, method: str, path: str, *, retry: bool, **kwargs: Any) -> httpx.Response:
        """One call; errors become the project's exceptions. ``retry`` only for idempotent calls."""
        attempts = 1 + (self.retries if retry else 0)
        for attempt in range(attempts):
            try:
                response = self._client.request(method, path, **kwargs)
            except _RETRYABLE as exc:
                if attempt + 1 < attempts:
                    time.sleep(self.backoff_s * (2**attempt))
                    continue
                raise self._transport_error(exc, method, path) from exc
            except httpx.HTTPError as exc:
                raise self._transport_error(exc, method, path) from exc
            if response.status_code >= 400:
                raise self._answer_error(response, method, path)
            return response
        raise AssertionError("unreachable")

    @contextmanager
    def stream(self, method: str, path: str, **kwargs: Any) -> Iterator[httpx.Response]:
        """A streamed call (never retried)."""
        try:
            with self._client.stream(method, path, **kwargs) as response:
                if response.status_code >= 400:
                    response.read()
                    raise self._answer_error(response, method, path)
                yield response
        except httpx.HTTPError as exc:
            raise self._transport_error(exc, method, path) from exc

    def _transport_error(self, exc: httpx.HTTPError, method: str, path: str) -> HarnessError:
        if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
            return SandboxUnavailable(
                f"cannot reach the sandbox server at {self.url}: {exc or type(exc).__name__}; is `harness serve` running?"
            )
        if isinstance(exc, httpx.TimeoutException):
            return SandboxTimeout(f"the sandbox server at {self.url} did not answer {method} {path} in time ({type(exc).__name__})")
        return SandboxUnavailable(
            f"lost the connection to the sandbox server at {self.url} during {method} {path}: {exc or type(exc).__name__}"
        )

    def _answer_error(self, response: httpx.Response, method: str, path: str) -> HarnessError:
        try:
            err = response.json()["error"]
            kind, message = str(err["type"]), str(err["message"])
        except (ValueError, KeyError, TypeError):
            kind, message = "", response.text.strip().splitlines()[0][:200] if response.text.strip() else ""
        if response.status_code in (401, 403):
            return SandboxAuthError(
                f"the sandbox server at {self.url} refused the token ({response.status_code}): {message}; "
                "set HARNESS_SANDBOX_TOKEN to the server's token"
            )
        exc = error_from(kind, message)
        if exc is not None:
            return exc
        return SandboxError(
            f"the sandbox server at {self.url} answered {response.status_code} to {method} {path}"
            f"{': ' + message if message else ''}; is it a harness sandbox server?"
        )

    # -- Provider --------------------------------------------------------------
    def _sandbox(self, info: dict[str, Any]) -> HttpSandbox:
        return HttpSandbox(self, SandboxInfo.from_dict(info).id)

    def create(self, spec: SandboxSpec | None = None, *, from_snapshot: str | None = None) -> HttpSandbox:
        body = {"spec": (spec or SandboxSpec()).to_dict(), "from_snapshot": from_snapshot}
        return self._sandbox(self.request("POST", "/v1/sandboxes", retry=False, json=body).json())

    def get(self, sandbox_id: str) -> HttpSandbox:
        self.request("GET", _sandbox_path(sandbox_id), retry=True)
        return HttpSandbox(self, sandbox_id)

    def fork(self, sandbox_id: str, spec: SandboxSpec | None = None) -> HttpSandbox:
        body = {"spec": spec.to_dict() if spec else None}
        return self._sandbox(self.request("POST", _sandbox_path(sandbox_id, "fork"), retry=False, json=body).json())

    def list(self) -> list[SandboxInfo]:
        return [SandboxInfo.from_dict(d) for d in self.request("GET", "/v1/sandboxes", retry=True).json()]

    def snapshots(self) -> list[SnapshotInfo]:
        return [SnapshotInfo.from_dict(d) for d in self.request("GET", "/v1/snapshots", retry=True).json()]

    def snapshot_info(self, name: str) -> SnapshotInfo:
        return SnapshotInfo.from_dict(self.request("GET", _snapshot_path(name), retry=True).json())

    def delete_snapshot(self, name: str) -> None:
        self.request("DELETE", _snapshot_path(name), retry=True)

    def gc(self) -> GcReport:
        data = self.request("POST", "/v1/gc", retry=True).json()
        return GcReport(
            deleted_sandboxes=tuple(data.get("deleted_sandboxes", ())),
            removed_layers=tuple(data.get("removed_layers", ())),
        )

    def close(self) -> None:
        self._client.close()


class HttpSandbox(Sandbox):
    """A handle on one remote sandbox; holds nothing but its id."""

    def __init__(self, provider: HttpProvider, sandbox_id: str):
        self.provider = provider
        self.id = sandbox_id

    def _path(self, verb: str = "") -> str:
        return _sandbox_path(self.id, verb)

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
        body = {
            "command": command,
            "timeout": timeout,
            "env": dict(env or {}),
            "cwd": cwd,
            "stdin": base64.b64encode(stdin).decode("ascii") if stdin is not None else None,
            "max_output_bytes": max_output_bytes,
            "stream": on_output is not None,
        }
        bufs = {"stdout": bytearray(), "stderr": bytearray()}
        final: dict[str, Any] | None = None
        read_timeout = max(self.provider.timeout, _EXEC_READ_TIMEOUT_S)
        with self.provider.stream(
            "POST", self._path("exec"), json=body, timeout=httpx.Timeout(self.provider.timeout, read=read_timeout)
        ) as response:
            for line in response.iter_lines():
                if not line:
                    continue
                msg = json.loads(line)
                if "stream" in msg:
                    stream = msg["stream"]
                    chunk = base64.b64decode(msg["data"])
                    if on_output is not None:
                        on_output(stream, chunk)
                    buf = bufs[stream]
                    room = max_output_bytes - len(buf)
                    if room > 0:
                        buf += chunk[:room]
                elif "exit_code" in msg:
                    final = msg  # the stream ends here; reading to its end keeps the connection pooled
                elif "error" in msg:
                    err = msg["error"]
                    raise error_from(err.get("type", ""), err.get("message", "")) or SandboxError(err.get("message", ""))
        if final is None:
            raise SandboxUnavailable(
                f"the sandbox server at {self.provider.url} ended the output of a command in {self.id} before its result"
            )
        return ExecResult(
            exit_code=int(final["exit_code"]),
            stdout=bytes(bufs["stdout"]),
            stderr=bytes(bufs["stderr"]),
            duration_s=float(final["duration_s"]),
            timed_out=bool(final["timed_out"]),
            truncated=bool(final["truncated"]),
        )

    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        self.provider.request(
            "PUT",
            self._path("files"),
            retry=True,
            params={"path": path, "mode": mode},
            content=bytes(data),
            headers={"Content-Type": "application/octet-stream"},
        )

    def read_file(self, path: str) -> bytes:
        return self.provider.request("GET", self._path("files"), retry=True, params={"path": path}).content

    def snapshot(self, name: str) -> SnapshotInfo:
        data = self.provider.request("POST", self._path("snapshot"), retry=False, json={"name": name}).json()
        return SnapshotInfo.from_dict(data)

    def fork(self, spec: SandboxSpec | None = None) -> HttpSandbox:
        return self.provider.fork(self.id, spec)

    def rename(self, name: str) -> SandboxInfo:
        data = self.provider.request("POST", self._path("rename"), retry=True, json={"name": name}).json()
        return SandboxInfo.from_dict(data)

    def info(self) -> SandboxInfo:
        return SandboxInfo.from_dict(self.provider.request("GET", self._path(), retry=True).json())

    def delete(self) -> None:
        self.provider.request("DELETE", self._path(), retry=True)

    def __reduce__(self):
        return (HttpSandbox, (self.provider, self.id))


def error_from(kind: str, message: str) -> HarnessError | None:
    """The project's exception named ``kind`` with ``message``; None if there is no such class."""
    cls = getattr(errors, kind, None) if kind else None
    if not (isinstance(cls, type) and issubclass(cls, HarnessError)):
        return None
    try:
        return cls(message)
    except TypeError:  # a class with its own constructor (MissingDependency)
        exc = cls.__new__(cls)
        Exception.__init__(exc, message)
        return exc


def _sandbox_path(sandbox_id: str, verb: str = "") -> str:
    # A slash or a dot segment would route elsewhere once the URL is normalized:
    # no sandbox has such an id.
    if not sandbox_id or "/" in sandbox_id or sandbox_id in (".", "..") or "\x00" in sandbox_id:
        raise SandboxNotFound(f"no sandbox {sandbox_id!r}: ids look like sb_0123456789")
    path = f"/v1/sandboxes/{quote(sandbox_id, safe='')}"
    return f"{path}/{verb}" if verb else path


def _snapshot_path(name: str) -> str:
    if not name or name in (".", "..") or "\x00" in name:
        from harness.errors import SnapshotNotFound

        raise SnapshotNotFound(f"no snapshot named {name!r}; `harness sandbox snapshots` lists them")
    return f"/v1/snapshots/{quote(name, safe='')}"


def _rebuild_provider(url, token, timeout, retries, backoff_s, max_connections) -> HttpProvider:
    return HttpProvider(url, token, timeout=timeout, retries=retries, backoff_s=backoff_s, max_connections=max_connections)

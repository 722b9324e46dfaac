"""`harness serve`: any sandbox Provider over HTTP (FastAPI + uvicorn).

Every verb of the seam is a route under ``/v1``; the OpenAPI document is at
``/openapi.json``. Every route but ``/healthz`` needs ``Authorization: Bearer
TOKEN`` (compared in constant time). Errors are JSON ``{"error": {"type":
"SandboxNotFound", "message": "..."}}`` with a status that matches the class,
so the http backend re-raises the same exception on the client.

``exec`` answers with NDJSON, one object per line, as the command produces output::

    {"stream": "stdout", "data": "<base64>"}       any number of these, in order
    {"heartbeat": true}                            while the command is silent
    {"exit_code": 0, "duration_s": 0.01, "timed_out": false, "truncated": false}
    {"error": {"type": "...", "message": "..."}}   instead of the line above

With ``"stream": true`` in the request every chunk is sent (the caller's
``on_output`` sees them all); otherwise only the first ``max_output_bytes`` of
each stream. A client that goes away mid-stream stops its command: at its next
output, and a silent one by a kill of every process in the sandbox that carries
the command's ``HARNESS_EXEC_ID`` environment variable.

Provider calls block, so plain routes run in the thread pool and each exec
runs in a thread of its own: many clients and commands proceed at once.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import ipaddress
import json
import logging
import secrets
import sys
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from harness import __version__
from harness.errors import (
    ConfigError,
    HarnessError,
    SandboxFileError,
    SandboxNotFound,
    SandboxTimeout,
    SandboxUnavailable,
    SnapshotExists,
    SnapshotNotFound,
)
from harness.sandbox.base import (
    GcReport,
    Provider,
    SandboxInfo,
    SandboxSpec,
    SnapshotInfo,
)

log = logging.getLogger("harness.serve")

#: Seconds between heartbeat lines of a silent exec (lets clients detect a dead server).
HEARTBEAT_S = 5.0
#: Output queued for a slow client beyond which the command's reader waits.
_MAX_QUEUED_BYTES = 32 << 20
#: Threads for the blocking routes (Starlette's default of 40 is low for rollouts).
_THREADPOOL_TOKENS = 256
_OPEN_PATHS = frozenset({"/healthz"})

#: Status code of each error class (the first match wins); anything else is a 500.
ERROR_STATUS: tuple[tuple[type[BaseException], int], ...] = (
    (SandboxNotFound, 404),
    (SnapshotNotFound, 404),
    (SnapshotExists, 409),
    (ConfigError, 400),
    (SandboxFileError, 422),
    (SandboxUnavailable, 503),
    (SandboxTimeout, 504),
)


def status_of(exc: BaseException) -> int:
    for cls, status in ERROR_STATUS:
        if isinstance(exc, cls):
            return status
    return 500


def error_body(exc: BaseException) -> dict[str, Any]:
    """The JSON error of an exception: its class name and its one-line message."""
    if isinstance(exc, HarnessError):
        kind, message = type(exc).__name__, str(exc)
    else:  # a bug or an unexpected failure below the seam
        kind, message = "SandboxError", f"internal error in the sandbox server: {type(exc).__name__}: {exc}"
    lines = message.strip().splitlines()
    return {"error": {"type": kind, "message": lines[0] if lines else kind}}


# -- request bodies (responses are the seam's own records) -------------------------


class SpecBody(BaseModel):
    """A SandboxSpec; the defaults are the seam's."""

    name: str | None = None
    type: str = "small"
    ttl_s: float | None = 3600.0
    network: bool = False
    env: dict[str, str] = Field(default_factory=dict)

    def to_spec(self) -> SandboxSpec:
        _no_nul(self.name or "", "sandbox name")
        for key, value in self.env.items():
            _no_nul(key + value, "environment variable")
        return SandboxSpec(**self.model_dump())  # type: ignore[arg-type]


class CreateBody(BaseModel):
    spec: SpecBody = Field(default_factory=SpecBody)
    from_snapshot: str | None = Field(None, description="start from this snapshot (name or id)")


class ForkBody(BaseModel):
    spec: SpecBody | None = Field(None, description="default: the source's type, network and env")


class ExecBody(BaseModel):
    command: str = Field(description="run under sh -c in the sandbox, as its user")
    timeout: float | None = Field(None, description="seconds; then the whole tree is killed (exit 124)")
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    stdin: str | None = Field(None, description="base64 bytes fed to the command's standard input")
    max_output_bytes: int = Field(16 << 20, ge=0, description="bytes of each stream kept in the result")
    stream: bool = Field(True, description="send every chunk (true) or only what the result keeps (false)")


class NameBody(BaseModel):
    name: str


class ErrorDetail(BaseModel):
    type: str = Field(description="the exception class, e.g. SandboxNotFound (Unauthorized for 401/403)")
    message: str = Field(description="one line: what is wrong and what to do")


class ErrorBody(BaseModel):
    error: ErrorDetail


_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": text}
    for status, text in (
        (400, "bad input (ConfigError)"),
        (401, "no bearer token"),
        (403, "wrong bearer token"),
        (404, "no such sandbox or snapshot"),
        (409, "the snapshot name is taken"),
        (422, "invalid request or file path"),
        (500, "any other sandbox error"),
        (503, "the backend cannot run here"),
        (504, "the backend took too long"),
    )
}


def _no_nul(text: str, what: str) -> None:
    if "\x00" in text:
        raise ConfigError(f"invalid {what}: it contains a NUL byte")


def _check_path(path: str) -> str:
    if not path:
        raise SandboxFileError("no file path given: pass ?path=...")
    if "\x00" in path:
        raise SandboxFileError(f"invalid path {path!r}: it contains a NUL byte")
    return path


class _ClientGone(Exception):
    """Raised inside a command's output callback once its client disconnected."""


# -- authentication ----------------------------------------------------------------


class BearerAuth:
    """ASGI middleware: every path but the open ones needs the bearer token."""

    def __init__(self, app, token: str | None):
        self.app = app
        self.token = token.encode() if token else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.token is None or scope["path"] in _OPEN_PATHS:
            return await self.app(scope, receive, send)
        header = b""
        for key, value in scope["headers"]:
            if key == b"authorization":
                header = value
        scheme, _, given = header.partition(b" ")
        if scheme.lower() != b"bearer" or not given.strip():
            status, message = 401, "this server needs a bearer token: set HARNESS_SANDBOX_TOKEN"
        elif not hmac.compare_digest(given.strip(), self.token):
            status, message = 403, "the bearer token is wrong: set HARNESS_SANDBOX_TOKEN to the server's token"
        else:
            return await self.app(scope, receive, send)
        response = JSONResponse(
            {"error": {"type": "Unauthorized", "message": message}},
            status_code=status,
            headers={"WWW-Authenticate": "Bearer"},
        )
        await response(scope, receive, send)


# -- the application ---------------------------------------------------------------


def create_app(provider: Provider, token: str | None) -> FastAPI:
    """The ASGI app serving ``provider``; ``token`` None means no authentication."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        import anyio.to_thread

        anyio.to_thread.current_default_thread_limiter().total_tokens = _THREADPOOL_TOKENS
        yield

    app = FastAPI(
        title="harness sandbox server",
        version=__version__,
        description="\n\n".join((__doc__ or "").split("\n\n")[1:5]),
        responses=_ERROR_RESPONSES,
        docs_url=None,
        redoc_url=None,
        lifespan=lifespan,
    )
    app.add_middleware(BearerAuth, token=token)  # type: ignore[arg-type]

    @app.exception_handler(HarnessError)
    async def harness_error(request: Request, exc: HarnessError) -> JSONResponse:
        return JSONResponse(error_body(exc), status_code=status_of(exc))

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors():
            where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        return JSONResponse(
            {"error": {"type": "ConfigError", "message": "invalid request: " + "; ".join(parts)}},
            status_code=422,
        )

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return JSONResponse(error_body(exc), status_code=500)

    def sandbox(sandbox_id: str):
        return provider.get(sandbox_id)

    @app.get("/healthz", tags=["server"])
    def healthz() -> dict[str, Any]:
        """Open to everyone: is the server up."""
        return {"ok": True, "backend": provider.name, "version": __version__}

    # -- sandboxes -------------------------------------------------------------
    @app.get("/v1/sandboxes", response_model=list[SandboxInfo], tags=["sandboxes"])
    def list_sandboxes():
        return provider.list()

    @app.post("/v1/sandboxes", response_model=SandboxInfo, status_code=201, tags=["sandboxes"])
    def create(body: CreateBody):
        """A new sandbox, empty or from a snapshot."""
        return provider.create(body.spec.to_spec(), from_snapshot=body.from_snapshot).info()

    @app.get("/v1/sandboxes/{sandbox_id}", response_model=SandboxInfo, tags=["sandboxes"])
    def info(sandbox_id: str):
        return sandbox(sandbox_id).info()

    @app.delete("/v1/sandboxes/{sandbox_id}", status_code=204, tags=["sandboxes"])
    def delete(sandbox_id: str) -> Response:
        """Deleting a sandbox that is already gone is fine."""
        try:
            sandbox(sandbox_id).delete()
        except SandboxNotFound:
            pass
        return Response(status_code=204)

    @app.post("/v1/sandboxes/{sandbox_id}/fork", response_model=SandboxInfo, status_code=201, tags=["sandboxes"])
    def fork(sandbox_id: str, body: ForkBody | None = None):
        spec = body.spec.to_spec() if body and body.spec else None
        return provider.fork(sandbox_id, spec).info()

    @app.post("/v1/sandboxes/{sandbox_id}/rename", response_model=SandboxInfo, tags=["sandboxes"])
    def rename(sandbox_id: str, body: NameBody):
        _no_nul(body.name, "sandbox name")
        return sandbox(sandbox_id).rename(body.name)

    @app.post("/v1/sandboxes/{sandbox_id}/snapshot", response_model=SnapshotInfo, status_code=201, tags=["snapshots"])
    def snapshot(sandbox_id: str, body: NameBody):
        _no_nul(body.name, "snapshot name")
        return sandbox(sandbox_id).snapshot(body.name)

    # -- files -----------------------------------------------------------------
    @app.get(
        "/v1/sandboxes/{sandbox_id}/files",
        response_class=Response,
        responses={200: {"content": {"application/octet-stream": {}}, "description": "the file's bytes"}},
        tags=["files"],
    )
    def read_file(sandbox_id: str, path: str = Query(description="relative paths are under the home")):
        data = sandbox(sandbox_id).read_file(_check_path(path))
        return Response(data, media_type="application/octet-stream")

    @app.put(
        "/v1/sandboxes/{sandbox_id}/files",
        status_code=204,
        openapi_extra={"requestBody": {"required": True, "content": {"application/octet-stream": {}}}},
        tags=["files"],
    )
    async def write_file(
        sandbox_id: str,
        request: Request,
        path: str = Query(description="relative paths are under the home"),
        mode: int = Query(0o644, ge=0, le=0o7777, description="permission bits, as a decimal integer"),
    ) -> Response:
        """Write the request body (raw bytes) to ``path``, creating parent directories."""
        _check_path(path)
        data = await request.body()
        await run_in_threadpool(lambda: sandbox(sandbox_id).write_file(path, data, mode))
        return Response(status_code=204)

    # -- exec ------------------------------------------------------------------
    @app.post(
        "/v1/sandboxes/{sandbox_id}/exec",
        response_class=StreamingResponse,
        responses={200: {"content": {"application/x-ndjson": {}}, "description": "output lines, then the result"}},
        tags=["exec"],
    )
    async def exec_(sandbox_id: str, body: ExecBody) -> StreamingResponse:
        """Run a command; output is streamed as NDJSON lines as it is produced."""
        _no_nul(body.command, "command")
        _no_nul(body.cwd or "", "cwd")
        for key, value in body.env.items():
            _no_nul(key + value, "environment variable")
        try:
            stdin = base64.b64decode(body.stdin, validate=True) if body.stdin is not None else None
        except (binascii.Error, ValueError):
            raise ConfigError("stdin must be base64") from None
        sb = await run_in_threadpool(sandbox, sandbox_id)  # unknown id: a 404, not a stream
        return StreamingResponse(_run_exec(sb, body, stdin), media_type="application/x-ndjson")

    # -- snapshots and gc ------------------------------------------------------
    @app.get("/v1/snapshots", response_model=list[SnapshotInfo], tags=["snapshots"])
    def snapshots():
        return provider.snapshots()

    @app.get("/v1/snapshots/{name:path}", response_model=SnapshotInfo, tags=["snapshots"])
    def snapshot_info(name: str):
        return provider.snapshot_info(name)

    @app.delete("/v1/snapshots/{name:path}", status_code=204, tags=["snapshots"])
    def delete_snapshot(name: str) -> Response:
        provider.delete_snapshot(name)
        return Response(status_code=204)

    @app.post("/v1/gc", response_model=GcReport, tags=["server"])
    def gc():
        """Delete expired or dead sandboxes and unused layers."""
        return provider.gc()

    return app


async def _run_exec(sb, body: ExecBody, stdin: bytes | None) -> AsyncIterator[bytes]:
    """Run the command in a thread; yield its output lines as the thread queues them."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    gone = threading.Event()
    finished = threading.Event()
    exec_id = secrets.token_hex(8)
    sent = {"stdout": 0, "stderr": 0}
    queued = [0]  # bytes waiting for the client
    drained = threading.Condition()

    def put(item: dict[str, Any]) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is going down
            gone.set()

    def on_output(stream: str, chunk: bytes) -> None:
        if gone.is_set():
            raise _ClientGone
        if not body.stream:
            room = body.max_output_bytes - sent[stream]
            if room <= 0:
                return
            chunk = chunk[:room]
        sent[stream] += len(chunk)
        with drained:
            # A slow client holds the command back rather than filling memory.
            while queued[0] > _MAX_QUEUED_BYTES and not gone.is_set():
                drained.wait(0.1)
            queued[0] += len(chunk)
        put({"stream": stream, "data": base64.b64encode(chunk).decode("ascii"), "size": len(chunk)})

    def work() -> None:
        try:
            result = sb.exec(
                body.command,
                timeout=body.timeout,
                env={**body.env, "HARNESS_EXEC_ID": exec_id},
                cwd=body.cwd,
                stdin=stdin,
                on_output=on_output,
                max_output_bytes=body.max_output_bytes,
            )
            final: dict[str, Any] = {
                "exit_code": result.exit_code,
                "duration_s": result.duration_s,
                "timed_out": result.timed_out,
                "truncated": result.truncated,
            }
        except _ClientGone:
            return
        except BaseException as exc:  # reported to the client as a line
            if not isinstance(exc, HarnessError):
                log.exception("exec in %s failed", sb.id)
            final = error_body(exc)
        finally:
            finished.set()
        put({**final, "done": True})

    def beat() -> None:
        nonlocal timer
        queue.put_nowait({"heartbeat": True})
        timer = loop.call_later(HEARTBEAT_S, beat)

    timer = loop.call_later(HEARTBEAT_S, beat)
    threading.Thread(target=work, name=f"exec-{sb.id}", daemon=True).start()
    try:
        while True:
            item = await queue.get()
            done = item.pop("done", False)
            size = item.pop("size", 0)
            yield json.dumps(item).encode() + b"\n"
            if done:
                return
            if size:
                with drained:
                    queued[0] -= size
                    drained.notify_all()
    finally:
        timer.cancel()
        gone.set()  # the client left (or all is sent): a still running command dies at its next output
        with drained:
            drained.notify_all()
        if not finished.is_set():
            threading.Thread(target=_stop_exec, args=(sb, exec_id, finished), daemon=True).start()


_KILL_SCRIPT = (
    "for d in /proc/[0-9]*; do "
    "tr '\\0' '\\n' < $d/environ 2>/dev/null | grep -qx HARNESS_EXEC_ID={id} && kill -9 ${{d#/proc/}} 2>/dev/null; "
    "done; true"
)


def _stop_exec(sb, exec_id: str, finished: threading.Event) -> None:
    """Kill a command whose client went away, if it does not stop by itself."""
    for _ in range(3):
        if finished.wait(0.3):
            return
        try:
            sb.exec(_KILL_SCRIPT.format(id=exec_id), timeout=10)
        except HarnessError:
            return  # the sandbox is gone, and its commands with it


# -- serving ------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_token(token_file: str | None, env_token: str | None) -> str | None:
    """The server's token: from ``token_file`` if given, else the environment."""
    if token_file:
        try:
            with open(token_file) as f:
                token = f.read().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read the token file {token_file}: {exc.strerror}") from None
        if not token:
            raise ConfigError(f"the token file {token_file} is empty")
        return token
    return (env_token or "").strip() or None


def serve(
    host: str = "127.0.0.1",
    port: int = 8765,
    *,
    token: str | None,
    insecure: bool = False,
    provider: Provider | None = None,
) -> None:
    """Serve ``provider`` (default: the local backend) until interrupted."""
    if token is None:
        if not (insecure and is_loopback(host)):
            where = "" if is_loopback(host) else f" on the non-loopback address {host}"
            raise ConfigError(
                f"refusing to serve{where} without a token: set HARNESS_SERVER_TOKEN or pass --token-file"
                " (--insecure runs without one, on a loopback address only)"
            )
        sys.stderr.write(f"harness serve: WARNING: no token: anyone who can reach {host}:{port} controls the sandboxes\n")
    import uvicorn

    if provider is None:
        from harness.sandbox import open_provider

        provider = open_provider("local")
    app = create_app(provider, token)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=5,
        access_log=False,
    )
    server = uvicorn.Server(config)
    sys.stderr.write(f"harness serve: serving the {provider.name} backend on http://{host}:{port} (OpenAPI at /openapi.json)\n")
    sys.stderr.flush()
    try:
        server.run()
    finally:
        provider.close()

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

import base64
import binascii
import hmac
import ipaddress
import logging
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from harness import __version__
from harness.errors import ConfigError, HarnessError, SandboxNotFound
from harness.sandbox._server_exec import HEARTBEAT_S, run_exec
from harness.sandbox._server_models import (
    _ERROR_RESPONSES,
    ERROR_STATUS,
    MAX_FILE_BYTES,
    MAX_JSON_BYTES,
    NON_EMPTY_NO_NUL,
    ClientError,
    CreateBody,
    ErrorBody,
    ExecBody,
    ForkBody,
    NameBody,
    SpecBody,
    check_env,
    check_name,
    check_path,
    error_body,
    no_nul,
    status_of,
    validation_error,
)
from harness.sandbox.base import GcReport, Provider, SandboxInfo, SnapshotInfo

__all__ = ["ERROR_STATUS", "HEARTBEAT_S", "CreateBody", "ErrorBody", "ExecBody", "ForkBody", "NameBody", "SpecBody",
           "create_app", "error_body", "is_loopback", "read_token", "serve", "status_of"]

log = logging.getLogger("harness.serve")

#: Threads for the blocking routes (Starlette's default of 40 is low for rollouts).
_THREADPOOL_TOKENS = 256
_OPEN_PATHS = frozenset({"/healthz"})

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


class BodyLimit:
    """ASGI middleware: a 413 for a request body over the limit (file uploads have a larger one)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = MAX_FILE_BYTES if scope["method"] == "PUT" and scope["path"].endswith("/files") else MAX_JSON_BYTES
        length = dict(scope["headers"]).get(b"content-length", b"0")
        declared = int(length) if length.isdigit() else 0
        if declared > limit:
            return await _error(413, "PayloadTooLarge", f"the request body has {declared} bytes; at most {limit} "
                                "are accepted here")(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:  # a chunked body without a length
                raise ClientError(f"the request body has more than {limit} bytes", kind="PayloadTooLarge",
                                  status=413)
            return message

        return await self.app(scope, counted, send)


def _error(status: int, kind: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"type": kind, "message": message}}, status_code=status, headers=headers)


def _allowed_methods(app: FastAPI, scope: dict[str, Any]) -> list[str]:
    """Every method some route serves at this path (Starlette's 405 names only the first route's)."""
    methods: set[str] = set()
    for route in app.router.routes:
        match, _ = route.matches({**scope, "method": "GET"}) if hasattr(route, "matches") else (Match.NONE, {})
        if match != Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return sorted(methods)


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
    app.add_middleware(BodyLimit)  # type: ignore[arg-type]
    app.add_middleware(BearerAuth, token=token)  # type: ignore[arg-type]

    @app.exception_handler(HarnessError)
    async def harness_error(request: Request, exc: HarnessError) -> JSONResponse:
        return JSONResponse(error_body(exc), status_code=status_of(exc))

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        kind, message = validation_error(list(exc.errors()), request.url.path)
        return _error(422, kind, message)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Routing and parsing errors (unknown route, wrong method, a body that is not JSON) in
        the same one-line JSON error as every other."""
        headers = dict(exc.headers or {})
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}; the API is described at /openapi.json"
            return _error(404, "NotFound", message, headers)
        if exc.status_code == 405:
            allowed = _allowed_methods(app, request.scope)
            headers["Allow"] = ", ".join(allowed)
            message = f"{request.method} is not allowed on {request.url.path}; use {' or '.join(allowed)}"
            return _error(405, "MethodNotAllowed", message, headers)
        if exc.status_code == 400:  # FastAPI: "There was an error parsing the body"
            cause = exc.__cause__
            if isinstance(cause, ClientError):
                return JSONResponse(error_body(cause), status_code=cause.status)
            return _error(400, "ConfigError", "invalid request: the body is not valid JSON", headers)
        message = " ".join(str(exc.detail).split())[:500] or f"HTTP {exc.status_code}"
        return _error(exc.status_code, "HTTPError", message, headers)

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
        check_name(body.name, "sandbox")
        return sandbox(sandbox_id).rename(body.name)

    @app.post("/v1/sandboxes/{sandbox_id}/snapshot", response_model=SnapshotInfo, status_code=201, tags=["snapshots"])
    def snapshot(sandbox_id: str, body: NameBody):
        check_name(body.name, "snapshot")
        return sandbox(sandbox_id).snapshot(body.name)

    # -- files -----------------------------------------------------------------
    @app.get(
        "/v1/sandboxes/{sandbox_id}/files",
        response_class=Response,
        responses={200: {"content": {"application/octet-stream": {}}, "description": "the file's bytes"}},
        tags=["files"],
    )
    def read_file(sandbox_id: str, path: str = Query(description="relative paths are under the home", pattern=NON_EMPTY_NO_NUL)):
        data = sandbox(sandbox_id).read_file(check_path(path))
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
        path: str = Query(description="relative paths are under the home", pattern=NON_EMPTY_NO_NUL),
        mode: int = Query(0o644, ge=0, le=0o7777, description="permission bits, as a decimal integer"),
    ) -> Response:
        """Write the request body (raw bytes) to ``path``, creating parent directories."""
        check_path(path)
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
        no_nul(body.command, "command")
        no_nul(body.cwd or "", "cwd")
        check_env(body.env)
        try:
            stdin = base64.b64decode(body.stdin, validate=True) if body.stdin is not None else None
        except (binascii.Error, ValueError):
            raise ConfigError("stdin must be base64") from None
        sb = await run_in_threadpool(sandbox, sandbox_id)  # unknown id: a 404, not a stream
        return StreamingResponse(run_exec(sb, body, stdin), media_type="application/x-ndjson")

    # -- snapshots and gc ------------------------------------------------------
    @app.get("/v1/snapshots", response_model=list[SnapshotInfo], tags=["snapshots"])
    def snapshots():
        return provider.snapshots()

    @app.get("/v1/snapshots/{name:path}", response_model=SnapshotInfo, tags=["snapshots"])
    def snapshot_info(name: str):
        return provider.snapshot_info(name)

    @app.delete("/v1/snapshots/{name:path}", status_code=204, tags=["snapshots"])
    def delete_snapshot(name: str) -> Response:
        # Looked up first: a name no snapshot can have (or an id) is a 404 here, as for GET.
        provider.delete_snapshot(provider.snapshot_info(name).name)
        return Response(status_code=204)

    @app.post("/v1/gc", response_model=GcReport, tags=["server"])
    def gc():
        """Delete expired or dead sandboxes and unused layers."""
        return provider.gc()

    return app


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

"""The sandbox server's wire formats: request bodies, the error body and its statuses.

Request bodies are strict (``{"network": 0}`` is not a boolean) and refuse unknown
keys, so a typo is a 422 that names it instead of a silently ignored setting.
Numbers must be finite, timeouts and TTLs positive.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from harness.errors import (
    ConfigError,
    HarnessError,
    SandboxError,
    SandboxFileError,
    SandboxNotFound,
    SandboxTimeout,
    SandboxUnavailable,
    SnapshotExists,
    SnapshotNotFound,
)
from harness.sandbox.base import SandboxSpec

#: Largest JSON request body (a command, its environment, base64 stdin): larger is a 413.
MAX_JSON_BYTES = 64 << 20
#: Largest file upload (PUT .../files): larger is a 413.
MAX_FILE_BYTES = 4 << 30
#: Patterns of the request schema, so that clients and fuzzers see the rules (checked by pydantic).
NO_NUL = r"^[^\u0000]*$"
NON_EMPTY_NO_NUL = r"^[^\u0000]+$"
NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
ENV_KEY = r"^[A-Za-z_][A-Za-z0-9_]*$"
Text = Annotated[str, StringConstraints(pattern=NO_NUL)]
Name = Annotated[str, StringConstraints(pattern=NAME)]
EnvKey = Annotated[str, StringConstraints(pattern=ENV_KEY)]
_ENV = {"additionalProperties": False}
BASE64 = r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"
#: Longest TTL a request may ask for: ten years, in seconds.
MAX_TTL_S = 10 * 365 * 86400.0

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
    if isinstance(exc, ClientError):
        return exc.status
    for cls, status in ERROR_STATUS:
        if isinstance(exc, cls):
            return status
    return 500


class ClientError(SandboxError):
    """Bad input found by the server itself; ``kind`` is the class name sent to the client
    (which re-raises that class), ``status`` the HTTP status."""

    def __init__(self, message: str, *, kind: str = "ConfigError", status: int = 400):
        super().__init__(message)
        self.kind, self.status = kind, status


def error_body(exc: BaseException) -> dict[str, Any]:
    """The JSON error of an exception: its class name and its one-line message."""
    if isinstance(exc, ClientError):
        kind, message = exc.kind, str(exc)
    elif isinstance(exc, HarnessError):
        kind, message = type(exc).__name__, str(exc)
    else:  # a bug or an unexpected failure below the seam
        kind, message = "SandboxError", f"internal error in the sandbox server: {type(exc).__name__}: {exc}"
    lines = message.strip().splitlines()
    line = lines[0] if lines else kind
    if len(line) > 500:  # e.g. an id of thousands of characters quoted back
        line = line[:500] + "..."
    return {"error": {"type": kind, "message": line}}




_STRICT = ConfigDict(strict=True, extra="forbid")


class SpecBody(BaseModel):
    """A SandboxSpec; the defaults are the seam's."""

    model_config = _STRICT

    name: Name | None = Field(None, description="letters, digits, '.', '_' and '-', at most 128")
    # Not validated here but by the seam (a 400 that names the types); the enum tells clients.
    type: str = Field("small", description="small, medium or large",
                      json_schema_extra={"enum": ["small", "medium", "large"]})
    ttl_s: float | None = Field(3600.0, gt=0, le=MAX_TTL_S, allow_inf_nan=False,
                                description="seconds until the sandbox is deleted; null for never")
    network: bool = False
    env: dict[EnvKey, Text] = Field(default_factory=dict, json_schema_extra=_ENV)

    def to_spec(self) -> SandboxSpec:
        if self.name is not None:
            check_name(self.name, "sandbox")
        check_env(self.env)
        return SandboxSpec(**self.model_dump())  # type: ignore[arg-type]


class CreateBody(BaseModel):
    model_config = _STRICT

    spec: SpecBody = Field(default_factory=SpecBody)
    from_snapshot: str | None = Field(None, description="start from this snapshot (name or id)")


class ForkBody(BaseModel):
    model_config = _STRICT

    spec: SpecBody | None = Field(None, description="default: the source's type, network and env")


class ExecBody(BaseModel):
    model_config = _STRICT

    command: Text = Field(description="run under sh -c in the sandbox, as its user")
    timeout: float | None = Field(None, gt=0, allow_inf_nan=False,
                                  description="seconds; then the whole tree is killed (exit 124)")
    env: dict[EnvKey, Text] = Field(default_factory=dict, json_schema_extra=_ENV)
    cwd: Text | None = None
    stdin: str | None = Field(None, description="base64 bytes fed to the command's standard input",
                              json_schema_extra={"pattern": BASE64})
    max_output_bytes: int = Field(16 << 20, ge=0, le=1 << 40, description="bytes of each stream kept in the result")
    stream: bool = Field(True, description="send every chunk (true) or only what the result keeps (false)")

    @field_validator("max_output_bytes", mode="before")
    @classmethod
    def _whole_number(cls, value: Any) -> Any:
        # JSON has one number type: 1000.0 is the integer 1000; "1000" and true are not numbers.
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return value


class NameBody(BaseModel):
    model_config = _STRICT

    name: Name = Field(description="letters, digits, '.', '_' and '-', at most 128")


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


#: Sandbox and snapshot names (the local backend's rule, checked here for every backend).
NAME_RE = re.compile(NAME)
_ENV_KEY_RE = re.compile(ENV_KEY)


def check_name(name: str, what: str) -> str:
    """A 400 (as the backend's own SandboxError) for a name no sandbox or snapshot may have."""
    if not NAME_RE.match(name):
        raise ClientError(f"invalid {what} name {name!r}: use letters, digits, '.', '_' and '-' (at most 128)",
                          kind="SandboxError")
    return name


def check_env(env: dict[str, str]) -> None:
    for key, value in env.items():
        if not _ENV_KEY_RE.match(key):
            raise ConfigError(f"invalid environment variable name {key!r}: use letters, digits and '_'")
        no_nul(value, "environment variable")


def no_nul(text: str, what: str) -> None:
    if "\x00" in text:
        raise ConfigError(f"invalid {what}: it contains a NUL byte")


def check_path(path: str) -> str:
    if not path:
        raise SandboxFileError("no file path given: pass ?path=...")
    if "\x00" in path:
        raise SandboxFileError(f"invalid path {path!r}: it contains a NUL byte")
    return path




def validation_error(errors: list[dict[str, Any]], path: str) -> tuple[str, str]:
    """(error type, one-line message) of a request that failed the schema. Names, paths and
    NUL bytes are reported as the backends' own checks report them, so that a client sees the
    same exception class from every backend."""
    parts, kinds = [], set()
    for err in errors:
        loc = tuple(str(x) for x in err.get("loc", ()))
        where = ".".join(x for x in loc if x not in ("body", "[key]"))
        pattern = (err.get("ctx") or {}).get("pattern")
        value = err.get("input")
        if loc == ("query", "path"):
            kinds.add("SandboxFileError")
            parts.append(f"invalid path {value!r}: give a non-empty path without a NUL byte")
        elif pattern == NAME:
            kinds.add("SandboxError")
            what = "snapshot" if path.endswith("/snapshot") else "sandbox"
            parts.append(f"invalid {what} name {value!r}: use letters, digits, '.', '_' and '-' (at most 128)")
        elif pattern in (NO_NUL, NON_EMPTY_NO_NUL):
            kinds.add("ConfigError")
            parts.append(f"invalid {where}: it contains a NUL byte")
        elif pattern == ENV_KEY:
            kinds.add("ConfigError")
            parts.append(f"invalid environment variable name {value!r}: use letters, digits and '_'")
        else:
            kinds.add("ConfigError")
            parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    kind = kinds.pop() if len(kinds) == 1 else "ConfigError"
    prefix = "" if kind != "ConfigError" or any("NUL" in p or "environment" in p for p in parts) else "invalid request: "
    return kind, " ".join((prefix + "; ".join(parts)).split())[:500]

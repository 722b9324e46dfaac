"""Environments: a host directory plus commands, built once into a snapshot.

Building = create a sandbox (with network), upload the directory to ``~/env``,
run ``setup``, grade once unchanged (the baseline), remove the grader's result,
run ``reset``, then snapshot. The snapshot's name carries a content hash of the
directory and the commands, so an unchanged environment is found again instead
of rebuilt. The baseline is stored inside the snapshot (``~/.harness/env.json``)
so it can be read back from any backend, including a remote one.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import tarfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.errors import (
    ConfigError,
    EnvironmentBuildError,
    GradeError,
    SandboxFileError,
    SnapshotExists,
    SnapshotNotFound,
)
from harness.sandbox.base import HOME, Provider, Sandbox, SandboxSpec

#: Where the environment directory lands inside the sandbox; every env command runs here.
ENV_DIR = f"{HOME}/env"
#: Build metadata (hash, baseline) stored inside the snapshot itself.
META_PATH = f"{HOME}/.harness/env.json"
#: Bumped when the build procedure changes, so old snapshots are not reused.
BUILD_FORMAT = 1
#: Never uploaded nor hashed: local virtualenvs and caches are rebuilt by ``setup``.
EXCLUDE = {".venv", "__pycache__", ".git", ".pytest_cache", ".mypy_cache"}

Log = Callable[[str], None]


@dataclass(frozen=True)
class GradeSpec:
    """How to grade: run ``command`` in ``~/env``, then read the JSON at ``result``."""

    command: str
    result: str = f"{HOME}/result.json"
    timeout: float = 300.0


@dataclass(frozen=True)
class EnvSpec:
    """An environment: ``dir`` uploaded to ``~/env``, commands run there."""

    dir: str
    grade: GradeSpec
    name: str = ""
    setup: tuple[str, ...] = ()
    reset: tuple[str, ...] = ()
    setup_timeout: float = 900.0
    type: str = "small"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EnvSpec:
        grade = dict(data.get("grade") or {})
        if not grade.get("command"):
            raise ConfigError("env.grade.command is required; set it to the command that grades an episode")
        if not data.get("dir"):
            raise ConfigError("env.dir is required; set it to the environment's directory on this host")
        path = Path(str(data["dir"])).expanduser().resolve()
        if not path.is_dir():
            raise ConfigError(f"env.dir {data['dir']!r} is not a directory; point it at the environment's folder")
        return cls(
            dir=str(path),
            grade=GradeSpec(**{k: v for k, v in grade.items() if v is not None}),
            name=str(data.get("name") or path.name),
            setup=tuple(data.get("setup") or ()),
            reset=tuple(data.get("reset") or ()),
            setup_timeout=float(data.get("setup_timeout") or 900.0),
            type=str(data.get("type") or "small"),
        )


@dataclass(frozen=True)
class BuiltEnv:
    """A built environment: the snapshot every episode starts from."""

    spec: EnvSpec
    snapshot: str
    content_hash: str
    baseline: Mapping[str, Any] = field(default_factory=dict)
    build_seconds: float = 0.0
    cached: bool = False

    @property
    def baseline_reward(self) -> float | None:
        value = self.baseline.get("reward")
        return float(value) if isinstance(value, (int, float)) else None


def _files(root: Path) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDE)
        for name in sorted(filenames):
            if not name.endswith(".pyc"):
                out.append(Path(dirpath) / name)
    return out


def content_hash(spec: EnvSpec) -> str:
    """sha256 over every uploaded file (path, mode, bytes) and every build command."""
    h = hashlib.sha256()
    recipe = {
        "format": BUILD_FORMAT,
        "setup": list(spec.setup),
        "reset": list(spec.reset),
        "grade": [spec.grade.command, spec.grade.result],
        "type": spec.type,
    }
    h.update(json.dumps(recipe, sort_keys=True).encode())
    root = Path(spec.dir)
    for path in _files(root):
        rel = path.relative_to(root).as_posix()
        h.update(f"\0{rel}\0{path.stat().st_mode & 0o777:o}\0".encode())
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def snapshot_name(spec: EnvSpec, digest: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", spec.name or "env").strip("-") or "env"
    return f"env-{slug}-{digest[:16]}"


def tar_dir(root: str | Path) -> bytes:
    """The directory as a gzipped tar (excluding venvs and caches), in memory."""
    root = Path(root)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path in _files(root):
            info = tar.gettarinfo(str(path), arcname=path.relative_to(root).as_posix())
            info.uid = info.gid = 1000
            info.uname = info.gname = "user"
            with path.open("rb") as fh:
                tar.addfile(info, fh)
    return buf.getvalue()


def _run(sb: Sandbox, what: str, command: str, timeout: float, log: Log | None) -> str:
    if log:
        log(f"{what}: {command}")
    res = sb.exec(command, cwd=ENV_DIR, timeout=timeout)
    if not res.ok:
        tail = (res.text("stderr") or res.text()).strip().splitlines()[-3:]
        why = "timed out" if res.timed_out else f"exited {res.exit_code}"
        raise EnvironmentBuildError(
            f"env {what} command {command!r} {why}: {' | '.join(tail) or 'no output'}; fix it and run again"
        )
    return res.text()


def parse_grade(raw: bytes | None, grade: GradeSpec) -> dict[str, Any]:
    """The grader's JSON object from the result file's bytes (None or empty: no result).

    GradeError (one line) if it is missing, not JSON, not an object, or its ``reward``
    is not a finite number: NaN, Infinity, numbers beyond the float range, booleans,
    strings and null are refused, so no non-finite reward ever reaches a dataset. The
    returned object's ``reward`` is a float. Bytes that are not UTF-8 are replaced."""
    where = " ".join(str(grade.result).split())[:200]
    if not raw:
        raise GradeError(f"the grader wrote no result at {where}; make it write a JSON object there")
    head = _excerpt(raw)
    try:
        data = json.loads(raw.decode("utf-8", errors="replace"))
    except (ValueError, RecursionError) as exc:  # RecursionError: "[[[[..." nested beyond the parser's depth
        raise GradeError(f"the grader's result {where} is not JSON: {head}") from exc
    reward = data.get("reward") if isinstance(data, dict) else None
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        raise GradeError(f"the grader's result {where} has no numeric 'reward': {head}")
    try:
        value = float(reward)
    except OverflowError:  # an integer with hundreds of digits
        value = math.inf
    if not math.isfinite(value):
        raise GradeError(f"the grader's result {where} has a reward that is not a finite number: {head}")
    data["reward"] = value
    return data


def _excerpt(raw: bytes, limit: int = 80) -> str:
    """The first bytes of a result for an error message: one line, printable, short."""
    text = repr(raw[:limit])
    return text + (f" (+{len(raw) - limit} bytes)" if len(raw) > limit else "")


def read_grade(sb: Sandbox, grade: GradeSpec) -> dict[str, Any]:
    """The grader's JSON object read from the sandbox (see ``parse_grade``)."""
    try:
        raw = sb.read_file(grade.result)
    except SandboxFileError:
        raw = None
    return parse_grade(raw, grade)


def _upload(sb: Sandbox, spec: EnvSpec) -> None:
    sb.write_file(f"{HOME}/.harness/env.tgz", tar_dir(spec.dir))
    res = sb.exec(f"mkdir -p {ENV_DIR} && tar xzf {HOME}/.harness/env.tgz -C {ENV_DIR} && rm {HOME}/.harness/env.tgz")
    if not res.ok:
        raise EnvironmentBuildError(f"uploading {spec.dir} failed: {res.text('stderr').strip()}; check the sandbox has tar")


def _cached(provider: Provider, name: str, spec: EnvSpec, digest: str) -> BuiltEnv | None:
    try:
        provider.snapshot_info(name)
    except SnapshotNotFound:
        return None
    # Read the baseline that the build stored inside the snapshot.
    with provider.create(SandboxSpec(type=spec.type, ttl_s=120), from_snapshot=name) as sb:
        try:
            meta = json.loads(sb.read_file(META_PATH))
        except (SandboxFileError, ValueError):
            return None
    return BuiltEnv(spec, name, digest, meta.get("baseline", {}), meta.get("build_seconds", 0.0), cached=True)


def build_env(provider: Provider, spec: EnvSpec, *, rebuild: bool = False, log: Log | None = None) -> BuiltEnv:
    """The snapshot for ``spec``: reused when its content hash matches, else built."""
    digest = content_hash(spec)
    name = snapshot_name(spec, digest)
    if not rebuild and (found := _cached(provider, name, spec, digest)):
        if log:
            log(f"env {spec.name}: using cached snapshot {name}")
        return found
    t0 = time.monotonic()
    if log:
        log(f"env {spec.name}: building snapshot {name}")
    with provider.create(SandboxSpec(name=f"build-{spec.name}"[:60], type=spec.type, ttl_s=spec.setup_timeout + 600,
                                     network=True)) as sb:
        _upload(sb, spec)
        for command in spec.setup:
            _run(sb, "setup", command, spec.setup_timeout, log)
        _run(sb, "grade", spec.grade.command, spec.grade.timeout, log)
        try:
            baseline = read_grade(sb, spec.grade)
        except GradeError as exc:
            raise EnvironmentBuildError(f"baseline grade failed: {exc}") from exc
        # Every episode must start without a result file, whatever the user's reset does.
        _run(sb, "reset", f"rm -f {spec.grade.result}", 60, None)
        for command in spec.reset:
            _run(sb, "reset", command, spec.setup_timeout, log)
        seconds = round(time.monotonic() - t0, 3)
        meta = {"hash": digest, "baseline": baseline, "build_seconds": seconds, "format": BUILD_FORMAT}
        sb.write_file(META_PATH, json.dumps(meta).encode())
        if rebuild:
            try:
                provider.delete_snapshot(name)
            except SnapshotNotFound:
                pass
        try:
            sb.snapshot(name)
        except SnapshotExists:
            # Another run built the same content meanwhile: theirs is as good as ours.
            if log:
                log(f"env {spec.name}: snapshot {name} was built concurrently; using it")
    if log:
        log(f"env {spec.name}: baseline reward {baseline.get('reward')} ({seconds:.1f}s)")
    return BuiltEnv(spec, name, digest, baseline, seconds, cached=False)


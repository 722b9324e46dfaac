"""The run configuration: OmegaConf structured dataclasses, YAML over them, dotlist over that.

Every field carries a docstring (the string literal right below it); ``describe()``
turns them into the configuration reference. An unknown or mistyped key is a
one-line ConfigError that names it.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import inspect
import itertools
import json
import math
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from harness.errors import ConfigError


@dataclass
class GradeConfig:
    command: str = MISSING
    """Command that grades an episode, run in ~/env after the policy has acted."""
    result: str = "/home/user/result.json"
    """Path in the sandbox of the JSON object the grader writes; it needs a numeric "reward"."""
    timeout: float = 300.0
    """Seconds the grade command may take before it is killed (the episode then fails)."""


@dataclass
class EnvConfig:
    dir: str = MISSING
    """Environment directory on this host, uploaded to ~/env (relative: to the config file)."""
    name: str = ""
    """Name used in the snapshot's name; empty means the directory's name."""
    setup: list[str] = field(default_factory=list)
    """Commands run once at build time in ~/env, with network (e.g. create a venv, pip install)."""
    reset: list[str] = field(default_factory=list)
    """Commands run after setup and the baseline grade, before the snapshot (the result file is always removed)."""
    grade: GradeConfig = field(default_factory=GradeConfig)
    """How an episode is graded."""
    setup_timeout: float = 900.0
    """Seconds each setup or reset command may take."""


@dataclass
class PolicyConfig:
    kind: str = "command"
    """Policy kind: command, script, python or openai."""
    id: Any = None
    """Free value for interpolation and sweeps, e.g. command: "cp policies/${policy.id}.py task/stats.py"."""
    command: str = ""
    """kind=command: the one command to run in ~/env."""
    commands: list[str] = field(default_factory=list)
    """kind=script: the commands to run in ~/env, one per step."""
    entrypoint: str = ""
    """kind=python: "module:attr", a class (instantiated per episode with args) or a function f(obs) -> command."""
    args: dict[str, Any] = field(default_factory=dict)
    """kind=python: keyword arguments for the entrypoint class."""
    python_path: list[str] = field(default_factory=list)
    """kind=python: directories put on sys.path before importing (relative: to the config file)."""
    base_url: str = ""
    """kind=openai: the OpenAI-compatible server's base URL, e.g. http://127.0.0.1:8000/v1."""
    model: str = ""
    """kind=openai: model name sent to the server."""
    api_key_env: str = "OPENAI_API_KEY"
    """kind=openai: environment variable holding the API key (no key sent when unset)."""
    temperature: float = 0.0
    """kind=openai: sampling temperature."""
    prompt: str = ""
    """The task description given to the policy in every observation (kind=openai: the user message)."""
    request_timeout: float = 120.0
    """kind=openai: seconds one chat-completions request may take."""
    max_steps: int = 20
    """Most commands a policy may run in one episode; reaching it truncates the episode."""
    step_timeout: float = 300.0
    """Seconds one policy command may run before it is killed."""


@dataclass
class SandboxConfig:
    backend: str = "local"
    """Sandbox backend: local (embedded) or http."""
    state_dir: str | None = None
    """Local backend's state directory; null means $HARNESS_HOME or ~/.local/share/harness."""
    type: str = "small"
    """Sandbox type of the build and every episode: small, medium or large."""
    ttl_s: float = 900.0
    """Seconds an episode sandbox lives at most; a crashed run's sandboxes expire after it."""
    network: bool = False
    """Outbound network for episode sandboxes (the build always has it)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the backend's provider, e.g. {url: "http://host:8765", token: ...} for http."""
    hosts: list[str] = field(default_factory=list)
    """Sandbox servers (`harness serve` URLs) for backend http to spread episodes over: actor i uses hosts[i % len(hosts)], and each server builds the environment once (cached by its content hash). Empty: sandbox.options.url or $HARNESS_SANDBOX_URL."""
    store: str | None = None
    """Snapshot store URI (a directory, s3://, gs://, hdfs://) for backend local on a multi-node cluster: the driver pushes the environment's snapshot there and each node's actors, with their node's own state directory, pull it on first use; null keeps one state directory for all actors."""


@dataclass
class RayConfig:
    address: str | None = None
    """Ray cluster to join (e.g. "auto" or "ray://host:10001"); null starts a local Ray."""
    num_cpus: int | None = None
    """CPUs of the local Ray when it is started here; null means all cores."""
    actor_cpus: float = 1.0
    """CPUs Ray reserves for each actor (the sandboxes' own processes are not counted)."""
    spread: bool | None = None
    """Spread the actors over the cluster's nodes (Ray's SPREAD scheduling strategy); null means when Ray has more than one node."""


@dataclass
class OutputConfig:
    dir: str = "results"
    """Directory that holds run directories <dir>/<run_id>/ (relative: to the working directory)."""
    run_id: str | None = None
    """Name of this run's directory; null means a timestamp plus a random suffix."""
    batch_rows: int = 64
    """Episodes buffered before a Parquet part file is written."""
    flush_seconds: float = 10.0
    """Seconds after which buffered episodes are written even if the batch is not full."""
    max_output_bytes: int = 65536
    """Bytes of stdout and of stderr kept per step (the rest is cut; infos.output_truncated says so)."""


@dataclass
class RunConfig:
    env: EnvConfig = field(default_factory=EnvConfig)
    """The environment: built once per run into a snapshot, cached by content hash."""
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    """The policy that acts in each episode."""
    method: str = "new_from"
    """How an episode gets its sandbox: new_from (from the snapshot) or fork (of a warm source sandbox)."""
    episodes: int = 1
    """Episodes per sweep point."""
    actors: int = 2
    """Ray actors running episodes in parallel, one episode at a time each."""
    sweep: dict[str, list[Any]] = field(default_factory=dict)
    """Config keys mapped to lists of values; the run covers their cartesian product."""
    rebuild: bool = False
    """Build the environment even if a snapshot with the same content hash exists."""
    retries: int = 3
    """Times an episode is run again after an infrastructure failure (a sandbox-layer error, actor or node death), on another actor where possible; policy and grade failures are never retried (see the failure table in the README)."""
    retry_backoff_s: float = 1.0
    """Seconds before the first retry; each further failure in a row doubles it (with jitter, at most 30 s), and no new episode starts meanwhile, so a sandbox server that is down is not stormed."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """Where sandboxes come from."""
    ray: RayConfig = field(default_factory=RayConfig)
    """Ray settings."""
    output: OutputConfig = field(default_factory=OutputConfig)
    """Where and how datasets are written."""


#: Keys a sweep may vary; everything else is shared by the whole run (one build, one pool).
SWEEPABLE = ("policy.", "method", "episodes", "sandbox.network", "sandbox.type", "sandbox.ttl_s")


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass: the string literal below each field."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())  # type: ignore[attr-defined]
    return docs


def describe(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, doc) for every leaf field: the configuration reference."""
    rows, docs = [], field_docs(cls)
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        if dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
            rows += describe(f.default_factory, key + ".")  # type: ignore[arg-type]
            continue
        if f.default is not dataclasses.MISSING:
            default = "required" if f.default == MISSING else json.dumps(f.default)
        else:
            default = json.dumps(f.default_factory())  # type: ignore[misc]
        type_name = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        rows.append((key, type_name, default, docs.get(f.name, "")))
    return rows


def _error(exc: Exception, where: str) -> ConfigError:
    if not isinstance(exc, OmegaConfBaseException):  # e.g. a TypeError from merging a YAML merge key
        return ConfigError(f"invalid config{where}: {type(exc).__name__}: {_line(exc)}")
    key = getattr(exc, "full_key", "") or ""
    msg = _line(exc)
    if "not in struct" in msg or "Key '" in msg and "not" in msg:
        return ConfigError(f"unknown config key {key!r}{where}; see `harness run --describe` for the keys")
    return ConfigError(f"bad value for config key {key!r}{where}: {msg}")


def _line(exc: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message, cut to ``limit`` characters."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else type(exc).__name__
    return text if len(text) <= limit else text[:limit] + "..."


#: What goes wrong inside OmegaConf and pathlib on odd input, besides OmegaConf's own errors:
#: a YAML merge key of the wrong type (TypeError), a NUL in a path (ValueError), self-nesting.
_ODD = (OmegaConfBaseException, TypeError, ValueError, KeyError, AttributeError, RecursionError)


def load_config(path: str | Path | None, overrides: list[str] = ()) -> DictConfig:
    """Defaults, then the YAML file, then ``key=value`` overrides; relative dirs resolved.
    Every problem is a one-line ConfigError."""
    try:
        return _load_config(path, overrides)
    except ConfigError:
        raise
    except _ODD as exc:
        raise _error(exc, f" in {path}" if path is not None else "") from exc


def _load_config(path: str | Path | None, overrides: list[str]) -> DictConfig:
    cfg = OmegaConf.structured(RunConfig)
    base = Path.cwd()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} not found; pass the path of a YAML config")
        try:
            data = OmegaConf.load(path)
        except Exception as exc:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {' '.join(str(exc).split())[:300]}") from exc
        if not isinstance(data, DictConfig):
            raise ConfigError(f"config file {str(path)!r} must hold a YAML mapping (key: value lines), "
                              f"not a {type(data).__name__}")
        try:
            cfg = OmegaConf.merge(cfg, data)
        except _ODD as exc:
            raise _error(exc, f" in {path}") from exc
        base = path.resolve().parent
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value")
    try:
        dotlist = OmegaConf.from_dotlist(list(overrides))
    except Exception as exc:  # YAML syntax inside a value, e.g. a broken {a: [1]}
        raise ConfigError(f"cannot parse overrides {' '.join(overrides)!r}: {' '.join(str(exc).split())[:200]}") from exc
    # `sweep=...` on the command line replaces the file's sweep instead of merging into it.
    replace_sweep = "sweep" in dotlist and any(item.split("=", 1)[0].strip() == "sweep" for item in overrides)
    try:
        if replace_sweep:
            cfg.sweep = {}
        cfg = OmegaConf.merge(cfg, dotlist)
    except _ODD as exc:
        raise _error(exc, " on the command line") from exc
    # Relative host paths in a config file mean "next to the config file".
    try:
        if not OmegaConf.is_missing(cfg.env, "dir"):
            cfg.env.dir = str((base / Path(cfg.env.dir).expanduser()).resolve())
    except ValueError as exc:  # a NUL byte in the path
        raise ConfigError(f"env.dir {cfg.env.dir!r} is not a usable path: {_line(exc)}") from exc
    cfg.policy.python_path = [str((base / p).resolve()) for p in cfg.policy.python_path]
    validate(cfg)
    return cfg


def _finite(low: float, *, strict: bool = True) -> Any:
    return lambda v: (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                      and (v > low if strict else v >= low))


_POSITIVE = (_finite(0), "a positive number of seconds")
#: Checks of the values a sweep point may change: key -> (test, what it must be).
POINT_CHECKS: dict[str, tuple[Any, str]] = {
    "method": (lambda v: v in ("new_from", "fork"), "one of: new_from, fork"),
    "episodes": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "an integer of at least 1"),
    "sandbox.type": (lambda v: v in ("small", "medium", "large"), "one of: small, medium, large"),
    "sandbox.ttl_s": _POSITIVE,
    "sandbox.network": (lambda v: isinstance(v, bool), "true or false"),
    "policy.kind": (lambda v: v in ("command", "script", "python", "openai"), "one of: command, script, python, openai"),
    "policy.max_steps": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "an integer of 0 or more"),
    "policy.step_timeout": _POSITIVE,
    "policy.request_timeout": _POSITIVE,
}
#: Checks of the values shared by the whole run.
RUN_CHECKS: dict[str, tuple[Any, str]] = {
    "sandbox.backend": (lambda v: v in ("local", "http"), "local or http"),
    "actors": (lambda v: v >= 1, "at least 1"),
    "retries": (lambda v: v >= 0, "0 or more"),
    "env.setup_timeout": _POSITIVE,
    "env.grade.timeout": _POSITIVE,
    "output.batch_rows": (lambda v: v >= 1, "at least 1"),
    "output.flush_seconds": _POSITIVE,
    "output.max_output_bytes": (lambda v: v >= 0, "0 or more"),
    "ray.actor_cpus": (_finite(0, strict=False), "a number of 0 or more"),
    "ray.num_cpus": (lambda v: v is None or v >= 1, "null or at least 1"),
}


def _check(key: str, value: Any, checks: dict[str, tuple[Any, str]], where: str = "") -> None:
    test, what = checks[key]
    try:
        ok = bool(test(value))
    except TypeError:
        ok = False
    if not ok:
        raise ConfigError(f"{key} must be {what}, got {value!r}{where}")


def validate(cfg: DictConfig) -> None:
    """One-line ConfigError for a missing, out-of-range or contradictory setting."""
    try:
        _validate(cfg)
    except ConfigError:
        raise
    except _ODD as exc:  # an interpolation to a key that does not exist, and the like
        raise _error(exc, "") from exc


def _validate(cfg: DictConfig) -> None:
    for node, name in ((cfg.env, "dir"), (cfg.env.grade, "command")):
        if OmegaConf.is_missing(node, name):
            key = "env.dir" if name == "dir" else "env.grade.command"
            raise ConfigError(f"config key {key!r} is required; set it in the YAML or as {key}=...")
    for key, values in cfg.sweep.items():
        if not any(key == s or (s.endswith(".") and key.startswith(s)) for s in SWEEPABLE):
            raise ConfigError(f"sweep key {key!r} cannot vary within a run; sweep one of: policy.*, method, episodes, "
                              "sandbox.network, sandbox.type, sandbox.ttl_s")
        if OmegaConf.select(cfg, key, default="<missing>") == "<missing>":
            raise ConfigError(f"unknown sweep key {key!r}; see `harness run --describe` for the keys")
        if not isinstance(values, (list, tuple)) and not OmegaConf.is_list(values) or len(values) == 0:
            raise ConfigError(f"sweep.{key} must be a non-empty list of values")
    if cfg.output.run_id is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,40}", str(cfg.output.run_id)):
        raise ConfigError(f"output.run_id {cfg.output.run_id!r} must be 1-41 letters, digits, '.', '_' or '-'")
    for key in RUN_CHECKS:
        _check(key, OmegaConf.select(cfg, key), RUN_CHECKS)
    # Values a sweep changes are checked per point (point_config), the others here.
    # (An unknown method is reported by point_config, with the methods there are.)
    for key in POINT_CHECKS:
        if key not in cfg.sweep and key != "method":
            _check(key, OmegaConf.select(cfg, key), POINT_CHECKS)
    if cfg.sandbox.store and cfg.sandbox.backend != "local":
        raise ConfigError("sandbox.store is for backend local; with http, start each `harness serve` with "
                          "HARNESS_SNAPSHOT_STORE=URI instead")
    if cfg.sandbox.hosts and cfg.sandbox.backend != "http":
        raise ConfigError("sandbox.hosts lists `harness serve` URLs for backend http; set sandbox.backend=http")
    for url in cfg.sandbox.hosts:
        if not str(url).startswith(("http://", "https://")):
            raise ConfigError(f"sandbox.hosts entry {url!r} must start with http:// or https://")
    # Resolve everything once: an interpolation of a key that does not exist fails here, not mid-run.
    OmegaConf.to_container(cfg, resolve=True)


def points(cfg: DictConfig) -> list[dict[str, Any]]:
    """The sweep's cartesian product as dicts of key -> value, in a stable order."""
    sweep = OmegaConf.to_container(cfg.sweep, resolve=True)
    keys = list(sweep)  # type: ignore[arg-type]
    return [dict(zip(keys, combo)) for combo in itertools.product(*(sweep[k] for k in keys))]  # type: ignore[index]


def point_config(cfg: DictConfig, point: dict[str, Any]) -> dict[str, Any]:
    """The resolved config of one sweep point (interpolations filled in)."""
    c = cfg.copy()
    where = f" in sweep point {json.dumps(point, default=str)}" if point else ""
    for key, value in point.items():
        try:
            OmegaConf.update(c, key, value, merge=False)
        except _ODD as exc:
            raise _error(exc, where) from exc
    try:
        data = OmegaConf.to_container(c, resolve=True, throw_on_missing=True)
    except _ODD as exc:
        raise _error(exc, where) from exc
    data.pop("sweep", None)  # type: ignore[union-attr]
    from harness.episode import METHODS

    if data["method"] not in METHODS:  # type: ignore[index]
        raise ConfigError(f"unknown method {data['method']!r}{where}; use one of: {', '.join(METHODS)}")  # type: ignore[index]
    for key in POINT_CHECKS:
        value: Any = data
        for part in key.split("."):
            value = value[part]  # type: ignore[index]
        _check(key, value, POINT_CHECKS, where)
    return data  # type: ignore[return-value]


def config_hash(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]

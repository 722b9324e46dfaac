"""A run directory as the driver keeps it: its config, manifest, lock and resume state.

    <run_dir>/config.yaml      the config as given (interpolations kept; secrets redacted):
                               what ``harness run --resume RUN_DIR`` starts from
    <run_dir>/manifest.yaml    status, resolved config, env, versions, per-point results
    <run_dir>/.lock            held (flock) by the driver running the run
    <run_dir>/episodes|steps|journal/   the datasets (see harness.dataset)

A run is resumable from the moment its manifest exists: the episodes of the
config are numbered deterministically, so the ones without a row are exactly
the ones still to run.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from harness import config as C
from harness.dataset import read_manifest
from harness.episode import EpisodeRequest
from harness.errors import ConfigError
from harness.files import write_atomically

REDACTED = "<redacted>"
#: Keys whose values never reach a run directory (also as the end of a key: auth_token).
SECRET_KEYS = ("token", "api_key", "apikey", "password", "secret")


def _secret(key: Any) -> bool:
    key = str(key).lower()
    return any(key == s or key.endswith("_" + s) for s in SECRET_KEYS)


def redact(data: Any) -> Any:
    """A copy of a config tree with secret values replaced (api_key_env names a variable: kept)."""
    if isinstance(data, dict):
        return {k: (REDACTED if _secret(k) and v else redact(v)) for k, v in data.items()}
    if isinstance(data, list):
        return [redact(v) for v in data]
    return data


def episodes_fingerprint(requests: Iterable[EpisodeRequest]) -> str:
    """What the run's episodes are: ids and the config that defines each. A resume
    must produce the same fingerprint, or it would mix two experiments in one dataset."""
    h = hashlib.sha256()
    for r in requests:
        h.update(f"{r.episode_id}:{r.point_id}:{r.config_hash}\n".encode())
    return h.hexdigest()[:16]


def write_config(run_dir: Path, cfg: DictConfig) -> Path:
    data = redact(OmegaConf.to_container(cfg, resolve=False))
    return write_atomically(run_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(data)))


def resume_config(run_dir: str | Path, overrides: list[str]) -> DictConfig:
    """The config of the run in ``run_dir``, with ``overrides`` on top (e.g. actors=8)."""
    run_dir = Path(run_dir).expanduser().resolve()
    if not (run_dir / "manifest.yaml").is_file() or not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{run_dir} is not a run directory (no manifest.yaml and config.yaml); "
                          "--resume takes a directory that `harness run` wrote, e.g. results/RUN_ID")
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if key in ("output.dir", "output.run_id"):
            raise ConfigError(f"{key} cannot change on --resume: the run stays in {run_dir}")
    cfg = C.load_config(run_dir / "config.yaml", [*overrides, f"output.dir={run_dir.parent}",
                                                  f"output.run_id={run_dir.name}"])
    for key in list(cfg.sandbox.options):
        if cfg.sandbox.options[key] == REDACTED:  # e.g. the token: from the environment again
            del cfg.sandbox.options[key]
    return cfg


def check_resumable(run_dir: Path, fingerprint: str, content_hash: str) -> dict[str, Any]:
    """The manifest of a run that may be resumed with these episodes and this environment."""
    manifest = read_manifest(run_dir)
    if manifest.get("episodes_fingerprint") != fingerprint:
        raise ConfigError(f"the overrides change the episodes of run {run_dir.name} (sweep, episodes, policy or "
                          "sandbox settings); resume with the run's own config, or start a new run")
    if manifest["env"]["content_hash"] != content_hash:
        raise ConfigError(f"the environment changed since run {run_dir.name} started (content hash "
                          f"{manifest['env']['content_hash']}, now {content_hash}); restore it, or start a new run")
    return manifest


@contextmanager
def locked(run_dir: Path) -> Iterator[None]:
    """Only one driver per run directory; the lock goes with the process, even on SIGKILL."""
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
            raise ConfigError(f"run {run_dir.name} is being run by {holder}; wait for it or stop it first") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"harness run pid {os.getpid()}".encode(), 0)
        yield
    finally:
        os.close(fd)

"""Datasets: Arrow schemas, Parquet part files written as episodes finish, loaders.

Layout of a run directory::

    <run_dir>/manifest.yaml          resolved config, baseline grade, snapshot, versions
    <run_dir>/episodes/part-NNNNN.parquet   one row per episode
    <run_dir>/steps/part-NNNNN.parquet      one row per policy step (RLlib offline columns)

Rows are buffered and flushed as a new part file every ``batch_rows`` episodes
or ``flush_seconds``, whichever comes first, so a crash loses at most one batch.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from harness.episode import EpisodeResult

#: RLlib's ids for a single-agent episode.
AGENT_ID = "default_agent"
MODULE_ID = "default_policy"

EPISODE_SCHEMA = pa.schema([
    pa.field("run_id", pa.string(), False),
    pa.field("episode_id", pa.int64(), False),
    pa.field("eps_id", pa.string(), False),
    pa.field("point_id", pa.int64(), False),
    pa.field("point", pa.string(), False),  # JSON object: swept key -> value
    pa.field("method", pa.string(), False),
    pa.field("policy", pa.string()),  # short label of the policy
    pa.field("policy_config", pa.string()),  # JSON of the resolved policy config
    pa.field("sandbox_id", pa.string()),
    pa.field("start_seconds", pa.float64()),  # acquire: snapshot restore or fork
    pa.field("reward", pa.float64()),  # null when the episode failed
    pa.field("grade", pa.string()),  # the grader's JSON object, null when absent
    pa.field("steps", pa.int64(), False),
    pa.field("terminated", pa.bool_(), False),
    pa.field("truncated", pa.bool_(), False),
    pa.field("clean_start", pa.bool_()),
    pa.field("acquire_seconds", pa.float64(), False),
    pa.field("check_seconds", pa.float64(), False),
    pa.field("act_seconds", pa.float64(), False),
    pa.field("grade_seconds", pa.float64(), False),
    pa.field("release_seconds", pa.float64(), False),
    pa.field("total_seconds", pa.float64(), False),
    pa.field("error_type", pa.string()),
    pa.field("error", pa.string()),
    pa.field("error_phase", pa.string()),
    pa.field("infra_error", pa.bool_(), False),  # the sandbox layer or the actor failed (retryable)
    pa.field("actor", pa.string()),
    pa.field("host", pa.string()),
    pa.field("started_at", pa.timestamp("us", tz="UTC"), False),
    pa.field("finished_at", pa.timestamp("us", tz="UTC"), False),
    pa.field("config_hash", pa.string()),
    pa.field("sandbox_info", pa.string()),  # JSON of the sandbox's info just before release
    pa.field("attempt", pa.int64(), False),  # 0, or how many infrastructure failures were retried
])

STEP_SCHEMA = pa.schema([
    pa.field("eps_id", pa.string(), False),
    pa.field("agent_id", pa.string(), False),
    pa.field("module_id", pa.string(), False),
    pa.field("t", pa.int64(), False),
    pa.field("obs", pa.string(), False),  # JSON of the Observation before the step
    pa.field("actions", pa.string(), False),  # the shell command run
    pa.field("rewards", pa.float64()),  # 0.0, the episode's reward on the last step (null if it failed)
    pa.field("new_obs", pa.string(), False),  # JSON of the Observation after the step
    pa.field("terminateds", pa.bool_(), False),
    pa.field("truncateds", pa.bool_(), False),
    pa.field("infos", pa.string(), False),  # JSON: exit_code, timed_out, truncated output, durations
    pa.field("run_id", pa.string(), False),
    pa.field("episode_id", pa.int64(), False),
    pa.field("point_id", pa.int64(), False),
])


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def episode_row(r: EpisodeResult, policy_label: str = "") -> dict[str, Any]:
    q = r.request
    return {
        "run_id": q.run_id, "episode_id": q.episode_id, "eps_id": q.eps_id, "point_id": q.point_id,
        "point": _json(dict(q.point)), "method": q.method, "policy": policy_label,
        "policy_config": _json(dict(q.policy)), "sandbox_id": r.sandbox_id, "start_seconds": r.acquire_seconds,
        "reward": r.reward, "grade": _json(dict(r.grade)) if r.grade is not None else None,
        "steps": len(r.steps), "terminated": r.terminated, "truncated": r.truncated,
        "clean_start": r.clean_start, "acquire_seconds": r.acquire_seconds, "check_seconds": r.check_seconds,
        "act_seconds": r.act_seconds, "grade_seconds": r.grade_seconds, "release_seconds": r.release_seconds,
        "total_seconds": r.total_seconds, "error_type": r.error_type, "error": r.error,
        "error_phase": r.error_phase, "infra_error": r.infra_error, "actor": r.actor, "host": r.host,
        "started_at": int(r.started_at * 1e6), "finished_at": int(r.finished_at * 1e6),
        "config_hash": q.config_hash,
        "sandbox_info": _json(dict(r.sandbox_info)) if r.sandbox_info is not None else None,
        "attempt": q.attempt,
    }


def step_rows(r: EpisodeResult) -> list[dict[str, Any]]:
    q, rows, last = r.request, [], len(r.steps) - 1
    for i, s in enumerate(r.steps):
        rows.append({
            "eps_id": q.eps_id, "agent_id": AGENT_ID, "module_id": MODULE_ID, "t": s.t,
            "obs": _json(s.obs.to_dict()), "actions": s.action,
            "rewards": (r.reward if i == last else 0.0),
            "new_obs": _json(s.new_obs.to_dict()),
            "terminateds": i == last and r.terminated and r.reward is not None,
            "truncateds": i == last and (r.truncated or r.reward is None),
            "infos": _json({"exit_code": s.exit_code, "timed_out": s.timed_out, "output_truncated": s.truncated,
                            "exec_seconds": s.exec_seconds, "policy_seconds": s.policy_seconds}),
            "run_id": q.run_id, "episode_id": q.episode_id, "point_id": q.point_id,
        })
    return rows


def _table(rows: list[dict[str, Any]], schema: pa.Schema) -> pa.Table:
    columns = {f.name: [row[f.name] for row in rows] for f in schema}
    return pa.Table.from_pydict(columns, schema=schema)


class DatasetWriter:
    """Appends episodes; writes Parquet part files in batches as they finish."""

    def __init__(self, run_dir: str | Path, *, batch_rows: int = 64, flush_seconds: float = 10.0):
        self.run_dir = Path(run_dir)
        self.batch_rows, self.flush_seconds = max(1, batch_rows), flush_seconds
        (self.run_dir / "episodes").mkdir(parents=True, exist_ok=True)
        (self.run_dir / "steps").mkdir(parents=True, exist_ok=True)
        self.episodes: list[dict[str, Any]] = []
        self.steps: list[dict[str, Any]] = []
        self.part = 0
        self.last_flush = time.monotonic()
        self.rows_written = 0

    def add(self, result: EpisodeResult, policy_label: str = "") -> None:
        self.episodes.append(episode_row(result, policy_label))
        self.steps.extend(step_rows(result))
        if len(self.episodes) >= self.batch_rows or time.monotonic() - self.last_flush >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        self.last_flush = time.monotonic()
        if not self.episodes:
            return
        name = f"part-{self.part:05d}.parquet"
        # Write to a temporary name and rename, so readers never see half a file.
        for sub, rows, schema in (("steps", self.steps, STEP_SCHEMA), ("episodes", self.episodes, EPISODE_SCHEMA)):
            path = self.run_dir / sub / name
            tmp = path.with_suffix(".tmp")
            pq.write_table(_table(rows, schema), tmp)
            tmp.rename(path)
        self.rows_written += len(self.episodes)
        self.part += 1
        self.episodes, self.steps = [], []

    def close(self) -> None:
        self.flush()


def _load(run_dir: str | Path, sub: str, schema: pa.Schema) -> pa.Table:
    files = sorted((Path(run_dir) / sub).glob("part-*.parquet"))
    if not files:
        return schema.empty_table()
    return pa.concat_tables([pq.read_table(f, schema=schema) for f in files])


def load_episodes(run_dir: str | Path) -> pa.Table:
    """Every episode row of a run, as an Arrow table with EPISODE_SCHEMA."""
    return _load(run_dir, "episodes", EPISODE_SCHEMA)


def load_steps(run_dir: str | Path) -> pa.Table:
    """Every step row of a run, as an Arrow table with STEP_SCHEMA (RLlib offline columns)."""
    return _load(run_dir, "steps", STEP_SCHEMA)


def write_manifest(run_dir: str | Path, manifest: Mapping[str, Any]) -> Path:
    path = Path(run_dir) / "manifest.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(json.loads(_json(dict(manifest))), sort_keys=False))
    tmp.rename(path)
    return path


def read_manifest(run_dir: str | Path) -> dict[str, Any]:
    return yaml.safe_load((Path(run_dir) / "manifest.yaml").read_text())

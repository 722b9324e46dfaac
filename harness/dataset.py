"""Datasets: Arrow schemas, Parquet part files written as episodes finish, loaders.

Layout of a run directory::

    <run_dir>/manifest.yaml          resolved config, baseline grade, snapshot, versions
    <run_dir>/episodes/part-NNNNN.parquet   one row per episode
    <run_dir>/steps/part-NNNNN.parquet      one row per policy step (RLlib offline columns)

    <run_dir>/journal/part-NNNNN.jsonl      rows not yet in a part file (fsynced per episode)

Each finished episode is appended to the journal and fsynced before it counts
as done; rows are then written as a new part file every ``batch_rows`` episodes
or ``flush_seconds``, whichever comes first. A crash loses no reported row:
``recover`` (run by the writer and by ``harness run --resume``) turns journals
into part files.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import yaml

from harness.episode import EpisodeResult
from harness.errors import DatasetWriteError
from harness.files import write_atomically

#: RLlib's ids for a single-agent episode.
AGENT_ID = "default_agent"
MODULE_ID = "default_policy"
#: Rows journalled but not yet in a part file (see DatasetWriter).
JOURNAL_DIR = "journal"
#: Episode ids being removed by drop_episodes; recover() finishes the job after a crash.
DROP_INTENT = "dropping.json"

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
    """Appends episodes: each row is journalled durably at once, then written to
    Parquet part files in batches.

    ``add`` returns only after the row is on disk (``journal/part-NNNNN.jsonl``,
    fsynced), so an episode reported done survives a SIGKILL of the driver or a
    power cut; ``recover`` turns journals left by a crash into part files. A part
    file appears whole or not at all (written under a temporary name, renamed),
    and its journal is removed only after.
    """

    def __init__(self, run_dir: str | Path, *, batch_rows: int = 64, flush_seconds: float = 10.0):
        self.run_dir = Path(run_dir)
        self.batch_rows, self.flush_seconds = max(1, batch_rows), flush_seconds
        for sub in ("episodes", "steps", JOURNAL_DIR):
            (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
        recover(self.run_dir)
        self.episodes: list[dict[str, Any]] = []
        self.steps: list[dict[str, Any]] = []
        self.part = next_part(self.run_dir)
        self.last_flush = time.monotonic()
        self.rows_written = 0
        self.broken = False  # a write failed: stop writing, leave the rest to recover()
        self._journal: Any = None

    def add(self, result: EpisodeResult, policy_label: str = "") -> None:
        self.add_row(episode_row(result, policy_label), step_rows(result))

    def add_row(self, episode: dict[str, Any], steps: list[dict[str, Any]]) -> None:
        """Journal one episode durably, then buffer it for the next part file."""
        path = self._journal_path(self.part)
        try:
            if self._journal is None:
                self._journal = open(path, "a", encoding="utf-8")  # noqa: SIM115
            self._journal.write(json.dumps({"episode": episode, "steps": steps}) + "\n")
            self._journal.flush()
            os.fsync(self._journal.fileno())
        except OSError as exc:
            self.broken = True  # the journal may end in half a line: append nothing more to it
            raise DatasetWriteError(f"cannot write the rows of run {self.run_dir.name} to {path}: "
                                    f"{exc.strerror or exc}; free space (or fix permissions), then resume the run") from exc
        self.episodes.append(episode)
        self.steps.extend(steps)
        if len(self.episodes) >= self.batch_rows or time.monotonic() - self.last_flush >= self.flush_seconds:
            self.flush()

    def _journal_path(self, part: int) -> Path:
        return self.run_dir / JOURNAL_DIR / f"part-{part:05d}.jsonl"

    def flush(self) -> None:
        self.last_flush = time.monotonic()
        if not self.episodes or self.broken:
            return  # broken: the journal holds every row reported done; recover() makes the parts
        try:
            _write_part(self.run_dir, self.part, self.episodes, self.steps)
        except OSError as exc:
            self.broken = True
            for sub in ("episodes", "steps"):  # no half-written file is left for readers to trip on
                (self.run_dir / sub / f"part-{self.part:05d}.tmp").unlink(missing_ok=True)
            raise DatasetWriteError(f"cannot write a part file of run {self.run_dir.name}: {exc.strerror or exc}; "
                                    "the rows are safe in its journal: free space, then resume the run") from exc
        if self._journal is not None:
            self._journal.close()
            self._journal = None
        self._journal_path(self.part).unlink(missing_ok=True)
        self.rows_written += len(self.episodes)
        self.part += 1
        self.episodes, self.steps = [], []

    def close(self) -> None:
        self.flush()


def _write_part(run_dir: Path, part: int, episodes: list[dict[str, Any]], steps: list[dict[str, Any]]) -> None:
    """Steps first, then episodes: an episodes part file on disk means its pair is complete.
    Each is written under a temporary name and renamed, so readers never see half a file."""
    name = f"part-{part:05d}.parquet"
    for sub, rows, schema in (("steps", steps, STEP_SCHEMA), ("episodes", episodes, EPISODE_SCHEMA)):
        path = run_dir / sub / name
        tmp = path.with_suffix(".tmp")
        pq.write_table(_table(rows, schema), tmp)
        os.replace(tmp, path)


def _part_index(path: Path) -> int:
    return int(path.name.split("-", 1)[1].split(".", 1)[0])


def next_part(run_dir: str | Path) -> int:
    """The number of the next part file: one past every part and journal on disk."""
    run_dir = Path(run_dir)
    found = [_part_index(p) for sub in ("episodes", "steps") for p in (run_dir / sub).glob("part-*.parquet")]
    found += [_part_index(p) for p in (run_dir / JOURNAL_DIR).glob("part-*.jsonl")]
    return max(found, default=-1) + 1


def _read_journal(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    episodes: list[dict[str, Any]] = []
    steps: list[dict[str, Any]] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                entry = json.loads(line)
                episode, episode_steps = entry["episode"], entry["steps"]
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short (crash, full disk): its episode was never reported done
            episodes.append(episode)
            steps.extend(episode_steps)
    return episodes, steps


def recover(run_dir: str | Path) -> int:
    """Make a run directory whole after a crash; returns the episodes recovered.

    Finishes an interrupted ``drop_episodes``, removes half-written temporary
    files, and turns each journal whose part file was never written into that
    part file. Idempotent: safe to call on a healthy run directory."""
    run_dir = Path(run_dir)
    pending = run_dir / DROP_INTENT
    if pending.exists():
        _drop(run_dir, set(json.loads(pending.read_text())))
        pending.unlink()
    for sub in ("episodes", "steps"):
        for tmp in (run_dir / sub).glob("part-*.tmp"):
            tmp.unlink()
    recovered = 0
    for journal in sorted((run_dir / JOURNAL_DIR).glob("part-*.jsonl")):
        part = _part_index(journal)
        if not (run_dir / "episodes" / f"part-{part:05d}.parquet").exists():
            episodes, steps = _read_journal(journal)
            if episodes:
                _write_part(run_dir, part, episodes, steps)
                recovered += len(episodes)
        journal.unlink()
    return recovered


def episode_ids(run_dir: str | Path) -> list[int]:
    """The episode ids that have a row (call ``recover`` first after a crash)."""
    files = sorted((Path(run_dir) / "episodes").glob("part-*.parquet"))
    return [i for f in files for i in pq.read_table(f, columns=["episode_id"]).column(0).to_pylist()]


def _drop(run_dir: Path, ids: set[int]) -> None:
    for sub in ("episodes", "steps"):
        for path in sorted((run_dir / sub).glob("part-*.parquet")):
            table = pq.read_table(path)
            keep = pc.invert(pc.is_in(table.column("episode_id"), value_set=pa.array(sorted(ids), pa.int64())))
            if pc.all(keep).as_py():  # nothing of these ids in this file
                continue
            tmp = path.with_suffix(".tmp")
            pq.write_table(table.filter(keep), tmp)
            os.replace(tmp, path)


def drop_episodes(run_dir: str | Path, ids: set[int]) -> None:
    """Remove these episodes' rows and steps (to run them again), all or nothing:
    the intent is written first, so ``recover`` completes a drop cut short."""
    run_dir = Path(run_dir)
    if not ids:
        return
    intent = write_atomically(run_dir / DROP_INTENT, json.dumps(sorted(ids)))
    _drop(run_dir, set(ids))
    intent.unlink()


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
    return write_atomically(Path(run_dir) / "manifest.yaml",
                            yaml.safe_dump(json.loads(_json(dict(manifest))), sort_keys=False))


def read_manifest(run_dir: str | Path) -> dict[str, Any]:
    return yaml.safe_load((Path(run_dir) / "manifest.yaml").read_text())

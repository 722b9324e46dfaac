"""Datasets: schemas, batched part files, loaders, manifest; read back by pyarrow and Ray Data."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from harness_fixtures import ray_local  # noqa: F401  (module-scoped fixture)

from harness.dataset import (
    EPISODE_SCHEMA,
    STEP_SCHEMA,
    DatasetWriter,
    drop_episodes,
    episode_ids,
    load_episodes,
    load_steps,
    next_part,
    read_manifest,
    recover,
    write_manifest,
)
from harness.episode import EpisodeRequest, EpisodeResult, StepRecord, failed_result
from harness.policy import Observation

RLLIB_COLUMNS = ["eps_id", "agent_id", "module_id", "t", "obs", "actions", "rewards", "new_obs",
                 "terminateds", "truncateds", "infos"]


def result(i: int, n_steps: int = 2, reward: float | None = 1.0) -> EpisodeResult:
    req = EpisodeRequest(run_id="r", episode_id=i, method="fork", policy={"kind": "script"}, point_id=i % 2,
                         point={"policy.id": i % 2}, config_hash="h")
    steps, obs = [], Observation(t=0, prompt="p")
    for t in range(n_steps):
        new = Observation(t=t + 1, prompt="p", command=f"c{t}", exit_code=0, stdout=f"out{t}")
        steps.append(StepRecord(t, obs, f"c{t}", new, 0, False, False, 0.01, 0.001))
        obs = new
    now = time.time()
    return EpisodeResult(req, f"sb{i}", reward, {"reward": reward, "passed": 4} if reward is not None else None,
                         tuple(steps), True, False, True, 0.02, 0.01, 0.1, 0.2, 0.01, 0.4, now, now + 0.4)


def test_writer_flushes_part_files_in_batches(tmp_path: Path) -> None:
    w = DatasetWriter(tmp_path, batch_rows=2, flush_seconds=3600)
    for i in range(5):
        w.add(result(i), "script")
    # two full batches are already on disk before close: a crash loses at most one batch
    assert sorted(p.name for p in (tmp_path / "episodes").iterdir()) == ["part-00000.parquet", "part-00001.parquet"]
    w.close()
    assert len(list((tmp_path / "episodes").glob("*.parquet"))) == 3
    assert len(list((tmp_path / "steps").glob("*.parquet"))) == 3
    assert not list(tmp_path.rglob("*.tmp"))
    episodes = load_episodes(tmp_path)
    assert episodes.schema.equals(EPISODE_SCHEMA) and episodes.num_rows == 5
    assert episodes.column("episode_id").to_pylist() == [0, 1, 2, 3, 4]


def test_rows_hold_what_trainers_need(tmp_path: Path) -> None:
    w = DatasetWriter(tmp_path)
    w.add(result(0, n_steps=3, reward=0.75), "script")
    w.add(failed_result(result(1).request, "RayActorError", "actor died\nbadly", "actor"), "script")
    w.close()
    ep = load_episodes(tmp_path).to_pylist()
    assert ep[0]["reward"] == 0.75 and json.loads(ep[0]["grade"]) == {"reward": 0.75, "passed": 4}
    assert json.loads(ep[0]["point"]) == {"policy.id": 0} and ep[0]["steps"] == 3 and ep[0]["error"] is None
    assert ep[1]["reward"] is None and ep[1]["grade"] is None and ep[1]["error_type"] == "RayActorError"
    assert ep[1]["error"] == "actor died badly" and ep[1]["error_phase"] == "actor"
    steps = load_steps(tmp_path)
    assert steps.schema.equals(STEP_SCHEMA) and steps.column_names[:11] == RLLIB_COLUMNS
    rows = steps.to_pylist()
    assert [r["t"] for r in rows] == [0, 1, 2]  # the failed episode had no steps
    assert [r["rewards"] for r in rows] == [0.0, 0.0, 0.75]  # the episode's reward on its last step
    assert [r["terminateds"] for r in rows] == [False, False, True]
    assert not any(r["truncateds"] for r in rows)
    assert json.loads(rows[1]["obs"])["stdout"] == "out0" and json.loads(rows[1]["new_obs"])["stdout"] == "out1"
    assert json.loads(rows[0]["infos"])["exit_code"] == 0
    assert {r["eps_id"] for r in rows} == {"r-000000"}


def test_empty_run_loads_empty_tables(tmp_path: Path) -> None:
    assert load_episodes(tmp_path).num_rows == 0 and load_steps(tmp_path).schema.equals(STEP_SCHEMA)


def test_manifest_round_trip(tmp_path: Path) -> None:
    write_manifest(tmp_path, {"run_id": "r", "env": {"baseline": {"reward": 0.5}}, "path": tmp_path})
    m = read_manifest(tmp_path)
    assert m["env"]["baseline"]["reward"] == 0.5 and m["path"] == str(tmp_path)


def test_read_back_with_pyarrow_and_ray_data(tmp_path: Path, ray_local) -> None:  # noqa: F811
    w = DatasetWriter(tmp_path, batch_rows=3)
    for i in range(7):
        w.add(result(i), "script")
    w.close()
    table = pq.read_table(tmp_path / "episodes")
    assert table.num_rows == 7 and set(EPISODE_SCHEMA.names) == set(table.column_names)
    ds = ray_local.data.read_parquet(str(tmp_path / "steps"))
    assert ds.count() == 14
    assert set(RLLIB_COLUMNS) <= set(ds.schema().names)
    last = ds.filter(lambda r: r["rewards"] > 0).take_all()
    assert len(last) == 7 and all(r["terminateds"] for r in last)
    episodes = ray_local.data.read_parquet(str(tmp_path / "episodes")).to_pandas()
    assert sorted(episodes["episode_id"]) == list(range(7))
    assert pytest.approx(episodes["reward"].mean()) == 1.0


def _crash_after(tmp_path: Path, n: int, batch_rows: int, cut_last: bool = False) -> None:
    """A writer process that reports ``n`` episodes done, then dies with SIGKILL-like abruptness."""
    code = (
        "import os, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_dataset import result\n"
        "from harness.dataset import DatasetWriter\n"
        f"w = DatasetWriter({str(tmp_path)!r}, batch_rows={batch_rows}, flush_seconds=3600)\n"
        f"for i in range({n}):\n"
        "    w.add(result(i, n_steps=2), 'script')\n"
        "os._exit(9)  # no close(), no flush: what SIGKILL leaves\n")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 9
    if cut_last:  # the power went while the next row was half written
        journal = next((tmp_path / "journal").glob("*.jsonl"))
        with open(journal, "a") as f:
            f.write('{"episode": {"episode_id": 99, "run_id"')


def test_rows_reported_done_survive_a_crash(tmp_path: Path) -> None:
    _crash_after(tmp_path, 5, batch_rows=2, cut_last=True)
    # two part files made it; the fifth row lives only in the journal
    assert len(list((tmp_path / "episodes").glob("*.parquet"))) == 2
    assert recover(tmp_path) == 1
    assert not list((tmp_path / "journal").iterdir()) and not list(tmp_path.rglob("*.tmp"))
    assert sorted(episode_ids(tmp_path)) == [0, 1, 2, 3, 4]  # the cut row is not there: it was never done
    assert load_steps(tmp_path).num_rows == 10
    assert recover(tmp_path) == 0  # idempotent
    w = DatasetWriter(tmp_path, batch_rows=1)  # a resumed run appends after the existing parts
    w.add(result(5), "script")
    w.close()
    assert sorted(episode_ids(tmp_path)) == [0, 1, 2, 3, 4, 5]
    assert next_part(tmp_path) == 4


def test_a_journal_whose_part_file_was_written_is_not_recovered_twice(tmp_path: Path) -> None:
    w = DatasetWriter(tmp_path, batch_rows=10, flush_seconds=3600)
    for i in range(3):
        w.add(result(i), "script")
    journal = tmp_path / "journal" / "part-00000.jsonl"
    kept = journal.read_bytes()
    w.flush()  # the part file is written, then the journal removed...
    journal.write_bytes(kept)  # ...but say the crash came between the two
    assert recover(tmp_path) == 0
    assert sorted(episode_ids(tmp_path)) == [0, 1, 2]


def test_dropping_rows_to_retry_them_is_all_or_nothing(tmp_path: Path) -> None:
    w = DatasetWriter(tmp_path, batch_rows=2)
    for i in range(5):
        w.add(result(i, n_steps=2), "script")
    w.close()
    drop_episodes(tmp_path, {1, 4})
    assert sorted(episode_ids(tmp_path)) == [0, 2, 3]
    assert sorted(set(load_steps(tmp_path).column("episode_id").to_pylist())) == [0, 2, 3]
    # a drop cut short by a crash (intent written, one file filtered) is finished by recover
    (tmp_path / "dropping.json").write_text("[0]")
    assert recover(tmp_path) == 0
    assert sorted(episode_ids(tmp_path)) == [2, 3]
    assert sorted(set(load_steps(tmp_path).column("episode_id").to_pylist())) == [2, 3]
    assert not (tmp_path / "dropping.json").exists()

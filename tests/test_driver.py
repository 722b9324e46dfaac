"""The driver end to end: real local Ray, real sandboxes, the median sweep, the CLI's errors."""

from __future__ import annotations

import collections
import json
import subprocess
from pathlib import Path

import yaml

from harness_fixtures import (
    MEDIAN_CONFIG,
    harness_cli,
    local_provider,
    median_env,
    median_overrides,
    start_server,
    state_dir,
    needs_sandbox,
    ray_local,  # noqa: F401  (module-scoped fixture)
)

from harness.config import load_config
from harness.dataset import load_episodes, load_steps, read_manifest
from harness.driver import run

pytestmark = needs_sandbox


def cli(*args: str) -> subprocess.CompletedProcess:
    """`harness run ARGS` through the real command-line entry point."""
    return harness_cli("run", *args, timeout=240)


def test_cli_errors_are_one_line_without_traceback(tmp_path: Path) -> None:
    for args, needle in [
        ((str(MEDIAN_CONFIG), "polcy.id=1"), "unknown config key 'polcy'"),
        ((str(MEDIAN_CONFIG), "episodes=lots"), "'episodes'"),
        ((str(tmp_path / "missing.yaml"),), "not found"),
        ((), "no config given"),
    ]:
        p = cli(*args)
        assert p.returncode == 2, p.stderr
        assert needle in p.stderr and "Traceback" not in p.stderr
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    p = harness_cli("--debug", "run", str(MEDIAN_CONFIG), "polcy.id=1")
    assert p.returncode != 0 and "Traceback" in p.stderr


def test_describe_lists_every_key() -> None:
    p = cli("--describe")
    assert p.returncode == 0 and "env.grade.command" in p.stdout and "ray.actor_cpus" in p.stdout


def test_main_command_prints_the_expected_table(tmp_path: Path) -> None:
    """`harness run configs/median.yaml` as a user runs it (its own local Ray), one episode per point."""
    median_env()  # built once per test process; the run finds it by content hash
    p = cli(str(MEDIAN_CONFIG), *median_overrides(tmp_path, episodes=1, **{"ray.num_cpus": 2}))
    assert p.returncode == 0, p.stderr
    # the progress bar's last state: done/total, failures, running mean reward
    assert "6/6" in p.stderr and "failures 0" in p.stderr and "mean reward 0.917" in p.stderr
    rows = [line for line in p.stdout.splitlines() if "new_from" in line or "fork" in line]
    got = {tuple(line.replace("│", " ").split()[:4]) for line in rows}
    assert got == {(pid, m, "1", r) for pid, r in (("0", "0.750"), ("1", "1.000"), ("2", "1.000"))
                   for m in ("new_from", "fork")}
    assert "baseline reward 0.5" in p.stdout
    assert "using cached snapshot" in p.stderr


def test_median_sweep_datasets_and_no_leaks(tmp_path: Path, ray_local) -> None:  # noqa: F811
    median_env()
    cfg = load_config(MEDIAN_CONFIG, median_overrides(tmp_path, episodes=3, **{"output.run_id": "sweep"}))
    seen = []
    summary = run(cfg, show_progress=False, on_result=seen.append)
    assert summary.errors == 0 and not summary.interrupted and len(seen) == 18
    means = {(p.point["policy.id"], p.method): p.mean_reward for p in summary.points}
    assert means == {(i, m): (0.75 if i == 0 else 1.0) for i in (0, 1, 2) for m in ("new_from", "fork")}
    run_dir = tmp_path / "results" / "sweep"
    assert summary.run_dir == run_dir

    episodes = load_episodes(run_dir)
    assert episodes.num_rows == 18 and episodes.column("error").null_count == 18
    assert sorted(episodes.column("episode_id").to_pylist()) == list(range(18))
    assert len(set(episodes.column("actor").to_pylist())) == 2  # both actors worked
    assert len(set(episodes.column("sandbox_id").to_pylist())) == 18
    by_point = collections.defaultdict(list)
    for row in episodes.to_pylist():
        by_point[row["point"]].append(row["reward"])
        assert json.loads(row["grade"])["reward"] == row["reward"] and row["clean_start"]
        assert row["start_seconds"] > 0 and row["total_seconds"] >= row["grade_seconds"]
        info = json.loads(row["sandbox_info"])
        assert info["id"] == row["sandbox_id"] and info["memoryRestored"] is False
        if row["method"] == "new_from":
            assert info["fromSnapshot"] == summary.snapshot
        else:
            assert info["resumedFrom"]  # the actor's warm source
    assert by_point[json.dumps({"method": "fork", "policy.id": 0})] == [0.75] * 3

    steps = ray_local.data.read_parquet(str(run_dir / "steps")).to_pandas()
    assert len(steps) == 18 and set(steps["agent_id"]) == {"default_agent"}
    assert sorted(steps["rewards"]) == sorted(episodes.column("reward").to_pylist())
    assert load_steps(run_dir).num_rows == 18
    assert ray_local.data.read_parquet(str(run_dir / "episodes")).count() == 18

    manifest = read_manifest(run_dir)
    assert manifest["status"] == "finished" and manifest["episodes_done"] == 18
    assert manifest["env"]["baseline"]["reward"] == 0.5 and manifest["env"]["snapshot"] == summary.snapshot
    assert manifest["versions"]["ray"] and len(manifest["points"]) == 6
    source = yaml.safe_load((run_dir / "config.yaml").read_text())  # as given, for --resume
    assert source["policy"]["command"] == "cp policies/${policy.id}.py task/stats.py"
    assert manifest["config"]["episodes"] == 3 and manifest["config"]["env"]["dir"].endswith("envs/median")
    assert [p["policy"]["command"] for p in manifest["points"]][::2] == [
        f"cp policies/{i}.py task/stats.py" for i in (0, 1, 2)]
    assert [r["mean_reward"] for r in manifest["results"]] == [0.75, 0.75, 1.0, 1.0, 1.0, 1.0]

    with local_provider() as provider:
        leaked = [i for i in provider.list() if (i.name or "").startswith(summary.run_id)]
    assert leaked == []  # episode sandboxes and the actors' fork sources are gone


def test_failing_episodes_are_rows_and_the_run_goes_on(tmp_path: Path, ray_local) -> None:  # noqa: F811
    (tmp_path / "crashy.py").write_text("def act(obs):\n    raise ValueError('policy bug')\n")
    cfg = load_config(MEDIAN_CONFIG, median_overrides(
        tmp_path, episodes=2, sweep="{policy.kind: [command, python]}", **{
            "policy.entrypoint": "crashy:act", "policy.python_path": f"[{tmp_path}]", "output.run_id": "fail"}))
    summary = run(cfg, show_progress=False)
    ok, bad = summary.points
    assert (ok.episodes, ok.errors, ok.mean_reward) == (2, 0, 0.75)
    assert (bad.episodes, bad.errors, bad.mean_reward) == (2, 2, None)
    rows = load_episodes(tmp_path / "results" / "fail").to_pylist()
    errors = [r for r in rows if r["error_type"]]
    assert len(rows) == 4 and len(errors) == 2
    assert all(r["error_type"] == "PolicyError" and "policy bug" in r["error"] and r["reward"] is None
               for r in errors)
    assert read_manifest(tmp_path / "results" / "fail")["episodes_failed"] == 2


def test_episodes_go_to_whichever_actor_is_free(tmp_path: Path, ray_local) -> None:  # noqa: F811
    """One slow episode must not hold the other actor back (no lockstep)."""
    cfg = load_config(MEDIAN_CONFIG, median_overrides(tmp_path, episodes=1, sweep="{policy.id: [3, 0, 0, 0, 0]}", **{
        "policy.command": "'sleep ${policy.id}; cp policies/0.py task/stats.py'", "output.run_id": "free"}))
    summary = run(cfg, show_progress=False)
    assert summary.errors == 0
    rows = load_episodes(tmp_path / "results" / "free").to_pylist()
    slow_actor = rows[0]["actor"] if rows[0]["point_id"] == 0 else next(r["actor"] for r in rows if r["point_id"] == 0)
    per_actor = collections.Counter(r["actor"] for r in rows)
    assert per_actor[slow_actor] == 1 and sum(per_actor.values()) == 5


def test_a_dying_actor_is_one_error_row_and_is_replaced(tmp_path: Path, ray_local) -> None:  # noqa: F811
    (tmp_path / "killer.py").write_text(
        "import os\n"
        "def act(obs):\n"
        "    if obs.prompt == 'die':\n"
        "        os._exit(3)  # the whole actor process goes, mid-episode, sandbox acquired\n"
        "    return 'cp policies/1.py task/stats.py' if obs.t == 0 else None\n")
    cfg = load_config(MEDIAN_CONFIG, median_overrides(
        tmp_path, episodes=2, retries=0, sweep="{policy.prompt: [live, die, live], method: [fork]}", **{
            "policy.kind": "python", "policy.entrypoint": "killer:act", "policy.python_path": f"[{tmp_path}]",
            "output.run_id": "die"}))
    summary = run(cfg, show_progress=False)
    assert [(p.episodes, p.errors, p.mean_reward) for p in summary.points] == [(2, 0, 1.0), (2, 2, None),
                                                                                (2, 0, 1.0)]
    rows = load_episodes(tmp_path / "results" / "die").to_pylist()
    dead = [r for r in rows if r["error_type"]]
    assert len(rows) == 6 and {r["error_phase"] for r in dead} == {"actor"}
    assert all("Actor" in r["error_type"] for r in dead)
    with local_provider() as provider:
        assert [i.name for i in provider.list() if (i.name or "").startswith("die-")] == []


def test_infrastructure_failures_are_retried(tmp_path: Path, ray_local) -> None:  # noqa: F811
    """An actor that dies once is replaced and its episode retried; the row shows attempt 1."""
    marks = tmp_path / "marks"
    marks.mkdir()
    (tmp_path / "flaky.py").write_text(
        "import os, pathlib\n"
        f"MARKS = pathlib.Path({str(marks)!r})\n"
        "class Flaky:\n"
        "    def act(self, obs):\n"
        "        if obs.t == 0:\n"
        "            if not any(MARKS.iterdir()):  # the very first episode kills its actor, once\n"
        "                (MARKS / 'died').touch()\n"
        "                os._exit(3)\n"
        "            return 'cp policies/1.py task/stats.py'\n"
        "        return None\n")
    cfg = load_config(MEDIAN_CONFIG, median_overrides(
        tmp_path, episodes=3, sweep="{}", retries=1, actors=1, **{
            "policy.kind": "python", "policy.entrypoint": "flaky:Flaky", "policy.python_path": f"[{tmp_path}]",
            "output.run_id": "retry"}))
    summary = run(cfg, show_progress=False)
    assert summary.errors == 0
    rows = load_episodes(tmp_path / "results" / "retry").to_pylist()
    assert sorted(r["attempt"] for r in rows) == [0, 0, 1] and all(r["reward"] == 1.0 for r in rows)


def test_the_same_run_over_two_sandbox_servers(tmp_path: Path, ray_local) -> None:  # noqa: F811
    """`sandbox.backend=http` with `sandbox.hosts`: actors are spread over two `harness serve`
    on loopback, each with its own state directory (so each builds the environment)."""
    from harness.sandbox import open_provider

    median_env()
    servers = []
    try:
        servers.append(start_server(state_dir()))
        servers.append(start_server(tmp_path / "second-host"))
        urls = [url for _, url in servers]
        cfg = load_config(MEDIAN_CONFIG, median_overrides(tmp_path, episodes=1, actors=2, **{
            "sandbox.backend": "http", "sandbox.hosts": "[" + ",".join(urls) + "]", "output.run_id": "http"}))
        summary = run(cfg, show_progress=False)
        for url in urls:  # each host built (or had) the environment's snapshot
            with open_provider("http", url=url) as host:
                assert summary.snapshot in {snap.name for snap in host.snapshots()}
    finally:
        for server, _ in servers:
            server.terminate()
            server.wait(timeout=30)
        if (tmp_path / "second-host").exists():
            open_provider("local", state_dir=tmp_path / "second-host").shutdown()
    assert summary.errors == 0 and summary.baseline["reward"] == 0.5
    means = {(p.point["policy.id"], p.method): p.mean_reward for p in summary.points}
    assert means == {(i, m): (0.75 if i == 0 else 1.0) for i in (0, 1, 2) for m in ("new_from", "fork")}
    rows = load_episodes(summary.run_dir).to_pylist()
    assert {r["actor"].rsplit("-", 1)[-1] for r in rows} == {"a0", "a1"}, "episodes did not use both actors/hosts"
    assert load_episodes(summary.run_dir).column("sandbox_info").null_count == 0


def test_run_parser_takes_flags_anywhere() -> None:
    import argparse

    from harness.cli import add_run_parser

    parser = argparse.ArgumentParser()
    add_run_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["run", "c.yaml", "episodes=1", "--rebuild", "sweep={}", "--no-progress"])
    assert (args.config, args.overrides, args.rebuild, args.no_progress) == ("c.yaml", ["episodes=1", "sweep={}"],
                                                                             True, True)

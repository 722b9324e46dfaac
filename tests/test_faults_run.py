"""Faults injected into whole runs, with real components (local Ray, real sandboxes, a real
`harness serve`): SIGKILL of the driver then resume, SIGKILL of an actor process mid-episode,
a sandbox server killed and restarted mid-run, Ctrl-C then resume, resume's refusals.
Each asserts on the final dataset: every episode exactly once, nothing lost, nothing leaked."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from harness_fixtures import (
    MEDIAN_CONFIG,
    ROOT,
    harness_cli,
    local_provider,
    make_tiny_env,
    median_env,
    median_overrides,
    needs_sandbox,
    ray_local,  # noqa: F401  (module-scoped fixture)
    start_server,
    state_dir,
)

from harness.config import load_config
from harness.dataset import load_episodes, read_manifest
from harness.dispatch import RetryPolicy
from harness.driver import run
from harness.rundir import resume_config

pytestmark = needs_sandbox

SLOW_FIX = "'sleep 1; cp policies/1.py task/stats.py'"


def harness(*args: str) -> subprocess.CompletedProcess:
    """`harness ARGS` in a subprocess, on the tests' state directory."""
    return harness_cli(*args, home=state_dir())


def run_sandboxes(run_id: str) -> list[str]:
    with local_provider() as provider:
        return [i.name for i in provider.list() if (i.name or "").startswith(run_id + "-")]


def assert_complete(run_dir: Path, total: int) -> list[dict]:
    rows = load_episodes(run_dir).to_pylist()
    ids = [r["episode_id"] for r in rows]
    assert sorted(ids) == list(range(total)), f"lost {set(range(total)) - set(ids)}, rows {len(ids)}"
    assert not list((run_dir / "journal").glob("*.jsonl")) and not list(run_dir.rglob("*.tmp"))
    return rows


def journal_rows(run_dir: Path) -> list[dict]:
    rows = []
    for path in sorted((run_dir / "journal").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line)["episode"])
            except ValueError:
                pass
    return rows


def test_sigkill_of_the_driver_then_gc_and_resume(tmp_path: Path) -> None:
    """Rows reported done survive a SIGKILL of the driver; `harness sandbox gc` reaps the dead
    driver's sandboxes at once (not after their TTL); --resume runs only what has no row."""
    median_env()
    total = 12
    overrides = median_overrides(tmp_path, episodes=total, sweep="{}", **{
        "policy.command": SLOW_FIX, "ray.num_cpus": 2, "output.run_id": "killed", "output.batch_rows": 100,
        "output.flush_seconds": 3600})
    run_dir = tmp_path / "results" / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", "run", str(MEDIAN_CONFIG), *overrides,
                             "--no-progress"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while len(journal_rows(run_dir)) < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, proc.stderr.read()
        assert run_sandboxes("killed"), "the run should have sandboxes in flight"
    finally:
        proc.kill()  # SIGKILL: no cleanup of any kind
        proc.wait()
    before = {r["episode_id"]: r["finished_at"] for r in journal_rows(run_dir)}
    assert len(before) >= 3 and not list((run_dir / "episodes").glob("*.parquet"))

    deadline = time.monotonic() + 60  # Ray ends the dead driver's actors; gc then takes their sandboxes
    while True:
        gc = harness("sandbox", "gc")
        assert gc.returncode == 0, gc.stderr
        if not run_sandboxes("killed"):
            break
        assert time.monotonic() < deadline, f"still alive after gc: {run_sandboxes('killed')}"
        time.sleep(1)
    assert "killed" in json.dumps(json.loads(gc.stdout)["crashedRuns"]) or not (state_dir() / "runs" / "killed.json").exists()

    resumed = harness("run", "--resume", str(run_dir), "--no-progress")
    assert resumed.returncode == 0, resumed.stderr
    assert "Traceback" not in resumed.stderr
    rows = assert_complete(run_dir, total)
    assert all(r["reward"] == 1.0 for r in rows)
    kept = {r["episode_id"]: r["finished_at"] for r in rows if r["episode_id"] in before}
    assert {k: int(v.timestamp() * 1e6) for k, v in kept.items()} == before  # the same rows, not reruns
    manifest = read_manifest(run_dir)
    assert manifest["status"] == "finished" and manifest["episodes_done"] == total
    assert manifest["resumes"][0]["episodes_to_run"] == total - len(before)
    assert run_sandboxes("killed") == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_or_sigterm_then_resume_finishes_the_run(tmp_path: Path, sig: int) -> None:
    median_env()
    total = 10
    overrides = median_overrides(tmp_path, episodes=total, sweep="{}", **{
        "policy.command": SLOW_FIX, "ray.num_cpus": 2, "output.run_id": "intr", "output.batch_rows": 100})
    run_dir = tmp_path / "results" / "intr"
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", "run", str(MEDIAN_CONFIG), *overrides,
                             "--no-progress"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while len(journal_rows(run_dir)) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert f"harness run --resume {run_dir}" in err and "Traceback" not in err
    assert run_sandboxes("intr") == []  # running episodes cancelled, their sandboxes deleted
    done = read_manifest(run_dir)["episodes_done"]
    assert read_manifest(run_dir)["status"] == "interrupted" and 2 <= done < total
    assert len(load_episodes(run_dir)) == done

    # Overrides that would change the episodes are refused, and nothing is touched.
    refused = harness("run", "--resume", str(run_dir), "episodes=99", "--no-progress")
    assert refused.returncode == 2 and "change the episodes" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) <= 3 and "Traceback" not in refused.stderr
    assert len(load_episodes(run_dir)) == done

    resumed = harness("run", "--resume", str(run_dir), "actors=1", "--no-progress")  # how, not what: allowed
    assert resumed.returncode == 0, resumed.stderr
    assert_complete(run_dir, total)
    again = harness("run", "--resume", str(run_dir), "--no-progress")  # nothing left: a no-op
    assert again.returncode == 0 and len(load_episodes(run_dir)) == total


def test_resume_errors_are_one_line(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for args in (["--resume", str(tmp_path / "nope")], ["--resume", str(tmp_path / "empty")],
                 [str(MEDIAN_CONFIG), "--retry-failed"]):
        r = harness("run", *args, "--no-progress")
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr


def test_a_run_directory_is_run_by_one_driver_at_a_time(tmp_path: Path) -> None:
    from harness.rundir import locked

    with locked(tmp_path / "r"):
        code = f"from harness.rundir import locked\nwith locked(__import__('pathlib').Path({str(tmp_path / 'r')!r})):\n pass"
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert r.returncode == 1 and "is being run by harness run pid" in r.stderr
    with locked(tmp_path / "r"):  # released with its holder
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert r.returncode == 1 and "ConfigError" in r.stderr
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def _killer_policy(tmp_path: Path, marks: Path) -> Path:
    """A python policy that records its actor's pid, then takes its time (so a kill lands mid-episode)."""
    (tmp_path / "slow_policy.py").write_text(
        "import os, pathlib, time\n"
        f"MARKS = pathlib.Path({str(marks)!r})\n"
        "def act(obs):\n"
        "    if obs.t == 0:\n"
        "        (MARKS / f'{time.time_ns()}-{os.getpid()}').touch()\n"
        "        time.sleep(1.0)\n"
        "        return 'cp policies/1.py task/stats.py'\n"
        "    return None\n")
    return tmp_path


def test_sigkill_of_an_actor_process_mid_episode(tmp_path: Path, ray_local) -> None:  # noqa: F811
    """An actor's process is SIGKILLed from outside mid-episode: its episode is retried on
    another actor, the actor replaced, its sandboxes reaped; every episode exactly once."""
    median_env()
    marks = tmp_path / "marks"
    marks.mkdir()
    total = 8
    cfg = load_config(MEDIAN_CONFIG, median_overrides(tmp_path, episodes=total, sweep="{}", retry_backoff_s=0.2, **{
        "policy.kind": "python", "policy.entrypoint": "slow_policy:act",
        "policy.python_path": f"[{_killer_policy(tmp_path, marks)}]", "output.run_id": "actorkill"}))
    killed: list[int] = []

    def kill_one() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            started = sorted(p.name for p in marks.iterdir())
            if len(started) >= 3:  # a few episodes in: kill the actor of the latest one, mid-episode
                pid = int(started[-1].split("-")[1])
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_one, daemon=True)
    killer.start()
    summary = run(cfg, show_progress=False)
    killer.join(timeout=5)
    assert killed, "the actor was never killed"
    rows = assert_complete(summary.run_dir, total)
    assert summary.errors == 0 and all(r["reward"] == 1.0 for r in rows)
    assert any(r["attempt"] == 1 for r in rows), "the killed actor's episode was not retried"
    assert run_sandboxes("actorkill") == []


def test_sandbox_server_killed_and_restarted_mid_run(tmp_path: Path, ray_local) -> None:  # noqa: F811
    """backend http: the server is SIGKILLed mid-run and restarted on the same port and state:
    episodes that hit the outage are retried with backoff; every episode once, all graded."""
    median_env()  # the server shares the test state dir: the snapshot is already built
    server, url = start_server(state_dir())
    port = int(url.rsplit(":", 1)[1])
    total = 10
    cfg = load_config(MEDIAN_CONFIG, median_overrides(tmp_path, episodes=total, sweep="{}", retries=5,
                                                      retry_backoff_s=1.0, **{
        "policy.command": "'sleep 0.5; cp policies/1.py task/stats.py'", "sandbox.backend": "http",
        "sandbox.options.url": url, "output.run_id": "srvkill", "output.batch_rows": 1}))
    done = threading.Event()
    restarts: list[subprocess.Popen] = []

    def on_result(result) -> None:
        if not done.is_set() and not restarts and result.request.episode_id >= 2:
            done.set()

    def outage() -> None:
        if not done.wait(timeout=120):
            return
        server.kill()
        server.wait()
        time.sleep(1.0)
        restarts.append(start_server(state_dir(), port)[0])

    t = threading.Thread(target=outage, daemon=True)
    t.start()
    try:
        summary = run(cfg, show_progress=False, on_result=on_result)
        t.join(timeout=60)
    finally:
        for p in [server, *restarts]:
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=30)
    assert restarts, "the server was never restarted"
    rows = assert_complete(summary.run_dir, total)
    assert all(r["reward"] == 1.0 for r in rows), [(r["episode_id"], r["error"]) for r in rows if r["error"]]
    assert any(r["attempt"] > 0 for r in rows), "no episode hit the outage"
    assert run_sandboxes("srvkill") == []


def test_retry_failed_reruns_only_infrastructure_failures(tmp_path: Path, ray_local) -> None:  # noqa: F811
    """retries=0 leaves an actor death as an error row; --resume --retry-failed runs that
    episode again and replaces its row, leaving the policy failure's row alone."""
    median_env()
    marks = tmp_path / "marks"
    marks.mkdir()
    (tmp_path / "dies_once_policy.py").write_text(
        "import os, pathlib\n"
        f"MARKS = pathlib.Path({str(marks)!r})\n"
        "def act(obs):\n"
        "    if obs.prompt == 'bad':\n"
        "        raise ValueError('policy bug')\n"
        "    if obs.t == 0:\n"
        "        if not (MARKS / 'died').exists():\n"
        "            (MARKS / 'died').touch()\n"
        "            os._exit(3)\n"
        "        return 'cp policies/1.py task/stats.py'\n"
        "    return None\n")
    overrides = median_overrides(tmp_path, episodes=2, retries=0, actors=1, sweep="{policy.prompt: [good, bad]}", **{
        "policy.kind": "python", "policy.entrypoint": "dies_once_policy:act",
        "policy.python_path": f"[{tmp_path}]", "output.run_id": "again"})
    summary = run(load_config(MEDIAN_CONFIG, overrides), show_progress=False)
    rows = load_episodes(summary.run_dir).to_pylist()
    assert sorted((r["error_phase"] or "ok") for r in rows) == ["act", "act", "actor", "ok"]
    again = run(resume_config(summary.run_dir, []), show_progress=False, resume=True, retry_failed=True)
    assert again.errors == 2  # the policy failures remain
    rows = assert_complete(summary.run_dir, 4)
    assert sorted((r["error_phase"] or "ok") for r in rows) == ["act", "act", "ok", "ok"]
    assert read_manifest(summary.run_dir)["resumes"][0]["rows_dropped_to_retry"] == 1


@contextlib.contextmanager
def small_disk(path: Path, size: str):
    """A tmpfs of ``size`` at ``path``: a disk that fills up for real."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(disk: Path) -> Path:
    """Take every free byte of ``disk`` (again: what was freed since is taken too)."""
    ballast = disk / "ballast"
    with open(ballast, "ab") as f:
        st = os.statvfs(disk)
        free = st.f_bavail * st.f_frsize
        if free > 0:
            with contextlib.suppress(OSError):
                os.posix_fallocate(f.fileno(), os.fstat(f.fileno()).st_size, free)
        with contextlib.suppress(OSError):  # the last partial blocks
            while os.statvfs(disk).f_bavail > 0:
                f.write(b"\0" * 4096)
                f.flush()
    return ballast


def tiny_config(root: Path, state: Path, **extra) -> Path:
    env = make_tiny_env(root)
    cfg = {"env": {"dir": str(env), "name": "tinyfull", "grade": {"command": "sh grade.sh"}},
           "policy": {"command": "echo 42 > answer.txt"}, "sandbox": {"state_dir": str(state)},
           "output": {"dir": str(root / "results"), "batch_rows": 1}, **extra}
    (root / "c.yaml").write_text(yaml.safe_dump(cfg))
    return root / "c.yaml"


def test_a_full_state_disk_stops_the_run_and_resume_finishes_it(tmp_path: Path, ray_local,  # noqa: F811
                                                                 monkeypatch) -> None:
    """Every sandbox start fails (the state disk is full): the run retries, then stops as
    resumable instead of crawling on; with space again, --resume --retry-failed completes it."""
    from harness.errors import InfrastructureDown
    from harness.sandbox import open_provider

    total = 30
    # The backoff doubles up to 30 s in production; the test does not wait for that.
    monkeypatch.setattr("harness.driver.RetryPolicy", functools.partial(RetryPolicy, max_backoff_s=0.05))
    with small_disk(tmp_path / "state", "96m") as state:
        config = tiny_config(tmp_path, state, episodes=total, retries=3, retry_backoff_s=0.01,
                             output={"dir": str(tmp_path / "results"), "batch_rows": 1, "run_id": "full"})
        cfg = load_config(config)
        provider = open_provider("local", state_dir=state)
        ballast: list[Path] = []
        stop_filling = threading.Event()

        def keep_it_full() -> None:  # what a deleted sandbox frees is taken again at once
            while not stop_filling.wait(0.005):
                fill(state)

        def fill_after_three(result) -> None:
            if not ballast and result.request.episode_id >= 2:
                ballast.append(fill(state))
                threading.Thread(target=keep_it_full, daemon=True).start()

        try:
            with pytest.raises(InfrastructureDown) as stop:
                run(cfg, show_progress=False, on_result=fill_after_three)
            stop_filling.set()
            message = str(stop.value)
            assert "\n" not in message and "infrastructure failures in a row" in message
            assert "full" in message and "harness run --resume" in message, message
            run_dir = tmp_path / "results" / "full"
            assert read_manifest(run_dir)["status"] == "stopped"
            rows_before = load_episodes(run_dir).to_pylist()
            assert sum(r["reward"] == 1.0 for r in rows_before) >= 3
            assert all(r["infra_error"] and r["attempt"] == 3 for r in rows_before if r["reward"] is None)

            ballast[0].unlink()
            summary = run(resume_config(run_dir, []), show_progress=False, resume=True, retry_failed=True)
            rows = assert_complete(run_dir, total)
            assert summary.errors == 0 and all(r["reward"] == 1.0 for r in rows)
            assert read_manifest(run_dir)["status"] == "finished"
            assert [i for i in provider.list() if (i.name or "").startswith("full-")] == []
        finally:
            stop_filling.set()
            provider.shutdown()


def test_a_full_output_disk_keeps_every_row_reported_done(tmp_path: Path, ray_local) -> None:  # noqa: F811
    """The run directory's disk fills mid-run: the run stops with a one-line error, every row
    it reported done is still there, and --resume (with space again) finishes the run."""
    from harness.errors import DatasetWriteError

    total = 40
    done: list[int] = []
    with small_disk(tmp_path / "out", "384k") as out:
        config = tiny_config(tmp_path, state_dir(), episodes=total,
                             output={"dir": str(out), "batch_rows": 1, "run_id": "outfull"})
        with pytest.raises(DatasetWriteError) as stop:
            run(load_config(config), show_progress=False, on_result=lambda r: done.append(r.request.episode_id))
        message = str(stop.value)
        assert "\n" not in message and "No space left" in message and "harness run --resume" in message
        run_dir = out / "outfull"
        assert 0 < len(done) < total
        subprocess.run(["mount", "-o", "remount,size=64m", str(out)], check=True)
        run(resume_config(run_dir, []), show_progress=False, resume=True)
        rows = assert_complete(run_dir, total)
        assert set(done) <= {r["episode_id"] for r in rows}
        kept = {r["episode_id"]: r["attempt"] for r in rows}
        assert all(kept[i] == 0 for i in done)
    assert run_sandboxes("outfull") == []

"""Environments: content hash, build -> snapshot, cache, --rebuild, baseline, build errors."""

from __future__ import annotations

import io
import tarfile
import time
from pathlib import Path

import pytest
from harness_fixtures import FakeProvider, local_provider, make_tiny_env, median_env, median_spec, needs_sandbox

from harness.env import META_PATH, EnvSpec, GradeSpec, build_env, content_hash, snapshot_name, tar_dir
from harness.errors import ConfigError, EnvironmentBuildError
from harness.sandbox.base import SandboxSpec


def tiny_spec(path: Path, **kw) -> EnvSpec:
    return EnvSpec.from_dict({"dir": str(path), "grade": {"command": "sh grade.sh"}, **kw})


def test_hash_covers_files_and_commands_but_not_venvs(tmp_path: Path) -> None:
    env = make_tiny_env(tmp_path)
    h0 = content_hash(tiny_spec(env))
    (env / ".venv").mkdir()
    (env / ".venv" / "junk").write_text("x")
    (env / "__pycache__").mkdir()
    assert content_hash(tiny_spec(env)) == h0
    assert content_hash(tiny_spec(env, setup=["true"])) != h0
    assert content_hash(tiny_spec(env, reset=["true"])) != h0
    (env / "answer.txt").write_text("1\n")
    h1 = content_hash(tiny_spec(env))
    assert h1 != h0
    (env / "answer.txt").chmod(0o755)
    assert content_hash(tiny_spec(env)) != h1
    assert snapshot_name(tiny_spec(env), h1) == f"env-tiny-{h1[:16]}"


def test_tar_excludes_venv(tmp_path: Path) -> None:
    env = make_tiny_env(tmp_path)
    (env / ".venv").mkdir()
    (env / ".venv" / "x").write_text("x")
    names = tarfile.open(fileobj=io.BytesIO(tar_dir(env))).getnames()
    assert sorted(names) == ["answer.txt", "grade.sh"]


def test_spec_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="env.grade.command"):
        EnvSpec.from_dict({"dir": str(tmp_path)})
    with pytest.raises(ConfigError, match="not a directory"):
        EnvSpec.from_dict({"dir": str(tmp_path / "nope"), "grade": {"command": "x"}})


def test_build_cache_and_rebuild_with_fake_provider(tmp_path: Path) -> None:
    env = make_tiny_env(tmp_path / "src")
    provider = FakeProvider(tmp_path / "state")
    spec = tiny_spec(env, setup=["echo built > setup.txt"], reset=["rm -f setup.txt"])
    built = build_env(provider, spec)
    assert not built.cached and built.baseline == {"reward": 0.25, "note": "tiny"}
    assert built.baseline_reward == 0.25
    assert built.snapshot in {s.name for s in provider.snapshots()}
    assert provider.list() == []  # the build sandbox is gone
    again = build_env(provider, spec)
    assert again.cached and again.snapshot == built.snapshot and again.baseline == built.baseline
    forced = build_env(provider, spec, rebuild=True)
    assert not forced.cached and forced.snapshot == built.snapshot
    # The snapshot starts clean: reset ran, no result file, the env is in ~/env.
    with provider.create(SandboxSpec(), from_snapshot=built.snapshot) as sb:
        assert sb.exec("test ! -e result.json && test ! -e env/setup.txt && cat env/answer.txt").text() == "0\n"


@pytest.mark.parametrize("kw,match", [
    ({"setup": ["exit 7"]}, "setup command 'exit 7' exited 7"),
    ({"grade": {"command": "true"}}, "baseline grade failed: the grader wrote no result"),
    ({"grade": {"command": "echo '{\"score\": 1}' > $HOME/result.json"}}, "no numeric 'reward'"),
])
def test_build_errors_are_one_line(tmp_path: Path, kw: dict, match: str) -> None:
    env = make_tiny_env(tmp_path / "src")
    provider = FakeProvider(tmp_path / "state")
    with pytest.raises(EnvironmentBuildError, match=match) as exc:
        build_env(provider, EnvSpec.from_dict({"dir": str(env), "grade": {"command": "sh grade.sh"}, **kw}))
    assert "\n" not in str(exc.value)
    assert provider.list() == []  # released on failure too


def test_grade_spec_defaults() -> None:
    assert GradeSpec("x").result == "/home/user/result.json"


@needs_sandbox
def test_median_build_in_a_real_sandbox() -> None:
    built = median_env()
    assert built.baseline_reward == 0.5
    assert built.baseline["passed"] == 2 and built.baseline["failed"] == 2
    with local_provider() as provider:
        t0 = time.monotonic()
        again = build_env(provider, median_spec())
        assert again.cached and again.snapshot == built.snapshot and again.baseline_reward == 0.5
        assert time.monotonic() - t0 < 5  # a cache hit does not reinstall pytest
        with provider.create(SandboxSpec(), from_snapshot=built.snapshot) as sb:
            r = sb.exec("test ! -e ~/result.json && cd env && .venv/bin/python -m pytest --version")
            assert r.ok and "8.3.3" in r.text() + r.text("stderr")
            assert b'"baseline"' in sb.read_file(META_PATH)

"""The run configuration: defaults < YAML < dotlist, one-line errors, sweeps, documentation."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from harness_fixtures import MEDIAN_CONFIG, MEDIAN_DIR

from harness import config as C
from harness.errors import ConfigError


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


BASE = """
env:
  dir: env
  grade: {command: ./grade.sh}
policy: {command: "echo ${policy.id}", id: 7}
"""


@pytest.fixture
def cfg_file(tmp_path: Path) -> Path:
    (tmp_path / "env").mkdir()
    return write(tmp_path, BASE)


def test_defaults_yaml_and_overrides_layer(cfg_file: Path) -> None:
    cfg = C.load_config(cfg_file, ["episodes=5", "policy.id=9"])
    assert cfg.episodes == 5  # override
    assert cfg.policy.id == 9  # override over YAML
    assert cfg.actors == 2 and cfg.method == "new_from"  # defaults
    assert cfg.env.grade.result == "/home/user/result.json"
    # A relative env.dir means next to the config file.
    assert cfg.env.dir == str(cfg_file.parent / "env")


def test_unknown_key_in_yaml_is_named(tmp_path: Path) -> None:
    (tmp_path / "env").mkdir()
    path = write(tmp_path, BASE + "polcy: {id: 1}\n")
    with pytest.raises(ConfigError) as exc:
        C.load_config(path)
    assert "'polcy'" in str(exc.value) and "\n" not in str(exc.value)


def test_unknown_nested_key_on_command_line_is_named(cfg_file: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown config key 'policy\.idd' on the command line"):
        C.load_config(cfg_file, ["policy.idd=3"])


def test_mistyped_value_is_named(cfg_file: Path) -> None:
    with pytest.raises(ConfigError, match="'episodes'"):
        C.load_config(cfg_file, ["episodes=many"])


def test_override_needs_equals(cfg_file: Path) -> None:
    with pytest.raises(ConfigError, match="key=value"):
        C.load_config(cfg_file, ["episodes"])


def test_missing_required_key(tmp_path: Path) -> None:
    (tmp_path / "env").mkdir()
    with pytest.raises(ConfigError, match="env.grade.command"):
        C.load_config(write(tmp_path, "env: {dir: env}\n"))


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="not found"):
        C.load_config("/nonexistent/x.yaml")


def test_sweep_is_cartesian_and_interpolates_per_point(cfg_file: Path) -> None:
    cfg = C.load_config(cfg_file, ["sweep={policy.id: [0, 1, 2], method: [new_from, fork]}"])
    pts = C.points(cfg)
    assert len(pts) == 6
    assert pts[0] == {"policy.id": 0, "method": "new_from"} and pts[-1] == {"policy.id": 2, "method": "fork"}
    resolved = [C.point_config(cfg, p) for p in pts]
    assert [r["policy"]["command"] for r in resolved] == ["echo 0"] * 2 + ["echo 1"] * 2 + ["echo 2"] * 2
    assert [r["method"] for r in resolved] == ["new_from", "fork"] * 3
    assert len({C.config_hash(r) for r in resolved}) == 6


def test_no_sweep_is_one_point(cfg_file: Path) -> None:
    cfg = C.load_config(cfg_file)
    assert C.points(cfg) == [{}]
    assert C.point_config(cfg, {})["policy"]["command"] == "echo 7"


@pytest.mark.parametrize("sweep,match", [
    ("{env.dir: [a, b]}", "cannot vary"),
    ("{policy.nope: [1]}", "unknown sweep key 'policy.nope'"),
    ("{policy.id: []}", "non-empty list"),
])
def test_bad_sweeps(cfg_file: Path, sweep: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        C.load_config(cfg_file, [f"sweep={sweep}"])


def test_bad_method(cfg_file: Path) -> None:
    cfg = C.load_config(cfg_file, ["method=teleport"])
    with pytest.raises(ConfigError, match="unknown method 'teleport'"):
        C.point_config(cfg, {})


def test_every_field_is_documented() -> None:
    rows = C.describe()
    assert len(rows) > 30
    missing = [key for key, _, _, doc in rows if not doc]
    assert not missing, f"fields without a docstring: {missing}"
    # and every dataclass field is reachable in the reference
    keys = {r[0] for r in rows}
    assert {"env.grade.command", "policy.max_steps", "sweep", "ray.address", "output.batch_rows"} <= keys
    for cls in (C.RunConfig, C.EnvConfig, C.PolicyConfig, C.SandboxConfig, C.RayConfig, C.OutputConfig):
        assert set(C.field_docs(cls)) == {f.name for f in dataclasses.fields(cls)}


def test_median_config_loads() -> None:
    cfg = C.load_config(MEDIAN_CONFIG)
    assert cfg.env.dir == str(MEDIAN_DIR)
    pts = C.points(cfg)
    assert len(pts) == 6 and {p["method"] for p in pts} == {"new_from", "fork"}
    assert C.point_config(cfg, pts[2])["policy"]["command"] == "cp policies/1.py task/stats.py"


def test_sweep_on_the_command_line_replaces_the_files_sweep() -> None:
    cfg = C.load_config(MEDIAN_CONFIG, ["sweep={policy.id: [1]}"])
    assert C.points(cfg) == [{"policy.id": 1}]
    assert C.points(C.load_config(MEDIAN_CONFIG, ["sweep={}"])) == [{}]


def test_run_id_must_be_a_safe_name(cfg_file: Path) -> None:
    with pytest.raises(ConfigError, match="output.run_id"):
        C.load_config(cfg_file, ["output.run_id='my run'"])
    assert C.load_config(cfg_file, ["output.run_id=exp-1.a_b"]).output.run_id == "exp-1.a_b"

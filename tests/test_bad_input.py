"""Bad input, part 5 of issue 5: malformed or contradictory configs, grader results
that are garbage, failing setup commands, unknown snapshots and ids, huge and
non-UTF-8 output. Each must end as a one-line error (or one recorded episode row),
never a traceback, and never lose what was already written.

Decisions the properties pin down:

- A grader's ``reward`` must be a JSON number that is finite as a float: NaN,
  Infinity, numbers beyond the float range (1e400, 10**400), booleans, strings and
  null are a GradeError (the episode records no reward). The parsed result's
  ``reward`` is always a Python float.
- A config either loads (and then every sweep point resolves, or fails with a
  ConfigError) or load_config raises ConfigError; never another exception type.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from harness import config as C
from harness.env import GradeSpec, parse_grade
from harness.errors import ConfigError, GradeError

ROOT = Path(__file__).resolve().parents[1]
HARNESS = Path(sys.executable).parent / "harness"

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.function_scoped_fixture])


def one_line(message: str) -> bool:
    return bool(message.strip()) and "\n" not in message and "\r" not in message


# -- configs -------------------------------------------------------------------------

#: Every leaf key of the config, plus the sweep, as dotted paths.
KEYS = [row[0] for row in C.describe()]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(10**6), max_value=10**6), st.integers(),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30),
    st.sampled_from(["local", "http", "fork", "new_from", "teleport", "small", "huge", "command", "python",
                     "${policy.id}", "${nosuch}", "${policy.id", "http://h:1", "a\x00b", "???", "[1, 2", "{a: 1}"]),
)
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=10)), inner,
                                                 max_size=4)), max_leaves=12)


def nest(flat: dict) -> dict:
    """{"a.b": 1} -> {"a": {"b": 1}}, keeping the last of clashing keys."""
    out: dict = {}
    for key, value in flat.items():
        node, parts = out, str(key).split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    return out


sweep_values = st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=10)),
                               st.one_of(st.lists(scalars, max_size=3), scalars), max_size=3)
REQUIRED = {"env.dir": "env", "env.grade.command": "sh grade.sh"}
documents = st.one_of(
    # valid documents with a few keys set to anything: these reach validate() and the sweep
    st.dictionaries(st.sampled_from([k for k in KEYS if k not in REQUIRED]), values, max_size=3).map(
        lambda d: nest({**REQUIRED, **d})),
    st.builds(lambda s: {**nest(REQUIRED), "sweep": s}, sweep_values),
    st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=12)), values, max_size=6).map(nest),
    values,  # not a mapping at all
)
overrides = st.one_of(st.just([]), st.lists(st.one_of(
    st.builds(lambda k, v: f"{k}={v}", st.sampled_from(KEYS + ["sweep", "polcy.id", "env"]),
              st.one_of(st.text(max_size=20), st.sampled_from(["[1, 2]", "{policy.id: [1, 2]}", "{env.dir: [a]}",
                                                               "-3", "0", "1e400", "nan", "[http://h:1]", "{",
                                                               "{method: [fork, teleport]}", "{episodes: [0]}"]))),
    st.text(max_size=20),
), max_size=4))


def check_config(path: Path | None, items: list[str]) -> None:
    """The property: ConfigError with one line, or a config whose every point resolves or fails cleanly."""
    try:
        cfg = C.load_config(path, items)
    except ConfigError as exc:
        assert one_line(str(exc)), repr(str(exc))
        return
    # A loaded config honours its invariants ...
    assert cfg.episodes >= 1 and cfg.actors >= 1 and cfg.retries >= 0
    assert cfg.sandbox.backend in ("local", "http")
    assert not (cfg.sandbox.hosts and cfg.sandbox.backend != "http")
    for key in cfg.sweep:
        assert any(key == s or (s.endswith(".") and key.startswith(s)) for s in C.SWEEPABLE)
    # ... and each sweep point resolves to valid values, or is a one-line ConfigError.
    for point in C.points(cfg)[:20]:
        try:
            data = C.point_config(cfg, point)
        except ConfigError as exc:
            assert one_line(str(exc)), repr(str(exc))
            continue
        assert data["method"] in ("new_from", "fork") and data["episodes"] >= 1
        assert data["sandbox"]["type"] in ("small", "medium", "large") and data["sandbox"]["ttl_s"] > 0
        assert math.isfinite(data["policy"]["step_timeout"]) and data["policy"]["step_timeout"] > 0
        assert data["policy"]["max_steps"] >= 0


@pytest.fixture(scope="module")
def cfg_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cfg")
    (path / "env").mkdir()
    return path


@FAST
@given(doc=documents, items=overrides)
@example(doc={"env": {"dir": "env", "grade": {"command": "g"}}, "sandbox": {"hosts": ["http://h:1"]}}, items=[])
@example(doc={"env": {"dir": "env", "grade": {"command": "g"}}, "sweep": {"env.dir": ["a"]}}, items=[])
@example(doc={"env": {"dir": "env", "grade": {"command": "g"}}, "episodes": -1}, items=[])
@example(doc={"env": {"dir": "env", "grade": {"command": "g"}}, "output": {"run_id": "${nosuch}"}}, items=[])
@example(doc={"env": {"dir": "env", "grade": {"command": "g"}}, "sweep": {"policy.a[": [1]}}, items=[])
@example(doc={"env": {"dir": "a\x00b", "grade": {"command": "g"}}}, items=[])
@example(doc={"env": {"dir": "env", "grade": {"command": "g"}}, "sweep": {"episodes": [0, "many"]}}, items=[])
@example(doc={"env": {"dir": "env", "grade": {"command": "g"}}, "sandbox": {"type": "huge"}}, items=[])
@example(doc={"env": {"dir": "env", "grade": {"command": "g"}}, "policy": {"step_timeout": float("nan")}}, items=[])
@example(doc={"env": {"dir": "env", "grade": {"command": "g"}}}, items=["sweep={policy.id: [1, ${nosuch}]}"])
def test_any_yaml_document_loads_or_is_a_one_line_config_error(cfg_dir: Path, doc, items: list[str]) -> None:
    path = cfg_dir / "c.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    check_config(path, items)


@FAST
@given(text=st.one_of(st.text(max_size=200), st.sampled_from([
    "env: [", "env: {dir: env, grade: {command: g}}\n\tsweep: 1", "- a\n- b", "!!python/object:os.system x",
    "env: &a [*a]", "a: b: c", "%YAML 9.9\n---\nx: 1", "env:\n  dir: env\n  dir: other\n", "\ufeff: 1", "? [a]\n: 1",
])), items=overrides)
def test_any_text_as_a_config_file_loads_or_is_a_one_line_config_error(cfg_dir: Path, text: str,
                                                                      items: list[str]) -> None:
    path = cfg_dir / "t.yaml"
    path.write_text(text, errors="surrogatepass")
    check_config(path, items)


@FAST
@given(items=overrides)
def test_any_overrides_without_a_file_are_a_one_line_config_error_or_load(items: list[str]) -> None:
    check_config(None, ["env.dir=/tmp", "env.grade.command=g", *items])


valid_sweeps = st.fixed_dictionaries({}, optional={
    "policy.id": st.lists(st.one_of(st.integers(-5, 5), st.text("abc", max_size=3)), min_size=1, max_size=3),
    "method": st.lists(st.sampled_from(["new_from", "fork"]), min_size=1, max_size=2),
    "episodes": st.lists(st.integers(1, 9), min_size=1, max_size=2),
    "sandbox.type": st.lists(st.sampled_from(["small", "medium", "large"]), min_size=1, max_size=2),
    "sandbox.ttl_s": st.lists(st.floats(0.5, 1e6), min_size=1, max_size=2),
})


@FAST
@given(sweep=valid_sweeps, episodes=st.integers(1, 10**6), actors=st.integers(1, 64))
def test_valid_settings_and_sweeps_always_load(cfg_dir: Path, sweep: dict, episodes: int, actors: int) -> None:
    """The other side of the property: the checks refuse nothing that is valid."""
    doc = {**nest({**REQUIRED, "policy.command": "echo ${policy.id}"}), "episodes": episodes, "actors": actors,
           "sweep": sweep}
    path = cfg_dir / "v.yaml"
    path.write_text(yaml.safe_dump(doc))
    cfg = C.load_config(path)
    pts = C.points(cfg)
    assert len(pts) == math.prod(len(v) for v in sweep.values())
    for point in pts:
        data = C.point_config(cfg, point)
        assert data["policy"]["command"] == f"echo {point.get('policy.id')}"


@pytest.mark.parametrize("items,match", [
    (["sandbox.hosts=[http://h:1]"], "set sandbox.backend=http"),
    (["sandbox.backend=docker"], "sandbox.backend"),
    (["episodes=-2"], "episodes"),
    (["actors=0"], "actors"),
    (["sweep={env.dir: [a, b]}"], "cannot vary"),
    (["sweep={ray.num_cpus: [1, 2]}"], "cannot vary"),
    (["sandbox.type=huge"], "sandbox.type"),
    (["sandbox.ttl_s=0"], "sandbox.ttl_s"),
    (["policy.kind=magic"], "policy.kind"),
    (["policy.step_timeout=-1"], "policy.step_timeout"),
    (["env.grade.timeout=nan"], "env.grade.timeout"),
    (["output.batch_rows=0"], "output.batch_rows"),
    (["output.run_id=${nosuch}"], "nosuch"),
    (["sweep={episodes: [1, 0]}"], "episodes"),
    (["sweep={method: [fork, teleport]}"], "teleport"),
    (["sweep={sandbox.type: [small, huge]}"], "huge"),
    (["env.dir=a\x00b"], "env.dir"),
])
def test_contradictory_or_out_of_range_settings_are_named(items: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match) as exc:
        cfg = C.load_config(None, ["env.dir=/tmp", "env.grade.command=g", *items])
        for point in C.points(cfg):  # some are only found per point
            C.point_config(cfg, point)
    assert one_line(str(exc.value))


# -- grader results ------------------------------------------------------------------

GRADE = GradeSpec("sh grade.sh")

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=8,
)
rewards = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=10), st.lists(st.integers(), max_size=2), st.just({"value": 1}))
reward_texts = st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1" + "0" * 400, "1" + "0" * 5000,
                                "0.5", "1", "-0.0", "true", "null", '"1.0"', "[1]", "1e-400"])


def _grade_objects() -> st.SearchStrategy[bytes]:
    dumped = st.builds(lambda extra, r: json.dumps({**extra, "reward": r}).encode(),
                       st.dictionaries(st.text(max_size=8), json_values, max_size=3), rewards)
    literal = st.builds(lambda t, pre: (pre + '{"reward": ' + t + "}").encode(), reward_texts,
                        st.sampled_from(["", " \n", '{"a": 1}\n', "\ufeff"]))
    return st.one_of(dumped, literal)


garbage = st.one_of(
    st.binary(max_size=300),
    st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.builds(lambda v: json.dumps(v).encode(), json_values),
    _grade_objects(),
    st.builds(lambda n: b"[" * n, st.integers(1, 200_000)),  # nesting deep enough to blow the recursion limit
    st.builds(lambda n, b: b'{"reward": 1, "x": "' + b * n + b'"}', st.integers(0, 3_000_000),
              st.sampled_from([b"a", b"\xff", b"\xe2\x82"])),  # several MB, some of it not UTF-8
    st.sampled_from([b"", b"\x00", b"\xff\xfe{\x00}\x00", b'{"reward": 0.5}\x00', b'{"reward": 0.5} trailing',
                     b'{"reward": 0.5}{"reward": 1}', '{"reward": 0.5, "n": "\udcff"}'.encode("utf-8", "surrogatepass"),
                     b'{"reward": 0.5, "note": "\xff"}', b'{"reward": 1, "reward": NaN}']),
)


@settings(max_examples=300, deadline=None)
@given(raw=garbage)
def test_parse_grade_gives_a_finite_float_reward_or_a_one_line_grade_error(raw: bytes) -> None:
    try:
        data = parse_grade(raw, GRADE)
    except GradeError as exc:
        assert one_line(str(exc)), repr(str(exc))
        assert len(str(exc)) < 1000
        return
    assert isinstance(data, dict)
    assert type(data["reward"]) is float and math.isfinite(data["reward"])


@pytest.mark.parametrize("text,expected", [
    ('{"reward": 1}', 1.0), ('{"reward": 0.25, "note": "x"}', 0.25), ('{"reward": -0.0}', 0.0),
    ('{"reward": 1e-400}', 0.0), ('{"reward": 0.5, "note": "\xff"}', 0.5),
])
def test_parse_grade_accepts_finite_numbers(text: str, expected: float) -> None:
    data = parse_grade(text.encode("latin-1"), GRADE)
    assert data["reward"] == expected and type(data["reward"]) is float


@pytest.mark.parametrize("text", [
    '{"reward": NaN}', '{"reward": Infinity}', '{"reward": -Infinity}', '{"reward": 1e400}',
    '{"reward": 1' + "0" * 400 + "}", '{"reward": true}', '{"reward": "1.0"}', '{"reward": null}', "[1]",
    "1", '"reward"', "{}", "[" * 100_000, "{" * 100_000, "",
])
def test_parse_grade_rejects_what_is_no_finite_number(text: str) -> None:
    with pytest.raises(GradeError) as exc:
        parse_grade(text.encode(), GRADE)
    assert one_line(str(exc.value)) and len(str(exc.value)) < 1000


# -- the command line: `harness run` and `harness sandbox` ------------------------------

from harness_fixtures import local_provider, needs_sandbox, state_dir

TINY_GRADE = ('if [ "$(cat answer.txt)" = 42 ]; then r=1.0; else r=0.25; fi\n'
              'printf \'{"reward": %s}\' "$r" > "$HOME/result.json"\n')


def harness(*args: str, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    """The installed `harness` command in a subprocess, as users run it."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HARNESS_SANDBOX_")}
    environ.update(env or {}, COLUMNS="200")
    return subprocess.run([str(HARNESS), *args], capture_output=True, text=True, timeout=timeout, env=environ,
                          stdin=subprocess.DEVNULL, cwd=ROOT, check=False)


def assert_one_line_error(proc: subprocess.CompletedProcess, needle: str, code: int | None = None) -> None:
    assert proc.returncode != 0 and (code is None or proc.returncode == code), (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert needle in proc.stderr, proc.stderr


def write_env(root: Path, setup: list[str] | None = None, grade: str = TINY_GRADE) -> Path:
    """A tiny environment and its config: the grader needs nothing but sh."""
    env = root / "env"
    (env / "policies").mkdir(parents=True, exist_ok=True)
    (env / "answer.txt").write_text("0\n")
    (env / "grade.sh").write_text("#!/bin/sh\n" + grade)
    cfg = {"env": {"dir": "env", "name": "badinput", "setup": setup or [], "grade": {"command": "sh grade.sh"}},
           "policy": {"command": "sh policies/${policy.id}.sh", "id": "ok"},
           "sandbox": {"state_dir": str(state_dir())}, "ray": {"num_cpus": 2},
           "output": {"dir": str(root / "results"), "batch_rows": 1}}
    (root / "c.yaml").write_text(yaml.safe_dump(cfg))
    return root / "c.yaml"


def test_run_with_a_missing_config_file_is_one_line(tmp_path: Path) -> None:
    assert_one_line_error(harness("run", str(tmp_path / "nope.yaml")), "not found", 2)


@pytest.mark.parametrize("text,needle", [
    ("env: [\n", "not valid YAML"),
    ("- just\n- a list\n", "must hold a YAML mapping"),
    ("env: {dir: env, grade: {command: g}}\nepisodes: -3\n", "episodes"),
    ("env: {dir: env, grade: {command: g}}\nsandbox: {hosts: ['http://h:1']}\n", "sandbox.backend=http"),
    ("env: {dir: env, grade: {command: g}}\noutput: {run_id: '${nosuch}'}\n", "nosuch"),
], ids=["broken-yaml", "not-a-mapping", "negative-episodes", "hosts-without-http", "bad-interpolation"])
def test_run_with_a_bad_config_is_one_line(tmp_path: Path, text: str, needle: str) -> None:
    (tmp_path / "c.yaml").write_text(text)
    assert_one_line_error(harness("run", str(tmp_path / "c.yaml")), needle, 2)


def test_run_with_a_missing_env_dir_is_one_line(tmp_path: Path) -> None:
    cfg = write_env(tmp_path)
    proc = harness("run", str(cfg), f"env.dir={tmp_path / 'gone'}", "--no-progress")
    assert_one_line_error(proc, "is not a directory", 2)
    assert not (tmp_path / "results").exists() or not any((tmp_path / "results").iterdir())


@pytest.fixture
def sandboxes():
    """The local provider of the runs' state directory (opened in this process, so that
    harness_fixtures' exit-time cleanup can open it again); no sandbox may be left behind."""
    with local_provider() as provider:
        before = {i.id for i in provider.list()}
        yield provider
        leaked = [i for i in provider.list() if i.id not in before]
        for info in leaked:
            provider.get(info.id).delete()
        assert not leaked, f"sandboxes left behind: {[i.name for i in leaked]}"


@needs_sandbox
def test_run_whose_setup_fails_names_the_command_and_its_output(tmp_path: Path, sandboxes) -> None:
    cfg = write_env(tmp_path, setup=["echo preparing; echo 'E: package libfoo not found' >&2; exit 3"])
    proc = harness("run", str(cfg), "output.run_id=setupfail", "--no-progress")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    # The build logs its steps as it goes; the error itself is one line, the last.
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert errors == [proc.stderr.strip().splitlines()[-1]], proc.stderr
    assert errors[0].startswith("harness run: error: env setup command")
    assert "exited 3" in errors[0] and "E: package libfoo not found" in errors[0]


#: Policy scripts of the one run below, by policy.id: what each does to the episode, and
#: the (error_type, error_phase, reward, error needle) its row must show.
MB = 4 << 20
POLICIES = {
    "ok": ("echo 42 > answer.txt", (None, None, 1.0, None)),
    # The grader prints binary garbage and writes binary garbage as its result.
    "garbage": ("printf 'head -c 3000 /dev/urandom; head -c 3000 /dev/urandom > \"$HOME/result.json\"' > grade.sh",
                ("GradeError", "grade", None, "is not JSON")),
    "not-json": ("printf 'echo reward: 1 > \"$HOME/result.json\"' > grade.sh", ("GradeError", "grade", None, "not JSON")),
    "reward-string": ("printf 'echo {\\\"reward\\\": \\\"high\\\"} > \"$HOME/result.json\"' > grade.sh",
                      ("GradeError", "grade", None, "no numeric 'reward'")),
    "reward-nan": ("printf 'echo {\\\"reward\\\": NaN} > \"$HOME/result.json\"' > grade.sh",
                   ("GradeError", "grade", None, "not a finite number")),
    # Several MB of non-UTF-8 on both streams, then a result that is not UTF-8 either.
    "huge-result": (f"printf 'head -c {MB} /dev/zero | tr \"\\\\\\\\0\" \"\\\\\\\\377\"; "  # noqa: ISC004
                    f"head -c {MB} /dev/zero | tr \"\\\\\\\\0\" \"\\\\\\\\376\" | tee \"$HOME/result.json\" >&2' > grade.sh",
                    ("GradeError", "grade", None, "not JSON")),
    # A grader as loud, but with a good result: the noise does not matter.
    "loud-grader": (f"printf 'head -c {MB} /dev/urandom; head -c {MB} /dev/urandom >&2; "  # noqa: ISC004
                    f"echo {{\\\"reward\\\": 0.5}} > \"$HOME/result.json\"' > grade.sh", (None, None, 0.5, None)),
    # The policy's own command prints several MB of non-UTF-8: cut to output.max_output_bytes.
    "loud-policy": (f"head -c {MB} /dev/urandom; head -c {MB} /dev/urandom >&2; echo 42 > answer.txt",
                    (None, None, 1.0, None)),
}


@needs_sandbox
def test_bad_graders_and_loud_policies_are_one_row_each(tmp_path: Path, sandboxes) -> None:
    """One run, one episode per policy: every bad grade is its own row with no reward, and the
    other episodes of the run are graded as usual; huge and non-UTF-8 output is cut, not fatal."""
    from harness.dataset import load_episodes, load_steps, read_manifest

    cfg = write_env(tmp_path)
    for name, (script, _) in POLICIES.items():
        (tmp_path / "env" / "policies" / f"{name}.sh").write_text(script + "\n")
    sweep = "{policy.id: [" + ", ".join(POLICIES) + "]}"
    proc = harness("run", str(cfg), f"sweep={sweep}", "output.run_id=badgrades", "output.max_output_bytes=1000",
                   "actors=2", "--no-progress", timeout=300)
    assert proc.returncode == 1, proc.stderr  # 1: the run finished, some episodes failed
    assert "Traceback" not in proc.stderr + proc.stdout
    run_dir = tmp_path / "results" / "badgrades"
    rows = {json.loads(r["point"])["policy.id"]: r for r in load_episodes(run_dir).to_pylist()}
    assert sorted(rows) == sorted(POLICIES) and load_episodes(run_dir).num_rows == len(POLICIES)
    for name, (_, (error_type, phase, reward, needle)) in POLICIES.items():
        row = rows[name]
        assert (row["error_type"], row["error_phase"], row["reward"]) == (error_type, phase, reward), (name, row)
        if needle:
            assert needle in row["error"] and len(row["error"]) <= 1000 and "\n" not in row["error"], row["error"]
            assert not row["infra_error"] and row["grade"] is None
    assert read_manifest(run_dir)["episodes_failed"] == 5
    steps = {r["episode_id"]: r for r in load_steps(run_dir).to_pylist()}
    loud = json.loads(steps[rows["loud-policy"]["episode_id"]]["new_obs"])
    assert len(loud["stdout"]) <= 1000 and len(loud["stderr"]) <= 1000  # cut, replacement characters and all
    assert json.loads(steps[rows["loud-policy"]["episode_id"]]["infos"])["output_truncated"] is True
    # A later run that fails on its config (here: the run directory exists, and the env dir does not)
    # leaves what this one wrote alone.
    again = harness("run", str(cfg), f"env.dir={tmp_path / 'gone'}", "output.run_id=badgrades", "--no-progress")
    assert_one_line_error(again, "", 2)
    assert load_episodes(run_dir).num_rows == len(POLICIES)


@pytest.mark.parametrize("args,needle", [
    (["new", "--ttl", "nan"], "--ttl"),
    (["new", "--ttl", "inf"], "--ttl"),
    (["new", "--ttl", "-5"], "--ttl"),
    (["exec", "sb_0000000000", "--timeout", "-1", "true"], "--timeout"),
    (["exec", "sb_0000000000", "--timeout", "nan", "true"], "--timeout"),
    (["exec", "sb_0000000000", "--timeout", "0", "true"], "--timeout"),
    (["new", "--from", "", "--ttl", "60"], "--from needs a snapshot name"),
    (["new", "--from", "nosuch", "--ttl", "60"], "no snapshot named 'nosuch'"),
    (["exec", "sb_0000000000", "true"], "sb_0000000000"),
    (["snapshot", "sb_0000000000", "../up"], ""),
], ids=["ttl-nan", "ttl-inf", "ttl-negative", "timeout-negative", "timeout-nan", "timeout-zero", "from-empty",
        "from-unknown", "exec-unknown-id", "snapshot-bad-name"])
def test_sandbox_verbs_refuse_bad_numbers_and_names_in_one_line(args: list[str], needle: str, sandboxes) -> None:
    """(Unknown ids and snapshots are in test_cli.py too; here with the odd numbers next to them.)"""
    proc = harness("sandbox", *args, env={"HARNESS_HOME": str(state_dir())})
    assert_one_line_error(proc, needle)
    assert proc.stdout == ""

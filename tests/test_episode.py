"""Episodes and the worker: one result per episode whatever happens, sandbox always released."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness_fixtures import FakeProvider, local_provider, make_tiny_env, median_env, needs_sandbox

from harness.actors import EpisodeWorker
from harness.env import EnvSpec, GradeSpec, build_env
from harness.episode import EpisodeRequest, run_episode
from harness.errors import SandboxStartError


@pytest.fixture
def tiny(tmp_path: Path):
    provider = FakeProvider(tmp_path / "state")
    spec = EnvSpec.from_dict({"dir": str(make_tiny_env(tmp_path / "src")), "grade": {"command": "sh grade.sh"}})
    built = build_env(provider, spec)
    return provider, built


def request(policy: dict, method: str = "new_from", **kw) -> EpisodeRequest:
    return EpisodeRequest(run_id="t", episode_id=kw.pop("episode_id", 0), method=method, policy=policy, **kw)


@pytest.mark.parametrize("method", ["new_from", "fork"])
def test_success_records_steps_reward_and_timings(tiny, method: str) -> None:
    provider, built = tiny
    worker = EpisodeWorker(built.snapshot, built.spec.grade, provider=provider, name="w")
    r = worker.run(request({"kind": "script", "commands": ["echo 42 > answer.txt", "cat answer.txt"]}, method))
    assert r.ok and r.reward == 1.0 and r.grade == {"reward": 1.0, "note": "tiny"}
    assert r.clean_start and r.terminated and not r.truncated
    assert [s.action for s in r.steps] == ["echo 42 > answer.txt", "cat answer.txt"]
    assert r.steps[1].new_obs.stdout == "42\n" and r.steps[1].obs.command == "echo 42 > answer.txt"
    assert r.total_seconds >= r.acquire_seconds + r.act_seconds + r.grade_seconds
    assert r.actor == "w" and r.sandbox_id
    live = {i.id for i in provider.list()}
    assert r.sandbox_id not in live
    # fork keeps exactly one warm source; new_from none
    assert len(live) == (1 if method == "fork" else 0)
    worker.close()
    assert provider.list() == []


def test_policy_exception_is_recorded_and_sandbox_released(tiny, tmp_path: Path) -> None:
    provider, built = tiny
    (tmp_path / "badpol.py").write_text("def act(obs):\n    raise RuntimeError('boom')\n")
    r = EpisodeWorker(built.snapshot, built.spec.grade, provider=provider).run(
        request({"kind": "python", "entrypoint": "badpol:act", "python_path": [str(tmp_path)]}))
    assert r.error_type == "PolicyError" and r.error_phase == "act" and "RuntimeError: boom" in r.error
    assert r.reward is None and provider.list() == [] and not r.infra_error


def test_policy_load_failure_is_recorded(tiny) -> None:
    provider, built = tiny
    r = EpisodeWorker(built.snapshot, built.spec.grade, provider=provider).run(
        request({"kind": "python", "entrypoint": "no_such_module_xyz:f"}))
    assert r.error_type == "PolicyError" and "no_such_module_xyz" in r.error and provider.list() == []


def test_grade_without_result_is_recorded(tiny) -> None:
    provider, built = tiny
    # The policy breaks the grader: it now exits 3 without writing a result.
    r = EpisodeWorker(built.snapshot, built.spec.grade, provider=provider).run(
        request({"kind": "command", "command": "echo 'echo broken >&2; exit 3' > grade.sh"}))
    assert r.error_type == "GradeError" and r.error_phase == "grade"
    assert "exited 3" in r.error and "broken" in r.error and len(r.steps) == 1
    assert provider.list() == []


def test_dirty_start_is_recorded(tiny) -> None:
    provider, built = tiny
    worker = EpisodeWorker(built.snapshot, built.spec.grade, provider=provider)
    source = worker._source(request({}, "fork"))
    source.exec("echo '{}' > ~/result.json")  # a stale result in the fork source
    r = worker.run(request({"kind": "command", "command": "true"}, "fork"))
    assert r.error_type == "CleanStartError" and r.clean_start is False and r.steps == ()
    worker.close()


def test_max_steps_truncates(tiny) -> None:
    provider, built = tiny
    r = EpisodeWorker(built.snapshot, built.spec.grade, provider=provider).run(
        request({"kind": "script", "commands": ["true"] * 5}, max_steps=2))
    assert r.ok and r.truncated and not r.terminated and len(r.steps) == 2 and r.reward == 0.25


def test_step_timeout_and_output_cap(tiny) -> None:
    provider, built = tiny
    r = EpisodeWorker(built.snapshot, built.spec.grade, provider=provider).run(
        request({"kind": "script", "commands": ["sleep 5", "yes | head -c 5000"]}, step_timeout=0.5,
                max_output_bytes=100))
    assert r.ok and r.steps[0].timed_out and r.steps[0].exit_code == 124
    assert r.steps[1].truncated and len(r.steps[1].new_obs.stdout) == 100


def test_acquire_failure_is_recorded() -> None:
    def acquire(req):
        raise SandboxStartError("no room")

    r = run_episode(request({"kind": "command", "command": "true"}), acquire, GradeSpec("true"))
    assert r.error_type == "SandboxStartError" and r.error_phase == "acquire" and r.sandbox_id is None
    assert r.infra_error


def test_fork_source_is_replaced_when_it_disappears(tiny) -> None:
    provider, built = tiny
    worker = EpisodeWorker(built.snapshot, built.spec.grade, provider=provider)
    assert worker.run(request({"kind": "command", "command": "true"}, "fork")).ok
    worker.source.delete()  # e.g. expired
    r = worker.run(request({"kind": "command", "command": "echo 42 > answer.txt"}, "fork"))
    assert r.ok and r.reward == 1.0
    worker.close()
    assert provider.list() == []


@needs_sandbox
@pytest.mark.parametrize("method", ["new_from", "fork"])
def test_median_episodes_in_real_sandboxes(method: str) -> None:
    built = median_env()
    with local_provider() as provider:
        worker = EpisodeWorker(built.snapshot, built.spec.grade, provider=provider, name="real")
        rewards = {}
        for pid in (0, 1, 2):
            r = worker.run(request({"kind": "command", "command": f"cp policies/{pid}.py task/stats.py"}, method,
                                   episode_id=pid))
            assert r.ok, r.error
            assert r.clean_start and r.grade["passed"] + r.grade["failed"] == 4
            rewards[pid] = r.reward
        # each episode is independent: policy 0's edit did not leak into later episodes
        before = worker.run(request({"kind": "command", "command": "true"}, method, episode_id=9))
        worker.close()
        leftovers = [i for i in provider.list() if i.name and i.name.startswith("t-ep")]
    assert rewards == {0: 0.75, 1: 1.0, 2: 1.0}
    assert before.reward == 0.5
    assert leftovers == []


def test_a_result_written_by_the_policy_does_not_count(tiny) -> None:
    provider, built = tiny
    forged = "echo '{\"reward\": 1.0}' > ~/result.json; echo 'exit 3' > grade.sh"
    r = EpisodeWorker(built.snapshot, built.spec.grade, provider=provider).run(
        request({"kind": "command", "command": forged}))
    assert r.error_type == "GradeError" and r.reward is None


def test_a_grader_that_times_out_gives_no_reward_even_with_a_result(tmp_path: Path) -> None:
    provider = FakeProvider(tmp_path / "state")
    env = make_tiny_env(tmp_path / "src", grade_body='echo \'{"reward": 1}\' > "$HOME/result.json"\n'
                                                       '[ -e slow ] && sleep 5\nexit 0\n')
    built = build_env(provider, EnvSpec.from_dict({"dir": str(env), "grade": {"command": "sh grade.sh",
                                                                             "timeout": 0.5}}))
    r = EpisodeWorker(built.snapshot, built.spec.grade, provider=provider).run(
        request({"kind": "command", "command": "touch slow"}))
    assert r.error_type == "GradeError" and "timed out" in r.error and r.reward is None
    assert not r.infra_error


def test_a_sandbox_that_dies_mid_episode_is_an_infrastructure_error(tiny) -> None:
    provider, built = tiny
    worker = EpisodeWorker(built.snapshot, built.spec.grade, provider=provider)

    class Vanish:
        def act(self, obs):
            worker.current.delete()  # as if the sandbox expired or its backend failed
            return "true"

    r = run_episode(request({}), worker._acquire, built.spec.grade, make=lambda cfg: Vanish())
    assert r.error_type == "SandboxNotFound" and r.error_phase == "act" and r.infra_error


@pytest.mark.parametrize("policy", ["command", "done at once"])
def test_a_dirty_start_stops_before_the_policy_acts(tiny, tmp_path: Path, policy: str) -> None:
    provider, built = tiny
    worker = EpisodeWorker(built.snapshot, built.spec.grade, provider=provider)
    worker._source(request({}, "fork")).exec("echo '{}' > ~/result.json")
    ran = tmp_path / "ran"  # the fake runs commands on the host: this shows whether the policy's ran
    cfg = {"kind": "command", "command": f"touch {ran}"} if policy == "command" else {"kind": "script",
                                                                                          "commands": ["done"]}
    r = worker.run(request(cfg, "fork"))
    worker.close()
    assert r.error_type == "CleanStartError" and r.error_phase == "check" and r.clean_start is False
    assert not ran.exists() and r.steps == () and r.reward is None


def test_a_clean_start_is_recorded_with_either_path(tiny) -> None:
    provider, built = tiny
    worker = EpisodeWorker(built.snapshot, built.spec.grade, provider=provider)
    acted = worker.run(request({"kind": "command", "command": "echo 42 > answer.txt"}))
    idle = worker.run(request({"kind": "script", "commands": ["done"]}))
    assert acted.clean_start is True and acted.reward == 1.0 and acted.check_seconds == 0.0
    assert idle.clean_start is True and idle.reward == 0.25 and idle.check_seconds > 0
    assert acted.steps[0].new_obs.stderr == "" and acted.steps[0].action == "echo 42 > answer.txt"

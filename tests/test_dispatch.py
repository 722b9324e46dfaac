"""The dispatcher's retry logic on a real local Ray, with stand-in actors (no sandboxes):
every request ends as exactly one result; infrastructure failures are retried with
backoff, on another actor where there is one, up to the cap; others never are."""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import pytest
from harness_fixtures import ray_local  # noqa: F401  (module-scoped fixture)

from harness.dispatch import Dispatcher, RetryPolicy
from harness.episode import EpisodeRequest, EpisodeResult, failed_result
from harness.errors import InfrastructureDown


class StandIn:
    """Fails the way ``plan`` says: {episode_id: [phase of attempt 0, attempt 1, ...]}, where a
    phase is "ok", an infrastructure phase ("acquire") or a policy one ("act"); "die" kills
    the actor process."""

    def __init__(self, name: str, plan: dict[int, list[str]], log: str):
        self.name, self.plan, self.log = name, plan, log

    def run(self, req: EpisodeRequest) -> EpisodeResult:
        import os

        phases = self.plan.get(req.episode_id, ["ok"])
        phase = phases[min(req.attempt, len(phases) - 1)]
        with open(self.log, "a") as f:
            f.write(f"{req.episode_id} {req.attempt} {self.name}\n")
        time.sleep(0.05)
        if phase == "die":
            os._exit(1)
        if phase == "ok":
            return dataclasses.replace(failed_result(req, "", "", "", actor=self.name), error_type=None, error=None,
                                       error_phase=None, reward=1.0, infra_error=False)
        return failed_result(req, "SandboxStartError" if phase == "acquire" else "PolicyError", "boom", phase,
                             actor=self.name)


def dispatch(ray, plan: dict[int, list[str]], n: int, actors: int, retry: RetryPolicy, log: Path | None = None):
    # Ray's workers cannot import this test module: ship the class by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    Actor = ray.remote(num_cpus=0)(StandIn)
    made = []
    log = log or Path(tempfile.mkdtemp()) / "attempts"

    def new_actor(slot: int):
        made.append(slot)
        return Actor.remote(f"a{slot}-{len(made)}", plan, str(log))

    results: list[EpisodeResult] = []
    reaped: list[set[str]] = []
    d = Dispatcher([new_actor(i) for i in range(actors)], new_actor, results.append, reaped.append, retry)
    t0 = time.monotonic()
    d.run([EpisodeRequest(run_id="r", episode_id=i) for i in range(n)])
    for a in d.actors:
        ray.kill(a)
    return results, d, time.monotonic() - t0, reaped


def test_each_request_ends_as_one_result_and_retries_use_another_actor(ray_local) -> None:  # noqa: F811
    plan = {1: ["acquire", "ok"], 3: ["acquire", "acquire", "ok"], 5: ["act"]}
    results, d, _, _ = dispatch(ray_local, plan, 8, 2, RetryPolicy(retries=3, backoff_s=0.05))
    assert sorted(r.request.episode_id for r in results) == list(range(8))
    by_id = {r.request.episode_id: r for r in results}
    assert by_id[1].ok and by_id[1].request.attempt == 1
    assert by_id[3].ok and by_id[3].request.attempt == 2
    assert by_id[5].error_type == "PolicyError" and by_id[5].request.attempt == 0  # never retried
    assert d.retries_done == 3


def test_a_retry_goes_to_a_different_actor(ray_local, tmp_path: Path) -> None:  # noqa: F811
    plan = {i: ["acquire", "ok"] for i in range(6)}
    results, _, _, _ = dispatch(ray_local, plan, 6, 2, RetryPolicy(retries=1, backoff_s=0.01), tmp_path / "log")
    assert len(results) == 6 and all(r.ok and r.request.attempt == 1 for r in results)
    actors: dict[int, list[str]] = {}
    for line in (tmp_path / "log").read_text().splitlines():
        episode, _, actor = line.split()
        actors.setdefault(int(episode), []).append(actor)
    assert all(len(a) == 2 and a[0] != a[1] for a in actors.values()), actors


def test_a_lone_actor_takes_its_own_retries(ray_local) -> None:  # noqa: F811
    results, _, _, _ = dispatch(ray_local, {0: ["acquire", "ok"]}, 2, 1, RetryPolicy(retries=1, backoff_s=0.01))
    assert sorted((r.request.episode_id, r.request.attempt, r.ok) for r in results) == [(0, 1, True), (1, 0, True)]


def test_retries_stop_at_the_cap_and_the_last_failure_is_the_row(ray_local) -> None:  # noqa: F811
    plan = {0: ["acquire"] * 10}
    results, d, _, _ = dispatch(ray_local, plan, 3, 2, RetryPolicy(retries=2, backoff_s=0.01))
    failed = [r for r in results if not r.ok]
    assert len(results) == 3 and len(failed) == 1
    assert failed[0].request.attempt == 2 and failed[0].infra_error and failed[0].error_phase == "acquire"


def test_backoff_holds_new_starts_while_failures_repeat(ray_local) -> None:  # noqa: F811
    """Everything failing (a server that is down): the run slows to the backoff instead of
    burning through the queue; 6 episodes x 3 attempts each take several backoff periods."""
    plan = {i: ["acquire"] * 5 for i in range(6)}
    results, d, elapsed, _ = dispatch(ray_local, plan, 6, 2, RetryPolicy(retries=2, backoff_s=0.2, max_backoff_s=0.4))
    assert len(results) == 6 and all(not r.ok and r.request.attempt == 2 for r in results)
    # 18 attempts; after the first failures every start waits >= 0.1-0.2 s (jitter 0.5-1.0 of 0.2-0.4 s)
    assert elapsed > 1.5, elapsed


def test_a_dead_actor_is_replaced_and_its_episode_retried(ray_local) -> None:  # noqa: F811
    plan = {2: ["die", "ok"]}
    results, d, _, reaped = dispatch(ray_local, plan, 5, 2, RetryPolicy(retries=1, backoff_s=0.01))
    assert sorted(r.request.episode_id for r in results) == list(range(5))
    assert all(r.ok for r in results)
    assert {r.request.episode_id: r.request.attempt for r in results}[2] == 1
    assert d.actors_replaced == 1 and reaped == [{"r-ep2", f"r-a{_slot_of(reaped)}-source"}]


def _slot_of(reaped: list[set[str]]) -> str:
    return next(n for n in reaped[0] if n.endswith("-source")).split("-a", 1)[1].split("-", 1)[0]


def test_without_retries_a_dead_actor_is_one_error_row(ray_local) -> None:  # noqa: F811
    results, d, _, _ = dispatch(ray_local, {0: ["die"]}, 3, 1, RetryPolicy(retries=0))
    assert len(results) == 3
    dead = [r for r in results if not r.ok]
    assert len(dead) == 1 and dead[0].error_phase == "actor" and dead[0].infra_error


@pytest.mark.parametrize("failures,low,high", [(0, 0.0, 0.0), (1, 0.5, 1.0), (3, 2.0, 4.0), (20, 15.0, 30.0)])
def test_backoff_doubles_with_jitter_and_a_cap(failures: int, low: float, high: float) -> None:
    policy = RetryPolicy(retries=3, backoff_s=1.0, max_backoff_s=30.0)
    delays = [policy.delay(failures) for _ in range(200)]
    assert all(low <= d <= high for d in delays)
    if failures:
        assert max(delays) - min(delays) > (high - low) * 0.3  # jittered, not all equal


def test_an_infrastructure_that_stays_down_stops_the_run(ray_local) -> None:  # noqa: F811
    """No success at all, failure after failure: stop (resumable) instead of crawling on."""
    plan = {i: ["acquire"] * 10 for i in range(50)}
    with pytest.raises(InfrastructureDown, match="5 infrastructure failures in a row"):
        dispatch(ray_local, plan, 50, 2, RetryPolicy(retries=3, backoff_s=0.01, give_up_after=5))


def test_policy_failures_end_a_streak_of_infrastructure_failures(ray_local) -> None:  # noqa: F811
    plan = {i: ["acquire", "act"] for i in range(30)}  # every episode: one infra failure, then a policy error
    # 30 infrastructure failures in all, but never 10 in a row: the retries' policy errors break the streaks
    results, _, _, _ = dispatch(ray_local, plan, 30, 2, RetryPolicy(retries=3, backoff_s=0.01, give_up_after=10))
    assert len(results) == 30 and {r.error_type for r in results} == {"PolicyError"}


def test_secrets_are_redacted_but_names_of_variables_are_kept() -> None:
    from harness.rundir import REDACTED, redact

    data = {"sandbox": {"options": {"token": "s3cret", "url": "http://h"}},
            "policy": {"api_key_env": "OPENAI_API_KEY", "auth_token": "t", "tokens": 5}, "x": [{"password": "p"}]}
    assert redact(data) == {"sandbox": {"options": {"token": REDACTED, "url": "http://h"}},
                            "policy": {"api_key_env": "OPENAI_API_KEY", "auth_token": REDACTED, "tokens": 5},
                            "x": [{"password": REDACTED}]}

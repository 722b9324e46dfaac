"""One episode: acquire a sandbox, check it starts clean, act, grade, release.

An episode never raises: whatever goes wrong is recorded in its result (error
type, message and the phase it happened in), so one bad rollout cannot kill a
run and every episode yields exactly one dataset row. The sandbox is deleted in
``finally`` on every path.
"""

from __future__ import annotations

import secrets
import shlex
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from harness.env import ENV_DIR, GradeSpec, parse_grade
from harness.errors import CleanStartError, GradeError, PolicyError
from harness.failures import INFRA_PHASES, is_infrastructure
from harness.policy import Observation, is_done, make_policy
from harness.sandbox.base import Sandbox, SandboxSpec

METHODS = ("new_from", "fork")
#: Exit status of the clean-start check's prefix when the grader's result already exists.
UNCLEAN_EXIT = 97


@dataclass(frozen=True)
class EpisodeRequest:
    """Everything an actor needs to run one episode (picklable, crosses Ray)."""

    run_id: str
    episode_id: int
    method: str = "new_from"
    policy: Mapping[str, Any] = field(default_factory=dict)
    point_id: int = 0
    point: Mapping[str, Any] = field(default_factory=dict)
    max_steps: int = 20
    step_timeout: float = 300.0
    max_output_bytes: int = 64 << 10
    sandbox_type: str = "small"
    ttl_s: float | None = 900.0
    network: bool = False
    config_hash: str = ""
    #: 0 for the first try; >0 when the driver retries after an infrastructure failure.
    attempt: int = 0

    @property
    def eps_id(self) -> str:
        return f"{self.run_id}-{self.episode_id:06d}"

    def spec(self) -> SandboxSpec:
        return SandboxSpec(name=f"{self.run_id}-ep{self.episode_id}", type=self.sandbox_type,  # type: ignore[arg-type]
                           ttl_s=self.ttl_s, network=self.network)


@dataclass(frozen=True)
class StepRecord:
    """One policy step: what the policy saw, what it ran, what came of it."""

    t: int
    obs: Observation
    action: str
    new_obs: Observation
    exit_code: int
    timed_out: bool
    truncated: bool
    exec_seconds: float
    policy_seconds: float


@dataclass(frozen=True)
class EpisodeResult:
    """One episode's outcome: exactly one dataset row (plus its steps)."""

    request: EpisodeRequest
    sandbox_id: str | None
    reward: float | None
    grade: Mapping[str, Any] | None
    steps: tuple[StepRecord, ...]
    terminated: bool  # the policy said done
    truncated: bool  # stopped by max_steps
    clean_start: bool | None
    acquire_seconds: float
    check_seconds: float
    act_seconds: float
    grade_seconds: float
    release_seconds: float
    total_seconds: float
    started_at: float
    finished_at: float
    error_type: str | None = None
    error: str | None = None
    error_phase: str | None = None
    actor: str = ""
    host: str = ""
    #: The sandbox as `harness sandbox info` shows it, taken just before release.
    sandbox_info: Mapping[str, Any] | None = None
    #: The failure was the infrastructure's (sandbox layer, actor), not the policy's or grader's.
    infra_error: bool = False

    @property
    def ok(self) -> bool:
        return self.error_type is None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:1000]


def _decode(data: bytes, limit: int) -> str:
    return data[:limit].decode("utf-8", errors="replace")


def run_episode(
    request: EpisodeRequest,
    acquire: Callable[[EpisodeRequest], Sandbox],
    grade: GradeSpec,
    *,
    actor: str = "",
    make: Callable[[Mapping[str, Any]], Any] = make_policy,
) -> EpisodeResult:
    """Run one episode end to end; failures become fields of the result."""
    started = time.time()
    t_start = time.monotonic()
    timings = {"acquire": 0.0, "check": 0.0, "act": 0.0, "grade": 0.0, "release": 0.0}
    steps: list[StepRecord] = []
    sandbox: Sandbox | None = None
    sandbox_id = reward = grade_data = clean = info = None
    terminated = truncated = infra = False
    error: tuple[str, str, str] | None = None
    phase = "acquire"
    policy = None
    try:
        t0 = time.monotonic()
        try:
            sandbox = acquire(request)
            sandbox_id = sandbox.id
        finally:
            timings["acquire"] = time.monotonic() - t0

        phase, t0 = "act", time.monotonic()
        # The clean-start check rides along with the first command (one process start
        # less per episode): a prefix that exits with a marker if the result file exists.
        marker = f"harness-unclean-start-{secrets.token_hex(4)}"
        check = f"test ! -e {shlex.quote(grade.result)} || {{ echo {marker} >&2; exit {UNCLEAN_EXIT}; }}\n"
        try:
            policy = make(request.policy)
            obs = Observation(t=0, prompt=str(request.policy.get("prompt") or ""))
            for t in range(request.max_steps + 1):
                p0 = time.monotonic()
                try:
                    action = policy.act(obs)
                except PolicyError:
                    raise
                except Exception as exc:  # a user's policy: report it as the policy's failure
                    raise PolicyError(f"policy failed at step {t}: {type(exc).__name__}: {_one_line(exc)}") from exc
                policy_s = time.monotonic() - p0
                if is_done(action):
                    terminated = True
                    break
                if t == request.max_steps:
                    truncated = True
                    break
                r = sandbox.exec(("" if clean else check) + str(action), cwd=ENV_DIR, timeout=request.step_timeout,
                                 max_output_bytes=request.max_output_bytes)
                if not clean:
                    clean = not (r.exit_code == UNCLEAN_EXIT and marker.encode() in r.stderr)
                    if not clean:
                        phase = "check"
                        raise CleanStartError(f"sandbox {sandbox_id} did not start clean: {grade.result} exists")
                new_obs = Observation(
                    t=t + 1, prompt=obs.prompt, command=str(action), exit_code=r.exit_code,
                    stdout=_decode(r.stdout, request.max_output_bytes),
                    stderr=_decode(r.stderr, request.max_output_bytes), timed_out=r.timed_out,
                )
                steps.append(StepRecord(t, obs, str(action), new_obs, r.exit_code, r.timed_out, r.truncated,
                                        r.duration_s, policy_s))
                obs = new_obs
        finally:
            timings["act"] = time.monotonic() - t0
            if policy is not None and hasattr(policy, "close"):
                policy.close()
        if not clean:  # the policy ran no command: check on its own
            phase, t0 = "check", time.monotonic()
            res = sandbox.exec(check + "true", timeout=60)
            timings["check"] = time.monotonic() - t0
            clean = res.exit_code == 0
            if not clean:
                raise CleanStartError(f"sandbox {sandbox_id} did not start clean: {grade.result} exists")

        phase, t0 = "grade", time.monotonic()
        try:
            # One exec: remove any result the policy may have written (only the grader's
            # counts), grade with the grader's stdout sent to stderr, then print the result.
            result = shlex.quote(grade.result)
            g = sandbox.exec(f"! test -e {result} || rm -f {result}; ( {grade.command}\n) 1>&2; rc=$?; "
                             f"test -f {result} && cat {result}; exit $rc", cwd=ENV_DIR, timeout=grade.timeout)
            tail = " | ".join(g.text("stderr").strip().splitlines()[-2:]) or "no output"
            if g.timed_out:  # whatever it wrote before, a grader cut short is no grade
                raise GradeError(f"grade command timed out after {grade.timeout:g}s: {tail}")
            try:
                grade_data = parse_grade(g.stdout, grade)
            except GradeError as exc:
                if g.ok:
                    raise
                raise GradeError(f"grade command exited {g.exit_code} without a result: {tail}") from exc
            reward = float(grade_data["reward"])
        finally:
            timings["grade"] = time.monotonic() - t0
    except Exception as exc:  # recorded, never raised: one row per episode
        error = (type(exc).__name__, _one_line(exc), phase)
        infra = is_infrastructure(exc, phase)  # see harness.failures
    finally:
        if sandbox is not None:
            try:
                info = sandbox.info().to_json()
            except Exception:  # informational only; the release below matters
                pass
            t0 = time.monotonic()
            try:
                sandbox.delete()
            except Exception as exc:
                if error is None:
                    error, infra = (type(exc).__name__, _one_line(exc), "release"), True
            timings["release"] = time.monotonic() - t0
    if error is not None:
        reward = None
    return EpisodeResult(
        request=request, sandbox_id=sandbox_id, reward=reward, grade=grade_data, steps=tuple(steps),
        terminated=terminated, truncated=truncated, clean_start=clean,
        acquire_seconds=timings["acquire"], check_seconds=timings["check"], act_seconds=timings["act"],
        grade_seconds=timings["grade"], release_seconds=timings["release"],
        total_seconds=time.monotonic() - t_start, started_at=started, finished_at=time.time(),
        error_type=error[0] if error else None, error=error[1] if error else None,
        error_phase=error[2] if error else None, actor=actor, host=socket.gethostname(), sandbox_info=info,
        infra_error=infra,
    )


def failed_result(request: EpisodeRequest, error_type: str, error: str, phase: str, *, actor: str = "") -> EpisodeResult:
    """The row of an episode that never ran to its own end (e.g. its actor died)."""
    now = time.time()
    return EpisodeResult(
        request=request, sandbox_id=None, reward=None, grade=None, steps=(), terminated=False, truncated=False,
        clean_start=None, acquire_seconds=0.0, check_seconds=0.0, act_seconds=0.0, grade_seconds=0.0,
        release_seconds=0.0, total_seconds=0.0, started_at=now, finished_at=now, error_type=error_type,
        error=" ".join(error.split())[:1000], error_phase=phase, actor=actor, host=socket.gethostname(),
        infra_error=phase in INFRA_PHASES,
    )

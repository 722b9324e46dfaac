"""The failure classes of an episode: which are retried, and what their row holds.

Infrastructure failures (the sandbox layer, an actor or its node) say nothing
about the policy, so the driver runs the episode again, with backoff and on
another actor where it can, up to ``retries`` times. Policy and grader failures
are results in their own right and are never retried. Either way an episode
ends as exactly one row; a failed one has ``reward`` null, ``error_type``,
``error`` (one line) and ``error_phase`` set, and ``infra_error`` saying which
class it was.

``FAILURE_CLASSES`` is the table the README shows (``markdown_table``).
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.errors import ConfigError, SandboxAuthError, SandboxError

#: Phases whose failures are the infrastructure's, whatever the exception.
INFRA_PHASES = ("acquire", "actor")


@dataclass(frozen=True)
class FailureClass:
    """One row of the failure table."""

    what: str
    phase: str  # the row's error_phase
    error_types: str  # typical error_type values
    retried: bool


FAILURE_CLASSES: tuple[FailureClass, ...] = (
    FailureClass("sandbox could not start (create, fork, pull of the snapshot)", "acquire",
                 "SandboxStartError, SandboxUnavailable, SnapshotNotFound", True),
    FailureClass("sandbox server unreachable or restarting", "acquire / act / grade",
                 "SandboxUnavailable", True),
    FailureClass("sandbox died or vanished mid-episode (killed from outside, expired)", "act / grade",
                 "SandboxNotFound, SandboxError", True),
    FailureClass("sandbox could not be deleted after a successful episode", "release", "SandboxError", True),
    FailureClass("actor process or its node died", "actor", "ActorDiedError, ActorUnavailableError", True),
    FailureClass("sandbox server refused the token", "acquire", "SandboxAuthError", False),
    FailureClass("policy could not be loaded or raised", "act", "PolicyError", False),
    FailureClass("policy's model server failed or timed out (kind openai)", "act", "PolicyError", False),
    FailureClass("sandbox did not start clean (a stale result file)", "check", "CleanStartError", False),
    FailureClass("grader crashed: exited non-zero without a result", "grade", "GradeError", False),
    FailureClass("grader timed out (grade.timeout)", "grade", "GradeError", False),
    FailureClass("grader wrote no result, or not JSON, or no finite numeric reward", "grade", "GradeError", False),
)

#: What is not a failure: a policy command that exits non-zero or hits
#: ``policy.step_timeout`` is an observation (exit code 124, ``timed_out``), and the
#: episode goes on; reaching ``policy.max_steps`` truncates it and it is graded.
NOT_FAILURES = (
    "a policy command that exits non-zero or hits policy.step_timeout: recorded in the step "
    "(exit_code, infos.timed_out); the episode goes on",
    "reaching policy.max_steps: truncated = true; the episode is graded as usual",
)


def is_infrastructure(exc: BaseException, phase: str) -> bool:
    """True when a failure is the infrastructure's and worth a retry. A refused token
    or a bad setting fails the same way every time: not retried."""
    if isinstance(exc, (SandboxAuthError, ConfigError)):
        return False
    return isinstance(exc, SandboxError) or phase in INFRA_PHASES


def markdown_table() -> str:
    """The failure table as Markdown, for the README."""
    lines = ["| failure | error_phase | error_type | retried | reward |", "|---|---|---|---|---|"]
    for c in FAILURE_CLASSES:
        retried = "yes, up to `retries` times, with backoff" if c.retried else "no"
        lines.append(f"| {c.what} | {c.phase} | {c.error_types} | {retried} | null |")
    return "\n".join(lines)

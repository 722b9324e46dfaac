"""One exception hierarchy for the whole project.

    HarnessError
    ├── ConfigError (ValueError)            a config key, value or file is wrong
    ├── SandboxError                        anything the sandbox layer reports
    │   ├── SandboxUnavailable (RuntimeError)   the backend cannot run here
    │   │   └── MissingDependency               a system package is missing
    │   ├── SandboxNotFound (LookupError)       unknown, deleted or expired sandbox
    │   ├── SnapshotNotFound (LookupError)      unknown snapshot name or id
    │   ├── SnapshotExists (FileExistsError)    a snapshot name is taken
    │   ├── SandboxStartError (RuntimeError)    a sandbox could not be started
    │   ├── SandboxTimeout (TimeoutError)       a sandbox operation took too long
    │   ├── SandboxAuthError (PermissionError)  a sandbox server refused the token
    │   └── SandboxFileError (OSError)          a file call failed inside the sandbox
    ├── EnvironmentBuildError                   an environment's setup failed
    ├── DatasetWriteError (OSError)             a run's rows could not be written (disk full, ...)
    └── InfrastructureDown                      infrastructure failures kept coming: the run stopped

Leaves also inherit the matching builtin so callers may catch either. Every
message is one line that says what is wrong and what to do about it.
"""

from __future__ import annotations


class HarnessError(Exception):
    """Base of every error the harness raises on purpose."""


class ConfigError(HarnessError, ValueError):
    """A configuration key, value or file is invalid."""


class SandboxError(HarnessError):
    """An error reported by the sandbox layer."""


class SandboxUnavailable(SandboxError, RuntimeError):
    """The sandbox backend cannot run on this machine as it is."""


class MissingDependency(SandboxUnavailable):
    """A system package the backend needs is not installed."""

    def __init__(self, what: str, install: str):
        super().__init__(f"{what} is not installed; install it with: {install}")
        self.install = install


class SandboxNotFound(SandboxError, LookupError):
    """No live sandbox has this id (never existed, deleted, or expired)."""


class SnapshotNotFound(SandboxError, LookupError):
    """No snapshot has this name or id."""


class SnapshotExists(SandboxError, FileExistsError):
    """A snapshot with this name already exists."""


class SandboxStartError(SandboxError, RuntimeError):
    """A sandbox could not be started."""


class SandboxTimeout(SandboxError, TimeoutError):
    """A sandbox operation (not a command: see ExecResult.timed_out) took too long."""


class SandboxAuthError(SandboxError, PermissionError):
    """A sandbox server refused the request: no token, or a wrong one."""


class SandboxFileError(SandboxError, OSError):
    """Reading or writing a file inside a sandbox failed."""


class EnvironmentBuildError(HarnessError):
    """Building an environment (upload, setup, baseline grade, snapshot) failed."""


# --- Episodes (appended for the RL harness: harness/episode.py, harness/policy.py) ---


class EpisodeError(HarnessError):
    """An episode failed; recorded in its dataset row rather than raised to the run."""


class CleanStartError(EpisodeError):
    """An episode's sandbox did not start clean (a stale grader result was present)."""


class PolicyError(EpisodeError):
    """A policy could not be loaded or failed to choose an action."""


class GradeError(EpisodeError):
    """The grader failed or wrote no readable result with a numeric reward."""


class InfrastructureDown(HarnessError):
    """Infrastructure failures kept coming with no success between them: the run stopped
    (resumable) instead of crawling through its backoff or burning every episode."""


class DatasetWriteError(HarnessError, OSError):
    """A run's rows could not be written to its run directory; the rows already
    reported done are safe, and the run is resumable once the cause is fixed."""

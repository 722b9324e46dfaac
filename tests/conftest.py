"""Shared fixtures: a private state directory, a sandbox provider per backend,
and a leak check after every test that used sandboxes."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from harness.sandbox import open_provider
from harness.sandbox._jail import HOLDER_CHECK_S
from sandbox.server_fixture import http_provider, sandbox_server  # noqa: F401  (a real `harness serve`)

BACKENDS = ["local", "http"]


def pytest_configure(config):
    if os.geteuid() != 0:
        raise pytest.UsageError("the test suite needs root (the local sandbox backend mounts and uses cgroups)")


@pytest.fixture(scope="session")
def state_dir():
    """One state directory for the whole session, outside the user's own."""
    path = Path(tempfile.mkdtemp(prefix="harness-test-"))
    old = os.environ.get("HARNESS_HOME")
    os.environ["HARNESS_HOME"] = str(path)
    yield path
    if old is None:
        os.environ.pop("HARNESS_HOME", None)
    else:
        os.environ["HARNESS_HOME"] = old
    open_provider("local", state_dir=path).shutdown()
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def local_provider(state_dir):
    return open_provider("local", state_dir=state_dir)


@pytest.fixture(params=BACKENDS)
def provider(request, local_provider):
    """The provider of each backend; every backend must pass the same tests."""
    if request.param == "local":
        yield local_provider
    elif request.param == "http":
        yield request.getfixturevalue("http_provider")
    else:  # pragma: no cover - backends join here as they are written
        raise AssertionError(request.param)


def live_leftovers(provider) -> list[str]:
    return [i.id for i in provider.list()]


def orphan_jail_processes(state: Path, wait_s: float = HOLDER_CHECK_S + 2) -> dict[int, str]:
    """Processes of sandboxes (their jail, holder, slirp4netns: found by the sandbox's path in
    their command line) whose sandbox record is gone: what a delete or a crash left running.
    Deletes kill them at once; the jail's own holder ends it within HOLDER_CHECK_S anyway."""
    pattern = re.compile(rf"{re.escape(str(state))}/sandboxes/(sb_[a-z0-9]+)")
    deadline = time.monotonic() + wait_s
    while True:
        orphans = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            m = pattern.search(cmdline)
            if m and not (state / "sandboxes" / m.group(1)).exists():
                orphans[int(entry.name)] = m.group(1)
        if not orphans or time.monotonic() > deadline:
            return orphans
        time.sleep(0.1)


def assert_nothing_left_on_host(state: Path) -> None:
    """No mount under the state dir's sandboxes, no process of a deleted sandbox."""
    mounts = [line for line in Path("/proc/self/mountinfo").read_text().splitlines()
              if f"{state}/sandboxes" in line]
    assert not mounts, f"a sandbox mount was left on the host: {mounts[:2]}"
    orphans = orphan_jail_processes(state)
    assert not orphans, f"processes of deleted sandboxes are still running: {orphans}"


@pytest.fixture(autouse=True)
def no_leaked_sandboxes(request):
    """Fail a test that leaves sandboxes, jailed processes, mounts or cgroups behind."""
    if "local_provider" not in request.fixturenames and "provider" not in request.fixturenames:
        yield
        return
    provider = request.getfixturevalue("local_provider")
    before = set(live_leftovers(provider))
    yield
    leaked = set(live_leftovers(provider)) - before
    for sandbox_id in leaked:
        provider.get(sandbox_id).delete()
    assert not leaked, f"test leaked sandboxes: {sorted(leaked)}"
    assert_nothing_left_on_host(provider.state_dir)


@pytest.fixture(autouse=True)
def no_leaked_run_sandboxes():
    """The same check for the RL-harness tests' own state directory (harness_fixtures):
    no sandbox, mount or run lease may outlive the test that made it."""
    import harness_fixtures

    def live() -> set[str]:
        if harness_fixtures.state_dir.cache_info().currsize == 0:
            return set()
        with harness_fixtures.local_provider() as provider:
            return {f"{i.id} ({i.name})" for i in provider.list()}

    before = live()
    yield
    if harness_fixtures.state_dir.cache_info().currsize == 0:
        return
    root = harness_fixtures.state_dir()
    leaked = live() - before
    assert not leaked, f"test leaked sandboxes: {sorted(leaked)}"
    leases = root / "runs"
    assert not leases.is_dir() or not list(leases.iterdir()), f"a run left its lease: {list(leases.iterdir())}"
    assert_nothing_left_on_host(root)

"""A real `harness serve` for the tests: a subprocess on 127.0.0.1, a free port, a token.

``sandbox_server`` (session scope) starts one over the session's state directory
(``HARNESS_HOME``), so the server's sandboxes are the ones the local provider of
the test process sees (the leak check works unchanged); ``http_provider`` is an
HttpProvider connected to it. Import both where they are needed::

    from sandbox.server_fixture import http_provider, sandbox_server  # noqa: F401

Importing them in several places is fine: every definition shares the one
server of the session (reference counted), which stops when the last user is done.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from harness.sandbox.http import HttpProvider

HARNESS = Path(sys.executable).parent / "harness"


@dataclass
class Server:
    """One running `harness serve`."""

    url: str
    token: str
    state_dir: Path
    proc: subprocess.Popen
    log: Path
    users: int = field(default=0)

    def env(self) -> dict[str, str]:
        """The environment of a `harness sandbox ...` subprocess that talks to this server."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("HARNESS_SANDBOX_")}
        env.update(HARNESS_SANDBOX_URL=self.url, HARNESS_SANDBOX_TOKEN=self.token)
        return env

    def provider(self, **options) -> HttpProvider:
        return HttpProvider(self.url, self.token, **options)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    state_dir: Path,
    *,
    token: str | None = None,
    args: tuple[str, ...] = (),
    timeout: float = 30.0,
    port: int | None = None,
    env: dict[str, str] | None = None,
) -> Server:
    """Start `harness serve` on a free loopback port (or ``port``) and wait until
    /healthz answers. ``env`` adds to the server's environment."""
    token = token or secrets.token_urlsafe(24)
    fixed = port
    for _ in range(1 if fixed else 3):  # another process may take the port between the probe and the bind
        port = fixed or free_port()
        log = state_dir / f"serve-{port}.log"
        proc_env = {**os.environ, **(env or {}), "HARNESS_HOME": str(state_dir), "HARNESS_SERVER_TOKEN": token}
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [str(HARNESS), "serve", "--host", "127.0.0.1", "--port", str(port), *args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=proc_env,
            )
        server = Server(url=f"http://127.0.0.1:{port}", token=token, state_dir=state_dir, proc=proc, log=log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{server.url}/healthz", timeout=1).status_code == 200:
                    return server
            except httpx.HTTPError:
                time.sleep(0.05)
        stop_server(server)
        if "address already in use" not in log.read_text(errors="replace").lower():
            break
    raise RuntimeError(f"`harness serve` did not come up: {log.read_text(errors='replace')[-2000:]}")


def kill_server(server: Server) -> None:
    """SIGKILL the server (as the OOM killer or a crash would) and reap it."""
    if server.proc.poll() is None:
        server.proc.kill()
    server.proc.wait(timeout=10)


def restart_server(server: Server, **kwargs) -> Server:
    """A new `harness serve` on the same port, state directory and token."""
    port = int(server.url.rsplit(":", 1)[1])
    return start_server(server.state_dir, token=server.token, port=port, **kwargs)


def stop_server(server: Server) -> None:
    """SIGTERM, then SIGKILL after a grace period; only this server's own process."""
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()


_SESSION: dict[Path, Server] = {}


@pytest.fixture(scope="session")
def sandbox_server(state_dir):
    """The session's `harness serve` over its state directory."""
    server = _SESSION.get(state_dir)
    if server is None or server.proc.poll() is not None:
        server = _SESSION[state_dir] = start_server(state_dir)
    server.users += 1
    yield server
    server.users -= 1
    if server.users == 0:
        _SESSION.pop(state_dir, None)
        stop_server(server)


@pytest.fixture(scope="session")
def http_provider(sandbox_server):
    """An HttpProvider connected to the session's server."""
    provider = sandbox_server.provider()
    yield provider
    provider.close()

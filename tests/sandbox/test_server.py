"""`harness serve` and its http backend: authentication, start-up refusals, the CLI
through the server, concurrency, paths, error mapping, retries. Everything real:
a server subprocess on 127.0.0.1 over the session's state directory, real sandboxes.
(The conformance suite runs against the http backend too, via tests/conftest.py.)"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
from sandbox import server_fixture
from sandbox.server_fixture import HARNESS, free_port, start_server, stop_server

from harness.errors import (
    ConfigError,
    SandboxAuthError,
    SandboxError,
    SandboxFileError,
    SandboxNotFound,
    SandboxUnavailable,
    SnapshotExists,
    SnapshotNotFound,
)
from harness.sandbox import SandboxSpec
from harness.sandbox.http import HttpProvider

# The session's server (shared with tests/conftest.py's http backend, if it imports them too).
sandbox_server = server_fixture.sandbox_server
http_provider = server_fixture.http_provider

# The leak check of tests/conftest.py runs for tests that use the local provider.
pytestmark = pytest.mark.usefixtures("local_provider")


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def auth(server) -> dict[str, str]:
    return {"Authorization": f"Bearer {server.token}"}


# -- authentication and start-up -------------------------------------------------------


def test_every_route_but_healthz_needs_the_token(sandbox_server):
    url = sandbox_server.url
    assert httpx.get(f"{url}/healthz").json()["ok"] is True
    for path in ("/v1/sandboxes", "/v1/snapshots", "/openapi.json", "/v1/sandboxes/sb_0000000000"):
        assert httpx.get(url + path).status_code == 401, path
        assert httpx.get(url + path, headers={"Authorization": "Bearer wrong"}).status_code == 403, path
        assert httpx.get(url + path, headers={"Authorization": f"Basic {sandbox_server.token}"}).status_code == 401
    assert httpx.post(f"{url}/v1/sandboxes", json={}).status_code == 401
    assert httpx.post(f"{url}/v1/gc").status_code == 401
    with HttpProvider(url, "wrong", retries=0) as provider, pytest.raises(SandboxAuthError, match="403"):
        provider.list()
    with HttpProvider(url, "", retries=0) as provider, pytest.raises(SandboxAuthError, match="401"):
        provider.list()


def test_openapi_document_lists_every_verb(sandbox_server):
    doc = httpx.get(f"{sandbox_server.url}/openapi.json", headers=auth(sandbox_server)).json()
    routes = {(method.upper(), path) for path, ops in doc["paths"].items() for method in ops}
    sb = "/v1/sandboxes/{sandbox_id}"
    assert {
        ("GET", "/v1/sandboxes"),
        ("POST", "/v1/sandboxes"),
        ("GET", sb),
        ("DELETE", sb),
        ("POST", f"{sb}/fork"),
        ("POST", f"{sb}/exec"),
        ("GET", f"{sb}/files"),
        ("PUT", f"{sb}/files"),
        ("POST", f"{sb}/snapshot"),
        ("POST", f"{sb}/rename"),
        ("GET", "/v1/snapshots"),
        ("GET", "/v1/snapshots/{name}"),
        ("DELETE", "/v1/snapshots/{name}"),
        ("POST", "/v1/gc"),
    } <= routes


def _serve(args: list[str], env: dict[str, str], timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(HARNESS), "serve", *args], capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL, check=False
    )


def test_refuses_to_start_without_a_token_unless_loopback_and_insecure(state_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HARNESS_SERVER_TOKEN"}
    port = str(free_port())
    for args in (
        ["--port", port],  # loopback, but not --insecure
        ["--host", "0.0.0.0", "--port", port],
        ["--host", "0.0.0.0", "--port", port, "--insecure"],  # --insecure only on loopback
    ):
        proc = _serve(args, env)
        assert proc.returncode != 0, args
        assert "refusing to serve" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    (tmp_path / "empty").write_text("\n")
    proc = _serve(["--port", port, "--token-file", str(tmp_path / "empty")], env)
    assert proc.returncode != 0 and "empty" in proc.stderr


def test_token_file_and_insecure_loopback(state_dir, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("from-a-file\n")
    server = start_server(state_dir, token="ignored-env-token", args=("--token-file", str(token_file)))
    try:
        assert httpx.get(f"{server.url}/v1/snapshots", headers={"Authorization": "Bearer from-a-file"}).status_code == 200
        assert httpx.get(f"{server.url}/v1/snapshots", headers={"Authorization": "Bearer ignored-env-token"}).status_code == 403
    finally:
        stop_server(server)
    env = {k: v for k, v in os.environ.items() if k != "HARNESS_SERVER_TOKEN"}
    port = free_port()
    proc = subprocess.Popen(
        [str(HARNESS), "serve", "--port", str(port), "--insecure"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/snapshots", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        else:
            pytest.fail("the insecure loopback server did not answer without a token")
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=15)
    assert "WARNING: no token" in err


# -- the CLI through the server ------------------------------------------------------


def test_cli_verbs_through_the_server(sandbox_server, local_provider):
    env = sandbox_server.env()

    def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(HARNESS), "sandbox", *args], capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL, check=False
        )

    created: list[str] = []
    snap = unique("clisnap")
    try:
        proc = run("new", "--name", "via-server", "--ttl", "600", "--json")
        assert proc.returncode == 0, proc.stderr
        events = [json.loads(line) for line in proc.stdout.splitlines()]
        assert [e["event"] for e in events] == ["creating", "ready"]
        sid = events[1]["id"]
        created.append(sid)
        assert events[1]["name"] == "via-server" and events[1]["status"] == "running"
        assert sid in {i.id for i in local_provider.list()}  # the server's sandboxes are this host's

        proc = run("exec", sid, "echo out; echo err >&2; echo kept > f; exit 7")
        assert (proc.returncode, proc.stdout, proc.stderr) == (7, "out\n", "err\n")
        proc = run("exec", sid, "--timeout", "0.5", "sleep 30")
        assert proc.returncode == 124 and "timed out" in proc.stderr

        proc = run("snapshot", sid, snap)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["snapshot"]["name"] == snap
        proc = run("new", "--from", snap, "--ttl", "600")
        restored = proc.stdout.strip()
        created.append(restored)
        assert run("exec", restored, "cat f").stdout == "kept\n"

        proc = run("fork", sid, "--ttl", "600", "--json")
        assert proc.returncode == 0, proc.stderr
        child = json.loads(proc.stdout)
        created.append(child["id"])
        assert child["event"] == "ready" and child["resumedFrom"] == sid

        info = json.loads(run("info", child["id"]).stdout)
        assert info["id"] == child["id"] and info["memoryRestored"] is False
        proc = run("delete", child["id"], "--yes")
        assert json.loads(proc.stdout) == {"ok": True, "deleted": child["id"]}
        proc = run("info", child["id"])
        assert proc.returncode == 1
        assert proc.stderr.startswith("harness: error: no sandbox") and len(proc.stderr.splitlines()) == 1
    finally:
        live = {i.id for i in local_provider.list()}
        for sid in set(created) & live:
            local_provider.get(sid).delete()
        if snap in {s.name for s in local_provider.snapshots()}:
            local_provider.delete_snapshot(snap)


@pytest.mark.slow
def test_seed_scripts_run_unchanged_through_the_server(sandbox_server, local_provider, tmp_path):
    """The seed's build and episode loop (scripts/seed), pointed at the server by two
    environment variables only. The build pip-installs pytest in the sandbox (needs PyPI)."""
    seed = Path(__file__).resolve().parents[2] / "scripts" / "seed"
    snap = unique("aeo-rl-env-v1")
    env = {**sandbox_server.env(), "SNAP": snap, "PATH": f"{HARNESS.parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
    env.pop("SBX", None)
    env["HARNESS_HOME"] = str(tmp_path / "unused")  # the CLI must not touch a local state directory
    src = None
    try:
        build = subprocess.run([str(seed / "build.sh")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400, check=False)
        src = (tmp_path / "src.id").read_text().strip() if (tmp_path / "src.id").exists() else None
        assert build.returncode == 0, build.stderr
        assert '{"passed": 2, "failed": 2, "reward": 0.5' in build.stdout
        episodes = subprocess.run([str(seed / "episodes.sh")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
        assert episodes.returncode == 0 and episodes.stderr == "", episodes.stderr
        rows = [row.split(" ", 5) for row in (tmp_path / "results.txt").read_text().splitlines()[1:]]
        assert [(r[1], json.loads(r[5])["reward"]) for r in rows] == [("new--from", 0.75), ("new--from", 1.0), ("fork", 1.0)]
        assert {i.id for i in local_provider.list()} & {r[2] for r in rows} == set()
        assert not (tmp_path / "unused").exists()
    finally:
        if src and src in {i.id for i in local_provider.list()}:
            local_provider.get(src).delete()
        if snap in {s.name for s in local_provider.snapshots()}:
            local_provider.delete_snapshot(snap)


def test_cli_says_when_the_server_is_unreachable(sandbox_server):
    env = {**sandbox_server.env(), "HARNESS_SANDBOX_URL": f"http://127.0.0.1:{free_port()}"}
    proc = subprocess.run([str(HARNESS), "sandbox", "ls"], capture_output=True, text=True, env=env, timeout=60, check=False)
    assert proc.returncode == 1
    assert "cannot reach the sandbox server" in proc.stderr and "harness serve" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


# -- concurrency and streaming ----------------------------------------------------------


def test_concurrent_execs_do_not_block_each_other(http_provider):
    with http_provider.create(SandboxSpec(ttl_s=600)) as a, http_provider.create(SandboxSpec(ttl_s=600)) as b:
        results = {}

        def run(i: int) -> None:
            results[i] = (a if i % 2 else b).exec(f"sleep 1; echo {i}")

        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        started = time.monotonic()
        for t in threads:
            t.start()
        time.sleep(0.3)
        listed = time.monotonic()
        http_provider.list()  # other calls are answered while the commands run
        assert time.monotonic() - listed < 0.5
        for t in threads:
            t.join()
        elapsed = time.monotonic() - started
        assert elapsed < 2.5, f"8 execs of `sleep 1` took {elapsed:.1f}s: they ran one after another"
        assert [results[i].text().strip() for i in range(8)] == [str(i) for i in range(8)]


def test_a_client_that_hangs_up_stops_its_command(http_provider):
    class HangUp(Exception):
        pass

    def hang_up(stream: str, chunk: bytes) -> None:
        raise HangUp

    with http_provider.create(SandboxSpec(ttl_s=600)) as sb:
        with pytest.raises(HangUp):
            sb.exec("while :; do echo tick-tock; sleep 0.05; done", on_output=hang_up)
        deadline = time.monotonic() + 5
        while "tick-tock" in (procs := sb.exec("cat /proc/[0-9]*/cmdline | tr '\\0' ' '").text()):
            assert time.monotonic() < deadline, f"the command outlived its client: {procs}"
            time.sleep(0.1)


def test_a_silent_command_stops_when_its_client_hangs_up(sandbox_server, http_provider):
    with http_provider.create(SandboxSpec(ttl_s=600)) as sb:
        url = f"{sandbox_server.url}/v1/sandboxes/{sb.id}/exec"
        body = {"command": "setsid sleep 77 & sleep 66", "stream": True}
        with httpx.stream("POST", url, json=body, headers=auth(sandbox_server), timeout=30) as response:
            assert response.status_code == 200
            time.sleep(0.5)  # hang up while the command is silent
        deadline = time.monotonic() + 10
        while re.search(r"sleep (77|66)\b", procs := sb.exec("cat /proc/[0-9]*/cmdline | tr '\\0' ' '").text()):
            assert time.monotonic() < deadline, f"the command outlived its client: {procs}"
            time.sleep(0.1)


def test_capped_output_without_a_callback(http_provider):
    with http_provider.create(SandboxSpec(ttl_s=600)) as sb:
        result = sb.exec("head -c 300000 /dev/zero; head -c 10 /dev/zero >&2", max_output_bytes=1000)
        assert (len(result.stdout), len(result.stderr), result.truncated) == (1000, 10, True)
        seen = []
        result = sb.exec("head -c 300000 /dev/zero", max_output_bytes=10, on_output=lambda s, c: seen.append(c))
        assert sum(map(len, seen)) == 300000 and len(result.stdout) == 10


# -- paths and errors ---------------------------------------------------------------


def test_paths_with_nul_bytes_are_rejected(sandbox_server, http_provider, tmp_path):
    host_file = tmp_path / "host-only"
    host_file.write_bytes(b"host secret")
    with http_provider.create(SandboxSpec(ttl_s=600)) as sb:
        files = f"{sandbox_server.url}/v1/sandboxes/{sb.id}/files"
        response = httpx.get(files, params={"path": "a\x00b"}, headers=auth(sandbox_server))
        assert response.status_code == 422
        assert response.json()["error"]["type"] == "SandboxFileError"
        response = httpx.put(files, params={"path": "x\x00/../../etc/passwd"}, content=b"x", headers=auth(sandbox_server))
        assert response.status_code == 422
        with pytest.raises(SandboxFileError, match="NUL"):
            sb.read_file("f\x00")
        with pytest.raises(SandboxFileError, match="NUL"):
            sb.write_file("f\x00", b"data")
        with pytest.raises(ConfigError, match="NUL"):
            sb.exec("echo a\x00b")
        # Paths are the sandbox's own: outside its home they meet the jail, not the host.
        with pytest.raises(SandboxFileError):
            sb.read_file(str(host_file))
        assert b"root:" not in sb.read_file("/etc/shadow")
        with pytest.raises(SandboxFileError):
            sb.write_file("../../../usr/bin/evil", b"x")


def test_server_errors_come_back_as_the_same_exceptions(sandbox_server, http_provider):
    url, headers = sandbox_server.url, auth(sandbox_server)
    response = httpx.get(f"{url}/v1/sandboxes/sb_0000000000", headers=headers)
    assert response.status_code == 404 and response.json()["error"]["type"] == "SandboxNotFound"
    with pytest.raises(SandboxNotFound, match="sb_0000000000"):
        http_provider.get("sb_0000000000")
    with pytest.raises(SandboxNotFound):
        http_provider.fork("sb_0000000000")
    assert httpx.delete(f"{url}/v1/sandboxes/sb_0000000000", headers=headers).status_code == 204
    with pytest.raises(SnapshotNotFound):
        http_provider.snapshot_info("no-such-snapshot")
    with pytest.raises(SnapshotNotFound):
        http_provider.snapshot_info("bad/name")
    response = httpx.post(f"{url}/v1/sandboxes", json={"spec": {"type": "huge"}}, headers=headers)
    assert response.status_code == 400 and response.json()["error"]["type"] == "ConfigError"
    assert "huge" in response.json()["error"]["message"]
    response = httpx.post(f"{url}/v1/sandboxes", json={"spec": {"ttl_s": "soon"}}, headers=headers)
    assert response.status_code == 422 and response.json()["error"]["type"] == "ConfigError"
    name = unique("dup")
    with http_provider.create(SandboxSpec(ttl_s=600)) as sb:
        sb.snapshot(name)
        try:
            response = httpx.post(f"{url}/v1/sandboxes/{sb.id}/snapshot", json={"name": name}, headers=headers)
            assert response.status_code == 409 and response.json()["error"]["type"] == "SnapshotExists"
            with pytest.raises(SnapshotExists):
                sb.snapshot(name)
            with pytest.raises(SandboxError, match="invalid snapshot name"):
                sb.snapshot("bad/name")
        finally:
            http_provider.delete_snapshot(name)


def test_unreachable_server_and_retries(sandbox_server):
    dead = HttpProvider(f"http://127.0.0.1:{free_port()}", "t", retries=2, backoff_s=0.2)
    started = time.monotonic()
    with pytest.raises(SandboxUnavailable, match=r"cannot reach the sandbox server at .*is `harness serve` running\?"):
        dead.list()
    assert time.monotonic() - started >= 0.2 + 0.4, "an idempotent call was not retried"
    for call in (lambda: dead.create(SandboxSpec()), lambda: dead.fork("sb_0000000000")):
        started = time.monotonic()
        with pytest.raises(SandboxUnavailable):
            call()
        assert time.monotonic() - started < 0.2, "a call that makes something was retried"
    # A server that comes up while an idempotent call is backing off answers it.
    port = free_port()
    late = HttpProvider(f"http://127.0.0.1:{port}", "t", retries=6, backoff_s=0.25)
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(late.snapshots()))
    waiter.start()
    time.sleep(0.3)
    proc = subprocess.Popen(
        [str(HARNESS), "serve", "--port", str(port)],
        env={**os.environ, "HARNESS_SERVER_TOKEN": "t"},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        waiter.join(timeout=30)
        assert got and isinstance(got[0], list), "the retried call did not reach the late server"
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def test_provider_pickles_for_ray(http_provider):
    with http_provider.create(SandboxSpec(ttl_s=600)) as sb:
        copy = pickle.loads(pickle.dumps(sb))
        assert copy.id == sb.id and copy.exec("echo hi").text() == "hi\n"
        copy.provider.close()

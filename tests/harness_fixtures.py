"""Shared helpers for the RL-harness tests (not a conftest: that file belongs to the sandbox tests).

- ``FakeProvider``: a temporary-directory Provider that runs commands on the host
  with HOME pointing at the sandbox's directory; for fast unit tests of logic only.
- ``state_dir()`` / ``median_env()``: one temporary local-backend state directory
  and one built median environment per test process, reused through the
  content-hash cache by every module that asks.
- ``ray_local``: a module-scoped real local Ray.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from harness.errors import SandboxFileError, SandboxNotFound, SnapshotExists, SnapshotNotFound
from harness.sandbox.base import (
    HOME,
    TIMEOUT_EXIT_CODE,
    ExecResult,
    GcReport,
    Provider,
    Sandbox,
    SandboxInfo,
    SandboxSpec,
    SnapshotInfo,
)

ROOT = Path(__file__).resolve().parents[1]
MEDIAN_DIR = ROOT / "envs" / "median"
MEDIAN_CONFIG = ROOT / "configs" / "median.yaml"


def can_sandbox() -> bool:
    return os.geteuid() == 0 and shutil.which("bwrap") is not None


needs_sandbox = pytest.mark.skipif(not can_sandbox(), reason="real sandboxes need root and bubblewrap")


# --- a fake Provider over temporary directories -------------------------------------------


class FakeSandbox(Sandbox):
    def __init__(self, provider: FakeProvider, sid: str, spec: SandboxSpec, from_snapshot: str | None):
        self.provider, self.id, self.spec = provider, sid, spec
        self.home = provider.root / "sandboxes" / sid
        self.from_snapshot = from_snapshot
        self.created_at = time.time()
        self.deleted = False

    def _path(self, path: str) -> Path:
        if path.startswith(HOME + "/"):
            path = path[len(HOME) + 1:]
        return self.home / path

    def exec(self, command, *, timeout=None, env=None, cwd=None, stdin=None, on_output=None,
             max_output_bytes=16 << 20) -> ExecResult:
        self._alive()
        workdir = self._path(cwd) if cwd else self.home
        environ = {"PATH": os.environ["PATH"], "HOME": str(self.home), **dict(self.spec.env), **dict(env or {})}
        # The fake's home is a host directory: map the sandbox's absolute home path onto it.
        command = command.replace(HOME, str(self.home))
        t0 = time.monotonic()
        try:
            p = subprocess.run(["sh", "-c", command], cwd=workdir, env=environ, input=stdin, capture_output=True,
                               timeout=timeout)
            code, out, err, timed_out = p.returncode, p.stdout, p.stderr, False
        except subprocess.TimeoutExpired as exc:
            code, out, err, timed_out = TIMEOUT_EXIT_CODE, exc.stdout or b"", exc.stderr or b"", True
        truncated = len(out) > max_output_bytes or len(err) > max_output_bytes
        return ExecResult(code, out[:max_output_bytes], err[:max_output_bytes], time.monotonic() - t0,
                          timed_out, truncated)

    def write_file(self, path, data, mode=0o644):
        self._alive()
        target = self._path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        target.chmod(mode)

    def read_file(self, path):
        self._alive()
        try:
            return self._path(path).read_bytes()
        except OSError as exc:
            raise SandboxFileError(f"cannot read {path}: {exc.strerror}") from exc

    def snapshot(self, name):
        self._alive()
        if name in self.provider.snaps:
            raise SnapshotExists(f"snapshot {name} exists")
        dest = self.provider.root / "snapshots" / name
        shutil.copytree(self.home, dest, symlinks=True)
        info = SnapshotInfo(name, f"snap-{name}", 0, self.id, self.spec.type, time.time(), (name,))
        self.provider.snaps[name] = info
        return info

    def fork(self, spec=None):
        self._alive()
        child = self.provider._new(spec or SandboxSpec(), None)
        shutil.rmtree(child.home)
        shutil.copytree(self.home, child.home, symlinks=True)
        return child

    def rename(self, name):
        self.spec = SandboxSpec(name=name, type=self.spec.type, ttl_s=self.spec.ttl_s, network=self.spec.network)
        return self.info()

    def info(self):
        return SandboxInfo(self.id, self.spec.name, self.spec.type, "running", self.created_at, None,
                           self.from_snapshot, None, self.spec.network, backend="fake")

    def delete(self):
        if not self.deleted:
            self.deleted = True
            shutil.rmtree(self.home, ignore_errors=True)
            self.provider.live.pop(self.id, None)

    def _alive(self):
        if self.deleted:
            raise SandboxNotFound(f"sandbox {self.id} was deleted")


class FakeProvider(Provider):
    name = "fake"

    def __init__(self, root: str | Path):
        self.root = Path(root)
        (self.root / "sandboxes").mkdir(parents=True, exist_ok=True)
        (self.root / "snapshots").mkdir(parents=True, exist_ok=True)
        self.live: dict[str, FakeSandbox] = {}
        self.snaps: dict[str, SnapshotInfo] = {}
        self.counter = itertools.count()
        self.created = 0

    def _new(self, spec, from_snapshot):
        sb = FakeSandbox(self, f"fake{next(self.counter)}", spec, from_snapshot)
        sb.home.mkdir(parents=True)
        self.live[sb.id] = sb
        self.created += 1
        return sb

    def create(self, spec=None, *, from_snapshot=None):
        spec = spec or SandboxSpec()
        if from_snapshot is not None:
            self.snapshot_info(from_snapshot)
        sb = self._new(spec, from_snapshot)
        if from_snapshot is not None:
            shutil.rmtree(sb.home)
            shutil.copytree(self.root / "snapshots" / from_snapshot, sb.home, symlinks=True)
        return sb

    def get(self, sandbox_id):
        try:
            return self.live[sandbox_id]
        except KeyError:
            raise SandboxNotFound(f"no sandbox {sandbox_id}") from None

    def list(self):
        return [sb.info() for sb in self.live.values()]

    def snapshots(self):
        return list(self.snaps.values())

    def snapshot_info(self, name):
        try:
            return self.snaps[name]
        except KeyError:
            raise SnapshotNotFound(f"no snapshot {name}") from None

    def delete_snapshot(self, name):
        self.snapshot_info(name)
        del self.snaps[name]
        shutil.rmtree(self.root / "snapshots" / name)

    def gc(self):
        return GcReport()


def make_tiny_env(root: Path, *, grade_body: str | None = None) -> Path:
    """A small environment whose grader needs nothing but sh: reward = 1 if answer.txt says 42."""
    env = root / "tiny"
    env.mkdir(parents=True, exist_ok=True)
    (env / "answer.txt").write_text("0\n")
    body = grade_body or (
        'if [ "$(cat answer.txt)" = 42 ]; then r=1.0; else r=0.25; fi\n'
        'printf \'{"reward": %s, "note": "tiny"}\' "$r" > "$HOME/result.json"\n'
    )
    (env / "grade.sh").write_text("#!/bin/sh\n" + body)
    return env


# --- real local backend, one state dir and one median build per test process ---------------


@functools.lru_cache(maxsize=None)
def state_dir() -> Path:
    path = Path(tempfile.mkdtemp(prefix="harness-test-state-"))

    def cleanup() -> None:
        try:
            from harness.sandbox import open_provider

            p = open_provider("local", state_dir=path)
            if hasattr(p, "shutdown"):  # deletes every sandbox and unmounts the state's tmpfs
                p.shutdown()
            else:
                for info in p.list():
                    p.get(info.id).delete()
        except Exception as exc:  # at exit: say so, but do not fail the session
            print(f"harness_fixtures: cleaning {path} failed: {exc!r}", file=sys.stderr)
        shutil.rmtree(path, ignore_errors=True)

    atexit.register(cleanup)
    return path


def local_provider():
    from harness.sandbox import open_provider

    return open_provider("local", state_dir=state_dir())


def median_spec():
    """The env of configs/median.yaml, so that driver runs hit the same cached snapshot."""
    from omegaconf import OmegaConf

    from harness.config import load_config
    from harness.env import EnvSpec

    cfg = load_config(MEDIAN_CONFIG)
    return EnvSpec.from_dict({**OmegaConf.to_container(cfg.env, resolve=True), "type": cfg.sandbox.type})


@functools.lru_cache(maxsize=None)
def median_env():
    """The median environment built once per process (the content hash makes later builds hits)."""
    from harness.env import build_env

    with local_provider() as provider:
        return build_env(provider, median_spec())


def median_overrides(tmp_path: Path, **extra) -> list[str]:
    """Overrides that point configs/median.yaml at the test's state dir and output dir."""
    items = {"sandbox.state_dir": str(state_dir()), "output.dir": str(tmp_path / "results"), **extra}
    return [f"{k}={v}" for k, v in items.items()]


def harness_cli(*args: str, timeout: float = 300, home: Path | None = None) -> subprocess.CompletedProcess:
    """`harness ARGS` through the real command-line entry point, in a subprocess of its own
    (``home``: its $HARNESS_HOME)."""
    env = {**os.environ, "COLUMNS": "150"}
    if home is not None:
        env["HARNESS_HOME"] = str(home)
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def start_server(home: Path, port: int | None = None) -> tuple[subprocess.Popen, str]:
    """A real `harness serve --insecure` on loopback with its own state directory."""
    import socket

    import httpx

    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "harness.cli", "serve", "--port", str(port), "--insecure"],
                              env={**os.environ, "HARNESS_HOME": str(home)}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return server, f"http://127.0.0.1:{port}"
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or server.poll() is not None:
            server.kill()
            raise AssertionError(server.stderr.read())
        time.sleep(0.2)


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield ray
    ray.shutdown()


# --- a small OpenAI-compatible chat-completions server on loopback ------------------------


class OpenAIStub:
    """Serves POST /v1/chat/completions on 127.0.0.1: calls the bash tool with ``commands``
    in turn (chosen by how many tool results the request carries, so concurrent
    episodes are fine), then answers with text. Records every request body."""

    def __init__(self, commands: list[str], *, status: int = 200, calls_per_reply: int = 1):
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.commands, self.status, self.calls_per_reply = commands, status, calls_per_reply
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output clean
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.requests.append(body)
                stub.headers.append(dict(self.headers))
                if self.path != "/v1/chat/completions":
                    return self._send(404, {"error": "not found"})
                if stub.status != 200:
                    return self._send(stub.status, {"error": {"message": "stub failure"}})
                done = sum(1 for m in body["messages"] if m["role"] == "tool")
                todo = stub.commands[done:done + stub.calls_per_reply]
                if todo:
                    message = {"role": "assistant", "content": None, "tool_calls": [
                        {"id": f"call_{done + i}", "type": "function",
                         "function": {"name": "bash", "arguments": json.dumps({"command": c})}}
                        for i, c in enumerate(todo)]}
                else:
                    message = {"role": "assistant", "content": "The task is solved."}
                self._send(200, {"id": "x", "object": "chat.completion", "model": body["model"],
                                 "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})

            def _send(self, code, payload):
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.base_url = f"http://127.0.0.1:{self.server.server_port}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> OpenAIStub:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

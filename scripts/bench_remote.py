#!/usr/bin/env python3
"""Benchmark of the remote overhead: the sandbox benchmark's figures through a real
`harness serve` on 127.0.0.1 (the http backend) against the local backend direct
(a benchmark, not a test).

Both sides use one state directory (the server's), so they start from the same
snapshots. Samples are interleaved (direct, remote, then remote, direct, ...) so
that the noise of a shared machine hits both alike. Figures:
  new        new sandbox from a 10 MB snapshot until ready
  new+py     the same plus exec `python3 -c pass`
  fork+py    fork of a live sandbox (--fork-mb changed) plus the same exec
  exec       round trip of `true` in a ready sandbox
  (and, for scale, the server's HTTP floor: GET /healthz on the pooled connection)
Target: `new` and `exec` through the server within 2x of direct (p50).

Usage: sudo .venv/bin/python scripts/bench_remote.py [--n 30] [--fork-mb 100]
"""

from __future__ import annotations

import argparse
import os
import platform
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.sandbox import SandboxSpec, open_provider  # noqa: E402
from harness.sandbox.base import Provider, Sandbox  # noqa: E402

SNAPSHOT = "bench-remote-10mb"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(state: Path, token: str) -> tuple[subprocess.Popen, str]:
    import httpx

    port = free_port()
    env = {**os.environ, "HARNESS_HOME": str(state), "HARNESS_SERVER_TOKEN": token}
    env.pop("HARNESS_SNAPSHOT_STORE", None)
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"harness serve did not start: {proc.stderr.read() if proc.stderr else ''}")
        time.sleep(0.1)


def sample(fn: Callable[[], object], after: Callable[[object], None] | None = None) -> float:
    t0 = time.perf_counter()
    value = fn()
    ms = (time.perf_counter() - t0) * 1000
    if after is not None:
        after(value)
    return ms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=30, help="samples per figure and side (exec: 3x; default 30)")
    ap.add_argument("--fork-mb", type=int, default=100, help="MB changed in the fork source (default 100)")
    args = ap.parse_args()

    state = Path(tempfile.mkdtemp(prefix="harness-bench-remote-"))
    token = secrets.token_urlsafe(24)
    direct = open_provider("local", state_dir=state)
    server, url = start_server(state, token)
    remote = open_provider("http", url=url, token=token)
    print(f"machine: nproc {os.cpu_count()}, {platform.system()} {platform.release()}; "
          f"cgroups: {direct.cgroup_layout.describe()}")
    print(f"server: harness serve on {url} (bearer token), same state dir {state}")
    sides: dict[str, Provider] = {"direct": direct, "remote": remote}
    figures = ["new", "new+py", "fork+py", "exec"]
    data: dict[str, dict[str, list[float]]] = {f: {"direct": [], "remote": []} for f in figures}
    sources: dict[str, Sandbox] = {}
    http_floor: list[float] = []
    try:
        with direct.create(SandboxSpec(type="large")) as src:
            src.exec("head -c 10M /dev/urandom > data.bin", timeout=120)
            src.snapshot(SNAPSHOT)
        for side, provider in sides.items():
            sources[side] = provider.create(SandboxSpec(), from_snapshot=SNAPSHOT)
            res = sources[side].exec(f"head -c {args.fork_mb}M /dev/urandom > changed.bin", timeout=300)
            assert res.ok, res
            sources[side].fork().delete()  # warm: the first fork promotes the source's changes
            sources[side].exec("true")

        def delete(sb) -> None:
            sb.delete()

        def new_and_py(provider: Provider) -> Sandbox:
            sb = provider.create(SandboxSpec(), from_snapshot=SNAPSHOT)
            res = sb.exec("python3 -c pass")
            assert res.ok, res
            return sb

        def fork_and_py(side: str) -> Sandbox:
            sb = sources[side].fork()
            res = sb.exec("python3 -c pass")
            assert res.ok, res
            return sb

        for _ in range(2):  # warm-up of both paths (imports, connection pool), not counted
            for provider in sides.values():
                new_and_py(provider).delete()
        print(f"sampling: n={args.n} per figure and side (exec {3 * args.n}), interleaved ...", flush=True)
        for i in range(args.n):
            order = ["direct", "remote"] if i % 2 == 0 else ["remote", "direct"]
            for side in order:
                provider = sides[side]
                data["new"][side].append(
                    sample(lambda p=provider: p.create(SandboxSpec(), from_snapshot=SNAPSHOT), delete))
            for side in order:
                data["new+py"][side].append(sample(lambda p=sides[side]: new_and_py(p), delete))
            for side in order:
                data["fork+py"][side].append(sample(lambda s=side: fork_and_py(s), delete))
            for _ in range(3):
                for side in order:
                    data["exec"][side].append(sample(lambda sb=sources[side]: sb.exec("true")))
                http_floor.append(sample(lambda: remote._client.get("/healthz")))
    finally:
        for sb in sources.values():
            try:
                sb.delete()
            except Exception as exc:  # noqa: BLE001 - report and go on cleaning up
                print(f"could not delete {sb.id}: {exc}", file=sys.stderr)
        remote.close()
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        direct.shutdown()
        shutil.rmtree(state, ignore_errors=True)

    labels = {
        "new": "new from 10 MB snapshot, ready",
        "new+py": "new from snapshot + exec python3 -c pass",
        "fork+py": f"fork ({args.fork_mb} MB changed) + exec python3",
        "exec": "exec `true` round trip",
    }
    print(f"\n{'figure':42} {'direct p50':>10} {'p95':>7} {'remote p50':>10} {'p95':>7} {'ratio p50':>9} "
          f"{'p95':>6} {'n':>4}")
    ratios = {}
    for f in figures:
        d, r = data[f]["direct"], data[f]["remote"]
        ratios[f] = statistics.median(r) / statistics.median(d)
        print(f"{labels[f]:42} {statistics.median(d):10.2f} {pct(d, 0.95):7.2f} {statistics.median(r):10.2f} "
              f"{pct(r, 0.95):7.2f} {ratios[f]:8.2f}x {pct(r, 0.95) / pct(d, 0.95):5.2f}x {len(d):4d}")
    print(f"{'HTTP floor: GET /healthz':42} {'':10} {'':7} {statistics.median(http_floor):10.2f} "
          f"{pct(http_floor, 0.95):7.2f} {'':9} {'':6} {len(http_floor):4d}")
    print("(milliseconds; ratio = remote / direct)")
    print()
    for f, what in (("new", "create-from-snapshot"), ("exec", "exec `true`")):
        overhead = statistics.median(data[f]["remote"]) - statistics.median(data[f]["direct"])
        verdict = "ok" if ratios[f] <= 2.0 else "MISSED"
        print(f"{what + ' remote/direct p50 <= 2.0':42} {ratios[f]:8.2f}  {verdict}  (+{overhead:.2f} ms per call)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Benchmark of the local sandbox backend (a benchmark, not a test).

Measures in one run, so that ratios hold on a noisy shared machine:
  floor      bare `python3 -c pass` on the host
  new+py     new sandbox from a 10 MB snapshot until ready, plus exec `python3 -c pass`,
             cold (a jail started per sandbox) and warm (claimed from the provider's pool)
  fork+py    fork of a live sandbox with 100 MB changed, plus the same exec
  exec       round trip of `true` in a ready sandbox
  restore    new sandbox until ready from a 10 MB and from a 1 GB snapshot

Usage: sudo .venv/bin/python scripts/bench_sandbox.py [--n 30] [--state-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.sandbox import SandboxSpec, open_provider  # noqa: E402

PY = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else "python3"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def timed(fn, n: int, after=None) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        value = fn()
        out.append((time.perf_counter() - t0) * 1000)
        if after is not None:
            after(value)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=30, help="samples per figure (default 30)")
    ap.add_argument("--state-dir", help="state directory (default: a temporary one, removed after)")
    ap.add_argument("--big-mb", type=int, default=1024, help="size of the big snapshot in MB (default 1024)")
    args = ap.parse_args()

    state = Path(args.state_dir) if args.state_dir else Path(tempfile.mkdtemp(prefix="harness-bench-"))
    provider = open_provider("local", state_dir=state)
    print(f"machine: {os.cpu_count()} cores; cgroups: {provider.cgroup_layout.describe()}; state: {state}")
    try:
        print("preparing snapshots (10 MB and", args.big_mb, "MB) ...", flush=True)
        with provider.create(SandboxSpec(type="large")) as src:
            src.exec("head -c 10M /dev/urandom > data.bin", timeout=120)
            small = src.snapshot("bench-10mb")
            src.exec(f"head -c {args.big_mb}M /dev/zero > big.bin", timeout=600)
            big = src.snapshot("bench-big")
        print(f"  snapshot sizes: {small.size_bytes / 1e6:.1f} MB and {big.size_bytes / 1e6:.1f} MB")

        def delete(sb) -> None:
            sb.delete()

        n = args.n
        floor = timed(lambda: subprocess.run([PY, "-c", "pass"], check=True), n)

        def new_and_py():
            sb = provider.create(SandboxSpec(), from_snapshot="bench-10mb")
            sb.exec("python3 -c pass")
            return sb

        new_py = timed(new_and_py, n, after=delete)

        pooled = open_provider("local", state_dir=state, pool_size=4)

        def warm_new_and_py():
            sb = pooled.create(SandboxSpec(), from_snapshot="bench-10mb")
            sb.exec("python3 -c pass")
            return sb

        def settle(sb) -> None:
            sb.delete()
            # Let the pool refill between samples, as it does between episodes.
            deadline = time.monotonic() + 5
            while sum(map(len, pooled._pool._ready.values())) < 4 and time.monotonic() < deadline:
                time.sleep(0.005)

        settle(warm_new_and_py())  # the first claim starts the pool
        warm_py = timed(warm_new_and_py, n, after=settle)
        pooled.close()

        fork_src = provider.create(SandboxSpec(), from_snapshot="bench-10mb")
        fork_src.exec("head -c 100M /dev/urandom > changed.bin", timeout=120)

        def fork_and_py():
            sb = fork_src.fork()
            sb.exec("python3 -c pass")
            return sb

        fork_py = timed(fork_and_py, n, after=delete)
        fork_only = timed(fork_src.fork, n, after=delete)
        exec_true = timed(lambda: fork_src.exec("true"), n * 3)
        fork_src.delete()

        restore_small: list[float] = []
        restore_big: list[float] = []
        for _ in range(n):  # alternate so drift hits both alike
            restore_small += timed(lambda: provider.create(SandboxSpec(), from_snapshot="bench-10mb"), 1, after=delete)
            restore_big += timed(lambda: provider.create(SandboxSpec(), from_snapshot="bench-big"), 1, after=delete)
    finally:
        provider.gc()
        if not args.state_dir:
            provider.shutdown()
            shutil.rmtree(state, ignore_errors=True)

    rows = [
        ("floor: python3 -c pass on host", floor),
        ("new from snapshot + exec python3, cold", new_py),
        ("new from snapshot + exec python3, warm", warm_py),
        ("fork (100 MB changed) + exec python3", fork_py),
        ("fork (100 MB changed), ready", fork_only),
        ("exec `true` round trip", exec_true),
        ("restore from 10 MB snapshot", restore_small),
        (f"restore from {args.big_mb} MB snapshot", restore_big),
    ]
    print(f"\n{'figure':42} {'p50 ms':>8} {'p95 ms':>8} {'n':>4}")
    for label, xs in rows:
        print(f"{label:42} {statistics.median(xs):8.2f} {pct(xs, 0.95):8.2f} {len(xs):4d}")

    f50 = statistics.median(floor)
    checks = [
        ("new+py (warm) p50 <= 25 ms", statistics.median(warm_py), 25.0),
        ("new+py (warm) p50 / floor p50 <= 2.0", statistics.median(warm_py) / f50, 2.0),
        ("new+py (cold) p50 / floor p50 (no target)", statistics.median(new_py) / f50, float("inf")),
        ("fork+py p50 <= 50 ms (100 MB changed)", statistics.median(fork_py), 50.0),
        ("exec true p50 <= 5 ms", statistics.median(exec_true), 5.0),
        ("restore big / restore 10 MB p50 <= 1.2", statistics.median(restore_big) / statistics.median(restore_small), 1.2),
    ]
    print()
    for label, value, limit in checks:
        print(f"{label:42} {value:8.2f}  {'ok' if value <= limit else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

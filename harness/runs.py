"""A run's footprint in the sandbox layer: its leftover sandboxes and its lease.

Episode sandboxes are named ``<run_id>-ep<N>`` and fork sources
``<run_id>-a<slot>-source``, so a run's leftovers are found by name. While a
run is going, its driver holds a lease in the local state directory
(``runs/<run_id>.json``: host, pid and the pid's start time). When a driver dies
without cleaning up (SIGKILL, power cut), the next ``harness run`` or
``harness sandbox gc`` on that host sees the lease of a dead process and deletes
the run's sandboxes then, long before their TTL; the TTL stays the last resort
(and the only one for sandboxes on other hosts).
"""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from harness.errors import HarnessError
from harness.files import write_atomically
from harness.sandbox import open_provider
from harness.sandbox._jail import alive, process_start_time


def leftover_pattern(run_id: str) -> re.Pattern[str]:
    return re.compile(rf"^{re.escape(run_id)}-(ep\d+|a\d+-source)$")


def reap_sandboxes(backend: str, options: dict[str, Any], run_id: str, only: set[str] | None = None) -> list[str]:
    """Delete this run's sandboxes still alive (episodes and fork sources, found by name):
    the guard against leaks when an actor died or was killed before its own cleanup."""
    pattern = leftover_pattern(run_id)
    deleted = []
    with open_provider(backend, **options) as provider:
        for info in provider.list():
            if info.name and pattern.match(info.name) and (only is None or info.name in only):
                try:
                    provider.get(info.id).delete()
                    deleted.append(info.name)
                except HarnessError:
                    pass  # already gone
    return deleted


def reap_on_nodes(backend: str, options: dict[str, Any], run_id: str, nodes: set[str],
                  only: set[str] | None = None, timeout: float = 60.0) -> list[str]:
    """``reap_sandboxes`` run on each Ray node in ``nodes``: for actors that keep their
    sandboxes in their own node's state directory. A node that is gone is skipped
    (its sandboxes' TTL is the last resort)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not nodes:
        return []
    task = ray.remote(num_cpus=0, max_retries=0)(reap_sandboxes)
    refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
            .remote(backend, options, run_id, only) for node in sorted(nodes)]
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    deleted: list[str] = []
    for ref in done:
        try:
            deleted += ray.get(ref)
        except (ray.exceptions.RayError, HarnessError):
            pass
    return deleted


def _leases(state_dir: Path) -> Path:
    return state_dir / "runs"


@contextmanager
def lease(state_dir: str | Path, run_id: str, run_dir: str | Path) -> Iterator[Path]:
    """Hold the run's lease while the block runs; a driver that dies keeps it, which is
    how the next harness call knows the run's sandboxes are orphans."""
    pid = os.getpid()
    path = write_atomically(_leases(Path(state_dir)) / f"{run_id}.json", json.dumps({
        "run_id": run_id, "host": socket.gethostname(), "pid": pid, "pid_start": process_start_time(pid),
        "run_dir": str(run_dir)}))
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def reap_dead_runs(state_dir: str | Path) -> dict[str, list[str]]:
    """Delete the sandboxes of runs whose driver on this host died; returns run id -> names.

    A lease of a live process, or of another host, is left alone."""
    leases = _leases(Path(state_dir))
    reaped: dict[str, list[str]] = {}
    if not leases.is_dir():
        return reaped
    for path in sorted(leases.glob("*.json")):
        try:
            data = json.loads(path.read_text())
            run_id, host, pid, start = data["run_id"], data["host"], data["pid"], data["pid_start"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written, or not ours to judge
        if host != socket.gethostname() or alive(pid, start):
            continue
        reaped[run_id] = reap_sandboxes("local", {"state_dir": str(state_dir)}, run_id)
        path.unlink(missing_ok=True)
    return reaped

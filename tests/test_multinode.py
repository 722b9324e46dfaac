"""Multi-node: the median sweep on a real two-node Ray cluster on this machine.

Each node is a `ray start --block` process in a session of its own, with its own
state directory (HARNESS_HOME), its own ports and one CPU. The driver is a
`harness run` subprocess with a third state directory: it has the environment's
build there and pushes the snapshot to a store (a local directory); every node
pulls it on first use. Ray's token auth is on, with a token of the test's own.
Only the sessions started here are stopped; the cluster's temp dir is private,
so no other Ray client on the machine finds the cluster.
"""

from __future__ import annotations

import collections
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness_fixtures import MEDIAN_CONFIG, ROOT, median_env, needs_sandbox, state_dir

from harness.dataset import load_episodes, read_manifest
from harness.sandbox import open_provider

pytestmark = needs_sandbox

RAY = Path(sys.executable).with_name("ray")


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class LocalCluster:
    """Ray nodes as `ray start --block` subprocesses, each in a session of its own
    (Ray's workers get process groups of their own, but stay in the session)."""

    def __init__(self, root: Path):
        self.root = root
        self.procs: list[subprocess.Popen] = []
        self.address = ""

    def add_node(self, home: Path, *, head: bool) -> None:
        ports = free_ports(10)
        worker_lo = 10000 + (ports[9] % 20000)  # below the ephemeral range that free_ports draws from
        temp = self.root / f"ray{len(self.procs)}"  # short: Ray's socket paths must fit in 107 bytes
        args = [str(RAY), "start", "--block", "--num-cpus=1",
                "--object-store-memory=100000000", "--disable-usage-stats", f"--temp-dir={temp}",
                f"--node-manager-port={ports[0]}", f"--object-manager-port={ports[1]}",
                f"--dashboard-agent-listen-port={ports[2]}", f"--dashboard-agent-grpc-port={ports[3]}",
                f"--metrics-export-port={ports[4]}", f"--runtime-env-agent-port={ports[5]}",
                f"--min-worker-port={worker_lo}", f"--max-worker-port={worker_lo + 40}"]
        if head:
            self.address = f"127.0.0.1:{ports[6]}"
            args += ["--head", f"--port={ports[6]}", "--include-dashboard=false",
                     f"--ray-client-server-port={ports[7]}", f"--dashboard-port={ports[8]}"]
        else:
            args += [f"--address={self.address}"]
        env = driver_env(HARNESS_HOME=str(home))
        with open(self.root / f"node{len(self.procs)}.log", "wb") as log:
            self.procs.append(subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT,
                                               start_new_session=True))

    def wait_nodes(self, n: int, timeout: float = 60.0) -> None:
        """Until the cluster has ``n`` live nodes (asked by a short-lived driver process)."""
        probe = (
            "import sys, time, ray\n"
            "ray.init(address=sys.argv[1], logging_level='ERROR', log_to_driver=False)\n"
            "deadline = time.monotonic() + float(sys.argv[3])\n"
            "while sum(1 for n in ray.nodes() if n['Alive']) < int(sys.argv[2]):\n"
            "    assert time.monotonic() < deadline, ray.nodes()\n"
            "    time.sleep(0.2)\n"
        )
        p = subprocess.run([sys.executable, "-c", probe, self.address, str(n), str(timeout)], env=driver_env(),
                           capture_output=True, text=True, timeout=timeout + 30)
        assert p.returncode == 0, f"the cluster did not get {n} nodes: {p.stderr[-2000:]}\n{self.logs()}"

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-2000:] for p in sorted(self.root.glob("node*.log")))

    def stop(self) -> None:
        """SIGTERM, then SIGKILL, to the processes of the sessions started here (the
        worker node's first), nothing else."""
        for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 10.0)):
            for p in reversed(self.procs):
                for pid in session_members(p.pid):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and any(session_members(p.pid) for p in self.procs):
                time.sleep(0.2)
        for p in self.procs:
            p.wait(timeout=10)


#: The test cluster's own Ray auth token (not the user's ~/.ray/auth_token, which may not exist).
RAY_TOKEN = secrets.token_hex(32)


def driver_env(**extra: str) -> dict[str, str]:
    """The environment of the cluster's processes and its clients: Ray's token auth
    on, with the test's own token (Ray reads both at process start)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != "HARNESS_SNAPSHOT_STORE"}
    return {**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": RAY_TOKEN, **extra}


def session_members(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid``."""
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                stat = (proc / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, session, ...
            if int(fields[3]) == sid and fields[0] != "Z":
                out.append(int(proc.name))
    return out


def processes_under(path: Path) -> list[str]:
    """Processes whose command line mentions ``path`` (the cluster's temp dirs)."""
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(path) in cmdline:
                out.append(f"{proc.name}: {cmdline[:150]}")
    return out


def test_median_sweep_across_two_nodes(tmp_path: Path) -> None:
    """`harness run` with ray.address and sandbox.store, as a user runs it on a cluster."""
    snapshot = median_env().snapshot  # the driver's own state dir has the build (cached by content hash)
    root = Path(tempfile.mkdtemp(prefix="hmn-"))  # short: Ray's socket paths live under it
    homes = [root / "node0", root / "node1"]
    store = tmp_path / "store"
    cluster = LocalCluster(root)
    try:
        cluster.add_node(homes[0], head=True)
        cluster.wait_nodes(1)
        cluster.add_node(homes[1], head=False)
        cluster.wait_nodes(2)
        p = subprocess.run(
            [sys.executable, "-m", "harness.cli", "run", str(MEDIAN_CONFIG), f"output.dir={tmp_path / 'results'}",
             "output.run_id=multinode", "episodes=2", "actors=2", f"ray.address={cluster.address}",
             f"sandbox.store={store}", "--no-progress"],
            cwd=ROOT, env=driver_env(HARNESS_HOME=str(state_dir()), COLUMNS="120"), capture_output=True, text=True,
            timeout=180)
    finally:
        cluster.stop()
        leftovers = processes_under(root)
        pulled = {}
        for home in homes:  # what each node's state dir got; then unmount its run filesystem
            if (home / "run").is_dir():
                provider = open_provider("local", state_dir=home)
                try:
                    info = provider.snapshot_store.get(snapshot)
                    pulled[home.name] = (all(provider.layers.path(layer).is_dir() for layer in info.layers
                                             if layer != provider.layers.EMPTY)
                                         and (home / f".pull-{snapshot}.lock").exists()
                                         and provider.list() == [])
                except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                    pulled[home.name] = repr(exc)
                provider.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    assert leftovers == [], leftovers
    assert all(not session_members(proc.pid) for proc in cluster.procs)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"snapshot {snapshot} in the store" in p.stderr

    # the same results as on one node
    run_dir = tmp_path / "results" / "multinode"
    manifest = read_manifest(run_dir)
    assert manifest["status"] == "finished" and manifest["episodes_failed"] == 0
    assert manifest["env"]["snapshot"] == snapshot and manifest["env"]["baseline"]["reward"] == 0.5
    means = {(r["point"]["policy.id"], r["method"]): r["mean_reward"] for r in manifest["results"]}
    assert means == {(i, m): (0.75 if i == 0 else 1.0) for i in (0, 1, 2) for m in ("new_from", "fork")}
    assert manifest["config"]["sandbox"]["store"] == str(store)

    # episodes ran on both nodes (the host column carries the Ray node id)
    episodes = load_episodes(run_dir)
    assert episodes.num_rows == 12 and episodes.column("error").null_count == 12
    hosts = collections.Counter(episodes.column("host").to_pylist())
    assert len(hosts) == 2 and all(h.startswith(socket.gethostname() + "/") for h in hosts), hosts

    # the store has the snapshot; each node pulled it (with its layers) into its own state
    # dir, and no sandbox is left there
    assert (store / "snapshots" / f"{snapshot}.json").is_file()
    assert pulled == {"node0": True, "node1": True}


def test_store_options_and_errors(tmp_path: Path) -> None:
    """With sandbox.store, actors open their own node's state dir and pull from the store;
    without it, every actor opens the driver's. The store is for backend local only."""
    from harness.config import load_config
    from harness.driver import _provider_options
    from harness.errors import ConfigError

    base = [f"output.dir={tmp_path}"]
    cfg = load_config(MEDIAN_CONFIG, [*base, f"sandbox.state_dir={tmp_path / 'state'}"])
    assert _provider_options(cfg, actors=True) == _provider_options(cfg) == {"state_dir": str(tmp_path / "state")}
    cfg = load_config(MEDIAN_CONFIG, [*base, "sandbox.store=s3://bucket/snaps"])
    driver, actors = _provider_options(cfg), _provider_options(cfg, actors=True)
    assert driver["snapshot_store"] == actors["snapshot_store"] == "s3://bucket/snaps"
    assert "state_dir" in driver and "state_dir" not in actors
    cfg = load_config(MEDIAN_CONFIG, [*base, "sandbox.store=rel/store"])
    assert _provider_options(cfg, actors=True)["snapshot_store"] == str(Path("rel/store").resolve())
    try:
        load_config(MEDIAN_CONFIG, [*base, "sandbox.backend=http", "sandbox.store=/srv/store"])
    except ConfigError as exc:
        assert "HARNESS_SNAPSHOT_STORE" in str(exc)
    else:
        raise AssertionError("sandbox.store with backend http must be refused")

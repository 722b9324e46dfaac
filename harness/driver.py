"""`harness run CONFIG [key=value ...]`: config -> build -> Ray actor pool -> datasets.

All sweep points of a run share one environment build and one actor pool.
Episodes are handed out as actors free up (``ray.wait``), not in lockstep, and
each finished episode is appended to the Parquet datasets at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import secrets
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from harness import config as C
from harness.actors import EpisodeWorker
from harness.dataset import DatasetWriter, write_manifest
from harness.env import EnvSpec, build_env
from harness.episode import EpisodeRequest, EpisodeResult, failed_result
from harness.errors import ConfigError, HarnessError
from harness.policy import describe as describe_policy
from harness.policy import make_policy
from harness.sandbox import default_state_dir, open_provider

#: Seconds to wait for the actors to start before reporting that Ray cannot place them.
ACTOR_START_TIMEOUT_S = 120.0


@dataclass
class PointStats:
    """Running figures of one sweep point, for the progress bar and the final table."""

    point_id: int
    point: dict[str, Any]
    method: str
    policy: str
    episodes: int = 0
    errors: int = 0
    rewards: list[float] = field(default_factory=list)
    start_s: list[float] = field(default_factory=list)
    grade_s: list[float] = field(default_factory=list)

    def add(self, r: EpisodeResult) -> None:
        self.episodes += 1
        if r.error_type is not None:
            self.errors += 1
        if r.reward is not None:
            self.rewards.append(r.reward)
            self.start_s.append(r.acquire_seconds)
            self.grade_s.append(r.grade_seconds)

    @property
    def mean_reward(self) -> float | None:
        return statistics.fmean(self.rewards) if self.rewards else None


@dataclass
class RunSummary:
    run_id: str
    run_dir: Path
    snapshot: str
    baseline: dict[str, Any]
    points: list[PointStats]
    seconds: float
    interrupted: bool = False

    @property
    def errors(self) -> int:
        return sum(p.errors for p in self.points)


def _p50(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f}" if xs else "-"


def summary_table(summary: RunSummary) -> Table:
    """One row per sweep point: its swept values, then the figures."""
    baseline = summary.baseline.get("reward")
    table = Table(title=f"run {summary.run_id}: baseline reward {baseline}", caption=f"snapshot {summary.snapshot}")
    keys = list(summary.points[0].point) if summary.points else []
    if "method" not in keys:
        keys.append("method")
    for key in keys:
        table.add_column(key)
    for col in ("episodes", "mean reward", "errors", "start s p50", "grade s p50"):
        table.add_column(col, justify="right")
    for p in summary.points:
        values = [str(p.point.get(k, p.method if k == "method" else "")) for k in keys]
        mean = f"{p.mean_reward:.3f}" if p.mean_reward is not None else "-"
        table.add_row(*values, str(p.episodes), mean, str(p.errors), _p50(p.start_s), _p50(p.grade_s))
    return table


def _versions() -> dict[str, str]:
    import platform

    import omegaconf
    import pyarrow
    import ray

    from harness import __version__ as harness_version

    return {"harness": harness_version, "ray": ray.__version__, "pyarrow": pyarrow.__version__,
            "omegaconf": omegaconf.__version__,
            "python": platform.python_version()}


def _requests(cfg: DictConfig, run_id: str) -> tuple[list[EpisodeRequest], list[PointStats], list[dict[str, Any]]]:
    requests, stats, resolved = [], [], []
    for point_id, point in enumerate(C.points(cfg)):
        data = C.point_config(cfg, point)
        policy_cfg = data["policy"]
        probe = make_policy(policy_cfg)  # fail fast on a bad policy config, before any build
        if hasattr(probe, "close"):
            probe.close()
        resolved.append({"point_id": point_id, "point": point, "policy": policy_cfg, "method": data["method"]})
        stats.append(PointStats(point_id, point, data["method"], describe_policy(policy_cfg)))
        chash = C.config_hash(data)
        for _ in range(int(data["episodes"])):
            requests.append(EpisodeRequest(
                run_id=run_id, episode_id=len(requests), method=data["method"], policy=policy_cfg,
                point_id=point_id, point=point, max_steps=int(policy_cfg["max_steps"]),
                step_timeout=float(policy_cfg["step_timeout"]), max_output_bytes=int(data["output"]["max_output_bytes"]),
                sandbox_type=data["sandbox"]["type"], ttl_s=float(data["sandbox"]["ttl_s"]),
                network=bool(data["sandbox"]["network"]), config_hash=chash,
            ))
    return requests, stats, resolved


def _init_ray(cfg: DictConfig) -> bool:
    """Start or join Ray unless the caller already did; True if we must shut it down."""
    import ray

    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.ERROR,
                              "log_to_driver": False, "configure_logging": True}
    if cfg.ray.address:
        ray.init(address=cfg.ray.address, **kwargs)
    else:
        ray.init(num_cpus=cfg.ray.num_cpus, **kwargs)
    return True


def _provider_options(cfg: DictConfig, *, actors: bool = False) -> dict[str, Any]:
    """The provider's keyword arguments on the driver, or (``actors``) in the actors.

    Without ``sandbox.store`` the state directory is resolved here, so that every
    actor opens the very same one. With it, an actor opens its own node's
    (``sandbox.state_dir``, else the node's default, e.g. its $HARNESS_HOME) and
    pulls the snapshot from the store on first use."""
    options = dict(OmegaConf.to_container(cfg.sandbox.options, resolve=True))  # type: ignore[arg-type]
    if cfg.sandbox.backend == "local":
        store = cfg.sandbox.store
        if store:
            options["snapshot_store"] = store if "://" in store else str(Path(store).expanduser().resolve())
        if not (actors and store and not cfg.sandbox.state_dir):
            options["state_dir"] = str(Path(cfg.sandbox.state_dir or default_state_dir()).resolve())
    return options


def reap_sandboxes(backend: str, options: dict[str, Any], run_id: str, only: set[str] | None = None) -> list[str]:
    """Delete this run's sandboxes still alive (episodes and fork sources, found by name):
    the guard against leaks when an actor died or was killed before its own cleanup."""
    pattern = re.compile(rf"^{re.escape(run_id)}-(ep\d+|a\d+-source)$")
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


def _dispatch(actors: list[Any], new_actor: Callable[[int], Any], requests: list[EpisodeRequest],
              finished: Callable[[EpisodeResult], None], reap: Callable[[set[str]], Any], retries: int = 0) -> None:
    """Hand episodes out one at a time as actors free up (not in lockstep); an actor that
    dies yields an error row for its episode and is replaced. An infrastructure failure
    is retried up to ``retries`` times; only the last attempt becomes a row."""
    import ray

    queue = list(reversed(requests))
    inflight: dict[Any, tuple[int, EpisodeRequest]] = {}

    def submit(slot: int) -> None:
        if queue:
            req = queue.pop()
            inflight[actors[slot].run.remote(req)] = (slot, req)

    for slot in range(len(actors)):
        submit(slot)
    while inflight:
        ready, _ = ray.wait(list(inflight), num_returns=1)
        slot, req = inflight.pop(ready[0])
        try:
            result = ray.get(ready[0])
        except ray.exceptions.RayError as exc:
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            result = failed_result(req, type(exc).__name__, message, "actor", actor=f"{req.run_id}-a{slot}")
            ray.kill(actors[slot], no_restart=True)
            reap({f"{req.run_id}-ep{req.episode_id}", f"{req.run_id}-a{slot}-source"})
            actors[slot] = new_actor(slot)
        if result.infra_error and req.attempt < retries:
            queue.append(dataclasses.replace(req, attempt=req.attempt + 1))  # next out of the queue
        else:
            finished(result)
        submit(slot)


def run(cfg: DictConfig, *, console: Console | None = None, show_progress: bool = True,
        on_result: Callable[[EpisodeResult], None] | None = None) -> RunSummary:
    """Build once, run every episode of every sweep point on one actor pool, write datasets."""
    import ray

    console = console or Console(stderr=True)
    t_run = time.monotonic()
    run_id = cfg.output.run_id or time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)
    requests, stats, resolved = _requests(cfg, run_id)
    run_dir = Path(cfg.output.dir).expanduser().resolve() / run_id
    if (run_dir / "episodes").exists() and any((run_dir / "episodes").iterdir()):
        raise ConfigError(f"run directory {run_dir} already has episodes; choose another output.run_id")

    options = _provider_options(cfg)
    actor_options = _provider_options(cfg, actors=True)
    # With sandbox.hosts, each server is a provider of its own: it builds the
    # environment (cached by content hash) and serves the actors given to it.
    host_options = [{**options, "url": url} for url in cfg.sandbox.hosts] or [options]
    # Actors keep their sandboxes in their own node's state directory (sandbox.store).
    node_local = cfg.sandbox.backend == "local" and "state_dir" not in actor_options
    env_data = OmegaConf.to_container(cfg.env, resolve=True)
    env_spec = EnvSpec.from_dict({**env_data, "type": cfg.sandbox.type})  # type: ignore[dict-item]
    n_actors = min(int(cfg.actors), len(requests))
    owns_ray = _init_ray(cfg)
    try:
        cpus = ray.cluster_resources().get("CPU", 0.0)
        if n_actors * cfg.ray.actor_cpus > cpus:
            raise ConfigError(f"actors={n_actors} x ray.actor_cpus={cfg.ray.actor_cpus} need more CPUs than Ray "
                              f"has ({cpus:g}); lower actors or ray.actor_cpus")
        n_nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
        spread = cfg.ray.spread if cfg.ray.spread is not None else n_nodes > 1
        if n_nodes > 1 and cfg.sandbox.backend == "local" and not cfg.sandbox.store:
            console.print(f"[yellow]Ray has {n_nodes} nodes but sandbox.store is not set: actors on other nodes "
                          "find the snapshot only if the state directory is shared; set sandbox.store=URI")
        for opts in reversed(host_options):  # the first host's build is the one recorded
            with open_provider(cfg.sandbox.backend, **opts) as provider:
                built = build_env(provider, env_spec, rebuild=bool(cfg.rebuild),
                                  log=lambda m: console.print(f"[dim]{escape(m)}"))
            if cfg.sandbox.store:
                t_push = time.monotonic()
                with open_provider(cfg.sandbox.backend, **options) as provider:
                    provider.push_snapshot(built.snapshot, options["snapshot_store"])  # type: ignore[attr-defined]
                console.print(f"[dim]env {escape(env_spec.name)}: snapshot {built.snapshot} in the store "
                              f"{escape(options['snapshot_store'])} ({time.monotonic() - t_push:.1f}s)")
    except BaseException:
        if owns_ray:
            ray.shutdown()
        raise

    manifest: dict[str, Any] = {
        "run_id": run_id, "status": "running", "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        # resolved: interpolations filled with the base values; each point's own resolved
        # policy is under points, and the config as written (with ${...}) under config_source.
        "config": OmegaConf.to_container(cfg, resolve=True),
        "config_source": OmegaConf.to_container(cfg, resolve=False),
        "points": resolved, "episodes_total": len(requests),
        "env": {"snapshot": built.snapshot, "content_hash": built.content_hash, "cached": built.cached,
                "build_seconds": built.build_seconds, "baseline": dict(built.baseline)},
        "versions": _versions(),
    }
    write_manifest(run_dir, manifest)
    writer = DatasetWriter(run_dir, batch_rows=cfg.output.batch_rows, flush_seconds=cfg.output.flush_seconds)

    # max_concurrency=2 lets close() run while an episode is in flight (Ctrl-C cleanup).
    Worker = ray.remote(num_cpus=cfg.ray.actor_cpus, max_concurrency=2)(EpisodeWorker)
    grade = dict(env_data["grade"])  # type: ignore[index]

    if spread:
        Worker = Worker.options(scheduling_strategy="SPREAD")
    node_refs: list[Any] = []  # each actor's Ray node, where its leftovers are reaped (node_local)

    def new_actor(i: int):
        opts = {**actor_options, **host_options[i % len(host_options)]} if cfg.sandbox.hosts else actor_options
        actor = Worker.remote(built.snapshot, grade, backend=cfg.sandbox.backend, provider_options=opts,
                              name=f"{run_id}-a{i}")
        if node_local:
            node_refs.append(actor.node_id.remote())
        return actor

    def reap(only: set[str] | None = None) -> list[str]:
        deleted = [d for opts in host_options for d in reap_sandboxes(cfg.sandbox.backend, opts, run_id, only)]
        if node_local and node_refs:
            known, _ = ray.wait(node_refs, num_returns=len(node_refs), timeout=10)
            nodes = set()
            for ref in known:
                try:
                    nodes.add(ray.get(ref))
                except ray.exceptions.RayError:
                    pass  # the actor died before it said where it was
            deleted += reap_on_nodes(cfg.sandbox.backend, actor_options, run_id, nodes - {None}, only)
        return deleted

    actors = [new_actor(i) for i in range(n_actors)]
    status, counts = "failed", {"done": 0, "failures": 0}
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("failures {task.fields[failures]}  mean reward {task.fields[mean]}"),
                        TimeElapsedColumn(), console=console, disable=not show_progress)
    try:
        try:
            ray.get([a.ready.remote() for a in actors], timeout=ACTOR_START_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError as exc:
            raise HarnessError(f"Ray could not start {n_actors} actors in {ACTOR_START_TIMEOUT_S:.0f}s; "
                               "lower actors or ray.actor_cpus, or add nodes") from exc
        with progress:
            task = progress.add_task(f"run {run_id}", total=len(requests), failures=0, mean="-")
            rewards: list[float] = []

            def finished(result: EpisodeResult) -> None:
                writer.add(result, stats[result.request.point_id].policy)
                stats[result.request.point_id].add(result)
                counts["done"] += 1
                counts["failures"] += result.error_type is not None
                if result.reward is not None:
                    rewards.append(result.reward)
                progress.update(task, advance=1, failures=counts["failures"],
                                mean=f"{statistics.fmean(rewards):.3f}" if rewards else "-")
                if on_result:
                    on_result(result)

            _dispatch(actors, new_actor, requests, finished, reap, int(cfg.retries))
        status = "finished"
    except KeyboardInterrupt:
        status = "interrupted"
        console.print("[yellow]interrupted: deleting sandboxes and writing what finished")
    finally:
        closing = [a.close.remote() for a in actors]
        try:
            ray.wait(closing, num_returns=len(closing), timeout=30)
        finally:
            for a in actors:
                ray.kill(a, no_restart=True)
            try:
                leaked = reap()
                if leaked:
                    console.print(f"[yellow]deleted {len(leaked)} sandboxes left by actors: {', '.join(leaked)}")
            except HarnessError as exc:
                console.print(f"[yellow]could not check for leftover sandboxes: {escape(str(exc))}")
            writer.close()
            manifest.update(
                status=status, episodes_done=counts["done"], episodes_failed=counts["failures"],
                seconds=round(time.monotonic() - t_run, 3),
                finished_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                results=[{"point": p.point, "method": p.method, "episodes": p.episodes, "errors": p.errors,
                          "mean_reward": p.mean_reward} for p in stats],
            )
            write_manifest(run_dir, manifest)
            if owns_ray:
                ray.shutdown()
    return RunSummary(run_id, run_dir, built.snapshot, dict(built.baseline), stats,
                      time.monotonic() - t_run, status == "interrupted")


def _describe(out: Console) -> None:
    table = Table(title="harness run: configuration keys")
    for col in ("key", "type", "default", "meaning"):
        table.add_column(col, overflow="fold")
    for row in C.describe():
        table.add_row(*row)
    out.print(table)


def run_command(args: argparse.Namespace) -> int:
    """Entry of `harness run`: 0 when every episode went well, 1 if some failed, 2 on errors."""
    out, err = Console(), Console(stderr=True)
    debug = bool(getattr(args, "debug", False))
    try:
        if getattr(args, "describe", False):
            _describe(out)
            return 0
        if not args.config:
            raise ConfigError("no config given; run `harness run CONFIG [key=value ...]`, e.g. configs/median.yaml")
        overrides = list(args.overrides or [])
        if getattr(args, "rebuild", False):
            overrides.append("rebuild=true")
        cfg = C.load_config(args.config, overrides)
        summary = run(cfg, console=err, show_progress=not getattr(args, "no_progress", False))
    except HarnessError as exc:
        if debug:
            raise
        err.print(f"[red]harness run: error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 2
    except Exception as exc:
        if debug:
            raise
        err.print(f"[red]harness run: internal error:[/red] {type(exc).__name__}: {escape(' '.join(str(exc).split()))}; "
                  "run again with --debug for the traceback", highlight=False, soft_wrap=True)
        return 2
    out.print(summary_table(summary))
    out.print(f"datasets: {summary.run_dir}  ({sum(p.episodes for p in summary.points)} episodes, "
              f"{summary.errors} errors, {summary.seconds:.1f}s)", highlight=False, soft_wrap=True)
    if summary.interrupted:
        return 130
    return 1 if summary.errors else 0


if __name__ == "__main__":  # `python -m harness.driver ...` is `harness run ...`
    from harness.cli import main

    sys.exit(main(["run", *sys.argv[1:]]))

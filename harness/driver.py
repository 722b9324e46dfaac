"""`harness run CONFIG [key=value ...]`: config -> build -> Ray actor pool -> datasets.

All sweep points of a run share one environment build and one actor pool.
Episodes are handed out as actors free up (``ray.wait``), not in lockstep, and
each finished episode is appended to the Parquet datasets at once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import secrets
import signal
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from harness import config as C
from harness import rundir
from harness.actors import EpisodeWorker
from harness.dataset import DatasetWriter, drop_episodes, episode_row, load_episodes, recover, step_rows, write_manifest
from harness.dispatch import Dispatcher, RetryPolicy
from harness.env import EnvSpec, build_env
from harness.episode import EpisodeRequest, EpisodeResult
from harness.errors import ConfigError, DatasetWriteError, HarnessError, InfrastructureDown
from harness.policy import describe as describe_policy
from harness.policy import make_policy
from harness.runs import lease, reap_dead_runs, reap_on_nodes, reap_sandboxes
from harness.summary import PointStats, RunSummary, summary_table
from harness.sandbox import default_state_dir, open_provider

#: Seconds to wait for the actors to start before reporting that Ray cannot place them.
ACTOR_START_TIMEOUT_S = 120.0
#: Config keys that say how a run is carried out, not what its episodes are (see _episode_data).
RUN_MECHANICS = ("actors", "retries", "retry_backoff_s", "rebuild", "ray", "output.dir", "output.run_id",
                 "output.batch_rows", "output.flush_seconds", "sandbox.backend", "sandbox.state_dir",
                 "sandbox.options", "sandbox.hosts", "sandbox.store")


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
        chash = C.config_hash(_episode_data(data))
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


def _episode_data(data: dict[str, Any]) -> dict[str, Any]:
    """A point's config without the keys that only say how the run is carried out
    (actors, retries, Ray, where datasets go, which sandbox hosts): their hash is the
    ``config_hash`` column, the same for a run and its resumes."""
    data = json.loads(json.dumps(data, default=str))
    for key in RUN_MECHANICS:
        node, *rest = key.split(".")
        if rest:
            data.get(node, {}).pop(rest[0], None)
        else:
            data.pop(node, None)
    return data


def _resume_plan(run_dir: Path, requests: list[EpisodeRequest], retry_failed: bool,
                 console: Console) -> tuple[list[EpisodeRequest], list[dict[str, Any]], int]:
    """(requests still to run, rows already written, rows dropped to run again)."""
    recovered = recover(run_dir)
    if recovered:
        console.print(f"[dim]recovered {recovered} journalled episodes into part files")
    rows = load_episodes(run_dir).select(["episode_id", "point_id", "error_type", "reward", "acquire_seconds",
                                          "grade_seconds", "infra_error"]).to_pylist()
    dropped = 0
    if retry_failed:
        failed = {r["episode_id"] for r in rows if r["infra_error"]}
        drop_episodes(run_dir, failed)
        rows = [r for r in rows if r["episode_id"] not in failed]
        dropped = len(failed)
    done = {r["episode_id"] for r in rows}
    if len(done) != len(rows):
        raise HarnessError(f"run directory {run_dir} has duplicate episode rows; it was written by two drivers at "
                           "once or edited by hand")
    return [r for r in requests if r.episode_id not in done], rows, dropped


def run(cfg: DictConfig, *, console: Console | None = None, show_progress: bool = True,
        on_result: Callable[[EpisodeResult], None] | None = None, resume: bool = False,
        retry_failed: bool = False) -> RunSummary:
    """Build once, run every episode of every sweep point on one actor pool, write datasets.

    With ``resume``, the run directory of ``cfg.output.run_id`` must exist: only the
    episodes without a row run (plus, with ``retry_failed``, those whose row is an
    infrastructure failure), and the rows go to the same datasets."""
    console = console or Console(stderr=True)
    run_id = cfg.output.run_id or time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)
    run_dir = Path(cfg.output.dir).expanduser().resolve() / run_id
    if not resume and (run_dir / "manifest.yaml").exists():
        raise ConfigError(f"run directory {run_dir} already exists; resume it with `harness run --resume "
                          f"{run_dir}`, or choose another output.run_id")
    with rundir.locked(run_dir):
        try:
            return _run_locked(cfg, run_id, run_dir, console, show_progress, on_result, resume, retry_failed)
        finally:
            if not (run_dir / "manifest.yaml").exists():  # failed before it started: leave nothing of ours
                (run_dir / ".lock").unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    run_dir.rmdir()  # only if empty: never remove what someone else put there


def _run_locked(cfg: DictConfig, run_id: str, run_dir: Path, console: Console, show_progress: bool,
                on_result: Callable[[EpisodeResult], None] | None, resume: bool, retry_failed: bool) -> RunSummary:
    import ray

    t_run = time.monotonic()
    all_requests, stats, resolved = _requests(cfg, run_id)
    fingerprint = rundir.episodes_fingerprint(all_requests)
    options = _provider_options(cfg)
    actor_options = _provider_options(cfg, actors=True)
    if cfg.sandbox.backend == "local":
        for dead, names in reap_dead_runs(options["state_dir"]).items():
            if names:
                console.print(f"[yellow]deleted {len(names)} sandboxes left by the crashed run {escape(dead)}")
    # With sandbox.hosts, each server is a provider of its own: it builds the
    # environment (cached by content hash) and serves the actors given to it.
    host_options = [{**options, "url": url} for url in cfg.sandbox.hosts] or [options]
    # Actors keep their sandboxes in their own node's state directory (sandbox.store).
    node_local = cfg.sandbox.backend == "local" and "state_dir" not in actor_options
    env_data = OmegaConf.to_container(cfg.env, resolve=True)
    env_spec = EnvSpec.from_dict({**env_data, "type": cfg.sandbox.type})  # type: ignore[dict-item]
    owns_ray = _init_ray(cfg)
    if _stop_on_sigterm:  # ray.init installs its own SIGTERM handler, which would skip the cleanup
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        cpus = ray.cluster_resources().get("CPU", 0.0)
        n_actors = min(int(cfg.actors), len(all_requests))
        if n_actors * cfg.ray.actor_cpus > cpus:
            raise ConfigError(f"actors={n_actors} x ray.actor_cpus={cfg.ray.actor_cpus} need more CPUs than Ray "
                              f"has ({cpus:g}); lower actors or ray.actor_cpus")
        n_nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
        spread = cfg.ray.spread if cfg.ray.spread is not None else n_nodes > 1
        if n_nodes > 1 and cfg.sandbox.backend == "local" and not cfg.sandbox.store:
            console.print(f"[yellow]Ray has {n_nodes} nodes but sandbox.store is not set: actors on other nodes "
                          "find the snapshot only if the state directory is shared; set sandbox.store=URI")
        if resume:
            # The leftovers of the interrupted driver, wherever they are (local or on the hosts).
            for opts in host_options:
                reap_sandboxes(cfg.sandbox.backend, opts, run_id)
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
        if resume:
            manifest = rundir.check_resumable(run_dir, fingerprint, built.content_hash)
            requests, rows, dropped = _resume_plan(run_dir, all_requests, retry_failed, console)
            manifest.setdefault("resumes", []).append({
                "at": _now(), "episodes_to_run": len(requests), "rows_dropped_to_retry": dropped})
            console.print(f"[dim]resuming run {run_id}: {len(rows)} episodes have rows, {len(requests)} to run")
        else:
            requests, rows = all_requests, []
            manifest = {
                "run_id": run_id, "status": "running", "started_at": _now(),
                # resolved: interpolations filled with the base values; each point's own resolved
                # policy is under points, and the config as written (with ${...}) in config.yaml.
                "config": rundir.redact(OmegaConf.to_container(cfg, resolve=True)),
                "points": resolved, "episodes_total": len(all_requests), "episodes_fingerprint": fingerprint,
                "env": {"snapshot": built.snapshot, "content_hash": built.content_hash, "cached": built.cached,
                        "build_seconds": built.build_seconds, "baseline": dict(built.baseline)},
                "versions": _versions(),
            }
            rundir.write_config(run_dir, cfg)
        manifest["status"] = "running"
        write_manifest(run_dir, manifest)  # from here on the run is resumable
    except BaseException:
        if owns_ray:
            ray.shutdown()
        raise
    for row in rows:
        stats[row["point_id"]].add(row)
    writer = DatasetWriter(run_dir, batch_rows=cfg.output.batch_rows, flush_seconds=cfg.output.flush_seconds)
    run_lease = lease(options["state_dir"], run_id, run_dir) if cfg.sandbox.backend == "local" else nullcontext()

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
        deleted: list[str] = []
        try:
            for opts in host_options:
                deleted += reap_sandboxes(cfg.sandbox.backend, opts, run_id, only)
            if node_local and node_refs:
                known, _ = ray.wait(node_refs, num_returns=len(node_refs), timeout=10)
                nodes = set()
                for ref in known:
                    try:
                        nodes.add(ray.get(ref))
                    except ray.exceptions.RayError:
                        pass  # the actor died before it said where it was
                deleted += reap_on_nodes(cfg.sandbox.backend, actor_options, run_id, nodes - {None}, only)
        except Exception as exc:  # a cleanup must never end the run: the next reap and the TTL remain
            console.print(f"[yellow]could not delete leftover sandboxes of run {run_id}: {type(exc).__name__}: "
                          f"{escape(' '.join(str(exc).split()))}; the next cleanup or their TTL removes them")
        return deleted

    actors: list[Any] = []
    stopped: InfrastructureDown | DatasetWriteError | None = None
    status, counts = "failed", {"done": len(rows), "failures": sum(r["error_type"] is not None for r in rows)}
    rewards = [r["reward"] for r in rows if r["reward"] is not None]
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("failures {task.fields[failures]}  mean reward {task.fields[mean]}"),
                        TimeElapsedColumn(), console=console, disable=not show_progress)
    try:
        with run_lease:
            try:
                actors = [new_actor(i) for i in range(min(n_actors, len(requests)))]
                try:
                    ray.get([a.ready.remote() for a in actors], timeout=ACTOR_START_TIMEOUT_S)
                except ray.exceptions.GetTimeoutError as exc:
                    raise HarnessError(f"Ray could not start {n_actors} actors in {ACTOR_START_TIMEOUT_S:.0f}s; "
                                       "lower actors or ray.actor_cpus, or add nodes") from exc
                with progress:
                    task = progress.add_task(f"run {run_id}", total=len(all_requests), completed=counts["done"],
                                             failures=counts["failures"], mean=_mean(rewards))

                    def finished(result: EpisodeResult) -> None:
                        row = episode_row(result, stats[result.request.point_id].policy)
                        writer.add_row(row, step_rows(result))  # durable before it counts as done
                        stats[result.request.point_id].add(row)
                        counts["done"] += 1
                        counts["failures"] += result.error_type is not None
                        if result.reward is not None:
                            rewards.append(result.reward)
                        progress.update(task, advance=1, failures=counts["failures"], mean=_mean(rewards))
                        if on_result:
                            on_result(result)

                    retry = RetryPolicy(int(cfg.retries), float(cfg.retry_backoff_s))
                    Dispatcher(actors, new_actor, finished, reap, retry).run(requests)
                status = "finished"
            except KeyboardInterrupt:
                status = "interrupted"
                console.print("[yellow]interrupted: cancelling running episodes, deleting their sandboxes")
            except (InfrastructureDown, DatasetWriteError) as exc:
                status, stopped = "stopped", exc
            finally:
                _stop_actors(actors)
                leaked = reap()
                if leaked:
                    console.print(f"[yellow]deleted {len(leaked)} sandboxes left by actors: {', '.join(leaked)}")
    finally:
        try:
            writer.close()
        except DatasetWriteError as exc:  # the journal keeps what was reported done
            status, stopped = "stopped", stopped or exc
        manifest.update(
            status=status, episodes_done=counts["done"], episodes_failed=counts["failures"],
            seconds=round(manifest.get("seconds", 0.0) + time.monotonic() - t_run, 3), finished_at=_now(),
            results=[{"point": p.point, "method": p.method, "episodes": p.episodes, "errors": p.errors,
                      "mean_reward": p.mean_reward} for p in stats],
        )
        try:
            write_manifest(run_dir, manifest)
        except OSError as exc:  # the last one written (status running) stays: resumable all the same
            console.print(f"[yellow]could not update {run_dir / 'manifest.yaml'}: {escape(str(exc))}")
        if owns_ray:
            ray.shutdown()
    if stopped is not None:
        raise type(stopped)(f"{stopped}: harness run --resume {run_dir}")
    if status == "interrupted":
        console.print(f"[yellow]{counts['done']} of {len(all_requests)} episodes have rows; finish the run with: "
                      f"harness run --resume {run_dir}", highlight=False, soft_wrap=True)
    return RunSummary(run_id, run_dir, built.snapshot, dict(built.baseline), stats,
                      time.monotonic() - t_run, status == "interrupted", len(all_requests))


def _stop_actors(actors: list[Any]) -> None:
    """Let each actor delete its sandboxes (close), then end it."""
    import ray

    closing = [a.close.remote() for a in actors]
    try:
        ray.wait(closing, num_returns=len(closing), timeout=30)
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _mean(xs: list[float]) -> str:
    return f"{statistics.fmean(xs):.3f}" if xs else "-"


#: Set by the command line: SIGTERM stops a run as Ctrl-C does (not for library callers).
_stop_on_sigterm = False


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


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
        overrides = list(args.overrides or [])
        resume = getattr(args, "resume", None)
        if resume and args.config:  # `run --resume DIR k=v`: the first override lands in config
            if "=" not in args.config:
                raise ConfigError("--resume takes the run directory instead of a config; drop the config argument")
            overrides.insert(0, args.config)
        elif not args.config and not resume:
            raise ConfigError("no config given; run `harness run CONFIG [key=value ...]`, e.g. configs/median.yaml")
        if getattr(args, "retry_failed", False) and not resume:
            raise ConfigError("--retry-failed goes with --resume RUN_DIR")
        if getattr(args, "rebuild", False):
            overrides.append("rebuild=true")
        cfg = rundir.resume_config(resume, overrides) if resume else C.load_config(args.config, overrides)
        # SIGTERM (a scheduler stopping the job, `kill`) stops the run as cleanly as Ctrl-C.
        global _stop_on_sigterm
        _stop_on_sigterm = True
        signal.signal(signal.SIGTERM, _interrupt)
        summary = run(cfg, console=err, show_progress=not getattr(args, "no_progress", False),
                      resume=bool(resume), retry_failed=bool(getattr(args, "retry_failed", False)))
    except KeyboardInterrupt:
        err.print("[yellow]harness run: interrupted before the run started; nothing to resume", highlight=False)
        return 130
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

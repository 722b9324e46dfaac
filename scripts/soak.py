#!/usr/bin/env python3
"""Soak run: the median sweep, long, with faults injected at random (a benchmark-style
script, not a test).

Runs ``configs/median.yaml`` (3 policies x 2 methods = 6 sweep points) through the
real driver (``harness.driver.run``, local Ray, real sandboxes) in a private state
directory, while a fault injector thread, at random intervals (exponential, mean
``--fault-every`` seconds, seeded by ``--seed``), does one of:

  actor    SIGKILL an EpisodeWorker actor process of *this* script's Ray instance
           (a process whose cmdline starts with "ray::EpisodeWorker" and whose parent
           chain leads to this process);
  sandbox  SIGKILL the jail (its init pid, from the record in the private state dir)
           of a live sandbox of this run (name ``<run_id>-ep<N>`` or ``-a<N>-source``);
  grade    make the grading of upcoming episodes hang: the policy (kind python,
           ``SoakPolicy`` below, which otherwise is the seed's
           ``cp policies/<id>.py task/stats.py``) plants ``task/conftest.py`` that sleeps,
           so ``grade.py``'s pytest hangs past ``env.grade.timeout``. The policy also
           plants one by itself with probability ``--hang-rate`` per episode. Such an
           episode must end as a GradeError row (never retried).

The run ends with one plain-text table: episodes expected, rows written, unique ids,
duplicates, lost, rows by class, faults by kind, leaked sandboxes / records /
mounts / processes / cgroups (after the run, and after ``provider.shutdown()``),
episodes per second. Exit status 0 only if lost == duplicated == leaked == 0
(130 after Ctrl-C, after the check and the cleanup).

Usage:
  .venv/bin/python scripts/soak.py [--episodes 1000] [--actors 2] [--seed 1] [--fault-every 2.0]
                                   [--quick] [--out DIR] [--keep]
"""

from __future__ import annotations

import argparse
import collections
import logging
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.config import load_config
from harness.dataset import load_episodes, load_steps
from harness.driver import run
from harness.sandbox import open_provider
from harness.sandbox._exec import REAPER_NAME
from harness.sandbox._jail import alive, process_start_time
from harness.sandbox._record import ID_RE, SandboxRecord

CONFIG = ROOT / "configs" / "median.yaml"
POINTS = 6  # the sweep of configs/median.yaml: policy.id [0, 1, 2] x method [new_from, fork]
HANG_MARK = "soak-hang"  # in the planting command, so the steps dataset tells which episodes hung

POLICY_SOURCE = f'''\
"""The soak's policy: the seed's stand-in (cp policies/<id>.py task/stats.py), which
sometimes also plants a task/conftest.py that sleeps, so that grading hangs."""
import os, random, time
from pathlib import Path

_rng = None


class SoakPolicy:
    def __init__(self, id=0, hang_rate=0.0, seed=0, marks=""):
        self.id, self.hang_rate, self.seed, self.marks = id, float(hang_rate), int(seed), Path(marks)

    def _hang(self):
        global _rng
        if _rng is None:
            _rng = random.Random(self.seed * 1000003 + os.getpid())
        if _rng.random() < self.hang_rate:
            return "random"
        # A grade fault asked for by the injector: the first episode to see it takes it.
        for req in sorted(self.marks.glob("hang-request-*")):
            try:
                req.rename(req.with_name("taken-" + req.name))
                return "injected"
            except OSError:
                continue  # another actor took it
        return None

    def act(self, obs):
        if obs.t != 0:
            return None
        cmd = f"cp policies/{{self.id}}.py task/stats.py"
        why = self._hang()
        if why:
            with open(self.marks / "hangs.log", "a") as f:
                f.write(f"{{time.time():.3f}} {{os.getpid()}} {{why}}\\n")
            cmd += (" && printf 'import time\\\\ntime.sleep(600)\\\\n' > task/conftest.py"
                    f"  # {HANG_MARK} {{why}}")
        return cmd
'''


# --- /proc helpers ---------------------------------------------------------------------------

def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _age(pid: int) -> float:
    """Seconds since the process started (0 if it is gone)."""
    start = process_start_time(pid)
    if start is None:
        return 0.0
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return uptime - start / os.sysconf("SC_CLK_TCK")


def _descends_from(pid: int, ancestor: int) -> bool:
    seen = 0
    while pid and pid > 1 and seen < 64:
        if pid == ancestor:
            return True
        pid = _ppid(pid) or 0
        seen += 1
    return False


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def my_actor_pids() -> list[int]:
    """EpisodeWorker actor processes of the Ray instance this process started."""
    me = os.getpid()
    return [pid for pid in _pids() if _cmdline(pid).startswith("ray::EpisodeWorker") and _descends_from(pid, me)]


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def my_descendants() -> list[tuple[int, str]]:
    """Live (not zombie) processes below this one: Ray's, once it is shut down, should be gone.
    This process's own exec watchdog is not counted: it lives exactly as long as this
    process does, by design (see harness.sandbox._exec)."""
    me = os.getpid()
    return [(pid, cmd) for pid in _pids() if pid != me and _descends_from(pid, me) and not _zombie(pid)
            and REAPER_NAME not in (cmd := _cmdline(pid))]


def processes_referencing(path: Path) -> list[tuple[int, str]]:
    """Processes whose command line names ``path`` (bwrap, its holder, slirp4netns...)."""
    needle, me = str(path), os.getpid()
    return [(pid, cmd) for pid in _pids() if pid != me and needle in (cmd := _cmdline(pid))]


def records(state_dir: Path) -> list[tuple[str, SandboxRecord | None]]:
    """Every sandbox directory (and half-deleted .trash-) in the state dir, with its record."""
    out: list[tuple[str, SandboxRecord | None]] = []
    d = state_dir / "sandboxes"
    if not d.is_dir():
        return out
    for entry in sorted(d.iterdir()):
        if not (ID_RE.match(entry.name) or entry.name.startswith(".trash-")):
            continue
        try:
            out.append((entry.name, SandboxRecord.load(entry / "meta.json")))
        except (OSError, ValueError, TypeError):
            out.append((entry.name, None))
    return out


def mounts_under(path: Path) -> list[str]:
    needle = str(path)
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mountpoint = line.split()[4]
        if mountpoint == needle or mountpoint.startswith(needle + "/"):
            out.append(mountpoint)
    return out


def cgroups_of(state_dir: Path) -> list[str]:
    """This state dir's sandbox cgroups still present (named <prefix>-sb_..., see LocalProvider)."""
    import hashlib

    prefix = hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:8]
    found = []
    for root in ("/sys/fs/cgroup", *(str(p) for p in Path("/sys/fs/cgroup").glob("*") if p.is_dir())):
        parent = Path(root) / "harness"
        if parent.is_dir():
            found += [str(g) for g in parent.glob(f"{prefix}-sb_*")]
    return sorted(set(found))


def tmpfs_leftovers(state_dir: Path) -> list[str]:
    """Sandbox upper dirs and ephemeral (fork) layers still on the provider's in-memory
    run filesystem: memory held after every sandbox is gone."""
    run_fs = state_dir / "run"
    if not run_fs.is_dir():
        return []
    out = [str(p) for p in run_fs.iterdir() if p.name != "eph"]
    if (run_fs / "eph").is_dir():
        out += [str(p) for p in (run_fs / "eph").iterdir()]
    return sorted(out)


# --- the fault injector ------------------------------------------------------------------------

@dataclass
class Fault:
    at: float
    kind: str
    target: str
    ok: bool


@dataclass
class Injector:
    state_dir: Path
    marks: Path
    run_id: str
    rng: random.Random
    mean_s: float
    kinds: dict[str, float]  # kind -> weight
    actor_min_age: float = 3.0
    log: list[Fault] = field(default_factory=list)
    stop_event: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def start(self) -> None:
        if self.thread is None and self.mean_s > 0 and self.kinds:
            self.thread = threading.Thread(target=self._loop, name="soak-injector", daemon=True)
            self.thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(timeout=10)

    def _loop(self) -> None:
        t0 = time.monotonic()
        # Every kind once first (in a random order, each until it found a target), so that
        # even a short run sees all of them; then at random by weight.
        first = self.rng.sample(list(self.kinds), len(self.kinds))
        while not self.stop_event.wait(self.rng.expovariate(1.0 / self.mean_s)):
            kind = first[0] if first else self.rng.choices(list(self.kinds), weights=list(self.kinds.values()))[0]
            try:
                target, ok = getattr(self, f"_{kind}")()
            except Exception as exc:  # the injector must never take the soak down
                target, ok = f"{type(exc).__name__}: {exc}", False
            self.log.append(Fault(time.monotonic() - t0, kind, target, ok))
            if ok and first and first[0] == kind:
                first.pop(0)

    def _actor(self) -> tuple[str, bool]:
        # Only actors that are up (not ones still starting): a real fault hits a working actor,
        # and killing replacements before they start would only measure Ray's start-up time.
        pids = [pid for pid in my_actor_pids() if _age(pid) >= self.actor_min_age]
        if not pids:
            return "no actor process up", False
        pid = self.rng.choice(pids)
        start, cmd = process_start_time(pid), _cmdline(pid)
        if not (start and cmd.startswith("ray::EpisodeWorker") and _descends_from(pid, os.getpid())):
            return f"pid {pid} went away", False
        os.kill(pid, signal.SIGKILL)
        return f"pid {pid} ({cmd})", True

    def _sandbox(self) -> tuple[str, bool]:
        live = [rec for _, rec in records(self.state_dir)
                if rec is not None and rec.name and rec.name.startswith(self.run_id + "-")
                and rec.init_pid and alive(rec.init_pid, rec.init_start)]
        if not live:
            return "no live sandbox of the run", False
        rec = self.rng.choice(live)
        if not alive(rec.init_pid, rec.init_start):
            return f"{rec.name} ended by itself", False
        try:
            os.kill(rec.init_pid, signal.SIGKILL)  # type: ignore[arg-type]
        except ProcessLookupError:
            return f"{rec.name} ended by itself", False
        return f"{rec.name} {rec.id} init pid {rec.init_pid}", True

    def _grade(self) -> tuple[str, bool]:
        req = self.marks / f"hang-request-{len(self.log):06d}"
        req.touch()
        return req.name, True


# --- the check ---------------------------------------------------------------------------------

@dataclass
class Leaks:
    live_sandboxes: list[str] = field(default_factory=list)
    record_dirs: list[str] = field(default_factory=list)
    mounts: list[str] = field(default_factory=list)
    processes: list[str] = field(default_factory=list)
    cgroups: list[str] = field(default_factory=list)
    tmpfs_dirs: list[str] = field(default_factory=list)
    children: list[str] = field(default_factory=list)

    def total(self) -> int:
        return sum(len(v) for v in vars(self).values())


def leaks_now(state_dir: Path, *, run_tmpfs_ok: bool) -> Leaks:
    recs = records(state_dir)
    run_tmpfs = str(state_dir / "run")
    return Leaks(
        live_sandboxes=[f"{rec.name or '(pooled)'} {rec.id} pid {rec.init_pid}" for _, rec in recs
                        if rec is not None and rec.init_pid and alive(rec.init_pid, rec.init_start)],
        record_dirs=[name for name, _ in recs],
        mounts=[m for m in mounts_under(state_dir) if not (run_tmpfs_ok and m == run_tmpfs)],
        processes=[f"{pid} {' '.join(cmd.split())[:160]}" for pid, cmd in processes_referencing(state_dir)],
        cgroups=cgroups_of(state_dir),
        tmpfs_dirs=tmpfs_leftovers(state_dir),
        children=[f"{pid} {cmd[:120]}" for pid, cmd in my_descendants()],
    )


def settle(state_dir: Path, *, run_tmpfs_ok: bool, wait_s: float = 15.0) -> Leaks:
    """Leaks, after giving dying processes (jails of killed actors, Ray's) a moment to end."""
    deadline = time.monotonic() + wait_s
    while True:
        leaks = leaks_now(state_dir, run_tmpfs_ok=run_tmpfs_ok)
        if leaks.total() == 0 or time.monotonic() > deadline:
            return leaks
        time.sleep(0.5)


def classify(rows: list[dict], hung: set[int]) -> dict[str, int]:
    c: collections.Counter[str] = collections.Counter()
    for r in rows:
        if r["error_type"] is None:
            c["ok, first attempt" if r["attempt"] == 0 else "ok after infra retries (attempt > 0)"] += 1
        elif r["infra_error"]:
            c["infra failure after all retries"] += 1
        elif r["error_type"] == "GradeError" and "timed out" in (r["error"] or ""):
            c["grade timeout (planted hang)" if r["episode_id"] in hung else "grade timeout (NOT planted)"] += 1
        else:
            c[f"other error: {r['error_type']} in {r['error_phase']}"] += 1
    return dict(c)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=1000, help="episodes in all (rounded up to a multiple of 6)")
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--fault-every", type=float, default=2.0, help="mean seconds between faults (0: none)")
    ap.add_argument("--faults", default="actor=1,sandbox=2,grade=1",
                    help="kinds to inject with their weights, e.g. actor=1,sandbox=2,grade=1 (or just actor,sandbox)")
    ap.add_argument("--actor-min-age", type=float, default=3.0,
                    help="only kill actor processes up this many seconds (not replacements still starting)")
    ap.add_argument("--hang-rate", type=float, default=0.01,
                    help="chance per episode that the policy plants a hanging grader by itself")
    ap.add_argument("--grade-timeout", type=float, default=5.0, help="env.grade.timeout")
    ap.add_argument("--retries", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 60 episodes unless --episodes is given")
    ap.add_argument("--out", help="output.dir for the run directory (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directories")
    ap.add_argument("--progress", action="store_true", help="show the driver's progress bar")
    args = ap.parse_args(argv)
    if args.quick and "--episodes" not in (argv if argv is not None else sys.argv[1:]):
        args.episodes = 60
    per_point = max(1, math.ceil(args.episodes / POINTS))
    kinds: dict[str, float] = {}
    for item in filter(None, args.faults.split(",")):
        name, _, weight = item.partition("=")
        try:
            kinds[name.strip()] = float(weight) if weight else 1.0
        except ValueError:
            ap.error(f"--faults: bad weight in {item!r}")
    unknown = set(kinds) - {"actor", "sandbox", "grade"}
    if unknown:
        ap.error(f"unknown fault kinds: {', '.join(sorted(unknown))}")
    kinds = {k: w for k, w in kinds.items() if w > 0}

    work = Path(tempfile.mkdtemp(prefix="harness-soak-"))
    state_dir, marks = work / "state", work / "marks"
    state_dir.mkdir()
    marks.mkdir()
    (work / "soak_policy.py").write_text(POLICY_SOURCE)
    out_dir = Path(args.out).resolve() if args.out else work / "results"
    run_id = f"soak-{time.strftime('%Y%m%d-%H%M%S')}-s{args.seed}"
    overrides = [
        f"episodes={per_point}", f"actors={args.actors}", f"retries={args.retries}", "retry_backoff_s=0.2",
        f"sandbox.state_dir={state_dir}", f"output.dir={out_dir}", f"output.run_id={run_id}",
        f"env.grade.timeout={args.grade_timeout}", f"ray.num_cpus={max(2, args.actors)}",
        "policy.kind=python", "policy.entrypoint=soak_policy:SoakPolicy", f"policy.python_path=[{work}]",
        "policy.args.id=${policy.id}", f"policy.args.hang_rate={args.hang_rate}", f"policy.args.seed={args.seed}",
        f"policy.args.marks={marks}",
    ]
    cfg = load_config(CONFIG, overrides)
    injector = Injector(state_dir, marks, run_id, random.Random(args.seed), args.fault_every, kinds,
                        actor_min_age=args.actor_min_age)
    results = collections.Counter()
    t_first: list[float] = []

    def on_result(result) -> None:
        results[result.request.episode_id] += 1
        if not t_first:
            t_first.append(time.monotonic())
            injector.start()  # after the build and the actors' start: faults hit episodes only

    def sigterm(signum, frame):
        raise KeyboardInterrupt

    interrupted, crash, summary = False, None, None
    t0 = time.monotonic()
    mix = ",".join(f"{k}={w:g}" for k, w in kinds.items()) or "none"
    print(f"soak {run_id}: {per_point * POINTS} episodes ({per_point} per point x {POINTS}), {args.actors} actors, "
          f"faults {mix} every ~{args.fault_every:g}s, seed {args.seed}; work dir {work}", file=sys.stderr, flush=True)
    stdout = sys.stdout
    old_term = signal.getsignal(signal.SIGTERM)
    try:
        try:
            import ray

            # Ray prints its workers' deaths on stdout: keep stdout for the check's table.
            sys.stdout = sys.stderr
            # Started here rather than by the driver, so that SIGTERM can be ours: Ray's
            # driver installs its own SIGTERM handler, which dies without cleaning up.
            ray.init(num_cpus=max(2, args.actors), include_dashboard=False, logging_level=logging.ERROR,
                     log_to_driver=False, configure_logging=True)
            signal.signal(signal.SIGTERM, sigterm)
            summary = run(cfg, show_progress=args.progress, on_result=on_result)
            interrupted = summary.interrupted
        except KeyboardInterrupt:
            interrupted = True
        except Exception as exc:  # the run itself failed: still check and clean up
            crash = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        finally:
            injector.stop()
            try:
                ray.shutdown()
            finally:
                sys.stdout = stdout
        wall = time.monotonic() - t0
        return report(args, cfg, run_id, out_dir, state_dir, marks, per_point, injector, results, summary,
                      wall, t_first, interrupted, crash)
    except KeyboardInterrupt:
        print("soak: interrupted during the check; cleaning up", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # let the cleanup finish
        cleanup(state_dir, work, keep=args.keep)
        signal.signal(signal.SIGTERM, old_term)


def report(args, cfg, run_id, out_dir, state_dir, marks, per_point, injector, results, summary, wall, t_first,
           interrupted, crash) -> int:
    expected = per_point * POINTS
    run_dir = out_dir / run_id
    try:
        rows = load_episodes(run_dir).to_pylist()
    except Exception as exc:
        print(f"soak: cannot read the episodes of {run_dir}: {exc}", file=sys.stderr)
        rows = []
    try:
        steps = load_steps(run_dir).select(["episode_id", "actions"]).to_pylist()
    except Exception:
        steps = []
    hung = {s["episode_id"] for s in steps if HANG_MARK in (s["actions"] or "")}
    ids = [r["episode_id"] for r in rows]
    counts = collections.Counter(ids)
    duplicates = sum(n - 1 for n in counts.values() if n > 1)
    lost = sorted(set(range(expected)) - set(counts))
    strays = sorted(set(counts) - set(range(expected)))
    classes = classify(rows, hung)
    faults_by_kind = collections.Counter(f.kind for f in injector.log if f.ok)
    missed_by_kind = collections.Counter(f.kind for f in injector.log if not f.ok)
    (marks / "faults.log").write_text("".join(f"{f.at:9.3f} {f.kind:8} {'hit ' if f.ok else 'miss'} {f.target}\n"
                                               for f in injector.log))  # kept with --keep
    hang_log = (marks / "hangs.log").read_text().splitlines() if (marks / "hangs.log").exists() else []
    hangs_random = sum(line.endswith(" random") for line in hang_log)
    hangs_injected = sum(line.endswith(" injected") for line in hang_log)
    callbacks_twice = sum(1 for n in results.values() if n > 1)

    # Leaks after the run (the provider's run tmpfs may stay: it is mounted once per state dir) ...
    after_run = settle(state_dir, run_tmpfs_ok=True)
    # ... then the provider's own cleanup, after which nothing at all may remain.
    shutdown_error = ""
    try:
        open_provider("local", state_dir=state_dir).shutdown()
    except Exception as exc:
        shutdown_error = f"{type(exc).__name__}: {exc}"
    after_shutdown = settle(state_dir, run_tmpfs_ok=False, wait_s=5.0)
    leaked = after_run.total() + after_shutdown.total()

    times = [(r["started_at"], r["finished_at"]) for r in rows]
    span = (max(f for _, f in times) - min(s for s, _ in times)).total_seconds() if times else 0.0
    ok_rows = sum(1 for r in rows if r["error_type"] is None)

    lines: list[tuple[str, str]] = []

    def add(name: str, value) -> None:
        lines.append((name, str(value)))

    add("run", f"{run_id} ({'interrupted' if interrupted else 'crashed' if crash else 'finished'})")
    if crash:
        add("run error", crash)
    add("episodes expected", f"{expected} ({per_point} per point x {POINTS} points)")
    add("rows written", len(rows))
    add("unique episode ids", len(counts))
    add("duplicates", duplicates)
    add("lost (expected ids without a row)", len(lost))
    if strays:
        add("rows with unexpected ids", len(strays))
    add("results reported twice (on_result)", callbacks_twice)
    for name in ("ok, first attempt", "ok after infra retries (attempt > 0)", "infra failure after all retries",
                 "grade timeout (planted hang)", "grade timeout (NOT planted)"):
        add(f"rows: {name}", classes.pop(name, 0))
    for name, n in sorted(classes.items()):
        add(f"rows: {name}", n)
    add("rows: retried (attempt > 0), any outcome", sum(1 for r in rows if r["attempt"] > 0))
    add("mean reward of ok rows", f"{sum(r['reward'] for r in rows if r['reward'] is not None) / ok_rows:.3f}"
        if ok_rows else "-")
    for kind in ("actor", "sandbox", "grade"):
        extra = f" (+{missed_by_kind[kind]} found no target)" if missed_by_kind[kind] else ""
        add(f"faults injected: {kind}", f"{faults_by_kind[kind]}{extra}")
    add("grader hangs planted (injected + random)", f"{hangs_injected} + {hangs_random}")
    add("leaked sandboxes after run (live jails)", len(after_run.live_sandboxes))
    add("leaked sandbox records after run", len(after_run.record_dirs))
    add("leaked mounts after run (besides run tmpfs)", len(after_run.mounts))
    add("leaked processes after run (state dir)", len(after_run.processes))
    add("leaked child processes after run (Ray...)", len(after_run.children))
    add("leaked cgroups after run", len(after_run.cgroups))
    add("leaked tmpfs dirs after run (uppers, fork layers)", len(after_run.tmpfs_dirs))
    add("left after provider.shutdown()", f"{after_shutdown.total()} (sandboxes, records, mounts incl. run tmpfs, "
        "processes, cgroups)" + (f"; shutdown failed: {shutdown_error}" if shutdown_error else ""))
    add("wall seconds (build + episodes + cleanup)", f"{wall:.1f}")
    add("episodes/s (first start to last finish)", f"{len(rows) / span:.2f} over {span:.1f}s" if span else "-")
    width = max(len(k) for k, _ in lines)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in lines))
    for label, leaks in (("after run", after_run), ("after shutdown", after_shutdown)):
        for kind, items in vars(leaks).items():
            for item in items[:10]:
                print(f"  leak {label}: {kind}: {item}")
    if lost:
        print(f"  lost ids: {lost[:50]}{' ...' if len(lost) > 50 else ''}")
    dup_ids = sorted(i for i, n in counts.items() if n > 1)
    if dup_ids:
        print(f"  duplicated ids: {dup_ids[:50]}")
    bad = len(lost) + duplicates + leaked + len(strays)
    verdict = "PASS" if bad == 0 and not crash else "FAIL"
    print(f"soak: {verdict}: lost {len(lost)}, duplicated {duplicates}, leaked {leaked}")
    sys.stdout.flush()
    if interrupted:
        return 130
    return 0 if verdict == "PASS" else 1


def cleanup(state_dir: Path, work: Path, *, keep: bool) -> None:
    try:
        open_provider("local", state_dir=state_dir).shutdown()  # idempotent; also after a crash
    except Exception as exc:
        print(f"soak: provider shutdown failed: {exc!r}", file=sys.stderr)
    if keep:
        print(f"soak: kept {work}", file=sys.stderr)
    else:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

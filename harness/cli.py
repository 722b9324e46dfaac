"""The ``harness`` command.

``harness sandbox ...`` has the verbs of the hosted ``sbx`` tool in the seed, so
scripts written against it run with ``sbx`` replaced by ``harness sandbox``.
``harness run CONFIG`` runs an experiment (see ``harness.driver``).

Every error is one line on stderr and a non-zero exit; ``--debug`` shows the
traceback as well.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from harness import __version__
from harness.errors import HarnessError

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error instead of usage plus message."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")
        sys.exit(EXIT_USAGE)


def _seconds(zero_ok: bool):
    """An argparse type: a finite number of seconds, positive (or 0 where 0 means none)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
            need = "0 or more" if zero_ok else "more than 0"
            raise argparse.ArgumentTypeError(f"{text!r} must be a finite number of seconds, {need}")
        return value

    parse.__name__ = "seconds"
    return parse


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _provider():
    from harness.sandbox import open_provider

    url = os.environ.get("HARNESS_SANDBOX_URL")
    if url:
        return open_provider("http", url=url, token=os.environ.get("HARNESS_SANDBOX_TOKEN"))
    return open_provider("local")


def _spec(args: argparse.Namespace, network: bool):
    from harness.sandbox import SandboxSpec

    return SandboxSpec(
        name=args.name,
        type=args.type,
        ttl_s=None if args.ttl == 0 else args.ttl,
        network=network,
    )


# -- sandbox verbs -----------------------------------------------------------------


def cmd_new(args: argparse.Namespace) -> int:
    if args.from_snapshot is not None and not args.from_snapshot.strip():
        raise HarnessError("--from needs a snapshot name; `harness sandbox snapshots` lists them")
    provider = _provider()
    spec = _spec(args, network=not args.no_network)
    if args.json:
        _print_json({"event": "creating", "name": spec.name, "type": spec.type, "fromSnapshot": args.from_snapshot})
    return _announce(args, lambda: provider.create(spec, from_snapshot=args.from_snapshot))


def cmd_fork(args: argparse.Namespace) -> int:
    source = _provider().get(args.id)
    spec = _spec(args, network=not args.no_network)
    return _announce(args, lambda: source.fork(spec))


def _announce(args: argparse.Namespace, start) -> int:
    """Start a sandbox; print its id, or with --json its ready event (the seed's format)."""
    started = time.perf_counter()
    sandbox = start()
    if args.json:
        _print_json({"event": "ready", **sandbox.info().to_json(), "startSeconds": round(time.perf_counter() - started, 6)})
    else:
        print(sandbox.id)
    return 0


def cmd_exec(args: argparse.Namespace) -> int:
    provider = _provider()
    sandbox = provider.get(args.id)
    command = " ".join(args.command)
    env = {}
    for item in args.env or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise HarnessError(f"--env takes KEY=VALUE, got {item!r}")
        env[key] = value
    out, err = sys.stdout.buffer, sys.stderr.buffer

    def stream(name: str, chunk: bytes) -> None:
        target = out if name == "stdout" else err
        target.write(chunk)
        target.flush()

    stdin = sys.stdin.buffer.read() if args.stdin else None
    result = sandbox.exec(
        command,
        timeout=args.timeout,
        env=env,
        cwd=args.cwd,
        stdin=stdin,
        on_output=stream,
        max_output_bytes=0,  # streamed, not kept
    )
    if result.timed_out:
        sys.stderr.write(f"harness: command timed out after {args.timeout:g}s and was killed\n")
    return result.exit_code


def cmd_snapshot(args: argparse.Namespace) -> int:
    info = _provider().get(args.id).snapshot(args.snapshot_name)
    _print_json({"ok": True, "type": "snapshot.named.info", "snapshot": info.to_json()})
    return 0


def cmd_rename(args: argparse.Namespace) -> int:
    info = _provider().get(args.id).rename(args.name)
    _print_json({"ok": True, **info.to_json()})
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    _print_json(_provider().get(args.id).info().to_json())
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    if not args.yes:
        raise HarnessError(f"not deleting {args.id} without --yes")
    provider = _provider()
    provider.get(args.id).delete()
    _print_json({"ok": True, "deleted": args.id})
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    infos = _provider().list()
    if args.json:
        _print_json([i.to_json() for i in infos])
        return 0
    print(f"{'ID':14} {'NAME':24} {'TYPE':7} {'STATUS':8} {'FROM':24} EXPIRES")
    for i in infos:
        expires = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(i.expires_at)) if i.expires_at else "never"
        origin = i.from_snapshot or (f"fork of {i.resumed_from}" if i.resumed_from else "-")
        print(f"{i.id:14} {(i.name or '-'):24} {i.type:7} {i.status:8} {origin:24} {expires}")
    return 0


def cmd_snapshots(args: argparse.Namespace) -> int:
    snaps = _provider().snapshots()
    if args.json:
        _print_json([s.to_json() for s in snaps])
        return 0
    print(f"{'NAME':28} {'SIZE':>10} {'LAYERS':>6} {'SOURCE':14} SNAPSHOT ID")
    for s in snaps:
        print(f"{s.name:28} {_human(s.size_bytes):>10} {len(s.layers):>6} {(s.source_sandbox_id or '-'):14} {s.snapshot_id}")
    return 0


def cmd_delete_snapshot(args: argparse.Namespace) -> int:
    if not args.yes:
        raise HarnessError(f"not deleting snapshot {args.snapshot_name} without --yes")
    _provider().delete_snapshot(args.snapshot_name)
    _print_json({"ok": True, "deletedSnapshot": args.snapshot_name})
    return 0


def cmd_push(args: argparse.Namespace) -> int:
    info = _local_provider().push_snapshot(args.snapshot_name, args.store)
    _print_json({"ok": True, "pushed": args.snapshot_name, "snapshotId": info.snapshot_id, "layers": len(info.layers)})
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    info = _local_provider().pull_snapshot(args.snapshot_name, args.store)
    _print_json({"ok": True, "type": "snapshot.named.info", "snapshot": info.to_json()})
    return 0


def _local_provider():
    if os.environ.get("HARNESS_SANDBOX_URL"):
        raise HarnessError("push and pull work on this host's snapshots: unset HARNESS_SANDBOX_URL")
    from harness.sandbox import open_provider

    return open_provider("local")


def cmd_gc(args: argparse.Namespace) -> int:
    provider = _provider()
    crashed: dict[str, list[str]] = {}
    state_dir = getattr(provider, "state_dir", None)
    if state_dir is not None:  # local: the sandboxes of runs whose driver died on this host
        from harness.runs import reap_dead_runs

        crashed = {run: names for run, names in reap_dead_runs(state_dir).items() if names}
    report = provider.gc()
    _print_json({"ok": True, "deletedSandboxes": list(report.deleted_sandboxes), "removedLayers": len(report.removed_layers),
                 "crashedRuns": crashed})
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from harness.sandbox.server import read_token, serve

    token = read_token(args.token_file, os.environ.get("HARNESS_SERVER_TOKEN"))
    # A client that hangs up mid-stream must not kill the server (main() sets SIG_DFL).
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    serve(args.host, args.port, token=token, insecure=args.insecure)
    return 0


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return str(n)


# -- parser ------------------------------------------------------------------------


def _add_create_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", help="a name for the sandbox (letters, digits, . _ -)")
    p.add_argument("--type", default="small", choices=["small", "medium", "large"], help="size class (default small)")
    p.add_argument("--ttl", type=_seconds(zero_ok=True), default=3600, help="seconds until it is deleted; 0 for never (default 3600)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the bare id")
    p.add_argument("--no-network", action="store_true", help="no outbound network (default: outbound on, host loopback blocked)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="harness", description="Sandboxes with snapshots and forks, and RL/eval rollouts in them.")
    parser.add_argument("--version", action="version", version=f"harness {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    top = parser.add_subparsers(dest="group", metavar="COMMAND", parser_class=_Parser)
    top.required = True

    sbx = top.add_parser("sandbox", help="create, use and delete sandboxes and snapshots")
    verbs = sbx.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)
    verbs.required = True

    p = verbs.add_parser("new", help="create a sandbox (empty, or --from a snapshot); prints its id")
    _add_create_flags(p)
    p.add_argument("--from", dest="from_snapshot", metavar="SNAPSHOT", help="start from this snapshot")
    p.set_defaults(func=cmd_new)

    p = verbs.add_parser("fork", help="copy a live sandbox's files into a new sandbox")
    p.add_argument("id")
    _add_create_flags(p)
    p.add_argument("--wait", action="store_true", help="return once the fork is ready (always the case)")
    p.set_defaults(func=cmd_fork)

    p = verbs.add_parser("exec", help="run a shell command in a sandbox; exits with its exit code")
    p.add_argument("id")
    p.add_argument("command", nargs="+", help="the command, run under sh -c (quote it, or put -- before it)")
    p.add_argument("--timeout", type=_seconds(zero_ok=False), default=None, help="kill the command's process tree after this many seconds (exit 124)")
    p.add_argument("--env", action="append", metavar="KEY=VALUE", help="set an environment variable (repeatable)")
    p.add_argument("--cwd", help="working directory (default the home, /home/user)")
    p.add_argument("-i", "--stdin", action="store_true", help="pass this command's standard input to the command")
    p.set_defaults(func=cmd_exec)

    p = verbs.add_parser("snapshot", help="save a sandbox's files as a named snapshot")
    p.add_argument("id")
    p.add_argument("snapshot_name", metavar="NAME")
    p.set_defaults(func=cmd_snapshot)

    p = verbs.add_parser("rename", help="rename a sandbox")
    p.add_argument("id")
    p.add_argument("--name", required=True)
    p.set_defaults(func=cmd_rename)

    p = verbs.add_parser("info", help="show a sandbox as JSON")
    p.add_argument("id")
    p.set_defaults(func=cmd_info)

    p = verbs.add_parser("delete", help="delete a sandbox: every process, file and mount")
    p.add_argument("id")
    p.add_argument("--yes", "-y", action="store_true", help="do not ask")
    p.set_defaults(func=cmd_delete)

    p = verbs.add_parser("ls", help="list live sandboxes")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_ls)

    p = verbs.add_parser("snapshots", help="list snapshots")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_snapshots)

    p = verbs.add_parser("delete-snapshot", help="delete a snapshot (its layers go at the next gc)")
    p.add_argument("snapshot_name", metavar="NAME")
    p.add_argument("--yes", "-y", action="store_true", help="do not ask")
    p.set_defaults(func=cmd_delete_snapshot)

    for verb, func, text in (
        ("push", cmd_push, "upload a snapshot to a snapshot store (a directory, s3://, gs://, hdfs://)"),
        ("pull", cmd_pull, "download a snapshot from a snapshot store, verifying its content hashes"),
    ):
        p = verbs.add_parser(verb, help=text)
        p.add_argument("snapshot_name", metavar="NAME")
        p.add_argument("--store", help="the store URI (default $HARNESS_SNAPSHOT_STORE)")
        p.set_defaults(func=func)

    p = verbs.add_parser("gc", help="delete expired sandboxes, leftovers of crashes (also of `harness run` drivers "
                         "that died), and unused layers")
    p.set_defaults(func=cmd_gc)

    p = top.add_parser("serve", help="serve this machine's sandboxes over HTTP to `harness sandbox` and the http backend")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8765, help="port (default 8765)")
    p.add_argument("--token-file", help="file holding the bearer token clients must send (default $HARNESS_SERVER_TOKEN)")
    p.add_argument("--insecure", action="store_true", help="run without a token; only on a loopback address")
    p.set_defaults(func=cmd_serve)

    add_run_parser(top)
    return parser


def add_run_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Adds `run` to the `harness` command's subparsers."""
    p = subparsers.add_parser(
        "run", help="run a config's episodes (all sweep points) and write Parquet datasets",
        description="Run CONFIG's episodes on a Ray actor pool; key=value overrides the YAML.",
    )
    p.add_argument("config", nargs="?", help="YAML config file, e.g. configs/median.yaml")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. episodes=10")
    p.add_argument("--rebuild", action="store_true", help="rebuild the environment even if it is cached")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="finish an interrupted run: run only its episodes that have no row yet")
    p.add_argument("--retry-failed", action="store_true",
                   help="with --resume: also run again the episodes whose row is an infrastructure failure")
    p.add_argument("--describe", action="store_true", help="print every config key with its default and meaning")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    # SUPPRESS: do not clobber a --debug given to the main `harness` parser.
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    p.set_defaults(func=cmd_run)
    _allow_intermixed(p)
    return p


def _allow_intermixed(parser: argparse.ArgumentParser) -> None:
    """Let flags and ``key=value`` overrides come in any order (`run C k=v --rebuild k2=v2`):
    the subparsers action calls ``parse_known_args``; route it through argparse's intermixed
    parsing, which itself calls ``parse_known_args`` (hence the re-entry guard)."""
    plain = type(parser).parse_known_args
    busy = False

    def parse_known_args(args=None, namespace=None):
        nonlocal busy
        if busy:
            return plain(parser, args, namespace)
        busy = True
        try:
            return parser.parse_known_intermixed_args(args, namespace)
        finally:
            busy = False

    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]


def cmd_run(args: argparse.Namespace) -> int:
    # Imported here: Ray and pyarrow cost a third of a second that the
    # sandbox verbs, called hundreds of times by scripts, should not pay.
    from harness.driver import run_command

    return run_command(args)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "verb", None) == "exec" and not args.command:
        parser.error("exec needs a command, e.g. harness sandbox exec ID 'echo hi'")
    # The exec verb must not die on SIGPIPE mid-stream with a traceback.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        sys.stderr.write("harness: interrupted\n")
        return EXIT_INTERRUPTED
    except HarnessError as exc:
        if args.debug:
            raise
        sys.stderr.write(f"harness: error: {exc}\n")
        return EXIT_ERROR
    except Exception as exc:  # a bug of ours: still one line unless --debug
        if args.debug:
            raise
        sys.stderr.write(f"harness: internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)\n")
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())

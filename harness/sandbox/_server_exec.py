"""The sandbox server's exec stream: a command run in a thread, its output sent as NDJSON lines.

See ``harness.sandbox.server`` for the line format.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import secrets
import threading
from collections.abc import AsyncIterator
from typing import Any

from harness.errors import HarnessError
from harness.sandbox._server_models import ExecBody, error_body

log = logging.getLogger("harness.serve")

#: Seconds between heartbeat lines of a silent exec (lets clients detect a dead server).
HEARTBEAT_S = 5.0
#: Output queued for a slow client beyond which the command's reader waits.
_MAX_QUEUED_BYTES = 32 << 20


class _ClientGone(Exception):
    """Raised inside a command's output callback once its client disconnected."""


async def run_exec(sb, body: ExecBody, stdin: bytes | None) -> AsyncIterator[bytes]:
    """Run the command in a thread; yield its output lines as the thread queues them."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    gone = threading.Event()
    finished = threading.Event()
    exec_id = secrets.token_hex(8)
    sent = {"stdout": 0, "stderr": 0}
    queued = [0]  # bytes waiting for the client
    drained = threading.Condition()

    def put(item: dict[str, Any]) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is going down
            gone.set()

    def on_output(stream: str, chunk: bytes) -> None:
        if gone.is_set():
            raise _ClientGone
        if not body.stream:
            room = body.max_output_bytes - sent[stream]
            if room <= 0:
                return
            chunk = chunk[:room]
        sent[stream] += len(chunk)
        with drained:
            # A slow client holds the command back rather than filling memory.
            while queued[0] > _MAX_QUEUED_BYTES and not gone.is_set():
                drained.wait(0.1)
            queued[0] += len(chunk)
        put({"stream": stream, "data": base64.b64encode(chunk).decode("ascii"), "size": len(chunk)})

    def work() -> None:
        try:
            result = sb.exec(
                body.command,
                timeout=body.timeout,
                env={**body.env, "HARNESS_EXEC_ID": exec_id},
                cwd=body.cwd,
                stdin=stdin,
                on_output=on_output,
                max_output_bytes=body.max_output_bytes,
            )
            final: dict[str, Any] = {
                "exit_code": result.exit_code,
                "duration_s": result.duration_s,
                "timed_out": result.timed_out,
                "truncated": result.truncated,
            }
        except _ClientGone:
            return
        except BaseException as exc:  # reported to the client as a line
            if not isinstance(exc, HarnessError):
                log.exception("exec in %s failed", sb.id)
            final = error_body(exc)
        finally:
            finished.set()
        put({**final, "done": True})

    def beat() -> None:
        nonlocal timer
        queue.put_nowait({"heartbeat": True})
        timer = loop.call_later(HEARTBEAT_S, beat)

    timer = loop.call_later(HEARTBEAT_S, beat)
    threading.Thread(target=work, name=f"exec-{sb.id}", daemon=True).start()
    try:
        while True:
            item = await queue.get()
            done = item.pop("done", False)
            size = item.pop("size", 0)
            yield json.dumps(item).encode() + b"\n"
            if done:
                return
            if size:
                with drained:
                    queued[0] -= size
                    drained.notify_all()
    finally:
        timer.cancel()
        gone.set()  # the client left (or all is sent): a still running command dies at its next output
        with drained:
            drained.notify_all()
        if not finished.is_set():
            threading.Thread(target=_stop_exec, args=(sb, exec_id, finished), daemon=True).start()


_KILL_SCRIPT = (
    "for d in /proc/[0-9]*; do "
    "tr '\\0' '\\n' < $d/environ 2>/dev/null | grep -qx HARNESS_EXEC_ID={id} && kill -9 ${{d#/proc/}} 2>/dev/null; "
    "done; true"
)


def _stop_exec(sb, exec_id: str, finished: threading.Event) -> None:
    """Kill a command whose client went away, if it does not stop by itself.
    (If the server itself dies, its commands in flight die with it: see
    "Commands die with their caller" in ``harness.sandbox._exec``.)"""
    for _ in range(3):
        if finished.wait(0.3):
            return
        try:
            sb.exec(_KILL_SCRIPT.format(id=exec_id), timeout=10)
        except HarnessError:
            return  # the sandbox is gone, and its commands with it

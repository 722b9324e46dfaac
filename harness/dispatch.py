"""Hands episodes to a pool of Ray actors and turns every episode into one result.

Episodes go out one at a time as actors free up (never in lockstep). An actor
that dies yields an ``actor``-phase failure for its episode and is replaced.
Infrastructure failures (see ``harness.failures``) are retried up to
``retries`` times: each retry waits an exponential backoff with jitter and goes
to another actor when there is one; and while failures keep coming with no
success between them, no new episode starts before the backoff is over either,
so a sandbox server that is down for a while sees a trickle, not a storm. When
failures keep coming with no success at all (``give_up_after`` in a row), the
infrastructure is down rather than flaky: the run stops, resumable.

A policy or grader failure ends the streak like a success does: the episode
reached its sandbox, so the infrastructure works.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from harness.episode import EpisodeRequest, EpisodeResult, failed_result
from harness.errors import InfrastructureDown


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently infrastructure failures are retried."""

    retries: int = 3
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    #: Infrastructure failures in a row, with no episode ending well between them, after
    #: which the run stops (InfrastructureDown): the infrastructure is down, not flaky.
    give_up_after: int = 20

    def delay(self, failures: int) -> float:
        """Seconds to wait after ``failures`` failures in a row: doubling, capped, with
        jitter so that many episodes failing together do not come back together."""
        if failures <= 0 or self.backoff_s <= 0:
            return 0.0
        base = min(self.max_backoff_s, self.backoff_s * 2 ** (failures - 1))
        return base * random.uniform(0.5, 1.0)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


class Dispatcher:
    """Runs ``requests`` on ``actors`` (Ray actor handles with ``run.remote``).

    ``new_actor(slot)`` makes a replacement for a dead actor; ``reap(names)``
    deletes the sandboxes a dead actor left; ``finished(result)`` receives each
    episode's final result, exactly once per request.
    """

    def __init__(self, actors: list[Any], new_actor: Callable[[int], Any], finished: Callable[[EpisodeResult], None],
                 reap: Callable[[set[str]], Any], retry: RetryPolicy):
        self.actors, self.new_actor, self.finished, self.reap, self.retry = actors, new_actor, finished, reap, retry
        self.generation = [0] * len(actors)  # bumped when a slot's actor is replaced
        self.retries_done = 0
        self.actors_replaced = 0

    def run(self, requests: list[EpisodeRequest]) -> None:
        import ray

        fresh: deque[EpisodeRequest] = deque(requests)
        # Retries waiting for their backoff: (ready_at, seq, request, (slot, generation) to avoid).
        waiting: list[tuple[float, int, EpisodeRequest, tuple[int, int]]] = []
        due: list[tuple[EpisodeRequest, tuple[int, int]]] = []  # retries whose backoff is over
        seq = itertools.count()
        inflight: dict[Any, tuple[int, EpisodeRequest]] = {}
        free = list(range(len(self.actors)))
        hold_until, failures_in_a_row = 0.0, 0

        def pick(slot: int) -> EpisodeRequest | None:
            me = (slot, self.generation[slot])
            for i, (req, avoid) in enumerate(due):
                # Another actor where possible: a lone actor takes its own retries.
                if avoid != me or len(self.actors) == 1:
                    del due[i]
                    return req
            return fresh.popleft() if fresh else None

        while fresh or waiting or due or inflight:
            now = time.monotonic()
            while waiting and waiting[0][0] <= now:
                _, _, req, avoid = heapq.heappop(waiting)
                due.append((req, avoid))
            if now >= hold_until:
                for slot in list(free):
                    req = pick(slot)
                    if req is None:
                        continue  # what is left avoids this actor; another may take it
                    free.remove(slot)
                    inflight[self.actors[slot].run.remote(req)] = (slot, req)
            wake = [t for t in (hold_until, waiting[0][0] if waiting else 0.0) if t > now]
            timeout = max(0.0, min(wake) - now) if wake else None
            if not inflight:
                # Every actor is free, so whatever is left waits for its backoff (an avoided
                # retry always finds another actor); with nothing left, the loop ends.
                time.sleep(timeout or 0.0)
                continue
            ready, _ = ray.wait(list(inflight), num_returns=1, timeout=timeout)
            if not ready:
                continue
            slot, req = inflight.pop(ready[0])
            try:
                result = ray.get(ready[0])
            except ray.exceptions.RayError as exc:
                result = failed_result(req, type(exc).__name__, _first_line(exc), "actor",
                                       actor=f"{req.run_id}-a{slot}")
                self._replace(slot, req)
            free.append(slot)
            if not result.infra_error:
                failures_in_a_row = 0
                self.finished(result)
                continue
            failures_in_a_row += 1
            if failures_in_a_row >= self.retry.give_up_after:
                raise InfrastructureDown(
                    f"{failures_in_a_row} infrastructure failures in a row and no episode went well in between "
                    f"(last: {result.error_type}: {result.error}); fix the cause, then resume the run")
            hold_until = time.monotonic() + self.retry.delay(failures_in_a_row)
            if req.attempt < self.retry.retries:
                self.retries_done += 1
                ready_at = time.monotonic() + self.retry.delay(req.attempt + 1)
                heapq.heappush(waiting, (ready_at, next(seq), dataclasses.replace(req, attempt=req.attempt + 1),
                                         (slot, self.generation[slot])))
            else:
                self.finished(result)

    def _replace(self, slot: int, req: EpisodeRequest) -> None:
        import ray

        ray.kill(self.actors[slot], no_restart=True)
        self.reap({f"{req.run_id}-ep{req.episode_id}", f"{req.run_id}-a{slot}-source"})
        self.actors[slot] = self.new_actor(slot)
        self.generation[slot] += 1
        self.actors_replaced += 1

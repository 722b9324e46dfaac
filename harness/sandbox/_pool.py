"""A warm pool of started jails for one LocalProvider (opt-in, in-process).

Starting a jail costs a few milliseconds of namespace and mount set-up; a
long-lived process that creates many sandboxes from the same snapshot (a
rollout worker) can pay that in the background instead. A pooled jail is an
ordinary sandbox started from the snapshot, with a short TTL, hidden from
``list``, in which nothing has run; ``create`` claims one and hands it out. A
claim that fails for any reason falls back to a cold start, so the pool can
only make creation faster, never different, except in one way: a pooled jail
is started with bubblewrap's --die-with-parent from the pool's thread, so it
ends with the provider's process or its ``close()``, claimed or not. That is
what a rollout worker wants (nothing outlives it); a script that wants its
sandboxes to outlive it should not use a pool.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harness.sandbox.local import LocalProvider

log = logging.getLogger(__name__)

#: Seconds a pooled jail waits to be claimed before it is deleted (gc sees the TTL).
POOL_TTL_S = 300.0
#: The longest TTL a pooled jail can be claimed with; longer ones start cold.
#: A pooled jail's own deadline (when its holder ends it) covers its wait plus
#: this; claiming moves it to the claimed TTL's, as a cold start would have it
#: (see ``LocalProvider._claim`` and ``_jail.write_deadline``).
POOL_CLAIM_MAX_TTL_S = 3600.0

Key = tuple[str, bool, "str | None"]  # (sandbox type, network, snapshot id or None for empty)


class WarmPool:
    def __init__(self, provider: LocalProvider, size: int):
        self.provider = provider
        self.size = size
        self._ready: dict[Key, deque[str]] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    def take(self, key: Key) -> str | None:
        """A warm jail's id for ``key``, or None (and the pool starts filling for it)."""
        with self._cond:
            queue = self._ready.setdefault(key, deque())
            sandbox_id = queue.popleft() if queue else None
            self._cond.notify()
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._fill, name="harness-warm-pool", daemon=True)
                self._thread.start()
        return sandbox_id

    def _wanted(self) -> Key | None:
        for key, queue in self._ready.items():
            if len(queue) < self.size:
                return key
        return None

    def _fill(self) -> None:
        while True:
            with self._cond:
                while not self._closed and self._wanted() is None:
                    self._cond.wait()
                if self._closed:
                    return
                key = self._wanted()
            assert key is not None
            try:
                sandbox_id = self.provider._start_pooled(*key)
            except Exception as exc:  # the pool is an optimisation: log, back off, go on
                log.warning("warm pool could not start a sandbox: %s", exc)
                with self._cond:
                    self._cond.wait(timeout=5)
                continue
            with self._cond:
                if self._closed:
                    self.provider._destroy(sandbox_id)
                    return
                self._ready[key].append(sandbox_id)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            ids = [i for queue in self._ready.values() for i in queue]
            self._ready.clear()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for sandbox_id in ids:
            self.provider._destroy(sandbox_id)

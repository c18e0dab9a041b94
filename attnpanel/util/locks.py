"""One lock per key: a value that is costly to compute is computed once, however many
threads (the served explorer's sessions and its map workers) ask for it at the same time.

The second thread to ask waits for the first and then reads what it stored, instead of
computing it again (an overview of one head at L = 65,536 is ~10 s of both cores).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterator
from contextlib import contextmanager


class KeyLocks:
    """A lock per key, made on first use and dropped once nobody holds or awaits it."""

    def __init__(self):
        self._guard = threading.Lock()
        self._locks: dict[Hashable, list] = {}  # key -> [lock, threads holding or waiting]

    @contextmanager
    def hold(self, key: Hashable) -> Iterator[None]:
        """Hold the lock of ``key`` (waiting while another thread holds it)."""
        with self._guard:
            found = self._locks.setdefault(key, [threading.Lock(), 0])
            found[1] += 1
        try:
            with found[0]:
                yield
        finally:
            with self._guard:
                found[1] -= 1
                if found[1] == 0:
                    del self._locks[key]

    def __len__(self) -> int:
        """Keys held or awaited now."""
        with self._guard:
            return len(self._locks)

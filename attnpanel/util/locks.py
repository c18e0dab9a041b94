"""What threads (the served explorer's sessions and its map workers) share.

- :class:`KeyLocks`: one lock per key: a value that is costly to compute is computed once,
  however many threads ask for it at the same time. The second thread to ask waits for the
  first and then reads what it stored, instead of computing it again (an overview of one
  head at L = 65,536 is ~10 s of both cores).
- :class:`SharedSetting`: a setting of one object that overlapping users share (a model in
  eval mode): the first in makes it, the last out restores what was.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable, Iterator
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


class SharedSetting:
    """A setting of an object that overlapping users share, counted per object.

    ``make(obj)`` sets it and returns what it changed; ``restore(changed)`` undoes that. The
    first user of an object makes it, the last one out restores it: a user that left first
    no longer undoes the setting under another still inside (a session's model switched
    back to training, dropout on, in the middle of another session's forward). ``make``
    and ``restore`` run under one lock for every object: keep them short.
    """

    def __init__(self, make: Callable[[object], object], restore: Callable[[object], None]):
        self.make, self.restore = make, restore
        self._guard = threading.Lock()
        self._users: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @contextmanager
    def __call__(self, obj) -> Iterator[None]:
        """The setting on ``obj`` while the block runs (and while any other user's does)."""
        with self._guard:
            count, changed = self._users.get(obj, (0, None))
            if count == 0:
                changed = self.make(obj)
            try:
                self._users[obj] = (count + 1, changed)
            except TypeError:  # an object that cannot be referenced weakly: undone at once
                if count == 0:
                    self.restore(changed)
                raise
        try:
            yield
        finally:
            with self._guard:
                count, changed = self._users[obj]
                if count == 1:
                    del self._users[obj]
                    self.restore(changed)
                else:
                    self._users[obj] = (count - 1, changed)

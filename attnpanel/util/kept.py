"""The last few values computed, by key, shared by threads."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable


class Kept:
    """The last ``size`` values by key, shared by threads (a server's sessions)."""

    def __init__(self, size: int):
        self.size = size
        self._values: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key, compute: Callable):
        """The value kept under ``key``, else ``compute()`` (outside the lock), kept."""
        with self._lock:
            if key in self._values:
                self._values.move_to_end(key)
                return self._values[key]
        value = compute()
        with self._lock:
            self._values[key] = value
            while len(self._values) > self.size:
                self._values.popitem(last=False)
        return value

"""Work that nobody waits for any more stops between two of its steps.

On the served long page a zoom starts the exact pixels of the zoomed window on a worker
(seconds for windows of ~30,000^2 cells). Zoom again before they are drawn and they are
superseded: nobody will draw them. Left to run, they would hold a core and delay the
newest window's pixels by the rest of their time.

A worker runs such work inside :func:`while_wanted`, with a test of whether its result is
still wanted. The work calls :func:`check` between its steps; ``check`` raises
:class:`Superseded` once the result is no longer wanted. Outside any such scope (a script,
a notebook, the tests, the benchmarks) ``check`` does nothing, so the compute core does not
need to know who called it. Work whose result is shared or stored (an overview that other
views wait for and that the trace's folder keeps) runs inside :func:`shielded`, where
``check`` never stops it.

The scope lives in a :class:`contextvars.ContextVar`: each worker thread has its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_wanted: ContextVar[Callable[[], bool] | None] = ContextVar("attnpanel_wanted", default=None)


class Superseded(Exception):
    """Raised by :func:`check` in work whose result is no longer wanted."""


@contextmanager
def while_wanted(wanted: Callable[[], bool]) -> Iterator[None]:
    """Run the block as work that stops at its next :func:`check` once ``wanted()`` is False.

    ``wanted`` is called from the worker's thread at every check: keep it cheap and safe to
    call from any thread (a comparison of two numbers).
    """
    token = _wanted.set(wanted)
    try:
        yield
    finally:
        _wanted.reset(token)


@contextmanager
def shielded() -> Iterator[None]:
    """Run the block to its end whatever the enclosing scope: for work whose result others
    share (a stored overview)."""
    token = _wanted.set(None)
    try:
        yield
    finally:
        _wanted.reset(token)


def check() -> None:
    """Raise :class:`Superseded` if the enclosing :func:`while_wanted` no longer wants the
    result; otherwise (or outside any scope) do nothing."""
    wanted = _wanted.get()
    if wanted is not None and not wanted():
        raise Superseded("superseded: a newer request for the same view came meanwhile")

"""Pickled values read as plain data only: no class is ever looked up, so nothing runs.

Some file formats keep small values pickled (PyTables' node attributes, which pandas'
HDF5 tables and NILMTK's metadata use). :func:`plain_loads` reads such a value when it is
made of numbers, strings, bytes, lists, tuples, dicts and sets, and refuses any other,
naming the global it met (as ``torch.load(weights_only=True)`` does). The classes let
through are those pandas keeps an index's clock with, each built from numbers or a zone's
name and running nothing: a date offset (``Second``, ``Minute`` ...), ``datetime``'s
``timezone`` and ``timedelta``, and ``zoneinfo.ZoneInfo``.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import threading
import types

OFFSETS = "pandas._libs.tslibs.offsets"  # the module of pandas' date offsets
ALLOWED = frozenset({("datetime", "timezone"), ("datetime", "timedelta"), ("zoneinfo", "ZoneInfo")})


class PlainPickleError(pickle.UnpicklingError):
    """A pickled value that is not plain data."""


class _Plain(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in ALLOWED or (module == OFFSETS and _is_offset(name)):
            return super().find_class(module, name)
        raise PlainPickleError(f"refused to load the global {module}.{name}: plain data only")

    def persistent_load(self, pid):
        raise PlainPickleError("refused a persistent reference: plain data only")


def _is_offset(name: str) -> bool:
    import pandas.tseries.offsets as offsets

    found = getattr(offsets, name, None) if name in offsets.__all__ else None
    return isinstance(found, type) and issubclass(found, offsets.BaseOffset)


def plain_loads(data: bytes, *, encoding: str = "ASCII", errors: str = "strict", **_):
    """``pickle.loads`` of plain data; any global refused (:class:`PlainPickleError`)."""
    return _Plain(io.BytesIO(data), encoding=encoding, errors=errors).load()


_PLAIN_MODULE = types.SimpleNamespace(
    loads=plain_loads, UnpicklingError=pickle.UnpicklingError, dumps=pickle.dumps,
    HIGHEST_PROTOCOL=pickle.HIGHEST_PROTOCOL,
)  # fmt: skip
_lock = threading.Lock()


@contextlib.contextmanager
def plain_pytables():
    """PyTables' attributes read as plain data while inside (one reader at a time).

    PyTables unpickles a node's attributes as it opens it (its issues #47 and #813 ask for
    a way out; there is none). Inside this block its attribute module's ``pickle`` is one
    that loads plain data only: a file's attribute that needs a class comes back as its raw
    bytes instead (PyTables' own fallback for a pickle it cannot read), never run.
    """
    import tables.attributeset as attributes

    with _lock:
        kept = attributes.pickle
        attributes.pickle = _PLAIN_MODULE
        try:
            yield
        finally:
            attributes.pickle = kept

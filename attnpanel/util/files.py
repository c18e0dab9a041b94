"""Safe writes: a file appears whole or not at all, and nothing is replaced by accident.

Every file attnpanel writes (a trace, an HTML export, a trained model) goes through
:func:`write_safely`: the content is written to a temporary sibling in the same directory
and renamed into place only once it is complete, so an interrupted or failed write
(Ctrl-C, a full disk, an invalid trace) leaves the old file untouched and no partial file.
An existing path is replaced only when the caller says so (``overwrite=True``, the CLI's
``--force``), and never when it holds something of another kind: a trace is never written
over an HTML page, a zarr store never over a folder of the user's own files.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
ZIP_SIGNATURE = b"PK\x03\x04"  # torch.save's format
ZARR_MARKERS = (".zgroup", ".zarray", "zarr.json")


def _head(path: Path, size: int = 512) -> bytes:
    with open(path, "rb") as handle:
        return handle.read(size)


def _is_netcdf(path: Path) -> bool:
    return path.is_file() and _head(path, 8) == HDF5_SIGNATURE


def _is_zarr(path: Path) -> bool:
    return path.is_dir() and any((path / marker).is_file() for marker in ZARR_MARKERS)


def _is_html(path: Path) -> bool:
    if not path.is_file():
        return False
    start = _head(path).lstrip().lower()
    return start.startswith((b"<!doctype html", b"<html"))


def _is_torch_file(path: Path) -> bool:
    return path.is_file() and _head(path, 4) == ZIP_SIGNATURE


def _is_json(path: Path) -> bool:
    return path.is_file() and _head(path).lstrip().startswith((b"{", b"["))


def _is_svg(path: Path) -> bool:
    start = _head(path, 1024).lstrip().lower() if path.is_file() else b""
    return start.startswith((b"<?xml", b"<svg")) and b"<svg" in start


def _is_pdf(path: Path) -> bool:
    return path.is_file() and _head(path, 5) == b"%PDF-"


def _is_png(path: Path) -> bool:
    return path.is_file() and _head(path, 8) == b"\x89PNG\r\n\x1a\n"


def _is_csv(path: Path) -> bool:
    head = _head(path)
    return path.is_file() and b"," in head.split(b"\n", 1)[0] and b"\0" not in head


KINDS: dict[str, tuple[str, Callable[[Path], bool]]] = {
    "csv": ("a CSV table", _is_csv),
    "netcdf": ("a netCDF (HDF5) file", _is_netcdf),
    "zarr": ("a zarr store", _is_zarr),
    "html": ("an HTML page", _is_html),
    "torch": ("a torch.save file", _is_torch_file),
    "json": ("a JSON file", _is_json),
    "svg": ("an SVG figure", _is_svg),
    "pdf": ("a PDF figure", _is_pdf),
    "png": ("a PNG figure", _is_png),
}


def check_target(path: str | Path, kind: str, overwrite: bool = False) -> Path:
    """Refuse ``path`` unless writing ``kind`` there is safe; return it as a Path.

    Parameters
    ----------
    path : str or Path
        Where the caller is about to write.
    kind : {"netcdf", "zarr", "html", "torch", "json"}
        What it writes.
    overwrite : bool
        Replace an existing file of the same kind.

    Raises
    ------
    FileExistsError
        ``path`` exists and ``overwrite`` is false, or it holds something of another kind
        (never replaced, whatever ``overwrite`` says).
    FileNotFoundError
        The directory that would hold ``path`` does not exist.
    """
    path = Path(path)
    description, is_kind = KINDS[kind]
    if path.exists() or path.is_symlink():
        if path.is_symlink() or not is_kind(path):
            raise FileExistsError(
                f"{path} exists and is not {description}; attnpanel never replaces it "
                "(choose another path)"
            )
        if not overwrite:
            raise TargetExists(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"no directory {path.parent} to write {path.name} in")
    return path


def write_safely(
    path: str | Path, kind: str, write: Callable[[Path], object], overwrite: bool = False
) -> Path:
    """Write through ``write(temporary_path)``, then move the result onto ``path``.

    Parameters
    ----------
    path : str or Path
        The final path.
    kind : {"netcdf", "zarr", "html", "torch", "json"}
        What is written; a zarr store is a directory, the others are files.
    write : callable
        Writes the whole content to the path it is given (which does not exist yet).
    overwrite : bool
        Replace an existing ``path`` of the same kind (see :func:`check_target`).

    Returns
    -------
    Path
        ``path``.
    """
    path = check_target(path, kind, overwrite)
    directory = path.parent
    if kind == "zarr":
        staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory))
        temporary = staging / path.name
    else:
        handle, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
        os.close(handle)
        staging = temporary = Path(name)
        temporary.unlink()  # writers create the file themselves
    try:
        write(temporary)
        if kind == "zarr":
            _replace_directory(temporary, path)
        else:
            os.replace(temporary, path)  # atomic on one file system
    finally:
        _remove(staging)
    return path


def _replace_directory(new: Path, path: Path) -> None:
    """Put directory ``new`` at ``path``; an old store there is removed only afterwards."""
    if not path.exists():
        os.replace(new, path)
        return
    old = new.parent / f"{path.name}.old"
    os.replace(path, old)
    try:
        os.replace(new, path)
    except BaseException:
        os.replace(old, path)  # put the old store back
        raise


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


class TargetExists(FileExistsError):
    """A path to write exists and the caller did not say to replace it; the message speaks
    Python, :attr:`cli_words` the command line."""

    def __init__(self, path: Path):
        super().__init__(f"{path} exists; pass overwrite=True to replace it")
        self.path = path

    @property
    def cli_words(self) -> str:
        return f"{self.path} exists; add --force to replace it"

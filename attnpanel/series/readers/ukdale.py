"""UK-DALE's layout: ``house_<N>/labels.dat`` (``id name`` lines) and one
``channel_<id>.dat`` per meter (``unix_ts watts`` lines, each channel on its own clock).

A path is the data set's folder (every ``house_<N>`` in it) or one house's folder. The
channel named ``aggregate`` in ``labels.dat`` is the mains. Reading a channel is
``pandas.read_csv`` with the pyarrow engine (a year at 6 s is 5.3 M lines).
"""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from attnpanel.series.recordings import (
    Recording,
    RecordingError,
    pick_houses,
    reader,
    series_of,
    utc_index,
)

HOUSE = re.compile(r"^house_(\d+)$")


def read_labels(path: Path) -> dict[int, str]:
    """``{id: name}`` from ``id name`` lines (blank lines skipped)."""
    found = {}
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split(maxsplit=1)
        if len(parts) != 2 or not parts[0].isdigit():
            raise RecordingError(f"{path}, line {number}: not an 'id name' line: {line[:60]!r}")
        found[int(parts[0])] = parts[1].strip()
    return found


def _house_folders(path: Path) -> list[Path]:
    if (path / "labels.dat").exists():
        return [path]
    return sorted(
        (p for p in path.iterdir() if p.is_dir() and HOUSE.match(p.name)),
        key=lambda p: int(HOUSE.match(p.name).group(1)),
    )


def _claims(path: Path) -> bool:
    return path.is_dir() and bool(_house_folders(path))


def read_channel(path: Path, name: str) -> pd.Series:
    """One ``channel_<id>.dat`` file as a UTC series of watts."""
    try:
        table = pd.read_csv(
            path, sep=" ", header=None, names=["unix_ts", "watts"], usecols=[0, 1],
            engine="pyarrow",
        )  # fmt: skip
    except Exception as error:  # pyarrow's parse errors have no common class with pandas'
        raise RecordingError(
            f"{path} is not a UK-DALE channel of 'unix_ts watts' lines: "
            f"{str(error).splitlines()[0]}"
        ) from None
    if table["unix_ts"].dtype.kind not in "iuf" or table["watts"].dtype.kind not in "iuf":
        raise RecordingError(f"{path} is not a UK-DALE channel: its columns are not numbers")
    index = utc_index(table["unix_ts"].to_numpy(), f"the times of {path}")
    return series_of(table["watts"].to_numpy(), index, name, str(path))


@reader("ukdale", claims=_claims, words="UK-DALE's house_<N>/labels.dat and channel_<id>.dat")
def read_ukdale(path: Path, houses=None, channels=None) -> list[Recording]:
    if not path.is_dir():
        raise RecordingError(f"{path} is not a UK-DALE folder (house_<N>/labels.dat)")
    folders = _house_folders(path)
    if not folders:
        raise RecordingError(f"{path} holds no house_<N> folder with a labels.dat")
    named = {(HOUSE.match(f.name).group(1) if HOUSE.match(f.name) else f.name): f for f in folders}
    found = []
    for house in pick_houses(list(named), houses, str(path)):
        folder = named[house]
        labels = read_labels(folder / "labels.dat")
        wanted = None if channels is None else {"aggregate", *channels}
        read = {}
        for number, name in labels.items():
            if wanted is not None and name not in wanted:
                continue
            file = folder / f"channel_{number}.dat"
            if not file.exists():
                raise RecordingError(
                    f"{folder}/labels.dat names channel {number} ({name}), "
                    f"but {file.name} is not there"
                )
            read[name] = read_channel(file, name)
        found.append(Recording(house, read, source=f"{folder} (UK-DALE)"))
    return found

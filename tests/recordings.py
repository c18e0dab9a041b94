"""Recordings written by the tests, in the layouts researchers keep: UK-DALE's folders,
REFIT's CSV, NILMTK's HDF5 and a plain CSV, all of one synthetic house whose kettle and
fridge are known (the mains is their sum plus a base load)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

START = pd.Timestamp("2014-03-03 00:00", tz="UTC")  # a Monday


def house_power(hours: float = 24, step_s: int = 6, seed: int = 0, start=START) -> pd.DataFrame:
    """A house at ``step_s`` seconds: ``aggregate`` = base + ``kettle`` + ``fridge``, W."""
    rng = np.random.default_rng(seed)
    n = int(hours * 3600 // step_s)
    index = pd.date_range(start, periods=n, freq=f"{step_s}s")
    minutes = np.arange(n) * step_s / 60
    fridge = np.where((minutes % 40) < 15, 90.0, 0.0) + rng.normal(0, 1, n).clip(-2, 2)
    kettle = np.zeros(n)
    for at in rng.uniform(0, minutes[-1] - 5, size=max(1, int(hours / 3))):
        kettle[(minutes >= at) & (minutes < at + 3)] = 2800.0
    base = 150 + 30 * np.sin(2 * np.pi * minutes / (24 * 60)) + rng.normal(0, 5, n)
    frame = pd.DataFrame({"kettle": kettle, "fridge": fridge.clip(min=0)}, index=index)
    frame.insert(0, "aggregate", base + frame["kettle"] + frame["fridge"])
    return frame


def write_ukdale(root: Path, houses: dict[str, pd.DataFrame]) -> Path:
    """``root/house_N/labels.dat`` and ``channel_i.dat`` (``unix_ts watts``), each channel
    on its own clock (the submeters 1 s later than the mains)."""
    for house, frame in houses.items():
        folder = root / f"house_{house}"
        folder.mkdir(parents=True)
        names = list(frame.columns)
        (folder / "labels.dat").write_text("".join(f"{i} {n}\n" for i, n in enumerate(names, 1)))
        for i, name in enumerate(names, 1):
            unix = frame.index.as_unit("s").asi8 // 1 + (0 if i == 1 else 1)
            lines = "".join(
                f"{t} {int(round(v))}\n" for t, v in zip(unix, frame[name].to_numpy(), strict=True)
            )
            (folder / f"channel_{i}.dat").write_text(lines)
    return root


def write_refit(path: Path, frame: pd.DataFrame) -> Path:
    """REFIT's CLEAN_House<N>.csv: Time (local text), Unix, Aggregate, numbered submeters,
    Issues; a labels file beside it names them."""
    table = pd.DataFrame({
        "Time": frame.index.tz_convert("Europe/London").strftime("%Y-%m-%d %H:%M:%S"),
        "Unix": frame.index.as_unit("s").asi8,
        "Aggregate": frame["aggregate"].round().astype(int).to_numpy(),
    })  # fmt: skip
    submeters = [c for c in frame.columns if c != "aggregate"]
    for i in range(1, 10):
        column = frame[submeters[i - 1]] if i <= len(submeters) else pd.Series(0, index=frame.index)
        table[f"Appliance{i}"] = column.round().astype(int).to_numpy()
    table["Issues"] = 0
    table.to_csv(path, index=False)
    path.with_suffix(".labels").write_text(
        "".join(f"{i} {n}\n" for i, n in enumerate(submeters, 1))
    )
    return path


def write_nilmtk(path: Path, houses: dict[str, pd.DataFrame], metadata: bool = True) -> Path:
    """NILMTK's HDF5: ``/building<i>/elec/meter<j>`` tables of ``(power, active)``; the
    building's metadata names its site meter and its meters."""
    with pd.HDFStore(path, mode="w") as store:
        for house, frame in houses.items():
            for j, name in enumerate(frame.columns, 1):
                table = pd.DataFrame({("power", "active"): frame[name].astype(np.float32)})
                table.columns = pd.MultiIndex.from_tuples(
                    table.columns, names=["physical_quantity", "type"]
                )
                store.put(
                    f"/building{house}/elec/meter{j}", table, format="table", track_times=False
                )
            if metadata:
                node = store.get_node(f"/building{house}")
                node._v_attrs.metadata = {
                    "instance": int(house),
                    "elec_meters": {
                        j: {"site_meter": j == 1} for j in range(1, len(frame.columns) + 1)
                    },
                    "appliances": [
                        {"type": name, "instance": 1, "meters": [j]}
                        for j, name in enumerate(frame.columns, 1) if name != "aggregate"
                    ],
                }  # fmt: skip
    return path


def command_flags(root: Path, factory: str, **changes) -> list[str]:
    """The flags of a recording command on ``root``'s UK-DALE house and trained checkpoint
    (``--model factory``, kettle, scale and clip 6000); ``changes`` override or add flags
    (None drops one)."""
    options = {
        "--model": factory,
        "--checkpoint": str(root / "trainer.pt"),
        "--recording": str(root / "ukdale"),
        "--target": "kettle",
        "--scale": "6000",
        "--clip": "6000",
        **changes,
    }
    return [x for kv in options.items() for x in kv if kv[1] is not None]

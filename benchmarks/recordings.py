"""Reading a recording and evaluating a model on it, beside the plain route of the same run.

1. A year of one house at 6 s in UK-DALE's layout (5.3 M lines x 7 channels, written once
   into ``--cache``): ``attnpanel.series.read_recordings`` + ``windows_of`` (1 min, L 480)
   against ``pandas.read_csv`` + ``resample("1min").mean()`` of the same files alone
   (target <= 1.5x).
2. ``RecordingModel.evaluate()`` over the windows against the plain forwards of the same
   windows (target <= 1.2x), the reference NILMFormer of the tests.
3. ``attnpanel serve --model ... --recording ...`` (the reference NILMFormer, 3 layers x 8
   heads, on 8 windows of a UK-DALE house): from the command to the first page drawn in
   Chromium, and the next pages, beside ``attnpanel serve`` of the demo in the same run
   (target: first page <= 1.5x the demo's).

Medians and p95 over ``--repeats`` rounds, each round timing both routes in turn::

    python benchmarks/recordings.py [--days 365] [--repeats 3] [--pages 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
CHANNELS = ("aggregate", "kettle", "fridge", "washer", "dishwasher", "microwave", "lights")


def write_house(folder: Path, days: int, step_s: int = 6) -> Path:
    """One UK-DALE house of ``days`` days at ``step_s`` seconds (written once)."""
    house = folder / "house_1"
    if (house / "labels.dat").exists():
        return folder
    house.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    n = days * 86400 // step_s
    unix = 1_388_534_400 + np.arange(n, dtype=np.int64) * step_s  # 2014-01-01
    for i, name in enumerate(CHANNELS, 1):
        watts = rng.integers(0, 3000 if name == "aggregate" else 300, size=n)
        table = pd.DataFrame({"t": unix + (0 if i == 1 else 1), "w": watts})
        table.to_csv(house / f"channel_{i}.dat", sep=" ", header=False, index=False)
    (house / "labels.dat").write_text("".join(f"{i} {n}\n" for i, n in enumerate(CHANNELS, 1)))
    return folder


def plain_read(folder: Path) -> pd.DataFrame:
    """The baseline: each channel read and resampled with pandas alone."""
    columns = {}
    for i, name in enumerate(CHANNELS, 1):
        table = pd.read_csv(
            folder / "house_1" / f"channel_{i}.dat", sep=" ", header=None,
            names=["t", "w"], engine="pyarrow",
        )  # fmt: skip
        series = pd.Series(
            table["w"].to_numpy(float), index=pd.to_datetime(table["t"], unit="s", utc=True)
        )
        columns[name] = series.resample("1min").mean()
    return pd.DataFrame(columns)


def ours(folder: Path):
    from attnpanel import series

    return series.windows_of(series.read_recordings(folder), length=480, freq="1min")


def summary(times: list[float]) -> str:
    median = statistics.median(times)
    p95 = float(np.percentile(times, 95))
    return f"median {median:.3f} s, p95 {p95:.3f} s"


def evaluate_case(repeats: int) -> None:
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from recordings import house_power
    from reference_nilmformer import reference_nilmformer

    from attnpanel import series

    windows = series.windows_of(series.read_recordings(house_power(hours=24 * 8)), 480)
    recipe = series.make_recipe("nilmformer", scale=6000.0, targets=["kettle"])
    model = reference_nilmformer()
    plain, full = [], []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        with torch.no_grad():
            for first in range(0, windows.sizes["window"], 64):
                (x,), _ = recipe.inputs(windows.isel(window=slice(first, first + 64)))
                model(x)
        plain.append(time.perf_counter() - start)
        start = time.perf_counter()
        series.RecordingModel(model, recipe, windows, {"kettle": 2000.0}).evaluate()
        full.append(time.perf_counter() - start)
    plain, full = plain[1:], full[1:]  # the first round warms up
    ratio = statistics.median(full) / statistics.median(plain)
    print(f"evaluate, {windows.sizes['window']} windows: {summary(full)}")
    print(f"plain forwards:             {summary(plain)}")
    print(f"ratio (target <= 1.2): {ratio:.2f}")


def served_pages(command: list[str], pages: int) -> tuple[float, list[float]]:
    """Seconds from starting ``attnpanel serve ...`` to its first page drawn (the server's
    start, its build and the first page), and each later page's request to drawn."""
    sys.path.insert(0, str(ROOT / "tests"))
    from playwright.sync_api import sync_playwright
    from served_app import HELPERS_JS, RENDERED_JS, free_port, launch_chromium, serving

    port = free_port()
    cmd = [sys.executable, "-m", "attnpanel", "serve", *command, "--port", str(port)]
    url = f"http://localhost:{port}/attnpanel"
    later = []
    with sync_playwright() as p:
        browser = launch_chromium(p)
        start = time.perf_counter()
        with serving(cmd, port, url, timeout=600) as (url, _proc):
            for index in range(pages + 1):
                page = browser.new_page(viewport={"width": 1600, "height": 1300})
                asked = time.perf_counter()
                page.goto(url, timeout=600_000)
                page.wait_for_function(
                    "() => window.Bokeh && Object.keys(Bokeh.index || {}).length > 0",
                    timeout=600_000,
                )
                page.evaluate(HELPERS_JS)
                page.wait_for_function(RENDERED_JS, timeout=600_000, polling=50)
                now = time.perf_counter()
                if index == 0:
                    first = now - start
                else:
                    later.append(now - asked)
                page.close()
        browser.close()
    return first, later


def serve_case(pages: int) -> None:
    import tempfile

    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from recordings import house_power, write_ukdale
    from reference_nilmformer import reference_nilmformer, trainer_checkpoint

    folder = Path(tempfile.mkdtemp())
    write_ukdale(folder / "ukdale", {"1": house_power(hours=24 * 3)})
    torch.manual_seed(0)
    trainer_checkpoint(reference_nilmformer(), folder / "kettle.pt")
    recording = [
        "--model", str(ROOT / "tests" / "reference_nilmformer.py") + ":reference_nilmformer",
        "--checkpoint", str(folder / "kettle.pt"), "--recording", str(folder / "ukdale"),
        "--target", "kettle", "--scale", "6000", "--clip", "6000",
        "--threshold", "kettle=2000", "--windows", "8",
    ]  # fmt: skip
    demo_first, demo_later = served_pages([], pages)
    ours_first, ours_later = served_pages(recording, pages)
    print("attnpanel serve: start -> first page drawn (s); later pages request -> drawn")
    print(f"demo (32 windows, 1 layer x 8 heads): first {demo_first:.1f}; {summary(demo_later)}")
    print(f"recording (8 windows, 3 layers x 8 heads): first {ours_first:.1f}; "
          f"{summary(ours_later)}")  # fmt: skip
    print(f"first page ratio (target <= 1.5): {ours_first / demo_first:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--days", type=int, default=365)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "attnpanel"))
    parser.add_argument("--pages", type=int, default=4, help="pages after the first (4)")
    parser.add_argument("--only-serve", action="store_true", help="the served pages alone")
    args = parser.parse_args()
    if args.only_serve:
        serve_case(args.pages)
        return
    folder = write_house(Path(args.cache) / f"bench-ukdale-{args.days}d", args.days)
    base, found = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        plain_read(folder)
        base.append(time.perf_counter() - start)
        start = time.perf_counter()
        cut = ours(folder)
        found.append(time.perf_counter() - start)
    lines = args.days * 86400 // 6
    print(f"read + 1 min + windows, {lines:,} lines x {len(CHANNELS)} channels, "
          f"{cut.sizes['window']} windows")  # fmt: skip
    print(f"attnpanel.series:          {summary(found)}")
    print(f"pandas read_csv + resample: {summary(base)}")
    print(f"ratio (target <= 1.5): {statistics.median(found) / statistics.median(base):.2f}")
    evaluate_case(args.repeats)
    serve_case(args.pages)


if __name__ == "__main__":
    main()

"""Attention at long lengths: virtual traces, exact tiles and overviews beside the dense path.

Run: ``python benchmarks/tiles.py [--lengths 4096 16384 65536] [--repeats 9]``.

The demo's layer shape (d_model 96, 8 heads, head dim 12), diagonal mask, one sample of
random input. Per length, each case in a fresh process (peak memory is that process's
``ru_maxrss``, the imports of torch, dask and attnpanel included, about 0.5 GB):

- **virtual trace**: ``trace(layer, x, dense=False)``: the layer's forward through the
  fused kernel, ``lse`` kept instead of the maps (time, peak memory);
- **dense trace**, the baseline, where its two maps fit in 2 GiB: ``trace(layer, x,
  dense=True)``;
- **overview**: one head's 480 x 480 overview (``tiles.overview``), and the time to read it
  back from its zarr store (``overviews.Overviews``, a reopened trace);
- **window**: a random 480 x 480 window of the virtual trace's lazy ``weights`` (a dask
  slice: every 1024 x 1024 chunk it touches is computed), exactly (median and p95 over
  ``--repeats``); **row**: one query's weights over every key (what a query click draws as
  bars), through ``virtual.window``, which computes only the row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CASE = r"""
import json, resource, sys, tempfile, time
import numpy as np
import torch
from attnpanel.kernels.attention import MultiHeadSelfAttention
from attnpanel.traces.overviews import Entry, Overviews
from attnpanel.trace import trace
from attnpanel import virtual
kind, length, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
layer = MultiHeadSelfAttention(96, 8, "diagonal").eval()
x = torch.randn(1, length, 96)
out = {}
start = time.perf_counter()
ds = trace(layer, x, dense=kind == "dense")
out["trace"] = time.perf_counter() - start
if kind == "virtual":
    with tempfile.TemporaryDirectory() as folder:
        entry = Entry(sample=0, head=0, mask="diagonal")
        start = time.perf_counter()
        Overviews(ds, folder).get(entry)
        out["overview"] = time.perf_counter() - start
        start = time.perf_counter()
        Overviews(ds, folder).get(entry)
        out["overview_read"] = time.perf_counter() - start
    weights = ds["weights"]
    lse = virtual.row_lse(ds, "diagonal", 0)
    generator = np.random.default_rng(1)
    windows, rows = [], []
    for _ in range(repeats):
        r, c = generator.integers(0, max(1, length - 480), 2)
        head = int(generator.integers(0, 8))
        start = time.perf_counter()
        weights.isel(batch=0, head=head, query=slice(r, r + 480), key=slice(c, c + 480)).values
        windows.append(time.perf_counter() - start)
        start = time.perf_counter()
        virtual.window(ds, 0, head, slice(r, r + 1), slice(None), lse=lse)
        rows.append(time.perf_counter() - start)
    out["windows"], out["rows"] = windows, rows
out["peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out))
"""

DENSE_LIMIT = 2 * 2**30  # the dense baseline runs where its two maps fit


def run(kind: str, length: int, repeats: int) -> dict:
    found = subprocess.run(
        [sys.executable, "-c", CASE, kind, str(length), str(repeats)],
        capture_output=True,
        text=True,
    )
    if found.returncode != 0:
        raise SystemExit(f"{kind} at L={length} failed:\n{found.stderr[-2000:]}")
    return json.loads(found.stdout.strip().splitlines()[-1])


def p95(values: list[float]) -> float:
    return sorted(values)[max(0, round(0.95 * len(values)) - 1)]


def ms(values: list[float]) -> str:
    values = [1000 * v for v in values]
    return f"{statistics.median(values):.0f} / {p95(values):.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    print("one sample, 8 heads, head dim 12, diagonal mask; each case in a fresh process")
    print(
        "| L | virtual trace (s) | peak (MB) | dense trace (s) | dense peak (MB) "
        "| overview, one head (s) | overview read back (ms) "
        "| 480x480 window median / p95 (ms) | one row median / p95 (ms) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for length in args.lengths:
        virtual = run("virtual", length, args.repeats)
        dense, dense_peak = "does not fit", "-"
        if 2 * 4 * 8 * length * length <= DENSE_LIMIT:
            baseline = run("dense", length, 0)
            dense, dense_peak = f"{baseline['trace']:.2f}", f"{baseline['peak_mb']:.0f}"
        print(
            f"| {length} | {virtual['trace']:.2f} | {virtual['peak_mb']:.0f} | {dense} "
            f"| {dense_peak} | {virtual['overview']:.2f} | {1000 * virtual['overview_read']:.0f} "
            f"| {ms(virtual['windows'])} | {ms(virtual['rows'])} |",
            flush=True,
        )


if __name__ == "__main__":
    main()

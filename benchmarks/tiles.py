"""Exact attention tiles at long lengths (attnpanel.tiles) beside the dense path.

Run: ``python benchmarks/tiles.py [--lengths 4096 16384] [--windows 9]``.

One sample, one head, head dim 12, diagonal mask, random q, k, v. Per length it prints:
the streaming pass that computes every row's log-sum-exp (``row_statistics``), the
bounded-memory forward (``blocked_attention``), the 480 x 480 overview of the whole map
(per-pixel max, mean and blocked share, ``overview``), and the median and p95 time to compute a
random 480 x 480 window of the lazy weights (what a zoomed view asks for); beside them,
in the same run, the dense path (``attention.attention_weights``, the whole ``L x L``
map) where it fits in 2 GiB, and each side's peak memory (measured in a fresh process
per case, ``ru_maxrss``, torch's import included).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

CASE = r"""
import json, resource, sys, time
import torch
from attnpanel.attention import attention_weights, build_mask
from attnpanel.tiles import Masking, blocked_attention, lazy_weights, overview, row_statistics
kind, length, windows = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
q, k, v = (torch.randn(1, 1, length, 12) for _ in range(3))
out = {}
if kind == "dense":
    start = time.perf_counter()
    weights = attention_weights(q, k, build_mask("diagonal", length), 12 ** -0.5)
    out["dense"] = time.perf_counter() - start
else:
    masking = Masking("diagonal")
    start = time.perf_counter()
    _, lse = row_statistics(q, k, masking)
    out["statistics"] = time.perf_counter() - start
    start = time.perf_counter()
    blocked_attention(q, k, v, masking)
    out["forward"] = time.perf_counter() - start
    start = time.perf_counter()
    overview(q, k, lse, masking, pixels=(480, 480))
    out["overview"] = time.perf_counter() - start
    lazy = lazy_weights(q, k, lse, masking)
    generator = torch.Generator().manual_seed(1)
    times = []
    for _ in range(windows):
        r, c = (int(x) for x in torch.randint(0, max(1, length - 480), (2,), generator=generator))
        start = time.perf_counter()
        lazy[0, 0, r : r + 480, c : c + 480].compute()
        times.append(time.perf_counter() - start)
    out["windows"] = times
out["peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out))
"""

DENSE_LIMIT = 2 * 2**30  # the dense baseline runs where its weights (and scores) fit


def run(kind: str, length: int, windows: int) -> dict:
    found = subprocess.run(
        [sys.executable, "-c", CASE, kind, str(length), str(windows)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(found.stdout.strip().splitlines()[-1])


def p95(values: list[float]) -> float:
    return sorted(values)[max(0, round(0.95 * len(values)) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--windows", type=int, default=9)
    args = parser.parse_args()
    print("one sample, one head, E = 12, diagonal mask; seconds, window in ms")
    print(
        "| L | row statistics (s) | bounded forward (s) | overview 480x480 (s)"
        " | 480x480 window median / p95 (ms) | tiles peak (MB) | dense map (s) | dense peak (MB) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for length in args.lengths:
        tiles = run("tiles", length, args.windows)
        ms = [1000 * t for t in tiles["windows"]]
        dense = "does not fit"
        dense_peak = "-"
        if 2 * 4 * length * length <= DENSE_LIMIT:
            baseline = run("dense", length, 0)
            dense, dense_peak = f"{baseline['dense']:.2f}", f"{baseline['peak_mb']:.0f}"
        print(
            f"| {length} | {tiles['statistics']:.2f} | {tiles['forward']:.2f} | "
            f"{tiles['overview']:.2f} | "
            f"{statistics.median(ms):.0f} / {p95(ms):.0f} | {tiles['peak_mb']:.0f} | "
            f"{dense} | {dense_peak} |"
        )
        time.sleep(0.5)


if __name__ == "__main__":
    main()

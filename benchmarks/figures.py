"""``attnpanel figure`` from the command line, view by view, beside the README's own
``attnpanel trace --demo`` in the same run.

Run: ``python benchmarks/figures.py [--repeats 5]``.

Writes the README's demo file once (``attnpanel trace --demo``), then times, each in a fresh
process as a user runs them, ``attnpanel figure demo.nc --view V -o V.png`` for the views
a trace draws (matrix, heads, model) and, as the baseline, ``attnpanel trace --demo`` itself
(the command the README runs just before). Rounds alternate the commands so that the
machine's load hits all alike. Prints the median and p95 wall time of each and its ratio to
the baseline's median. The PNG is the slowest of the three formats (300 dpi).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VIEWS = ("matrix", "heads", "model")


def p95(values: list[float]) -> float:
    return sorted(values)[max(0, round(0.95 * len(values)) - 1)]


def timed(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    cli = [sys.executable, "-m", "attnpanel"]
    with tempfile.TemporaryDirectory() as folder:
        demo = Path(folder) / "demo.nc"
        commands = {"trace --demo (baseline)": [*cli, "trace", "--demo", "-o", str(demo)]}
        subprocess.run([*commands["trace --demo (baseline)"]], check=True, capture_output=True)
        commands["trace --demo (baseline)"].append("--force")
        for view in VIEWS:
            out = Path(folder) / f"{view}.png"
            commands[f"figure --view {view}"] = [
                *cli, "figure", str(demo), "--view", view, "--sample", "1", "-o", str(out),
                "--force",
            ]  # fmt: skip
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.repeats):
            for name, command in commands.items():
                times[name].append(timed(command))
    base = statistics.median(times["trace --demo (baseline)"])
    print(f"{'command':<26}{'median s':>10}{'p95 s':>9}{'x baseline':>12}")
    for name, found in times.items():
        median = statistics.median(found)
        print(f"{name:<26}{median:>10.2f}{p95(found):>9.2f}{median / base:>12.2f}")


if __name__ == "__main__":
    main()

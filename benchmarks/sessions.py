"""What one more session costs the served demo: server CPU seconds and resident memory.

Run: ``python benchmarks/sessions.py [--sessions 6]``.

Serves ``apps/main.py`` with ``panel serve`` (one process, loopback only) and requests the
page ``--sessions`` times in a row with plain HTTP GETs: each request makes a session and
builds its explorer, whose whole document the page carries, so the server does a session's
work without a browser. Read from the server's own ``/proc`` figures, it prints:

* the server's memory at baseline (started, no session yet);
* per request: wall time, server CPU seconds, memory after it;
* the median CPU seconds and the median memory added per session after the first (the
  first also computes what a process shares: the demo trace);
* memory after every session has been discarded (Bokeh drops a session whose page never
  connected after ``--unused-session-lifetime``, set short here) and collected.

The baseline, in the same run, is the first session: what every session cost before the
trace was shared per process.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from served_app import cpu_seconds, rss_mb, serve  # noqa: E402


def request(url: str) -> float:
    start = time.perf_counter()
    with urllib.request.urlopen(url, timeout=300) as response:
        response.read()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--idle", type=float, default=30.0, help="seconds to wait at the end")
    args = parser.parse_args(argv)
    lines = []
    extra = ["--unused-session-lifetime", "5000", "--check-unused-sessions", "1000"]
    with serve(extra_args=extra) as (url, proc):
        time.sleep(2)
        baseline = rss_mb(proc.pid)
        lines.append(f"baseline: {baseline:.0f} MB")
        cpu, memory, rows = [], [baseline], []
        for index in range(args.sessions):
            before = cpu_seconds(proc.pid)
            wall = request(url)
            time.sleep(0.5)
            cpu.append(cpu_seconds(proc.pid) - before)
            memory.append(rss_mb(proc.pid))
            rows.append(
                f"| {index + 1} | {wall:.2f} | {cpu[-1]:.2f} | {memory[-1]:.0f} |"
                f" {memory[-1] - memory[-2]:+.0f} |"
            )
        lines += [
            "| session | wall (s) | server CPU (s) | server memory (MB) | added (MB) |",
            "| --- | --- | --- | --- | --- |",
            *rows,
        ]
        later_cpu = cpu[1:] or cpu
        added = [b - a for a, b in zip(memory[1:-1], memory[2:], strict=True)] or [0.0]
        lines.append(
            f"first session (baseline: builds the shared trace): {cpu[0]:.2f} s CPU, "
            f"{memory[1] - memory[0]:+.0f} MB"
        )
        lines.append(
            f"each further session: median {statistics.median(later_cpu):.2f} s CPU "
            f"(max {max(later_cpu):.2f}), median {statistics.median(added):+.0f} MB"
        )
        time.sleep(args.idle)
        log = ROOT / "artifacts" / f"serve-{urllib.parse.urlparse(url).port}.log"
        if "Error running application handler" in log.read_text():
            raise RuntimeError(f"the app failed in a session: see {log}")
        lines.append(
            f"{args.idle:.0f} s after the last request (sessions discarded): "
            f"{rss_mb(proc.pid):.0f} MB"
        )
    report = "\n".join(lines)
    print(report)
    return report


if __name__ == "__main__":
    main()

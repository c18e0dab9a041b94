"""What one more session costs the served demo: server CPU seconds and resident memory.

Run: ``python benchmarks/sessions.py [--sessions 6]``.

Serves ``apps/main.py`` as the README does (``--warm``: the demo, its model and a first
explorer are built as the server starts; one process, loopback only) and requests the page
``--sessions`` times in a row with plain HTTP GETs: each request makes a session and its
explorer, whose whole document the page carries, so the server does a session's work
without a browser. The first takes the explorer built as the server started; each later
one builds its own (a plain GET connects no browser, so its page never loads and nothing
is built ahead for the next). A request answered by the loading page (nothing built) is
an error. Read from the server's own ``/proc`` figures, it prints:

* the server's memory at baseline (started and warm, no session yet);
* per request: wall time, server CPU seconds, memory after it;
* the median CPU seconds and the median memory added per session after the first;
* memory after every session has been discarded (Bokeh drops a session whose page never
  connected after ``--unused-session-lifetime``, set short here) and collected.
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

from served_app import cpu_seconds, rss_mb, serve, wait_idle  # noqa: E402

LOADING = "builds the demo once"  # serving.LoadingPage's words: a session that built nothing


def request(url: str) -> float:
    start = time.perf_counter()
    with urllib.request.urlopen(url, timeout=300) as response:
        page = response.read().decode("utf-8", "replace")
    if LOADING in page:
        raise RuntimeError("the server answered with its loading page: no explorer was built")
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--idle", type=float, default=30.0, help="seconds to wait at the end")
    args = parser.parse_args(argv)
    lines = []
    # the README's command (--warm: the demo is built as the server starts), sessions that
    # no browser connects to discarded after 5 s
    extra = ["--warm", "--unused-session-lifetime", "5000", "--check-unused-sessions", "1000"]
    with serve(extra_args=extra) as (url, proc):
        wait_idle(proc.pid)  # what the server does once as it starts (the demo's survey)
        time.sleep(6)  # and the memory it gives back after (serving.TRIM_DELAY_S)
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
            f"first session (takes the explorer built as the server started): {cpu[0]:.2f} s CPU, "
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

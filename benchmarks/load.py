"""Load test of the served demo: many browser sessions at once, on loopback only.

Run: ``python benchmarks/load.py [--sessions 20] [--waves 3] [--wave-size 10]``.

``panel serve apps/main.py`` runs in its own process (one server process); headless
Chromium, in this process, opens the sessions. It prints, from the server's own ``/proc``
figures:

* the time until every one of ``--sessions`` pages opened at once has rendered its
  matrix (bounded by ``--timeout``; a page that never renders is counted as an error);
* server CPU seconds per session (after the first, which computes the shared trace);
* server memory at baseline, after 1, 5 and ``--sessions`` sessions, and ``--idle``
  seconds after every page has closed;
* memory after each of ``--waves`` waves of ``--wave-size`` pages opened and closed
  (memory that grows wave after wave is a leak).

Targets (issue 11): every session renders, 0 errors, at most 150 MB and 1 s of server CPU
per additional session, memory after the waves within 10 % of the one-session figure.
The baseline is the one-session figure measured in the same run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from served_app import (  # noqa: E402
    HELPERS_JS,
    RENDERED_JS,
    cpu_seconds,
    launch_chromium,
    rss_mb,
    serve,
)


def open_pages(context, url: str, count: int, timeout: float) -> tuple[list, float, int]:
    """``count`` pages opened at once; returns them, seconds until all rendered, errors."""
    start = time.perf_counter()
    pages, errors = [], 0
    for _ in range(count):
        page = context.new_page()
        page.goto(url, wait_until="commit", timeout=timeout * 1000)
        pages.append(page)
    pending = list(pages)
    while pending and time.perf_counter() - start < timeout:
        for page in list(pending):
            try:
                ready = page.evaluate(
                    "() => !!(window.Bokeh && Bokeh.index && Object.keys(Bokeh.index).length)"
                )
                if ready:
                    page.evaluate(HELPERS_JS)
                    if page.evaluate(RENDERED_JS):
                        pending.remove(page)
            except Exception:  # noqa: BLE001 - a page still navigating; asked again
                pass
        time.sleep(0.5)
    errors += len(pending)
    return pages, time.perf_counter() - start, errors


def close_pages(pages) -> None:
    for page in pages:
        page.close()


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--waves", type=int, default=3)
    parser.add_argument("--wave-size", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per batch")
    parser.add_argument("--idle", type=float, default=60.0)
    args = parser.parse_args(argv)
    from playwright.sync_api import sync_playwright

    lines = []
    # Bokeh drops a closed page's session after this long (ms); checked every second
    extra = ["--unused-session-lifetime", "5000", "--check-unused-sessions", "1000"]
    with serve(extra_args=extra) as (url, proc), sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        context = browser.new_context(viewport={"width": 1600, "height": 1300})
        time.sleep(2)
        memory = {"baseline": rss_mb(proc.pid)}
        first, seconds, errors = open_pages(context, url, 1, args.timeout)
        memory["1 session"] = rss_mb(proc.pid)
        lines.append(f"first session rendered in {seconds:.1f} s (computes the shared trace)")
        cpu_start = cpu_seconds(proc.pid)
        more, seconds, more_errors = open_pages(context, url, 4, args.timeout)
        memory["5 sessions"] = rss_mb(proc.pid)
        rest, seconds_all, rest_errors = open_pages(context, url, args.sessions - 5, args.timeout)
        memory[f"{args.sessions} sessions"] = rss_mb(proc.pid)
        cpu_per_session = (cpu_seconds(proc.pid) - cpu_start) / max(1, args.sessions - 1)
        errors += more_errors + rest_errors
        lines.append(
            f"{args.sessions - 5} sessions opened at once: all rendered in {seconds_all:.1f} s; "
            f"errors (never rendered) in all: {errors}"
        )
        close_pages(first + more + rest)
        time.sleep(args.idle)
        memory[f"{args.idle:.0f} s after all closed"] = rss_mb(proc.pid)
        for wave in range(args.waves):
            pages, seconds, wave_errors = open_pages(context, url, args.wave_size, args.timeout)
            close_pages(pages)
            time.sleep(10)
            memory[f"after wave {wave + 1} ({args.wave_size} opened, closed)"] = rss_mb(proc.pid)
            lines.append(f"wave {wave + 1}: rendered in {seconds:.1f} s, errors {wave_errors}")
        browser.close()
    one = memory["1 session"]
    added = (memory[f"{args.sessions} sessions"] - one) / max(1, args.sessions - 1)
    lines.append(f"server CPU per additional session: {cpu_per_session:.2f} s (target <= 1 s)")
    lines.append(f"server memory per additional session: {added:.0f} MB (target <= 150 MB)")
    lines += ["| server memory | MB | vs one session |", "| --- | --- | --- |"]
    lines += [f"| {k} | {v:.0f} | {v / one:.2f}x |" for k, v in memory.items()]
    report = "\n".join(lines)
    print(report)
    return report


if __name__ == "__main__":
    main()

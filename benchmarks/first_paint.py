"""Request to complete first paint of the served explorer, beside a naive DynamicMap page.

Run: ``python benchmarks/first_paint.py [--pages 6] [--gap 0] [--app demo|text]``.

``--app text`` serves ``apps/text.py`` (the shipped MiniLM) started cold (its first page
shows the model loading, then the explorer) and with ``--warm``, beside the one-map floor.

Serves ``apps/main.py`` and, as the baseline in the same run, ``benchmarks/naive_app.py``
(the same views as HoloViews DynamicMaps) with ``panel serve`` on loopback, opens each
``--pages`` times in headless Chromium one after another (``--gap`` seconds apart), and
prints the median and p95 time from the request to Bokeh's document being idle (the first
paint: every view on the page rendered and painted; a served explorer puts the sections
below the fold in their place after it), the median time to the server's answer (the
page's HTML) and the time until every section is in its place and the page idle again. The
first page of each server is left out of the figures (it builds the shared demo trace) and
printed apart; the row of a server started with ``--warm`` (the README's command: the demo
and the first explorer are built as the server starts) shows the cold start the first
visitor meets, requested as soon as the server listens. The row of
``benchmarks/skeleton_app.py`` is the README's page with every figure's data cut to two
points: what the page's structure costs whatever its data (its "every section" column is
its first paint: its later sections are not waited for). A last row,
``benchmarks/one_map_app.py`` (a Panel page with one 480 x 480 map), is this machine's
floor in the same run.

With ``--gap 0`` a page is requested as soon as the previous one is idle: the explorer
built ahead for it (``attnpanel.app.serving.built_ahead``) is then still being built, and the
request waits for the rest. ``--gap 2`` is a visitor arriving to an idle server.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from playwright.sync_api import TimeoutError as PlaywrightTimeout  # noqa: E402
from served_app import APP, LATER_JS, launch_chromium, serve  # noqa: E402

IDLE_JS = "() => window.Bokeh && Bokeh.documents.length > 0 && Bokeh.documents[0].is_idle"
ANSWER_JS = "() => performance.getEntriesByType('navigation')[0].responseStart"
PLOTS_JS = (
    "() => [...Bokeh.documents[0].all_models]"
    ".filter(m => m.type == 'Figure' || m.type == 'Plot').length"
)
DRAWN_JS = f"() => ({IDLE_JS})() && ({PLOTS_JS})() > 0"
# every section in its place (a served explorer puts those below the fold there after its
# first paint, attnpanel/app/later.py) and the document idle again
COMPLETE_JS = f"() => ({DRAWN_JS})() && ({LATER_JS})()"


def check_rendered(page, app: Path) -> None:
    """Raise unless the page drew plots: a page whose app failed is idle at once, and
    empty (its app's error is in the server's log, not the page)."""
    if page.evaluate(PLOTS_JS) == 0:
        raise RuntimeError(
            f"{app.name} served a page without plots: its app failed (is attnpanel "
            "installed in this environment?); the page reads: " + page.inner_text("body")[:300]
        )


def first_paints(
    browser, app: Path, pages: int, gap: float, extra=(), every_section: bool = True
) -> tuple[list[float], list[float], list[float]]:
    """Seconds from the request to an idle document, to the server's answer and to every
    section in its place, for ``pages`` pages in a row, ``gap`` seconds apart (``extra``:
    ``panel serve``'s options; the first page is requested as soon as the server listens;
    ``every_section=False``: the first paint only, for a page whose later sections are not
    drawn)."""
    times, answers, complete = [], [], []
    with serve(app, extra_args=extra) as (url, _proc):
        for _ in range(pages):
            page = browser.new_page(viewport={"width": 1600, "height": 1300})
            start = time.perf_counter()
            page.goto(url, timeout=300_000)
            page.wait_for_function(IDLE_JS, timeout=300_000, polling=20)
            if page.evaluate(PLOTS_JS) == 0:
                # a cold server's first page shows its loading page, then the explorer in
                # the same document; a failed app stays empty (check_rendered says so)
                with contextlib.suppress(PlaywrightTimeout):
                    page.wait_for_function(DRAWN_JS, timeout=240_000, polling=20)
            times.append(time.perf_counter() - start)
            if every_section:
                page.wait_for_function(COMPLETE_JS, timeout=300_000, polling=20)
            complete.append(time.perf_counter() - start)
            answers.append(page.evaluate(ANSWER_JS) / 1000)
            check_rendered(page, app)
            page.close()
            time.sleep(gap)
    return times, answers, complete


def p95(values: list[float]) -> float:
    return sorted(values)[max(0, round(0.95 * len(values)) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=6)
    parser.add_argument(
        "--gap", type=float, default=0.0, help="seconds between pages (default 0: back to back)"
    )
    parser.add_argument(
        "--app",
        choices=("demo", "text"),
        default="demo",
        help="demo: apps/main.py beside its baselines (default); text: apps/text.py (MiniLM) "
        "started cold and with --warm, beside the one-map floor",
    )
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = launch_chromium(p)
        rows = text_rows(browser, args) if args.app == "text" else demo_rows(browser, args)
        browser.close()
    report(rows, args)


def text_rows(browser, args) -> dict:
    """The text page (apps/text.py on the shipped MiniLM): a cold server's first page is its
    loading page then the explorer; a warm one's first page is built as the server starts."""
    text = ROOT / "apps" / "text.py"
    return {
        "text page (apps/text.py), server started cold": first_paints(
            browser, text, args.pages, args.gap
        ),
        "text page, server started with --warm": first_paints(
            browser, text, args.pages, args.gap, extra=("--warm",)
        ),
        "floor: one 480 x 480 map alone": first_paints(
            browser, ROOT / "benchmarks" / "one_map_app.py", args.pages, args.gap
        ),
    }


def demo_rows(browser, args) -> dict:
    """The demo page (apps/main.py), cold and warm, beside its baselines."""
    rows = {
        "explorer (apps/main.py)": first_paints(browser, APP, args.pages, args.gap),
        "explorer, server started with --warm (the README's)": first_paints(
            browser, APP, args.pages, args.gap, extra=("--warm",)
        ),
        "naive DynamicMaps (baseline)": first_paints(
            browser, ROOT / "benchmarks" / "naive_app.py", args.pages, args.gap
        ),
        "the README's page with its data cut away (structure only)": first_paints(
            browser,
            ROOT / "benchmarks" / "skeleton_app.py",
            args.pages,
            args.gap,
            extra=("--warm",),
            every_section=False,
        ),
        "floor: one 480 x 480 map alone": first_paints(
            browser, ROOT / "benchmarks" / "one_map_app.py", args.pages, args.gap
        ),
    }
    return rows


def report(rows: dict, args) -> None:
    what = "demo 32 x 8 x 480 x 480" if args.app == "demo" else "MiniLM, 6 x 12 x 13 x 13"
    print(f"request -> complete first paint (document idle), {what}, pages {args.gap:g} s apart")
    print(
        "| page | first page (s) | median (s) | p95 (s) | server answer, median (s) "
        "| every section in place, median (p95) (s) |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    floor = statistics.median(rows["floor: one 480 x 480 map alone"][0][1:])
    for name, (times, answers, complete) in rows.items():
        rest, done = times[1:], complete[1:]
        print(
            f"| {name} | {times[0]:.2f} | {statistics.median(rest):.2f} | {p95(rest):.2f} "
            f"| {statistics.median(answers[1:]):.2f} "
            f"| {statistics.median(done):.2f} ({p95(done):.2f}) |"
        )
    later = {  # each page's later pages' median first paint (the floor's row left out)
        name.split(" (")[0]: (times[0], statistics.median(times[1:]))
        for name, (times, _, _) in rows.items()
        if not name.startswith("floor")
    }
    for what, ratio in (
        ("first page over the later pages' median (the first visitor's wait)", lambda f, m: f / m),
        ("first paint over the floor (medians)", lambda f, m: m / floor),
    ):
        ratios = ", ".join(f"{name} {ratio(*times):.2f}x" for name, times in later.items())
        print(f"{what}: {ratios}")


if __name__ == "__main__":
    main()

"""Opening a section of the served explorer, from its checkbox to its plots painted.

Run: ``python benchmarks/open_sections.py [--pages 4]``.

Serves ``apps/main.py`` (the demo) with ``panel serve`` and opens ``--pages`` fresh pages
(each its own session) in headless Chromium. On each, every section closed when the page
opens is opened in turn by its checkbox (what a click sets on the checkbox's model) and
timed until the page has more plots than before and its document is idle, two frames
later: the server builds the section (the first time) and the browser paints it. Each is
then closed and opened again (drawn already: shown again). It prints, per section, the
median and p95 of both, beside the page's own first paint (request to idle document) in
the same run (as ``first_paint.py`` measures it), the baseline a section's opening
compares to.

A closed section costs the first page nothing: it is built the first time it is opened
(``Section.shown_by``); the survey's statistics are computed once per server, in a thread
after the first page has loaded.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from first_paint import DRAWN_JS, IDLE_JS, PLOTS_JS  # noqa: E402
from served_app import HELPERS_JS, RENDERED_JS, launch_chromium, serve  # noqa: E402

SECTIONS = (  # the checkbox of each section closed when the page opens
    "Q/K/V projection",
    "head merge and Wo",
    "masked and unmasked side by side",
    "positional encoding",
    "head average beside the head maps",
    "Q/K embedding",
    "patching",
    "every sample (survey)",
)
# Set a checkbox and wait until its document is idle (and, where it ``grows``, the page has
# more plots than before) and two frames have been painted; the milliseconds it took.
OPEN_JS = """
async ([label, on, grows]) => {
  const box = attn.views().find((v) => v.model && v.model.type === "Checkbox"
                                        && v.model.label === label).model;
  const before = attn.plots().length;
  const t0 = performance.now();
  box.active = on;
  const frame = () => new Promise((r) => requestAnimationFrame(r));
  while (performance.now() - t0 < 120000) {
    await frame();
    const grown = !grows || attn.plots().length > before;
    if (grown && Bokeh.documents[0].is_idle) { await frame(); await frame(); break; }
  }
  return performance.now() - t0;
}
"""


def p95(values: list[float]) -> float:
    return sorted(values)[max(0, round(0.95 * len(values)) - 1)]


def measure(pages: int) -> tuple[dict, dict, list[float]]:
    from playwright.sync_api import sync_playwright

    first: dict[str, list[float]] = {label: [] for label in SECTIONS}
    again: dict[str, list[float]] = {label: [] for label in SECTIONS}
    paints = []
    with serve() as (url, _proc), sync_playwright() as p:
        browser = launch_chromium(p)
        for _ in range(pages + 1):  # the first page builds the demo: not counted
            page = browser.new_page(viewport={"width": 1600, "height": 1300})
            start = time.perf_counter()
            page.goto(url, timeout=300_000)
            page.wait_for_function(IDLE_JS, timeout=300_000, polling=20)
            if page.evaluate(PLOTS_JS) == 0:  # a loading page first (as first_paint.py)
                page.wait_for_function(DRAWN_JS, timeout=300_000, polling=20)
            paints.append(time.perf_counter() - start)
            page.evaluate(HELPERS_JS)
            page.wait_for_function(RENDERED_JS, timeout=300_000)
            page.wait_for_timeout(1500)  # the page's idle work (maps sent ahead) lands
            for label in SECTIONS:
                first[label].append(page.evaluate(OPEN_JS, [label, True, True]))
                page.evaluate(OPEN_JS, [label, False, False])
                again[label].append(page.evaluate(OPEN_JS, [label, True, False]))
                page.evaluate(OPEN_JS, [label, False, False])
                page.wait_for_timeout(300)
            page.close()
        browser.close()
    drop_first = {label: times[1:] for label, times in first.items()}
    return drop_first, {label: times[1:] for label, times in again.items()}, paints[1:]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=4, help="fresh pages (sessions)")
    args = parser.parse_args(argv)
    first, again, paints = measure(args.pages)
    print(f"checkbox -> section painted (Chromium, demo), {args.pages} fresh pages")
    print(
        f"baseline, the page's first paint: median {statistics.median(paints):.2f} s, "
        f"p95 {p95(paints):.2f} s"
    )
    print("| section | first open, median (ms) | p95 | opened again, median (ms) | p95 |")
    print("| --- | --- | --- | --- | --- |")
    for label in SECTIONS:
        print(
            f"| {label} | {statistics.median(first[label]):.0f} | {p95(first[label]):.0f} "
            f"| {statistics.median(again[label]):.0f} | {p95(again[label]):.0f} |"
        )


if __name__ == "__main__":
    main()

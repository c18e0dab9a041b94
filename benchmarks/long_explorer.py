"""The explorer of the long demo (a virtual trace, L = 64,800 at 45 days): first paint,
zoom and query click, beside the 480 demo's page measured in the same run.

Run: ``python benchmarks/long_explorer.py [--days 45] [--pages 5] [--repeats 7]``.

1. ``stored_long_demo``: the trace and its 8 overviews, built once into ``--cache`` (the
   time is printed when this run built them; a stored demo opens in well under a second).
2. Request to complete first paint in headless Chromium (Bokeh's document idle) of
   ``attnpanel serve --demo long``, ``--pages`` pages in a row, beside ``attnpanel serve``
   on the 480 demo (the baseline); the first page of each server is printed apart.
3. In one process, on the server's side: a linked zoom (the large map and the 8 head
   maps re-rasterized, side by side on the page's workers) to windows of several sizes,
   then, where the stored overview is coarser than the screen (windows over 4,096^2), the
   large map's refinement to its own pixels (the served page draws it after the zoom);
   and a query click (the row over every key and its top keys), medians and p95 over
   ``--repeats`` rounds at random places.
4. Zoom again while the last zoom's refinement runs: the newest window's own pixels, with
   the superseded refinement stopped at its next step, beside the same with it run to its
   end (the baseline: how the page refined before ``attnpanel.util.cancel``).
5. In Chromium, a head change on the served long page to its repainted map, ``--repeats``
   x 3 changes: once the page holds every head's map of the window (sent ahead while
   idle; the browser draws the change), beside the same page opened with ``?ahead=false``
   (every change a round trip: the map cut from its overview on a worker and sent).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from served_app import HELD_JS, free_port, launch_chromium, open_app, serving  # noqa: E402

IDLE_JS = "() => window.Bokeh && Bokeh.documents.length > 0 && Bokeh.documents[0].is_idle"


def p95(values: list[float]) -> float:
    return sorted(values)[max(0, round(0.95 * len(values)) - 1)]


def first_paints(browser, cmd: list[str], port: int, pages: int) -> list[float]:
    """Seconds from the request to an idle document, for ``pages`` pages in a row."""
    times = []
    with serving(cmd, port, f"http://localhost:{port}/attnpanel", timeout=900) as (url, _):
        for _ in range(pages):
            page = browser.new_page(viewport={"width": 1600, "height": 1300})
            start = time.perf_counter()
            page.goto(url, timeout=300_000)
            page.wait_for_function(IDLE_JS, timeout=300_000, polling=20)
            times.append(time.perf_counter() - start)
            page.close()
    return times


MATRIX = "() => attn.plot('sample 0, head')"
MAIN_IMAGE = (
    f"({MATRIX})().model.renderers.find((r) => r.glyph && r.glyph.type === 'Image'"
    " && r.name !== 'cached levels').data_source.data.image[0]"
)
# a head change timed to the repainted map (the image the server's layer holds is kept to
# tell, once the change's views have landed, whether the server sent a new one)
TIMED_HEAD_JS = f"""
async (value) => {{
  window.attn_image = {MAIN_IMAGE};
  const timing = await attn.timed_change("Head", value, {MATRIX});
  return timing.total;
}}
"""
NO_IMAGE_JS = f"() => ({MAIN_IMAGE}) === window.attn_image"


def head_changes(browser, cmd: list[str], port: int, repeats: int) -> dict[str, list]:
    """Milliseconds from a head change to the repainted map on the served long page, with
    the maps sent ahead and with ``?ahead=false``; and for how many the server sent no
    image (the browser drew the map from its copy, or showed the server's image it held)."""
    found: dict[str, list] = {}
    heads = [f"head {h}" for h in (1, 2, 3, 4, 5, 6, 7, 0)]
    with serving(cmd, port, f"http://localhost:{port}/attnpanel", timeout=900) as (url, _):
        for name, query in (("maps sent ahead", ""), ("round trip (?ahead=false)", "?ahead=false")):
            console: list = []
            page = open_app(browser, url + query, console)
            if not query:  # every head's map of the window, sent while the page is idle
                page.wait_for_function(f"() => ({HELD_JS})('__cached') >= 8", timeout=120_000)
            times, drawn = [], 0
            for i in range(3 * repeats):
                times.append(page.evaluate(TIMED_HEAD_JS, heads[i % len(heads)]))
                page.wait_for_timeout(200)  # the other views land before the next change
                drawn += page.evaluate(NO_IMAGE_JS)
            found[name] = [times, drawn]
            page.close()
    return found


def long_explorer(path: Path):
    """A LongExplorer of the stored trace, its page laid out (as a server's session)."""
    from attnpanel.app.long_explorer import LongExplorer
    from attnpanel.traces import io
    from attnpanel.traces.overviews import folder_for

    explorer = LongExplorer(io.load(path), folder=folder_for(path))
    explorer.__panel__()
    return explorer


def server_side(explorer, repeats: int) -> dict[str, list[float]]:
    """Linked zoom and query click on the long demo's explorer (seconds)."""
    import numpy as np

    n = explorer.trace.sizes["query"]
    rng = np.random.default_rng(0)
    found: dict[str, list[float]] = {}
    refined = [(view, view.refine) for view in explorer.engine.views if view.refine is not None]
    for side in (480, 2048, 4096, 16384):
        for _ in range(repeats):
            x0, y0 = (int(v) for v in rng.integers(0, n - side, size=2))
            window = ((x0 - 0.5, x0 + side - 0.5), (y0 - 0.5, y0 + side - 0.5))
            # what a zoom draws first: the nine maps (windows too large to compute at once
            # for their plot cut from the overviews)
            for view, _ in refined:
                view.refine = None
            start = time.perf_counter()
            explorer.linked.zoom(*window)
            found.setdefault(f"linked zoom to {side:,}^2 cells: 9 maps drawn", []).append(
                time.perf_counter() - start
            )
            # then the maps whose overview is coarser than their pixels, refined one after
            # another (as the served page's refinement worker does)
            due = [id(view) for view, refine in refined if refine(explorer.selection)]
            for view, refine in refined:
                view.refine = refine
            if due:
                start = time.perf_counter()
                explorer.engine.redraw(lambda view, due=due: id(view) in due)
                found.setdefault(
                    f"then the maps' own pixels at {side:,}^2 (refinement)", []
                ).append(time.perf_counter() - start)
    explorer.linked.zoom((-0.5, n - 0.5), (-0.5, n - 0.5))
    for _ in range(repeats):
        query = int(rng.integers(0, n))
        start = time.perf_counter()
        explorer.param.update(query=query)
        found.setdefault("query click: row over every key + top keys", []).append(
            time.perf_counter() - start
        )
    return found


def _still_wanted(stops: bool, superseded: threading.Event) -> bool:
    return not (stops and superseded.is_set())


def zoom_during_refinement(explorer, repeats: int, side: int = 8192) -> dict[str, list[float]]:
    """Zoom to a ``side``^2 window, then again to another 0.2 s into the first window's
    refinement: seconds from the second zoom until its own pixels are computed, on one
    refinement worker as the served page has. The first refinement is stopped at its next
    step (``attnpanel.util.cancel``, as the page's ``Background`` does) or, as the baseline in
    the same run, left to run to its end (as before)."""
    import numpy as np

    from attnpanel.util import cancel

    found = explorer.source.virtual_map(explorer.selection)
    n = explorer.trace.sizes["query"]
    rng = np.random.default_rng(1)

    def refine(window, wanted):
        with cancel.while_wanted(wanted):
            try:
                return found.refined(480, 480, window).raster(480, 480, window)
            except cancel.Superseded:
                return None

    def windows():
        x0, y0 = (int(v) for v in rng.integers(0, n - side, size=2))
        return ((x0 - 0.5, x0 + side - 0.5), (y0 - 0.5, y0 + side - 0.5))

    times: dict[str, list[float]] = {}
    with ThreadPoolExecutor(1, thread_name_prefix="refine") as worker:
        refine(windows(), lambda: True)  # warm-up: the row statistics, q and k
        for _ in range(repeats):
            for name, stop in (("stopped (cancel)", True), ("run to its end (baseline)", False)):
                first, second = windows(), windows()
                superseded = threading.Event()
                wanted = partial(_still_wanted, stop, superseded)
                worker.submit(refine, first, wanted)
                time.sleep(0.2)
                start = time.perf_counter()
                superseded.set()
                worker.submit(refine, second, lambda: True).result()
                times.setdefault(name, []).append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--days", type=int, default=45)
    parser.add_argument("--pages", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--cache", default=None, help="where the long demo is stored")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    from attnpanel.nilm.demo import cache_folder, stored_long_demo

    path = cache_folder(args.cache) / f"demo-long-{args.days}d.zarr"
    built = not path.exists()
    start = time.perf_counter()
    path = stored_long_demo(days=args.days, folder=args.cache)
    took = time.perf_counter() - start
    print(f"long demo ({args.days} days): {'built' if built else 'opened'} in {took:.1f} s")

    long_cmd = [sys.executable, "-m", "attnpanel", "serve", "--demo", "long"]
    long_cmd += ["--days", str(args.days)] + (["--cache", args.cache] if args.cache else [])
    short_cmd = [sys.executable, "-m", "attnpanel", "serve"]
    rows = {}
    with sync_playwright() as p:
        browser = launch_chromium(p)
        for name, cmd in (
            (f"long demo, L = {args.days * 1440:,} (virtual)", long_cmd),
            ("480 demo, 32 x 8 x 480 x 480 (baseline)", short_cmd),
        ):
            port = free_port()
            rows[name] = first_paints(browser, [*cmd, "--port", str(port)], port, args.pages)
        browser.close()
    print("\nrequest -> complete first paint (document idle), 1600 px, Chromium")
    print("| page | first page (s) | median (s) | p95 (s) |")
    print("| --- | --- | --- | --- |")
    for name, times in rows.items():
        rest = times[1:] or times
        print(f"| {name} | {times[0]:.2f} | {statistics.median(rest):.2f} | {p95(rest):.2f} |")

    explorer = long_explorer(path)
    print(f"\nserver side, {args.repeats} rounds at random places (ms)")
    print_ms("action", server_side(explorer, args.repeats))
    print(
        "\nzoom again 0.2 s into the refinement of an 8,192^2 window: the second window's "
        f"own pixels computed, {args.repeats} rounds (ms)"
    )
    print_ms("the first refinement", zoom_during_refinement(explorer, args.repeats))

    with sync_playwright() as p:
        browser = launch_chromium(p)
        port = free_port()
        changes = head_changes(browser, [*long_cmd, "--port", str(port)], port, args.repeats)
        browser.close()
    print("\nhead change -> repainted map on the served long page, Chromium (ms)")
    print("| page | median | p95 | no image from the server |")
    print("| --- | --- | --- | --- |")
    for name, (times, drawn) in changes.items():
        print(
            f"| {name} | {statistics.median(times):.0f} | {p95(times):.0f} | "
            f"{drawn} of {len(times)} |"
        )


def print_ms(what: str, rows: dict[str, list[float]]) -> None:
    """A table of medians and p95, in ms, of ``rows`` (name -> seconds)."""
    print(f"| {what} | median | p95 |")
    print("| --- | --- | --- |")
    for name, times in rows.items():
        ms = [1000 * t for t in times]
        print(f"| {name} | {statistics.median(ms):.0f} | {p95(ms):.0f} |")


if __name__ == "__main__":
    main()

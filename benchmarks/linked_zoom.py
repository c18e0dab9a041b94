"""Linked zoom across the attention matrix and the head maps: zoom event to repaint.

Run: ``python benchmarks/linked_zoom.py [--repeats 8]``.

Serves ``apps/main.py`` (the demo trace: 32 x 8 x 480 x 480) with ``panel serve`` and opens
it in headless Chromium. Each zoom sets the shared x/y ranges of the maps (what the wheel
and box zoom tools do), then, every animation frame, checks which maps' image data the
server has re-rasterized and whether their canvases have repainted. It prints the medians
over the zooms of:

* ``total``: zoom to every map repainted with its re-rasterized window: the matrix and
  the head maps (one figure of eight tiles); the acceptance number;
* ``first data`` / ``all data``: zoom to the first and the last map's new image arriving
  (debounce, round trip, server work), so ``total - all data`` is the browser's paint;
* ``server``: the explorer's linked zoom measured in this process (re-rasterize the window
  of every map with datashader and write them into the Bokeh models), and how much of
  it is datashader;
* ``first box selection``: on fresh pages (each its own session), from releasing the mouse
  after dragging a box on a head's tile to the mass-share bars repainted (median, p95);
* the naive baseline, measured in the same run: the matrix and eight head maps as HoloViews
  ``rasterize``d ``DynamicMap``s, each ``RangeXY`` stream given the new window (what a
  linked zoom triggers), and the ratio of its server time to the explorer's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from served_app import launch_chromium, open_app, serve  # noqa: E402

# (x0, x1, y0, y1): key and query windows, each different from the one before.
WINDOWS = [
    (100, 340, 60, 300),
    (150, 270, 200, 320),
    (0, 480, 0, 480),
    (300, 360, 20, 80),
    (40, 200, 250, 410),
    (-0.5, 479.5, -0.5, 479.5),
    (210, 290, 120, 200),
    (60, 420, 100, 460),
]

TIMED_ZOOM_JS = r"""
async ([x0, x1, y0, y1]) => {
  const imageOf = (pv) => [...pv.renderer_views.values()].find(
    (r) => r.model.glyph && r.model.glyph.type === "Image");
  // The matrix, and the head maps: one figure of a tile per head.
  const pvs = attn.plots().filter((pv) => imageOf(pv) && pv.el.offsetParent !== null &&
    (pv.model.name === "head maps" || /^sample \d+, /.test(pv.model.title.text)));
  const sources = pvs.map((pv) => [...pv.renderer_views.values()]
    .filter((r) => r.model.glyph && r.model.glyph.type === "Image")
    .map((r) => r.model.data_source));
  const arrived = pvs.map(() => null);
  const done = pvs.map(() => null);
  const doc = pvs[0].model.document;
  const listener = (ev) => {
    const i = sources.findIndex((found) => found.includes(ev.model));
    if (i >= 0 && arrived[i] === null) arrived[i] = performance.now();
  };
  doc.on_change(listener);
  const frame = () => new Promise((resolve) => requestAnimationFrame(resolve));
  const t0 = performance.now();
  // the matrix: its ranges are the window every map shows
  const m = pvs.find((pv) => pv.model.name !== "head maps").model;
  m.x_range.setv({start: x0, end: x1});
  m.y_range.setv({start: y1, end: y0});  // the query axis is inverted
  await frame();  // Bokeh paints in its own animation-frame callback, queued before ours
  const local = performance.now() - t0;
  await frame();
  const h0 = performance.now();
  const magnified = pvs.map((pv) => attn.hash(pv));
  const hashing = performance.now() - h0;
  const seen = pvs.map(() => 0);
  while (done.some((d) => d === null) && performance.now() - t0 < 20000) {
    await frame();
    const now = performance.now();
    pvs.forEach((pv, i) => {
      if (done[i] !== null || arrived[i] === null) return;
      seen[i] += 1;
      // Repainted: the canvas differs from the magnified frame (or, where the new image
      // happens to paint the same, the frame after its data arrived).
      if (attn.hash(pv) !== magnified[i] || seen[i] > 1) done[i] = now;
    });
  }
  doc.remove_on_change(listener);
  if (done.some((d) => d === null)) throw new Error("a map was not re-rasterized");
  return { maps: pvs.length, total: Math.max(...done) - t0, local, hashing,
           first_data: Math.min(...arrived) - t0, all_data: Math.max(...arrived) - t0 };
}
"""


# Times a box selection from the mouse button's release to the mass-share bars under the
# head tiles repainted: their data arrives, then the figure paints its next frame.
ARM_BOX_JS = r"""
() => {
  const frame = () => new Promise((resolve) => requestAnimationFrame(resolve));
  const shares = Bokeh.documents[0].get_model_by_name('head maps shares');
  window.__box_ms = null;
  let arrived = false;
  shares.connect(shares.properties.data.change, () => { arrived = true; });
  document.addEventListener('pointerup', () => {
    const t0 = performance.now();
    (async () => {
      while (performance.now() - t0 < 30000) {
        await frame();
        if (arrived) {
          await frame();  // the frame that paints the new bars
          window.__box_ms = performance.now() - t0;
          return;
        }
      }
      window.__box_ms = -1;
    })();
  }, { capture: true, once: true });
}
"""


def drag_box(page, head: int, start=(0.25, 0.3), end=(0.6, 0.7)) -> None:
    """Drag a box on a head's tile with the mouse, as a person does."""
    a = page.evaluate("([h, x, y]) => attn.tile_point(h, x, y)", [head, *start])
    b = page.evaluate("([h, x, y]) => attn.tile_point(h, x, y)", [head, *end])
    page.mouse.move(a["x"], a["y"])
    page.mouse.down()
    page.mouse.move((a["x"] + b["x"]) / 2, (a["y"] + b["y"]) / 2, steps=4)
    page.mouse.move(b["x"], b["y"], steps=4)
    page.mouse.up()


def browser_box_selections(pages: int) -> list[float]:
    """Milliseconds from releasing the mouse to the repainted mass bars, for the first box
    selection of ``pages`` fresh pages (each its own session)."""
    from playwright.sync_api import sync_playwright

    out = []
    with serve() as (url, _proc), sync_playwright() as p:
        browser = launch_chromium(p)
        for i in range(pages):
            page = open_app(browser, url, [])
            page.evaluate(ARM_BOX_JS)
            drag_box(page, 1 + i % 7)
            page.wait_for_function("() => window.__box_ms !== null", timeout=60_000)
            out.append(page.evaluate("window.__box_ms"))
            page.close()
        browser.close()
    if any(ms < 0 for ms in out):
        raise RuntimeError("a box selection never repainted the mass bars")
    return out


def browser_zooms(repeats: int):
    from playwright.sync_api import sync_playwright

    out = []
    with serve() as (url, _proc), sync_playwright() as p:
        browser = launch_chromium(p)
        console: list = []
        page = open_app(browser, url, console)
        page.evaluate(TIMED_ZOOM_JS, [0, 240, 0, 240])  # warm-up, not counted
        page.wait_for_timeout(300)
        for i in range(repeats):
            out.append(page.evaluate(TIMED_ZOOM_JS, list(WINDOWS[i % len(WINDOWS)])))
            page.wait_for_timeout(300)
        errors = [m for m in console if m[0] in ("error", "pageerror")]
        browser.close()
    return out, errors


def server_times(repeats: int):
    """The explorer's linked zoom in process, and the naive rasterize/RangeXY baseline."""
    import holoviews as hv
    import panel as pn
    from bokeh.document import Document
    from holoviews.operation.datashader import rasterize

    import attnpanel
    from attnpanel.app.explorer import AttentionExplorer
    from attnpanel.readouts import raster
    from attnpanel.render import views

    trace = attnpanel.demo()
    explorer = AttentionExplorer(trace)
    doc = Document()
    doc.add_root(explorer.__panel__().get_root(doc))
    explorer.linked.zoom((0, 240), (240, 0))  # warm-up
    raster_time = [0.0]
    original = raster.raster_values  # what window_raster calls for a downsampled window

    def timed_raster(*args, **kw):
        start = time.perf_counter()
        try:
            return original(*args, **kw)
        finally:
            raster_time[0] += time.perf_counter() - start

    raster.raster_values = timed_raster
    mine, datashader_ms = [], []
    try:
        for i in range(repeats):
            x0, x1, y0, y1 = WINDOWS[i % len(WINDOWS)]
            raster_time[0] = 0.0
            start = time.perf_counter()
            explorer.linked.zoom((x0, x1), (y1, y0))
            mine.append(1000 * (time.perf_counter() - start))
            datashader_ms.append(1000 * raster_time[0])
    finally:
        raster.raster_values = original

    sel = explorer.selection
    images = [views.attention_matrix(trace, sel)] + [
        views.attention_matrix(trace, sel.with_(head=h)) for h in range(trace.sizes["head"])
    ]
    maps = [
        rasterize(image).opts(width=520 if i == 0 else 150, height=520 if i == 0 else 150)
        for i, image in enumerate(images)
    ]
    layout = pn.Row(*[pn.pane.HoloViews(m, linked_axes=True) for m in maps])
    layout.get_root(Document())
    streams = [s for m in maps for s in m.streams if isinstance(s, hv.streams.RangeXY)]
    naive = []
    for i in range(max(3, repeats // 2)):
        x0, x1, y0, y1 = WINDOWS[i % len(WINDOWS)]
        start = time.perf_counter()
        for stream in streams:
            stream.event(x_range=(x0, x1), y_range=(y0, y1))
        naive.append(1000 * (time.perf_counter() - start))
    return mine, datashader_ms, naive, len(streams)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=8, help="zooms to time")
    parser.add_argument("--boxes", type=int, default=5, help="fresh pages whose first box to time")
    args = parser.parse_args(argv)

    print("measuring the server side in process ...", flush=True)
    mine, datashader_ms, naive, n_streams = server_times(args.repeats)
    print("measuring the served app in Chromium ...", flush=True)
    zooms, errors = browser_zooms(args.repeats)
    print("timing first box selections in Chromium ...", flush=True)
    boxes = browser_box_selections(args.boxes)

    med = statistics.median
    print()
    print(
        f"linked zoom, {zooms[0]['maps']} maps (matrix 520 px + head tiles 140 px), demo "
        f"480 x 480, {len(zooms)} zooms (medians, ms)"
    )
    print(
        f"  zoom -> all maps repainted (Chromium):   {med(z['total'] for z in zooms):7.0f}"
        f"   (min {min(z['total'] for z in zooms):.0f}, max "
        f"{max(z['total'] for z in zooms):.0f})"
    )
    print(f"  zoom -> local (magnified) repaint:       {med(z['local'] for z in zooms):7.0f}")
    print(f"  (measurement: hashing the maps' canvases: {med(z['hashing'] for z in zooms):7.0f})")
    print(f"  zoom -> first map's new image arrives:   {med(z['first_data'] for z in zooms):7.0f}")
    print(f"  zoom -> last map's new image arrives:    {med(z['all_data'] for z in zooms):7.0f}")
    print(
        f"  server: linked zoom of every map:        {med(mine):7.1f}"
        f"   (datashader {med(datashader_ms):.1f})"
    )
    print(
        f"  naive baseline: {n_streams} rasterize RangeXY DynamicMaps: {med(naive):7.0f}"
        f"   ratio {med(naive) / med(mine):.1f}x"
    )
    print(
        f"  first box selection of a page -> mass bars repainted ({len(boxes)} pages): "
        f"median {med(boxes):.0f}, p95 {sorted(boxes)[max(0, round(0.95 * len(boxes)) - 1)]:.0f}"
        f"   (min {min(boxes):.0f}, max {max(boxes):.0f})"
    )
    if errors:
        print(f"browser console errors: {errors}")


if __name__ == "__main__":
    main()

"""Latency of the served explorer, from a widget change in Chromium to the repainted canvas.

Run: ``python benchmarks/explorer_latency.py [--repeats 20]``.

Serves ``apps/main.py`` (the demo trace: 32 x 8 x 480 x 480) with ``panel serve``, opens it
in headless Chromium, and for each change type (head, query, mask, stage) sets the widget's
value in the page (what a user's change does to the Bokeh model), then polls a hash of the
attention matrix canvas every animation frame until its pixels differ. It prints, per change
type, the median and 95th percentile of:

* ``median``/``p95``: widget change to repainted matrix canvas (the acceptance number),
  on the page as served: a head, stage or mask change whose map the server has sent
  ahead is drawn by the browser (``by browser`` counts them; see
  :mod:`attnpanel.app.prefetch`);
* ``to patch``: widget change to the first document patch arriving from the server
  (round trip plus server callback);
* ``round trip``: the same changes on the same page opened with ``?ahead=false``, every
  change drawn by the server as before (the baseline of the same run), and ``ratio``, its
  median over the served page's;
* ``server``: the explorer's callback for the same change measured in this process, for
  the views drawn first and for all views; ``naive base``: nine ``rasterize``d HoloViews
  ``DynamicMap``s (the matrix and the eight head maps) refreshed through a ``Params``
  stream.

For the query it also times the query's weights bars, from the same change (drawn by the
browser from the shown head's weights sent ahead, or by the server). Finally
it reports the server process's resident memory with one session: as the page has loaded,
and once settled (``TRIM_DELAY_S`` after the load the server gives back what building the
page freed, :func:`attnpanel.app.serving.release_memory`).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import param

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from served_app import (  # noqa: E402
    HELD_JS,
    launch_chromium,
    open_app,
    peak_rss_mb,
    rss_mb,
    serve,
    wait_idle,
)

from attnpanel.app.scheduler import CONTEXT_PARAMS  # noqa: E402
from attnpanel.app.serving import TRIM_DELAY_S  # noqa: E402
from attnpanel.readouts import core  # noqa: E402

MATRIX = "() => attn.plots().find((v) => /^sample \\d+, /.test(v.model.title.text))"
NEXT = "next"  # the sample after the shown one
CHANGES = {
    # a jump to a sample nobody has looked at, nor at one beside it: nothing is ready
    # for it (no two of these samples are within 2 of each other; each is jumped to once)
    "jump": ("Sample", [16, 4, 28, 10, 22, 1, 31, 13, 25, 7, 19], "sample"),
    # the arrow keys' next sample, the page idle a while before (a person reads it)
    "sample": ("Sample", [NEXT], "sample"),
    "head": ("Head", [f"head {h}" for h in (1, 2, 3, 4, 5, 6, 7, 0)], "head"),
    "query": ("Query", [37, 121, 250, 333, 402, 460, 15, 199], "query"),
    "mask": ("Mask", ["none", "causal", "diagonal"], "mask"),
    "stage": ("Stage", ["raw scores", "scaled", "masked", "softmax"], "stage"),
}
CACHED = f"({HELD_JS})('__cached')"  # the maps the page holds
# 1 when the server sent no new image for the change (the browser drew it from its copy,
# or showed the server's own image it still held): the image TIMED_JS saw is still there
DRAWN_BY_BROWSER = (
    f"(() => {{ const pv = ({MATRIX})();"
    " const main = pv.model.renderers.find((r) => r.glyph && r.glyph.type === 'Image'"
    " && r.name !== 'cached levels');"
    " return main.data_source.data.image[0] === window.attn_image ? 1 : 0; })()"
)
# A widget change timed to the repainted matrix (``total``), to the first document change
# from elsewhere (``to_patch``), to the repainted weights bars (``bars``) and to every view
# repainted (``every``): the frame after the one that painted the change's last document
# patch from the server (the maps sent ahead, ``ColumnsStreamed``, and the URL are not the
# change's), once no patch of it has come for ``QUIET_MS``. (Timed from the patches, not
# by hashing every canvas each frame: that alone held the page's thread ~0.3 s a change.)
QUIET_MS = 600
TIMED_JS = f"""
async ([title, value]) => {{
  const matrix = ({MATRIX})(), bars = attn.plot('weights of query');
  const main = matrix.model.renderers.find((r) => r.glyph && r.glyph.type === "Image"
                                                  && r.name !== "cached levels");
  window.attn_image = main.data_source.data.image[0];  // a new image: the server drew it
  const before = [attn.hash(matrix), attn.hash(bars)];
  const model = attn.widget(title), doc = model.document;
  let to_patch = null, total = null, bar = null, t0 = null, last = null, every = null;
  const listener = (event) => {{
    if (to_patch === null && event.model !== undefined && event.model !== model
        && event.sync !== false) {{
      to_patch = performance.now() - t0;
    }}
  }};
  const apply = doc.apply_json_patch;
  doc.apply_json_patch = function (patch, buffers) {{
    const out = apply.call(this, patch, buffers);
    const own = (patch.events || []).filter((e) => {{
      if (e.kind === "ColumnsStreamed" || !e.model) return false;
      const m = doc.get_model_by_id(e.model.id);
      return m !== undefined && m !== model && !String(m.type).includes("Location");
    }});
    if (own.length) {{
      const at = last = performance.now();
      requestAnimationFrame(() => requestAnimationFrame(() => {{
        if (last === at) every = performance.now() - t0;
      }}));
    }}
    return out;
  }};
  doc.on_change(listener);
  t0 = performance.now();
  model.value = value;
  await new Promise((resolve) => {{
    const poll = () => {{
      const now = performance.now() - t0;
      if (total === null && attn.hash(matrix) !== before[0]) total = now;
      if (bar === null && attn.hash(bars) !== before[1]) bar = now;
      const done = total !== null && (bar !== null || title !== "Query");
      if (done || now > 15000) resolve(); else requestAnimationFrame(poll);
    }};
    requestAnimationFrame(poll);
  }});
  await new Promise((resolve) => {{
    const wait = () => {{
      const now = performance.now();
      const quiet = now - (last === null ? t0 : last) > {QUIET_MS};
      if ((quiet && every !== null) || now - t0 > 15000) resolve(); else setTimeout(wait, 50);
    }};
    wait();
  }});
  doc.apply_json_patch = apply;
  doc.remove_on_change(listener);
  return {{ total, to_patch, bars: bar, every }};
}}
"""
# how long the page is left between two sample changes (a person reads the new sample;
# the server makes the samples beside it ready meanwhile, attnpanel.app.neighbours)
SAMPLE_DWELL_MS = 2500
DEMO_SAMPLES = 32
PARAM_VALUES = {
    "sample": [1, 2, 3, 4, 5, 6, 7, 0],
    "head": [1, 2, 3, 4, 5, 6, 7, 0],
    "query": [37, 121, 250, 333, 402, 460, 15, 199],
    "mask": ["none", "causal", "diagonal"],
    "stage": ["raw", "scaled", "masked", "softmax"],
}


def percentile(values, q):
    return float(np.percentile(np.asarray(values, dtype=float), q))


def browser_latencies(repeats: int, gap_ms: int = 150, changes=tuple(CHANGES)):
    """Per change type: lists of total and to-patch milliseconds and how many changes the
    browser drew itself, for the page as served and for the same page without maps sent
    ahead (``?ahead=false``: every change a round trip), plus memory figures."""
    from playwright.sync_api import sync_playwright

    with serve() as (url, proc), sync_playwright() as p:
        browser = launch_chromium(p)
        console: list = []
        page = open_app(browser, url, console)
        rss_loaded, loaded_at = rss_mb(proc.pid), time.monotonic()
        # the server's one-time work (the demo's survey, warmed after the first page)
        # is done before the changes are timed: it would compete with them for the CPU
        waited = wait_idle(proc.pid)
        # what it holds once settled: the page's memory goes back TRIM_DELAY_S after it loads
        time.sleep(max(0.0, TRIM_DELAY_S + 1 - (time.monotonic() - loaded_at)))
        rss_settled, settled_s = rss_mb(proc.pid), time.monotonic() - loaded_at
        page.wait_for_function(f"() => {CACHED} >= 20", timeout=60_000)  # the first maps
        results = _changes(page, repeats, gap_ms, changes)
        page.close()
        page = open_app(browser, url + "?ahead=false", console)
        round_trips = _changes(page, repeats, gap_ms, changes)
        page.wait_for_timeout(1000)
        memory = dict(loaded=rss_loaded, now=rss_mb(proc.pid), peak=peak_rss_mb(proc.pid))
        memory.update(waited=waited, settled=rss_settled, settled_s=settled_s)
        errors = [m for m in console if m[0] in ("error", "pageerror")]
        browser.close()
    return results, round_trips, memory, errors


def _changes(page, repeats: int, gap_ms: int, changes) -> dict:
    results = {}
    for name in changes:
        title, values, _ = CHANGES[name]
        totals, patches, aggregation, every, in_browser = [], [], [], [], 0
        count = min(repeats, len(values)) if name == "jump" else repeats
        for value in itertools.islice(itertools.cycle(values), count):
            if value == NEXT:
                value = (page.evaluate("attn.widget('Sample').value") + 1) % DEMO_SAMPLES
            timing = page.evaluate(TIMED_JS, [title, value])
            totals.append(timing["total"])
            if timing["every"] is not None:
                every.append(timing["every"])
            if timing["to_patch"] is not None:
                patches.append(timing["to_patch"])
            if name == "query" and timing["bars"] is not None:
                # the query's weights bars, timed from the same change (the browser may
                # draw them before the matrix's box)
                aggregation.append(timing["bars"])
            # the deferred views land before the next change
            page.wait_for_timeout(SAMPLE_DWELL_MS if title == "Sample" else gap_ms)
            in_browser += page.evaluate(DRAWN_BY_BROWSER)  # no image came meanwhile
        results[name] = dict(
            total=totals, patch=patches, aggregation=aggregation, every=every, in_browser=in_browser
        )
    return results


def _time_updates(target, name, repeats):
    values = PARAM_VALUES[name]
    target.param.update(**{name: values[-1]})
    times = []
    for value in itertools.islice(itertools.cycle(values), repeats):
        start = time.perf_counter()
        target.param.update(**{name: value})
        times.append(1000 * (time.perf_counter() - start))
    return times


def _time_first_views(explorer, name, repeats):
    """Time of the views drawn in the change's own message (the engine's ``first``)."""
    values = PARAM_VALUES[name]
    times = []
    # a change of sample draws every view in its own message; the others the first
    whole = name in CONTEXT_PARAMS

    def drawn_first(view) -> bool:
        return (view.first or whole) and name in view.parameters

    for value in itertools.islice(itertools.cycle(values), repeats):
        with param.parameterized.discard_events(explorer):
            explorer.param.update(**{name: value})
        start = time.perf_counter()
        explorer.engine.redraw(drawn_first)
        times.append(1000 * (time.perf_counter() - start))
    return times


def server_times(repeats: int):
    """In-process server callback times: the explorer (first views, all views) and a naive
    DynamicMap + rasterize baseline of the nine attention images."""
    import holoviews as hv
    import panel as pn
    import param
    from bokeh.document import Document
    from holoviews.operation.datashader import rasterize

    import attnpanel
    from attnpanel.app.explorer import AttentionExplorer
    from attnpanel.render import views

    trace = attnpanel.demo()
    explorer = AttentionExplorer(trace)
    explorer.__panel__().get_root(Document())
    out = {}
    for name in PARAM_VALUES:
        first = _time_first_views(explorer, name, repeats)
        every = _time_updates(explorer, name, repeats)
        out[name] = dict(first=first, all=every)

    class Selection(param.Parameterized):
        sample = param.Integer(0)
        head = param.Parameter(0)
        query = param.Integer(0)
        mask = param.String("diagonal")
        stage = param.String("softmax")

    state = Selection()

    def image(head, **kw):
        sel = core.Selection(
            sample=state.sample,
            head=state.head if head is None else head,
            mask=state.mask,
            stage=state.stage if head is None else "softmax",
        )
        return views.attention_matrix(trace, sel)  # no cache: the naive way recomputes

    maps = [
        hv.DynamicMap(
            lambda head=h, **kw: image(head, **kw),
            streams=[hv.streams.Params(state, ["sample", "head", "mask", "stage"])],
        )
        for h in [None] + list(range(trace.sizes["head"]))
    ]
    layout = pn.Row(*[pn.pane.HoloViews(rasterize(m).opts(width=300, height=300)) for m in maps])
    layout.get_root(Document())
    for name in ("head", "mask", "stage"):
        out[name]["baseline"] = _time_updates(state, name, max(3, repeats // 3))
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="changes per type")
    parser.add_argument(
        "--gap",
        type=int,
        default=150,
        help="ms from one change's repaint to the next change (default 150: a mask change's "
        "head tiles, redrawn by the server 120 ms after it, can then meet the next change)",
    )
    parser.add_argument(
        "--changes",
        nargs="+",
        choices=list(CHANGES),
        default=list(CHANGES),
        help="the change types timed (default: every one)",
    )
    args = parser.parse_args(argv)

    print("measuring server callbacks in process ...", flush=True)
    server = server_times(args.repeats)
    print("measuring the served app in Chromium ...", flush=True)
    browser, round_trips, memory, errors = browser_latencies(args.repeats, args.gap, args.changes)

    def ms(values, q=50):
        return percentile(values, q) if values else float("nan")

    header = (
        f"{'change':<8}{'n':>4}{'median ms':>11}{'p95 ms':>8}{'by browser':>12}{'to patch':>10}"
        f"{'round trip':>12}{'p95':>6}{'ratio':>7}"
        f"{'server first':>14}{'server all':>12}{'naive base':>12}"
    )
    print()
    print("event -> repainted matrix canvas (Chromium, demo 32 x 8 x 480 x 480)")
    print("  as served (maps sent ahead); round trip: the same page with ?ahead=false,")
    print("  same server and run; server columns: the callbacks in this process (naive:")
    print("  nine rasterized DynamicMaps); by browser: changes the server sent no image for")
    print(header)
    for name, timing in browser.items():
        srv, trip = server[CHANGES[name][2]], round_trips[name]["total"]
        base = statistics.median(srv["baseline"]) if "baseline" in srv else float("nan")
        total = timing["total"]
        # the query moves a marker: no map to draw
        by_browser = "-" if name == "query" else f"{timing['in_browser']}/{len(total)}"
        print(
            f"{name:<8}{len(total):>4}{ms(total):>11.0f}{ms(total, 95):>8.0f}"
            f"{by_browser:>12}{ms(timing['patch']):>10.0f}"
            f"{ms(trip):>12.0f}{ms(trip, 95):>6.0f}{ms(trip) / ms(total):>7.1f}"
            f"{statistics.median(srv['first']):>14.1f}{statistics.median(srv['all']):>12.1f}"
            f"{base:>12.0f}"
        )
    print()
    print("event -> every view repainted (the frame after the change's last patch painted)")
    print(f"{'change':<8}{'n':>4}{'median ms':>11}{'p95 ms':>8}{'/ head':>8}{'round trip':>12}")
    head = ms(browser["head"]["every"]) if "head" in browser else float("nan")
    for name, timing in browser.items():
        every, trip = timing["every"], round_trips[name]["every"]
        print(
            f"{name:<8}{len(every):>4}{ms(every):>11.0f}{ms(every, 95):>8.0f}"
            f"{ms(every) / head:>8.2f}{ms(trip):>12.0f}"
        )
    print(
        f"  target: a sample change <= 2x a head change (sample: the next sample, the page "
        f"left {SAMPLE_DWELL_MS} ms between changes; jump: to a sample nothing is ready for)"
    )
    if "query" in browser:
        agg, trip = browser["query"]["aggregation"], round_trips["query"]["aggregation"]
        print(
            f"query -> weights bars repainted: median {ms(agg):.0f} ms, p95 {ms(agg, 95):.0f} "
            f"ms (round trip: median {ms(trip):.0f} ms, p95 {ms(trip, 95):.0f} ms)"
        )
    print(
        f"server RSS: {memory['loaded']:.0f} MiB after load, {memory['settled']:.0f} MiB "
        f"{memory['settled_s']:.0f} s after it (its one-time work done, and the memory "
        f"freed by building it given back {TRIM_DELAY_S:.0f} s after the load), "
        f"{memory['now']:.0f} MiB after the run, peak {memory['peak']:.0f} MiB (one session); "
        "the server's one-time work "
        f"after the first page took {memory['waited']:.0f} s before the changes"
    )
    if errors:
        print(f"browser console errors: {errors}")


if __name__ == "__main__":
    main()

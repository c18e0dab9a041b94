"""Serve an app file with ``panel serve`` in a subprocess and read its canvases from Chromium.

Shared by the browser tests and ``benchmarks/explorer_latency.py``. The JavaScript helpers
walk ``Bokeh.index`` (the root views of the page) to find plots by their title, so tests
need no CSS selectors into Bokeh's shadow DOM.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
APP = ROOT / "apps" / "main.py"
CHROMIUM = os.environ.get("ATTNPANEL_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

# The text of every rendered view (shadow DOMs included), as a person reads it.
PAGE_TEXT_JS = (
    "() => { const out = [];"
    " const walk = (node) => { if (!node) return;"
    "  if (node.nodeType === 3) out.push(node.textContent);"
    "  if (node.shadowRoot) walk(node.shadowRoot);"
    "  for (const c of node.childNodes || []) walk(c); };"
    " walk(document.body); return out.join(' '); }"
)


def launch_chromium(playwright):
    """Debian's Chromium, headless, with the flags every test and benchmark uses."""
    return playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)


# Bokeh's JS helpers installed into the page as window.attn.
HELPERS_JS = r"""
(() => {
  const views = () => {
    const out = [];
    const walk = (v) => { out.push(v); for (const c of (v.child_views || [])) walk(c); };
    for (const r of Object.values(Bokeh.index)) walk(r);
    return out;
  };
  const plots = () => views().filter((v) => v.model && v.model.type === "Figure");
  // A plot by its name (the head maps) or the start of its title.
  const plot = (prefix) => {
    // a title's words, whichever lines the server broke it into (render/titles.py)
    const words = (v) => v.model.title.text.replace(/\s+/g, " ");
    const found = plots().filter((v) => v.model.name === prefix ||
                                        (v.model.title && words(v).startsWith(prefix)));
    if (found.length === 0) throw new Error(`no plot titled ${prefix}...`);
    return found[0];
  };
  const widget = (title) => {
    const found = views().filter((v) => v.model && v.model.title === title &&
                                        "value" in v.model.properties);
    if (found.length === 0) throw new Error(`no widget titled ${title}`);
    return found[0].model;
  };
  const pixels = (pv) => {
    const layer = pv.canvas_view.compose();
    const { width, height } = layer.canvas;
    return { data: layer.ctx.getImageData(0, 0, width, height).data, width, height,
             ratio: width / pv.canvas_view.bbox.width };
  };
  const hash = (pv) => {
    const { data } = pixels(pv);
    let h = 2166136261 >>> 0;
    const words = new Uint32Array(data.buffer, data.byteOffset, data.byteLength >> 2);
    for (let i = 0; i < words.length; i++) { h = Math.imul(h ^ words[i], 16777619) >>> 0; }
    return h;
  };
  // The page position of a point given as a fraction of the plot's frame.
  const frame_point = (pv, fx, fy) => {
    const rect = pv.el.getBoundingClientRect();
    const f = pv.frame.bbox;
    return { x: rect.left + f.x + fx * f.width, y: rect.top + f.y + fy * f.height };
  };
  // The page position of a point given as a fraction of one head's tile in the head maps.
  const tile_point = (head, fx, fy) => {
    const pv = plot("head maps");
    const glyph = pv.model.renderers.find((r) => r.name === `head ${head}`).glyph;
    const at = (spec) => (typeof spec === "number" ? spec : spec.value);
    const rect = pv.el.getBoundingClientRect();
    return { x: rect.left + pv.frame.x_scale.compute(at(glyph.x) + fx),
             y: rect.top + pv.frame.y_scale.compute(at(glyph.y) + fy) };
  };
  // RGBA of the pixel at data coordinates (x, y) of a plot.
  const rgba_at = (pv, x, y) => {
    const { data, width, ratio } = pixels(pv);
    const px = Math.floor(pv.frame.x_scale.compute(x) * ratio);
    const py = Math.floor(pv.frame.y_scale.compute(y) * ratio);
    const i = 4 * (py * width + px);
    return [data[i], data[i + 1], data[i + 2], data[i + 3]];
  };
  // Resolve with the milliseconds from now until the plot's pixels differ from `before`.
  const until_changed = (pv, before, timeout = 15000) => new Promise((resolve, reject) => {
    const t0 = performance.now();
    const poll = () => {
      if (hash(pv) !== before) { resolve(performance.now() - t0); return; }
      if (performance.now() - t0 > timeout) { reject(new Error("plot did not change")); return; }
      requestAnimationFrame(poll);
    };
    requestAnimationFrame(poll);
  });
  // Time from setting a widget's value (what a user's change does) to the repainted plot.
  const timed_change = async (title, value, prefix) => {
    const pv = typeof prefix === "string" ? plot(prefix) : prefix();
    const before = hash(pv);
    const model = widget(title);
    const t0 = performance.now();
    let first_patch = null;
    const doc = model.document;
    // The first change the server sends back (the widget's own change is local).
    const listener = (event) => {
      if (first_patch === null && event.model !== undefined && event.model !== model) {
        first_patch = performance.now();
      }
    };
    doc.on_change(listener);
    model.value = value;
    await until_changed(pv, before);
    const t1 = performance.now();
    doc.remove_on_change(listener);
    return { total: t1 - t0, to_patch: first_patch === null ? null : first_patch - t0 };
  };
  // A view's table (attnpanel/render/tables.py: Panel's HTML model, its text the table's
  // HTML escaped once more) by words in it: the <table> the page shows.
  const table = (words) => {
    const found = views().find((v) => v.model && v.model.type === "panel.models.markup.HTML"
                                      && v.model.text.startsWith("&lt;table")
                                      && v.model.text.includes(words));
    if (found === undefined) throw new Error(`no table with ${words}`);
    return found.el.shadowRoot.querySelector("table");
  };
  window.attn = { views, plots, plot, widget, table, hash, pixels, frame_point, tile_point,
                  rgba_at, until_changed, timed_change };
})();
"""


# The explorer has rendered: the top view is laid out and every view has painted.
# (and every section below the fold is in its place: the line saying they are coming is
# hidden, app/later.py; read from the views: the document's models keep a replaced one)
LATER_JS = (
    "() => { let left = false; const walk = (v) => { if (!v || left) return;"
    " if (v.model && v.model.visible && (v.model.css_classes || []).includes('attnpanel-later'))"
    " left = true;"
    " for (const c of (v.child_views || [])) walk(c); };"
    " for (const r of Object.values(Bokeh.index)) walk(r); return !left; }"
)
# what "rendered" is made of, by name (a page that never renders says which never came)
RENDERED_PARTS = {
    "top view laid out": "attn.plot('sample').canvas_view.bbox.width > 0",
    "document idle": "Bokeh.documents[0].is_idle",
    "every section in place": f"({LATER_JS})()",
}
RENDERED_JS = (
    "() => { try { return "
    + " && ".join(f"({js})" for js in RENDERED_PARTS.values())
    + "; } catch (e) { return false; } }"
)


def free_port() -> int:
    """A free localhost TCP port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ``python -m panel``, whose threads' stacks are written to its log on SIGUSR1 (see
# :func:`thread_stacks`: what a hung server was doing, in a failed test's report)
SERVE_BOOT = (
    "import faulthandler, signal, sys; faulthandler.register(signal.SIGUSR1, all_threads=True); "
    "from panel.command import main; main(['panel', *sys.argv[1:]])"
)


def thread_stacks(proc, log: Path, timeout: float = 5.0) -> str:
    """Every thread's stack of a server started by :func:`serve`, from its log."""
    if proc.poll() is not None:
        return f"(the server exited with {proc.returncode})"
    before = log.read_text(errors="replace") if log.exists() else ""
    proc.send_signal(signal.SIGUSR1)
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        found = log.read_text(errors="replace")[len(before) :]
        if "thread 0x" in found.lower() and found == last:  # written, and no more coming
            return found
        last = found
        time.sleep(0.3)  # a failed test's report only: the server writes as it runs
    return log.read_text(errors="replace")[len(before) :] or "(no stacks written)"


@contextlib.contextmanager
def serve(app: Path = APP, timeout: float = 240.0, extra_args=()):
    """Run ``panel serve app [extra_args]`` on a free port; yield ``(url, process)``; stop it
    after."""
    port = free_port()
    cmd = [
        sys.executable,
        "-c",
        SERVE_BOOT,
        "serve",
        str(app),
        "--port",
        str(port),
        "--address",
        "127.0.0.1",
        "--allow-websocket-origin",
        f"127.0.0.1:{port}",
        "--num-procs",
        "1",
        *extra_args,
    ]
    with serving(cmd, port, f"http://127.0.0.1:{port}/{app.stem}", timeout) as served:
        yield served


@contextlib.contextmanager
def serving(cmd: list[str], port: int, url: str, timeout: float = 240.0):
    """Run a server command listening on ``port``; yield ``(url, process)``; stop it after.

    Its output goes to ``artifacts/serve-{port}.log``.
    """
    (ROOT / "artifacts").mkdir(exist_ok=True)
    log = open(ROOT / "artifacts" / f"serve-{port}.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env=dict(os.environ, BOKEH_PY_LOG_LEVEL="info"),
    )
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[:4]} exited with {proc.returncode}; see {log.name}")
            # Only the port: any HTTP request for the app would start a session.
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{cmd[:4]} did not start in {timeout} s") from None
                time.sleep(0.5)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def open_app(
    browser, url: str, console: list, timeout_ms: int = 180_000, before=None, loading=None
):
    """Open the served explorer in a new page; wait until its matrix is drawn.

    ``before(page)``, if given, runs before the page loads (to listen to its websocket);
    ``loading(page)``, once it has loaded (a loading page's words, before the explorer)."""
    page = browser.new_page(viewport={"width": 1600, "height": 1300})
    if before is not None:
        before(page)
    page.on("console", lambda msg: console.append((msg.type, msg.text)))
    page.on("pageerror", lambda err: console.append(("pageerror", str(err))))
    page.on("dialog", lambda dialog: (console.append(("dialog", dialog.message)), dialog.dismiss()))
    page.goto(url, timeout=timeout_ms)
    if loading is not None:
        loading(page)
    page.wait_for_function(
        "() => window.Bokeh && Bokeh.index && Object.keys(Bokeh.index).length > 0",
        timeout=timeout_ms,
    )
    page.evaluate(HELPERS_JS)
    try:
        page.wait_for_function(RENDERED_JS, timeout=timeout_ms)
    except Exception as err:  # say which part of "rendered" never came, and what the page said
        raise AssertionError(f"{url} never rendered: {not_rendered(page)}; {console}") from err
    page.wait_for_timeout(1000)  # let the first WebGL frames land
    return page


def not_rendered(page) -> dict:
    """Which parts of :data:`RENDERED_JS` hold on ``page`` (for a failure's message)."""
    found = {}
    for name, js in RENDERED_PARTS.items():
        try:
            answer = f"() => {{ try {{ return {js}; }} catch (e) {{ return String(e); }} }}"
            found[name] = page.evaluate(answer)
        except Exception as err:  # noqa: BLE001 - a page that cannot answer says so
            found[name] = f"no answer: {err}"
    return found


@contextlib.contextmanager
def opened(browser, url: str):
    """A page on the served explorer (see :func:`open_app`); yield ``(page, console)``."""
    console: list = []
    page = open_app(browser, url, console)
    try:
        yield page, console
    finally:
        page.close()


def shot(page, artifacts: Path, name: str) -> Path:
    """A full-page screenshot ``artifacts/browser_{name}.png`` (asserted not blank)."""
    path = artifacts / f"browser_{name}.png"
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000
    return path


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds a process has used (Linux /proc; 100 ticks a second)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100


def wait_idle(pid: int, timeout: float = 180.0, busy: float = 0.05) -> float:
    """Wait until a process uses under ``busy`` of a core over a second (a server's
    one-time work done: the demo's survey warmed after the first page); returns the
    seconds waited."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        before = cpu_seconds(pid)
        time.sleep(1.0)
        if cpu_seconds(pid) - before < busy:
            break
    return time.monotonic() - start


def rss_mb(pid: int) -> float:
    """Resident set size of a process in MiB (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def peak_rss_mb(pid: int) -> float:
    """Peak resident set size (high-water mark) of a process in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


# A checkbox's centre and state, by its label, scrolled into the window where it is out of
# it, two frames after the call (the layout of a viewport just resized has settled by
# then, or the two looks differ).
CHECKBOX_JS = """async (label) => {
  const v = attn.views().find((v) => v.model && v.model.label === label &&
                                     v.model.type === 'Checkbox');
  const r0 = v.checkbox_el.getBoundingClientRect();
  if (r0.top < 0 || r0.bottom > window.innerHeight) v.checkbox_el.scrollIntoView({block: 'center'});
  await new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(done)));
  const r = v.checkbox_el.getBoundingClientRect();
  return [r.x + r.width / 2, r.y + r.height / 2, v.model.active];
}"""


def click_checkbox(page, label: str) -> None:
    """Click a checkbox by its label, with the mouse, as a person does (scrolled to it),
    once the page's layout holds still; wait until it has toggled. (In two workers the click
    landed where the box had been before a resize of the viewport, and a click on a box
    scrolled out of the window went nowhere: nothing toggled, and nothing said so.)"""
    before = None
    for _ in range(50):
        found = page.evaluate(CHECKBOX_JS, label)
        if before is not None and found == before:
            break
        before = found
    x, y, active = before
    page.mouse.click(x, y)
    page.wait_for_function(
        "([label, was]) => attn.views().some((v) => v.model && v.model.label === label &&"
        " v.model.type === 'Checkbox' && v.model.active !== was)",
        arg=[label, active],
        timeout=10_000,
    )


def page_widths(page, widths=(1280, 1600)) -> dict:
    """The page's scroll width at each viewport width (equal to it: no horizontal scroll)."""
    found = {}
    for width in widths:
        page.set_viewport_size({"width": width, "height": 1300})
        page.wait_for_timeout(800)  # let the layout settle
        found[width] = page.evaluate("document.documentElement.scrollWidth")
    page.set_viewport_size({"width": 1600, "height": 1300})
    return found


IMAGE_JS = r"""
() => {
  const pv = attn.plot(PREFIX);
  const rv = [...pv.renderer_views.values()].find(
    (r) => r.model.glyph && r.model.glyph.type === "Image");
  const d = rv.model.data_source.data;
  return { title: pv.model.title.text, shape: [...d.image[0].shape],
           values: Array.from(d.image[0], (v) => (Number.isNaN(v) ? null : v)),
           extent: [d.x[0], d.y[0], d.dw[0], d.dh[0]] };
}
"""


# How many maps (and heads' weights) the page holds from the server's sending ahead: the
# inflated rows its scripts keep on the matrix's ClientMapState model.
HELD_JS = (
    "(what) => { const found = [...Bokeh.documents[0].all_models].find("
    "(m) => m[what] !== undefined); return found ? found[what].rows.size : 0; }"
)


def image_js(prefix: str) -> str:
    """A page function returning the image a plot (by title prefix) holds now: its title,
    shape, values (NaN as null) and extent ``[x, y, dw, dh]``."""
    return IMAGE_JS.replace("PREFIX", json.dumps(prefix))


# Every problem of the words and ranges of the page as it stands, whatever its kind; [] when
# none: each plot's title fits its canvas and each axis label its axis (measured in their
# own fonts), its continuous ranges hold the data it draws and are no more than Bokeh's
# padding wider (a range left from a previous state, a non-negative statistic on a -1..1
# axis), no table or text is wider than its box, no word on the page is "NaN", and where one
# axis of positions names them (tokens, clock times), no other numbers them.
WORDS_JS = r"""
() => {
  const problems = [];
  const measure = document.createElement("canvas").getContext("2d");
  const value = (glyph, name) => glyph[name];
  const column = (data, spec, n) => {
    if (spec === null || spec === undefined) return null;
    if (typeof spec === "number") return new Array(n).fill(spec);
    if (spec.field !== undefined) return data[spec.field] ? Array.from(data[spec.field]) : null;
    if (typeof spec.value === "number") return new Array(n).fill(spec.value);
    return null;
  };
  const finite = (xs) => xs.filter((x) => typeof x === "number" && Number.isFinite(x));
  // The data extent along x and y of one glyph renderer: [[lo, hi] or null, ...].
  const extent = (r) => {
    const g = r.glyph, data = r.data_source.data;
    const n = Math.max(1, ...Object.values(data).map((c) => (c && c.length) || 0));
    const get = (name) => column(data, value(g, name), n);
    const xs = [], ys = [];
    const add = (to, ...cols) => { for (const c of cols) if (c) to.push(...finite(c)); };
    switch (g.type) {
      case "Image": case "ImageRGBA": {
        const x = get("x"), y = get("y"), dw = get("dw"), dh = get("dh");
        if (x && dw) add(xs, x, x.map((v, i) => v + dw[i]));
        if (y && dh) add(ys, y, y.map((v, i) => v + dh[i]));
        break;
      }
      case "Quad": add(xs, get("left"), get("right")); add(ys, get("bottom"), get("top")); break;
      case "Line": case "Scatter": case "Circle": add(xs, get("x")); add(ys, get("y")); break;
      case "VBar": {
        const x = get("x"), w = get("width");
        if (x && w) add(xs, x.map((v, i) => v - w[i] / 2), x.map((v, i) => v + w[i] / 2));
        add(ys, get("bottom"), get("top"));
        break;
      }
      case "Rect": {
        const x = get("x"), w = get("width"), y = get("y"), h = get("height");
        if (x && w) add(xs, x.map((v, i) => v - w[i] / 2), x.map((v, i) => v + w[i] / 2));
        if (y && h) add(ys, y.map((v, i) => v - h[i] / 2), y.map((v, i) => v + h[i] / 2));
        break;
      }
      case "Segment": add(xs, get("x0"), get("x1")); add(ys, get("y0"), get("y1")); break;
      case "MultiLine": {  // each line's points
        const flat = (v) => (v ? [].concat(...v.map((line) => Array.from(line))) : null);
        add(xs, flat(get("xs"))); add(ys, flat(get("ys")));
        break;
      }
      case "Text": add(xs, get("x")); add(ys, get("y")); break;  // a label's anchor
      default: return [null, null];
    }
    const span = (v) => (v.length ? [Math.min(...v), Math.max(...v)] : null);
    return [span(xs), span(ys)];
  };
  for (const pv of attn.plots()) {
    if (!pv.el.isConnected || pv.bbox.width === 0) continue;
    const m = pv.model;
    const title = m.title ? m.title.text : "";
    const name = title.split("\n")[0].slice(0, 60) || m.name || "(untitled plot)";
    // 1. the title fits its canvas (each line, in the title's own font)
    const tv = [...pv.renderer_views.values()].find((r) => r.model === m.title);
    if (tv && title) {
      measure.font = tv.visuals.text.font_value();
      const widest = Math.max(...title.split("\n").map((l) => measure.measureText(l).width));
      // up to the canvas' edge, or to the toolbar where one shares the title's row
      const bar = [...pv.renderer_views.values()].find((r) => r.model &&
        r.model.type === "ToolbarPanel" && r.bbox.y0 < tv.bbox.y1 && r.bbox.y1 > tv.bbox.y0);
      const end = bar && bar.bbox.x0 > tv.bbox.x0 ? bar.bbox.x0 : pv.canvas_view.bbox.width;
      const room = end - tv.bbox.x0;
      if (widest > room + 1) {
        const px = (v) => `${v.toFixed(0)} px`;
        problems.push(`${name}: title cut (${px(widest)} of text, ${px(room)} of room)`);
      }
    }
    // 2. continuous ranges hold the data, no more than the padding wider
    const glyphs = m.renderers.filter((r) => r.type === "GlyphRenderer" && r.visible && !r.muted);
    const found = { x: [], y: [] };
    for (const r of glyphs) {
      const [x, y] = extent(r);
      if (x) found.x.push(x);
      if (y) found.y.push(y);
    }
    for (const axis of ["x", "y"]) {
      const range = m[`${axis}_range`];
      if (range.type === "FactorRange" || found[axis].length === 0) continue;
      const lo = Math.min(...found[axis].map((e) => e[0]));
      const hi = Math.max(...found[axis].map((e) => e[1]));
      const a = Math.min(range.start, range.end), b = Math.max(range.start, range.end);
      const span = hi - lo, tol = 0.01 * span + 1e-9;
      const p = (v) => v.toPrecision(6);
      const where = `${name}: ${axis} range ${p(a)} to ${p(b)}, data ${p(lo)} to ${p(hi)}`;
      if (a > lo + tol || b < hi - tol) problems.push(`${where}: data outside the range`);
      else if (span > 1e-4 * Math.max(Math.abs(lo), Math.abs(hi)) && b - a > 1.25 * span + tol) {
        problems.push(`${where}: range wider than its data`);
      }
    }
  }
  // 3. no table is wider than its frame (a cut cell)
  for (const v of attn.views()) {
    const table = v.shadow_el && v.shadow_el.querySelector("table");
    if (!table || !v.el.isConnected) continue;
    const frame = v.el.getBoundingClientRect(), drawn = table.getBoundingClientRect();
    if (frame.width > 0 && drawn.right > frame.right + 1) {
      const first = table.querySelector("th, td");
      const what = `table "${first ? first.textContent : ""}..."`;
      problems.push(`${what}: ${drawn.width.toFixed(0)} px wide in ${frame.width.toFixed(0)} px`);
    }
  }
  // 4. every axis label fits along its axis, in its own font
  for (const pv of attn.plots()) {
    if (!pv.el.isConnected || pv.bbox.width === 0) continue;
    const name = (pv.model.title ? pv.model.title.text : "").split("\n")[0].slice(0, 60);
    for (const av of pv.renderer_views.values()) {
      const label = av.model && av.model.axis_label;
      const font = av.visuals && av.visuals.axis_label_text;
      if (!label || typeof label !== "string" || !font) continue;
      measure.font = font.font_value();
      const along = ["left", "right"].includes(av.panel.side) ? pv.frame.bbox.height
                                                               : pv.frame.bbox.width;
      const wide = measure.measureText(label).width;
      if (wide > along + 1) {
        problems.push(`${name}: axis label "${label}" cut (${wide.toFixed(0)} px of text, ` +
                      `${along.toFixed(0)} px of axis)`);
      }
    }
  }
  // 5. no text pane is wider than its box (a word cut at its edge)
  for (const v of attn.views()) {
    const type = v.model && String(v.model.type);
    if (!type || !/markup\.(HTML|Markdown)|^Div$/.test(type) || !v.el.isConnected) continue;
    const box = v.el.getBoundingClientRect();
    const inner = v.shadow_el ? v.shadow_el.querySelector(".markdown, div, p") : null;
    if (box.width === 0 || !inner) continue;
    if (inner.scrollWidth > inner.clientWidth + 1 && getComputedStyle(inner).overflowX !== "auto") {
      problems.push(`text "${(inner.textContent || "").trim().slice(0, 50)}...": ` +
                    `${inner.scrollWidth} px wide in ${inner.clientWidth} px`);
    }
  }
  // 6. nothing a person reads is "NaN" (a blocked cell names its mask)
  const words = [];
  const walk = (node) => { if (!node) return;
    if (node.nodeType === 3) words.push(node.textContent);
    if (node.shadowRoot) walk(node.shadowRoot);
    for (const c of node.childNodes || []) walk(c); };
  walk(document.body);
  for (const pv of attn.plots()) words.push(pv.model.title ? pv.model.title.text : "");
  const nan = words.find((w) => /\bNaN\b/.test(w));
  if (nan !== undefined) problems.push(`"NaN" on the page: "${nan.trim().slice(0, 60)}"`);
  // 7. positions named one way everywhere: where one axis of positions (query, key,
  // position) labels them by token or clock, none labels them by bare number
  const numeric = (t) => /^[\s\u2007]*[-\u2212]?\d+(\.\d+)?(:|$)/.test(t) &&
                         !/^\s*\d+:\d\d/.test(t);
  const position_axes = [];
  for (const pv of attn.plots()) {
    if (!pv.el.isConnected || pv.bbox.width === 0) continue;
    const name = (pv.model.title ? pv.model.title.text : "").split("\n")[0].slice(0, 60);
    for (const av of pv.renderer_views.values()) {
      const label = av.model && av.model.axis_label;
      if (typeof label !== "string" || !/^(query|key|position)s?( \(.*\))?$/.test(label)) continue;
      let ticks = [];
      try {
        const boxes = av.compute_labels(av.tick_coords.major[av.dimension]);
        ticks = (boxes.items || []).map((b) => String(b.text));
      } catch (e) { continue; }
      if (ticks.length) position_axes.push([`${name}: axis "${label}"`, ticks]);
    }
  }
  const named = position_axes.filter(([, ticks]) => !ticks.every(numeric));
  if (named.length) {
    for (const [where, ticks] of position_axes) {
      const bare = ticks.filter(numeric);
      if (bare.length) {
        problems.push(`${where} numbers positions (${bare.slice(0, 3).join(", ")}) ` +
                      `where ${named[0][0]} names them (${named[0][1].slice(0, 3).join(", ")})`);
      }
    }
  }
  return problems;
}
"""

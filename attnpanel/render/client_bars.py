"""The query's weights redrawn by the browser from the shown head's weights it holds.

A query change moves the matrix's box around the query's row, in the browser at once, and
the query's weights bars ("weights of query q (head h)"). The server
sends the page, while it is idle, the shown head's softmax weights for every query (the
same float32 numbers it draws the bars from, zlib-compressed) into a cache on the page;
a query change then redraws the bars in the browser at once: each key's bar from the
query's row, the title, the query's marker and the value axis by the rule the server fits
it with (:mod:`attnpanel.render.axes`: the bars' span and 6 % beyond each end). The server
still draws the bars as before, with the same numbers: its message changes nothing the
page shows, and its models stay the page's.

The cache shares the matrix's context (:class:`~attnpanel.render.client_maps.ClientMapState`:
sample, layer, enabled heads, window) and is keyed by ``context|head|mask``.
"""

from __future__ import annotations

import zlib

import numpy as np
from bokeh.models import ColumnDataSource, CustomJS, Range1d

from attnpanel.render.axes import CHART_PAD
from attnpanel.render.client_maps import INFLATED_JS, ClientMapState, stream_once
from attnpanel.render.push import REDRAWN_BY_BROWSER

COLUMNS = ("key", "blob", "rows", "cols", "title")

# The shown head's rows, inflated once, by key; draw_bars() (the widgets' script only: it
# reads them) redraws the bars for the query.
BARS_JS = """
const bars_store = state.__rows ??= {rows: new Map(), pending: new Set()};
const quiet_bars = {sync: false};
const bars_key = () => [state.context, heads[head.value], masks[mask.value]].join("|");
function draw_bars() {
  const q = Number(query.value);
  if (row_box !== null) row_box.setv({bottom: q - 0.5, top: q + 0.5}, quiet_bars);
  const row = bars_store.rows.get(bars_key());
  if (row === undefined || !(q >= 0 && q < row.rows)) return;
  const w = row.values.subarray(q * row.cols, (q + 1) * row.cols);
  const n = w.length;
  const bottom = new Float32Array(n), top = new Float32Array(n);
  let lo = Infinity, hi = -Infinity;
  for (let j = 0; j < n; j++) {
    bottom[j] = Math.min(0, w[j]);
    top[j] = Math.max(0, w[j]);
    for (const y of [bottom[j], top[j]]) {
      if (Number.isFinite(y)) { lo = Math.min(lo, y); hi = Math.max(hi, y); }
    }
  }
  const data = Object.assign({}, bars.data, {bottom, top, value: new Float32Array(w)});
  bars.setv({data}, quiet_bars);
  if (lo <= hi) {
    const margin = hi > lo ? PAD * (hi - lo) : 1.0;
    const end = hi + margin;
    const start = lo >= 0 ? Math.max(lo - margin, 0) : lo - margin;  // as axes.fit_axis
    bars_plot.y_range.setv({start, end, reset_start: start, reset_end: end}, quiet_bars);
  }
  bars_plot.title.setv({text: row.title.replace("{query}", String(q))}, quiet_bars);
  if (marker !== null) marker.setv({location: q}, quiet_bars);
}
async function inflate_rows(i) {
  const d = rows_cache.data;
  const key = d.key[i];
  if (bars_store.rows.has(key) || bars_store.pending.has(key) || d.blob[i].length === 0) return;
  bars_store.pending.add(key);
  const row = {rows: d.rows[i], cols: d.cols[i], title: d.title[i]};
  try {
    row.values = new Float32Array(await inflated(d.blob[i]));
  } catch (err) {
    console.warn(`attnpanel: weights ${key} could not be read; the server draws the bars`, err);
    return;
  } finally {
    bars_store.pending.delete(key);
  }
  if (!key.startsWith(state.context + "|")) return;  // the context moved on meanwhile
  bars_store.rows.set(key, row);
}
for (const key of [...bars_store.rows.keys()]) {
  if (!key.startsWith(state.context + "|")) bars_store.rows.delete(key);
}
for (let i = 0; i < rows_cache.data.key.length; i++) inflate_rows(i);
"""


class ClientBars:
    """The models that let the browser redraw the query's weights bars (see the module).

    Parameters
    ----------
    state : attnpanel.render.client_maps.ClientMapState
        The matrix's cache state (its context is the bars' too).
    bars : dict
        The bars' models as drawn (``source``, ``plot``).
    marker : dict, optional
        The bars' query marker's models (``glyph``: a ``Span``).
    row_box : dict, optional
        The matrix's box around the query's row (``glyph``: a ``BoxAnnotation``): it moves
        with the query, whether or not the rows are there.
    """

    def __init__(
        self,
        state: ClientMapState,
        bars: dict,
        marker: dict | None = None,
        row_box: dict | None = None,
    ):
        self.cache = ColumnDataSource({name: [] for name in COLUMNS})
        self.args = dict(
            state=state,
            rows_cache=self.cache,
            bars=bars["source"],
            bars_plot=bars["plot"],  # its y_range: the Range1d the server fits (not drawn's)
            marker=None if marker is None else marker["glyph"],
            row_box=None if row_box is None else row_box["glyph"],
        )
        self._source, self._plot = bars["source"], bars["plot"]
        self._marker = None if marker is None else marker["glyph"]
        bars[REDRAWN_BY_BROWSER] = self.confirm
        # rows that land are only inflated: the server has drawn the bars meanwhile
        on_rows = CustomJS(args=self.args, code=self._code(""))
        self.cache.js_on_change("streaming", on_rows)
        self.cache.js_on_change("data", on_rows)
        state.js_on_change("context", on_rows)

    @staticmethod
    def _code(body: str) -> str:
        return f"const PAD = {CHART_PAD!r};\n" + INFLATED_JS + BARS_JS + body

    def widget_code(self) -> str:
        """The script the query, head and mask widgets run on a change; its arguments are
        :attr:`args` plus ``query``, ``head``, ``mask``, ``heads`` and ``masks`` (as the
        matrix's widget script takes them)."""
        return self._code("draw_bars();")

    def confirm(self) -> None:
        """The server has drawn the bars: the page gets what its models hold (bars, value
        axis, title, query marker), changed or not: the browser may show another query's,
        drawn by its script (another query's scale, which a server draw equal to its last
        one would otherwise leave)."""
        drawn = [(self._source, ("data",)), (self._plot.title, ("text",))]
        if isinstance(self._plot.y_range, Range1d):  # (never fitted: Bokeh's own, NaN ends)
            drawn.append((self._plot.y_range, ("start", "end", "reset_start", "reset_end")))
        if self._marker is not None:
            drawn.append((self._marker, ("location",)))
        for model, names in drawn:
            for name in names:
                value = getattr(model, name)
                model.trigger(name, value, value)

    def reset(self) -> None:
        """A new context: the browser drops the rows it holds."""
        self.cache.data = {name: [] for name in COLUMNS}

    def send(self, key: str, weights: np.ndarray, title: str) -> None:
        """Stream the shown head's weights, ``(query, key)`` float32, to the browser, with
        the bars' title, ``{query}`` in the place of the query (``views.weights_title``)."""
        values = np.ascontiguousarray(weights, dtype=np.float32)
        blob = zlib.compress(values.tobytes(), 1)
        rows, cols = values.shape
        stream_once(
            self.cache,
            dict(
                key=[key],
                blob=[np.frombuffer(blob, dtype=np.uint8)],
                rows=[rows],
                cols=[cols],
                title=[title],
            ),
        )

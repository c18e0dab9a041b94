"""A map the browser redraws itself from images it already holds.

The server draws a map's exact float32 image into its Bokeh source (the *main* layer:
exact values in the hover). :class:`ClientLayer` adds, on the same figure, what lets the
browser switch that map without asking the server for an image:

- a cache the server fills in the background (a ``ColumnDataSource`` it streams rows to:
  one map each, 8-bit and zlib-compressed, with the words around it: title, colour
  limits, colour-bar title, the value's name);
- a second image layer the page's scripts draw a cached map into, over the main one, and
  a hover for it that gives the range of the cell's colour (the 8-bit copy cannot give
  the exact value);
- :class:`ClientMapState`, a Bokeh ``DataModel`` (no compiled extension) holding the
  cache's *context* (what every cached map shares: sample, layer, window ...) and the key
  of the map the main layer holds (``server_key``).

A stored level is the colour index BokehJS's ``LinearColorMapper`` gives the exact value
(:func:`palette_index`, the same arithmetic in float64), and the browser draws each level
as that colour (a mapper of its own, from 0 to the palette's length): the canvas the
browser paints from the cache is, pixel for pixel, the one it paints from the server's
image. Masked cells (NaN) travel as a bit plane after the levels. The colour bar
reads the scale from a mapper that colours no image (``scale``).

The scripts set what they draw with ``sync: false``: nothing goes back to the server. The
server writes the words itself as well (:meth:`ClientLayer.follow`: title, colour-bar
title, the value's name, the scale), so its models hold what the page shows; what differs
is only where the pixels come from and which layer is visible, which the scripts alone
decide.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
from bokeh.core.properties import String
from bokeh.model import DataModel
from bokeh.models import (
    ColumnDataSource,
    CustomJS,
    CustomJSHover,
    GlyphRenderer,
    HoverTool,
    LinearColorMapper,
)
from bokeh.models import Image as ImageGlyph

from attnpanel.readouts.raster import scale_title
from attnpanel.render.figures import BLOCKED, CELL, CELL_JS
from attnpanel.render.push import name_map

EMPTY = np.zeros(0, dtype=np.uint8)
LEVEL_NAME = "cached levels"  # the client layer's renderer: its hover and tests find it
CACHE_COLUMNS = ("key", "blob", "rows", "cols", "x", "y", "dw", "dh", "low", "high")
WORD_COLUMNS = ("title", "bar", "label")


def stream_once(source: ColumnDataSource, row: dict) -> None:
    """Stream one row to the page, whose ``blob`` the browser keeps and the server drops
    (it can make it again). Replacing the list's item, not the column, changes nothing
    on the page."""
    source.stream(row)
    blobs = source.data["blob"]
    blobs[len(blobs) - 1] = EMPTY


class ClientMapState(DataModel):
    """What the browser needs to know beside the cache: the cache's context and the map the
    server's own image shows (``"{context}|{head}|{stage}|{mask}"``)."""

    context = String(default="", help="What every cached map shares (sample, layer, window).")
    server_key = String(default="", help="The key of the map the main layer holds.")
    server_title = String(default="", help="The title of the map the main layer holds.")
    server_bar = String(default="", help="Its colour bar's title.")
    server_label = String(default="", help="Its value's name (the hover's).")


def palette_index(values: np.ndarray, low: float, high: float, colours: int) -> np.ndarray:
    """The palette index BokehJS's ``LinearColorMapper`` gives each value (NaN: 0).

    Its ``value_to_index`` in float64, step by step: ``(v - low) * (1 / (high - low))``
    divided by ``1 / colours``, floored, and clamped to the palette (a mapper without
    ``low_color``/``high_color`` paints out-of-range values with the end colours); a value
    equal to ``high`` takes the last colour.
    """
    v = np.asarray(values, dtype=np.float64)
    norm_factor = 1.0 / (float(high) - float(low))
    normed_interval = 1.0 / colours
    with np.errstate(invalid="ignore"):
        index = np.floor(((v - float(low)) * norm_factor) / normed_interval)
    index = np.where(v == float(high), colours - 1, index)
    return np.clip(np.nan_to_num(index, nan=0.0), 0, colours - 1).astype(np.uint8)


def encode_levels(values: np.ndarray, low: float, high: float, colours: int) -> bytes:
    """A map as its colours' indices (one byte a cell, rows as stored) followed by its
    masked cells as bits (``numpy.packbits``, big-endian), zlib-compressed."""
    if not 0 < colours <= 256:
        raise ValueError(f"a palette of {colours} colours does not fit 8-bit levels")
    if not high > low:
        raise ValueError(f"colour limits {low}..{high} are empty")
    levels = palette_index(values, low, high, colours)
    masked = np.packbits(np.isnan(values).ravel())
    return zlib.compress(levels.tobytes() + masked.tobytes(), 6)


def decode_levels(blob: bytes, shape: tuple[int, int], low: float, high: float, colours: int):
    """A map as the browser decodes and draws it (``explorer.drawn()`` where the page shows
    it): each level at the middle of its colour's interval, masked cells NaN, float32."""
    raw = zlib.decompress(blob)
    cells = shape[0] * shape[1]
    levels = np.frombuffer(raw[:cells], dtype=np.uint8).astype(np.float64)
    masked = np.unpackbits(np.frombuffer(raw[cells:], dtype=np.uint8))[:cells].astype(bool)
    step = (high - low) / colours
    values = low + (levels + 0.5) * step
    values[masked] = np.nan
    return values.reshape(shape).astype(np.float32)


@dataclass(frozen=True)
class CachedMap:
    """One map as the browser's cache holds it: its levels, compressed, and the words the
    page shows around it."""

    key: str
    blob: bytes  # encode_levels' output
    shape: tuple[int, int]  # (rows, cols), rows by ascending y as the main source holds them
    bounds: tuple  # (left, bottom, right, top)
    low: float
    high: float
    colours: int  # the palette's length the levels index
    title: str
    label: str  # the value's name (hover, colour bar)

    @classmethod
    def of(cls, key: str, values: np.ndarray, bounds, limits, colours: int, title, label):
        """Encode a map (float32, NaN masked) drawn with colour ``limits`` ``(low, high)``."""
        low, high = (float(v) for v in limits)
        blob = encode_levels(values, low, high, colours)
        return cls(key, blob, values.shape, tuple(bounds), low, high, colours, title, label)

    @property
    def bar(self) -> str:
        """The colour bar's title."""
        return scale_title(self.label, self.low)

    def values(self) -> np.ndarray:
        """The map as the browser draws it (each level at its colour's middle)."""
        return decode_levels(self.blob, self.shape, self.low, self.high, self.colours)


# A zlib stream's bytes inflated by the browser's own DecompressionStream (both caches').
# (a ``var``: the widgets' script holds both caches' code, and declares it twice)
INFLATED_JS = """
var inflated = async (bytes) => {
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("deflate"));
  return await new Response(stream).arrayBuffer();
};
"""

# Shared by every callback: the browser's own table of inflated maps lives on the state
# model (one per page), keyed by map key. ``show()`` draws the map the widgets ask for: the
# main layer when the server's image is that map, else its cached levels, else nothing yet
# (the server or the cache will bring it). The levels are drawn as themselves (level + 0.5
# on a mapper from 0 to the palette's length: each its own colour), so a new map re-maps
# one image and no other. The colour bar reads a mapper that colours no image (``scale``):
# a new scale redraws the bar alone (binding the bar to another mapper rebuilds it: ~110 ms).
SHOW_JS = """
const store = state.__cached ??= {rows: new Map(), pending: new Set(), parts: null, shown: null};
const wanted = () => store.parts === null ? state.server_key
                                          : [state.context, ...store.parts].join("|");
const quiet = {sync: false};
function words(row) {
  plot.title.setv({text: row.title}, quiet);
  if (bar !== null) bar.setv({title: row.bar}, quiet);
  for (const tool of [main_hover, level_hover]) {
    const tips = (tool.tooltips ?? []).slice();
    if (tips.length === 0) continue;
    tips[tips.length - 1] = [row.label, tips[tips.length - 1][1]];
    tool.setv({tooltips: tips}, quiet);
  }
}
function show() {
  // rows the page arrived with, or that came while no callback ran: inflated on first look
  for (let i = 0; i < cache.data.key.length; i++) inflate(i);
  const key = wanted();
  const row = store.rows.get(key);
  if (key === state.server_key) {
    words({title: state.server_title, bar: state.server_bar, label: state.server_label});
    scale.setv({low: mapper.low, high: mapper.high}, quiet);
    level.setv({visible: false}, quiet);
    main.setv({visible: true}, quiet);
    store.shown = null;
    return;
  }
  if (row === undefined || store.shown === key) return;
  const cells = row.rows * row.cols;
  const values = new Float32Array(cells);
  for (let i = 0; i < cells; i++) {
    const masked = (row.bytes[cells + (i >> 3)] >> (7 - (i & 7))) & 1;
    values[i] = masked ? NaN : row.bytes[i] + 0.5;
  }
  const old = level_source.data.image[0];
  level_source.setv({data: {image: [new old.constructor(values, [row.rows, row.cols])],
                            x: [row.x], y: [row.y], dw: [row.dw], dh: [row.dh]}}, quiet);
  scale.setv({low: row.low, high: row.high}, quiet);
  words(row);
  level.setv({visible: true}, quiet);
  main.setv({visible: false}, quiet);
  store.shown = key;
}
async function inflate(i) {
  const d = cache.data;
  const key = d.key[i];
  if (store.rows.has(key) || store.pending.has(key) || d.blob[i].length === 0) return;
  store.pending.add(key);
  const row = {};
  for (const name of NUMBERS) row[name] = d[name][i];
  for (const name of WORDS) row[name] = d[name][i];
  try {
    row.bytes = new Uint8Array(await inflated(d.blob[i]));
  } catch (err) {
    console.warn(`attnpanel: map ${key} could not be read; the server draws it`, err);
    return;
  } finally {
    store.pending.delete(key);
  }
  if (!key.startsWith(state.context + "|")) return;  // the context moved on meanwhile
  store.rows.set(key, row);
  show();
}
"""

# A widget of the map's selection changed (the user's, or the server's echo of its own).
# A part without a widget (``null``) is named by its one value (a string).
WIDGET_JS = """
const part = (widget, names) => widget === null ? names : names[widget.value];
store.parts = [part(head, heads), part(stage, stages), part(mask, masks)];
show();
"""
# New rows in the cache (streamed) or a new cache (its context changed): inflate them.
CACHE_JS = """
for (const key of [...store.rows.keys()]) {
  if (!key.startsWith(state.context + "|")) store.rows.delete(key);
}
show();
"""
# A cell's range: its colour's interval on the map's scale; the end colours also hold what
# the scale clips.
LEVEL_RANGE_JS = (
    CELL_JS
    + """
if (Number.isNaN(cell)) return blocked;
const n = scale.palette.length, step = (scale.high - scale.low) / n;
const level = Math.floor(cell);
const from = scale.low + level * step, to = from + step;
const drawn = " (its colour's range: an 8-bit copy drawn in the browser)";
if (level === n - 1) return `≥ ${from.toFixed(4)}${drawn}`;
if (level === 0 && scale.low < 0) return `≤ ${to.toFixed(4)}${drawn}`;
return `${from.toFixed(4)} to ${to.toFixed(4)}${drawn}`;
"""
)


def _code(body: str) -> str:
    numbers = [c for c in CACHE_COLUMNS if c not in ("key", "blob")]
    head = f"const NUMBERS = {numbers!r}; const WORDS = {list(WORD_COLUMNS)!r};\n"
    return head + INFLATED_JS + SHOW_JS + body


class ClientLayer:
    """The models that let the browser redraw one drawn map from a cache (see the module).

    Parameters
    ----------
    handles : dict
        The map's models as :func:`attnpanel.render.figures.draw` recorded them (``plot``,
        ``glyph_renderer``, ``color_mapper``, ``colorbar``, ``hover`` ...).
    """

    def __init__(self, handles: dict):
        self.handles = handles
        self.state = ClientMapState()
        self.cache = ColumnDataSource({name: [] for name in CACHE_COLUMNS + WORD_COLUMNS})
        main = handles["glyph_renderer"]
        mapper = handles["color_mapper"]
        # the levels' own colours, and the map's scale for the colour bar and the hover
        colours = dict(palette=mapper.palette, nan_color=mapper.nan_color)
        levels = LinearColorMapper(low=0, high=len(mapper.palette), **colours)
        self.scale = LinearColorMapper(low=mapper.low, high=mapper.high, **colours)
        if handles.get("colorbar") is not None:
            handles["colorbar"].color_mapper = self.scale
        blank = np.full((1, 1), np.nan, dtype=np.float32)
        self.source = ColumnDataSource(dict(image=[blank], x=[0.0], y=[0.0], dw=[1.0], dh=[1.0]))
        glyph = ImageGlyph(image="image", x="x", y="y", dw="dw", dh="dh", color_mapper=levels)
        self.glyph = glyph
        self.renderer = GlyphRenderer(
            data_source=self.source, glyph=glyph, visible=False, name=LEVEL_NAME
        )
        plot = handles["plot"]
        plot.renderers.append(self.renderer)
        main_hover = handles.get("hover") or HoverTool(renderers=[main], tooltips=[])
        tips = [tuple(tip) for tip in main_hover.tooltips or []]
        value_tip = (tips[-1][0] if tips else "value", CELL + "{level}")
        words = dict(scale=self.scale, blocked=BLOCKED)
        level_range = CustomJSHover(args=words, code=LEVEL_RANGE_JS)
        self.hover = HoverTool(
            renderers=[self.renderer],
            tooltips=[*tips[:-1], value_tip],
            formatters={**dict(main_hover.formatters or {}), CELL: level_range},
            visible=False,  # no second button: the map's own hover button stands for both
        )
        plot.add_tools(self.hover)
        # the map's one hover button (a tool's active state lives in the browser only)
        main_hover.js_on_change(
            "change:active",
            CustomJS(args=dict(level=self.hover), code="level.active = cb_obj.active;"),
        )
        self.args = dict(
            state=self.state,
            cache=self.cache,
            level=self.renderer,
            level_source=self.source,
            level_hover=self.hover,
            main=main,
            main_hover=main_hover,
            mapper=mapper,
            scale=self.scale,
            bar=handles.get("colorbar"),
            plot=plot,
        )
        on_cache = CustomJS(args=self.args, code=_code(CACHE_JS))
        self.cache.js_on_change("streaming", on_cache)
        self.cache.js_on_change("data", on_cache)
        self.state.js_on_change("server_key", on_cache)
        self.state.js_on_change("context", on_cache)

    def recolour(self, palette: list[str]) -> None:
        """A new colour map: the levels keep their indices, the colours follow."""
        for mapper in (self.glyph.color_mapper, self.scale):
            mapper.palette = palette

    @property
    def colours(self) -> int:
        """The map's palette length (each level is one of its colours)."""
        return len(self.handles["color_mapper"].palette)

    def widget_code(self) -> str:
        """The script a widget of the map's selection runs on a change; its own arguments
        are :attr:`args` plus ``head``, ``stage``, ``mask`` (the widgets) and ``heads``,
        ``stages``, ``masks`` (each widget's labels to the key's parts); a part the page
        has no widget for is ``None``, and its names the one value every key holds."""
        return _code(WIDGET_JS)

    def reset(self, context: str) -> None:
        """A new context: the cache emptied (the browser drops its maps)."""
        self.cache.data = {name: [] for name in CACHE_COLUMNS + WORD_COLUMNS}
        self.state.context = context

    def send(self, cached: CachedMap) -> None:
        """Stream one map to the browser's cache."""
        rows, cols = cached.shape
        left, bottom, right, top = cached.bounds
        row = dict(
            key=[cached.key],
            blob=[np.frombuffer(cached.blob, dtype=np.uint8)],
            rows=[rows],
            cols=[cols],
            x=[left],
            y=[bottom],
            dw=[right - left],
            dh=[top - bottom],
            low=[cached.low],
            high=[cached.high],
            title=[cached.title],
            bar=[cached.bar],
            label=[cached.label],
        )
        stream_once(self.cache, row)

    def server_drew(self, key: str) -> None:
        """The server wrote map ``key``'s exact image into the main layer, with its limits
        and words: the colour bar's scale follows, and the page keeps the words to show
        with that map again (after maps drawn from its cache)."""
        mapper = self.handles["color_mapper"]
        self.scale.low, self.scale.high = mapper.low, mapper.high
        colorbar, hover = self.handles.get("colorbar"), self.handles.get("hover")
        if hover is not None and hover.tooltips and self.hover.tooltips:
            # the levels' hover names the value as the map's own does from the first
            # second (it kept the name it was built with until the page's callback ran)
            *place, (_, field) = self.hover.tooltips
            if self.hover.tooltips[-1][0] != hover.tooltips[-1][0]:
                self.hover.tooltips = [*place, (hover.tooltips[-1][0], field)]
        self.state.update(
            server_title=self.handles["plot"].title.text,
            server_bar=colorbar.title if colorbar is not None else "",
            server_label=hover.tooltips[-1][0] if hover is not None and hover.tooltips else "",
            server_key=key,  # last: the page redraws on it
        )

    def follow(self, cached: CachedMap) -> None:
        """The words around a map the browser draws from its cache, written by the server
        too (they are what the browser already shows: the server's models stay the page's)."""
        self.handles["plot"].title.text = cached.title
        self.scale.low, self.scale.high = cached.low, cached.high
        name_map(self.handles, cached.label, cached.low, hovers=(self.hover,))

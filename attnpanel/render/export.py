"""Standalone, offline HTML export of a trace's attention maps.

:func:`export_html` checks what is asked, stores the maps
(:mod:`attnpanel.render.export_maps`) at the largest resolution that keeps the file under its
size limit, lays them out in one self-contained page (:mod:`attnpanel.render.export_page`)
and writes it safely (never half-written, never over a file that is not such a page). The
file's size depends on the display resolution, not on the square of the sequence length.
"""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path

import xarray as xr

from attnpanel.render.export_maps import (
    DISPLAY,
    OVERVIEW_DISPLAY,
    OverviewMaps,
    export_maps,
    shown_masks,
)
from attnpanel.render.export_page import page_html
from attnpanel.traces import virtual
from attnpanel.traces.overviews import Overviews
from attnpanel.util.files import check_target, write_safely

MAX_BYTES = 5_000_000  # the file's default size limit (5 MB)
# Each head is a small map of its own (about 6 KB of page before any map is stored); the
# largest models have 128 heads per layer.
MAX_HEADS = 256


def export_html(
    ds: xr.Dataset,
    path: str | Path,
    sample: int = 0,
    size: int | None = None,
    title: str = "attnpanel",
    max_bytes: int | None = MAX_BYTES,
    subtitle: str | None = None,
    overwrite: bool = False,
    query: int = 0,
    masks: list[str] | None = None,
    overviews: Overviews | None = None,
    layer: int | None = None,
) -> Path:
    """Write one sample's attention maps as a standalone HTML file that works offline.

    Above the maps, the sample's input sequence (the input signal with each reference
    series' truth and prediction, where the trace holds them) with the selected query's
    weights behind it; a query slider (or a click on the large map) moves the query, whose
    row is marked on every map.

    A virtual trace (:func:`attnpanel.traces.virtual.is_virtual`) is drawn from its overviews:
    each pixel the maximum weight of its cells (a single sharp key is never averaged
    away), masked where at least :data:`MASKED_SHARE` of them are blocked; the titles say
    so, and the query's marks cover the pixel row that holds it.

    Parameters
    ----------
    ds : xarray.Dataset
        A trace.
    path : str or Path
        The HTML file to write.
    sample : int
        Which batch item (by position).
    size : int, optional
        Display resolution: maps longer than this are reduced to ``size`` x ``size``;
        default :data:`DISPLAY` (400) for a dense trace and, for a virtual one, the side
        of the overviews the explorer stores (:data:`OVERVIEW_DISPLAY`, 480), so that
        stored overviews are read rather than computed.
    title : str
        The page title.
    max_bytes : int or None
        The file's size limit. Maps that compress badly (noise-like attention) are stored
        at a lower resolution until the file fits (a virtual trace's by whole blocks of
        its overviews' pixels); ``None`` keeps ``size``.
    subtitle : str, optional
        What the page shows, in its header before the sample (such as the layer's module
        name and group).
    overwrite : bool
        Replace an existing HTML page at ``path`` (anything else there is never replaced).
    query : int
        The query selected when the page opens.
    masks : list of str, optional
        The mask modes shown (see :func:`attnpanel.traces.stages.mask_options`). Default: every
        mode for a dense trace; only the trace's own (``ds.attrs["mask"]``) for a virtual
        one, since each other mode costs a pass over every cell of each head's map (about
        10 s a head at L = 65,536 on 2 cores) unless its overviews are stored.
    overviews : attnpanel.traces.overviews.Overviews, optional
        A virtual trace's overviews (:func:`attnpanel.traces.overviews.folder_for` the trace
        file's, to read those stored and store new ones); None computes them in memory.
        Unused for a dense trace.
    layer : int, optional
        The layer's index when ``overviews`` holds a stacked trace (``layer`` dim).

    Returns
    -------
    Path

    Raises
    ------
    ValueError
        For a sample, query or mask the trace does not have, too many heads, or maps that
        do not fit ``max_bytes``.
    """
    if not 0 <= sample < ds.sizes["batch"]:
        raise ValueError(
            f"sample {sample} is out of range: the trace has {ds.sizes['batch']} samples"
        )
    if ds.sizes["head"] > MAX_HEADS:
        raise ValueError(
            f"the export draws every head as a small map, and {ds.sizes['head']} heads are "
            f"more than the {MAX_HEADS} it lays out; export a selection, such as "
            f"ds.isel(head=slice(0, {MAX_HEADS}))"
        )
    if not 0 <= query < ds.sizes["query"]:
        raise ValueError(
            f"query {query} is out of range: the trace has {ds.sizes['query']} query positions"
        )
    masks = shown_masks(ds, masks)
    check_target(path, "html", overwrite)  # before the work
    if virtual.is_virtual(ds):
        size = OVERVIEW_DISPLAY if size is None else size
        encode = OverviewMaps(ds, sample, size, masks, overviews, layer).payload
    else:
        size = DISPLAY if size is None else size
        encode = partial(export_maps, ds, sample, masks=masks)
    frame = size  # the large map's frame in pixels stays, whatever resolution is stored
    payload = encode(size)
    html = page_html(ds, payload, title, sample, frame, subtitle, query)
    for _ in range(4):
        if max_bytes is None or len(html.encode("utf-8")) <= max_bytes:
            break
        # maps shrink with the square of their side; the page around them does not
        maps = sum(len(m) for per_mask in payload["maps"].values() for m in per_mask)
        page = len(html.encode("utf-8")) - maps
        if page >= max_bytes:
            raise ValueError(
                f"a page of {ds.sizes['head']} heads takes {page} bytes before any map is "
                f"stored, over max_bytes={max_bytes} (max_bytes=None lifts the limit)"
            )
        size = int(payload["n"] * math.sqrt(0.95 * (max_bytes - page) / maps))
        payload = encode(size)
        html = page_html(ds, payload, title, sample, frame, subtitle, query)
    if max_bytes is not None and len(html.encode("utf-8")) > max_bytes:
        raise ValueError(f"could not fit the maps in max_bytes={max_bytes}")
    return write_safely(path, "html", lambda target: target.write_text(html, "utf-8"), overwrite)

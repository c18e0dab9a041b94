"""The HTML export of a virtual trace: each head's map from its overview, each pixel the
maximum weight of its cells, checked against the model's own weights (the dense twin)."""

from __future__ import annotations

import base64
import gzip
import json
import re
import zlib

import numpy as np
import pytest
import torch
import xarray as xr
from pairs import padded_pair

import attnpanel
from attnpanel.cli import main
from attnpanel.readouts.windows import CURVE_BINS
from attnpanel.render.export import export_html
from attnpanel.render.export_maps import LEVELS, MASKED, MASKED_SHARE, export_maps
from attnpanel.traces import overviews, virtual
from attnpanel.traces.stages import attention_stage

MAX_BYTES = 5_000_000  # the limit
DIAGONAL_PADDED = 40  # padded_pair: sample 1's last 40 keys are padding


@pytest.fixture(scope="module")
def pair():
    """A dense trace (the model's weights) and a virtual one of the same numbers."""
    return padded_pair(300)


def _plain(node):
    """Bokeh's serialised document as plain Python: maps as dicts, arrays as numpy."""
    if isinstance(node, list):
        return [_plain(item) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "map":
        return {key: _plain(value) for key, value in node.get("entries", [])}
    if node.get("type") == "ndarray":
        array = node["array"]
        if isinstance(array, dict):  # {"type": "bytes", "data": base64, gzipped or not}
            raw = base64.b64decode(array["data"])
            raw = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
            values = np.frombuffer(raw, node["dtype"])
        else:
            values = np.asarray(array, node["dtype"])
        return values.reshape(node["shape"])
    return {key: _plain(value) for key, value in node.items()}


def _document_json(path):
    """An exported page's Bokeh document, as JSON."""
    text = path.read_text(encoding="utf-8")
    (doc,) = re.findall(r'<script type="application/json"[^>]*>(.*?)</script>', text, re.S)
    return json.loads(doc)


def _text(path) -> str:
    """Every string of an exported page's document (titles, the header, script values)."""
    return json.dumps(_document_json(path), ensure_ascii=False)


def _document(path) -> list[dict]:
    """Every model of an exported page's document: ``{"name", "attributes"}``."""
    found = []

    def walk(node):
        if isinstance(node, dict):
            if node.get("type") == "object" and "attributes" in node:
                found.append({"name": node["name"], "attributes": _plain(node["attributes"])})
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(_document_json(path))
    return found


def _payload(path) -> dict:
    """The encoded maps stored in an exported page (the script's ``payload``)."""
    for model in _document(path):
        if model["name"] == "CustomJS" and "payload" in model["attributes"].get("args", {}):
            return model["attributes"]["args"]["payload"]
    raise AssertionError(f"no payload in {path}")


def _decoded(payload: dict, mask: str, head: int) -> tuple[np.ndarray, np.ndarray, float]:
    """A stored map as weights (NaN where drawn masked), its 8-bit levels and the step."""
    n = payload["n"]
    raw = zlib.decompress(base64.b64decode(payload["maps"][mask][head]))
    levels = np.frombuffer(raw, np.uint8).reshape(n, n)
    low, top = payload["scales"][mask][head]
    values = np.where(levels == MASKED, np.nan, low + levels / LEVELS * (top - low))
    return values, levels, (top - low) / LEVELS


def _pixel_max(weights: np.ndarray, blocked: np.ndarray, n: int) -> np.ndarray:
    """The reference: each pixel's cells (query ``i`` in row ``i * n // L``) reduced by
    max, NaN where at least MASKED_SHARE of them are blocked."""
    length = len(weights)
    of = np.arange(length) * n // length
    at = (of[:, None], of[None, :])
    peak, cells, shut = np.zeros((n, n)), np.zeros((n, n)), np.zeros((n, n))
    np.maximum.at(peak, at, weights)
    np.add.at(cells, at, 1)
    np.add.at(shut, at, blocked)
    peak[shut / cells >= MASKED_SHARE] = np.nan
    return peak


def _assert_drawn(payload: dict, mask: str, head: int, expected: np.ndarray) -> None:
    """A stored map draws ``expected`` within its 8-bit step, masked exactly where NaN."""
    values, _, step = _decoded(payload, mask, head)
    assert values.shape == expected.shape
    np.testing.assert_array_equal(np.isnan(values), np.isnan(expected))
    top = payload["scales"][mask][head][1]
    shown = ~np.isnan(expected)
    # weights above the colour scale's top (p99.5) are stored at the top level
    np.testing.assert_allclose(values[shown], np.minimum(expected[shown], top), atol=step)


def _model_blocked(length: int, sample: int) -> np.ndarray:
    """The cells padded_pair's model blocked: the diagonal and sample 1's padded keys."""
    blocked = np.eye(length, dtype=bool)
    if sample == 1:
        blocked[:, length - DIAGONAL_PADDED :] = True
    return blocked


@pytest.mark.parametrize("size", [300, 150, 100])
def test_each_pixel_is_the_max_of_the_models_weights(pair, size, tmp_path):
    dense, lazy = pair
    path = export_html(lazy, tmp_path / f"virtual_{size}.html", sample=1, size=size)
    assert path.stat().st_size <= MAX_BYTES
    payload = _payload(path)
    assert payload["n"] == size and payload["masks"] == ["diagonal"]  # its own mask only
    blocked = _model_blocked(300, sample=1)
    for head in range(lazy.sizes["head"]):
        weights = dense["weights"].isel(batch=1, head=head).values  # the model's own
        _assert_drawn(payload, "diagonal", head, _pixel_max(weights, blocked, size))
    text = _text(path)
    per_pixel = 300 // size
    if per_pixel > 1:
        assert f"max of ≤{per_pixel} x {per_pixel} cells per pixel" in text
        assert f"stored at {size} x {size}, each pixel the max of" in text
    else:
        assert "cells per pixel" not in text  # one cell per pixel: the weights themselves
    _, levels, _ = _decoded(payload, "diagonal", 0)
    # 2 x 2 pixels hold the diagonal in half their cells: drawn masked, as the dense export
    assert (np.diag(levels) == MASKED).all() == (per_pixel <= 2)
    assert (levels[:, -(DIAGONAL_PADDED // per_pixel) :] == MASKED).all()  # padded keys


def test_a_file_over_its_limit_is_cut_from_the_same_overviews(pair, tmp_path, monkeypatch):
    dense, lazy = pair
    computed = []
    compute = overviews.compute
    monkeypatch.setattr(overviews, "compute", lambda task: computed.append(task) or compute(task))
    store = overviews.Overviews(lazy)
    full = export_html(lazy, tmp_path / "full.html", sample=1, overviews=store, max_bytes=None)
    assert len(computed) == lazy.sizes["head"]  # one overview per head, 300 x 300 cells
    maps = sum(len(m) for m in _payload(full)["maps"]["diagonal"])
    limit = full.stat().st_size - maps // 2
    smaller = export_html(
        lazy, tmp_path / "smaller.html", sample=1, overviews=store, max_bytes=limit
    )
    assert smaller.stat().st_size <= limit
    assert len(computed) == lazy.sizes["head"], "the smaller maps were computed again"
    payload = _payload(smaller)
    n = payload["n"]
    assert n < 300 and 300 % n == 0, f"{n} is no whole-block coarsening of 300"
    blocked = _model_blocked(300, sample=1)
    for head in range(lazy.sizes["head"]):
        weights = dense["weights"].isel(batch=1, head=head).values
        _assert_drawn(payload, "diagonal", head, _pixel_max(weights, blocked, n))


def test_masks_asked_for_are_drawn_and_unknown_ones_named(pair, tmp_path):
    dense, lazy = pair
    path = export_html(lazy, tmp_path / "masks.html", sample=1, size=100, masks=["none", "causal"])
    payload = _payload(path)
    assert payload["masks"] == ["none", "causal"]
    blocked = np.triu(np.ones((300, 300), bool), 1)  # causal, the padded keys kept
    blocked[:, 300 - DIAGONAL_PADDED :] = True
    for head in range(lazy.sizes["head"]):  # the dense trace's recomputation under causal
        weights = attention_stage(dense, "softmax", mask="causal", batch=1, head=head).values
        _assert_drawn(payload, "causal", head, _pixel_max(weights, blocked, 100))
    with pytest.raises(ValueError, match="mask 'sideways' is not one this trace"):
        export_html(lazy, tmp_path / "bad.html", masks=["sideways"])
    assert not (tmp_path / "bad.html").exists()
    # a dense trace: every mode by default, as before; a list asked for is honoured
    assert export_maps(dense, size=50)["masks"] == ["none", "diagonal", "causal"]
    assert export_maps(dense, size=50, masks=["causal"])["masks"] == ["causal"]
    with pytest.raises(ValueError, match="'sideways'"):
        export_maps(dense, masks=["sideways"])


@pytest.fixture(scope="module")
def long_virtual():
    """A virtual trace longer than the curve's bins and the map's pixels (L = 4,000)."""
    torch.manual_seed(4)
    layer = attnpanel.MultiHeadSelfAttention(32, 2, "diagonal").eval()
    steps = torch.arange(4000, dtype=torch.float32)[None, :, None]
    x = torch.randn(1, 4000, 32) + 3 * torch.sin(steps / 50 * torch.arange(32) / 8)
    return attnpanel.trace(layer, x, dense=False)


@pytest.fixture(scope="module")
def long_page(long_virtual, tmp_path_factory):
    path = tmp_path_factory.mktemp("long") / "long.html"
    return export_html(long_virtual, path, query=1234)


def test_a_long_trace_stores_its_curve_by_bins_and_marks_the_querys_pixel_row(
    long_virtual, long_page
):
    assert long_page.stat().st_size <= MAX_BYTES
    models = _document(long_page)
    lines = [
        m["attributes"]["data"]
        for m in models
        if m["name"] == "ColumnDataSource" and set(m["attributes"].get("data", {})) == {"x", "y"}
    ]
    assert len(lines) == 1  # the input norm
    norm = np.linalg.norm(long_virtual["x"].isel(batch=0).values, axis=-1)
    curve = lines[0]
    assert len(curve["y"]) == 2 * CURVE_BINS < len(norm)
    assert curve["y"].max() == pytest.approx(norm.max()) and curve["y"].min() == pytest.approx(
        norm.min()
    )
    assert (np.diff(curve["x"]) >= 0).all()
    # 480 pixel rows over 4,000 queries: query 1234 lies in row 148, queries 1234 to 1241
    boxes = {
        (m["attributes"]["bottom"], m["attributes"]["top"])
        for m in models
        if m["name"] == "BoxAnnotation" and m["attributes"].get("name") == "query row"
    }
    assert boxes == {(1233.5, 1241.5)}
    text = _text(long_page)
    assert "max of ≤9 x 9 cells per pixel" in text
    assert "max weight of queries 1234-1241 (the pixel row of query 1234, head 0)" in text


def test_the_query_slider_marks_the_pixel_row_and_paints_its_stored_weights(
    long_page, browser, artifacts
):
    import re as regex

    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    attempted, errors = [], []
    context.route(regex.compile(r"^(?!file:).*"), lambda r: attempted.append(r) or r.abort())
    page = context.new_page()
    page.on("pageerror", lambda error: errors.append(str(error)))
    try:
        page.goto(long_page.as_uri())
        page.wait_for_function("document.body.dataset.attnpanelView === 'diagonal/0'")
        page.evaluate(
            "() => { [...Bokeh.documents[0].all_models].find(m => m.type === 'Slider')"
            ".value = 2500; }"
        )
        page.wait_for_timeout(300)
        found = page.evaluate(
            """() => {
              const all = [...Bokeh.documents[0].all_models];
              const band = all.find(m => m.type === 'ColumnDataSource' && 'alpha' in m.data);
              const seq = all.find(m => m.name === 'sequence');
              return {weight: Array.from(band.data.weight), title: seq.title.text,
                      rows: all.filter(m => m.name === 'query row').map(b => [b.bottom, b.top])};
            }"""
        )
        page.screenshot(path=str(artifacts / "export_virtual_query.png"), full_page=True)
    finally:
        context.close()
    assert errors == [] and attempted == []
    # query 2500 lies in pixel row 2500 * 480 // 4000 = 300: queries 2500 to 2508
    assert {tuple(r) for r in found["rows"]} == {(2499.5, 2508.5)}
    assert found["title"].startswith("max weight of queries 2500-2508 (the pixel row of query")
    stored, _, step = _decoded(_payload(long_page), "diagonal", 0)
    np.testing.assert_allclose(found["weight"], np.nan_to_num(stored[300]), atol=step / 2)


def _saved_virtual(tmp_path, length: int = 300):
    torch.manual_seed(5)
    layer = attnpanel.MultiHeadSelfAttention(32, 2, "diagonal").eval()
    ds = attnpanel.trace(layer, torch.randn(1, length, 32), dense=False)
    return attnpanel.save(ds, tmp_path / "virtual.zarr"), ds


def test_the_cli_stores_the_overviews_and_a_second_export_reads_them(tmp_path, monkeypatch, capsys):
    path, ds = _saved_virtual(tmp_path)
    first = tmp_path / "first.html"
    assert main(["export", str(path), "-o", str(first)]) == 0
    folder = overviews.folder_for(path)
    stored = sorted(p.name for p in folder.iterdir())
    assert stored == [f"sample0-head{h}-diagonal-480x480.zarr" for h in range(2)]

    def no_compute(task):
        raise AssertionError("an overview was computed again")

    monkeypatch.setattr(overviews, "compute", no_compute)
    second = tmp_path / "second.html"
    assert main(["export", str(path), "-o", str(second)]) == 0
    assert _payload(second)["maps"] == _payload(first)["maps"]
    blocked = np.eye(300, dtype=bool)
    for head in range(2):
        weights = ds["weights"].isel(batch=0, head=head).values  # the cells themselves
        _assert_drawn(_payload(second), "diagonal", head, _pixel_max(weights, blocked, 300))
    capsys.readouterr()
    bad = tmp_path / "bad.html"
    assert main(["export", str(path), "-o", str(bad), "--masks", "diagonal", "sideways"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("attnpanel: error: mask 'sideways'") and error.count("\n") == 1
    assert "none, diagonal, causal" in error
    assert not bad.exists()


def test_the_cli_exports_one_layer_of_a_stacked_virtual_trace(tmp_path, capsys):
    torch.manual_seed(6)
    x = torch.randn(1, 200, 32)
    parts = [
        virtual.detach(
            attnpanel.trace(
                attnpanel.MultiHeadSelfAttention(32, 2, "diagonal").eval(), x, dense=False
            )
        )
        for _ in range(2)
    ]
    stacked = xr.concat(parts, "layer", coords="minimal", compat="override")
    stacked = virtual.attach(stacked.assign_coords(layer=["enc.0", "enc.1"]))
    path = attnpanel.save(stacked, tmp_path / "stacked.zarr")
    page = tmp_path / "layer1.html"
    assert main(["export", str(path), "-o", str(page), "--layer", "enc.1"]) == 0
    assert "layer enc.1, sample 0" in capsys.readouterr().out
    stored = sorted(p.name for p in overviews.folder_for(path).iterdir())
    assert stored == [f"layer1-sample0-head{h}-diagonal-480x480.zarr" for h in range(2)]
    blocked = np.eye(200, dtype=bool)
    for head in range(2):
        weights = stacked["weights"].isel(layer=1, batch=0, head=head).values
        _assert_drawn(_payload(page), "diagonal", head, _pixel_max(weights, blocked, 200))

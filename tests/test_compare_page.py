"""The comparison page (``explore(a, compare=b)``) and its offline report, against the models'
own attention: two checkpoints of the zoo's NILMFormer (its own attention code, diagonal
masking, 2 layers x 8 heads, L = 49), each map what the model computed for that head,
regridded the way the page regrids (``window_raster``), the heads ranked by the
Jensen-Shannon divergence of the models' own rows (``test_compare.long_way``)."""

from __future__ import annotations

import json
import re
from html import unescape

import numpy as np
import pytest
import xarray as xr
import zoo
from bokeh.document import Document
from test_compare import NUDGE, long_way, own_attention, second_checkpoint
from test_export import external_references

import attnpanel
from attnpanel.app.base import MISSING_RESOURCES
from attnpanel.app.compare_explorer import CompareExplorer
from attnpanel.app.sections.comparison import COMPARED_SIZE as SIZE
from attnpanel.readouts.raster import window_raster
from attnpanel.render.elements import PlotKey
from attnpanel.util.untrusted import page_title, shortened

NAME = "nilmformer_real"


@pytest.fixture(scope="module")
def pair():
    """Captures of two checkpoints on one batch, and each model's own weights by layer."""
    case = zoo.case(NAME)
    model, args, kwargs = case.build()
    other = second_checkpoint(model, NUDGE[NAME])
    a, b = (attnpanel.capture(m, *args, **kwargs) for m in (model, other))
    names = [str(n) for n in a["layer"].values]
    own = [own_attention(case, m, args, kwargs) for m in (model, other)]
    return a, b, [np.stack([found[n] for n in names]) for found in own]  # (layer, B, H, L, S)


@pytest.fixture(scope="module")
def page(pair):
    a, b, _ = pair
    explorer = attnpanel.explore(a, compare=b)
    explorer.__panel__().get_root(Document())
    return explorer


def expected(own: np.ndarray, layer: int, sample: int, head: int) -> np.ndarray:
    """A model's own weights of one head with the cells its mask blocked (the diagonal:
    NILMFormer's own masking) drawn as masked (NaN)."""
    weights = own[layer, sample, head].astype(np.float32)
    weights[np.eye(weights.shape[0], dtype=bool)] = np.nan
    return weights


def drawn_maps(page) -> dict[str, np.ndarray]:
    return {
        "a": page.drawn("a", "Attention"),
        "b": page.drawn("b", "Attention"),
        "difference": page.drawn("difference", "Difference"),
    }


LAYERS = ("EncoderBlock.0.attention_layer", "EncoderBlock.1.attention_layer")  # as captured


def long_way_ranking(own) -> tuple[list[tuple[int, int]], np.ndarray]:
    """``(layer, head)`` by the long way's divergence, most different first, and the
    divergences in that order."""
    weights_a, weights_b = own
    padded = np.zeros(weights_a.shape[1:4:2], dtype=bool)  # (batch, query): nothing padded
    js, _, _ = long_way(list(weights_a), list(weights_b), padded)
    order = np.argsort(-js, axis=None, kind="stable")
    return [tuple(int(i) for i in np.unravel_index(k, js.shape)) for k in order], np.sort(
        js, axis=None
    )[::-1]


def test_the_three_maps_are_each_models_own_attention(page, pair):
    _, _, (own_a, own_b) = pair
    order, _ = long_way_ranking((own_a, own_b))
    assert (page.layer, page.head) == order[0]  # the page opens on the most different head
    assert tuple(str(n) for n in pair[0]["layer"].values) == LAYERS
    for selection in ({}, {"sample": 1}, {"layer": 0, "head": 2}, {"sample": 0, "head": 7}):
        page.param.update(**selection)
        layer, sample, head = page.layer, page.sample, int(page.head)
        first, second = (expected(own, layer, sample, head) for own in (own_a, own_b))
        drawn = drawn_maps(page)
        # 49 positions on a 270 px frame: the page draws the cells themselves
        np.testing.assert_allclose(drawn["a"], window_raster(first, SIZE, SIZE)[0], atol=2e-6)
        np.testing.assert_allclose(drawn["b"], window_raster(second, SIZE, SIZE)[0], atol=2e-6)
        np.testing.assert_allclose(drawn["difference"], second - first, atol=2e-6)
        assert np.isnan(drawn["difference"][np.eye(49, dtype=bool)]).all()  # masked: black
        assert np.nanmax(np.abs(drawn["difference"])) > 1e-3  # the checkpoints differ
        where = f"sample {sample}, layer {LAYERS[layer]}, head {head}"  # (in lines that fit)
        assert " ".join(page.engine.title("a").split()) == f"A · {where}"
        assert " ".join(page.engine.title("difference").split()) == f"B − A · {where}"
    assert page.last_error == ""


def test_b_minus_a_is_centred_on_zero_and_a_runs_from_zero(page, pair):
    page.param.update(layer=1, head=3, sample=0)
    difference = page.engine.handles("difference", PlotKey("Image", "Difference"))[0]
    mapper = difference["color_mapper"]
    assert mapper.low == pytest.approx(-mapper.high) and mapper.high > 0
    assert "±p99.5" in difference["colorbar"].title
    weights = page.engine.handles("a", PlotKey("Image", "Attention"))[0]["color_mapper"]
    assert weights.low == 0.0 and weights.high > 0
    # a window where B attends more everywhere (one sign) is still centred on 0
    values = page.drawn("difference", "Difference")
    row, col = np.unravel_index(np.nanargmax(values), values.shape)
    page.linked.zoom((col - 0.4, col + 0.4), (row - 0.4, row + 0.4))
    try:
        assert page.drawn("difference", "Difference").shape == (1, 1)
        assert mapper.low == pytest.approx(-mapper.high) and mapper.high > 0
    finally:
        page.linked.zoom((-0.5, 48.5), (48.5, -0.5))


def test_two_equal_captures_draw_an_empty_difference_centred_on_zero(pair):
    a, _, _ = pair
    explorer = CompareExplorer(a, a.copy(deep=True))
    explorer.__panel__().get_root(Document())
    values = explorer.drawn("difference", "Difference")
    assert np.nanmax(np.abs(values)) == 0
    mapper = explorer.engine.handles("difference", PlotKey("Image", "Difference"))[0]
    assert mapper["color_mapper"].low == -mapper["color_mapper"].high


def test_the_ranking_is_the_order_of_the_divergence(page, pair):
    _, _, own = pair
    order, js = long_way_ranking(own)
    bars = page.engine.handles("ranking", PlotKey("Rectangles", "Ranking"))[0]["source"].data
    assert len(bars["right"]) == 16  # every head of the 2 layers
    np.testing.assert_allclose(bars["right"], js, rtol=1e-5, atol=1e-7)  # bar length: js
    assert list(bars["right"]) == sorted(bars["right"], reverse=True)
    assert [(int(r.layer), int(r.head)) for r in page.ranking.itertuples()] == order
    names = [f"layer {LAYERS[layer]}, head {head}" for layer, head in order]
    assert list(bars["name"]) == names
    ticks = page.engine.handles("ranking", PlotKey("Rectangles", "Ranking"))[0]["yaxis"]
    assert [ticks.major_label_overrides[float(i)] for i in range(16)] == names
    divergence = page.engine.handles("ranking", PlotKey("Rectangles", "Ranking"))[0]["xaxis"]
    assert divergence.formatter.use_scientific is False  # 0.0001, not 1.000e-4


def test_a_click_on_a_ranked_head_opens_it(page, pair):
    _, _, (own_a, own_b) = pair
    order, _ = long_way_ranking((own_a, own_b))
    page.param.update(sample=1)
    for rank in (5, 11, 0):
        page.sections["ranking"].click(x=0.001, y=rank + 0.2)  # the bar's row, as a tap sends
        layer, head = order[rank]
        assert (page.layer, int(page.head)) == (layer, head)
        assert page.widgets["head"].value == head and page.widgets["layer"].value == layer
        np.testing.assert_allclose(
            page.drawn("b", "Attention"), expected(own_b, layer, 1, head), atol=2e-6
        )
        outline = page.engine.handles("ranking", PlotKey("Rectangles", "Selected"))[0]
        assert list(outline["source"].data["bottom"]) == [rank - 0.5]  # the row outlined
        assert f"rank **{rank + 1}** of 16" in page.sections["maps"].caption.object
    page.sections["ranking"].click(x=0.001, y=40.0)  # below the last bar: nothing opens
    assert (page.layer, int(page.head)) == order[0]


def test_zoom_on_one_map_moves_and_re_rasterizes_the_other_two(page, pair):
    _, _, (own_a, own_b) = pair
    page.param.update(layer=0, head=4, sample=0)
    figures = {
        pane: page.engine.handles(pane, PlotKey("Image", group))[0]["plot"]
        for pane, group in (("a", "Attention"), ("b", "Attention"), ("difference", "Difference"))
    }
    figures["b"].x_range.start, figures["b"].x_range.end = 10.2, 30.7  # a zoom on B
    figures["b"].y_range.start, figures["b"].y_range.end = 20.4, 5.3
    try:
        for figure in figures.values():
            assert (figure.x_range.start, figure.x_range.end) == (10.2, 30.7)
            assert (figure.y_range.start, figure.y_range.end) == (20.4, 5.3)
        assert page.engine.window == ((10.2, 30.7), (20.4, 5.3))
        first, second = (expected(own, 0, 0, 4) for own in (own_a, own_b))
        for pane, full in (("a", first), ("b", second), ("difference", second - first)):
            handles = page.engine.handles(pane, next(iter(page.engine.plots(pane))))[0]
            data = handles["source"].data
            # the window's own cells (snapped outwards), not a magnified image
            cols = slice(round(data["x"][0] + 0.5), round(data["x"][0] + data["dw"][0] + 0.5))
            rows = slice(round(data["y"][0] + 0.5), round(data["y"][0] + data["dh"][0] + 0.5))
            assert (cols, rows) == (slice(10, 32), slice(5, 21))  # every cell it touches
            np.testing.assert_allclose(data["image"][0], full[rows, cols], atol=2e-6)
        page.param.update(head=6)  # a new head keeps the window
        first, second = (expected(own, 0, 0, 6) for own in (own_a, own_b))
        np.testing.assert_allclose(
            page.drawn("difference", "Difference"), (second - first)[5:21, 10:32], atol=2e-6
        )
    finally:
        page.linked.zoom((-0.5, 48.5), (48.5, -0.5))


def test_the_page_is_driven_by_its_state_and_names_its_captures(page):
    page.param.update(layer=1, head=0, sample=1)
    assert page.widgets["sample"].value == 1
    assert page.title == "TinyNILMFormer (float32) vs TinyNILMFormer (float32)"
    long = "NILMFormer demo (nilmformer.pt), encoder layer 2 of 3, 32 held-out windows"
    assert shortened(long, 60) == "NILMFormer demo (nilmformer.pt), encoder layer 2 of 3, 32…"
    assert shortened("short", 60) == "short"
    source = "NILMFormer demo (nilmformer.pt), layer encoder.2.attention of 3 encoder layers, 32"
    assert page_title(source + " held-out windows, and a long tail of words", 90) == (
        f"attnpanel · {source}…"  # at a word's end, never mid-word or at a comma
    )
    assert page_title("") == "attnpanel"
    caption = page.sections["maps"].caption.object
    assert caption.startswith(r"layer EncoderBlock\.1\.attention\_layer, head 0: rank")
    assert set(page.URL_PARAMS) == {"sample", "layer", "head"}
    with pytest.raises(ValueError):
        page.head = "mean"  # one head at a time


def test_paths_open_and_what_cannot_be_compared_is_refused(pair, tmp_path):
    a, b, _ = pair
    paths = [attnpanel.save(ds, tmp_path / f"{name}.nc") for name, ds in (("a", a), ("b", b))]
    explorer = attnpanel.explore(paths[0], compare=paths[1], head=2, layer=0)
    assert isinstance(explorer, CompareExplorer)
    assert (explorer.layer, explorer.head) == (0, 2)
    with pytest.raises(ValueError, match="differ in shape: 8 heads in a, 7 in b"):
        attnpanel.explore(a, compare=b.isel(head=slice(0, 7)))
    with pytest.raises(ValueError, match="one head at a time"):
        attnpanel.explore(a, compare=b, head="mean")
    tree = xr.DataTree.from_dict({"/encoder": a})
    with pytest.raises(ValueError, match="DataTree"):
        attnpanel.explore(tree, compare=b)
    with pytest.raises(TypeError, match="compare two traces"):
        attnpanel.explore(a, compare=np.zeros(3))


def document_texts(html: str, markup_only: bool = False) -> list[str]:
    """Every text of a standalone Bokeh page (its Divs' HTML, its plots' titles), read from
    the document the page embeds; ``markup_only``: only the texts a browser reads as HTML
    (not a plot's title, which Bokeh draws as plain text)."""
    found = re.search(
        r'<script type="application/json" id="[^"]+">\s*(.*?)\s*</script>', html, re.S
    )
    texts = []

    def walk(node, model=""):
        if isinstance(node, dict):
            model = node.get("name", model) if node.get("type") == "object" else model
            for key, value in node.items():
                if key == "text" and isinstance(value, str):
                    if not (markup_only and model == "Title"):
                        texts.append(unescape(value))  # Bokeh escapes the embedded document
                else:
                    walk(value, model)
        elif isinstance(node, list):
            for value in node:
                walk(value, model)

    walk(json.loads(found.group(1)))
    return texts


def test_the_offline_report_holds_the_ranking_and_the_top_heads_maps(page, pair, tmp_path):
    _, _, own = pair
    order, js = long_way_ranking(own)
    page.param.update(sample=1)
    path = page.save(tmp_path / "report.html", heads=3)
    html = path.read_text()
    assert html.lower().startswith("<!doctype html")
    assert external_references(html) == []  # no tag loads another file: the scripts are inline
    texts = document_texts(html)
    table = next(t for t in texts if "<table>" in t)
    # every head in the table, most different first, with its divergence
    names = re.findall(r"<td>\d+</td><td>(layer [^<]+, head \d)</td><td>([0-9.e-]+)</td>", table)
    assert [n for n, _ in names] == [f"layer {LAYERS[la]}, head {h}" for la, h in order]
    np.testing.assert_allclose([float(v) for _, v in names], js, rtol=1e-3)
    assert table.count('class="drawn"') == 3
    headings = [t for t in texts if t.startswith("<h3>")]
    assert len(headings) == 3
    for rank, (layer, head) in enumerate(order[:3], start=1):
        name = f"layer {LAYERS[layer]}, head {head}"
        assert headings[rank - 1].startswith(f"<h3>{rank}. {name}</h3>")
        for which in ("A", "B", "B − A"):
            assert f"{which} · sample 1, {name}" in [t.replace(",\n", ", ") for t in texts]


def test_serve_compares_two_saved_traces_of_the_same_inputs(pair, tmp_path, capsys):
    from attnpanel.cli.main import main

    a, b, _ = pair
    first, second, fewer = (
        attnpanel.save(ds, tmp_path / f"{name}.nc")
        for name, ds in (("a", a), ("b", b), ("fewer", b.isel(batch=[0])))
    )
    assert main(["serve", "--compare", str(second)]) == 2
    assert "--compare B compares a saved trace A with B" in capsys.readouterr().err
    assert main(["serve", str(first), "--compare", str(fewer)]) == 2
    assert "differ in shape: 2 samples in a, 1 in b" in capsys.readouterr().err


def test_a_notebook_composes_b_minus_a_centred_on_zero(page):
    import holoviews as hv

    page.param.update(layer=1, head=5, sample=0)
    figure = hv.render(page.dynamic_map("difference map"))  # rasterized by datashader
    mapper = next(r.glyph.color_mapper for r in figure.renderers if hasattr(r.glyph, "image"))
    drawn = page.drawn("difference", "Difference")
    assert mapper.low == pytest.approx(-mapper.high)
    assert mapper.high == pytest.approx(np.nanmax(np.abs(drawn)), rel=1e-6)


def test_a_notebook_shows_it_and_hostile_names_stay_text(tmp_path):
    """A capture whose strings are scripts: its source names A and B on the page and in the
    report, as text (tests/test_untrusted.py shows the same capture's explorer)."""
    import panel as pn
    from hostile import SOURCE, hostile_capture

    pn.extension()
    first = hostile_capture()
    explorer = attnpanel.explore(first, compare=first.copy(deep=True))
    data, _metadata = explorer._repr_mimebundle_()
    html = data["text/html"]
    assert html.startswith(MISSING_RESOURCES)  # a note of our own, then Panel's output
    html = html.removeprefix(MISSING_RESOURCES)
    assert html.lower().count("</script") == 1 and html.endswith("</script>")
    assert SOURCE not in html  # the markdown holds it escaped, never as markup
    about = explorer.sections["maps"].__panel__()[1].object  # what A and B are
    assert "<img" not in about and "&lt;img src=x onerror=alert" in about
    saved = explorer.save(tmp_path / "hostile.html").read_text()
    texts = document_texts(saved, markup_only=True)
    header = texts[0]
    assert "<img" not in header and "&lt;img src=x onerror=alert(1)&gt;" in header
    assert not any("<script>" in text or "<svg" in text for text in texts)
    titles = set(document_texts(saved)) - set(texts)  # drawn as text: the name as it is
    assert any("layer blocks.<svg onload=alert(7)>, head 0" in title for title in titles)

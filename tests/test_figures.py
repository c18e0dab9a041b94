"""Figures for papers (attnpanel.render.paper): each view written as SVG, PDF and PNG
draws the numbers the page draws for the same state, and the files are what they say."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import numpy as np
import pytest
from bokeh.document import Document
from drawn import shown_matrix

import attnpanel
from attnpanel.cli import main
from attnpanel.nilm.demo import demo_model_run
from attnpanel.readouts import core, model_map
from attnpanel.render import paper

WINDOWS = 2


@pytest.fixture(scope="module")
def page():
    run = demo_model_run(n_windows=WINDOWS)
    explorer = attnpanel.explore(attnpanel.demo(n_windows=WINDOWS), model=run)
    explorer.__panel__().get_root(Document())
    return explorer


def check_files(path_stem, element) -> None:
    """The element as SVG (valid XML, an svg root), PDF (its header, pages, trailer) and
    PNG (its signature)."""
    svg = paper.write_figure(element, f"{path_stem}.svg")
    root = ET.parse(svg).getroot()
    assert root.tag.endswith("svg")
    assert any(e.tag.endswith("image") or e.tag.endswith("path") for e in root.iter())
    pdf = paper.write_figure(element, f"{path_stem}.pdf").read_bytes()
    assert pdf.startswith(b"%PDF-") and b"/Type /Page" in pdf and pdf.rstrip().endswith(b"%%EOF")
    png = paper.write_figure(element, f"{path_stem}.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")


def test_the_matrix_figure_draws_the_pages_matrix_in_every_state(page, tmp_path):
    for state in (
        dict(sample=1, head=3, mask="causal", stage="raw"),
        dict(sample=0, head=5, mask="diagonal", stage="softmax"),
    ):
        with page.engine.drawing_now():
            page.param.update(**state)
        element = paper.view_of("matrix", page.trace, page.selection)
        np.testing.assert_array_equal(paper.data_of(element), shown_matrix(page))
        [axes] = paper.maps_of(element)
        assert axes.get_title() == core.matrix_title(page.trace, page.selection)
        assert (axes.get_xlabel(), axes.get_ylabel()) == ("key", "query")
    written = page.figure("matrix", tmp_path / "matrix.svg")
    assert ET.parse(written).getroot().tag.endswith("svg")
    check_files(tmp_path / "m", element)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        page.figure("matrix", tmp_path / "matrix.svg")


def test_the_heads_figure_is_each_heads_own_weights(page, tmp_path):
    with page.engine.drawing_now():
        page.param.update(sample=1, head=0, mask="diagonal", stage="softmax")
    element = paper.view_of("heads", page.trace, page.selection)
    drawn = paper.data_of(element)
    weights = page.trace["weights"].isel(batch=1).values
    blocked = np.eye(480, dtype=bool)
    assert drawn.shape == weights.shape
    np.testing.assert_allclose(drawn[:, ~blocked], weights[:, ~blocked], rtol=1e-6)
    assert np.isnan(drawn[:, blocked]).all()  # blocked by the mask: left blank
    check_files(tmp_path / "h", element)


def colour_bars(figure) -> int:
    """How many colour bars a figure has (axes beside the maps that draw none)."""
    return sum(1 for axes in figure.axes if not axes.get_images())


def test_each_head_has_its_own_colour_scale_and_axes_and_its_map_is_square(page):
    """On one scale (0 to 0.145 on the demo) seven of the eight heads looked uniformly
    dark, and the maps had no axes: each head is now on its own scale, its bar beside it
    (or, asked, one scale stated in the title), with clock ticks, and each map square."""
    with page.engine.drawing_now():
        page.param.update(sample=1, head=0, mask="diagonal", stage="softmax")
    figure = paper.view_of("heads", page.trace, page.selection)
    weights = np.where(np.eye(480, dtype=bool), np.nan, page.trace["weights"].isel(batch=1).values)
    clock = core.clock_labels(page.trace, 1)  # the sample's own clock, as the page's axes
    ticks = [clock[i] for i in range(0, 480, 160)]
    maps = paper.maps_of(figure)
    assert len(maps) == 8 and colour_bars(figure) == 8
    for head, axes in enumerate(maps):
        own = (np.nanmin(weights[head]), np.nanmax(weights[head]))
        np.testing.assert_allclose(axes.get_images()[0].get_clim(), own, rtol=1e-6)
        assert axes.get_title() == f"head {head}"
    highs = [axes.get_images()[0].get_clim()[1] for axes in maps]
    assert max(highs) > 2 * min(highs)  # what one scale for every head hid
    title = figure.get_suptitle()
    assert title.endswith("; each head on its own colour scale"), title
    shared = paper.view_of("heads", page.trace, page.selection, scale="shared")
    limits = {tuple(axes.get_images()[0].get_clim()) for axes in paper.maps_of(shared)}
    assert len(limits) == 1 and colour_bars(shared) == 1
    low, high = limits.pop()
    assert shared.get_suptitle().endswith(
        f"one colour scale for every head, {low:.3g} to {high:.3g}"
    )
    figure.draw_without_rendering()  # laid out as written
    for index, axes in enumerate(maps):
        box = axes.get_window_extent()
        assert abs(box.width / box.height - 1) < 0.02, (box.width, box.height)
        assert axes.get_ylabel() == ("query" if index % 4 == 0 else "")  # once, at the left
        assert axes.get_xlabel() == ("key" if index >= 4 else "")  # once, at the bottom
        assert [t.get_text() for t in axes.get_xticklabels()] == ticks
    with pytest.raises(ValueError, match="scale 'loud': one of own, shared"):
        paper.view_of("heads", page.trace, page.selection, scale="loud")


def test_the_importance_figure_is_the_pages_map(page, tmp_path):
    with page.engine.drawing_now():
        page.param.update(sample=1)
    shown = page.drawn("importance", "Importance")
    ranking = page.model.importance(1)
    element = paper.view_of("importance", page.trace, page.selection, ranking=ranking)
    np.testing.assert_allclose(paper.data_of(element), shown, rtol=1e-6)
    [axes] = paper.maps_of(element)
    names = [t.get_text() for t in axes.get_yticklabels()]
    assert names == [f"encoder.{i}.attention" for i in range(3)]
    check_files(tmp_path / "i", element)
    assert page.figure("importance", tmp_path / "importance.pdf").read_bytes()[:5] == b"%PDF-"


def test_the_model_figure_is_every_layer_and_head(tmp_path):
    from zoo import case

    model, args, kwargs = case("nanogpt_sdpa_causal").build()
    capture = attnpanel.capture(model, *args, **kwargs)
    sel = core.Selection(sample=0)
    element = paper.view_of("model", capture.isel(layer=0), sel, stacked=capture)
    mosaic = model_map.model_mosaic(capture, sel).values
    np.testing.assert_array_equal(paper.data_of(element), mosaic)
    check_files(tmp_path / "model", element)
    one = paper.view_of("model", capture.isel(layer=0), sel)  # a trace of one layer: its row
    np.testing.assert_array_equal(
        paper.data_of(one), model_map.model_mosaic(capture.isel(layer=0), sel).values
    )
    layer = str(capture["layer"].values[0])
    assert paper.maps_of(one)[0].get_title().startswith(f"sample 0: every head of {layer}")
    one.draw_without_rendering()
    box = paper.maps_of(one)[0].get_window_extent()
    heads = capture.sizes["head"]
    assert abs(box.width / box.height - heads) < 0.05 * heads  # each map square


def test_the_figure_command(tmp_path, capsys):
    path = tmp_path / "demo.nc"
    attnpanel.save(attnpanel.demo(n_windows=WINDOWS), str(path))
    out = tmp_path / "fig.pdf"
    args = ["figure", str(path), "--view", "matrix", "--sample", "1", "--head", "2"]
    assert main([*args, "--stage", "scaled", "-o", str(out)]) in (0, None)
    said = capsys.readouterr().out
    assert said.startswith(f"wrote {out}: matrix, layer encoder.2.attention, sample 1")
    assert out.read_bytes().startswith(b"%PDF-")
    assert main([*args, "-o", str(out)]) == 2
    assert "add --force" in capsys.readouterr().err
    # one sample read alone: its own numbers, its own number in every title
    trace = attnpanel.load(path)
    sel = core.Selection(sample=1, head=2, stage="scaled")
    alone = paper.view_of(
        "matrix", attnpanel.load(path, samples=[1]), sel.with_(sample=0), number=1
    )
    np.testing.assert_array_equal(paper.data_of(alone), core.attention_values(trace, sel))
    assert paper.maps_of(alone)[0].get_title() == core.matrix_title(trace, sel)
    heads = paper.view_of("heads", attnpanel.load(path, samples=[1]), sel.with_(sample=0), number=1)
    assert heads.get_suptitle().startswith("sample 1: every head")
    assert main([*args[:4], "--sample", "9", "-o", str(tmp_path / "x.svg")]) == 2
    assert "--sample 9 is out of range: the trace has 2 samples, 0 to 1" in capsys.readouterr().err
    assert main([*args, "-o", str(tmp_path / "fig.jpg")]) == 2
    assert "a figure is written as .svg, .pdf or .png" in capsys.readouterr().err
    assert main([*args[:4], "--head", "9", "-o", str(tmp_path / "x.svg")]) == 2
    assert "--head 9 is out of range" in capsys.readouterr().err
    assert main(["figure", str(path), "--view", "model", "-o", str(tmp_path / "m.svg")]) == 0
    assert "wrote" in capsys.readouterr().out  # the README's demo file: its layer's heads
    assert main(["figure", str(path), "--view", "importance", "-o", str(tmp_path / "i.svg")]) == 2
    assert "--view importance takes a head ranking" in capsys.readouterr().err

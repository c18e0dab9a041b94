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
from attnpanel.readouts import core
from attnpanel.render import model_views, paper

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
        assert element.opts.get("plot", "matplotlib").kwargs["title"] == core.matrix_title(
            page.trace, page.selection
        )
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


def test_the_importance_figure_is_the_pages_map(page, tmp_path):
    with page.engine.drawing_now():
        page.param.update(sample=1)
    shown = page.drawn("importance", "Importance")
    ranking = page.model.importance(1)
    element = paper.view_of("importance", page.trace, page.selection, ranking=ranking)
    np.testing.assert_allclose(paper.data_of(element), shown, rtol=1e-6)
    ticks = element.opts.get("plot", "matplotlib").kwargs["yticks"]
    assert [name for _, name in ticks] == [f"encoder.{i}.attention" for i in range(3)]
    check_files(tmp_path / "i", element)
    assert page.figure("importance", tmp_path / "importance.pdf").read_bytes()[:5] == b"%PDF-"


def test_the_model_figure_is_every_layer_and_head(tmp_path):
    from zoo import case

    model, args, kwargs = case("nanogpt_sdpa_causal").build()
    capture = attnpanel.capture(model, *args, **kwargs)
    sel = core.Selection(sample=0)
    element = paper.view_of("model", capture.isel(layer=0), sel, stacked=capture)
    mosaic = model_views.model_mosaic(capture, sel).values
    np.testing.assert_array_equal(paper.data_of(element), mosaic)
    check_files(tmp_path / "model", element)
    with pytest.raises(ValueError, match="several layers"):
        paper.view_of("model", capture.isel(layer=0), sel)


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
    assert main([*args, "-o", str(tmp_path / "fig.jpg")]) == 2
    assert "a figure is written as .svg, .pdf or .png" in capsys.readouterr().err
    assert main([*args[:4], "--head", "9", "-o", str(tmp_path / "x.svg")]) == 2
    assert "--head 9 is out of range" in capsys.readouterr().err
    assert main(["figure", str(path), "--view", "model", "-o", str(tmp_path / "m.svg")]) == 2
    assert "several layers" in capsys.readouterr().err
    assert main(["figure", str(path), "--view", "importance", "-o", str(tmp_path / "i.svg")]) == 2
    assert "--view importance takes a head ranking" in capsys.readouterr().err

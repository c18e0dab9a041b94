"""The pages the benchmarks serve beside the explorer are what they say they are (the suite
runs no benchmark: a page that drifted from the explorer would go unseen)."""

from __future__ import annotations

import runpy
from pathlib import Path

import numpy as np
import panel as pn
import pytest
from bokeh.models import ColumnDataSource, Plot
from bokeh.settings import settings

from attnpanel.app.explorer import AttentionExplorer

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def sources_and_titles(explorer):
    """Every figure's data source, and the figures' titles, of an explorer's page."""
    sources, titles = {}, []
    for pane in explorer.lay_out().select(pn.pane.Bokeh):
        for model in pane.object.references():
            if isinstance(model, ColumnDataSource):
                sources[model.id] = model
            if isinstance(model, Plot) and model.title is not None:
                titles.append(model.title.text)
    return list(sources.values()), sorted(titles)


@pytest.fixture
def app_settings(monkeypatch):
    """What an app file sets for its server (``pn.extension``'s options, Bokeh's document
    validation), put back after the test: an exception handler left set would swallow the
    errors of every later test's callbacks."""
    for name in ("exception_handler", "notifications", "inline"):
        monkeypatch.setattr(pn.config, name, getattr(pn.config, name))
    validation = settings.perform_document_validation
    before = validation()
    yield
    validation.set_value(before)


def test_the_skeleton_page_is_the_readmes_page_with_its_data_cut_to_two_points(app_settings):
    """``benchmarks/skeleton_app.py``: the same sections and figures as the explorer it
    is built from, every column of every figure's source two entries long at most."""
    found = runpy.run_path(str(BENCHMARKS / "skeleton_app.py"))
    assert isinstance(found["page"], AttentionExplorer)  # what it serves
    # the page's first sections (those below the fold are drawn after the first paint)
    skeleton = found["skeleton"](found["trace"], found["model"])
    full = AttentionExplorer.built(found["trace"], model=found["model"])
    cut, cut_titles = sources_and_titles(skeleton)
    whole, titles = sources_and_titles(full)
    assert cut_titles == titles and len(cut) == len(whole) > 10
    longest = max(len(column) for source in whole for column in source.data.values())
    assert longest >= 480  # a sample's curve
    for source in cut:
        for column in source.data.values():
            assert len(column) <= 2
            for item in column:
                if isinstance(item, np.ndarray):
                    assert item.size <= 4  # an image: 2 x 2 cells

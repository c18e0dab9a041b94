"""One entry, one family: ``attnpanel.explore`` opens every kind of capture, and the kinds
share one base (``attnpanel.app.base``) and declare what they add."""

from __future__ import annotations

import subprocess
import sys

import panel as pn
import pytest
import torch
import xarray as xr
import zoo

import attnpanel
from attnpanel.app.base import Explorer, LayerExplorer
from attnpanel.app.explorer import AttentionExplorer
from attnpanel.app.groups_explorer import GroupsExplorer
from attnpanel.app.long_explorer import LongExplorer
from attnpanel.app.sections.long import LongHeads, QueryRow, WindowedMatrix
from attnpanel.app.sources import VirtualSource
from attnpanel.traces import layers
from attnpanel.traces.overviews import folder_for
from attnpanel.util import untrusted


@pytest.fixture(scope="module")
def layer():
    torch.manual_seed(0)
    return attnpanel.MultiHeadSelfAttention(16, 4, mask="causal").eval(), torch.randn(2, 40, 16)


def test_a_dataset_opens_the_dense_explorer(layer):
    ds = attnpanel.trace(*layer)
    explorer = attnpanel.explore(ds, head=2)
    assert type(explorer) is AttentionExplorer and explorer.head == 2
    assert isinstance(explorer, LayerExplorer) and isinstance(explorer, Explorer)


def test_a_virtual_trace_opens_the_long_explorer_with_a_typed_source(layer):
    lazy = attnpanel.trace(*layer, dense=False)
    explorer = attnpanel.explore(lazy)
    assert type(explorer) is LongExplorer and isinstance(explorer, LayerExplorer)
    readers = [s for s in explorer.sections.values() if "source" in s.param]
    assert {type(s) for s in readers} == {QueryRow, WindowedMatrix, LongHeads}
    assert all(isinstance(s.source, VirtualSource) and s.source is explorer.source for s in readers)


def test_an_encoder_decoder_datatree_opens_one_explorer_per_group():
    case = zoo.case("torch_transformer")
    model, args, kwargs = case.build()
    tree = attnpanel.capture(model, *args, **kwargs)
    assert isinstance(tree, xr.DataTree)
    explorer = attnpanel.explore(tree)
    assert type(explorer) is GroupsExplorer and isinstance(explorer, Explorer)
    assert isinstance(explorer.explorer, AttentionExplorer)
    # the page's heading first, above the picker of every group's layers; the shown
    # group's part headed by the group (the picker sat above the page's heading)
    page = explorer.__panel__()
    assert page.objects[0].object.startswith("## attnpanel · ")
    assert page.objects[1].name == "Layer (every group)"
    group = explorer.explorer.__panel__().objects[0].object
    count = sum(entry.group == explorer.group for entry in layers.layers(tree))
    assert count == 2  # the encoder's two layers, not the shown one alone
    assert group == f"### group {untrusted.markup(explorer.group)} ({count} layers)"
    # one layer menu on the page: the group's own (its layers alone) is the picker's double
    menus = [w for w in page.select(pn.widgets.Select) if w.name.startswith("Layer") and w.visible]
    assert [w.name for w in menus] == ["Layer (every group)"]
    assert "layer" in explorer.explorer.widgets  # (hidden, not missing: it follows the picker)


@pytest.mark.parametrize("suffix", [".nc", ".zarr"])
def test_a_path_is_read_and_a_virtual_trace_keeps_its_overviews_beside_it(layer, tmp_path, suffix):
    dense = attnpanel.save(attnpanel.trace(*layer), tmp_path / f"dense{suffix}")
    assert type(attnpanel.explore(dense)) is AttentionExplorer
    assert type(attnpanel.explore(str(dense))) is AttentionExplorer
    lazy = attnpanel.save(attnpanel.trace(*layer, dense=False), tmp_path / f"lazy{suffix}")
    explorer = attnpanel.explore(lazy)
    assert type(explorer) is LongExplorer
    assert explorer.overviews.folder == folder_for(lazy)


def test_what_is_not_a_trace_is_refused_by_name():
    with pytest.raises(TypeError, match="not int"):
        attnpanel.explore(42)
    with pytest.raises(FileNotFoundError, match="no trace at"):
        attnpanel.explore("no-such-trace.nc")


def test_import_attnpanel_leaves_the_explorer_out_until_it_is_asked_for():
    code = (
        "import sys, attnpanel\n"
        "assert 'panel' not in sys.modules and 'holoviews' not in sys.modules\n"
        "assert 'explore' in attnpanel.__all__\n"
        "attnpanel.explore\n"
        "assert 'panel' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

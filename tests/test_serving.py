"""What served sessions share: one read-only trace per process, never written by a session."""

from __future__ import annotations

import hashlib

import numpy as np
import panel as pn
import pytest
import torch
from bokeh.document import Document
from test_explorer import make_trace
from zoo import build_torch_transformer

import attnpanel
from attnpanel import serving
from attnpanel.explorer import AttentionExplorer, explore


def digest(ds) -> str:
    """A hash of every array of a trace, to see that nothing changed it."""
    found = hashlib.sha256()
    for name in sorted(ds.variables):
        found.update(name.encode())
        found.update(np.ascontiguousarray(ds[name].values).tobytes())
    return found.hexdigest()


def test_freeze_makes_every_array_read_only():
    ds = serving.freeze(make_trace(n_batch=1))
    for name, var in ds.variables.items():
        assert not var.data.flags.writeable, name
    with pytest.raises(ValueError, match="read-only"):
        ds["weights"].values[0, 0, 0, 0] = 2.0


def test_freeze_reaches_every_group_of_a_data_tree():
    model, args, kwargs = build_torch_transformer()
    tree = serving.freeze(attnpanel.capture(model, *args, **kwargs))
    for node in tree.subtree:
        for var in node.dataset.variables.values():
            assert not var.data.flags.writeable


def test_shared_trace_is_built_once_per_process():
    built = []

    def build():
        built.append(1)
        return make_trace(n_batch=1)

    key = f"test-{id(built)}"
    try:
        first = serving.shared_trace(key, build)
        second = serving.shared_trace(key, build)
    finally:
        pn.state.clear_caches()
    assert first is second and built == [1]
    assert not first["weights"].values.flags.writeable


def test_an_explorer_on_a_shared_trace_never_writes_to_it():
    """Every control of a session, on a frozen trace: a write would raise, and the arrays
    every other session reads are unchanged."""
    ds = serving.freeze(make_trace())
    before = digest(ds)
    explorer = AttentionExplorer(ds)
    explorer.__panel__().get_root(Document())
    for change in (
        dict(mask="causal"),
        dict(stage="scaled", head=3),
        dict(stage="masked", head="mean"),
        dict(sample=1, query=17),
        dict(enabled_heads=[0, 2, 5], side_by_side=True),
        dict(show_head_average=True, colormap="viridis"),
    ):
        explorer.param.update(**change)
        assert explorer.last_error == "", (change, explorer.last_error)
    assert digest(ds) == before


def test_sessions_on_one_capture_with_several_layers_do_not_see_each_other():
    torch.manual_seed(0)
    model, args, kwargs = build_torch_transformer()
    tree = serving.freeze(attnpanel.capture(model, *args, **kwargs))
    first, second = explore(tree), explore(tree)
    for session in (first, second):
        session.__panel__()
    first.layer = first.param.layer.objects[-1]  # a cross-attention layer
    assert second.layer == second.param.layer.objects[0]
    assert second.explorer.trace.sizes["query"] == 10  # still the encoder's 10 x 10
    assert first.explorer.trace.sizes["query"] == 7

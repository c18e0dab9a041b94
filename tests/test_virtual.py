"""Virtual traces (attnpanel.traces.virtual): lse instead of the maps, the maps lazy and exact.

Every check compares the virtual form with the dense form of the same layer and input:
the model's own weights, scores, context and output.
"""

from __future__ import annotations

import dask
import numerics
import numpy as np
import pytest
import torch
import xarray as xr
from pairs import padded_pair

from attnpanel.kernels import attention, masks, memory
from attnpanel.kernels.attention import MultiHeadSelfAttention
from attnpanel.traces import io, virtual
from attnpanel.traces.build import trace
from attnpanel.traces.validate import validate

MODES = ("none", "diagonal", "causal")


def _layer(mode: str, seed: int = 0) -> MultiHeadSelfAttention:
    torch.manual_seed(seed)
    return MultiHeadSelfAttention(48, 4, mode).eval()


def _input(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, length, 48, generator=torch.Generator().manual_seed(seed)) * 2


@pytest.mark.parametrize("mode", MODES)
def test_a_virtual_trace_holds_the_dense_traces_numbers(mode):
    layer, x = _layer(mode), _input(2, 700)
    dense = trace(layer, x, dense=True)
    lazy = trace(layer, x, dense=False)
    assert virtual.is_virtual(lazy) and not virtual.is_virtual(dense)
    assert "lse" in lazy and lazy["lse"].dims == ("batch", "head", "query")
    for name in ("weights", "scores"):
        assert lazy[name].dims == dense[name].dims and lazy[name].chunks is not None
    # tiles from the fused kernel's lse against the dense softmax: two kernels
    numerics.assert_kernels_agree(
        lazy["weights"], dense["weights"], logits=numerics.trace_logits(dense)
    )
    numerics.assert_products_agree(lazy["scores"], dense["scores"], terms=12)  # q . k, E = 12
    for name in ("q", "k", "v", "x", "w_o"):
        np.testing.assert_array_equal(lazy[name].values, dense[name].values)
    for name in ("context", "output"):
        np.testing.assert_allclose(lazy[name].values, dense[name].values, rtol=0, atol=1e-5)
    if mode != "none":
        blocked = masks.build_mask(mode, 700).numpy()
        assert (lazy["weights"].isel(batch=1, head=2).values[blocked] == 0).all()
    assert lazy.attrs["mask"] == mode and validate(lazy) is lazy


def test_a_window_computes_only_its_chunks():
    layer, x = _layer("diagonal"), _input(1, 3000)
    lazy = trace(layer, x, dense=False)
    window = lazy["weights"].isel(batch=0, head=1, query=slice(1200, 1300), key=slice(0, 50))
    # of the 3 x 3 chunks of 1024 x 1024 (per head), one tile is computed, then sliced
    (culled,) = dask.optimize(window.data)
    assert len(dict(culled.__dask_graph__())) == 2
    dense = trace(layer, x, dense=True)["weights"].isel(
        batch=0, head=1, query=slice(1200, 1300), key=slice(0, 50)
    )
    numerics.assert_kernels_agree(window, dense, logits=numerics.trace_logits(lazy))


def test_the_form_is_chosen_by_size(monkeypatch):
    layer, x = _layer("diagonal"), _input(2, 64)
    assert not virtual.is_virtual(trace(layer, x))  # 2 x 4 x 64 x 64: dense
    needed = virtual.dense_bytes(2, 4, 64, 64)
    monkeypatch.setattr(virtual, "DENSE_MAX_BYTES", needed - 1)
    assert virtual.is_virtual(trace(layer, x))
    assert not virtual.is_virtual(trace(layer, x, dense=True))  # overridable both ways
    monkeypatch.setattr(virtual, "DENSE_MAX_BYTES", needed)
    assert not virtual.is_virtual(trace(layer, x))
    assert virtual.is_virtual(trace(layer, x, dense=False))


@pytest.mark.parametrize("suffix", [".nc", ".zarr"])
def test_a_file_stores_lse_and_reading_gives_the_maps_back(tmp_path, suffix):
    layer, x = _layer("causal"), _input(2, 300)
    lazy = trace(layer, x, dense=False)
    path = io.save(lazy, tmp_path / f"trace{suffix}")
    engine = dict(engine="h5netcdf") if suffix == ".nc" else dict(engine="zarr")
    with xr.open_dataset(path, **engine) as raw:
        assert "lse" in raw and "weights" not in raw and "scores" not in raw
    dense = trace(layer, x, dense=True)
    for lazy_read in (False, True):
        back = io.load(path, lazy=lazy_read)
        assert virtual.is_virtual(back)
        numerics.assert_kernels_agree(
            back["weights"], dense["weights"], logits=numerics.trace_logits(dense)
        )


def test_a_wrong_lse_is_refused_naming_the_row(tmp_path):
    layer, x = _layer("diagonal"), _input(1, 200)
    lazy = trace(layer, x, dense=False)
    bad = virtual.detach(lazy)
    bad["lse"] = bad["lse"] + 0.01  # every row's weights would sum to 0.99
    with pytest.raises(ValueError, match=r"lse at batch=0, head=0, query=0 .* sum to 0\.99"):
        validate(virtual.attach(bad))
    with pytest.raises(ValueError, match="lse at batch=0"):
        io.save(virtual.attach(bad), tmp_path / "bad.nc")
    assert not (tmp_path / "bad.nc").exists()
    io.save(lazy, tmp_path / "good.nc")
    with xr.open_dataset(tmp_path / "good.nc", engine="h5netcdf") as raw:
        tampered = raw.load()
    tampered["lse"][0, 0, 0] = np.nan
    tampered.to_netcdf(tmp_path / "nan.nc", engine="h5netcdf")
    with pytest.raises(ValueError, match="lse contains NaN at batch=0, head=0, query=0"):
        io.load(tmp_path / "nan.nc")


def test_a_custom_mask_needs_the_dense_form():
    mask = torch.zeros(50, 50, dtype=torch.bool)
    mask[:, :3] = True
    layer = MultiHeadSelfAttention(48, 4, mask).eval()
    with pytest.raises(ValueError, match="custom .* mask tensor .* dense=True"):
        trace(layer, _input(1, 50), dense=False)
    assert "weights" in trace(layer, _input(1, 50))


def test_projections_that_cannot_fit_are_refused_with_the_numbers(monkeypatch):
    monkeypatch.setattr(memory, "MAX_ATTENTION_BYTES", 2**20)  # 1 MiB may be used
    layer = _layer("diagonal")
    with pytest.raises(ValueError, match=r"a sequence of 4,000 positions .* GiB .* 0.000977 GiB"):
        trace(layer, _input(1, 4000), dense=False)


@pytest.mark.parametrize("mode", MODES)
def test_the_layer_runs_in_bounded_memory_at_long_lengths(mode, monkeypatch):
    """forward() at inference from BOUNDED_LENGTH on: the fused kernel's output, without
    the (L, L) mask it would take."""
    layer, x = _layer(mode), _input(2, 400)
    with torch.no_grad():
        fused = layer(x)
        monkeypatch.setattr(attention, "BOUNDED_LENGTH", 300)
        for name in ("blocked", "allowed"):  # any (L, L) mask asked for now fails
            monkeypatch.setattr(layer, name, None)
        bounded = layer(x)
    np.testing.assert_allclose(bounded.numpy(), fused.numpy(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("stage", ["raw", "scaled", "masked", "softmax"])
@pytest.mark.parametrize("mode", [None, *MODES])
def test_every_stage_and_mask_of_a_virtual_trace_is_the_dense_ones(stage, mode):
    """The stage player and the mask switch on a virtual trace: lazy arrays equal to the
    dense recomputation, the per-sample padding kept, blocked weights exactly 0."""
    from attnpanel.traces.stages import attention_stage, recompute_weights

    dense, lazy = padded_pair()
    assert virtual.is_virtual(lazy) and "padding" in lazy
    for batch, head in [(None, None), (1, None), (1, 2), (0, 1)]:
        found = attention_stage(lazy, stage, mode, batch=batch, head=head)
        expected = attention_stage(dense, stage, mode, batch=batch, head=head)
        assert found.chunks is not None and found.dims == expected.dims
        if stage == "softmax":
            logits = numerics.trace_logits(dense, mode)
            numerics.assert_kernels_agree(found, expected, logits=logits)
        else:  # scores of E = 12 products, the masked ones at -1e4: 1e-5 is ~100 ulps of 1
            np.testing.assert_allclose(found.values, expected.values, rtol=0, atol=1e-5)
        if stage == "softmax":
            np.testing.assert_array_equal(found.values == 0, expected.values == 0)
    if stage == "softmax":
        again = recompute_weights(lazy, mode or "diagonal", batch=1)
        assert again.chunks is not None
        numerics.assert_kernels_agree(
            again,
            recompute_weights(dense, mode or "diagonal", batch=1),
            logits=numerics.trace_logits(dense, mode or "diagonal"),
        )
        assert (again.values[..., -40:] == 0).all()  # the padded keys of sample 1


def test_a_virtual_trace_refuses_a_custom_mask_by_name():
    from attnpanel.traces.stages import recompute_weights

    _, lazy = padded_pair(50)
    with pytest.raises(ValueError, match="custom mask"):
        recompute_weights(lazy, np.ones((50, 50), dtype=bool))


@pytest.mark.parametrize("mode", [None, "none", "causal"])
def test_a_window_or_one_row_is_computed_alone_and_exact(mode):
    from attnpanel.traces.stages import attention_stage

    dense, lazy = padded_pair()
    expected = attention_stage(dense, "softmax", mode, batch=1, head=2).values
    # the trace's lse is the fused kernel's float32 one: two kernels against each other
    logits = numerics.trace_logits(dense, mode)
    row = virtual.window(lazy, 1, 2, slice(17, 18), slice(None), mode)
    numerics.assert_kernels_agree(row, expected[17:18], logits=logits)
    found = virtual.window(lazy, 1, 2, slice(250, 300), slice(100, 290), mode)
    numerics.assert_kernels_agree(found, expected[250:300, 100:290], logits=logits)
    np.testing.assert_array_equal(found == 0, expected[250:300, 100:290] == 0)
    assert (found[:, -30:] == 0).all()  # padded keys 260-299 of sample 1

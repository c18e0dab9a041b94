"""Overview levels (attnpanel.traces.overviews): computed once, stored in zarr, read back at once,
built on a dask.distributed LocalCluster; never read half-written or from other numbers."""

from __future__ import annotations

import numerics
import numpy as np
import pytest
import torch
import xarray as xr

from attnpanel.kernels import tiles
from attnpanel.kernels.attention import MultiHeadSelfAttention
from attnpanel.traces import overviews
from attnpanel.traces.build import trace
from attnpanel.traces.overviews import Entry, Overviews


def _virtual(seed: int = 0) -> xr.Dataset:
    torch.manual_seed(seed)
    layer = MultiHeadSelfAttention(32, 4, "diagonal").eval()
    x = torch.randn(2, 600, 32, generator=torch.Generator().manual_seed(1)) * 2
    return trace(layer, x, dense=False)


@pytest.fixture(scope="module")
def lazy():
    return _virtual()


def _expected(ds: xr.Dataset, entry: Entry) -> tiles.Overview:
    """The overview straight from the dense float64 weights of the trace's q and k."""
    from attnpanel.traces.stages import attention_stage

    one = {"batch": entry.sample, "head": entry.head}
    weights = attention_stage(ds, "softmax", entry.mask, **one).values.astype(np.float64)
    rows, cols = entry.pixels
    row_bin = np.arange(weights.shape[0]) * rows // weights.shape[0]
    col_bin = np.arange(weights.shape[1]) * cols // weights.shape[1]
    peak, mean = np.zeros((rows, cols)), np.zeros((rows, cols))
    for r in range(rows):
        for c in range(cols):
            cells = weights[row_bin == r][:, col_bin == c]
            peak[r, c], mean[r, c] = cells.max(), cells.mean()
    return peak, mean


def _assert_overview(found: tiles.Overview, ds: xr.Dataset, entry: Entry, parts=("max", "mean")):
    """The overview's pixels against those of the trace's own weights: two kernels (the
    overview's float64 maxima and float32 means, the trace's tiles or dense softmax)."""
    peak, mean = _expected(ds, entry)
    logits = numerics.trace_logits(ds, entry.mask)
    for part, expected in (("max", peak), ("mean", mean)):
        if part in parts:
            numerics.assert_kernels_agree(getattr(found, part), expected, logits=logits)


@pytest.mark.parametrize("mask", ["diagonal", "causal", "none"])
def test_an_overview_is_the_maps_pixel_max_and_mean(lazy, mask):
    entry = Entry(sample=1, head=2, mask=mask, pixels=(40, 30))
    _assert_overview(Overviews(lazy).get(entry), lazy, entry)


def test_a_stored_overview_is_read_back_without_computing(lazy, tmp_path, monkeypatch):
    folder = overviews.folder_for(tmp_path / "t.zarr")
    entry = Entry(sample=0, head=1, mask="diagonal", pixels=(40, 30))
    first = Overviews(lazy, folder).get(entry)
    assert (folder / entry.name).is_dir()
    assert [p.name for p in folder.iterdir()] == [entry.name]  # no partial store left

    def refuse(task):
        raise AssertionError("computed again")

    monkeypatch.setattr(overviews, "compute", refuse)
    again = Overviews(lazy, folder)
    assert again.stored(entry)
    for part in overviews.PARTS:
        np.testing.assert_array_equal(getattr(again.get(entry), part), getattr(first, part))


def test_a_store_of_other_numbers_is_not_used(lazy, tmp_path):
    folder = tmp_path / "o"
    entry = Entry(sample=0, head=0, mask="diagonal", pixels=(20, 20))
    Overviews(lazy, folder).get(entry)
    other = _virtual(seed=5)  # another layer on the same input
    assert not Overviews(other, folder).stored(entry)
    found = Overviews(other, folder).get(entry)  # computed for its own numbers, replacing
    _assert_overview(found, other, entry, parts=("max",))
    assert Overviews(other, folder).stored(entry) and not Overviews(lazy, folder).stored(entry)


def test_an_interrupted_write_leaves_nothing_that_reads_as_complete(lazy, tmp_path, monkeypatch):
    folder = tmp_path / "o"
    entry = Entry(sample=0, head=0, mask="causal", pixels=(20, 20))
    real = xr.Dataset.to_zarr

    def interrupted(self, store, **kwargs):
        real(self[["max"]], store, **kwargs)  # one array written, then the process dies
        raise KeyboardInterrupt

    monkeypatch.setattr(xr.Dataset, "to_zarr", interrupted)
    with pytest.raises(KeyboardInterrupt):
        Overviews(lazy, folder).get(entry)
    monkeypatch.undo()
    assert not Overviews(lazy, folder).stored(entry)
    assert not (folder / entry.name).exists()
    assert list(folder.iterdir()) == []  # the partial store removed


def test_a_two_worker_local_cluster_builds_every_overview(lazy, tmp_path):
    folder = tmp_path / "o"
    store = Overviews(lazy, folder)
    entries = store.entries(heads=[0, 3], masks=["diagonal", "causal"], pixels=(30, 30))
    assert len(entries) == 2 * 2 * 2
    built = store.build(entries, workers=2, progress=False)
    assert built == entries
    reopened = Overviews(lazy, folder)
    assert all(reopened.stored(entry) for entry in entries)
    assert reopened.build(entries, progress=False) == []  # nothing left to do
    for entry in entries[:3]:
        _assert_overview(reopened.get(entry), lazy, entry)


def test_a_dense_trace_has_overviews_too():
    torch.manual_seed(0)
    layer = MultiHeadSelfAttention(16, 2, "causal").eval()
    dense = trace(layer, torch.randn(1, 90, 16), dense=True)
    entry = Entry(sample=0, head=1, mask="causal", pixels=(9, 9))
    _assert_overview(Overviews(dense).get(entry), dense, entry)


def test_bad_entries_are_refused_by_name(lazy):
    with pytest.raises(ValueError, match="mask mode"):
        Entry(sample=0, head=0, mask="custom")
    with pytest.raises(ValueError, match="head 9 is out of range"):
        Overviews(lazy).get(Entry(sample=0, head=9, mask="diagonal"))


def test_the_command_line_builds_and_then_skips_the_stored_overviews(lazy, tmp_path, capsys):
    from attnpanel.cli import main
    from attnpanel.traces import io

    path = io.save(lazy.isel(batch=[0]), tmp_path / "t.zarr")
    argv = ["overviews", str(path), "--masks", "diagonal", "none", "--pixels", "24", "24"]
    assert main(argv) == 0
    assert "8 overviews built, 0 already stored" in capsys.readouterr().out
    folder = overviews.folder_for(path)
    assert len(list(folder.iterdir())) == 8
    assert main(argv) == 0
    assert "0 overviews built, 8 already stored" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:  # argparse: a usage error
        main(["overviews", str(path), "--workers", "0"])
    assert exit_.value.code == 2 and "give 1 or more" in capsys.readouterr().err


def test_a_damaged_store_is_computed_again(lazy, tmp_path):
    folder = tmp_path / "o"
    entry = Entry(sample=1, head=0, mask="diagonal", pixels=(20, 20))
    first = Overviews(lazy, folder).get(entry)
    (folder / entry.name / "zarr.json").write_text("{not json")
    assert not Overviews(lazy, folder).stored(entry)
    again = Overviews(lazy, folder).get(entry)  # recomputed and written whole again
    np.testing.assert_array_equal(again.max, first.max)
    assert Overviews(lazy, folder).stored(entry)


def test_a_trace_with_an_additive_bias_is_refused_not_drawn_without_it():
    from attnpanel.kernels.attention import attend
    from attnpanel.traces.build import build_trace

    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 30, 4, generator=generator) for _ in range(2))
    bias = torch.randn(1, 2, 30, 30, generator=generator)
    _, weights = attend(q, k, None, 0.5, bias=bias)
    ds = build_trace(weights=weights, q=q, k=k, bias=bias, scale=0.5)
    with pytest.raises(ValueError, match="'bias'"):
        Overviews(ds).get(Entry(sample=0, head=1, mask="none"))


def test_a_stored_overview_holding_a_compression_bomb_is_refused_and_computed_again(lazy, tmp_path):
    """The overviews' folder may come with a trace from elsewhere: each store is screened
    before a chunk is decoded, and a refused one is computed again."""
    from test_bombs import zstd_bomb

    from attnpanel.traces import screening

    folder = tmp_path / "o"
    entry = Entry(sample=0, head=1, mask="diagonal", pixels=(20, 20))
    first = Overviews(lazy, folder).get(entry)
    chunks = [p for p in (folder / entry.name).rglob("*") if p.is_file() and "/c/" in str(p)]
    assert chunks, "the overview is stored in chunks"
    chunks[0].write_bytes(zstd_bomb(2**31))
    with pytest.raises(ValueError, match="compression bomb"):
        screening.refuse_unsafe_storage(folder / entry.name, "zarr")
    again = Overviews(lazy, folder).get(entry)
    np.testing.assert_array_equal(again.max, first.max)
    np.testing.assert_array_equal(again.mean, first.mean)

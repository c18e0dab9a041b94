"""``attnpanel compare`` against the Python API: the report it writes, the ranking it
prints and the one-line refusals, through the command's own parser."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import xarray as xr
import zoo
from test_compare import NUDGE, second_checkpoint

import attnpanel
from attnpanel.cli import compare as compare_command
from attnpanel.cli.common import CommandError
from attnpanel.readouts.compare import compare


def attnpanel_compare(*argv: str) -> None:
    """``attnpanel compare ARGV``: the command's parser under a parser of its own, run."""
    parser = argparse.ArgumentParser(prog="attnpanel")
    sub = parser.add_subparsers(dest="command", required=True)
    compare_command.add_parser(sub)
    args = parser.parse_args(["compare", *argv])
    args.func(args)


@pytest.fixture(scope="module")
def saved_bert(tmp_path_factory):
    """Two checkpoints of the padded BERT captured on the same batch, saved as .nc."""
    folder = tmp_path_factory.mktemp("bert")
    model, args, kwargs = zoo.case("bert_padding").build()
    paths = folder / "a.nc", folder / "b.nc"
    other = second_checkpoint(model, NUDGE["bert_padding"])
    for checkpoint, path in zip((model, other), paths, strict=True):
        attnpanel.save(attnpanel.capture(checkpoint, *args, **kwargs), path)
    return paths


def test_the_report_and_the_ranking(saved_bert, tmp_path, capsys):
    a, b = saved_bert
    out = tmp_path / "report.nc"
    attnpanel_compare(str(a), str(b), "-o", str(out))
    printed = capsys.readouterr().out.splitlines()
    expected = compare(attnpanel.load(a), attnpanel.load(b))
    with xr.open_dataset(out, engine="h5netcdf") as report:
        report = report.load()
    assert set(report.data_vars) == {"js", "max_abs", "rows"}  # no maps without --difference
    np.testing.assert_allclose(report["js"].values, expected["js"].values, rtol=1e-12)
    np.testing.assert_allclose(report["max_abs"].values, expected["max_abs"].values, rtol=1e-12)
    np.testing.assert_array_equal(report["rows"].values, 20)
    assert list(report["layer"].values) == list(expected["layer"].values)
    assert report.attrs["a_file"] == str(a) and report.attrs["b"] == "BertModel (float32)"
    assert printed[0] == f"wrote {out}: 8 heads compared (without the difference maps)"
    assert printed[1:3] == ["a: BertModel (float32)", "b: BertModel (float32)"]
    assert "most different first" in printed[3]
    ranking = expected["js"].to_series().sort_values(ascending=False)
    values = [float(line.split(" js ")[1].split()[0]) for line in printed[4:]]
    np.testing.assert_allclose(values, ranking.values, rtol=1e-3)
    (layer, head), value = ranking.index[0], ranking.iloc[0]
    assert printed[4].startswith(f"    1. {layer}  head {head:<3d} js {value:.4g}")
    assert len(printed) == 4 + 8


def test_the_difference_maps_on_request(saved_bert, tmp_path, capsys):
    a, b = saved_bert
    out = tmp_path / "report.nc"
    out.write_bytes(b"")  # something that is no netCDF file is never replaced
    with pytest.raises(CommandError, match="is not a netCDF"):
        attnpanel_compare(str(a), str(b), "-o", str(out), "--force")
    out.unlink()
    attnpanel_compare(str(a), str(b), "-o", str(out))
    with pytest.raises(CommandError, match="--force"):
        attnpanel_compare(str(a), str(b), "-o", str(out), "--difference")
    attnpanel_compare(str(a), str(b), "-o", str(out), "--difference", "--force")
    assert "with the difference maps" in capsys.readouterr().out
    with xr.open_dataset(out, engine="h5netcdf") as report:
        difference = report["difference"].load()
    expected = attnpanel.load(b)["weights"] - attnpanel.load(a)["weights"]
    np.testing.assert_allclose(difference.values, expected.values, atol=1e-7)


def test_refusals_are_one_line(saved_bert, tmp_path):
    a, b = saved_bert
    with pytest.raises(CommandError, match="does not end in .nc"):
        attnpanel_compare(str(a), str(b), "-o", str(tmp_path / "r.zarr"))
    with pytest.raises(CommandError, match="no trace at .*none.nc"):
        attnpanel_compare(str(a), str(tmp_path / "none.nc"), "-o", str(tmp_path / "r.nc"))
    model, args, kwargs = zoo.case("bert_padding").build()
    shorter = attnpanel.capture(model, *args, **{k: v[:, :10] for k, v in kwargs.items()})
    attnpanel.save(shorter, tmp_path / "short.nc")
    with pytest.raises(CommandError, match="differ in shape: 12 queries in a, 10 in b"):
        attnpanel_compare(str(a), str(tmp_path / "short.nc"), "-o", str(tmp_path / "r.nc"))
    assert not (tmp_path / "r.nc").exists()


def test_encoder_decoder_captures_compared_by_group(tmp_path, capsys):
    model, args, kwargs = zoo.case("bart").build()
    paths = [tmp_path / "a.nc", tmp_path / "b.nc"]
    other = second_checkpoint(model, NUDGE["bart"])
    for checkpoint, path in zip((model, other), paths, strict=True):
        attnpanel.save(attnpanel.capture(checkpoint, *args, **kwargs), path)
    out = tmp_path / "report.nc"
    attnpanel_compare(*map(str, paths), "-o", str(out))
    printed = capsys.readouterr().out.splitlines()
    expected = compare(*map(attnpanel.load, paths))
    with xr.open_datatree(out, engine="h5netcdf") as report:
        report = report.load()
    for group in ("encoder.layers.self_attn", "decoder.layers.encoder_attn"):
        np.testing.assert_allclose(report[group]["js"].values, expected[group]["js"].values)
        assert "difference" not in report[group].data_vars
    every = {
        (str(layer), int(head)): float(node["js"].sel(layer=layer, head=head))
        for node in expected.subtree
        if node.has_data
        for layer in node["layer"].values
        for head in node["head"].values
    }
    layer, head = max(every, key=every.get)
    assert printed[4].startswith(f"    1. {layer}")
    assert f"head {head:<3d} js {every[layer, head]:.4g}" in printed[4]
    assert printed[-1] == f"  ... and {len(every) - compare_command.LISTED_HEADS} more"

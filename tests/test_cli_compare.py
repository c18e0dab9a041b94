"""``attnpanel compare`` against the Python API: the report it writes, the ranking it
prints and the one-line refusals, through the command's own parser."""

from __future__ import annotations

import argparse
import re

import numpy as np
import pytest
import xarray as xr
import zoo
from test_compare import NUDGE, second_checkpoint
from test_compare_page import document_texts
from test_export import external_references

import attnpanel
from attnpanel.cli import compare as compare_command
from attnpanel.cli.common import CommandError
from attnpanel.readouts.compare import compare, ranked_heads
from attnpanel.render.compare_views import head_name


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
    from attnpanel.cli.main import main

    assert main(["info", str(out)]) == 0  # the report's ranking again
    assert capsys.readouterr().out.splitlines() == printed[1:]


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


def test_an_html_page_of_the_ranking_and_the_most_different_heads(saved_bert, tmp_path, capsys):
    a, b = saved_bert
    out = tmp_path / "report.html"
    attnpanel_compare(str(a), str(b), "-o", str(out), "--heads", "3", "--sample", "1")
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == f"wrote {out}: 8 heads compared, the maps of the 3 most different"
    assert printed[1:3] == ["a: BertModel (float32)", "b: BertModel (float32)"]
    html = out.read_text()
    assert external_references(html) == []  # works offline: no tag loads another file
    texts = document_texts(html)
    ranking = ranked_heads(compare(attnpanel.load(a), attnpanel.load(b)))
    names = [head_name(row.layer_name, row.head) for row in ranking.itertuples()]
    table = next(text for text in texts if "<table>" in text)
    assert re.findall(r"<td>\d+</td><td>(layer [^<]+, head \d+)</td>", table) == names
    for rank, name in enumerate(names[:3], start=1):
        assert any(text.startswith(f"<h3>{rank}. {name}</h3>") for text in texts)
        assert f"B − A · sample 1, {name}" in [t.replace(",\n", ", ") for t in texts]
    assert not any(text.startswith("<h3>4. ") for text in texts)
    with pytest.raises(CommandError, match="--force"):
        attnpanel_compare(str(a), str(b), "-o", str(out))
    attnpanel_compare(str(a), str(b), "-o", str(out), "--force", "--heads", "1")
    assert sum(text.startswith("<h3>") for text in document_texts(out.read_text())) == 1


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
    page = tmp_path / "r.html"
    with pytest.raises(CommandError, match="--difference goes with a .nc"):
        attnpanel_compare(str(a), str(b), "-o", str(page), "--difference")
    with pytest.raises(CommandError, match="--sample 5 is out of range"):
        attnpanel_compare(str(a), str(b), "-o", str(page), "--sample", "5")
    page.write_text("notes")  # something that is no HTML page is never replaced
    with pytest.raises(CommandError, match="is not an HTML page"):
        attnpanel_compare(str(a), str(b), "-o", str(page), "--force")
    assert page.read_text() == "notes"


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
    with pytest.raises(CommandError, match="several groups: an HTML report draws"):
        attnpanel_compare(*map(str, paths), "-o", str(tmp_path / "report.html"))

"""Safe writes: nothing replaced by accident, nothing left half-written.

Every writer (``save`` of a trace as .nc or .zarr, the HTML export, the trained model, the
CLI's ``trace -o`` and ``export -o``) refuses an existing path unless told to replace it,
never replaces something of another kind, and leaves the old file whole when a write fails
or is interrupted.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xarray as xr

import attnpanel
from attnpanel import cli
from attnpanel.nilm.nilmformer import NILMFormer, NILMFormerConfig, default_path, save_model
from attnpanel.nilm.training import main
from attnpanel.render.export import export_html
from attnpanel.traces import io
from attnpanel.util.files import write_safely


def small_trace(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weights = torch.softmax(torch.randn(1, 2, 6, 6, generator=generator), -1)
    return attnpanel.build_trace(weights=weights, source=f"seed {seed}")


def siblings(path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir())


@pytest.mark.parametrize("suffix", [".nc", ".zarr"])
def test_a_trace_is_replaced_only_when_asked(tmp_path, suffix):
    path = tmp_path / f"trace{suffix}"
    io.save(small_trace(0), path)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        io.save(small_trace(1), path)
    assert io.load(path).attrs["source"] == "seed 0"
    io.save(small_trace(1), path, overwrite=True)
    assert io.load(path).attrs["source"] == "seed 1"
    assert siblings(path) == [path.name]  # no temporary left beside it


@pytest.mark.parametrize("suffix", [".nc", ".zarr"])
def test_a_failed_write_leaves_the_old_trace_and_no_partial_file(tmp_path, suffix, monkeypatch):
    path = tmp_path / f"trace{suffix}"
    io.save(small_trace(0), path)
    before = io.load(path)
    method = "to_netcdf" if suffix == ".nc" else "to_zarr"
    original = getattr(xr.Dataset, method)

    def interrupted(self, target, *args, **kwargs):
        original(self, target, *args, **kwargs)  # the new content is all there ...
        raise KeyboardInterrupt  # ... and Ctrl-C lands before it is moved into place

    monkeypatch.setattr(xr.Dataset, method, interrupted)
    with pytest.raises(KeyboardInterrupt):
        io.save(small_trace(1), path, overwrite=True)
    monkeypatch.undo()
    assert io.load(path).identical(before)
    assert siblings(path) == [path.name]


def test_an_invalid_trace_never_replaces_a_valid_one(tmp_path):
    path = io.save(small_trace(0), tmp_path / "good.nc")
    bad = small_trace(1)
    bad["weights"][0, 0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        io.save(bad, path, overwrite=True)
    assert io.load(path).attrs["source"] == "seed 0"


def test_something_of_another_kind_is_never_replaced(tmp_path):
    page = tmp_path / "page.nc"
    page.write_text("<!DOCTYPE html><html>my notes</html>")
    folder = tmp_path / "mine.zarr"
    folder.mkdir()
    (folder / "thesis.tex").write_text("years of work")
    for target in (page, folder):
        with pytest.raises(FileExistsError, match="never replaces"):
            io.save(small_trace(), target, overwrite=True)
    assert page.read_text() == "<!DOCTYPE html><html>my notes</html>"
    assert (folder / "thesis.tex").read_text() == "years of work"
    trace = io.save(small_trace(), tmp_path / "t.nc")
    with pytest.raises(FileExistsError, match="not an HTML page"):
        export_html(small_trace(), trace, overwrite=True)  # an export over a trace
    assert io.load(trace).attrs["source"] == "seed 0"


def test_a_symlink_is_never_written_through(tmp_path):
    target = io.save(small_trace(0), tmp_path / "real.nc")
    link = tmp_path / "link.nc"
    link.symlink_to(target)
    with pytest.raises(FileExistsError, match="never replaces"):
        io.save(small_trace(1), link, overwrite=True)
    assert io.load(target).attrs["source"] == "seed 0"


def test_a_lazy_trace_saved_onto_its_own_store(tmp_path):
    path = io.save(small_trace(0), tmp_path / "own.zarr")
    expected = io.load(path)
    lazy = io.load(path, lazy=True)
    io.save(lazy, path, overwrite=True)  # reads the old store while writing the new one
    again = io.load(path)
    assert again.identical(expected)
    assert np.isfinite(again["weights"].values).all()


def test_html_export_refuses_then_replaces(tmp_path):
    path = export_html(small_trace(), tmp_path / "page.html")
    first = path.read_bytes()
    with pytest.raises(FileExistsError):
        export_html(small_trace(1), path)
    assert path.read_bytes() == first
    export_html(small_trace(1), path, overwrite=True)
    assert path.read_bytes() != first


def test_write_safely_cleans_up_after_an_error(tmp_path):
    def broken(target):
        target.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_safely(tmp_path / "out.html", "html", broken)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(FileNotFoundError, match="no directory"):
        write_safely(tmp_path / "missing" / "out.html", "html", broken)


def test_model_weights_are_not_replaced_by_default(tmp_path, monkeypatch):
    model = NILMFormer(NILMFormerConfig(n_layers=1))
    path = save_model(model, tmp_path / "w.pt")
    with pytest.raises(FileExistsError):
        save_model(model, path)
    save_model(model, path, overwrite=True)
    assert torch.load(path, weights_only=True)["config"]["n_layers"] == 1
    # `attnpanel train` with no --out writes ./nilmformer.pt, never the shipped weights;
    # an existing one there is refused before any training
    shipped = default_path().read_bytes()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "nilmformer.pt").write_bytes(path.read_bytes())
    with pytest.raises(SystemExit) as stopped:
        main(["--steps", "1", "--minutes", "0.01"])
    assert stopped.value.code == 2
    assert default_path().read_bytes() == shipped


def test_cli_trace_and_export_refuse_without_force(tmp_path, capsys):
    trace = io.save(small_trace(0), tmp_path / "t.nc")
    page = tmp_path / "p.html"
    assert cli.main(["export", str(trace), "-o", str(page)]) == 0
    first = page.read_bytes()
    assert cli.main(["export", str(trace), "-o", str(page)]) != 0
    assert "--force" in capsys.readouterr().err
    assert page.read_bytes() == first
    assert cli.main(["export", str(trace), "-o", str(page), "--force"]) == 0
    # trace -o onto a page, or an existing trace, is refused before anything is computed
    named_like_a_trace = tmp_path / "page.nc"
    named_like_a_trace.write_bytes(first)
    cases = ((page, "written as .nc or .zarr"), (named_like_a_trace, "not a netCDF"))
    for output, expected in (*cases, (trace, "--force")):
        assert cli.main(["trace", "--model", "x", "--text", "y", "-o", str(output)]) != 0
        assert expected in capsys.readouterr().err
    assert io.load(trace).attrs["source"] == "seed 0"

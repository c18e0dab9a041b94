"""Positions that are not time steps: NILMFormer's statistics token named (never given a
time), PatchTST's patches as spans from its Hugging Face config; the input's own timestamps
mapped onto the model's positions; axes, the shape table, the statistics and the roles
follow."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from recordings import house_power
from reference_nilmformer import small_nilmformer

import attnpanel
from attnpanel import Layout, Positions, series
from attnpanel.kernels.roles import RoleInputs
from attnpanel.kernels.statistics import head_statistics_of
from attnpanel.readouts import core
from attnpanel.readouts.roles import trace_roles
from attnpanel.readouts.summary import describe, shape_table
from attnpanel.surveys.roles import head_roles

SUMMER = pd.Timestamp("2014-06-02 07:00", tz="UTC")  # 08:00 in London (BST)


@pytest.fixture(scope="module")
def run():
    house = house_power(hours=16, start=SUMMER)
    cut = series.windows_of(series.read_recordings(house), length=480, freq="1min")
    recipe = series.make_recipe("nilmformer", scale=6000.0, targets=["kettle"])
    return series.RecordingModel(small_nilmformer(), recipe, cut, {"kettle": 2000.0})


@pytest.fixture(scope="module")
def traced(run):
    found = run.trace([0, 1])
    found.attrs["time_zone"] = "Europe/London"  # the house's own clock
    return found


def test_the_statistics_token_is_named_and_never_given_a_time(traced):
    """481 positions from 480 timestamps: the last is the token, NaT, named; every other
    keeps its own minute; labels read the house's clock (BST: UTC + 1)."""
    assert traced.sizes["query"] == 481
    time = traced["time"].isel(batch=0).values
    assert np.isnat(time[480]) and not np.isnat(time[:480]).any()
    assert str(traced["position_name"].isel(batch=0).values[480]) == "statistics"
    assert (traced["position_name"].isel(batch=0).values[:480] == "").all()
    found = Positions.of(traced, 0)
    labels = found.labels()
    assert labels[0] == "08:00" and labels[479] == "15:59" and labels[480] == "statistics"
    assert found.kind(480) == "token" and found.kind(0) == "time step"
    assert found.step() == np.timedelta64(60, "s")
    assert core.clock_labels(traced, 1)[0] == "16:00"  # the second window's own clock
    assert traced.attrs["positions"] == "statistics last"


def test_the_shape_table_and_summary_name_the_token(traced):
    layer = traced.isel(layer=0)
    table = shape_table(layer)
    assert table.iloc[0].tolist() == [
        "positions",
        "480 time steps every 1 min; position 480: the statistics token",
        "(position=481)",
    ]
    text = describe(layer, positions=True)
    assert "480@statistics" in text and "0@08:00" in text
    assert "480@00:00" not in text  # the token never reads as a clock time


def test_reference_series_are_in_units_with_no_reading_at_the_token(run, traced):
    signal = traced["signal"].values
    assert np.isnan(signal[:, 480]).all()
    np.testing.assert_allclose(signal[:, :480], run.recipe.signal(run.windows)[:2])
    np.testing.assert_allclose(
        traced["prediction"].values[:, :, :480], run.predictions()[:2], rtol=1e-5, atol=1e-3
    )
    assert traced["truth"].attrs["units"] == "W"


def test_the_weights_are_the_models_own_over_481_positions(run, traced):
    """What the trace holds is what the model's attention module computed (its einsum and
    masked_fill): the module's own softmax, read by a forward hook of our own."""
    seen = []
    softmax_out = run.model.EncoderBlock[1].attention_layer.attn_dropout  # identity in eval
    handle = softmax_out.register_forward_hook(lambda m, i, o: seen.append(o.detach()))
    try:
        args, kwargs = run.recipe.inputs(run.windows.isel(window=[0, 1]))
        with torch.no_grad():
            run.model(*args, **kwargs)
    finally:
        handle.remove()
    own = seen[0].numpy()
    assert own.shape[-1] == 481
    np.testing.assert_array_equal(traced["weights"].isel(layer=1).values, own)


def test_time_for_other_positions_without_a_layout_is_refused_in_words():
    weights = torch.softmax(torch.randn(1, 2, 5, 5), -1)
    stamps = pd.date_range("2024-01-01", periods=4, freq="1min")
    with pytest.raises(ValueError, match="4 timestamps for 5 positions.*layout=Layout"):
        attnpanel.build_trace(weights=weights, time=stamps)
    found = attnpanel.build_trace(weights=weights, time=stamps, layout=Layout(before=("cls",)))
    assert Positions.of(found).labels() == ["cls", "00:00", "00:01", "00:02", "00:03"]
    with pytest.raises(ValueError, match="lays 4 time steps out as 6 positions"):
        attnpanel.build_trace(weights=weights, time=stamps, layout=Layout(("a", "b")))
    with pytest.raises(ValueError, match="distinct, non-empty names"):
        Layout(before=("cls",), after=("cls",))


def test_capture_without_a_layout_says_how_to_give_one(run):
    args, _ = run.recipe.inputs(run.windows.isel(window=[0]))
    found = attnpanel.capture(run.model, *args, time=run.windows["time"].values[:1])
    assert "time" not in found.coords
    assert (
        "480 timestamps for 481 positions; say what the other positions are with layout="
        in (found.attrs["note"])
    )


def test_patchtst_patches_are_spans_from_its_config():
    """PatchTST's own config lays its positions out (no layout given): spans of
    ``patch_length`` steps every ``patch_stride``, ending on the last step, and its CLS
    token first; the weights are its own (captured exactly)."""
    from transformers import PatchTSTConfig, PatchTSTModel

    config = PatchTSTConfig(
        num_input_channels=2, context_length=70, patch_length=16, patch_stride=8, d_model=16,
        num_attention_heads=2, num_hidden_layers=1, ffn_dim=32, use_cls_token=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = PatchTSTModel(config).eval()
    stamps = pd.date_range("2024-01-01 00:00", periods=70, freq="1min")
    found = attnpanel.capture(model, past_values=torch.randn(2, 70, 2), time=stamps)
    positions = Positions.of(found.isel(layer=0), 0)
    # (70 - 16) // 8 + 1 = 7 spans; 70 - (16 + 8 * 6) = 6 steps read by none
    assert found.sizes["query"] == 8
    labels = positions.labels()
    assert labels[0] == "cls" and labels[1] == "00:06–00:21" and labels[-1] == "00:54–01:09"
    assert positions.kind(1) == "span" and positions.kind(0) == "token"
    assert positions.step() == np.timedelta64(480, "s")
    assert found.attrs["positions"] == "cls first; spans of 16 steps every 8"


def test_files_keep_what_positions_are(tmp_path, traced):
    path = tmp_path / "t.nc"
    attnpanel.save(traced.isel(layer=0), path)
    back = attnpanel.load(path)
    assert Positions.of(back, 1).labels() == Positions.of(traced, 1).labels()


def _token_head(length: int = 9) -> torch.Tensor:
    """Two heads over 8 steps and a token last: head 0 puts 0.9 of each step's weight on
    the token and 0.1 on the step before; head 1 all on the step before."""
    weights = torch.zeros(1, 2, length, length)
    for i in range(length - 1):
        before = max(i - 1, 0)
        weights[0, 0, i, length - 1], weights[0, 0, i, before] = 0.9, 0.1
        weights[0, 1, i, before] = 1.0
    weights[0, :, length - 1, 0] = 1.0  # the token's own row
    return weights


def test_a_tokens_weight_adds_no_distance_and_is_its_own_statistic():
    weights = _token_head()
    named = torch.zeros(9, dtype=torch.bool)
    named[8] = True
    found = head_statistics_of(weights, named=named)
    # steps 1..7 look 1 back, step 0 at itself: (7 * 1 + 0) / 8 over the step queries
    np.testing.assert_allclose(found["distance"][0].numpy(), [0.1 * 7 / 8, 7 / 8])
    np.testing.assert_allclose(found["token_share"][0].numpy(), [0.9, 0.0])
    plain = head_statistics_of(weights)  # the token read as a step: 8 - i steps away
    assert float(plain["distance"][0, 0]) == pytest.approx((0.9 * 36 + 0.7 + 8) / 9)
    with_roles = head_statistics_of(weights, named=named, roles=RoleInputs())
    np.testing.assert_allclose(with_roles["distance"], found["distance"])
    assert float(with_roles["offset"][0, 1]) == 1.0


def test_roles_say_a_head_looks_at_the_statistics_token():
    weights = _token_head()
    stamps = pd.date_range("2024-01-01", periods=8, freq="1h")
    trace = attnpanel.build_trace(
        weights=weights, time=stamps, layout=Layout(after=("statistics",))
    )
    roles = trace_roles(trace)
    assert list(roles["role"].values[0]) == ["looks at the statistics token", "previous token"]
    assert float(roles["token_share"].values[0, 0]) == pytest.approx(0.9)


def test_a_survey_with_a_layout_keeps_the_token_share(run):
    args, _ = run.recipe.inputs(run.windows.isel(window=[0, 1]))
    layout = run.recipe.position_layout()
    found = attnpanel.survey(run.model, [args], layout=layout, progress=False)
    assert found.attrs["named_tokens"] == ["statistics"]
    assert "token_share" in found.attrs["statistics"]
    share = found["token_share"].values
    assert share.shape == (2, 2, 4) and ((share >= 0) & (share <= 1)).all()
    table = head_roles(found)
    assert "token_share" in table and table.attrs["named_tokens"] == ["statistics"]
    # the weight on the token, read by hand from the model's own weights of window 0
    trace = run.trace([0])
    expected = trace["weights"].isel(layer=0, batch=0).values[:, :480, 480].mean(-1)
    np.testing.assert_allclose(share[0, 0], expected, rtol=1e-5)


def test_the_pages_survey_leaves_the_token_out_and_reads_the_clock(run):
    """The explorer's "every sample" survey of a recording's model (its ModelRun) is the
    survey with the recipe's layout and the windows' step."""
    page = run.subset(slice(0, 2)).model_run()
    found = page.survey()
    args, _ = run.subset(slice(0, 2)).inputs()
    expected = attnpanel.survey(
        run.model, [args], layout=run.recipe.position_layout(), step=60.0, progress=False
    )
    np.testing.assert_allclose(found["token_share"].values, expected["token_share"].values)
    np.testing.assert_allclose(found["distance_time"].values, 60 * found["distance"].values)

"""attnpanel.demo(): the contract the explorer builds on, and heads that learned something."""

from __future__ import annotations

import numerics
import numpy as np
import pytest
import torch

import attnpanel
from attnpanel import MultiHeadSelfAttention, trace
from attnpanel.nilm.demo import demo, demo_windows, head_statistics
from attnpanel.nilm.nilmformer import load_model, time_features
from attnpanel.nilm.power import APPLIANCES, TRAIN_SEED, generate


@pytest.fixture(scope="module")
def ds():
    return attnpanel.demo()


@pytest.fixture(scope="module")
def stats(ds):
    return head_statistics(ds)


@pytest.fixture(scope="module")
def random_stats(ds):
    """The same statistics for a freshly initialised layer on the same inputs."""
    torch.manual_seed(1)
    layer = MultiHeadSelfAttention(96, 8, mask="diagonal")
    untrained = trace(layer, ds["x"].values).assign(truth=ds["truth"])
    return head_statistics(untrained)


def test_shape_dims_and_coords(ds):
    assert ds["weights"].dims == ("batch", "head", "query", "key")
    assert ds["weights"].shape == (32, 8, 480, 480)
    assert ds["time"].dims == ("batch", "position")
    assert ds["time"].dtype == np.dtype("datetime64[ns]")
    assert np.all(np.diff(ds["time"].values, axis=1) == np.timedelta64(1, "m"))
    # the reference series (docs/trace.md), in the demo's words
    assert ds["signal"].dims == ("batch", "position")
    for name in ("signal", "truth", "prediction"):
        assert ds[name].dtype == np.float32 and ds[name].attrs["units"] == "W"
    for name in ("truth", "prediction"):
        assert ds[name].dims == ("batch", "series", "position")
    assert list(ds["series"].values) == list(APPLIANCES)
    assert ds["signal"].attrs["long_name"] == "aggregate power"
    assert ds["truth"].attrs["long_name"] == "appliance power"
    for name in ("x", "q", "k", "v", "scores", "context", "output", "w_q", "w_k", "w_v", "w_o"):
        assert name in ds
    attrs = ds.attrs
    assert (attrs["d_model"], attrs["n_heads"], attrs["head_dim"]) == (96, 8, 12)
    assert attrs["mask"] == "diagonal" and attrs["scale"] == pytest.approx(12**-0.5)
    assert attrs["n_layers"] == load_model().config.n_layers
    assert 0 <= attrs["layer_index"] < attrs["n_layers"]
    assert "NILMFormer" in attrs["source"]


def test_rows_sum_to_one_and_diagonal_is_exactly_zero(ds):
    weights = ds["weights"].values
    np.testing.assert_allclose(weights.sum(-1), 1, atol=1e-5)
    assert np.all(np.diagonal(weights, axis1=-2, axis2=-1) == 0)
    assert weights.min() >= 0


def test_data_is_held_out_and_consistent(ds):
    training = generate(1, seed=TRAIN_SEED)
    # Held-out days come long after the 400 training days (and from another seed).
    assert ds["time"].values.min() > training["time"].values[0] + np.timedelta64(400, "D")
    held = demo_windows(32)
    np.testing.assert_array_equal(ds["signal"].values, held["aggregate"].values)
    np.testing.assert_array_equal(ds["time"].values, held["time"].values)
    # The aggregate is the base load (at least 60 W) on top of the appliances.
    assert np.all(ds["signal"] >= ds["truth"].sum("series") + 59)
    assert ds["prediction"].min() >= 0


def test_x_is_the_input_the_traced_layer_sees(ds):
    model = load_model()
    aggregate = torch.from_numpy(ds["signal"].values[:2])
    features = time_features(ds["time"].values[:2])
    seen = model.attention_input(aggregate, features, ds.attrs["layer_index"])
    np.testing.assert_allclose(ds["x"].values[:2], seen.detach().numpy(), atol=1e-5)


def test_layers_and_errors():
    small = demo(layer=0, n_windows=2)
    assert small["weights"].shape == (2, 8, 480, 480) and small.attrs["layer_index"] == 0
    assert demo(layer=-1, n_windows=2).attrs["layer_index"] == small.attrs["n_layers"] - 1
    with pytest.raises(ValueError, match="layer must be in"):
        demo(layer=small.attrs["n_layers"])
    with pytest.raises(ValueError, match="n_windows must be positive"):
        demo(n_windows=0)


def test_model_disaggregates_the_demo_windows(ds):
    error = abs(ds["prediction"] - ds["truth"]).mean(("batch", "position"))
    baseline = ds["truth"].mean(("batch", "position"))  # predicting zero
    assert bool((error < 0.6 * baseline).any())


def test_heads_are_sharper_than_untrained_ones(stats, random_stats):
    # An untrained layer on the same inputs is all but uniform; every trained head is
    # sharper than the average untrained one, and the sharpest far sharper.
    uniform = stats.attrs["uniform_entropy"]
    assert float(random_stats["entropy"].mean()) > 0.98 * uniform
    assert bool((stats["entropy"] < random_stats["entropy"].mean()).all())
    assert float(stats["entropy_ratio"].min()) < float(random_stats["entropy_ratio"].min()) - 0.05


def test_heads_select_keys_by_what_is_running(stats, random_stats):
    # Trained heads favour or shun the minutes when particular appliances run, far beyond
    # what random projections of the same inputs do (a lift of 1 is no preference).
    def selectivity(s):
        return float(np.abs(np.log(s["event_lift"])).max())

    assert selectivity(stats) > 2 * selectivity(random_stats)
    assert float(stats["event_lift"].min()) < 0.5 * float(random_stats["event_lift"].min())


def test_the_long_demo_is_a_virtual_trace_of_what_the_model_computed():
    """demo_long: one sample over whole days at one minute, a virtual trace whose output
    and weights are the numbers the model's own attention layer computes on that input."""
    from attnpanel.kernels.masks import build_mask
    from attnpanel.nilm.demo import DEMO_LAYER, demo_long
    from attnpanel.traces import virtual

    ds = demo_long(days=2, dense=False)
    assert virtual.is_virtual(ds) and ds.sizes["query"] == ds.sizes["key"] == 2 * 1440
    assert ds.sizes["batch"] == 1 and ds["time"].dtype.kind == "M"
    assert {"signal", "truth", "prediction"} <= set(ds.data_vars)
    model = load_model()  # a model of its own, run on the trace's input
    attention = model.encoder[DEMO_LAYER].attention
    seen = {}
    hook = attention.register_forward_hook(lambda m, args, out: seen.update(x=args[0], out=out))
    try:
        aggregate = torch.from_numpy(ds["signal"].values)
        predicted = model.predict(aggregate, time_features(ds["time"].values))
    finally:
        hook.remove()
    np.testing.assert_allclose(ds["prediction"].values, predicted.numpy(), atol=1e-3)
    out = seen["out"][0] if isinstance(seen["out"], tuple) else seen["out"]
    np.testing.assert_allclose(ds["output"].values, out.numpy(), rtol=0, atol=1e-5)
    with torch.no_grad():
        q = attention.split_heads(attention.wq(seen["x"]))
        k = attention.split_heads(attention.wk(seen["x"]))
        logits = (q @ k.transpose(-2, -1)) * attention.scale
        blocked = build_mask(attention.mask, logits.shape[-1])
        logits = logits if blocked is None else logits.masked_fill(blocked, float("-inf"))
        own = torch.softmax(logits, -1)[0].numpy()
        largest = float(logits[logits.isfinite()].abs().max())
    # what the page draws: one query's row and a window
    row = virtual.window(ds, 0, 3, slice(1500, 1501), slice(None))
    numerics.assert_kernels_agree(row, own[3, 1500:1501], logits=largest)
    window = ds["weights"].isel(batch=0, head=5, query=slice(0, 480), key=slice(2000, 2480))
    numerics.assert_kernels_agree(window, own[5, :480, 2000:2480], logits=largest)


def test_a_trace_saved_with_the_old_names_reads_in_todays(ds, tmp_path):
    """Demo traces saved before the reference-series contract (aggregate, appliance_power,
    predicted_power over appliance) load with today's names and attributes."""
    old = ds.isel(batch=slice(0, 2)).rename(
        {"signal": "aggregate", "truth": "appliance_power", "prediction": "predicted_power"}
    )
    old = old.rename({"series": "appliance"})
    for name in ("aggregate", "appliance_power", "predicted_power"):
        old[name].attrs = {"units": "W"}
    path = tmp_path / "old.nc"
    attnpanel.save(old, path)
    back = attnpanel.load(path)
    assert {"signal", "truth", "prediction"} <= set(back.data_vars)
    assert "aggregate" not in back and "appliance" not in back.dims
    assert back["truth"].attrs["long_name"] == "appliance power"
    np.testing.assert_array_equal(back["truth"].values, ds["truth"].values[:2])

"""capture() on every architecture of the zoo, with no hints, against the model's own attention.

For each model: one object comes back; its weights and the model's own (the eager
``output_attentions`` or a manual reference) each equal a float64 recomputation from the
trace's q, k and mask, and each other, within the rounding of the model's dtype
(``numerics``: ``8 eps (1 + max|logit|)`` between two float32 kernels); the explorer builds on every
layer and the matrix it draws holds those same numbers, with exactly the blocked and padded
cells drawn as masked; save/load round trips; the model computes what it computed before.
"""

from __future__ import annotations

import numerics
import numpy as np
import pytest
import torch
import xarray as xr
import zoo
from bokeh.document import Document

import attnpanel
from attnpanel.app.explore import explore
from attnpanel.app.explorer import AttentionExplorer
from attnpanel.readouts import core
from attnpanel.traces import layers
from attnpanel.traces.stages import masked_cells

CASES = [case.name for case in zoo.CASES]
GROUPED = {"bart", "t5", "torch_transformer"}  # several kinds of attention: a DataTree


def tolerance(case: zoo.ZooCase, ds: xr.Dataset) -> float:
    """Two kernels' rounding in the model's dtype, from the layer's own logits."""
    return numerics.kernel_bound(numerics.trace_logits(ds), case.dtype)


@pytest.fixture(scope="module", params=CASES)
def captured(request):
    case = zoo.case(request.param)
    model, args, kwargs = case.build()
    reference = case.reference(model, args, kwargs)
    with torch.no_grad():
        before = model(*args, **kwargs)
    result = attnpanel.capture(model, *args, **kwargs)
    with torch.no_grad():
        after = model(*args, **kwargs)
    return case, model, reference, result, (before, after)


def by_name(result) -> dict[str, xr.Dataset]:
    return {entry.name: layers.select(result, entry.name) for entry in layers.layers(result)}


def reference_name(name: str, captured_names) -> str:
    # attnpanel's own layer is the model itself: the reference names it "", capture by class
    return name if name else next(iter(captured_names))


def test_one_object_with_every_attention_of_the_model(captured):
    case, model, reference, result, _ = captured
    expected = xr.DataTree if case.name in GROUPED else xr.Dataset
    assert isinstance(result, expected)
    found = by_name(result)
    assert len(found) == len(reference)
    for name, weights in reference:
        ds = found[reference_name(name, found)]
        assert ds["weights"].dtype == np.float32
        logits = numerics.trace_logits(ds)
        truth = numerics.float64_weights(ds).values
        rows = numerics.real_rows(ds)
        # both kernels against the float64 truth from the trace's q, k and mask, then each other
        for label, values in (("captured", ds["weights"]), ("model", weights)):
            numerics.assert_exact_weights(
                numerics.values_of(values)[rows],
                truth[rows],
                logits=logits,
                dtype=case.dtype,
                err_msg=f"{name}: {label}",
            )
        numerics.assert_kernels_agree(
            ds["weights"], weights, logits=logits, dtype=case.dtype, err_msg=name
        )


def test_the_mask_truth_recomputes_the_weights(captured):
    """From q, k and the trace's own mask (per sample, head, bias), the weights follow."""
    case, _, reference, result, _ = captured
    for name, ds in by_name(result).items():
        recomputed = attnpanel.recompute_weights(ds, ds.attrs["mask"])
        for sample in range(ds.sizes["batch"]):
            hidden = masked_cells(ds, batch=sample)
            rows = ~hidden.all(axis=1) if hidden is not None else slice(None)
            np.testing.assert_allclose(
                recomputed.isel(batch=sample).values[:, rows],
                ds["weights"].isel(batch=sample).values[:, rows],
                rtol=0,
                atol=tolerance(case, ds),
                err_msg=name,
            )


def test_the_explorer_draws_the_model_attention(captured):
    case, _, reference, result, _ = captured
    explorer = explore(result)
    explorer.__panel__()
    references = dict(reference)
    for entry in layers.layers(result):
        if isinstance(explorer, AttentionExplorer):
            explorer.layer = entry.index
            inner = explorer
        else:
            explorer.layer = entry.name
            inner = explorer.explorer
        if not inner.engine.panes():
            inner.__panel__().get_root(Document())
        ds = inner.trace
        bound = tolerance(case, layers.select(result, entry.name))
        weights = references[entry.name if entry.name in references else ""]
        for sample in range(ds.sizes["batch"]):
            for head in range(ds.sizes["head"]):
                inner.param.update(sample=sample, head=head)
                drawn = inner.drawn()
                truth = weights[sample, head].detach().float().numpy()
                assert drawn.shape == truth.shape
                shown = np.isfinite(drawn)
                np.testing.assert_allclose(
                    drawn[shown], truth[shown], rtol=0, atol=bound, err_msg=entry.name
                )
                hidden = masked_cells(ds, batch=sample, head=head)
                expected = np.zeros_like(shown) if hidden is None else hidden
                assert (~shown == expected).all(), entry.name
                if case.padding is not None and not case.kinds == ("self", "cross"):
                    padded = case.padding[sample].numpy()
                    assert (~shown[padded]).all() and (~shown[:, padded]).all()


def test_save_load_round_trip(captured, tmp_path):
    _, _, _, result, _ = captured
    path = attnpanel.save(result, tmp_path / "capture.nc")
    loaded = attnpanel.load(path)
    assert type(loaded) is type(result)
    for group, ds in layers.groups(result).items():
        assert layers.groups(loaded)[group].identical(ds)


def test_capture_leaves_the_model_as_it_was(captured):
    _, model, _, _, (before, after) = captured
    before = before[0] if isinstance(before, tuple) else before
    after = after[0] if isinstance(after, tuple) else after
    first = getattr(before, "last_hidden_state", before)
    second = getattr(after, "last_hidden_state", after)
    assert torch.equal(first, second)
    assert not model.training
    assert torch.backends.mha.get_fastpath_enabled()


@pytest.mark.parametrize(
    ("name", "mask", "variables"),
    [
        ("nilmformer_real", "diagonal", set()),
        ("nanogpt_sdpa_causal", "causal", set()),
        ("mistral_sliding_window", "custom", {"mask"}),
        ("gpt2_padding", "causal", {"sample_mask", "padding"}),
        ("bert_padding", "none", {"sample_mask", "padding"}),
        ("mha_float_mask", "none", {"bias"}),
    ],
)
def test_the_trace_records_what_the_model_masked(name, mask, variables):
    case = zoo.case(name)
    model, args, kwargs = case.build()
    ds = attnpanel.capture(model, *args, **kwargs)
    assert ds.attrs["mask"] == mask
    assert variables <= set(ds.data_vars)
    if "padding" in variables:
        np.testing.assert_array_equal(ds["padding"].isel(layer=0).values, case.padding.numpy())


def test_nilmformer_stats_token_and_rotary_notes():
    model, args, kwargs = zoo.case("nilmformer_real").build()
    ds = attnpanel.capture(model, *args, **kwargs)
    assert ds.sizes["query"] == args[0].shape[1] + 1  # the stats token
    assert {"w_q", "w_k", "w_v", "w_o"} <= set(ds.data_vars)
    model, args, kwargs = zoo.case("llama_gqa_rotary").build()
    ds = attnpanel.capture(model, *args, **kwargs)
    assert "w_q" not in ds and "w_k" not in ds and "w_v" in ds  # rotary: q, k not x Wq
    assert "rotary" in ds.attrs["note"]
    assert ds.attrs["kv_heads"] == 2
    assert ds.sizes["head"] == 4


def test_t5_keeps_its_relative_position_bias():
    model, args, kwargs = zoo.case("t5").build()
    tree = attnpanel.capture(model, *args, **kwargs)
    encoder = layers.groups(tree)["encoder.block.layer.SelfAttention"]
    assert encoder["bias"].dims == ("layer", "head", "query", "key")
    assert float(np.abs(encoder["bias"]).max()) > 0
    cross = layers.groups(tree)["decoder.block.layer.EncDecAttention"]
    assert cross.attrs["attention"] == "cross"
    assert cross["k"].dims[-2] == "key"


def test_bf16_is_captured_and_stored_as_float32():
    model, args, kwargs = zoo.case("bf16_llama").build()
    ds = attnpanel.capture(model, *args, **kwargs)
    assert ds.attrs["dtype"] == "bfloat16"
    assert all(ds[n].dtype == np.float32 for n in ("weights", "q", "k", "v"))


def test_patchtst_channels_and_vit_patches_are_labelled():
    model, args, kwargs = zoo.case("patchtst").build()
    ds = attnpanel.capture(model, *args, **kwargs)
    assert list(ds["sample"].values) == [0, 0, 0, 1, 1, 1]
    assert list(ds["channel"].values) == [0, 1, 2, 0, 1, 2]
    # the layout is the model's: changing sample 0's channel 1 changes attention batch 1 only
    changed = dict(kwargs, past_values=kwargs["past_values"].clone())
    changed["past_values"][0, :8, 1] *= 5.0  # not a shift: the model scales each channel
    other = attnpanel.capture(model, *args, **changed)
    moved = np.abs(other["x"].values - ds["x"].values).max(axis=(0, 2, 3))
    assert list(moved > 1e-6) == [False, True, False, False, False, False]
    model, args, kwargs = zoo.case("vit").build()
    ds = attnpanel.capture(model, *args, **kwargs)
    tokens = list(ds["token"].isel(batch=0).values)
    assert tokens[:2] == ["[CLS]", "patch 0,0"] and tokens[-1] == "patch 3,3"


def test_cross_attention_is_its_own_group_even_at_equal_lengths():
    model, args, kwargs = zoo.case("bart").build()
    kwargs = {"input_ids": kwargs["input_ids"], "decoder_input_ids": kwargs["input_ids"]}
    tree = attnpanel.capture(model, *args, **kwargs)
    kinds = {g: ds.attrs.get("attention", "self") for g, ds in layers.groups(tree).items()}
    assert kinds == {
        "encoder.layers.self_attn": "self",
        "decoder.layers.self_attn": "self",
        "decoder.layers.encoder_attn": "cross",
    }


def test_padding_is_labelled_on_the_matrix():
    model, args, kwargs = zoo.case("bert_padding").build()
    ds = layers.select(attnpanel.capture(model, *args, **kwargs), 0)
    padded = int(zoo.case("bert_padding").padding[1].sum())
    title = core.matrix_title(ds, core.Selection(sample=1))
    assert f"{padded} padded positions masked" in title
    assert "padded" not in core.matrix_title(ds, core.Selection(sample=0))


def test_fp16_is_captured_with_a_dtype_tolerance():
    model, args, kwargs = zoo.case("nanogpt_sdpa_causal").build()
    reference = dict(zoo.case("nanogpt_sdpa_causal").reference(model, args, kwargs))
    half = model.half()
    ds = attnpanel.capture(half, *(a.half() if a.is_floating_point() else a for a in args))
    assert ds.attrs["dtype"] == "float16" and ds["weights"].dtype == np.float32
    for name, weights in reference.items():
        np.testing.assert_allclose(
            ds["weights"].sel(layer=name).values, weights.detach().numpy(), rtol=0, atol=2e-2
        )

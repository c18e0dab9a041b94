"""Two captures compared (``attnpanel.readouts.compare``) against the long way: the models'
own attention (eager Hugging Face ``output_attentions``, NILMFormer's softmax in float64),
row by row in numpy, the padded queries of the zoo's own masks left out."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import xarray as xr
import zoo
from scipy.special import rel_entr

import attnpanel
from attnpanel.readouts.compare import check_comparable, compare

# How far each model's second checkpoint is nudged, in units of each weight matrix's spread:
# Hugging Face models start at std 0.02, where attention is nearly uniform and needs a
# large nudge to move (js of 0.01-0.1 nats, well above the tolerance).
NUDGE = {"bert_padding": 10.0, "bart": 10.0, "nilmformer_real": 1.0}


def second_checkpoint(model: torch.nn.Module, size: float, seed: int = 5):
    """A copy of ``model`` with every weight matrix nudged by ``size`` of its spread: the
    same architecture after some training."""
    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in other.parameters():
            if parameter.dim() == 2:
                noise = torch.randn(parameter.shape, generator=generator)
                parameter.add_(size * parameter.std() * noise)
    return other


def long_way(weights_a, weights_b, padded, skipped=()):
    """``(js, max_abs, rows)`` per (layer, head), one query row at a time, in float64.

    ``padded`` is ``(batch, query)``, True for a padded query; ``skipped`` lists more
    ``(layer, batch, head, query)`` rows to leave out."""
    layers, heads = len(weights_a), weights_a[0].shape[1]
    js, gap, rows = np.zeros((layers, heads)), np.zeros((layers, heads)), np.zeros((layers, heads))
    for layer, (wa, wb) in enumerate(zip(weights_a, weights_b, strict=True)):
        for head in range(heads):
            divergences = []
            for sample in range(wa.shape[0]):
                for query in range(wa.shape[2]):
                    if padded[sample, query] or (layer, sample, head, query) in skipped:
                        continue
                    p = np.asarray(wa[sample, head, query], dtype=np.float64)
                    q = np.asarray(wb[sample, head, query], dtype=np.float64)
                    m = (p + q) / 2
                    divergences.append(0.5 * rel_entr(p, m).sum() + 0.5 * rel_entr(q, m).sum())
                    gap[layer, head] = max(gap[layer, head], np.abs(q - p).max())
            js[layer, head] = np.mean(divergences)
            rows[layer, head] = len(divergences)
    return js, gap, rows


def own_attention(case, model, args, kwargs) -> dict[str, np.ndarray]:
    """The model's own weights of every attention module, by module name."""
    return {name: w.detach().numpy() for name, w in case.reference(model, args, kwargs)}


def two_checkpoints(name: str):
    """Captures and own attention of a zoo model and of its second checkpoint."""
    case = zoo.case(name)
    model, args, kwargs = case.build()
    other = second_checkpoint(model, NUDGE[name])
    captures = [attnpanel.capture(m, *args, **kwargs) for m in (model, other)]
    own = [own_attention(case, m, args, kwargs) for m in (model, other)]
    return case, captures, own


@pytest.mark.parametrize("name", ["bert_padding", "nilmformer_real"])
def test_two_checkpoints_against_the_models_own_attention(name):
    case, (a, b), (own_a, own_b) = two_checkpoints(name)
    found = compare(a, b)
    names = [str(n) for n in a["layer"].values]
    weights_a, weights_b = [own_a[n] for n in names], [own_b[n] for n in names]
    padded = np.zeros(a["weights"].shape[1:4:2], bool) if case.padding is None else case.padding
    js, gap, rows = long_way(weights_a, weights_b, np.asarray(padded))
    assert found["difference"].dims == ("layer", "batch", "head", "query", "key")
    assert found["difference"].dtype == np.float32
    np.testing.assert_allclose(
        found["difference"].values, np.stack(weights_b) - np.stack(weights_a), atol=1e-5
    )
    assert found["js"].dims == ("layer", "head") and found["js"].dtype == np.float64
    np.testing.assert_allclose(found["js"].values, js, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(found["max_abs"].values, gap, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(found["rows"].values, rows)
    assert 1e-3 < js.min() and js.max() < math.log(2)  # a real difference, not a saturated one
    assert list(found["layer"].values) == names
    assert found.attrs["a"] == found.attrs["b"] == f"{a.attrs['source']} (float32)"


def test_padded_queries_are_left_out():
    """BERT's padded queries attend to the real keys: their rows are no zeros, and counting
    them would change every mean."""
    case, (a, b), (own_a, own_b) = two_checkpoints("bert_padding")
    found = compare(a, b)
    names = [str(n) for n in a["layer"].values]
    weights_a, weights_b = [own_a[n] for n in names], [own_b[n] for n in names]
    every = np.zeros_like(case.padding.numpy())
    js_every, _, rows_every = long_way(weights_a, weights_b, every)
    assert (found["rows"].values == 20).all() and (rows_every == 24).all()
    assert np.abs(found["js"].values - js_every).min() > 1e-5


def test_rows_without_attention_are_left_out():
    """A row of no weight (all NaN, all zero) or one the model blocked from every key is no
    attention of a real query."""
    case, (a, b), (own_a, own_b) = two_checkpoints("bert_padding")
    names = [str(n) for n in a["layer"].values]
    weights_a, weights_b = [own_a[n] for n in names], [own_b[n] for n in names]
    padded = case.padding.numpy()
    b = b.copy(deep=True)
    b["weights"][0, 0, 1, 3, :] = np.nan
    a = a.copy(deep=True)
    a["weights"][1, 0, 2, 5, :] = 0.0
    found = compare(a, b)
    js, gap, rows = long_way(weights_a, weights_b, padded, skipped={(0, 0, 1, 3), (1, 0, 2, 5)})
    np.testing.assert_allclose(found["js"].values, js, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(found["max_abs"].values, gap, rtol=1e-5, atol=1e-5)
    assert found["rows"].values[0, 1] == found["rows"].values[1, 2] == 19
    a["sample_mask"][:, 1, :] = True  # as if the model had blocked every key of sample 1
    found = compare(a, b)
    js, gap, rows = long_way(
        weights_a, weights_b, padded | (np.arange(2) == 1)[:, None], {(0, 0, 1, 3), (1, 0, 2, 5)}
    )
    np.testing.assert_array_equal(found["rows"].values, rows)
    assert rows.max() == 12 and rows[0, 1] == 11
    np.testing.assert_allclose(found["js"].values, js, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(found["max_abs"].values, gap, rtol=1e-5, atol=1e-5)


def test_identical_captures_do_not_differ():
    model, args, kwargs = zoo.case("bert_padding").build()
    a = attnpanel.capture(model, *args, **kwargs)
    again = attnpanel.capture(model, *args, **kwargs)
    for found in (compare(a, a), compare(a, again)):
        assert (found["js"].values == 0).all() and (found["max_abs"].values == 0).all()
        assert (found["difference"].values == 0).all()
    one = compare(a.isel(layer=1), again.isel(layer=1))
    assert one["js"].dims == ("head",) and (one["js"].values == 0).all()
    assert str(one["layer"].values) == "encoder.layer.1.attention.self"


def test_a_dense_and_a_virtual_capture_of_one_model():
    """The virtual trace's weights are recomputed tile by tile: the same within float32."""
    model, args, kwargs = zoo.case("nanogpt_sdpa_causal").build()
    dense = attnpanel.capture(model, *args, dense=True, **kwargs)
    lazy = attnpanel.capture(model, *args, dense=False, **kwargs)
    found = compare(dense, lazy)
    assert hasattr(found["difference"].data, "dask")  # the map stays lazy
    assert np.abs(found["difference"].values).max() < 1e-6
    assert found["js"].values.max() < 1e-10 and found["max_abs"].values.max() < 1e-6
    assert (found["rows"].values == 24).all()  # causal: no row is empty


def test_bfloat16_against_float32_is_small_but_not_nothing():
    model, args, kwargs = zoo.case("llama_gqa_rotary").build()
    half = copy.deepcopy(model).to(torch.bfloat16)
    found = compare(
        attnpanel.capture(model, *args, **kwargs), attnpanel.capture(half, *args, **kwargs)
    )
    assert found.attrs["a"].endswith("(float32)") and found.attrs["b"].endswith("(bfloat16)")
    assert 0 < found["js"].values.min() and found["js"].values.max() < 1e-5
    assert 0 < found["max_abs"].values.min() and found["max_abs"].values.max() < 1e-2
    ranked = found["js"].to_series().sort_values(ascending=False)
    assert ranked.iloc[0] == found["js"].values.max()


def test_encoder_decoder_trees_are_compared_group_by_group():
    case, (a, b), (own_a, own_b) = two_checkpoints("bart")
    found = compare(a, b, labels=("before", "after"))
    assert isinstance(found, xr.DataTree) and found.attrs["a"] == "before"
    groups = [node.path.lstrip("/") for node in found.subtree if node.has_data]
    assert groups == [node.path.lstrip("/") for node in a.subtree if node.has_data]
    for group in groups:
        names = [str(n) for n in a[group]["layer"].values]
        shape = a[group]["weights"].shape
        js, gap, _ = long_way(
            [own_a[n] for n in names], [own_b[n] for n in names], np.zeros((shape[1], shape[3]))
        )
        np.testing.assert_allclose(found[group]["js"].values, js, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(found[group]["max_abs"].values, gap, rtol=1e-5, atol=1e-5)
    cross = found["decoder.layers.encoder_attn"]["difference"]
    assert cross.sizes["query"] == 7 and cross.sizes["key"] == 10
    partial = xr.DataTree.from_dict(
        {
            node.path: node.to_dataset()
            for node in a.subtree
            if node.has_data and "encoder_attn" not in node.path
        }
    )
    with pytest.raises(
        ValueError, match="different groups: only in b: 'decoder.layers.encoder_attn'"
    ):
        compare(partial, b)
    with pytest.raises(ValueError, match="a is a DataTree and b is a Dataset"):
        compare(a, b["encoder.layers.self_attn"].to_dataset())


def captured_bert(attention_mask=None, tokens=None, input_ids=None):
    model, args, kwargs = zoo.case("bert_padding").build()
    kwargs = dict(kwargs)
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    if input_ids is not None:
        kwargs["input_ids"] = input_ids
    return attnpanel.capture(model, *args, tokens=tokens, **kwargs)


def test_captures_of_other_inputs_are_refused():
    words = [[f"w{i}" for i in range(12)] for _ in range(2)]
    a = captured_bert(tokens=words)
    other = copy.deepcopy(words)
    other[1][3] = "cat"
    with pytest.raises(
        ValueError, match=r"'token' differ \(at batch 1, position 3: 'w3' in a, 'cat' in b\)"
    ):
        compare(a, captured_bert(tokens=other))
    mask = zoo.BERT_MASK.clone()
    mask[1, 8] = 1  # sample 1 is 9 tokens long, not 8
    with pytest.raises(ValueError, match="'padding' differ .*batch 1, position 8"):
        compare(a, captured_bert(attention_mask=mask, tokens=words))
    unpadded = captured_bert(attention_mask=torch.ones_like(mask), tokens=words)
    assert "padding" not in unpadded  # no position padded: the capture records none
    with pytest.raises(ValueError, match="a pads 4 positions, b records no padding"):
        compare(a, unpadded)
    nilm, args, kwargs = zoo.case("nilmformer_real").build()
    steps = np.arange(49)  # its attention's positions: the statistics token and 48 steps
    days = np.datetime64("2024-01-01T00:00") + steps * np.timedelta64(1, "m")
    one = attnpanel.capture(nilm, *args, time=days, **kwargs)
    later = attnpanel.capture(nilm, *args, time=days + np.timedelta64(1, "D"), **kwargs)
    with pytest.raises(ValueError, match="'time' differ .*position 0: 2024-01-01T00:00.* in a"):
        compare(one, later)


def test_captures_of_other_shapes_and_layers_are_refused():
    model, args, kwargs = zoo.case("bert_padding").build()
    a = attnpanel.capture(model, *args, **kwargs)
    shorter = {k: v[:, :10] for k, v in kwargs.items()}
    with pytest.raises(ValueError, match="differ in shape: 10 queries in a, 12 in b; 10 keys"):
        compare(attnpanel.capture(model, *args, **shorter), a)
    fewer = {k: v[:1] for k, v in kwargs.items()}
    with pytest.raises(ValueError, match="differ in shape: 2 samples in a, 1 in b"):
        compare(a, attnpanel.capture(model, *args, **fewer))
    with pytest.raises(ValueError, match="differ in shape: 2 heads in a, 4 in b"):
        compare(a.isel(head=[0, 1]), a)
    with pytest.raises(ValueError, match=r"different layers: 2 layers \('encoder.layer.0"):
        compare(a, a.isel(layer=[0]))
    renamed = a.assign_coords(layer=["one", "two"])
    with pytest.raises(ValueError, match=r"different layers: .* in a, 2 layers \('one', 'two'\)"):
        compare(a, renamed)
    with pytest.raises(ValueError, match="different layers: 2 layers .* 1 layer"):
        check_comparable(a, a.isel(layer=0))
    with pytest.raises(ValueError, match=r"a is a capture with a 'layer' dim .* a.isel\(layer=0\)"):
        compare(a.isel(layer=[1]), a.isel(layer=1))
    with pytest.raises(TypeError, match="got ndarray"):
        compare(a, a["weights"].values)

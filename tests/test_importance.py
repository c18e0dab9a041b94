"""Head importance (``attnpanel.head_importance``): exact ablation, the gradient estimate,
threads and a dask cluster, each against a computation written out."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import zoo
from scipy.stats import spearmanr
from test_ablation import run
from torch import nn

import attnpanel
from attnpanel.interventions.gate import AblationError, attention_heads
from attnpanel.interventions.importance import output_tensor


def squared(y: torch.Tensor) -> torch.Tensor:
    return y.double().pow(2).mean()


@pytest.fixture(scope="module")
def nilmformer():
    return zoo.case("nilmformer_real").build()


def test_ablation_importance_is_each_head_switched_off_alone(nilmformer):
    """Exactly: its forwards after the first hook and watch only the attention modules
    (the rest of the model outside the mode), with the same numbers as ``ablate``, which
    watches every call."""
    model, args, kwargs = nilmformer
    importance = attnpanel.head_importance(model, *args, progress=False)
    assert importance.dims == ("layer", "head")
    assert list(importance["layer"].values) == list(attention_heads(model, *args))
    plain = run(model, args, kwargs)
    for layer in importance["layer"].values:
        for head in (0, 5):
            with torch.no_grad(), attnpanel.ablate(model, {str(layer): [head]}):
                ablated = model(*args)
            expected = float((plain.double() - ablated.double()).norm() / plain.double().norm())
            assert float(importance.sel(layer=layer, head=head)) == expected
    assert importance.attrs["forwards"] == 2 * 8 + 2
    assert importance.attrs["measure"] == "||y - y_ablated|| / ||y||"


def test_a_padded_fused_encoder_is_ranked_on_one_path():
    """``nn.TransformerEncoder`` with a padding mask runs fused and nested (padded rows 0)
    outside a mode, unfused inside one: the baseline runs where the ablated forwards run,
    so a head's importance is its own change (every head once read 0.50: the two paths'
    padded rows)."""
    model, args, kwargs = zoo.case("torch_encoder_padding").build()
    importance = attnpanel.head_importance(model, *args, progress=False, **kwargs)
    with torch.no_grad(), attnpanel.ablate(model, {}):
        plain = model(*args, **kwargs).double()
    for layer in importance["layer"].values:
        for head in range(importance.sizes["head"]):
            with torch.no_grad(), attnpanel.ablate(model, {str(layer): [head]}):
                ablated = model(*args, **kwargs).double()
            expected = float((plain - ablated).norm() / plain.norm())
            assert float(importance.sel(layer=layer, head=head)) == pytest.approx(expected)
    assert float(importance.max()) < 0.4  # not the paths' difference


def test_a_score_gives_its_signed_change(nilmformer):
    model, args, kwargs = nilmformer
    importance = attnpanel.head_importance(model, *args, score=squared, how="mean", progress=False)
    layer = str(importance["layer"].values[1])
    plain = float(squared(run(model, args, kwargs)))
    with torch.no_grad(), attnpanel.ablate(model, {layer: [3]}, how="mean"):
        ablated = float(squared(model(*args)))
    assert float(importance.sel(layer=layer, head=3)) == pytest.approx(plain - ablated)
    assert (importance < 0).any() and (importance > 0).any()  # signed, not a norm


def test_the_gradient_estimate_is_d_score_d_gate(nilmformer):
    """Against the long way: a gate multiplied into the out projection's input lane."""
    model, args, _ = nilmformer
    estimate = attnpanel.head_importance(model, *args, score=squared, method="gradient")
    assert estimate.attrs["forwards"] == 2
    layer = "EncoderBlock.0.attention_layer"
    projection = model.get_submodule(f"{layer}.wo")
    gate = torch.ones(8, requires_grad=True)

    def hook(_module, inputs):
        merged = inputs[0]
        lanes = merged.reshape(*merged.shape[:-1], 8, -1) * gate[:, None]
        return (lanes.reshape(merged.shape),)

    handle = projection.register_forward_pre_hook(hook)
    try:
        (grad,) = torch.autograd.grad(squared(model(*args)), [gate])
    finally:
        handle.remove()
    np.testing.assert_allclose(estimate.sel(layer=layer).values, grad.abs().numpy(), rtol=1e-5)
    assert all(p.grad is None for p in model.parameters())  # the model's grads untouched


def test_the_gradient_ranks_heads_as_the_exact_ablation(nilmformer):
    model, args, _ = nilmformer
    exact = attnpanel.head_importance(model, *args, score=squared, progress=False)
    estimate = attnpanel.head_importance(model, *args, score=squared, method="gradient")
    rho = spearmanr(np.abs(exact.values).ravel(), estimate.values.ravel()).statistic
    assert rho > 0.8  # measured 0.99 on this model (docs/importance.md has the zoo's)


class TwoSizes(nn.Module):
    """Two attention layers of 2 and 4 heads."""

    def __init__(self):
        super().__init__()
        self.small = nn.MultiheadAttention(8, 2, batch_first=True)
        self.large = nn.MultiheadAttention(8, 4, batch_first=True)

    def forward(self, x):
        x = x + self.small(x, x, x, need_weights=False)[0]
        return x + self.large(x, x, x, need_weights=False)[0]


def test_layers_of_fewer_heads_are_padded_with_nan():
    torch.manual_seed(0)
    model = TwoSizes().eval()
    importance = attnpanel.head_importance(model, torch.randn(2, 5, 8), progress=False)
    assert importance.sizes == {"layer": 2, "head": 4}
    assert np.isnan(importance.sel(layer="small", head=[2, 3])).all()
    assert np.isfinite(importance.sel(layer="large")).all()


def test_modes_are_restored_and_bad_requests_refused(nilmformer):
    model, args, _ = nilmformer
    model.train()
    try:
        attnpanel.head_importance(model, *args, method="gradient")
        assert all(m.training for m in model.modules())
    finally:
        model.eval()
    with pytest.raises(AblationError, match="method='taylor'"):
        attnpanel.head_importance(model, *args, method="taylor")
    with pytest.raises(AblationError, match="how='half'"):
        attnpanel.head_importance(model, *args, how="half")
    with pytest.raises(AblationError, match="computed no attention"):
        attnpanel.head_importance(nn.Linear(3, 3), torch.randn(2, 3), progress=False)
    with pytest.raises(TypeError, match="holds no tensor"):
        output_tensor({"a": "text"})


def test_threads_ablating_one_model_at_once_keep_to_their_own_heads(nilmformer):
    """A served model is shared by sessions: each thread's ablation is its own."""
    model, args, kwargs = nilmformer
    layer = "EncoderBlock.1.attention_layer"
    serial = {}
    for head in range(4):
        with torch.no_grad(), attnpanel.ablate(model, {layer: [head]}):
            serial[head] = model(*args)
    plain = run(model, args, kwargs)
    found, errors = {}, []

    def work(head):
        try:
            for _ in range(5):
                if head is None:
                    found[head] = run(model, args, kwargs)
                    continue
                with torch.no_grad(), attnpanel.ablate(model, {layer: [head]}):
                    found[head] = model(*args)
        except Exception as err:  # noqa: BLE001 - reported by the assertion below
            errors.append(err)

    fastpath = torch.backends.mha.get_fastpath_enabled()
    # several rounds: a thread's forward could call a hook another thread was registering,
    # in torch's convention without kwargs (a TypeError in one round of about thirty)
    for _ in range(8):
        found.clear()
        threads = [threading.Thread(target=work, args=(h,)) for h in [*range(4), None]]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        for head in range(4):
            assert torch.equal(found[head], serial[head])
        assert torch.equal(found[None], plain)
    # one process-wide flag, switched off by the first and restored by the last one out
    assert torch.backends.mha.get_fastpath_enabled() == fastpath


@pytest.mark.slow
def test_a_two_worker_cluster_gives_the_same_ranking(nilmformer):
    from dask.distributed import Client, LocalCluster

    model, args, _ = nilmformer
    here = attnpanel.head_importance(model, *args, score=squared, progress=False)
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=2, processes=True, dashboard_address=None
        ) as cluster,
        Client(cluster) as client,
    ):
        there = attnpanel.head_importance(model, *args, score=squared, client=client)
    np.testing.assert_allclose(there.values, here.values, rtol=1e-12)


def test_overlapping_users_of_a_shared_model_keep_it_in_eval_and_frozen():
    """A served model is shared by the sessions' threads. Session A enters, B enters, A
    leaves while B runs: A used to switch the model back to training (dropout on in the
    middle of B's forward) and its parameters back to requiring gradients. The last one
    out restores both."""
    import threading

    from attnpanel.capturing.modes import evaluating
    from attnpanel.interventions.importance import probing

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    model.train()
    inside, a_left, b_done = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def session_b():
        with evaluating(model), probing(model):
            inside.set()
            a_left.wait(10)
            seen["training"] = [m.training for m in model.modules()]
            seen["grad"] = [p.requires_grad for p in model.parameters()]
            x = torch.ones(1, 4)
            seen["same"] = torch.equal(model(x), model(x))  # no dropout: the same output
        b_done.set()

    with evaluating(model), probing(model):
        thread = threading.Thread(target=session_b)
        thread.start()
        assert inside.wait(10)
    a_left.set()  # A is out; B still runs
    assert b_done.wait(10)
    thread.join()
    assert seen == {"training": [False, False, False], "grad": [False, False], "same": True}
    assert [m.training for m in model.modules()] == [True, True, True]  # restored by B
    assert all(p.requires_grad for p in model.parameters())


def test_a_capture_ending_in_one_session_leaves_the_model_in_eval_for_another():
    """Session A captures a model that is in training mode; session B enters its own eval
    block meanwhile. A's capture used to switch the modules back to training on its way
    out, under B. The model goes back to training only when B is done too."""
    import threading

    from attnpanel.capturing.modes import evaluating

    class Waiting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = torch.nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)
            self.entered, self.gate = threading.Event(), threading.Event()

        def forward(self, x):
            out = self.mha(x, x, x)[0]
            if threading.current_thread() is not threading.main_thread():
                self.entered.set()  # session A is in the middle of its capture
                self.gate.wait(10)
            return out

    model = Waiting().train()
    captured = []
    a = threading.Thread(
        target=lambda: captured.append(attnpanel.capture(model, torch.ones(1, 3, 8)))
    )
    a.start()
    assert model.entered.wait(10)
    with evaluating(model):  # session B
        model.gate.set()
        a.join(10)
        assert captured and not any(m.training for m in model.modules())  # A is out
    assert all(m.training for m in model.modules())  # B was the last: restored


def test_a_model_already_in_eval_is_not_switched_again():
    """A wrapper's ``eval()`` (TransformerLens' bridge: 2.4 ms) can cost a tenth of a small
    model's forward, and every patching or ranking call asks for eval mode: a model in eval
    already is left alone; one training is switched, and switched back after."""
    from attnpanel.capturing.modes import evaluating

    calls = []

    class Counted(nn.Linear):
        def train(self, mode: bool = True):
            calls.append(mode)
            return super().train(mode)

    model = Counted(2, 2).eval()
    calls.clear()
    with evaluating(model):
        assert not model.training
    assert calls == []
    model.train()
    calls.clear()
    with evaluating(model):
        assert not model.training
    assert calls == [False] and model.training

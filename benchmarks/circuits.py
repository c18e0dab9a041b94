"""Time of ``attnpanel.circuits`` (every head's QK and OV circuits and the Q-, K- and
V-composition scores of every pair of heads of successive layers) on a 12-layer x 12-head
model of BERT-base's shapes (d_model 768, head_dim 64), from its weights, beside in the
same rounds:

* TransformerLens' own ``all_composition_scores`` (its ``FactoredMatrix``: low-rank, head
  pair by head pair) for the three modes, on its own native model of the same shapes
  (built offline with ``TransformerBridge.boot_native``);
* the dense product: each head's ``d x d`` OV matrix times the later head's ``d x d``
  matrix, pair by pair, timed on the pairs of the first layer (``11 x 12 x 12``) and scaled
  to every pair (the whole takes minutes).

The scores of the first two agree (``tests/test_circuits.py`` checks them to 1e-5). Issue
#48's target: < 1 s here with low-rank factors. Run from the repository root::

    python benchmarks/circuits.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from transformer_lens.model_bridge import TransformerBridge

from attnpanel.kernels.circuits import (
    COMPOSITIONS,
    Factored,
    composition_scores,
    head_circuits,
    later_circuit,
)
from attnpanel.readouts.circuits import NEEDS, stream_circuits, tensor

LAYERS, HEADS, WIDTH, HEAD_DIM = 12, 12, 768, 64


def tl_model():
    config = dict(
        n_layers=LAYERS, d_model=WIDTH, n_ctx=64, d_head=HEAD_DIM, n_heads=HEADS, d_vocab=100,
        act_fn="relu", attn_only=True, normalization_type=None, seed=0, d_mlp=None,
    )  # fmt: skip
    return TransformerBridge.boot_native(config).eval()


def weights_of(model):
    """The native model's weights as a trace holds them (``nn.Linear.weight``)."""
    import xarray as xr

    w_q, w_k, w_v = (getattr(model, n).detach() for n in ("W_Q", "W_K", "W_V"))  # (L,H,d,E)
    w_o = model.W_O.detach()  # (L, H, E, d)
    per = {n: w.permute(0, 1, 3, 2).reshape(LAYERS, HEADS * HEAD_DIM, WIDTH)
           for n, w in (("w_q", w_q), ("w_k", w_k), ("w_v", w_v))}  # fmt: skip
    per["w_o"] = w_o.reshape(LAYERS, HEADS * HEAD_DIM, WIDTH).permute(0, 2, 1)
    dims = ("layer", "feature_out", "feature_in")
    return xr.Dataset({n: (dims, w.numpy()) for n, w in per.items()}).assign_coords(
        head=np.arange(HEADS)
    )


def dense_first_layer(model) -> float:
    """Seconds of the dense products of layer 0's heads with every later head, 3 modes."""
    ov = Factored(model.W_V.detach(), model.W_O.detach()).dense()  # (L, H, d, d)
    qk = Factored(model.W_Q.detach(), model.W_K.detach().mT).dense()
    start = time.perf_counter()
    with torch.no_grad():
        for right in (qk, qk.mT, ov):
            for head in range(HEADS):
                left = ov[0, head]
                product = left @ right[1:]  # (L-1, H, d, d)
                torch.linalg.matrix_norm(product) / (
                    torch.linalg.matrix_norm(left) * torch.linalg.matrix_norm(right[1:])
                )
    return time.perf_counter() - start


def row(name, times, base) -> str:
    median, p95 = statistics.median(times), float(np.percentile(times, 95))
    return f"| {name} | {median:.3f} | {p95:.3f} | {median / base:.2f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model = tl_model()
    trace = weights_of(model)
    ours, theirs, scores = [], [], []
    qk, ov = head_circuits(*(tensor(trace[name]) for name in NEEDS), heads=HEADS)
    for _ in range(args.repeats):
        start = time.perf_counter()
        composition_scores(ov, [later_circuit(qk, ov, mode) for mode in COMPOSITIONS])
        scores.append(time.perf_counter() - start)
        start = time.perf_counter()
        stream_circuits(trace)
        ours.append(time.perf_counter() - start)
        start = time.perf_counter()
        with torch.no_grad():
            for mode in COMPOSITIONS:
                model.all_composition_scores(mode)
        theirs.append(time.perf_counter() - start)
    first = dense_first_layer(model)
    pairs_first = (LAYERS - 1) * HEADS * HEADS
    pairs_all = sum(LAYERS - 1 - layer for layer in range(LAYERS)) * HEADS * HEADS
    dense = first * pairs_all / pairs_first
    base = statistics.median(theirs)
    print(
        f"composition scores (Q, K, V) of {LAYERS} layers x {HEADS} heads, d_model {WIDTH}, "
        f"head_dim {HEAD_DIM}: {pairs_all} pairs of heads per mode, "
        f"{torch.get_num_threads()} torch threads"
    )
    print("| what | median (s) | p95 (s) | x TransformerLens |")
    print("| --- | --- | --- | --- |")
    print(row("TransformerLens all_composition_scores, 3 modes (baseline)", theirs, base))
    print(row("attnpanel composition scores alone, 3 modes (the target: < 1 s)", scores, base))
    print(row("attnpanel.circuits (+ singular values, copying, baseline)", ours, base))
    print(
        f"| dense d x d products, 3 modes (layer 0's {pairs_first} pairs took {first:.2f} s; "
        f"scaled to all) | {dense:.1f} | - | {dense / base:.1f} |"
    )


if __name__ == "__main__":
    main()

"""Time of ``attnpanel.score_attribution`` of one cell with S steps, beside the plain
forward and backward of the same model on one sample in the same rounds.

The demo NILMFormer (3 layers x 8 heads, 480 steps, its aggregate power and 16 time
features), the cell (query 200, key 100) of head 3 of its last layer (``encoder.2``: the
forward runs nearly whole) and of its first (``encoder.0``: the attribution's forward stops
there), of the query's whole row (``key=None``: its scores weighted by the model's own
weights, one backward per step as for a cell) and of the whole map (``query=None`` too).
Issue #48's budgets: one cell with S steps <= S x 1.2 x (forward + backward); a whole row
<= 1.5 x one cell.

The attribution runs its S steps as batches of ``CHUNK`` rows (one forward each, up to the
layer) and takes two backward passes per batch (the query side's and the key side's). Run
from the repository root::

    python benchmarks/attribution.py [--steps 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch

from attnpanel.interventions.attribution import score_attribution
from attnpanel.nilm.demo import demo_model_run


def timed(call, repeats: int) -> list[float]:
    import time

    found = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        found.append(time.perf_counter() - start)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    run = demo_model_run(n_windows=2)
    model = run.model.eval()
    one = [t[:1] for t in run.inputs]

    def forward_backward():
        inputs = [t.clone().requires_grad_(True) for t in one]
        model(*inputs).sum().backward()

    base = timed(forward_backward, args.repeats)
    print(
        f"demo NILMFormer, one sample of 480 steps, {torch.get_num_threads()} torch threads; "
        f"S = {args.steps} steps"
    )
    print("| what | median (s) | p95 (s) | x S (forward + backward) | budget 1.2 |")
    print("| --- | --- | --- | --- | --- |")
    unit = statistics.median(base)
    print(
        f"| forward + backward, one sample (baseline) | {unit:.4f} | "
        f"{np.percentile(base, 95):.4f} | {1 / args.steps:.3f} | - |"
    )
    cells = {}
    asked = {"one cell": (200, 100), "the whole row (480 keys)": (200, None),
             "the whole map (480 x 480)": (None, None)}  # fmt: skip
    for layer in ("encoder.2.attention", "encoder.0.attention"):
        for what, (query, key) in asked.items():
            times = timed(
                lambda layer=layer, query=query, key=key: score_attribution(
                    model, one, layer=layer, head=3, query=query, key=key, steps=args.steps
                ),
                args.repeats,
            )
            median = statistics.median(times)
            ratio = median / (args.steps * unit)
            verdict = "holds" if ratio <= 1.2 else "over"
            if key is not None:
                cells[layer] = median
            else:  # issue #48: a row (and the map) at most 1.5x one cell
                row = median / cells[layer]
                verdict += f"; {row:.2f}x the cell ({'holds' if row <= 1.5 else 'over'} 1.5)"
            print(
                f"| score_attribution, {layer}, {what} | {median:.3f} | "
                f"{np.percentile(times, 95):.3f} | {ratio:.2f} | {verdict} |"
            )


if __name__ == "__main__":
    main()

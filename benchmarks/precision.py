"""How close each zoo model's captured weights are to the truth, beside the derived bound.

For every model of ``tests/zoo.py`` (offline) and every layer: the largest logit
``max|scale q.k + bias|`` over the cells not masked, the two-kernel bound
``attnpanel.kernels.precision.softmax_bound`` in the model's dtype, and the largest differences of
the captured weights and the model's own (its eager ``output_attentions`` or reference)
against a float64 recomputation from the trace's q, k and mask, and against each other.
The last column is how many times the measured kernel-to-kernel difference fits in the
bound (the margin the tests keep on this machine). It also prints the CPU it ran on.

Run from the repository root::

    python benchmarks/precision.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import numerics  # noqa: E402
import numpy as np  # noqa: E402
import zoo  # noqa: E402

import attnpanel  # noqa: E402
from attnpanel.traces import layers


def cpu() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown CPU"
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    vector = [f for f in flags if f.startswith(("avx", "fma", "sse4", "amx"))]
    return f"{fields.get('Model name', '?').strip()} ({' '.join(vector)})"


def main() -> None:
    print(f"CPU: {cpu()}")
    header = "| model | dtype | max logit | bound (2 kernels) | captured - truth | model - truth "
    print(header + "| captured - model | bound / measured |")
    print("|---|---|---|---|---|---|---|---|")
    for case in zoo.CASES:
        model, args, kwargs = case.build()
        reference = dict(case.reference(model, args, kwargs))
        result = attnpanel.capture(model, *args, **kwargs)
        worst = dict(logits=0.0, captured=0.0, model=0.0, between=0.0)
        for entry in layers.layers(result):
            ds = layers.select(result, entry.name)
            own = reference[entry.name if entry.name in reference else next(iter(reference))]
            own = numerics.values_of(own)
            rows = numerics.real_rows(ds)
            truth = numerics.float64_weights(ds).values
            captured = ds["weights"].values
            worst["logits"] = max(worst["logits"], numerics.trace_logits(ds))
            worst["captured"] = max(worst["captured"], _gap(captured[rows], truth[rows]))
            worst["model"] = max(worst["model"], _gap(own[rows], truth[rows]))
            worst["between"] = max(worst["between"], _gap(captured[rows], own[rows]))
        bound = numerics.kernel_bound(worst["logits"], case.dtype)
        margin = bound / worst["between"] if worst["between"] else float("inf")
        dtype = str(case.dtype).removeprefix("torch.")
        print(
            f"| {case.name} | {dtype} | {worst['logits']:.2f} | {bound:.2e} "
            f"| {worst['captured']:.2e} | {worst['model']:.2e} | {worst['between']:.2e} "
            f"| {margin:.1f} |"
        )


def _gap(a: np.ndarray, b: np.ndarray) -> float:
    both = np.isfinite(a) & np.isfinite(b)
    return float(np.abs(a[both] - b[both]).max()) if both.any() else 0.0


if __name__ == "__main__":
    main()

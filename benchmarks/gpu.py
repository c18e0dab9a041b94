"""The CUDA path: capture, ablation, patching, importance, the survey and the tiles on a model
on the GPU, each beside the same call on the CPU (the numbers must agree), timed beside the
plain forward of the same run on the same device.

Models, built offline:

* ``demo``: the trained demo NILMFormer (SDPA attention, diagonal mask), 8 held-out windows
  of 480 steps; the corrupted input is the same windows without the kettle (the generator's
  ground truth);
* ``bert``: a Hugging Face BERT from a config (2 layers x 4 heads, eager attention, so its
  own ``output_attentions`` is the reference), 4 padded sequences of 24 tokens;
* ``llama``: a Hugging Face Llama from a config on SDPA with grouped-query attention (4
  query heads, 2 key/value heads), 4 sequences of 32 tokens;
* ``mha``: ``nn.TransformerEncoder`` (``nn.MultiheadAttention``), 2 layers x 4 heads.

For each: capture (weights against the CPU's and, for ``bert``, against the model's own
``output_attentions`` on the GPU), switching a head off (the output changes, as on the CPU),
exact and attribution patching (``patching_effect``, against the CPU's), and for ``demo``
the head importance and the survey. The tiles: the fused kernel (``tiles.attention``) and
one head's 480 x 480 overview at ``--long`` positions on the GPU against the CPU.

Every comparison prints its largest difference and the tolerance it is held to (float32
on two devices: cuBLAS and SDPA's kernels sum in another order); the script exits 1 when
any fails. Times: median over ``--repeats`` calls, ``torch.cuda.synchronize`` around each.

Run from the repository root on a machine with a GPU::

    python benchmarks/gpu.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import torch
from torch import nn

import attnpanel
from attnpanel.kernels import tiles
from attnpanel.kernels.masks import Masking

FAILED: list[str] = []


def check(name: str, got, want, tolerance: float) -> None:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        FAILED.append(name)
        print(f"  FAIL {name}: shape {got.shape} against {want.shape}")
        return
    both = np.isfinite(got) & np.isfinite(want)
    same_gaps = np.array_equal(np.isnan(got), np.isnan(want))
    diff = float(np.abs(got[both] - want[both]).max()) if both.any() else 0.0
    good = same_gaps and diff <= tolerance
    if not good:
        FAILED.append(name)
    print(f"  {'ok  ' if good else 'FAIL'} {name}: max |diff| {diff:.2e} (tolerance {tolerance:g})")


def timed(fn, device, repeats: int) -> tuple[float, float]:
    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    times = sorted(times[1:])  # the first is a warm-up
    return statistics.median(times), times[min(len(times) - 1, round(0.95 * len(times)))]


def moved(inputs, device):
    if isinstance(inputs, dict):
        return {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()}
    return tuple(v.to(device) for v in inputs)


def spread(fn, model, inputs, **kwargs):
    """``fn(model, *inputs)`` or ``fn(model, **inputs)``, as the inputs come."""
    if isinstance(inputs, dict):
        return fn(model, **inputs, **kwargs)
    return fn(model, *inputs, **kwargs)


def run(model, inputs):
    with torch.no_grad():
        out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    return out


def first_tensor(out) -> torch.Tensor:
    from attnpanel.interventions.importance import output_tensor

    return output_tensor(out)


def demo_case():
    from attnpanel.nilm.demo import demo_windows, without_appliance
    from attnpanel.nilm.nilmformer import load_model, time_features

    model = load_model().eval()
    held = demo_windows(8)
    features = time_features(held["time"].values)
    clean = (torch.from_numpy(held["aggregate"].values), features)
    corrupted = (torch.from_numpy(without_appliance(held, "kettle")), features)
    channel = list(model.config.appliances).index("kettle")
    return model, clean, corrupted, lambda y: y[:, channel].double().sum()


def bert_case():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=64, attn_implementation="eager",
    )  # fmt: skip
    model = BertModel(config).eval()
    ids = torch.randint(5, 500, (4, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 18:] = 0
    mask[3, 10:] = 0
    other = ids.clone()
    other[:, 3] = 4
    clean = {"input_ids": ids, "attention_mask": mask}
    corrupted = {"input_ids": other, "attention_mask": mask}
    # one feature of the first token (its row's norm, after LayerNorm, is the same for all)
    return model, clean, corrupted, lambda y: y[:, 0, 0].double().sum()


def llama_case():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64,
        attn_implementation="sdpa",
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 300, (4, 32), generator=torch.Generator().manual_seed(2))
    other = ids.clone()
    other[:, 5] = (other[:, 5] + 1) % 300
    return model, (ids,), (other,), lambda y: (y[:, -1, 7] - y[:, -1, 11]).double().sum()


def mha_case():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(4, 20, 32, generator=torch.Generator().manual_seed(3))
    other = x.clone()
    other[:, 4:8] = 0
    # one feature of the last position (a post-norm row sums to 0 whatever the input)
    return model, (x,), (other,), lambda y: y[:, -1, 0].double().sum()


CASES = {"demo": demo_case, "bert": bert_case, "llama": llama_case, "mha": mha_case}


def layers_of(found) -> dict:
    """``{layer name: weights (numpy)}`` of a capture (a Dataset or a DataTree)."""
    if hasattr(found, "children"):
        return {name: node.dataset["weights"].values for name, node in found.children.items()}
    weights = found["weights"]
    if "layer" not in weights.dims:
        return {str(found["layer"].values): weights.values}
    return {str(name): weights.sel(layer=name).values for name in found["layer"].values}


def own_attentions(model, inputs) -> list[np.ndarray]:
    with torch.no_grad():
        out = model(**inputs, output_attentions=True)
    return [a.float().cpu().numpy() for a in out.attentions]


def case(name: str, device, repeats: int) -> None:
    model, clean, corrupted, score = CASES[name]()
    print(f"\n{name} on {device} (against the CPU)")
    gpu_model = CASES[name]()[0].to(device)
    gpu_clean, gpu_corrupted = moved(clean, device), moved(corrupted, device)

    def grab(m, inputs):
        return spread(attnpanel.capture, m, inputs)

    on_cpu, on_gpu = layers_of(grab(model, clean)), layers_of(grab(gpu_model, gpu_clean))
    check("capture: layers", [len(on_gpu)], [len(on_cpu)], 0)
    for layer in on_cpu:
        check(f"capture {layer}: weights", on_gpu[layer], on_cpu[layer], 2e-5)
    if name == "bert":
        for own, layer in zip(own_attentions(gpu_model, gpu_clean), on_gpu, strict=True):
            batch = np.broadcast_to(own, on_gpu[layer].shape)
            check(f"capture {layer}: the model's own output_attentions", on_gpu[layer], batch, 1e-6)

    heads = spread(attnpanel.attention_heads, gpu_model, gpu_clean)
    first = next(iter(heads))
    plain = first_tensor(run(gpu_model, gpu_clean))
    with attnpanel.ablate(gpu_model, {first: [0]}):
        off = first_tensor(run(gpu_model, gpu_clean))
    with attnpanel.ablate(model, {first: [0]}):
        off_cpu = first_tensor(run(model, clean))
    changed = float((off - plain).abs().max())
    verdict = "ok  " if changed > 0 else "FAIL"
    print(f"  {verdict} ablate {first} head 0: output moves by up to {changed:.3g}")
    if changed == 0:
        FAILED.append(f"{name}: ablate changed nothing")
    check(
        f"ablate {first} head 0: output",
        off.float().cpu(),
        off_cpu.float(),
        2e-4 * float(off_cpu.abs().max()),
    )
    after = first_tensor(run(gpu_model, gpu_clean))
    check("after ablate: bit-identical", [int(torch.equal(after, plain))], [1], 0)

    effects = {}
    for method in ("exact", "attribution"):
        args = dict(score=score, method=method, progress=False)
        got = attnpanel.patching_effect(gpu_model, gpu_clean, gpu_corrupted, **args)
        want = attnpanel.patching_effect(model, clean, corrupted, **args)
        check(f"patching_effect {method}", got.values, want.values, 2e-3)
        effects[method] = got
    top = effects["exact"].stack(h=("layer", "head")).to_series().abs().nlargest(3)
    print("  largest exact effects:", ", ".join(f"{k[0]}/{k[1]} {v:.3f}" for k, v in top.items()))

    if name == "demo":
        got = attnpanel.head_importance(gpu_model, *gpu_clean, progress=False)
        want = attnpanel.head_importance(model, *clean, progress=False)
        check("head_importance (ablation)", got.values, want.values, 1e-4)
    gradient = dict(method="gradient", progress=False)
    got = spread(attnpanel.head_importance, gpu_model, gpu_clean, **gradient)
    want = spread(attnpanel.head_importance, model, clean, **gradient)
    check("head_importance (gradient)", got.values, want.values, 1e-4 * float(abs(want).max()))
    got = spread(attnpanel.attention_gradients, gpu_model, gpu_clean, score=score)
    want = spread(attnpanel.attention_gradients, model, clean, score=score)
    check("attention_gradients", got.values, want.values, 1e-3 * float(abs(want).max()))
    got = spread(attnpanel.head_roles, gpu_model, gpu_clean)
    want = spread(attnpanel.head_roles, model, clean)
    for stat in ("previous_token", "sink_rate", "offset_weight"):
        if stat in want:
            check(f"head_roles {stat}", got[stat].values, want[stat].values, 1e-4)
    same = bool((got["role"].values == want["role"].values).all())
    print(f"  {'ok  ' if same else 'FAIL'} head_roles role: the same label for every head")
    if not same:
        FAILED.append(f"{name}: head_roles role")
    got = attnpanel.survey(gpu_model, [gpu_clean], progress=False)
    want = attnpanel.survey(model, [clean], progress=False)
    for stat in ("entropy", "distance", "sink", "max_weight", "previous_token", "offset_weight"):
        if stat in want:
            check(f"survey {stat}", got[stat].values, want[stat].values, 1e-3)

    forward = timed(lambda: run(gpu_model, gpu_clean), device, repeats)
    cap = timed(lambda: grab(gpu_model, gpu_clean), device, repeats)

    def patching(method: str):
        return attnpanel.patching_effect(
            gpu_model, gpu_clean, gpu_corrupted, score=score, method=method, progress=False
        )

    exact = timed(lambda: patching("exact"), device, max(3, repeats // 3))
    attr = timed(lambda: patching("attribution"), device, max(3, repeats // 3))
    n_heads = sum(heads.values())
    print(
        f"  times on {device}: forward {forward[0] * 1e3:.2f} ms (p95 {forward[1] * 1e3:.2f}); "
        f"capture {cap[0] * 1e3:.1f} ms ({cap[0] / forward[0]:.1f}x); exact patching of "
        f"{n_heads} heads {exact[0] * 1e3:.0f} ms ({exact[0] / forward[0]:.1f} forwards, budget "
        f"{(n_heads + 2) * 1.2:.1f}); attribution {attr[0] * 1e3:.1f} ms "
        f"({attr[0] / forward[0]:.1f} forwards)"
    )


def traces_case(device) -> None:
    """``attnpanel.trace`` of a layer on the GPU, dense and virtual, against the CPU's, and
    a window of the virtual trace's weights against the dense map."""
    from attnpanel.kernels.attention import MultiHeadSelfAttention
    from attnpanel.traces import virtual

    print(f"\ntraces of a layer (d_model 96, 8 heads, diagonal) on {device}")
    torch.manual_seed(0)
    layer = MultiHeadSelfAttention(96, 8, "diagonal").eval()
    x = torch.randn(2, 480, 96, generator=torch.Generator().manual_seed(4))
    want = attnpanel.trace(layer, x, dense=True)
    gpu_layer = MultiHeadSelfAttention(96, 8, "diagonal").eval()
    gpu_layer.load_state_dict(layer.state_dict())
    gpu_layer, gx = gpu_layer.to(device), x.to(device)
    got = attnpanel.trace(gpu_layer, gx, dense=True)
    for name in ("q", "k", "weights", "output"):
        check(f"trace {name}", got[name].values, want[name].values, 2e-5)
    for stage in ("raw", "softmax"):
        redone = attnpanel.attention_stage(got, stage, batch=1)
        check(
            f"attention_stage {stage} from the trace",
            redone,
            want["scores" if stage == "raw" else "weights"].isel(batch=1).values,
            2e-4,
        )
    lazy = attnpanel.trace(gpu_layer, gx, dense=False)
    tile = virtual.window(lazy, 1, 3, slice(100, 340), slice(0, 480))
    check("virtual trace window", tile, want["weights"].isel(batch=1, head=3).values[100:340], 1e-6)


def tiles_case(device, length: int, repeats: int) -> None:
    print(f"\ntiles: one sample, 8 heads x {length} positions, diagonal mask, on {device}")
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, length, 12, generator=generator) for _ in range(3))
    masking = Masking(mode="diagonal")
    out_cpu, lse_cpu = tiles.attention(q, k, v, masking)
    dq, dk, dv = q.to(device), k.to(device), v.to(device)
    out_gpu, lse_gpu = tiles.attention(dq, dk, dv, masking)
    check("tiles.attention: output", out_gpu.cpu(), out_cpu, 1e-5)
    check("tiles.attention: lse", lse_gpu.cpu(), lse_cpu, 1e-4)
    over_cpu = tiles.overview(q[:, :1], k[:, :1], lse_cpu[:, :1], masking)
    over_gpu = tiles.overview(dq[:, :1], dk[:, :1], lse_gpu[:, :1], masking)
    for field in ("max", "mean"):
        got, want = getattr(over_gpu, field), getattr(over_cpu, field)
        got = got.cpu() if torch.is_tensor(got) else got
        check(f"overview {field} (480 x 480)", got, want, 1e-5)
    fused = timed(lambda: tiles.attention(dq, dk, dv, masking), device, repeats)
    cpu_fused = timed(lambda: tiles.attention(q, k, v, masking), torch.device("cpu"), 1)
    over = timed(
        lambda: tiles.overview(dq[:, :1], dk[:, :1], lse_gpu[:, :1], masking), device, repeats
    )
    print(
        f"  times: fused attention {fused[0] * 1e3:.1f} ms on {device} (p95 {fused[1] * 1e3:.1f}), "
        f"{cpu_fused[0] * 1e3:.0f} ms on the CPU; one head's overview {over[0] * 1e3:.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--long", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument(
        "--tf32", action="store_true", help="let cuDNN's convolutions run in TF32 (its default)"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    # cuDNN runs float32 convolutions in TF32 by default (10-bit mantissa): a model with a
    # convolution (the demo's embedding) then computes another attention on the GPU than
    # on the CPU, before attnpanel reads it. Off, the two devices differ by rounding only.
    torch.backends.cudnn.allow_tf32 = args.tf32
    if device.type == "cuda":
        print(torch.cuda.get_device_name(device), "torch", torch.__version__)
    for name in args.cases:
        try:
            case(name, device, args.repeats)
        except Exception as error:  # one case's failure is reported, the others still run
            FAILED.append(f"{name}: {type(error).__name__}")

            traceback.print_exc()
    for extra in (lambda: traces_case(device), lambda: tiles_case(device, args.long, args.repeats)):
        try:
            extra()
        except Exception as error:
            FAILED.append(f"{type(error).__name__}")

            traceback.print_exc()
    print("\nall checks passed" if not FAILED else f"\nFAILED: {', '.join(FAILED)}")
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()

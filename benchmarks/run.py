"""Time and peak memory of ``trace`` and of a one-sample mask recompute, beside plain torch.

Memory: each case runs once in a fresh Python process whose resident high-water mark
(``VmHWM``, reset after setup; ``ru_maxrss`` where /proc is missing) sees torch's
allocations, which tracemalloc does not; the table gives the most one call added.
Time: all cases are set up in one process and called in turn, ``--repeats`` rounds after
a warm-up, so background load on a shared machine hits every case alike; the table gives
medians and their ratio to a plain-torch baseline measured in the same run.

Run from the repository root::

    python benchmarks/run.py
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CASES = {
    # name: (group, description)
    "torch_sdpa_output": ("layer", "plain torch: projections + SDPA, output only"),
    "torch_einsum_weights": ("layer", "plain torch: einsum softmax, output + weights"),
    "torch_mha_weights": ("layer", "nn.MultiheadAttention, need_weights per head"),
    "layer_forward": ("layer", "attnpanel layer forward (fused path)"),
    "trace": ("layer", "attnpanel.trace -> xarray.Dataset, every stage"),
    "torch_einsum_one_sample": ("recompute", "plain torch: one sample's weights, new mask"),
    "recompute_one_sample": ("recompute", "attnpanel.recompute_weights(batch=0), new mask"),
}
BASELINE = {"layer": "torch_einsum_weights", "recompute": "torch_einsum_one_sample"}


@dataclass
class Shape:
    batch: int = 32  # samples traced at once (the demo's 32 held-out windows)
    length: int = 480  # positions: 8 hours at 1-minute steps
    d_model: int = 96  # NILMFormer's width
    n_heads: int = 8  # NILMFormer's heads


def _current_rss_bytes() -> int:
    """Resident memory now (Linux), else the high-water mark."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * resource.getpagesize()
    except OSError:
        return _peak_rss_bytes()


def _reset_peak() -> bool:
    """Reset the kernel's resident high-water mark (Linux 4.0+); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _setup(case: str, shape: Shape) -> Callable[[], object]:
    """Build the inputs of a case and return the call to time."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from attnpanel import MultiHeadSelfAttention, recompute_weights, trace

    torch.manual_seed(0)
    layer = MultiHeadSelfAttention(shape.d_model, shape.n_heads, mask="diagonal").eval()
    x = torch.randn(shape.batch, shape.length, shape.d_model)
    heads, length, head_dim = shape.n_heads, shape.length, shape.d_model // shape.n_heads
    blocked = torch.eye(length, dtype=torch.bool)
    causal = torch.ones(length, length, dtype=torch.bool).triu(1)
    wq, wk, wv, wo = (getattr(layer, n).weight.detach() for n in ("wq", "wk", "wv", "wo"))

    def split(t):  # (B, L, D) -> (B, H, L, E)
        return t.view(t.shape[0], length, heads, head_dim).transpose(1, 2)

    def merge(t):  # (B, H, L, E) -> (B, L, D)
        return t.transpose(1, 2).reshape(t.shape[0], length, shape.d_model)

    @torch.no_grad()
    def torch_sdpa_output():
        q, k, v = split(x @ wq.T), split(x @ wk.T), split(x @ wv.T)
        return merge(F.scaled_dot_product_attention(q, k, v, attn_mask=~blocked)) @ wo.T

    @torch.no_grad()
    def torch_einsum_weights():
        q, k, v = split(x @ wq.T), split(x @ wk.T), split(x @ wv.T)
        scores = torch.einsum("bhle,bhse->bhls", q, k) * head_dim**-0.5
        weights = torch.softmax(scores.masked_fill(blocked, float("-inf")), dim=-1)
        return merge(torch.einsum("bhls,bhse->bhle", weights, v)) @ wo.T, weights

    mha = nn.MultiheadAttention(shape.d_model, heads, bias=False, batch_first=True).eval()
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.cat([wq, wk, wv]))
        mha.out_proj.weight.copy_(wo)

    @torch.no_grad()
    def torch_mha_weights():
        return mha(x, x, x, attn_mask=blocked, need_weights=True, average_attn_weights=False)

    @torch.no_grad()
    def layer_forward():
        return layer(x)

    if case in ("torch_einsum_one_sample", "recompute_one_sample"):
        ds = trace(layer, x)
        q0 = torch.from_numpy(ds.q.values[0].copy())  # (H, L, E)
        k0 = torch.from_numpy(ds.k.values[0].copy())  # (H, S, E)

        @torch.no_grad()
        def torch_einsum_one_sample():
            scores = torch.einsum("hle,hse->hls", q0, k0) * head_dim**-0.5
            return torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)

        def recompute_one_sample():
            return recompute_weights(ds, "causal", batch=0)

        return locals()[case]
    if case == "trace":
        return lambda: trace(layer, x)
    return locals()[case]


def measure_memory(case: str, shape: Shape) -> dict:
    """Peak resident memory one call adds, in this (fresh) process."""
    call = _setup(case, shape)
    gc.collect()
    _reset_peak()
    before = _current_rss_bytes()
    result = call()
    peak = _peak_rss_bytes() - before
    del result
    return {"case": case, "peak_mib": peak / 2**20}


def measure_times(cases: list[str], shape: Shape, repeats: int) -> dict[str, list[float]]:
    """Seconds per call; cases alternate call by call so background load hits all alike."""
    calls = {case: _setup(case, shape) for case in cases}
    for call in calls.values():
        call()  # warm-up: first-call dispatch, lazy imports, caches
    times = {case: [] for case in cases}
    for _ in range(repeats):
        for case, call in calls.items():
            start = time.perf_counter()
            result = call()
            times[case].append(time.perf_counter() - start)
            del result
    return times


def _memory_isolated(case: str, shape: Shape) -> dict:
    command = [sys.executable, __file__, "--memory-of", case]
    command += ["--batch", str(shape.batch), "--length", str(shape.length)]
    command += ["--d-model", str(shape.d_model), "--heads", str(shape.n_heads)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"benchmark case {case} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(times: dict[str, list[float]], memory: dict[str, float], shape: Shape) -> str:
    """The results as a fixed-width table with ratios to each group's baseline."""
    repeats = len(next(iter(times.values())))
    lines = [
        f"B={shape.batch}, L={shape.length}, H={shape.n_heads}, d_model={shape.d_model}; "
        f"median and min of {repeats} calls per case (cases alternating) after a warm-up;",
        "peak = resident-memory high-water mark one call adds, measured in a fresh process",
        "",
        f"{'case':<25} {'what':<50} {'median ms':>9} {'min ms':>8} {'x base':>6} {'peak MiB':>8}",
    ]
    for group, baseline in BASELINE.items():
        base = statistics.median(times[baseline]) if baseline in times else None
        for case, (case_group, description) in CASES.items():
            if case_group != group or case not in times:
                continue
            median = statistics.median(times[case])
            ratio = f"{median / base:.2f}" if base else "-"
            peak = f"{memory[case]:.0f}" if case in memory else "-"
            name = case + ("*" if case == baseline else "")
            lines.append(
                f"{name:<25} {description:<50} {median * 1e3:>9.1f} "
                f"{min(times[case]) * 1e3:>8.1f} {ratio:>6} {peak:>8}"
            )
        lines.append("")
    lines.append("* baseline of its group; x base = median / baseline median")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    """Run the benchmarks and print the table; returns it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9, help="timed calls per case")
    parser.add_argument("--batch", type=int, default=Shape.batch)
    parser.add_argument("--length", type=int, default=Shape.length)
    parser.add_argument("--d-model", type=int, default=Shape.d_model)
    parser.add_argument("--heads", type=int, default=Shape.n_heads)
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--no-memory", action="store_true", help="skip the memory processes")
    parser.add_argument("--memory-of", choices=list(CASES), help=argparse.SUPPRESS)
    parser.add_argument(
        "--all",
        action="store_true",
        help=(
            "then the others: capture.py, sessions.py, explorer_latency.py, first_paint.py, "
            "figures.py, linked_zoom.py, tiles.py, long_explorer.py"
        ),
    )
    args = parser.parse_args(argv)
    shape = Shape(args.batch, args.length, args.d_model, args.heads)
    if args.memory_of:  # a child process: one case's memory, JSON out
        print(json.dumps(measure_memory(args.memory_of, shape)))
        return ""
    memory = {}
    if not args.no_memory:
        for case in args.cases:
            memory[case] = _memory_isolated(case, shape)["peak_mib"]
    times = measure_times(args.cases, shape, args.repeats)
    text = table(times, memory, shape)
    print(text)
    if args.all:
        for script in (
            "capture.py",
            "sessions.py",
            "explorer_latency.py",
            "first_paint.py",
            "figures.py",
            "linked_zoom.py",
            "tiles.py",
            "long_explorer.py",
        ):
            print(f"\n== {script}", flush=True)
            subprocess.run([sys.executable, str(Path(__file__).with_name(script))], check=True)
    return text


if __name__ == "__main__":
    main()

"""A survey and a comparison of the demo model beside its own plain forward, same run.

* ``survey``: ``attnpanel.survey`` of the demo NILMFormer (3 layers x 8 heads) over
  ``--windows`` held-out windows of 480 steps (default 1,024) in batches of ``--batch``
  (32), in process, beside the plain forward (``torch.no_grad``, eval) over the same
  batches; median and p95 of ``--repeats`` and their ratio (issue #28's target: at most
  1.5x), and the same survey without the role statistics (``roles=False``: issue #34's
  target, roles at most 10 % slower). Its peak memory: a fresh process runs the
  forwards, then the survey, and the peak resident memory of each is printed beside one
  batch's weights (issue #28's budget: one batch's weights + 300 MB).
* ``floor``: what the target leaves for the statistics. On the demo's own q, k, v and mask
  (layer 0 of one batch, in blocks of head-samples that stay in cache, as the survey reads
  them), the model's own attention call beside each eager operation an exact statistic
  cannot do without, each timed on a block in cache, once per block of the layer: the
  scores, the softmax, and one pass over the cells per row sum (``sum a s``,
  ``sum a |i - j|``, ``max a``; for the value-weighted forms the product ``a n``, then
  ``sum a n``, ``sum a n s``, ``sum a n ln n``, ``sum a n |i - j|``, ``max a n``). Their
  sum per layer, against the budget the target leaves per layer (``--floor``: only this).
* ``compare``: two checkpoints of the demo model (its trained weights, and a copy with
  every matrix nudged by 1 % of its spread), each captured on 32 windows, then
  ``attnpanel.compare``; beside the plain forward of those windows.

Run from the repository root::

    python benchmarks/survey.py
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import numpy as np
import torch


def demo_batches(windows: int, batch: int):
    from attnpanel.nilm.demo import demo_windows
    from attnpanel.nilm.nilmformer import default_path, load_model, time_features

    held = demo_windows(windows)
    model = load_model(default_path()).eval()
    aggregate = torch.from_numpy(held["aggregate"].values)
    features = time_features(held["time"].values)
    return model, [
        (aggregate[i : i + batch], features[i : i + batch]) for i in range(0, windows, batch)
    ]


def forwards(model, batches) -> None:
    with torch.no_grad():
        for inputs in batches:
            model(*inputs)


def timed(call, repeats: int) -> list[float]:
    found = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        found.append(time.perf_counter() - start)
    return found


def summary(times: list[float]) -> tuple[float, float]:
    ordered = sorted(times)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, round(0.95 * len(ordered)))]


def rss_mb() -> float:
    """This process's resident memory now (Linux)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def memory_child(windows: int, batch: int, what: str) -> None:
    """In a fresh process: the resident memory before, and its peak during, the forwards
    or the survey (sampled every 5 ms)."""
    from attnpanel.surveys.survey import survey

    model, batches = demo_batches(windows, batch)
    forwards(model, batches[:1])  # torch's own first-call allocations, in both
    before = rss_mb()
    peak, done = [before], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_mb())
            time.sleep(0.005)

    watcher = threading.Thread(target=sample)
    watcher.start()
    if what == "forward":
        forwards(model, batches)
    else:
        survey(model, batches, progress=False)
    done.set()
    watcher.join()
    print(json.dumps({"before": before, "peak": max(peak[0], rss_mb())}))


def memory(windows: int, batch: int, what: str) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--memory-child",
            what,
            "--windows",
            str(windows),
            "--batch",
            str(batch),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def floor(model, inputs, repeats: int, forward_s: float) -> None:
    """The cost of the operations an exact survey cannot do without, per layer (see the
    module's docstring), beside the model's own attention call and the target's budget."""
    import torch.nn.functional as F

    import attnpanel
    from attnpanel.kernels.masks import build_mask
    from attnpanel.kernels.statistics import CHUNK_CELLS

    whole = attnpanel.capture(model, *inputs)
    layers, trace = whole.sizes["layer"], whole.isel(layer=0)
    q, k, v = (torch.from_numpy(np.ascontiguousarray(trace[n].values)) for n in "qkv")
    batch, heads, length, width = q.shape
    scale = float(trace.attrs["scale"])
    blocked = build_mask(trace.attrs["mask"], length)  # True where blocked
    allowed = None if blocked is None else ~blocked
    n = batch * heads
    qf, kf = (q * scale).reshape(n, length, width), k.reshape(n, length, width)
    added = torch.zeros(length, length) if blocked is None else torch.where(blocked, -1e30, 0.0)
    steps = (torch.arange(length)[:, None] - torch.arange(length)[None, :]).abs().float()
    norms = torch.linalg.vector_norm(v, dim=-1).reshape(n, length)
    per = max(1, CHUNK_CELLS // (length * length))
    blocks = [slice(i, i + per) for i in range(0, n, per)]

    def median(call) -> float:
        return summary(timed(call, repeats))[0]

    with torch.no_grad():
        sdpa = median(
            lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
        )
        first = blocks[0]  # one block in cache, as the survey keeps each: its cells
        s = torch.baddbmm(added, qf[first], kf[first].mT)
        a = torch.softmax(s, dim=-1)
        w = norms[first][:, None, :]
        an = a * w
        # the sums whose per-cell factor is a key's alone, in one product: sum a s =
        # q . (a k), sum a n s = q . (a (n k)), sum a n, sum a n ln n
        nk = norms[first][..., None]  # (blocks, S, 1)
        keyed = torch.cat([kf[first], nk * kf[first], nk, nk * torch.log(nk)], dim=-1)

        def each_block(operation) -> float:
            """An operation over the layer: once per block, on a block in cache."""
            return median(lambda: [operation() for _ in blocks])

        cost = {
            "scores (q k^T + mask)": median(
                lambda: [torch.baddbmm(added, qf[p], kf[p].mT) for p in blocks]
            ),
            "softmax": each_block(lambda: torch.softmax(s, dim=-1)),
            "3 row sums of a (sum a s, sum a |i-j|, max a), each": each_block(
                lambda: torch.linalg.vecdot(a, s)
            ),
            "a n (value-weighted cells)": each_block(lambda: a * w),
            "5 row sums of a n, each": each_block(lambda: torch.linalg.vecdot(an, steps)),
            "folded: a @ [k, n k, n, n ln n]": each_block(lambda: torch.bmm(a, keyed)),
        }
    total = (
        cost["scores (q k^T + mask)"]
        + cost["softmax"]
        + 3 * cost["3 row sums of a (sum a s, sum a |i-j|, max a), each"]
        + cost["a n (value-weighted cells)"]
        + 5 * cost["5 row sums of a n, each"]
    )
    # folded: 4 sums in one product; left apart: sum a |i-j|, max a, a n, sum a n |i-j|, max a n
    folded = (
        cost["scores (q k^T + mask)"]
        + cost["softmax"]
        + cost["folded: a @ [k, n k, n, n ln n]"]
        + 2 * cost["3 row sums of a (sum a s, sum a |i-j|, max a), each"]
        + cost["a n (value-weighted cells)"]
        + 2 * cost["5 row sums of a n, each"]
    )
    budget = 0.5 * forward_s / layers
    cells = n * length * length
    print(f"\nthe floor of an exact survey, per layer of {batch} windows ({cells:,} cells)")
    print("| what | median ms |")
    print("| --- | --- |")
    print(f"| the model's own attention call (SDPA) | {1e3 * sdpa:.1f} |")
    for name, seconds in cost.items():
        print(f"| {name} | {1e3 * seconds:.1f} |")
    print(f"| **their sum, every row sum its own pass** | **{1e3 * total:.1f}** |")
    print(f"| **their sum, 4 sums folded into one product** | **{1e3 * folded:.1f}** |")
    print(
        f"| the target's budget per layer (0.5 x the forward {1e3 * forward_s:.0f} ms / "
        f"{layers} layers) | {1e3 * budget:.1f} |"
    )
    print(
        f"per budget: {total / budget:.2f} (every pass), {folded / budget:.2f} (folded); "
        f"per the model's attention: {total / sdpa:.2f}, {folded / sdpa:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memory-child", choices=("forward", "survey"))
    parser.add_argument("--floor", action="store_true", help="only the floor of the statistics")
    args = parser.parse_args()
    if args.memory_child:
        memory_child(args.windows, args.batch, args.memory_child)
        return
    import attnpanel
    from attnpanel.surveys.survey import survey

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    model, batches = demo_batches(args.windows, args.batch)
    forwards(model, batches[:1])  # warm-up
    if args.floor:
        one_forward = summary(timed(lambda: forwards(model, batches[:1]), max(5, args.repeats)))[0]
        floor(model, batches[0], max(5, args.repeats), one_forward)
        return
    plain, surveyed, without = [], [], []
    for _ in range(args.repeats):  # interleaved: the machine's drift hits all three
        plain += timed(lambda: forwards(model, batches), 1)
        surveyed += timed(lambda: survey(model, batches, progress=False), 1)
        without += timed(lambda: survey(model, batches, progress=False, roles=False), 1)
    (fm, fp), (sm, sp) = summary(plain), summary(surveyed)
    wm, wp = summary(without)
    print(
        f"\nsurvey of the demo model, {args.windows} windows x 480 steps, batches of {args.batch}"
    )
    print("| what | median s | p95 s | in forwards (target 1.5) |")
    print("| --- | --- | --- | --- |")
    print(f"| plain forward over the batches | {fm:.2f} | {fp:.2f} | 1 |")
    print(
        f"| survey (12 statistics and 5 role statistics per sample, layer, head) | {sm:.2f} "
        f"| {sp:.2f} | {sm / fm:.2f} |"
    )
    print(
        f"| survey without the role statistics (roles=False) | {wm:.2f} | {wp:.2f} "
        f"| {wm / fm:.2f} |"
    )
    print(f"roles cost {sm / wm - 1:+.1%} of the survey without them (issue #34: at most +10 %)")

    weights_mb = 3 * args.batch * 8 * 480 * 480 * 4 / 2**20
    mem_f = memory(args.windows, args.batch, "forward")
    mem_s = memory(args.windows, args.batch, "survey")
    print("\npeak resident memory (a fresh process each)")
    print("| what | resident before MB | peak during MB | above before MB |")
    print("| --- | --- | --- | --- |")
    for name, found in (("forwards", mem_f), ("survey", mem_s)):
        print(
            f"| {name} | {found['before']:.0f} | {found['peak']:.0f} | "
            f"{found['peak'] - found['before']:.0f} |"
        )
    print(
        f"one batch's weights (3 layers x {args.batch} x 8 x 480 x 480 float32): "
        f"{weights_mb:.0f} MB; budget {weights_mb + 300:.0f} MB above the loaded model"
    )

    one_forward = summary(timed(lambda: forwards(model, batches[:1]), max(5, args.repeats)))[0]
    floor(model, batches[0], max(5, args.repeats), one_forward)

    other = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in other.parameters():
            if parameter.dim() >= 2:
                parameter.add_(0.01 * parameter.std() * torch.randn_like(parameter))
    inputs = batches[0]
    a = attnpanel.capture(model, *inputs)
    b = attnpanel.capture(other, *inputs)
    one = summary(timed(lambda: forwards(model, [inputs]), max(5, args.repeats)))
    compared = summary(timed(lambda: attnpanel.compare(a, b), max(3, args.repeats)))
    result = attnpanel.compare(a, b)
    top = result["js"].to_series().sort_values(ascending=False).head(3)
    print(f"\ncompare of two demo checkpoints on {args.batch} windows (captures made beforehand)")
    print("| what | median s | p95 s | in forwards |")
    print("| --- | --- | --- | --- |")
    print(f"| plain forward of the windows | {one[0]:.3f} | {one[1]:.3f} | 1 |")
    print(f"| compare(a, b) | {compared[0]:.3f} | {compared[1]:.3f} | {compared[0] / one[0]:.1f} |")
    print("most changed heads (js):", ", ".join(f"{k}: {v:.2e}" for k, v in top.items()))
    print(f"max |b - a| over every head: {float(np.nanmax(result['max_abs'].values)):.2e}")


if __name__ == "__main__":
    main()

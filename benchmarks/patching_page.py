"""On the served demo: a corrupted input chosen -> the patching map repainted, in Chromium.

Run: ``python benchmarks/patching_page.py [--samples 4]``.

Serves ``apps/main.py`` with ``panel serve``, opens it in headless Chromium with the
"what changes the prediction" section open (``?patching=true``), and for each of
``--samples`` samples picks each corrupted input in turn in its widget (every pick a map
the server has not computed yet: the model runs once per head plus two), timing the
widget change to the map's repainted canvas (``total``) and to the first document patch
from the server (``to patch``). Beside it, in the same run and the same machine: the
head widget's change to the repainted matrix (the page's everyday round trip), and the
server's own ``ModelRun.patching`` for the same requests, in this process.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from served_app import launch_chromium, open_app, serve  # noqa: E402

CORRUPTIONS = [
    "without the fridge",
    "without the kettle",
    "without the microwave",
    "span replaced by its mean",
    "span replaced by zeros",
]
# the map, found by its colour bar (its title names the input, or why there is no effect)
MAP = """() => attn.plots().find((v) => [...v.model.right, ...v.model.center].some(
  (m) => m.type === 'ColorBar' && m.title && m.title.startsWith('share restored')))"""
MATRIX = "() => attn.plots().find((v) => /^sample \\d+, /.test(v.model.title.text))"


def percentile(values, q) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q))


def in_process(samples: int) -> list[float]:
    """``ModelRun.patching`` of the same requests, in this process (uncached)."""
    from attnpanel.interventions.model_run import Patching
    from attnpanel.nilm.demo import demo_model_run

    run = demo_model_run()
    found = []
    for sample in range(samples):
        for how in CORRUPTIONS:
            start = time.perf_counter()
            try:
                run.patching(sample, Patching(how, 1, (210, 270), "output"))
            except ValueError:
                pass  # a window where the device never runs: nothing to patch, said on the page
            found.append(time.perf_counter() - start)
    return found


def in_browser(samples: int) -> tuple[list[float], list[float], list[float], list]:
    from playwright.sync_api import sync_playwright

    console: list = []
    totals, patches, heads = [], [], []
    with serve() as (url, _proc), sync_playwright() as p:
        browser = launch_chromium(p)
        page = open_app(browser, f"{url}?patching=true", console)
        page.wait_for_function(f"() => ({MAP})() !== undefined", timeout=180_000)
        for sample in range(samples):
            before = page.evaluate(f"({MAP})().model.title.text")
            page.evaluate("(v) => { attn.widget('Sample').value = v; }", sample)
            if sample:
                page.wait_for_function(
                    f"(b) => ({MAP})().model.title.text !== b", arg=before, timeout=120_000
                )
            for how in CORRUPTIONS:
                current = page.evaluate("attn.widget('corrupted input').value")
                if current == how:
                    continue  # no change: nothing to time
                timing = page.evaluate(
                    "([t, v, m]) => attn.timed_change(t, v, eval(m))", ["corrupted input", how, MAP]
                )
                totals.append(timing["total"])
                if timing["to_patch"] is not None:
                    patches.append(timing["to_patch"])
            for head in ("head 1", "head 0"):
                timing = page.evaluate(
                    "([t, v, m]) => attn.timed_change(t, v, eval(m))", ["Head", head, MATRIX]
                )
                heads.append(timing["total"])
        browser.close()
    return totals, patches, heads, [m for m in console if m[0] in ("error", "pageerror")]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4, help="samples, each every corruption")
    args = parser.parse_args(argv)
    print("the same requests in process ...", flush=True)
    server = in_process(args.samples)
    print("the served demo in Chromium ...", flush=True)
    totals, patches, heads, errors = in_browser(args.samples)
    print()
    print("| what | n | median ms | p95 ms |")
    print("| --- | --- | --- | --- |")
    for name, values in (
        ("corrupted input chosen -> patching map repainted", totals),
        ("  ... -> first patch from the server", patches),
        ("  ModelRun.patching in process (the model: heads + 2 forwards)", server),
        ("head changed -> matrix repainted (the page's round trip)", heads),
    ):
        scale = 1e3 if values is server else 1.0
        print(
            f"| {name} | {len(values)} | {statistics.median(values) * scale:.0f} "
            f"| {percentile(values, 95) * scale:.0f} |"
        )
    if errors:
        print(f"browser console errors: {errors}")


if __name__ == "__main__":
    main()

"""Latency of a head toggle on the served demo, to the model's prediction repainted.

Run: ``python benchmarks/head_toggle.py [--repeats 16]``.

Serves ``apps/main.py`` (the demo, with its model at hand), opens it in headless Chromium,
and switches one head off in the head toggles (what a click does to the Bokeh model), then
polls the canvas of "the model's prediction" every animation frame until its pixels differ:
the server ran the model again on the shown window with that head's lane zeroed
(``attnpanel.ablate``) and the page drew the new curves. Each head is switched off once on
each of two samples, so every measured toggle re-runs the model (a toggle back on reads the
cached prediction with every head, timed apart). Printed beside it, measured in the same
run: the same toggle to the repainted "output Wo" bars (the layer-only change that toggles
made before), and in-process the plain forward of the model on one window against
``ModelRun.prediction`` with a head off (uncached).
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

PREDICTION = '() => attn.plot("the model\'s prediction")'
OUTPUT = "() => attn.plot('output Wo')"
TOGGLES = (
    "() => attn.views().find((v) => v.model && Array.isArray(v.model.labels) && "
    "v.model.labels.includes('head 0') && 'active' in v.model.properties).model"
)
# Switch one head off (or every head back on) and time both plots until they repaint.
TOGGLE_JS = f"""async ([heads]) => {{
  const toggles = ({TOGGLES})();
  const prediction = ({PREDICTION})(), output = ({OUTPUT})();
  const before = [attn.hash(prediction), attn.hash(output)];
  const t0 = performance.now();
  toggles.active = heads;
  const times = await Promise.all([attn.until_changed(prediction, before[0]),
                                   attn.until_changed(output, before[1])]);
  return {{prediction: times[0], output: times[1], total: performance.now() - t0}};
}}"""


def percentile(values, q):
    return float(np.percentile(np.asarray(values, dtype=float), q))


def browser_times(repeats: int) -> dict[str, list[float]]:
    from playwright.sync_api import sync_playwright

    found = {"off: prediction": [], "off: output Wo": [], "on (cached): prediction": []}
    with serve() as (url, _), sync_playwright() as p:
        browser = launch_chromium(p)
        console: list = []
        page = open_app(browser, url + "?merge=true", console)
        every = list(range(8))
        done = 0
        for sample in (0, 1):
            page.evaluate("(s) => { attn.widget('Sample').value = s; }", sample)
            page.wait_for_timeout(1500)
            for head in range(8):
                if done >= repeats:
                    break
                off = page.evaluate(TOGGLE_JS, [[h for h in every if h != head]])
                found["off: prediction"].append(off["prediction"])
                found["off: output Wo"].append(off["output"])
                page.wait_for_timeout(200)
                back = page.evaluate(TOGGLE_JS, [every])
                found["on (cached): prediction"].append(back["prediction"])
                page.wait_for_timeout(200)
                done += 1
        errors = [m for m in console if m[0] in ("error", "pageerror")]
        browser.close()
    if errors:
        raise SystemExit(f"the page logged errors: {errors[:3]}")
    return found


def server_times(repeats: int) -> dict[str, list[float]]:
    import torch

    from attnpanel.nilm.demo import demo_model_run

    run = demo_model_run()
    forward, ablated = [], []
    for i in range(repeats):
        sample, head = 2 + i // 8, i % 8
        inputs, kwargs = run.one(sample)
        start = time.perf_counter()
        with torch.no_grad():
            run.model(*inputs, **kwargs)
        forward.append(1000 * (time.perf_counter() - start))
        start = time.perf_counter()
        run.prediction(sample, {run.layers[0]: [head]})  # never asked before: a model run
        ablated.append(1000 * (time.perf_counter() - start))
    return {"plain forward, one window": forward, "prediction with a head off": ablated}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=16, help="toggles (at most 16)")
    args = parser.parse_args(argv)
    print("measuring in process ...", flush=True)
    server = server_times(args.repeats)
    print("measuring the served demo in Chromium ...", flush=True)
    browser = browser_times(args.repeats)
    print()
    print(f"{'what':<34}{'n':>4}{'median ms':>11}{'p95 ms':>9}")
    for name, values in {**browser, **server}.items():
        print(
            f"{name:<34}{len(values):>4}{statistics.median(values):>11.0f}"
            f"{percentile(values, 95):>9.0f}"
        )


if __name__ == "__main__":
    main()

"""What the served demo holds in memory, and where: the first session's server RSS.

Run: ``python benchmarks/server_memory.py``.

Two parts, both on this machine in one run:

* **Where it is held.** Each step of what ``apps/main.py`` builds, in a fresh Python
  process, with the resident memory it adds (after a collection and ``malloc_trim``, so
  that freed memory is not counted): the imports, the demo trace, the model at hand, the
  first explorer (laid out and rendered into a document), the maps it sends ahead (every
  step of its idle work), and the second explorer (the one built ahead for the next
  visitor). The demo trace's row is measured twice: with its maps held (``demo()``), and
  recomputed on demand (``demo(on_demand=True)``, what the server holds).
* **The server.** ``panel serve apps/main.py --warm`` (the README's command), its RSS as it
  listens, once the first page has painted in headless Chromium, once the server's
  one-time work is done (the maps sent ahead, the survey) and it has given back what the
  page's loading freed (``serving.release_memory``), with a second page open, and its peak
  (``VmHWM``). Beside it, in the same run, ``benchmarks/one_map_app.py`` (a Panel
  page with one 480 x 480 map): what a Panel server with a page costs at all.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from served_app import (  # noqa: E402
    launch_chromium,
    open_app,
    peak_rss_mb,
    rss_mb,
    serve,
    wait_idle,
)

# one process per form of the trace: the steps apps/main.py takes, each one's RSS after it
STEPS = r"""
import ctypes, gc, json, os, sys
def rss():
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    for line in open(f"/proc/{os.getpid()}/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
steps = [("start", rss())]
import attnpanel
from bokeh.document import Document
from attnpanel.app.explorer import AttentionExplorer
from attnpanel.nilm.demo import demo_model_run
steps.append(("imports", rss()))
trace = attnpanel.demo(on_demand=sys.argv[1] == "on demand")
steps.append(("the demo trace, maps " + sys.argv[1], rss()))
model = demo_model_run()
steps.append(("the model at hand", rss()))
first = AttentionExplorer.built(trace, model=model)
first.__panel__().get_root(Document())
steps.append(("the first explorer, rendered", rss()))
first.engine.finish_idle()
steps.append(("its maps sent ahead (every idle step)", rss()))
AttentionExplorer.built(trace, model=model).__panel__().get_root(Document())
steps.append(("the explorer built ahead for the next visitor", rss()))
print(json.dumps(steps))
"""


def composition(form: str) -> list[tuple[str, float]]:
    found = subprocess.run(
        [sys.executable, "-c", STEPS, form], capture_output=True, text=True, check=True, cwd=ROOT
    )
    return json.loads(found.stdout.strip().splitlines()[-1])


def settle() -> float:
    """Wait until the server has given back what a page's loading freed
    (``serving.TRIM_DELAY_S`` after the last page loaded); returns the seconds waited."""
    from attnpanel.app.serving import TRIM_DELAY_S

    time.sleep(TRIM_DELAY_S + 1.0)
    return TRIM_DELAY_S + 1.0


def served(app: Path, extra=(), second: bool = False) -> dict[str, float]:
    from playwright.sync_api import sync_playwright

    found = {}
    with serve(app, extra_args=extra) as (url, proc), sync_playwright() as p:
        found["listening"] = rss_mb(proc.pid)
        browser = launch_chromium(p)
        console: list = []
        page = open_app(browser, url, console) if second else None
        if page is None:  # the floor: no explorer to wait for
            page = browser.new_page()
            page.goto(url)
            page.wait_for_function("() => window.Bokeh && Bokeh.documents[0]?.is_idle")
        found["first page painted"] = rss_mb(proc.pid)
        found["waited (s)"] = wait_idle(proc.pid) + settle()
        found["one-time work done, memory given back"] = rss_mb(proc.pid)
        if second:
            open_app(browser, url, console)
            wait_idle(proc.pid)
            settle()
            found["a second page open"] = rss_mb(proc.pid)
        found["peak"] = peak_rss_mb(proc.pid)
        browser.close()
    return found


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    lines = ["## Where it is held (MiB of resident memory, each step in a fresh process)", ""]
    held, on_demand = composition("held"), composition("on demand")
    lines.append("| step | maps held | maps on demand (served) |")
    lines.append("| --- | --- | --- |")
    before = (held[0][1], on_demand[0][1])
    for (name, a), (_, b) in zip(held, on_demand, strict=True):
        name = name.replace(" held", "").replace(" on demand", "")
        lines.append(
            f"| {name} | {a:.0f} ({a - before[0]:+.0f}) | {b:.0f} ({b - before[1]:+.0f}) |"
        )
        before = (a, b)
    lines += ["", "## The server (MiB; the README's command, headless Chromium)", ""]
    demo = served(ROOT / "apps" / "main.py", ["--warm"], second=True)
    floor = served(ROOT / "benchmarks" / "one_map_app.py")
    lines.append("| | apps/main.py --warm | one_map_app.py (floor) |")
    lines.append("| --- | --- | --- |")
    for key, value in demo.items():
        other = floor.get(key)
        lines.append(
            f"| {key} | {value:.1f} | {'' if other is None else f'{other:.1f}'} |"
            if key == "waited (s)"
            else f"| {key} | {value:.0f} | {'' if other is None else f'{other:.0f}'} |"
        )
    text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    main()

"""The words and ranges of every view follow the state they show, in every state.

One walk of the served demo through every stage x every mask x two heads for each of two
samples: the first sample, from the link (``?sample=1``), at 1280 px; the second, from the
keyboard (the Sample slider focused, ArrowRight), at 1600 px (the page widened between
them): the two ways a sample changes that once left a range of the sample before, and
every stage, mask and head at both widths. In each state, for every plot on the page (the
projection and the merge opened as well):

- its title fits its canvas (measured with the title's own font), or it wraps; no table
  is wider than its frame (a cell cut at its edge);
- its continuous axis ranges hold the data it draws, and are no more than Bokeh's padding
  wider (a range left from the previous state is wider);
- the matrix's title, hover label and the stage agree (``raw scores q·k`` at stage raw, not
  "softmax weights"); the head maps, labelled "weight", are the same at every stage; the
  bars titled "weights of query" are one query's weights (they sum to 1 over the keys the
  mask leaves).

Every problem found is collected with its state and reported together.
"""

from __future__ import annotations

from served_app import HELPERS_JS, RENDERED_JS, WORDS_JS, opened, shot

from attnpanel.kernels.masks import MASK_MODES
from attnpanel.readouts.core import PRE_MASK, STAGE_LABELS
from attnpanel.traces.schema import STAGES

SAMPLES = (1, 2)  # 1 from the link, 2 by the keyboard
HEADS = (0, 5)
SECTIONS = "projection=true&merge=true"

# Every problem of the page as it stands, as strings; [] when every view is right.
CHECK_JS = (
    r"""
([stage_label]) => {
  const problems = ("""
    + WORDS_JS
    + r""")();
  const finite = (xs) => xs.filter((x) => typeof x === "number" && Number.isFinite(x));
  // 4. the matrix: title, hover label and stage agree
  const matrix = attn.plots().find((v) => /^sample \d+, /.test(v.model.title.text));
  const tips = matrix.model.toolbar.tools.filter((t) => t.type === "HoverTool")
    .flatMap((t) => t.tooltips.map((pair) => pair[0]));
  if (!tips.includes(stage_label)) problems.push(`matrix hover names ${JSON.stringify(tips)}`);
  const text = matrix.model.title.text;
  if (!text.includes(stage_label)) problems.push(`matrix title ${JSON.stringify(text)}`);
  const bar = matrix.model.right.concat(matrix.model.center).find((a) => a.type === "ColorBar");
  if (bar && bar.title && !bar.title.startsWith(stage_label)) {
    problems.push(`matrix colour bar titled ${bar.title}`);
  }
  const maps = attn.plot("head maps").model.toolbar.tools.filter((t) => t.type === "HoverTool")
    .flatMap((t) => t.tooltips.map((pair) => pair[0]));
  if (!maps.includes("weight")) problems.push(`head maps hover names ${JSON.stringify(maps)}`);
  // 5. the bars titled "weights of query" are one query's weights
  const bars = attn.plot("weights of query").model.renderers.find((r) => r.glyph.type === "Quad");
  const sum = finite(Array.from(bars.data_source.data.top)).reduce((s, v) => s + v, 0);
  if (Math.abs(sum - 1) > 1e-3) problems.push(`"weights of query" bars sum to ${sum}`);
  return problems;
}
"""
)

# The views a state shows, as the page writes them (so a wait can tell the state has landed).
SETTLED_JS = r"""
([sample, head, words]) => {
  try {
    const titles = attn.plots().map((v) => v.model.title.text);
    const matrix = titles.find((t) => /^sample \d+, /.test(t));
    return Bokeh.documents[0].is_idle && matrix.startsWith(`sample ${sample}, head ${head},`)
      && matrix.includes(words)
      && titles.some((t) => t.startsWith(`sample ${sample}: `))
      && titles.some((t) => t.startsWith(`weights of query `) && t.includes(`(head ${head})`))
      && titles.some((t) => t.startsWith(`the model's prediction, sample ${sample}:`));
  } catch (e) { return false; }
}
"""
# What every plot shows now (titles, ranges, the size of each column and a checksum of each
# image), to tell when nothing moves any more.
SNAPSHOT_JS = r"""() => {
  const sum = (a) => {
    let s = 0;
    for (let i = 0; i < a.length; i += 7) if (Number.isFinite(a[i])) s += a[i];
    return s;
  };
  const column = (c) => (c && c.length && c[0] && c[0].length > 1000 ? sum(c[0])
                                                                     : (c && c.length) || 0);
  return JSON.stringify(attn.plots().map((v) => [v.model.title.text,
    v.model.x_range.start, v.model.x_range.end, v.model.y_range.start, v.model.y_range.end,
    ...v.model.renderers.map((r) => r.data_source
                             && Object.values(r.data_source.data).map(column))]));
}"""
# The values of the head maps (one checksum per head), not their pixels.
HEAD_MAPS_JS = r"""() => attn.plot("head maps").model.renderers
  .filter((r) => r.glyph.type === "Image")
  .map((r) => { const a = r.data_source.data.image[0]; let s = 0;
                for (let i = 0; i < a.length; i++) if (Number.isFinite(a[i])) s += a[i];
                return s.toPrecision(7); }).join(",")"""


def settle(page, sample: int, head: int, words: str) -> None:
    """Wait until the page shows the state and nothing on it moves for 300 ms."""
    page.wait_for_function(SETTLED_JS, arg=[sample, head, words], timeout=60_000)
    before = page.evaluate(SNAPSHOT_JS)
    for _ in range(40):
        page.wait_for_timeout(300)
        now = page.evaluate(SNAPSHOT_JS)
        if now == before and page.evaluate("Bokeh.documents[0].is_idle"):
            return
        before = now
    raise AssertionError(f"the page kept changing at sample {sample}, head {head}, {words}")


def set_value(page, title: str, value) -> None:
    page.evaluate("([t, v]) => { attn.widget(t).value = v; }", [title, value])


WIDTHS = {1: 1280, 2: 1600}  # the width each sample is walked at


def test_every_view_follows_every_state(browser, artifacts, demo_url):
    page = browser.new_page(viewport={"width": WIDTHS[SAMPLES[0]], "height": 1300})
    console: list = []
    page.on("console", lambda msg: console.append((msg.type, msg.text)))
    page.on("pageerror", lambda err: console.append(("pageerror", str(err))))
    problems: list[str] = []
    shots = {(1, 0, "none", "raw"), (2, 5, "causal", "softmax"), (2, 0, "diagonal", "masked")}
    shots |= {(1, 5, "diagonal", "softmax")}
    try:
        page.goto(f"{demo_url}?sample={SAMPLES[0]}&{SECTIONS}", timeout=180_000)
        page.wait_for_function("() => window.Bokeh && Object.keys(Bokeh.index).length > 0")
        page.evaluate(HELPERS_JS)
        page.wait_for_function(RENDERED_JS, timeout=180_000)
        for sample in SAMPLES:
            width = WIDTHS[sample]
            if sample != SAMPLES[0]:
                page.set_viewport_size({"width": width, "height": 1300})
                page.locator(".noUi-handle").first.focus()  # the Sample slider
                page.keyboard.press("ArrowRight")
            for head in HEADS:
                set_value(page, "Head", str(head))
                for mask in MASK_MODES:
                    if page.evaluate("attn.widget('Mask').value") != mask:
                        # the head maps follow the mask on the server, while the browser
                        # may draw the matrix at once: a stage is set once they have
                        tiles = page.evaluate(HEAD_MAPS_JS)
                        set_value(page, "Mask", mask)
                        page.wait_for_function(
                            f"(before) => ({HEAD_MAPS_JS})() !== before", arg=tiles
                        )
                    maps = set()
                    for stage in STAGES:
                        set_value(page, "Stage", stage)
                        label = STAGE_LABELS[stage]
                        # (scores before the mask name none: their title says so)
                        masked = "before the mask)" if stage in PRE_MASK else f"mask {mask}"
                        settle(page, sample, head, f"{label} ({masked}")
                        state = f"{width} px, sample {sample}, head {head}, {mask}, {stage}"
                        found = page.evaluate(CHECK_JS, [label])
                        problems += [f"{state}: {p}" for p in found]
                        maps.add(page.evaluate(HEAD_MAPS_JS))
                        if (sample, head, mask, stage) in shots:
                            shot(page, artifacts, f"state_{width}_{sample}_{head}_{mask}_{stage}")
                    if len(maps) != 1:
                        problems.append(
                            f"sample {sample}, head {head}, {mask}: the head maps "
                            "(labelled 'weight') changed with the stage"
                        )
    finally:
        page.close()
    assert problems == [], "\n".join(problems)
    assert [m for m in console if m[0] in ("error", "pageerror")] == []


EVERY_SECTION = (
    "projection=true&merge=true&survey=true&patching=true&embedding=true"
    "&corrupted=another+sample&other=5"  # the longest title of the patched prediction
)


def test_every_section_open_keeps_its_words_and_ranges(browser, artifacts, demo_url):
    """The sections closed by default (survey, patching, embedding), opened by the link,
    checked as above at both widths, before and after a sample change by the keyboard."""
    page = browser.new_page(viewport={"width": 1280, "height": 1300})
    console: list = []
    page.on("pageerror", lambda err: console.append(("pageerror", str(err))))
    problems: list[str] = []
    label = STAGE_LABELS["softmax"]
    try:
        page.goto(f"{demo_url}?sample=1&{EVERY_SECTION}", timeout=180_000)
        page.wait_for_function("() => window.Bokeh && Object.keys(Bokeh.index).length > 0")
        page.evaluate(HELPERS_JS)
        page.wait_for_function(RENDERED_JS, timeout=180_000)
        for drawn in (": entropy", "drawn by position on sample"):  # survey, patching
            page.wait_for_function(
                f"() => attn.plots().some((v) => v.model.title.text.includes({drawn!r}))",
                timeout=120_000,
            )
        for sample in (1, 2):
            if sample == 2:
                page.locator(".noUi-handle").first.focus()
                page.keyboard.press("ArrowRight")
            settle(page, sample, 0, f"{label} (mask diagonal")
            for width in (1280, 1600):
                page.set_viewport_size({"width": width, "height": 1300})
                page.wait_for_timeout(800)  # the layout settles
                found = page.evaluate(CHECK_JS, [label])
                problems += [f"{width} px, sample {sample}: {p}" for p in found]
                shot(page, artifacts, f"state_every_section_{width}_{sample}")
    finally:
        page.close()
    assert problems == [], "\n".join(problems)
    assert console == []


ACTIVE_JS = """(label) => attn.views().find((v) => v.model && v.model.label === label
    && v.model.type === 'Checkbox').model.active"""


def test_a_checkboxs_text_toggles_it(browser, artifacts, demo_url):
    """Bokeh draws a checkbox's text as a div beside its input: a click on the text did
    nothing. A click on the text toggles it (with the mouse, where a person clicks), and
    the keyboard still does."""
    with opened(browser, demo_url) as (page, console):
        for label in ("Q/K/V projection", "masked and unmasked side by side"):
            box = page.get_by_text(label, exact=True).first.bounding_box()
            page.mouse.click(box["x"] + 0.7 * box["width"], box["y"] + box["height"] / 2)
            page.wait_for_function(f"() => ({ACTIVE_JS})({label!r}) === true")
        page.wait_for_function("() => /projection=true/i.test(window.location.search)")
        page.evaluate(
            "attn.views().find((v) => v.model && v.model.label === 'head merge and Wo')"
            ".checkbox_el.focus()"
        )
        page.keyboard.press("Space")
        page.wait_for_function(f"() => ({ACTIVE_JS})('head merge and Wo') === true")
        box = page.get_by_text("Q/K/V projection", exact=True).first.bounding_box()
        page.mouse.click(box["x"] + 0.5 * box["width"], box["y"] + box["height"] / 2)
        page.wait_for_function(f"() => ({ACTIVE_JS})('Q/K/V projection') === false")
        shot(page, artifacts, "checkbox_text")
        assert [m for m in console if m[0] in ("error", "pageerror")] == []

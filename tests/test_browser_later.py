"""A served page's first paint draws what is in view; the sections below the fold take
their place once it is idle (attnpanel/app/later.py)."""

from __future__ import annotations

from served_app import LATER_JS, PAGE_TEXT_JS, open_app

# Recorded in the page from its first moment: whether the sections below the fold were
# still placeholders when the document was first idle (its first paint).
FIRST_IDLE_JS = f"""
(() => {{
  const poll = () => {{
    const doc = window.Bokeh && Bokeh.documents && Bokeh.documents[0];
    if (doc && doc.is_idle && [...doc.all_models].some((m) => m.type === "Figure")) {{
      window.__first_idle_placeholders = !({LATER_JS})();
      window.__first_idle_figures = [...doc.all_models].filter((m) => m.type === "Figure").length;
      return;
    }}
    requestAnimationFrame(poll);
  }};
  requestAnimationFrame(poll);
}})();
"""
FIGURES_JS = "() => [...Bokeh.documents[0].all_models].filter((m) => m.type === 'Figure').length"


def test_the_first_paint_draws_the_top_and_the_rest_follows(browser, demo_url):
    """On the README's server (``--warm``, the demo's): the page built ahead of its session."""
    console: list = []
    page = open_app(browser, demo_url, console, before=lambda p: p.add_init_script(FIRST_IDLE_JS))
    try:
        # the first paint: the page above the fold, the sections below not there yet
        assert page.evaluate("() => window.__first_idle_placeholders") is True
        first = page.evaluate("() => window.__first_idle_figures")
        # now (open_app waits for them): every section in place, with its figures,
        # and the line that said they were coming hidden
        assert page.evaluate(LATER_JS) is True
        assert page.evaluate(FIGURES_JS) > first
        text = page.evaluate(PAGE_TEXT_JS)
        assert "Which heads the prediction needs" in text  # a section below the fold
        assert not [m for m in console if m[0] in ("error", "pageerror")]
    finally:
        page.close()

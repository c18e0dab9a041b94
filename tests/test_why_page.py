"""The page's "why this cell", composition graph and OV copying labels, against the demo
model itself, each worked out the long way:

- the score split: integrated gradients computed here with a forward pre-hook on the
  attention module (its input ``x``, its own ``wq`` and ``wk``), one side at a time; the
  score itself checked against the model's own weights (their softmax row);
- composition and copying: the dense ``d x d`` matrices of the model's own ``Linear``
  weights (never the trace's), Elhage et al.'s definitions.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bokeh.document import Document

import attnpanel
from attnpanel.app.explorer import AttentionExplorer
from attnpanel.app.sections.why import WHY_NEEDS_MODEL
from attnpanel.app.url import apply_each
from attnpanel.nilm.demo import demo_model_run
from attnpanel.render.tables import shown_html

WINDOWS = 4
LAYER, HEAD, QUERY, KEY = "encoder.2.attention", 3, 100, 90
STEPS = 64


@pytest.fixture(scope="module")
def run():
    return demo_model_run(n_windows=WINDOWS)


@pytest.fixture(scope="module")
def page(run):
    explorer = AttentionExplorer(attnpanel.demo(n_windows=WINDOWS), model=run)
    explorer.__panel__().get_root(Document())
    return explorer


def long_way(run, sample: int, head: int, query: int, key: int, steps: int = STEPS):
    """The cell's score, and its IG shares per position (query side, key side), summed over
    channels, from zeros: every step's forward with a pre-hook on the attention module."""
    module = run.model.get_submodule(LAYER)
    inputs, _ = run.one(sample)
    width, scale = module.head_dim, module.head_dim**-0.5
    lane = slice(head * width, (head + 1) * width)
    seen = []
    handle = module.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))

    def scores(points):
        seen.clear()
        run.model(*points)
        x = seen[0]
        q, k = module.wq(x)[:, query, lane], module.wk(x)[:, key, lane]
        return q, k

    try:
        with torch.no_grad():
            q, k = scores(inputs)
            row_q = module.wq(seen[0])[0, query, lane]
            row_k = module.wk(seen[0])[0, :, lane]
        score = float((q * k).sum() * scale)
        row = (row_k @ row_q * scale).double()
        t = (torch.arange(steps, dtype=torch.float64) + 0.5) / steps
        points = [
            (t.view(-1, *[1] * (x.dim() - 1)) * x.double()).float().requires_grad_(True)
            for x in inputs
        ]
        q, k = scores(points)
        sides = []
        for side in ((q * k.detach()).sum() * scale, (q.detach() * k).sum() * scale):
            grads = torch.autograd.grad(side, points, retain_graph=True)
            shares = [
                g.double().mean(0) * x[0].double() for g, x in zip(grads, inputs, strict=True)
            ]
            power, features = shares  # (L,), (C, L)
            sides.append((power + features.sum(0)).numpy())
    finally:
        handle.remove()
    return score, row.numpy(), sides


def drawn_sides(page) -> dict[str, np.ndarray]:
    return {
        key.group: np.asarray(found[0]["source"].data["share"])
        for key, found in page.engine.plots("why shares").items()
        if key.kind == "Curve"
    }


def table_rows(page, pane: str) -> dict[str, list[str]]:
    html = shown_html(next(iter(page.engine.plots(pane).values()))[0]["table"])
    rows = {}
    for row in html.split("<tr>")[2:]:
        cells = [c.split(">", 1)[1].split("<", 1)[0] for c in row.split("<td")[1:]]
        rows[cells[0]] = cells[1:]
    return rows


def test_the_shares_drawn_are_the_models_own_score_split_the_long_way(page, run):
    page.param.update(show_why=True, sample=1, head=HEAD, query=QUERY, why_key=KEY)
    score, row, (query_side, key_side) = long_way(run, 1, HEAD, QUERY, KEY)
    drawn = drawn_sides(page)
    change = abs(query_side.sum() + key_side.sum())
    np.testing.assert_allclose(drawn["WhyQuery"], query_side, atol=2e-4 * change)
    np.testing.assert_allclose(drawn["WhyKey"], key_side, atol=2e-4 * change)
    # the key side lies around the key's position, the query side around the query's (the
    # embedding's dilated convolutions spread each over its neighbours)
    assert abs(int(np.argmax(np.abs(drawn["WhyKey"]))) - KEY) <= 4
    assert abs(int(np.argmax(np.abs(drawn["WhyQuery"]))) - QUERY) <= 4
    # the score is the model's own: its weights' row is the softmax of these scores
    weights = run.capture(1)["weights"].sel(layer=LAYER).isel(batch=0, head=HEAD).values[QUERY]
    row[QUERY] = -np.inf  # the demo's diagonal mask
    np.testing.assert_allclose(weights, np.exp(row - row.max()) / np.exp(row - row.max()).sum(),
                               atol=1e-5)  # fmt: skip
    cell = table_rows(page, "why cell")
    assert cell["cell"] == [f"sample 1, query {QUERY} → key {KEY}, head {HEAD} of {LAYER}"]
    assert cell["mask"][0].startswith("the model&#x27;s own (diagonal)")  # (escaped HTML)
    assert float(cell["score (before the softmax)"][0]) == pytest.approx(score, rel=1e-3)
    assert float(cell["sum of the shares"][0]) == pytest.approx(  # 3 digits drawn
        query_side.sum() + key_side.sum(), rel=5e-3
    )
    error, share = cell["completeness error"][0].split(" (")
    assert abs(float(error)) < 1e-4 * max(change, 1.0) and share.endswith("% of the change)")
    title = " ".join(page.engine.title("why shares").split())
    clock = [str(t)[11:16] for t in attnpanel.demo(n_windows=WINDOWS)["time"].isel(batch=1).values]
    assert title == (
        f"why sample 1, query {QUERY} ({clock[QUERY]}) → key {KEY} ({clock[KEY]}), head {HEAD} "
        f"of {LAYER}: shares per position, through the query (blue) and through the key "
        "(vermillion)"
    )
    # the input curve's marks are at the query's and the key's clock times
    times = attnpanel.demo(n_windows=WINDOWS)["time"].isel(batch=1).values
    marks = {key.group: found[0]["glyph"].location for key, found in page.engine.plots(
        "why input").items() if key.kind == "VLine"}  # fmt: skip
    for group, at in (("QueryMark", QUERY), ("KeyMark", KEY)):
        assert marks[group] == times[at].astype("datetime64[ms]").astype(np.int64)


def test_the_channel_table_adds_up_and_names_the_channels(page):
    page.param.update(show_why=True, sample=0, head=HEAD, query=QUERY, why_key=KEY)
    rows = table_rows(page, "why channels")
    names = list(rows)
    assert names[0] == "aggregate power"  # this head's keys read the power, not the clock
    assert any(name.startswith("sin of ") for name in names)
    assert names[-1] == "the other 5"  # 17 channels: 12 shown, the rest summed
    total = sum(float(values[2]) for values in rows.values())
    assert total == pytest.approx(float(table_rows(page, "why cell")["change"][0]), rel=2e-2)


def test_the_parts_table_splits_the_score_itself_each_side_adding_up(page, run):
    page.param.update(show_why=True, sample=1, head=HEAD, query=QUERY, why_key=KEY)
    rows = table_rows(page, "why parts")
    score, _, _ = long_way(run, 1, HEAD, QUERY, KEY, steps=1)
    for column in (0, 1):  # through the query, through the key: each adds up to the score
        total = sum(float(values[column]) for values in rows.values())
        assert total == pytest.approx(score, rel=2e-2)
    assert "encoder.1.attention head 3" in rows and "encoder.1.ffn" in rows
    page.param.update(head="mean")
    assert table_rows(page, "why parts")["no split"][0].startswith("the mean of heads")


def test_a_click_on_a_cell_picks_its_query_and_key(page):
    page.param.update(show_why=True, head=HEAD, sample=0)
    page.sections["matrix"].click(x=201.3, y=149.6)
    assert (page.query, page.why_key) == (150, 201)
    assert "query 150 (" in page.engine.title("why shares")
    assert "→ key 201 (" in page.engine.title("why shares")


def test_a_query_moved_after_a_click_explains_only_its_own_cell(page, run, monkeypatch):
    """The slider moves a clicked cell's query: its key goes back to the one the query
    attends most before any view reads it (the clicked key at the new query is never
    explained, not even once in a notebook, where every view is drawn at once)."""
    page.param.update(show_why=True, head=HEAD, sample=0, query=150, why_key=201)
    asked, why = [], run.why
    monkeypatch.setattr(
        run, "why", lambda cell, *a, **kw: asked.append(cell) or why(cell, *a, **kw)
    )
    page.query = 120
    weights = page.trace["weights"].isel(batch=0, head=HEAD).values[120]
    assert int(np.nanargmax(weights)) != 201  # (else the stale cell and the new one agree)
    assert page.why_key == -1
    assert {(cell.query, cell.key) for cell in asked} == {(120, int(np.nanargmax(weights)))}


def test_no_attribution_says_why(page):
    page.param.update(show_why=True, head="mean", sample=0)
    assert page.engine.title("why shares") == (
        "the mean of heads has no score of its own: pick one head"
    )
    assert all(np.isnan(v).all() for v in drawn_sides(page).values())  # no line drawn
    page.param.update(head=2, query=50, why_key=50)  # the diagonal: blocked
    words = " ".join(page.engine.title("why shares").split())
    assert words.endswith("is blocked by the mask: its score is not used"), words
    assert table_rows(page, "why cell")["no attribution"][0].startswith("cell (query 50, key 50)")
    page.param.update(why_key=-1, query=50)  # the key the query attends most
    weights = page.trace["weights"].isel(batch=0, head=2).values[50]
    assert f"→ key {int(np.nanargmax(weights))} (" in page.engine.title("why shares")


def test_a_link_gives_the_key_back_negative_included(page):
    """Panel reads a link's "-1" as -1.0: the key (-1: the most attended) is taken."""
    apply_each(page, {"why_key": -1.0, "query": 12.0}, AttentionExplorer.URL_PARAMS)
    assert (page.why_key, page.query) == (-1, 12)
    assert isinstance(page.why_key, int)


def test_without_the_model_it_says_what_it_needs():
    explorer = AttentionExplorer(attnpanel.demo(n_windows=2), show_why=True)
    laid = explorer.sections["why"].__panel__()
    assert WHY_NEEDS_MODEL in str(laid.objects[0].objects[1].object)


def dense(run):
    """Each layer's W_QK and W_OV per head, ``d x d``, from the model's own Linears."""
    found = {}
    for name in run.heads():
        module = run.model.get_submodule(name)
        width = module.head_dim
        wq, wk, wv, wo = (getattr(module, w).weight.double() for w in ("wq", "wk", "wv", "wo"))
        for h in range(module.n_heads):
            lane = slice(h * width, (h + 1) * width)
            found[name, h] = (wq[lane].T @ wk[lane], wo[:, lane] @ wv[lane])
    return found


def test_the_graph_draws_the_pairs_whose_dense_scores_are_above_random(page, run):
    page.param.update(show_composition=True, composition="K")
    section = page.sections["composition"]
    edges = section.edges()
    p95 = float(section.result["composition_baseline_p95"].sel(mode="K"))
    mats = dense(run)
    expected = {}
    layers = list(run.heads())
    for a, early in enumerate(layers):
        for late in layers[a + 1 :]:
            for h in range(8):
                for g in range(8):
                    qk, ov = mats[late, g][0], mats[early, h][1]
                    s = torch.linalg.matrix_norm(qk @ ov) / (
                        torch.linalg.matrix_norm(qk) * torch.linalg.matrix_norm(ov)
                    )
                    if s > p95:
                        expected[f"{early} head {h}", f"{late} head {g}"] = float(s)
    drawn = dict(
        zip(zip(edges["earlier"], edges["later"], strict=True), edges["score"], strict=True)
    )
    assert set(drawn) == set(expected)
    for pair, score in expected.items():
        assert drawn[pair] == pytest.approx(score, rel=1e-4)
    best = max(expected, key=expected.get)
    assert " → ".join(best) in " ".join(section.title_text().split())


def test_until_a_click_the_pair_drawn_is_the_modes_strongest(page):
    page.param.update(show_composition=True, composed_pair=("", -1, "", -1), sample=0)
    section = page.sections["composition"]
    for mode in ("K", "V"):
        page.param.update(composition=mode)
        edges = section.edges()
        best = int(np.argmax(edges["score"]))
        own = ", sample 0 (the model's own mask)"
        assert " ".join(page.engine.title("pair earlier").split()) == edges["earlier"][best] + own
        assert " ".join(page.engine.title("pair later").split()) == edges["later"][best] + own


def test_a_click_on_a_line_draws_both_heads_and_opens_the_later(page, run):
    page.param.update(show_composition=True, composition="K", sample=2, head=0)
    section = page.sections["composition"]
    edges = section.edges()
    i = next(i for i, later in enumerate(edges["later_layer"]) if later == LAYER)
    along = round(0.7 * (len(edges["xs"][i]) - 1))  # 70 % along the line (a curve, if it skips)
    x, y = edges["xs"][i][along], edges["ys"][i][along]
    section.click(x, y + 0.05)
    early, h, late, g = page.composed_pair
    assert (early, h, late, g) == (
        edges["earlier_layer"][i], edges["earlier_head"][i], LAYER, edges["later_head"][i]
    )  # fmt: skip
    assert page.head == g  # the later head opened in the matrix
    own = "sample 2 (the model's own mask)"
    assert " ".join(page.engine.title("pair earlier").split()) == f"{early} head {h}, {own}"
    assert " ".join(page.engine.title("pair later").split()) == f"{late} head {g}, {own}"
    own = run.capture(2)["weights"].sel(layer=early).isel(batch=0, head=h).values
    drawn = page.engine.drawn("pair earlier", "Pair")
    assert drawn.shape == (220, 220)
    assert np.nanmean(drawn) == pytest.approx(np.nanmean(own), rel=0.02)
    section.click(0.0, 7.4)  # no line near
    assert page.composed_pair == (early, h, late, g)
    assert "no line there" in section.status.object


def test_the_model_views_tiles_carry_the_dense_copying_score(run):
    explorer = AttentionExplorer(run.capture(0))
    explorer.__panel__().get_root(Document())
    mats = dense(run)
    found = {}
    for key, handles in explorer.engine.plots("model view").items():
        if key.group == "Copying":
            data = handles[0]["source"].data
            found = dict(
                zip(zip(data["layer"], data["head"], strict=True), data["copying"], strict=True)
            )
    assert len(found) == 24
    for layer, name in enumerate(run.heads()):
        for head in range(8):
            values = torch.linalg.eigvals(mats[name, head][1])
            share = float(values.abs()[values.real > 0].sum() / values.abs().sum())
            assert found[layer + 0.36, head] == f"OV copy {share:.2f}"

"""The page's "what changes the prediction" section and the heads' roles, against the demo
model itself: each cell is the model run on the corrupted window with one head's lane
replaced, before its output projection, by the clean run's (forward pre-hooks, the long
way)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from bokeh.document import Document

import attnpanel
from attnpanel.app.explorer import AttentionExplorer
from attnpanel.app.sections.patching import PATCHING_NEEDS_MODEL
from attnpanel.nilm.demo import demo_model_run, demo_windows, without_appliance
from attnpanel.nilm.nilmformer import time_features
from attnpanel.readouts.roles import trace_roles

WINDOWS = 4


@pytest.fixture(scope="module")
def run():
    return demo_model_run(n_windows=WINDOWS)


@pytest.fixture(scope="module")
def page(run):
    explorer = AttentionExplorer(attnpanel.demo(n_windows=WINDOWS), model=run)
    explorer.__panel__().get_root(Document())
    return explorer


def kettle_window(windows: int = WINDOWS) -> int:
    """A held-out window where the kettle runs (taking it out changes the prediction)."""
    held = demo_windows(windows)
    on = (held["appliance_power"].sel(appliance="kettle") > 0).sum("position").values
    return int(np.argmax(on))


@contextlib.contextmanager
def lane_from(module, head: int, source: torch.Tensor, n_heads: int = 8):
    """The long way: the out projection's input with ``head``'s lane from ``source``."""

    def hook(_module, args):
        merged = args[0].clone()
        width = merged.shape[-1] // n_heads
        merged[..., head * width : (head + 1) * width] = source[
            ..., head * width : (head + 1) * width
        ]
        return (merged,)

    handle = module.register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def long_way_effect(run, sample: int, layer: str, head: int) -> float:
    held = demo_windows(WINDOWS)
    features = time_features(held["time"].values[sample : sample + 1])
    clean = torch.from_numpy(held["aggregate"].values[sample : sample + 1])
    corrupted = torch.from_numpy(without_appliance(held.isel(window=[sample]), "kettle"))
    kettle = list(run.series).index("kettle")
    module = run.model.get_submodule(f"{layer}.wo")
    taken = []
    handle = module.register_forward_pre_hook(lambda _m, args: taken.append(args[0].clone()))
    with torch.no_grad():
        high = float(run.model(clean, features)[:, kettle].double().sum())
    handle.remove()
    with torch.no_grad():
        low = float(run.model(corrupted, features)[:, kettle].double().sum())
        with lane_from(module, head, taken[0]):
            patched = float(run.model(corrupted, features)[:, kettle].double().sum())
    return (patched - low) / (high - low)


def test_the_map_is_each_head_patched_into_the_window_without_the_kettle(page, run):
    sample = kettle_window()
    page.param.update(show_patching=True, corruption="without the kettle", sample=sample)
    drawn = page.drawn("patching", "Patching")
    assert drawn.shape == (3, 8)
    for layer, head in (("encoder.2.attention", 7), ("encoder.0.attention", 3)):
        row = int(layer.split(".")[1])
        assert drawn[row, head] == pytest.approx(
            long_way_effect(run, sample, layer, head), rel=1e-3, abs=1e-5
        )
    title = page.engine.title("patching")
    assert " ".join(title.split()) == f"output patched into sample {sample} without the kettle"


def test_a_click_draws_the_head_patched_and_opens_it(page, run):
    sample = kettle_window()
    page.param.update(show_patching=True, corruption="without the kettle", sample=sample, head=0)
    page.sections["patching"].click(x=5.1, y=2.2)  # row 2: the traced layer
    assert page.patched_head == ("encoder.2.attention", 5)
    assert page.head == 5  # opened in the matrix
    title = page.engine.title("patched prediction")
    assert title == (
        f"prediction on sample {sample} without the kettle, encoder.2.attention head 5 patched in"
    )
    held = demo_windows(WINDOWS)
    features = time_features(held["time"].values[sample : sample + 1])
    clean = torch.from_numpy(held["aggregate"].values[sample : sample + 1])
    corrupted = torch.from_numpy(without_appliance(held.isel(window=[sample]), "kettle"))
    module = run.model.get_submodule("encoder.2.attention.wo")
    taken = []
    handle = module.register_forward_pre_hook(lambda _m, args: taken.append(args[0].clone()))
    with torch.no_grad():
        run.model(clean, features)
    handle.remove()
    with lane_from(module, 5, taken[0]), torch.no_grad():
        expected = run.model.predict(corrupted, features)[0].numpy()
    drawn = {
        key.label: np.asarray(found[0]["source"].data["value"])
        for key, found in page.engine.plots("patched prediction").items()
    }
    for i, name in enumerate(run.series):
        np.testing.assert_allclose(
            drawn[f"{name} (head patched)"], expected[i], rtol=1e-5, atol=1e-3
        )


def test_other_corruptions_and_what_is_patched(page):
    page.param.update(show_patching=True, corruption="another sample", corrupt_sample=3, sample=0)
    assert np.isfinite(page.drawn("patching", "Patching")).all()
    assert "patched into sample 3" in " ".join(page.engine.title("patching").split())
    # sample 3's curves on sample 0's time axis: the title says so (its hours differ)
    curves = page.engine.title("patched prediction")
    assert curves.startswith("prediction on sample 3, ") and curves.endswith(
        "patched in; sample 3 drawn by position on sample 0's clock"
    ), curves
    page.param.update(corruption="span replaced by zeros", corrupt_span=(100, 200), patch_what="v")
    assert np.isfinite(page.drawn("patching", "Patching")).all()
    title = page.engine.title("patching")
    assert (
        " ".join(title.split())
        == "v patched into sample 0 with positions 100-199 replaced by zeros"
    )
    page.param.update(corruption="another sample", corrupt_sample=0)  # the shown one itself
    assert np.isnan(page.drawn("patching", "Patching")).all()
    assert "no difference" in " ".join(page.engine.title("patching").split())
    page.param.update(patch_what="output", corruption="without the kettle")


def test_a_window_without_kettle_use_says_there_is_no_difference(page):
    held = demo_windows(WINDOWS)
    idle = (held["appliance_power"].sel(appliance="washing_machine") > 0).sum("position").values
    if idle.min() > 0:
        pytest.fail("every test window runs the washing machine: pick another appliance")
    page.param.update(
        show_patching=True, corruption="without the washing_machine", sample=int(np.argmin(idle))
    )
    assert np.isnan(page.drawn("patching", "Patching")).all()
    assert "no difference" in " ".join(page.engine.title("patching").split())


def test_without_the_model_the_section_says_what_it_needs():
    explorer = AttentionExplorer(attnpanel.demo(n_windows=2))
    explorer.__panel__().get_root(Document())
    explorer.param.update(show_patching=True)
    section = explorer.sections["patching"].__panel__()
    assert PATCHING_NEEDS_MODEL in section.objects[0].objects[1].object


def test_head_tiles_and_the_model_view_carry_each_heads_role():
    layer, x = built_roles_layer()
    traced = attnpanel.trace(layer, x)
    explorer = AttentionExplorer(traced)
    explorer.__panel__().get_root(Document())
    names = explorer.sections["heads"].grid.names.data["text"]
    assert names == [
        "head 0 · previous token",
        "head 1 · attends to itself",
        "head 2 · sink",
        "head 3 · broad",
    ]
    roles = trace_roles(traced, 0)
    assert list(roles["role"].values[0]) == [n.split(" · ")[1] for n in names]


def built_roles_layer():
    from test_roles import built_roles_layer as built

    return built()


def test_the_model_view_writes_each_maps_role():
    import zoo

    model, args, kwargs = zoo.case("nanogpt_sdpa_causal").build()
    traced = attnpanel.capture(model, *args, **kwargs)
    explorer = AttentionExplorer(traced, sample=1)
    explorer.__panel__().get_root(Document())
    (labels,) = [
        h for key, h in explorer.engine.plots("model view").items() if key.group == "Roles"
    ]
    drawn = list(labels[0]["source"].data["role"])
    expected = trace_roles(traced, 1)["role"].values  # (layer, head)
    assert drawn == [str(r) for r in expected.ravel()]
    assert len(drawn) == traced.sizes["layer"] * traced.sizes["head"]


def test_the_words_say_what_the_score_is(page):
    page.param.update(show_patching=True, corruption="without the kettle", patch_what="output")
    assert "the kettle's predicted power" in page.sections["patching"].explained.object
    page.param.update(corruption="another sample", corrupt_sample=2)
    assert "‖output‖" in page.sections["patching"].explained.object
    page.param.update(corruption="without the kettle")


def test_start_values_stay_and_a_setting_the_input_ignores_is_the_same_request(run):
    explorer = AttentionExplorer(
        attnpanel.demo(n_windows=WINDOWS), model=run, corruption="another sample",
        corrupt_sample=3, corrupt_span=(10, 20),
    )  # fmt: skip
    assert (explorer.corruption, explorer.corrupt_sample, explorer.corrupt_span) == (
        "another sample", 3, (10, 20),
    )  # fmt: skip
    assert explorer.param.corrupt_span.bounds == (0, 480)  # the model's input positions
    explorer.param.update(corruption="without the kettle")
    before = explorer.patching
    explorer.param.update(corrupt_sample=2, corrupt_span=(30, 40))  # neither read by it
    assert explorer.patching == before
    explorer.param.update(corruption="span replaced by its mean")
    assert explorer.patching.span == (30, 40)


def test_another_corrupted_input_forgets_the_clicked_head(page):
    sample = kettle_window()
    page.param.update(show_patching=True, corruption="without the kettle", sample=sample)
    page.sections["patching"].click(x=1.0, y=0.0)
    assert page.patched_head == ("encoder.0.attention", 1)
    page.param.update(corruption="without the fridge")
    assert page.patched_head == ("", -1)
    assert "(the largest effect)" in page.engine.title("patched prediction")

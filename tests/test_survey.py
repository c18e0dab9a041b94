"""``attnpanel.survey`` against the definitions computed the long way from the model's own
attention (``zoo`` references, float64), its store (resumes, never reads half a batch,
refuses another model's) and its dask path."""

from __future__ import annotations

import copy

import dask.array
import numpy as np
import pytest
import torch
import xarray as xr
import zoo
from test_flow import LONG_WAY, first_input

from attnpanel.surveys.store import SurveyStore, SurveyStoreError
from attnpanel.surveys.survey import survey


def long_statistics(a: np.ndarray, padded: np.ndarray | None) -> dict[str, np.ndarray]:
    """The definitions, row by row: ``a`` ``(B, H, L, L)`` float64, ``padded`` ``(B, L)``."""
    batch, heads, length, _ = a.shape
    found = {n: np.zeros((batch, heads)) for n in ("entropy", "distance", "sink")}
    found.update({n: np.zeros((batch, heads)) for n in ("diagonal_share", "previous_share")})
    found["max_weight"] = np.zeros((batch, heads))
    for b in range(batch):
        real = np.ones(length, bool) if padded is None else ~padded[b]
        first = int(np.argmax(real))
        queries = [i for i in range(length) if real[i]]
        with_previous = [i for i in queries if i >= 1 and real[i - 1]]
        for h in range(heads):
            rows = a[b, h]
            entropy = [-sum(x * np.log(x) for x in rows[i] if x > 0) for i in queries]
            distance = [sum(rows[i, j] * abs(i - j) for j in range(length)) for i in queries]
            found["entropy"][b, h] = np.mean(entropy)
            found["distance"][b, h] = np.mean(distance)
            found["sink"][b, h] = np.mean([rows[i, first] for i in queries])
            found["diagonal_share"][b, h] = np.mean([rows[i, i] for i in queries])
            found["previous_share"][b, h] = np.mean([rows[i, i - 1] for i in with_previous])
            found["max_weight"][b, h] = np.mean([rows[i].max() for i in queries])
    return found


def own_attention(name):
    """The model, its inputs, its own weights per layer and the padded positions."""
    case = zoo.case(name)
    model, args, kwargs = case.build()
    weights = [w.detach().double().numpy() for _, w in case.reference(model, args, kwargs)]
    padded = None if case.padding is None else case.padding.numpy()
    return case, model, args, kwargs, weights, padded


@pytest.mark.parametrize(
    "name", ["nanogpt_sdpa_causal", "nilmformer_real", "bert_padding", "torch_encoder_padding"]
)
def test_survey_statistics_are_the_definitions_on_the_models_own_attention(name):
    case, model, args, kwargs, weights, padded = own_attention(name)
    found = survey(model, [(args, kwargs)], prepare=lambda batch: batch, progress=False)
    assert found.sizes["layer"] == len(weights)
    for index, a in enumerate(weights):
        expected = long_statistics(a, padded)
        for stat, values in expected.items():
            got = found[stat].isel(layer=index).values
            np.testing.assert_allclose(got, values, rtol=1e-5, atol=1e-8, err_msg=stat)


@pytest.mark.parametrize("name", ["nanogpt_sdpa_causal", "bert_padding"])
def test_value_weighted_statistics_weigh_rows_by_the_norm_of_v_w_o(name):
    case, model, args, kwargs, weights, padded = own_attention(name)
    pattern, read = LONG_WAY[name]
    modules = [pattern.format(i) for i in range(len(weights))]
    found = survey(model, [(args[0],) if args else kwargs], progress=False)
    with zoo.no_fastpath():
        calls = zoo.inputs_of(model, modules, args, kwargs)
    for index, (module_name, call_args, call_kwargs) in enumerate(calls):
        module = model.get_submodule(module_name)
        extra = dict(model=model, name=module_name) if name == "bert_padding" else {}
        with torch.no_grad():
            v, w_o = read(module, first_input(call_args, call_kwargs), **extra)
        blocks = w_o.detach().double().reshape(w_o.shape[0], v.shape[1], v.shape[3])
        norms = torch.einsum("bhje,dhe->bhjd", v, blocks).norm(dim=-1).numpy()
        weighted = weights[index] * norms[:, :, None, :]
        weighted = weighted / weighted.sum(-1, keepdims=True)
        for stat, values in long_statistics(weighted, padded).items():
            got = found["vw_" + stat].isel(layer=index).values
            np.testing.assert_allclose(got, values, rtol=1e-5, atol=1e-8, err_msg=stat)


@pytest.fixture
def nanogpt():
    model, args, _ = zoo.case("nanogpt_sdpa_causal").build()
    x = args[0]
    batches = [torch.roll(x, shift, dims=1) for shift in range(4)]  # 4 batches of 2
    return model, batches


def test_batches_one_by_one_equal_one_batch_and_time_distances(nanogpt):
    model, batches = nanogpt
    apart = survey(model, batches, progress=False, step=60.0)
    together = survey(model, [torch.cat(batches)], progress=False)
    assert apart.sizes["sample"] == 8
    np.testing.assert_array_equal(apart["sample"].values, np.arange(8))
    for stat in together.data_vars:
        np.testing.assert_allclose(apart[stat].values, together[stat].values, rtol=1e-6)
    np.testing.assert_allclose(apart["distance_time"], apart["distance"] * 60.0)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.cat(batches), torch.zeros(8)), batch_size=3
    )
    paired = survey(model, loader, prepare=lambda b: ((b[0],), {}), progress=False)
    np.testing.assert_allclose(paired["entropy"].values, together["entropy"].values, rtol=1e-6)
    with pytest.raises(TypeError, match="prepare="):
        survey(model, [3.0], progress=False)


def resumed_counting(model, batches, store) -> tuple[xr.Dataset, int]:
    """The survey resumed on ``store``, and how many forwards the model ran for it."""
    seen = []
    hook = model.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[0]))
    try:
        return survey(model, batches, store=store, progress=False), len(seen)
    finally:
        hook.remove()


def test_an_interrupted_survey_resumes_after_its_last_whole_batch(nanogpt, tmp_path):
    model, batches = nanogpt
    whole = survey(model, batches, progress=False)
    store = tmp_path / "survey.zarr"

    def interrupted():
        yield from batches[:2]
        raise KeyboardInterrupt  # Ctrl-C while the third batch is read

    with pytest.raises(KeyboardInterrupt):
        survey(model, interrupted(), store=store, progress=False)
    partial = SurveyStore(store).read()
    assert partial.sizes["sample"] == 4
    resumed, forwards = resumed_counting(model, batches, store)
    assert forwards == 2 + 1  # the two batches left, and the first sample's layer check
    xr.testing.assert_allclose(resumed.load(), whole.assign_attrs(resumed.attrs))


def test_a_half_written_batch_is_never_read_and_is_trimmed_on_resume(
    nanogpt, tmp_path, monkeypatch
):
    """A crash in the middle of an append: xarray has replaced the store's attributes and
    written part of the rows when it stops. The whole batches stay readable, and the resume
    runs only the batches left."""
    from xarray.backends.zarr import ZarrStore

    model, batches = nanogpt
    store = tmp_path / "survey.zarr"
    survey(model, batches[:2], store=store, progress=False)
    written = ZarrStore.set_variables

    def crash(self, *args, **kwargs):
        written(self, *args, **kwargs)  # the rows are in the store ...
        raise KeyboardInterrupt  # ... and the counts never follow

    monkeypatch.setattr(ZarrStore, "set_variables", crash)
    with pytest.raises(KeyboardInterrupt):
        survey(model, batches, store=store, progress=False)
    monkeypatch.setattr(ZarrStore, "set_variables", written)
    assert xr.open_zarr(str(store), consolidated=False).sizes["sample"] == 6
    assert SurveyStore(store).read().sizes["sample"] == 4
    resumed, forwards = resumed_counting(model, batches, store)
    assert forwards == 2 + 1  # the two batches left, and the first sample's layer check
    whole = survey(model, batches, progress=False)
    assert resumed.sizes["sample"] == 8
    np.testing.assert_allclose(resumed["entropy"].values, whole["entropy"].values)


@pytest.mark.parametrize("zarr_format", [3, 2])
def test_a_write_cut_between_two_arrays_leaves_the_whole_batches_readable(
    nanogpt, tmp_path, zarr_format
):
    """Ctrl-C while xarray appends array after array: some arrays hold the new rows, others
    do not (``xr.open_zarr`` refuses such a store). ``read`` gives the whole samples, lazily,
    as ``xr.open_zarr`` read them before the cut, and the resume trims the rest; in either
    zarr format (v2 names its dimensions in an attribute, v3 in its metadata)."""
    import zarr

    model, batches = nanogpt
    store = tmp_path / "survey.zarr"
    with zarr.config.set(default_zarr_format=zarr_format):
        survey(model, batches[:2], store=store, progress=False)
    before = xr.open_zarr(str(store), consolidated=False).compute()  # xarray's own reading
    group = zarr.open_group(str(store), mode="r+")
    assert group.metadata.zarr_format == zarr_format
    cut = ["sample", "entropy", "sink", "vw_distance"]  # the arrays the write reached
    for name in cut:
        array = group[name]
        array.resize((7, *array.shape[1:]))
        array[4:] = 99 if name == "sample" else np.nan
    with pytest.raises(ValueError, match="conflicting sizes"):
        xr.open_zarr(str(store), consolidated=False)
    read = SurveyStore(store).read()
    assert isinstance(read["entropy"].data, dask.array.Array)  # nothing loaded up front
    xr.testing.assert_identical(read.compute(), before)
    with zarr.config.set(default_zarr_format=zarr_format):
        resumed = survey(model, batches, store=store, progress=False)
    whole = survey(model, batches, progress=False)
    xr.testing.assert_allclose(resumed.drop_attrs(), whole.drop_attrs())
    assert resumed.attrs["samples_done"] == 8 and resumed.attrs["batches_done"] == 4


def test_a_resume_with_other_batches_is_refused(nanogpt, tmp_path):
    model, batches = nanogpt
    store = tmp_path / "survey.zarr"
    survey(model, batches[:1], store=store, progress=False)  # 2 samples
    ones = [x[i : i + 1] for x in batches for i in range(2)]  # batches of 1: fine
    assert survey(model, ones, store=store, progress=False).sizes["sample"] == 8
    other = tmp_path / "other.zarr"
    survey(model, [torch.cat(batches)[:3]], store=other, progress=False)  # 3 samples
    with pytest.raises(SurveyStoreError, match="holds 3 whole samples.*end at 2 and 4"):
        survey(model, batches, store=other, progress=False)


def test_a_survey_beside_other_threads_running_the_same_model(tmp_path):
    """A served page runs the model in other threads while the survey records (layer names
    come from module hooks: they must follow only the recording thread)."""
    import threading

    model, args, kwargs = zoo.case("torch_encoder_padding").build()
    alone = survey(model, [(args, kwargs)], prepare=lambda b: b, progress=False)
    stop, failures, runs = threading.Event(), [], []

    def busy():
        try:
            with torch.no_grad():
                while not stop.is_set():
                    model(*args, **kwargs)
                    runs.append(1)
        except Exception as error:  # reported below, on the test's thread
            failures.append(error)

    workers = [threading.Thread(target=busy) for _ in range(2)]
    for worker in workers:
        worker.start()
    try:
        for _ in range(5):
            beside = survey(model, [(args, kwargs)], prepare=lambda b: b, progress=False)
            xr.testing.assert_allclose(beside, alone)
    finally:
        stop.set()
        for worker in workers:
            worker.join()
    assert failures == [] and len(runs) > 0


def test_a_store_of_another_model_or_version_is_refused_by_name(nanogpt, tmp_path):
    model, batches = nanogpt
    store = tmp_path / "survey.zarr"
    survey(model, batches[:1], store=store, progress=False)
    other = copy.deepcopy(model)
    with torch.no_grad():
        next(other.parameters()).add_(0.01)
    with pytest.raises(SurveyStoreError, match="another model.*NanoGPT.*fingerprint"):
        survey(other, batches, store=store, progress=False)
    import zarr

    zarr.open_group(str(store), mode="r+").attrs["version"] = 99
    with pytest.raises(SurveyStoreError, match="format version 99"):
        survey(model, batches, store=store, progress=False)
    foreign = tmp_path / "foreign.zarr"
    xr.Dataset({"x": ("a", np.arange(3))}).to_zarr(str(foreign))
    with pytest.raises(SurveyStoreError, match="not an attnpanel survey store"):
        survey(model, batches, store=foreign, progress=False)
    assert xr.open_zarr(str(foreign))["x"].values.tolist() == [0, 1, 2]  # left as it was


@pytest.mark.slow
def test_a_two_worker_cluster_survey_equals_the_one_here(nanogpt):
    from dask.distributed import Client, LocalCluster

    model, batches = nanogpt
    here = survey(model, batches, progress=False)
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
        ) as cluster,
        Client(cluster) as client,
    ):
        there = survey(model, batches, scheduler=client, progress=False)
    xr.testing.assert_allclose(there, here)
    np.testing.assert_array_equal(there["entropy"].values, here["entropy"].values)


def test_statistics_from_scores_equal_those_from_the_weights_and_check_the_output():
    """The block-by-block path (SDPA's weights never formed) against the weights path, with
    a padding mask, a causal mask and an additive bias; a wrong output is caught."""
    from attnpanel.kernels.attention import attention_weights
    from attnpanel.kernels.statistics import head_statistics_of, head_statistics_of_scores

    generator = torch.Generator().manual_seed(3)
    batch, heads, length, width = 3, 4, 37, 8
    q, k, v = (torch.randn(batch, heads, length, width, generator=generator) for _ in range(3))
    padded = torch.zeros(batch, length, dtype=torch.bool)
    padded[1, 30:] = True
    padded[2, :4] = True  # padded on the left: its sink is key 4
    blocked = padded[:, None, None, :] | torch.ones(length, length, dtype=torch.bool).triu(1)
    bias = torch.randn(1, heads, length, length, generator=generator)
    norms = torch.rand(batch, heads, length, generator=generator) + 0.1
    for mask_bias in (None, bias):
        weights = attention_weights(q, k, blocked, 0.3, bias=mask_bias)
        context = weights @ v
        found, error = head_statistics_of_scores(q, k, 0.3, blocked, mask_bias, norms, v, context)
        expected = head_statistics_of(weights, blocked.all(dim=1).all(dim=1), norms)
        assert error < 1e-5
        assert set(found) == set(expected)
        for name, values in expected.items():
            np.testing.assert_allclose(found[name], values, rtol=2e-5, atol=1e-7, err_msg=name)
        long = long_statistics(weights.double().numpy(), padded.numpy())
        for name, values in long.items():  # the sink of sample 2 on key 4, as defined
            np.testing.assert_allclose(found[name], values, rtol=2e-5, atol=1e-7, err_msg=name)
    _, error = head_statistics_of_scores(q, k, 0.3, blocked, bias, None, v, context + 0.5)
    assert error == pytest.approx(0.5, abs=1e-4)


def test_a_batchs_tensors_are_freed_as_the_batch_ends_without_the_cycle_collector(nanogpt):
    """A watcher and its module stack held each other (the stack keeps the watcher's hooks):
    every batch's q, k and weights stayed alive until Python's slowest collection, and a
    survey's memory grew with its batches (1,024 demo windows: +1.8 GB). With the collector
    off, the recorder of a batch and every tensor it saw go as soon as it is dropped."""
    import gc
    import weakref

    from attnpanel.capturing.capture import record_calls

    model, batches = nanogpt
    inputs = batches[0] if isinstance(batches[0], tuple) else (batches[0],)
    gc.collect()
    gc.disable()
    try:
        recorder, _ = record_calls(model, inputs, {})
        tensors = [weakref.ref(t) for call in recorder.calls for t in (call.q, call.k)]
        sites = [weakref.ref(site) for site in recorder.sites]
        assert tensors and sites
        del recorder
        assert all(ref() is None for ref in tensors + sites)
    finally:
        gc.enable()

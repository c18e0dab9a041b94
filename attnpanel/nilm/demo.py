"""The demo trace: one attention layer of the trained NILMFormer on held-out household days.

:func:`demo` loads the weights shipped in ``attnpanel/nilm/data/nilmformer.pt``, generates
32 held-out 8-hour windows (their own seed and dates, never seen in training), runs the model and
returns :func:`attnpanel.trace` of one encoder layer's attention on the very input that
layer sees, plus the timestamps, the aggregate, the appliance ground truth and the
model's disaggregation (see ``docs/demo.md``). :func:`head_statistics` summarises what
each head attends to.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np
import torch
import xarray as xr

from attnpanel.interventions.model_run import Corruption, ModelRun
from attnpanel.kernels.statistics import head_statistics_of
from attnpanel.nilm.power import HELDOUT_SEED, HELDOUT_START, PowerConfig, generate, windows
from attnpanel.traces import upgrades, virtual
from attnpanel.traces.build import trace
from attnpanel.traces.on_demand import maps_on_demand

DEMO_LAYER = 2  # the default layer; docs/demo.md shows why
LONG_DAYS = 45  # demo_long: 45 days at one minute, L = 64,800
EVENT_APPLIANCES = ("kettle", "microwave", "washing_machine", "dishwasher")
LOCAL_RADIUS = 15  # minutes; attention within this distance of the query counts as local
AGGREGATE_ATTRS = {"long_name": "aggregate power", "units": "W"}
TRUTH_ATTRS = {"long_name": "appliance power", "units": "W"}
PREDICTED_ATTRS = {"long_name": "predicted appliance power", "units": "W"}
EVENT_THRESHOLD = {"fridge": 50.0}  # W above which an appliance counts as running ...
EVENT_THRESHOLD_DEFAULT = 300.0  # ... for the others: heaters, kettle, microwave, spin


@functools.lru_cache(maxsize=2)
def _model(path: Path):
    # Loading is cheap but not free; the explorer may ask for several layers in a row.
    # nilmformer is imported here so that `import attnpanel` does not load it, which
    # keeps `python -m attnpanel.nilm.training` free of runpy's double-import warning.
    from attnpanel.nilm.nilmformer import load_model

    return load_model(path)


def demo_windows(n_windows: int = 32, seed: int = HELDOUT_SEED) -> xr.Dataset:
    """Held-out 8-hour windows: 06:00-14:00 and 14:00-22:00 of consecutive days.

    Parameters
    ----------
    n_windows : int
        How many windows (two per day).
    seed : int
        Seed of the power generator; the default is the held-out seed, never trained on.

    Returns
    -------
    xarray.Dataset
        As :func:`attnpanel.nilm.power.windows`, with dims ``window``, ``appliance``, ``position``.
    """
    if n_windows < 1:
        raise ValueError(f"n_windows must be positive, got {n_windows}")
    n_days = (n_windows + 1) // 2
    ds = generate(n_days + 1, seed=seed, config=PowerConfig(start=HELDOUT_START))
    cut = windows(ds, length=480, offset=6 * 60)  # starts at 06:00, 14:00, 22:00, ...
    daytime = np.flatnonzero(np.arange(cut.sizes["window"]) % 3 != 2)[:n_windows]
    return cut.isel(window=daytime).assign_coords(window=np.arange(n_windows))


def without_appliance(held: xr.Dataset, appliance: str) -> np.ndarray:
    """The windows' aggregate power with one appliance's own power taken out, from the
    generator's ground truth: "this window without the kettle", ``(window, position)``."""
    names = [str(a) for a in held["appliance"].values]
    if appliance not in names:
        raise ValueError(f"no appliance {appliance!r}; the demo has {', '.join(names)}")
    own = held["appliance_power"].sel(appliance=appliance)
    return (held["aggregate"] - own).clip(min=0.0).values.astype(np.float32)


def demo(
    layer: int = DEMO_LAYER,
    n_windows: int = 32,
    seed: int = HELDOUT_SEED,
    weights: str | Path | None = None,
    dense: bool = True,
    on_demand: bool = False,
) -> xr.Dataset:
    """Trace of one attention layer of the trained demo NILMFormer on held-out windows.

    Parameters
    ----------
    layer : int
        Encoder layer to trace, ``0 .. n_layers - 1`` (negative counts from the end).
    n_windows : int
        Number of 480-step windows (the batch).
    seed : int
        Seed of the held-out household data.
    weights : str or Path, optional
        A model file from :func:`attnpanel.nilm.nilmformer.save_model`; default the shipped one.
    dense : bool
        Keep every map (scores and weights, 15 MB a window); False keeps each row's
        log-sum-exp instead, from which every map is recomputed exactly (the file to share:
        ``attnpanel trace --demo``, 1.1 MB a window; :func:`attnpanel.explore` opens it on
        the same page).
    on_demand : bool
        With ``dense``: hold no map, and recompute one sample's maps from ``q`` and ``k``
        when it is read, which gives the recorded maps bit for bit (checked on every
        sample; :func:`attnpanel.traces.on_demand.maps_on_demand`): 26 MB instead of 476 MB
        for the 32 windows. What the served demo holds.

    Returns
    -------
    xarray.Dataset
        A trace (``x, q, k, v, scores, weights, context, output, w_q, w_k, w_v, w_o``) with
        ``weights`` of dims ``(batch, head, query, key)``, plus the reference series
        (``docs/trace.md``): the aggregate power as ``signal`` (batch, position), each
        appliance's true and predicted power as ``truth`` and ``prediction`` (batch, series,
        position), in W; the ``time`` (batch, position) and ``series`` (the appliances)
        coordinates, the ``layer`` coordinate (its module name, ``encoder.2.attention``) and
        attrs ``layer_index``, ``n_layers`` and ``source``.

    Raises
    ------
    ValueError
        For a layer the model does not have.
    FileNotFoundError
        When the shipped weights are missing.
    """
    held = demo_windows(n_windows, seed)
    found = _traced(held, layer, weights, f"{n_windows} held-out windows", dense)
    if not dense:  # virtual to be small on disk: opened, its maps are computed once
        found.attrs[virtual.COMPACT] = "each row's log-sum-exp instead of its maps"
    elif on_demand:
        found = maps_on_demand(found)
    return found


def demo_model_run(
    n_windows: int = 32,
    seed: int = HELDOUT_SEED,
    layer: int = DEMO_LAYER,
    weights: str | Path | None = None,
) -> ModelRun:
    """The demo model at hand for :func:`demo`'s trace: head toggles switch heads off
    inside it and the explorer draws each appliance's predicted power again.

    Its metrics, per appliance on the shown sample: the MAE in W and the F1 of the on-state
    (the model's own on-thresholds), as ``docs/demo.md`` scores the model.
    """
    from attnpanel.nilm.nilmformer import TIME_FEATURE_NAMES, default_path, time_features
    from attnpanel.nilm.training import f1_score

    path = default_path() if weights is None else Path(weights)
    model = _model(path.resolve())
    layer = layer % len(model.encoder)
    held = demo_windows(n_windows, seed)
    aggregate = torch.from_numpy(held["aggregate"].values)  # (B, L)
    features = time_features(held["time"].values)  # (B, C, L)
    config = model.config

    def predict(output: torch.Tensor) -> np.ndarray:
        return (output * model.target_scale).clamp_min(0).numpy()  # (B, A, L) W

    def metrics(prediction: np.ndarray, truth: np.ndarray) -> dict[str, float]:
        found = {}
        for i, name in enumerate(config.appliances):
            threshold = config.on_threshold[i]
            found[f"MAE {name} (W)"] = float(np.abs(prediction[i] - truth[i]).mean())
            found[f"F1 {name}"] = f1_score(truth[i] > threshold, prediction[i] > threshold)
        return found

    def without(name: str) -> Corruption:
        channel = list(config.appliances).index(name)

        def make(sample: int) -> tuple[tuple, dict]:
            one = held.isel(window=[sample])
            power = torch.from_numpy(without_appliance(one, name))
            return (power, features[sample : sample + 1]), {}

        def score(output: torch.Tensor) -> torch.Tensor:  # the appliance's predicted power
            return output[:, channel].double().sum()

        return Corruption(f"without the {name}", make, score, f"the {name}'s predicted power")

    return ModelRun(
        model,
        (aggregate, features),
        layers=[f"encoder.{layer}.attention"],
        predict=predict,
        metrics=metrics,
        series=list(config.appliances),
        corruptions=[without(name) for name in config.appliances],
        channels=["aggregate power", *TIME_FEATURE_NAMES],
    )


def demo_long(
    days: int = LONG_DAYS,
    layer: int = DEMO_LAYER,
    seed: int = HELDOUT_SEED,
    weights: str | Path | None = None,
    dense: bool | None = None,
) -> xr.Dataset:
    """The demo model on one long sequence: ``days`` held-out days at one minute.

    At the default 45 days, L = 64,800: the model runs its attention in bounded memory
    (:func:`attnpanel.kernels.tiles.attention`) and the trace is virtual (each row's ``lse``
    instead of the maps, :mod:`attnpanel.traces.virtual`) unless ``dense`` says otherwise. One
    sample; otherwise as :func:`demo` (the aggregate, the appliance truth and the
    model's prediction, clock times).
    """
    if int(days) != days or days < 1:
        raise ValueError(f"days must be a positive integer, got {days!r}")
    series = generate(int(days), seed=seed, config=PowerConfig(start=HELDOUT_START))
    held = windows(series, length=int(days) * 24 * 60)
    what = f"{days} held-out day{'s' if days != 1 else ''} at one minute"
    return _traced(held, layer, weights, what, dense)


def layer_module_name(layer: int) -> str:
    """The demo model's name of its encoder layer ``layer``'s attention module (as
    :func:`attnpanel.capture` and a survey name it)."""
    return f"encoder.{layer}.attention"


def _traced(held: xr.Dataset, layer: int, weights, what: str, dense: bool | None = None):
    """The trace of one encoder layer of the demo model on the windows ``held``."""
    from attnpanel.nilm.nilmformer import default_path, time_features

    path = default_path() if weights is None else Path(weights)
    model = _model(path.resolve())
    n_layers = len(model.encoder)
    if not -n_layers <= layer < n_layers:
        raise ValueError(f"layer must be in 0..{n_layers - 1} (or negative), got {layer}")
    layer = layer % n_layers
    time = held["time"].values  # (batch, position)
    aggregate = torch.from_numpy(held["aggregate"].values)  # (B, L)
    features = time_features(time)  # (B, C, L)
    attention = model.encoder[layer].attention
    seen = []
    # One forward pass gives both the prediction and the input the traced layer sees.
    hook = attention.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    try:
        predicted = model.predict(aggregate, features)  # (B, A, L) W
    finally:
        hook.remove()
    name = layer_module_name(layer)
    source = f"NILMFormer demo ({path.name}), layer {name} of {n_layers} encoder layers, {what}"
    ds = trace(attention, seen[0], time=time, source=source, dense=dense)
    ds = ds.assign(reference_series(held["aggregate"], held["appliance_power"], predicted))
    # the layer's one name, as a capture names it (its module name); attrs keep the index
    ds = ds.assign_coords(layer=name)
    ds.attrs.update(layer_index=layer, n_layers=n_layers)
    return ds


def reference_series(aggregate: xr.DataArray, appliances: xr.DataArray, predicted) -> dict:
    """The demo's reference series in the trace's terms: the aggregate power is the
    ``signal``, each appliance a ``series`` with its true and its ``predicted`` power."""
    dims = ("batch", "series", "position")
    names = {"series": appliances["appliance"].values}
    return {
        "signal": xr.DataArray(
            np.asarray(aggregate), dims=("batch", "position"), attrs=AGGREGATE_ATTRS
        ),
        "truth": xr.DataArray(np.asarray(appliances), dims=dims, coords=names, attrs=TRUTH_ATTRS),
        "prediction": xr.DataArray(
            np.asarray(predicted), dims=dims, coords=names, attrs=PREDICTED_ATTRS
        ),
    }


@upgrades.register
def named_reference_series(ds: xr.Dataset) -> xr.Dataset:
    """A demo trace saved before the reference-series contract (``aggregate``,
    ``appliance_power``, ``predicted_power`` over ``appliance``) in today's names."""
    if "aggregate" not in ds or "appliance_power" not in ds:
        return ds
    renamed = ds.rename({"aggregate": "signal", "appliance_power": "truth", "appliance": "series"})
    if "predicted_power" in renamed:
        renamed = renamed.rename({"predicted_power": "prediction"})
        renamed["prediction"].attrs.update(PREDICTED_ATTRS)
    renamed["signal"].attrs.update(AGGREGATE_ATTRS)
    renamed["truth"].attrs.update(TRUTH_ATTRS)
    return renamed


def head_statistics(ds: xr.Dataset, radius: int = LOCAL_RADIUS) -> xr.Dataset:
    """What each head attends to, from a demo trace.

    Parameters
    ----------
    ds : xarray.Dataset
        A trace with ``weights``; event statistics also need the appliances' ``truth``.
    radius : int
        Keys within this many steps of the query count as local.

    Returns
    -------
    xarray.Dataset
        Per ``head``: ``distance`` (mean ``|query - key|`` weighted by attention, in steps),
        ``entropy`` (mean row entropy, nats), ``entropy_ratio`` (that over the entropy of a
        uniform row over the visible keys), ``local`` (mass within ``radius`` steps), and,
        per ``head`` and ``appliance``, ``event_lift``: the share of attention mass on keys
        where the appliance is on, over the share of such keys (1 = no preference),
        averaged over the windows where it is on.
    """
    weights = np.asarray(ds["weights"].values, dtype=np.float32)  # (B, H, L, S)
    batch, n_heads, length, n_keys = weights.shape
    offset = np.abs(np.arange(length)[:, None] - np.arange(n_keys)[None, :])  # (L, S)
    # distance and entropy: the survey's own statistics (one implementation of each)
    stats = head_statistics_of(torch.from_numpy(np.ascontiguousarray(weights)))
    distance = stats["distance"].mean(0).numpy()
    entropy = stats["entropy"].mean(0).numpy()
    local = np.einsum("bhls,ls->h", weights, (offset <= radius).astype(np.float32))
    local /= batch * length
    visible = n_keys - int(ds.attrs.get("mask") == "diagonal")
    stats = xr.Dataset(
        {
            "distance": ("head", distance),
            "entropy": ("head", entropy),
            "entropy_ratio": ("head", entropy / np.log(visible)),
            "local": ("head", local),
        },
        coords={"head": ds["head"].values},
        attrs={"local_radius": radius, "uniform_entropy": float(np.log(visible))},
    )
    if "truth" in ds:
        mass_per_key = weights.mean(2)  # (B, H, S): attention each key receives per query
        lifts = []
        for name in ds["series"].values:
            threshold = EVENT_THRESHOLD.get(str(name), EVENT_THRESHOLD_DEFAULT)
            on = ds["truth"].sel(series=name).values > threshold
            used = on.any(-1)  # windows where it runs
            mass = np.einsum("bhs,bs->bh", mass_per_key[used], on[used].astype(np.float32))
            share = on[used].mean(-1)  # (b,)
            lifts.append(mass.sum(0) / share.sum() if used.any() else np.full(n_heads, np.nan))
        stats["event_lift"] = (("head", "appliance"), np.stack(lifts, axis=1))
        stats = stats.assign_coords(appliance=ds["series"].values)
    return stats


CACHE_ENV = "ATTNPANEL_CACHE"  # where the stored long demo lives (default ~/.cache/attnpanel)


def cache_folder(folder: str | Path | None = None) -> Path:
    """The folder of stored demos: ``folder``, else ``$ATTNPANEL_CACHE``, else
    ``~/.cache/attnpanel``."""
    found = folder or os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "attnpanel"
    return Path(found).expanduser()


def stored_long_demo(
    days: int = LONG_DAYS,
    folder: str | Path | None = None,
    workers: int = 2,
    progress=print,
) -> Path:
    """The long demo (:func:`demo_long`) stored as a zarr trace with the overviews of
    every head under its own mask, built the first time and reused after.

    At 45 days the build takes about 4 minutes on 2 cores (the trace, then 8 overviews on
    a ``LocalCluster`` of ``workers`` processes); a server started later opens it at
    once. An interrupted build leaves nothing that reads as complete (the trace is
    written beside its place and moved in; each overview likewise).

    Returns
    -------
    Path
        The trace file; its overviews are in ``attnpanel.traces.overviews.folder_for(path)``.
    """
    from attnpanel.traces import io
    from attnpanel.traces.overviews import Overviews, folder_for

    path = cache_folder(folder) / f"demo-long-{int(days)}d.zarr"
    if not path.exists():
        progress(f"building the long demo ({days} days at one minute) into {path} ...")
        path.parent.mkdir(parents=True, exist_ok=True)
        io.save(demo_long(days, dense=False), path)  # virtual at any length
    ds = io.load(path)
    overviews = Overviews(ds, folder_for(path))
    todo = [entry for entry in overviews.entries() if not overviews.stored(entry)]
    if todo:
        progress(f"computing {len(todo)} overviews of the long demo ...")
        overviews.build(todo, workers=workers)
    return path

"""What each head does, in words: one role per head from the survey's statistics.

:func:`head_roles` reads a survey (``(sample, layer, head)``, :func:`attnpanel.survey`) or
runs one batch of a model through the same statistics, and gives per ``(layer, head)``:

==================  =====================================================================
``previous_token``  TransformerLens' previous-token score (``"mul"``), mean over samples
``duplicate_token`` its duplicate-token score (NaN without token ids)
``induction``       its induction score (NaN without token ids)
``sink_rate``       share of samples whose mean weight on the first real key exceeds
                    ``sink_threshold`` (0.3: Gu et al. 2025)
``offset``          the offset ``i - j`` most samples put most weight on (the mode of each
                    sample's best diagonal); ``offset_share`` the share of samples that do,
                    ``offset_weight`` their mean weight on it; ``offset_time`` in the
                    input's clock with ``step=``
``distance``        mean attention distance (steps) of the weight on steps (a named token's
                    weight adds none: ``distance / (1 - token_share)``); ``local`` where at
                    most ``local_distance``
``token_share``     mean weight on named tokens (a survey with a ``layout`` naming some)
``effective_keys``  the mean over samples of ``exp`` of a sample's mean row entropy: the
                    keys a typical row spreads over (a uniform causal row over ``i + 1``
                    keys: their geometric mean);
                    ``broad`` where at least ``broad_keys``
``role``            the first of: "looks at the statistics token" (``token_share`` at or
                    above one half), induction, duplicate token, previous token (a score at
                    or above ``score_threshold``: over the weight on steps), sink
                    (``sink_rate`` at or above one half), "looks d steps back"
                    (``offset_weight`` at or above ``offset_threshold``; "attends to
                    itself" for d = 0), local, broad, mixed
==================  =====================================================================

Padding and causal masks are respected by the statistics themselves (padded queries are
left out, blocked cells carry no weight).
"""

from __future__ import annotations

import numpy as np
import torch
import xarray as xr
from torch import nn

from attnpanel.kernels.roles import RoleInputs
from attnpanel.surveys.survey import Surveyor, token_ids

SCORE_THRESHOLD = 0.4
SINK_THRESHOLD = 0.3
OFFSET_THRESHOLD = 0.4
LOCAL_DISTANCE = 2.0
BROAD_KEYS = 16.0


def head_roles(
    model_or_survey,
    *inputs,
    tokens=None,
    step: float | None = None,
    layout=None,
    exclude_bos: bool = False,
    exclude_current_token: bool = False,
    score_threshold: float = SCORE_THRESHOLD,
    sink_threshold: float = SINK_THRESHOLD,
    offset_threshold: float = OFFSET_THRESHOLD,
    local_distance: float = LOCAL_DISTANCE,
    broad_keys: float = BROAD_KEYS,
    **kwargs,
) -> xr.Dataset:
    """One role per head, with the scores it is read from.

    Parameters
    ----------
    model_or_survey : torch.nn.Module or xarray.Dataset
        A model (run once on ``inputs``) or a survey (:func:`attnpanel.survey`).
    *inputs, **kwargs
        The model's inputs (one batch).
    tokens : torch.Tensor or list of list of str, optional
        Token ids ``(B, L)`` or labels where the inputs carry none (a model fed
        embeddings); by default the ``input_ids``, or an integer first input.
    step : float, optional
        Seconds between two positions: ``offset_time`` and roles such as "looks 24 h back".
    layout : attnpanel.Layout, optional
        A model's run only: named tokens before or after the steps (a survey keeps the
        layout it was made with).
    exclude_bos, exclude_current_token : bool
        TransformerLens' exclusions for the token scores (a model's run only; a survey
        keeps the settings it was made with).
    score_threshold, sink_threshold, offset_threshold, local_distance, broad_keys : float
        The thresholds of the table above.

    Returns
    -------
    xarray.Dataset
        ``(layer, head)``: the scores, ``role`` (str) and, in ``attrs``, the thresholds
        and why a score is NaN.
    """
    if isinstance(model_or_survey, xr.Dataset):
        found = model_or_survey
    elif isinstance(model_or_survey, nn.Module):
        found = _one_batch(
            model_or_survey, inputs, kwargs, tokens, (exclude_bos, exclude_current_token), layout
        )
    else:
        raise TypeError(
            f"head_roles reads a model or a survey Dataset, got {type(model_or_survey).__name__}"
        )
    missing = [
        n for n in ("previous_token", "offset", "sink", "distance", "entropy") if n not in found
    ]
    if missing:
        raise ValueError(
            f"this survey lacks {missing}: survey again with roles=True (attnpanel 0.1 "
            "stores of version 2)"
        )
    table = _scores(found, sink_threshold, step)
    table["role"] = _label(
        table, score_threshold, offset_threshold, local_distance, broad_keys, step
    )
    table.attrs.update(
        score_threshold=score_threshold,
        sink_threshold=sink_threshold,
        offset_threshold=offset_threshold,
        local_distance=local_distance,
        broad_keys=broad_keys,
        samples=int(found.sizes["sample"]),
    )
    if "token_roles" in found.attrs:
        table.attrs["token_roles"] = found.attrs["token_roles"]
    return table


def _one_batch(model, inputs, kwargs, tokens, exclusions, layout) -> xr.Dataset:
    with torch.no_grad():
        surveyor = Surveyor.of(model, inputs, kwargs)
        surveyor.roles = RoleInputs(None, *exclusions)
        surveyor.layout = layout
        surveyor.given_tokens = _ids(tokens)
        stats = surveyor.statistics(inputs, kwargs)
    data = {name: (("sample", "layer", "head"), values) for name, values in stats.items()}
    found = xr.Dataset(data, coords={"layer": np.array(surveyor.layers, dtype=object)})
    if layout is not None and (layout.before or layout.after):
        found.attrs["named_tokens"] = list(layout.before + layout.after)
    if surveyor.given_tokens is None and token_ids(inputs, kwargs) is None:
        found.attrs["token_roles"] = (
            "duplicate_token and induction are NaN: the inputs carry no token ids "
            "(continuous inputs); give tokens= to score them"
        )
    return found


def _ids(tokens) -> torch.Tensor | None:
    """Token ids ``(B, L)`` of ids or of labels (equal labels, equal ids)."""
    if tokens is None or isinstance(tokens, torch.Tensor):
        return tokens
    rows = [list(row) for row in tokens]
    codes: dict = {}
    return torch.tensor([[codes.setdefault(t, len(codes)) for t in row] for row in rows])


def _scores(found: xr.Dataset, sink_threshold: float, step) -> xr.Dataset:
    table = xr.Dataset(coords={"layer": found["layer"].values, "head": found["head"].values})
    for name in ("previous_token", "duplicate_token", "induction", "distance"):
        table[name] = found[name].mean("sample")
    table["sink_rate"] = (
        (found["sink"] > sink_threshold).where(found["sink"].notnull()).mean("sample")
    )
    table["effective_keys"] = np.exp(found["entropy"]).mean("sample")
    if "named_tokens" in found.attrs:
        table.attrs["named_tokens"] = list(found.attrs["named_tokens"])
    if "token_share" in found:
        table["token_share"] = found["token_share"].mean("sample")
    offsets = found["offset"].values  # (sample, layer, head)
    mode = np.full(offsets.shape[1:], np.nan)
    share = np.full(offsets.shape[1:], np.nan)
    weight = np.full(offsets.shape[1:], np.nan)
    for index in np.ndindex(*offsets.shape[1:]):
        column = offsets[(slice(None), *index)]
        column = column[np.isfinite(column)]
        if not column.size:
            continue
        values, counts = np.unique(column, return_counts=True)
        best = values[counts.argmax()]
        mode[index], share[index] = best, counts.max() / column.size
        at = found["offset"].values[(slice(None), *index)] == best
        weight[index] = float(np.nanmean(found["offset_weight"].values[(slice(None), *index)][at]))
    dims = ("layer", "head")
    table["offset"] = (dims, mode)
    table["offset_share"] = (dims, share)
    table["offset_weight"] = (dims, weight)
    if step is not None:
        table["offset_time"] = (dims, mode * float(step))
    return table


def _label(table, score_threshold, offset_threshold, local_distance, broad_keys, step):
    scores = {
        "induction": table["induction"].values,
        "duplicate token": table["duplicate_token"].values,
        "previous token": table["previous_token"].values,
    }
    labels = np.full(table["offset"].shape, "mixed", dtype=object)
    tokens = _named(table)
    on_tokens = table["token_share"].values if "token_share" in table else np.zeros(labels.shape)
    for index in np.ndindex(*labels.shape):
        labels[index] = tokens(float(on_tokens[index])) or _one_label(
            {k: v[index] for k, v in scores.items()},
            float(table["sink_rate"].values[index]),
            float(table["offset"].values[index]),
            float(table["offset_weight"].values[index]),
            float(table["distance"].values[index]) / max(1e-12, 1 - float(on_tokens[index])),
            float(table["effective_keys"].values[index]),
            (score_threshold, offset_threshold, local_distance, broad_keys),
            step,
        )
    return (("layer", "head"), labels.astype(str))


def _named(table: xr.Dataset):
    """The label of a head that puts most of its weight on named tokens ("looks at the
    statistics token"), as a function of its ``token_share`` ("" below one half)."""
    names = list(table.attrs.get("named_tokens", []))
    what = f"the {' and '.join(names)} token{'s' if len(names) > 1 else ''}"

    def label(share: float) -> str:
        return f"looks at {what}" if names and np.isfinite(share) and share >= 0.5 else ""

    return label


def _one_label(scores, sink_rate, offset, weight, distance, keys, thresholds, step) -> str:
    score_threshold, offset_threshold, local_distance, broad_keys = thresholds
    for name, value in scores.items():
        if np.isfinite(value) and value >= score_threshold:
            return name
    if np.isfinite(sink_rate) and sink_rate >= 0.5:
        return "sink"
    if np.isfinite(weight) and weight >= offset_threshold:
        if offset == 0:
            return "attends to itself"
        return f"looks {_span(abs(offset), step)} {'back' if offset > 0 else 'ahead'}"
    if np.isfinite(distance) and distance <= local_distance:
        return "local"
    if np.isfinite(keys) and keys >= broad_keys:
        return "broad"
    return "mixed"


def _span(steps: float, step) -> str:
    """``steps`` positions in words: "2 steps", or in the input's clock ("24 h")."""
    if step is None:
        return f"{int(steps)} step{'s' if steps != 1 else ''}"
    seconds = steps * float(step)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)} {unit}"
    return f"{seconds:g} s"

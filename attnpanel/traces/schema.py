"""The trace's contract: the dims of every variable, the mask truth, the stages.

One ``xarray.Dataset`` per attention layer (see ``docs/trace.md``). Attention-shaped
arrays have dims ``(batch, head, query, key)``; per-timestep vectors ``(batch,
position, feature)``; per-head vectors ``(batch, head, position, head_dim)``; a
multi-layer trace puts ``layer`` in front.
"""

from __future__ import annotations

ATTENTION_DIMS = ("batch", "head", "query", "key")
EXPECTED_DIMS = {  # in pipeline order
    "x": ("batch", "position", "feature"),
    "q": ("batch", "head", "position", "head_dim"),
    "k": ("batch", "head", "position", "head_dim"),
    "v": ("batch", "head", "position", "head_dim"),
    "scores": ATTENTION_DIMS,
    "weights": ATTENTION_DIMS,
    "lse": ("batch", "head", "query"),  # a virtual trace's rows (attnpanel.traces.virtual)
    "context": ("batch", "head", "query", "head_dim"),
    "output": ("batch", "position", "feature"),
    "w_q": ("feature_out", "feature_in"),
    "w_k": ("feature_out", "feature_in"),
    "w_v": ("feature_out", "feature_in"),
    "w_o": ("feature_out", "feature_in"),
    "mask": ("query", "key"),
    "padding": ("batch", "position"),
    # reference series over the input (REFERENCE_SERIES): optional, drawn on the top view
    "signal": ("batch", "position"),
    "truth": ("batch", "series", "position"),
    "prediction": ("batch", "series", "position"),
}
# What a model's input and output mean beyond its tensors: the input ``signal`` drawn at the
# top of the page (a power curve, a price series), and named channels over the same
# positions (``series``: what a model disaggregates or forecasts, labels), their ``truth``
# and the model's ``prediction``. Each may carry ``long_name`` and ``units`` attributes.
REFERENCE_SERIES = ("signal", "truth", "prediction")
# Cross-attention traces index k and v by the key side's own positions.
CROSS_DIMS = {
    "k": ("batch", "head", "key", "head_dim"),
    "v": ("batch", "head", "key", "head_dim"),
}
# q and k as wide as each other but not as v (a linear attention's features, Performer's
# random ones): their own dim, which no other variable shares.
QK_DIM = "qk_dim"
# The mask truth of a captured model: any ordered subset of the attention dims that holds
# ``key`` (padding varies by (batch, key), T5's bias by (head, query, key), ...).
MASK_TRUTH = ("sample_mask", "bias")
STAGES = ("raw", "scaled", "masked", "softmax", "value_weighted")
FIGURE_VIEWS = ("matrix", "heads", "model", "importance")  # attnpanel.render.paper's views
HEAD_SCALES = ("own", "shared")  # the heads figure's colour scales: each head's, or one for all
ROW_SUM_TOLERANCE = 1e-3

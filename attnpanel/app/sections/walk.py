"""A guided walk of one query through the layer, for teaching.

Seven steps, driven by the state's ``step`` parameter (so a link or a notebook opens the
walk at a step): the query's row of raw scores, the scaling by 1/sqrt(head_dim), the mask,
the softmax, the weighted sum of the values, the head's lane in the merge and the output
projection. Each step sets the stage it explains and says, with this trace's own numbers,
what happens and why.
"""

from __future__ import annotations

import numpy as np
import panel as pn

from attnpanel.app.sections.base import Section
from attnpanel.readouts import core
from attnpanel.util import untrusted

STEP_TITLES = (
    "1 · the query's row",
    "2 · scale by 1/√E",
    "3 · mask",
    "4 · softmax",
    "5 · weights × V",
    "6 · its lane in the merge",
    "7 · output projection Wo",
)
STEP_STAGES = ("raw", "scaled", "masked", "softmax", "softmax", "softmax", "softmax")
STEP_SHOWS = {1: "show_projection", 6: "show_merge", 7: "show_merge"}  # sections a step opens
MASK_MEANING = {
    "diagonal": (
        "The diagonal mask (NILMFormer's) forbids each position to attend to itself, so "
        "it must describe itself from its neighbours"
    ),
    "causal": "The causal mask forbids every key after the query: no looking at the future",
    "none": "No mask: every key is allowed",
}


def step_text(ds, sel: core.Selection, step: int, cache=None) -> str:
    """What step ``step`` (1-7) of the walk says, with the trace's own numbers (Markdown)."""
    query = sel.query
    head = 0 if sel.head == "mean" else int(sel.head)
    who = f"query {query}, head {head}"
    if step in (1, 2, 3):
        stage = STEP_STAGES[step - 1]
        row = core.stage_heads(ds, sel.with_(stage=stage), cache)[head, query]
        top = int(np.nanargmax(np.where(row > -1e3, row, np.nan)))
    if step == 1:
        dim = ds.attrs.get("head_dim", ds.sizes.get("head_dim", "E"))
        return (
            f"**{STEP_TITLES[0]}.** Row {query} of the matrix holds the dot products of {who}'s "
            f"vector q[{query}] (q = x·Wqᵀ, split into heads: Q/K/V projection, left) with every "
            f"key's k: q·k, a sum over E = {dim} features. The "
            f"highest is at key {top} ({row[top]:.3g}): the key whose k points most where "
            "q points."
        )
    if step == 2:
        scale = ds.attrs.get("scale")
        scale_text = f"{float(scale):.4g}" if scale is not None else "1/√E"
        return (
            f"**{STEP_TITLES[1]}.** Every score is multiplied by {scale_text} = 1/√E. A dot "
            "product of E random features grows like √E; unscaled, a few scores would dwarf "
            "the rest and the softmax would put all the weight on one key, with vanishing "
            f"gradients. Row {query} now peaks at {row[top]:.3g}."
        )
    if step == 3:
        mask = core.mask_mode(ds, sel)
        blocked = core.drawn_masked(ds, mask, sel.sample, head)
        n_blocked = 0 if blocked is None else int(np.asarray(blocked)[query].sum())
        return (
            # a mask name from a trace file is untrusted text
            f"**{STEP_TITLES[2]}.** {MASK_MEANING.get(mask, f'The {untrusted.markup(mask)} mask')} "
            f"({n_blocked} of the row's {row.size} keys here, drawn black). Blocked scores "
            "become −1e4 rather than −∞: exp(−1e4) is exactly 0 in float32, and a row whose "
            "keys were all blocked still gives numbers instead of NaN."
        )
    weights = core.selected_weights(ds, sel.with_(head=head), cache)
    top = int(np.argmax(weights))
    if step == 4:
        return (
            f"**{STEP_TITLES[3]}.** Softmax turns row {query} into weights: exp(score) over "
            f"the row's sum, all ≥ 0 and summing to {weights.sum():.3f}. Key {top} takes "
            f"{weights[top]:.3f} of it; the bars of the *value aggregation* and the band behind "
            "the curve show the whole row."
        )
    if step == 5:
        return (
            f"**{STEP_TITLES[4]}.** The context of {who} is Σ w·v: every key's value vector "
            f"weighted by its weight (key {top}'s v counts {weights[top]:.3f}). The *value "
            "aggregation* shows the value vectors of the top keys and the context vector."
        )
    if step == 6:
        dim = int(ds.sizes.get("head_dim", 0)) or int(ds.attrs.get("head_dim", 0))
        lane = f"features {head * dim}-{head * dim + dim - 1}" if dim else "its own lane"
        return (
            f"**{STEP_TITLES[5]}.** The heads' contexts are laid side by side: head {head}'s "
            f"is {lane} of the merged vector (head merge, below). Switching a head off zeros "
            "its lane."
        )
    return (
        f"**{STEP_TITLES[6]}.** The merged vector times Woᵀ is the layer's output at query "
        f"{query}: every output feature mixes every head's lane, which is how the heads' "
        "findings are combined (output, below; its title says how much the switched-off "
        "heads change it)."
    )


class GuidedWalk(Section):
    """Previous / next through the seven steps, with the step's text."""

    title = "Guided walk: one query through the layer"

    def __init__(self, **params):
        super().__init__(**params)
        self.text = pn.pane.Markdown("", sizing_mode="stretch_width", margin=(0, 10))
        self.steering: list[pn.widgets.Button] = []  # previous, next, close: while walking
        self.opened: set[str] = set()  # the sections the walk opened, closed with it
        self.state.param.watch(self._on_step, "step")
        self.engine.follow(self._refresh, ["sample", "head", "query", "mask", "layer"])

    def build(self):
        start = pn.widgets.Button(label="Walk through one query", width=200)
        back = pn.widgets.Button(label="◀ previous", width=110)
        forward = pn.widgets.Button(label="next ▶", width=110)
        close = pn.widgets.Button(label="close", width=80)
        start.on_click(lambda _: self.state.param.update(step=1))
        back.on_click(lambda _: self.state.param.update(step=max(1, self.state.step - 1)))
        forward.on_click(lambda _: self.state.param.update(step=min(7, self.state.step + 1)))
        close.on_click(lambda _: self.state.param.update(step=0))
        self.steering = [back, forward, close]
        self._refresh()
        return pn.Column(
            pn.Row(start, back, forward, close, margin=0),
            self.text,
            sizing_mode="stretch_width",
            margin=0,
        )

    def _on_step(self, event) -> None:
        if event.new:
            shown = STEP_SHOWS.get(event.new)
            if shown and not getattr(self.state, shown):
                self.opened.add(shown)
            # the step's stage, and the section it talks about opened
            self.state.param.update(
                stage=STEP_STAGES[event.new - 1], **({shown: True} if shown else {})
            )
        else:  # closed: the sections it opened close with it
            self.state.param.update(**dict.fromkeys(self.opened, False))
            self.opened.clear()
        self._refresh()

    def _refresh(self, *_events) -> None:
        step = self.state.step
        for button in self.steering:
            button.visible = bool(step)
        if not step:
            self.text.object = ""
            return
        try:
            text = step_text(self.trace, self.state.selection, step, self.cache)
        except Exception as err:  # noqa: BLE001 - shown to the user; the session goes on
            self.engine.report(err, "the guided walk")
            return
        self.text.object = text

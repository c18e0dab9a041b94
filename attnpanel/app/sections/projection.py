"""Q/K/V projection and the split into heads: x at the query, Wq/Wk/Wv, and q, k, v."""

from __future__ import annotations

import numpy as np
import panel as pn

from attnpanel.app.sections.base import Section
from attnpanel.readouts.core import MissingVariable, require
from attnpanel.readouts.raster import scale_title
from attnpanel.render import views
from attnpanel.render.elements import Raster

WIDTH = 280
WEIGHT_NAMES = {"w_q": "Wq", "w_k": "Wk", "w_v": "Wv", "w_o": "Wo"}


def weight_raster(ds, name: str) -> Raster:
    """A projection matrix (out x in) as a map: output row 0 at the bottom."""
    require(ds, name, f"{name} heatmap")
    values = np.asarray(ds[name].values, dtype=np.float32)
    n_out, n_in = values.shape
    label = f"{WEIGHT_NAMES.get(name, name)} ({n_out}×{n_in})"
    return Raster(values, (-0.5, -0.5, n_in - 0.5, n_out - 0.5), "Weight", label)


def weight_map(section: Section, name: str, width: int, height: int, edge_ticks=False, **style):
    """A weight matrix drawn by the engine (it follows the layer), or an alert.

    ``edge_ticks`` labels only the first and last feature of each axis (a small map).
    """
    try:
        raster = section.engine.add(
            f"{name} heatmap", lambda sel: weight_raster(section.trace, name), ["layer"], name
        )
    except MissingVariable as err:
        return section.missing(err, width, height)
    if edge_ticks:
        n_out, n_in = raster.values.shape
        style.update(
            xticks=[(0, "0"), (n_in - 1, n_in - 1)], yticks=[(0, "0"), (n_out - 1, n_out - 1)]
        )
    image = raster.element("weight", kdims=("in", "out"))
    style = dict(width=width, height=height, **style)
    return section.engine.render(image, name, style=style, width=width, height=height, margin=1)


class Projection(Section):
    """The input vector at the query, the projection matrices and the q, k, v vectors."""

    title = "Q/K/V projection"
    shown_by = "show_projection"

    def build(self):
        items = [self.heading()]
        items.append(
            self.bars(
                "input vector",
                lambda sel: views.input_vector(self.trace, sel),
                ["sample", "query"],
                WIDTH,
                125,
            )
        )
        maps = [
            weight_map(
                self,
                name,
                90,
                128,
                colorbar="below",
                edge_ticks=True,
                xlabel="",
                ylabel="",
                title=WEIGHT_NAMES[name],  # out × in: the shape is in the hover and the text
                title_size="9pt",
            )
            for name in ("w_q", "w_k", "w_v")
        ]
        items.append(pn.Row(*maps, margin=0))
        items.append(
            pn.pane.Markdown(
                f"rows: out, columns: in; colours {scale_title('', -1.0)} (centred on 0)",
                styles={"font-size": "10px", "color": "#555"},
                margin=(0, 5),
                width=WIDTH,
            )
        )
        for name in ("q", "k", "v"):
            items.append(
                self.bars(
                    f"{name.upper()} vector",
                    lambda sel, name=name: views.projection_vector(self.trace, sel, name),
                    ["sample", "query"],
                    WIDTH,
                    112,
                )
            )
        return pn.Column(*items, width=WIDTH + 15)

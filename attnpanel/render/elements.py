"""What the live path draws: a map's payload (:class:`Raster`) and the key of a drawn layer
(:class:`PlotKey`), shared by the figures that draw them and the engine that updates them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import holoviews as hv
import holoviews.plotting.bokeh  # noqa: F401 - registers the Bokeh backend and its options
import numpy as np

# Groups whose curves are told apart by their label (one curve per series, each its own
# models); a label of another group changes with the selection and is not part of its key.
LABELLED_GROUPS = ("Sequence", "Prediction")
# Groups of maps that are signed by nature (a difference b - a): their colour scale is
# centred on 0 whatever the values shown (``image_limits(..., centred=True)``).
CENTRED_GROUPS = ("Difference", "Patching")


class PlotKey(NamedTuple):
    """Which layer of a pane a Bokeh model set draws: element type, group, label."""

    kind: str  # the HoloViews element type: "Image", "Rectangles", "Curve", "Overlay" ...
    group: str  # the element's group: "Attention", "HeadMap", "Vector", "Sequence" ...
    label: str = ""  # only for the curves of LABELLED_GROUPS (one per series); else ""

    @classmethod
    def of(cls, element) -> PlotKey:
        """The key of an element drawn into a pane (labels change with the selection)."""
        if isinstance(element, Raster):
            return cls("Image", element.group)
        if isinstance(element, hv.Overlay):
            return cls("Overlay", "")
        label = element.label if element.group in LABELLED_GROUPS else ""
        return cls(type(element).__name__, element.group, label)


@dataclass
class Raster:
    """A map on the live path: the array the Bokeh image glyph draws.

    Building an ``hv.Image`` costs ~20 ms of parameter validation; the nine images a mask
    change redraws skip it (only the first render and ``dynamic_map`` make one).
    """

    values: np.ndarray  # float32, rows by ascending y
    bounds: tuple  # (left, bottom, right, top)
    group: str
    label: str
    value_label: str = ""  # the colour bar's title

    def element(self, vdim="value", kdims=("key", "query")) -> hv.Image:
        """The ``hv.Image`` of the first render (its colours follow ``image_limits``)."""
        return hv.Image(
            self.values[::-1],
            bounds=self.bounds,
            kdims=list(kdims),
            vdims=[vdim],
            group=self.group,
            label=self.label,
        )


MAP_KEY = PlotKey("Image", "Attention")  # the large matrix (the dense and the long page)
HEAD_MAP_KEY = PlotKey("Image", "HeadMap")  # a head's tile

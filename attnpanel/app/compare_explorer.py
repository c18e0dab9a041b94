"""The comparison page: two captures of the same inputs, A, B and B - A side by side.

``explore(a, compare=b)`` opens it: two checkpoints of one model, the model in float32 and
in bfloat16, before and after fine-tuning, run on the same inputs. It is a
:class:`~attnpanel.app.base.LayerExplorer` over capture A (the state: sample, layer, head),
with capture B and every head's divergence (:func:`attnpanel.readouts.compare.compare`)
held beside it (:class:`~attnpanel.app.sections.comparison.ComparedPair`), and composed of
the sections of :mod:`attnpanel.app.sections.comparison`: the selectors, the three maps of
the open head (linked zoom, each re-rasterized at full resolution, B - A centred on 0) and
the heads ranked by divergence (a click opens one). It opens on the most different head.
"""

from __future__ import annotations

from pathlib import Path

import xarray as xr

from attnpanel.app.base import LayerExplorer
from attnpanel.app.sections.comparison import (
    CompareControls,
    ComparedMaps,
    ComparedPair,
    HeadRanking,
)
from attnpanel.readouts import compare as pairwise
from attnpanel.traces import io, virtual
from attnpanel.util import untrusted


def compared_capture(capture, which: str) -> xr.Dataset:
    """A dense capture to compare (a path is loaded); refuse what the page cannot show."""
    if isinstance(capture, str | Path):
        capture = io.load(Path(capture))
    if isinstance(capture, xr.DataTree):
        raise ValueError(
            f"{which} is a DataTree: the comparison page shows one group of two captures; "
            f"compare a group, explore(a[group].to_dataset(), compare=b[group].to_dataset())"
        )
    if not isinstance(capture, xr.Dataset):
        raise TypeError(
            f"{which} is {type(capture).__name__}: compare two traces (xarray Datasets, as "
            "capture() and load() return) or the paths of saved ones"
        )
    if virtual.is_virtual(capture):
        raise ValueError(
            f"{which} is a virtual trace: the comparison page draws dense maps; compare its "
            "heads with attnpanel.compare(a, b)"
        )
    return capture


class CompareExplorer(LayerExplorer):
    """Explore how two captures of the same inputs differ, head by head.

    Parameters
    ----------
    trace : xarray.Dataset
        Capture A (one layer, or a capture with a ``layer`` dim).
    compare : xarray.Dataset
        Capture B, of the same inputs by a model of the same shape
        (:func:`attnpanel.readouts.compare.check_comparable`).
    labels : (str, str), optional
        What the page calls A and B; by default each capture's source and dtype.
    comparison : xarray.Dataset, optional
        ``attnpanel.compare(trace, compare)`` when already computed (a server computes it
        once for every session); only its ``js``, ``max_abs`` and ``rows`` are read.
    **params
        Initial ``sample``, ``layer`` and ``head``; by default the most different head.
    """

    URL_PARAMS = {name: name for name in ("sample", "layer", "head")}

    def __init__(
        self,
        trace: xr.Dataset,
        compare: xr.Dataset,
        labels: tuple[str, str] | None = None,
        comparison: xr.Dataset | None = None,
        **params,
    ):
        trace, compare = compared_capture(trace, "a"), compared_capture(compare, "b")
        if params.get("head") == "mean":
            raise ValueError("the comparison page shows one head at a time: give a head number")
        pairwise.check_comparable(trace, compare)
        if comparison is None:
            comparison = pairwise.compare(trace, compare, labels)
        ranking = pairwise.ranked_heads(comparison)
        shown = labels or (comparison.attrs.get("a", "a"), comparison.attrs.get("b", "b"))
        self.pair = ComparedPair(other=compare, ranking=ranking, labels=tuple(shown))
        if "head" not in params and "layer" not in params:
            top = ranking.iloc[0]
            params["head"] = int(top["head"])
            if "layer" in trace.dims:
                params["layer"] = int(top["layer"])
        super().__init__(trace, **params)

    @property
    def ranking(self):
        """Every head, most different first (a ``pandas.DataFrame``: layer, layer_name,
        head, js, max_abs, rows)."""
        return self.pair.ranking

    @property
    def other(self) -> xr.Dataset:
        """Capture B."""
        return self.pair.other

    @property
    def title(self) -> str:
        a, b = (untrusted.shortened(str(label).splitlines()[0], 60) for label in self.pair.labels)
        return f"{a} vs {b}"

    def make_sections(self, parts: dict) -> dict:
        self.param.head.objects = list(range(self.n_heads))
        return {
            "controls": CompareControls(**parts),
            "maps": ComparedMaps(pair=self.pair, **parts),
            "ranking": HeadRanking(pair=self.pair, **parts),
        }

    def page(self) -> list:
        s = self.sections
        return [s["controls"], s["maps"], s["ranking"]]

    def save(
        self,
        path,
        sample: int | None = None,
        heads: int | None = None,
        overwrite: bool = False,
    ):
        """Write the comparison as a standalone HTML file that works offline: the heads
        ranked by divergence and A, B and B - A of the most different ones.

        Parameters
        ----------
        path : str or Path
            The HTML file to write.
        sample : int, optional
            The sample whose maps are drawn; defaults to the one shown.
        heads : int, optional
            How many of the most different heads get their maps (default
            ``attnpanel.render.compare_report.REPORT_HEADS``).
        overwrite : bool
            Replace an existing HTML page at ``path`` (nothing else is ever replaced).

        Returns
        -------
        Path
        """
        from attnpanel.render.compare_report import REPORT_HEADS, compare_html

        return compare_html(
            self.layers if self.layers is not None else self.trace,
            self.other,
            self.ranking,
            path,
            sample=self.sample if sample is None else sample,
            heads=REPORT_HEADS if heads is None else heads,
            labels=self.pair.labels,
            overwrite=overwrite,
        )

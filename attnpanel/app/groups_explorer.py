"""The explorer of a capture with several groups (encoder, decoder, cross-attention).

A :class:`GroupsExplorer` holds one :class:`~attnpanel.app.explorer.AttentionExplorer` per
group of an ``xarray.DataTree`` capture, built when the group is first shown, and one
layer picker that spans every group: picking a decoder layer shows the decoder group's
explorer at that layer. The group explorer's own layer menu is hidden (the picker is the
page's one); its ``layer``, set from code, moves the picker too.

The page's link holds the layer across every group, by name (``?layer=decoder.layers.1...``),
and the shown group's selection (sample, head, query ...); a group shown next takes the
selection of the one shown before where it has it (a head number it has, a query within
its length), but not its mask: each group keeps its own.
"""

from __future__ import annotations

import contextlib

import panel as pn
import param
import xarray as xr

from attnpanel.app.base import Explorer
from attnpanel.app.explorer import AttentionExplorer
from attnpanel.traces import layers
from attnpanel.util import untrusted


class GroupLayerExplorer(AttentionExplorer):
    """One group's explorer on a page of several groups: its link leaves the layer to the
    page (:class:`GroupsExplorer`'s, by name across every group)."""

    URL_PARAMS = {k: v for k, v in AttentionExplorer.URL_PARAMS.items() if k != "layer"}

    def heading(self) -> pn.pane.Markdown:
        """Under the page's heading and its picker of every group's layers: the group."""
        group = untrusted.markup(str(self.trace.attrs.get("group", "")))
        count = 1 if self.layers is None else self.layers.sizes["layer"]  # the group's all
        layers = "1 layer" if count == 1 else f"{count} layers"
        return pn.pane.Markdown(f"### group {group} ({layers})", margin=(0, 10))

    def laid_out(self) -> None:
        super().laid_out()
        own = self.widgets.get("layer")
        if own is not None:  # the page's picker above picks the layer, from every group
            own.visible = False


class GroupsExplorer(Explorer):
    """Explore every group of a DataTree capture, one layer at a time.

    Parameters
    ----------
    capture : xarray.DataTree
        What :func:`attnpanel.capture` returns for a model with several kinds of attention.
    layer : int or str, optional
        The first layer shown, by position among all layers or by module name.
    **params
        Initial parameters of each group's explorer (``sample``, ``head`` ...).
    """

    layer = param.Selector(default=None, objects=[], doc="Layer shown, from any group, by name.")
    last_error = param.String(default="", doc="The last error reported (a link refused).")

    URL_PARAMS = {"layer": "layer"}

    def __init__(self, capture: xr.DataTree, layer: int | str | None = None, **params):
        self.capture = capture
        self._entries = {entry.name: entry for entry in layers.layers(capture)}
        first = layers.find(capture, layer).name
        super().__init__()
        self.param.layer.objects = list(self._entries)
        self._explorer_params = params
        self._explorers: dict[str, AttentionExplorer] = {}
        self._following = False
        self._url_synced = False
        with param.parameterized.discard_events(self):
            self.layer = first
        picker = pn.widgets.Select.from_param(
            self.param.layer, name="Layer (every group)", sizing_mode="stretch_width"
        )
        self._body = pn.Column(self.explorer, sizing_mode="stretch_width")
        # the page's heading above the picker (a group's explorer heads its part with the
        # group's name)
        self._layout = pn.Column(
            AttentionExplorer.heading(self.explorer),
            picker,
            self._body,
            sizing_mode="stretch_width",
        )
        self.param.watch(self._show, "layer")

    @property
    def group(self) -> str:
        """The group that holds the layer shown."""
        return self._entries[self.layer].group

    @property
    def explorer(self) -> AttentionExplorer:
        """The explorer of the shown layer's group, at that layer."""
        entry = self._entries[self.layer]
        found = self._explorers.get(entry.group)
        if found is None:
            # The group's name rides along (a shallow copy) so that titles tell apart
            # layers whose numbers repeat across groups.
            ds = layers.groups(self.capture)[entry.group].assign_attrs(group=entry.group)
            found = GroupLayerExplorer(ds, layer=entry.index, **self._explorer_params)
            found.param.watch(self._follow, "layer")
            self._explorers[entry.group] = found
        elif found.layer != entry.index:
            self._following = True
            try:
                found.layer = entry.index
            finally:
                self._following = False
        return found

    def _show(self, event) -> None:
        before = self._explorers.get(self._entries[event.old].group)
        shown = self.explorer
        if before is not None and before is not shown:
            carry(before, shown)
        self._body.objects = [shown]

    def _follow(self, event) -> None:
        if self._following:
            return
        group = next(g for g, e in self._explorers.items() if e is event.obj)
        self.layer = next(
            e.name for e in self._entries.values() if e.group == group and e.index == event.new
        )

    def __panel__(self):
        if not self._url_synced:  # the link's layer first: the group shown is its
            self._url_synced = True
            self.sync_url()
        return self._layout

    def save(
        self, path, sample: int | None = None, size: int | None = None, overwrite: bool = False
    ):
        """The offline HTML export of the layer shown (see ``AttentionExplorer.save``)."""
        return self.explorer.save(path, sample=sample, size=size, overwrite=overwrite)


# What a group shown next takes of the one shown before: not its mask, the group's own (a
# decoder's causal mask is not the encoder's none)
CARRIED = tuple(name for name in GroupLayerExplorer.URL_PARAMS if name != "mask")


def carry(before: AttentionExplorer, after: AttentionExplorer) -> None:
    """Give ``after`` (another group's explorer) the selection ``before`` shows, each value
    it can take: a head number the other group lacks, a query beyond its length, stay; so
    does its mask, its own."""
    for name in CARRIED:
        with contextlib.suppress(ValueError):  # not a value of this group: its own stays
            after.param.update({name: getattr(before, name)})

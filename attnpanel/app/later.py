"""The sections a served page puts in place after its first paint, while it is idle.

A page's first paint waits for every view on it: Bokeh builds, lays out and paints each
one before the page is idle. :class:`LaterSections` holds the sections below the fold (the
head maps, their importance, the tables) out of a served page's first document: each has
its place on the page (one line above them says they are coming) and takes it one idle
tick at a time after the first paint (:meth:`~attnpanel.app.scheduler.Scheduler.when_idle`:
never while a change the user made is being drawn, nor within a quarter second of one).
Their views are drawn when the explorer is built, as every view is, and follow the state
from then on: what arrives is the page as it stands. Outside a server (a notebook, a test),
and for a page put into a session that has already loaded (the loading page's), every
section is in its place at once: deferred there, a change to a section's data reached the
browser naming a model it had never been sent (one cold start in three).
"""

from __future__ import annotations

import panel as pn

PLACEHOLDER_CLASS = "attnpanel-later"  # the placeholder's CSS class (the tests wait on it)


class LaterSections:
    """The sections of one page that go in their place after its first paint."""

    def __init__(self):
        self._waiting: list[tuple[pn.Column, object]] = []
        # one line above their places while any waits (a closed section, which draws
        # nothing when it comes, gets no line of its own)
        self.notice = pn.pane.Markdown(
            "*The sections below are drawn once the page above is painted.*",
            css_classes=[PLACEHOLDER_CLASS],
            margin=(0, 10),
            visible=False,
        )

    def hold(self, section) -> pn.Column:
        """A place on the page for ``section``, empty until :meth:`fill_one` puts it
        there."""
        holder = pn.Column(sizing_mode="stretch_width", margin=0)
        self._waiting.append((holder, section))
        self.notice.visible = True
        return holder

    @property
    def waiting(self) -> int:
        """How many sections are not in their place yet."""
        return len(self._waiting)

    def fill_one(self) -> bool:
        """Put the next waiting section in its place; whether any still waits (an idle
        step of the page's scheduler)."""
        if self._waiting:
            holder, section = self._waiting.pop(0)
            holder.objects = [section]
        self.notice.visible = bool(self._waiting)
        return bool(self._waiting)

    def fill(self) -> None:
        """Put every waiting section in its place now."""
        while self.fill_one():
            pass

"""The sections of the explorer's page: one small ``Viewer`` each (see ``base.Section``).

A new view goes into the section it belongs to (or a new section here): register it with
``self.engine.add(name, build, parameters, pane)`` where the section lays it out, and
render it with ``self.engine.render``; ``AttentionExplorer`` only composes the sections.
"""

from attnpanel.sections.aggregation import ValueAggregation
from attnpanel.sections.base import Section
from attnpanel.sections.controls import Controls
from attnpanel.sections.heads import HeadComparison, LinkedZoom
from attnpanel.sections.matrix import AttentionMatrix
from attnpanel.sections.merge import MergeOutput
from attnpanel.sections.model import ModelView, Positional, TopAttended
from attnpanel.sections.projection import Projection
from attnpanel.sections.sequence import InputSequence
from attnpanel.sections.shapes import ShapeTable
from attnpanel.sections.walk import GuidedWalk

__all__ = [
    "AttentionMatrix",
    "Controls",
    "GuidedWalk",
    "HeadComparison",
    "InputSequence",
    "LinkedZoom",
    "MergeOutput",
    "ModelView",
    "Positional",
    "Projection",
    "Section",
    "ShapeTable",
    "TopAttended",
    "ValueAggregation",
]

"""The sections of the explorer's page: one small ``Viewer`` each (see ``base.Section``).

A new view goes into the section it belongs to (or a new section here): register it with
``self.engine.add(name, build, parameters, pane)`` where the section lays it out, and
render it with ``self.engine.render``; ``AttentionExplorer`` only composes the sections.
"""

from attnpanel.app.sections.aggregation import ValueAggregation
from attnpanel.app.sections.base import Section
from attnpanel.app.sections.composition import HeadComposition
from attnpanel.app.sections.controls import Controls
from attnpanel.app.sections.embedding import QueryKeyEmbedding
from attnpanel.app.sections.heads import HeadComparison, LinkedZoom
from attnpanel.app.sections.importance import HeadImportance
from attnpanel.app.sections.matrix import AttentionMatrix
from attnpanel.app.sections.merge import MergeOutput
from attnpanel.app.sections.model import ModelView, Positional, TopAttended
from attnpanel.app.sections.patching import PatchingView
from attnpanel.app.sections.projection import Projection
from attnpanel.app.sections.rollout import Rollout
from attnpanel.app.sections.sequence import InputSequence
from attnpanel.app.sections.shapes import ShapeTable
from attnpanel.app.sections.survey import SurveyView
from attnpanel.app.sections.walk import GuidedWalk
from attnpanel.app.sections.why import WhyThisCell

__all__ = [
    "AttentionMatrix",
    "Controls",
    "GuidedWalk",
    "HeadComparison",
    "HeadComposition",
    "HeadImportance",
    "InputSequence",
    "LinkedZoom",
    "MergeOutput",
    "ModelView",
    "PatchingView",
    "Positional",
    "Projection",
    "QueryKeyEmbedding",
    "Rollout",
    "Section",
    "ShapeTable",
    "SurveyView",
    "TopAttended",
    "ValueAggregation",
    "WhyThisCell",
]

"""A model in eval mode while attnpanel runs it, shared by overlapping users.

A served model is run by every session's threads at once (capture, ablation, patching,
the demo's predictions). :func:`evaluating` switches it to eval mode (no dropout) for the
block; the first user in switches it, and only the last one out switches back the modules
that were training (:class:`attnpanel.util.locks.SharedSetting`). A session leaving its
block used to switch the model back to training in the middle of another session's forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from attnpanel.util.locks import SharedSetting


def _to_eval(model: nn.Module) -> list[nn.Module]:
    training = [m for m in model.modules() if m.training]
    if training:  # (a wrapper's eval() may cost more than a small model's forward)
        model.eval()
    return training


def _back_to_training(training: list[nn.Module]) -> None:
    for module in training:  # exactly the modules that were training, as they were
        module.training = True


_EVAL = SharedSetting(_to_eval, _back_to_training)


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """The model in eval mode (no dropout) while the block runs, each module's mode
    restored after the last overlapping user (another session's thread) is done."""
    with _EVAL(model):
        yield

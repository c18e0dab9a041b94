"""A served page of an Energformer-like NILM model (tests/linear_models.py): linear
attention, which never forms its weights, captured as its implicit weights on three windows
of power with their clock, the model at hand. ``panel serve tests/linear_app.py``."""

from __future__ import annotations

import pandas as pd
import panel as pn
import torch
from linear_models import Energformer

import attnpanel

LENGTH, WINDOWS = 48, 3
STAMPS = pd.date_range("2025-06-02 06:00", periods=LENGTH, freq="1min")


def energformer() -> tuple[Energformer, torch.Tensor]:
    """The model, seeded, and its windows of power (W): a fridge's cycle on a base load."""
    torch.manual_seed(4)
    model = Energformer(32, 4).eval()
    steps = torch.arange(LENGTH, dtype=torch.float32)
    power = 80 + 120 * (torch.sin(steps[None] / 4 + torch.arange(WINDOWS)[:, None]) > 0)
    return model, power + 10 * torch.rand(WINDOWS, LENGTH)


if __name__.startswith("bokeh"):
    model, power = energformer()
    trace = attnpanel.capture(model, power, time=STAMPS)
    trace["signal"] = (("batch", "position"), power.numpy())
    trace["signal"].attrs.update(long_name="aggregate power", units="W")
    run = attnpanel.ModelRun(model, (power,), layers=list(trace["layer"].values))
    pn.extension(inline=True)
    attnpanel.explore(trace, model=run).servable()

"""Your model on your recordings: from a house's files to the whole page.

One command does it (``build`` below is the model's factory; a real one loads your trained
weights with ``--checkpoint``)::

    python examples/own_recording.py --write-house /tmp/house      # a house to try it on
    attnpanel serve --model examples/own_recording.py:build --recording /tmp/house \\
        --target kettle --scale 6000 --clip 6000 --threshold kettle=2000

and in Python it is the few lines of :func:`page` beyond the model's definition::

    python examples/own_recording.py /tmp/house [--checkpoint kettle.pt] [--serve]

The model here has NILMFormer's interface (Petralia et al., KDD 2025): input ``(B, 1 + 8,
L)``, the mains divided by a scale then sine and cosine of minute, hour, weekday and month;
a statistics token (the window's mean and std) appended last, so attention is over ``L +
1`` positions with NILMFormer's diagonal mask; one target out, in the same scale. The page
names the token ("statistics") on its axes, hovers and tables, and never gives it a time.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch import nn

import attnpanel
from attnpanel import series


class StatisticsTokenModel(nn.Module):
    """A small NILMFormer-shaped model: convolutions embed the mains and the clock, the
    window's mean and std become one token appended last, encoder layers attend over the
    ``L + 1`` positions (no position attends to itself), and the token is dropped before
    the output head."""

    def __init__(self, d_model: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        self.power = nn.Conv1d(1, 3 * d_model // 4, kernel_size=3, padding=1)
        self.clock = nn.Conv1d(8, d_model // 4, kernel_size=1)
        self.statistics = nn.Linear(2, d_model)
        self.encoder = nn.ModuleList(
            nn.TransformerEncoderLayer(
                d_model, heads, 2 * d_model, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(layers)
        )
        self.head = nn.Conv1d(d_model, 1, kernel_size=3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        power = x[:, :1]
        mean, std = power.mean(-1, keepdim=True), power.std(-1, keepdim=True) + 1e-6
        steps = torch.cat([self.power((power - mean) / std), self.clock(x[:, 1:])], dim=1)
        token = self.statistics(torch.cat([mean, std], dim=-1))  # (B, 1, D)
        h = torch.cat([steps.transpose(1, 2), token], dim=1)  # (B, L + 1, D)
        itself = torch.eye(h.shape[1], dtype=torch.bool, device=h.device)  # the diagonal mask
        for layer in self.encoder:
            h = layer(h, src_mask=itself)
        return self.head(h[:, :-1].transpose(1, 2)) * std + mean  # (B, 1, L)


def build() -> nn.Module:
    """The factory ``--model examples/own_recording.py:build`` names."""
    torch.manual_seed(0)
    return StatisticsTokenModel().eval()


def write_house(folder: Path, hours: int = 48, step_s: int = 6) -> Path:
    """A house in UK-DALE's layout (``house_1/labels.dat``, ``channel_N.dat`` of ``unix_ts
    watts`` lines): mains = base load + a kettle + a fridge, every ``step_s`` seconds."""
    rng = np.random.default_rng(0)
    n = hours * 3600 // step_s
    unix = 1_401_692_400 + np.arange(n) * step_s  # 2014-06-02 07:00 UTC
    minutes = np.arange(n) * step_s / 60
    kettle = np.zeros(n)
    for start in rng.choice(n - 40, size=hours // 3, replace=False):
        kettle[start : start + 30] = 2800.0  # three minutes at 2.8 kW
    fridge = np.where(minutes % 40 < 15, 90.0, 0.0)
    base = 150 + 50 * np.sin(2 * np.pi * minutes / 1440) + rng.normal(0, 5, n)
    house = folder / "house_1"
    house.mkdir(parents=True, exist_ok=True)
    channels = {"aggregate": base + kettle + fridge, "kettle": kettle, "fridge": fridge}
    for i, watts in enumerate(channels.values(), start=1):
        table = pd.DataFrame({"t": unix, "w": np.round(watts, 1)})
        table.to_csv(house / f"channel_{i}.dat", sep=" ", header=False, index=False)
    (house / "labels.dat").write_text("".join(f"{i} {n}\n" for i, n in enumerate(channels, 1)))
    return folder


def page(folder: Path, checkpoint: Path | None = None, windows: int = 8):
    """The explorer of the model on the house's first ``windows`` windows, and its
    metrics: the few lines a user writes beyond the model's definition."""
    houses = series.read_recordings(folder)  # UK-DALE, REFIT, NILMTK HDF5, CSV, Parquet
    cut = series.windows_of(houses, length=480, freq="1min")  # times and house kept
    model = build()
    if checkpoint is not None:
        series.load_checkpoint(model, checkpoint)  # weights_only; a trainer's dict too
    recipe = series.make_recipe("nilmformer", scale=6000, clip=6000, targets=["kettle"])
    run = series.RecordingModel(model, recipe, cut, thresholds={"kettle": 2000})
    trace = run.trace(slice(0, windows))  # every attention, the statistics token named
    shown = run.subset(slice(0, windows)).model_run([str(n) for n in trace["layer"].values])
    return attnpanel.explore(trace, model=shown), run.evaluate(), trace


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recording", nargs="?", help="a house in UK-DALE's layout (a folder)")
    parser.add_argument("--write-house", metavar="FOLDER", help="write a house to try it on")
    parser.add_argument("--checkpoint", help="the model's trained weights")
    parser.add_argument("--serve", action="store_true", help="serve the page")
    parser.add_argument("--port", type=int, default=5006)
    args = parser.parse_args(argv)
    if args.write_house:
        print(f"wrote {write_house(Path(args.write_house))}")
        return
    if not args.recording:
        parser.error("give a recording (or --write-house FOLDER first)")
    explorer, metrics, trace = page(Path(args.recording), args.checkpoint)
    overall = metrics.query("house == 'all' and scope == 'set'").set_index("metric")["value"]
    print(f"{trace.sizes['batch']} windows of {trace.sizes['query']} positions, "
          f"the last {attnpanel.Positions.of(trace).labels()[-1]!r}")  # fmt: skip
    print(overall[["MAE", "NDE", "F1"]].to_string())
    if args.serve:
        import panel as pn

        pn.serve(explorer, port=args.port, show=False)


if __name__ == "__main__":
    main()

"""A small NILMFormer that disaggregates synthetic household power, and its training loop.

The architecture follows NILMFormer (Petralia et al., "NILMFormer: Non-Intrusive Load
Monitoring that Accounts for Non-Stationarity", KDD 2025; ``src/nilmformer/model.py``,
``layers/embedding.py`` and ``layers/transformer.py``):

* a dilated residual convolution block (kernel 3, dilations 1, 2, 4, 8; each unit
  conv -> GELU -> BatchNorm plus a residual) embeds the load curve into ``3/4`` of
  ``d_model``;
* timestamp features (sine/cosine of the minute of the day at several periods and of the
  day of the week) are projected by a 1x1 convolution into the remaining ``1/4``; they
  are the model's positional information, as NILMFormer's exogenous time encoding;
* encoder layers exactly as NILMFormer's ``EncoderLayer``: ``x = norm1(x); x = x +
  attention(x); x = norm2(x); x = x + dropout(ffn(x))``, with the attention being
  :class:`attnpanel.MultiHeadSelfAttention` with ``mask="diagonal"``;
* a final LayerNorm and a convolutional head giving every appliance's power at every
  timestep (sequence to sequence).

Unlike NILMFormer there is no per-window instance normalisation with a statistics token:
that token would make the attention ``(L + 1) x (L + 1)``, and the explorer shows the
``L x L`` attention over the 480 timesteps. Inputs and targets are instead scaled by
statistics of the training data, stored with the weights.

Run ``python -m attnpanel.nilm.training --help`` to train; the shipped weights in ``data/``
come from that command with its defaults.
"""

from __future__ import annotations

import importlib.resources
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from attnpanel.capturing.modes import evaluating
from attnpanel.kernels.attention import MultiHeadSelfAttention
from attnpanel.nilm.power import (
    APPLIANCES,
)
from attnpanel.series.models import ModelError, load_weights_only
from attnpanel.util.files import write_safely

TIME_PERIODS = (1440, 720, 360, 180, 60, 30, 15)  # minutes; sine/cosine pairs of the day
# the channels of time_features, in order
TIME_FEATURE_NAMES = tuple(
    f"{f} of {period}"
    for period in (*(f"{p} min" for p in TIME_PERIODS), "weekday")
    for f in ("sin", "cos")
)
N_TIME_FEATURES = 2 * len(TIME_PERIODS) + 2  # plus the day of the week
WEIGHTS_FILE = "nilmformer.pt"
METRICS_FILE = "nilmformer_metrics.json"


@dataclass
class NILMFormerConfig:
    """Architecture and data scaling of the model; saved beside the weights."""

    d_model: int = 96  # width of the residual stream (NILMFormer's default)
    n_heads: int = 8  # attention heads; head_dim = 12
    n_layers: int = 3  # encoder layers (NILMFormer's default)
    window: int = 480  # steps per input window: 8 hours at 1 minute
    kernel_size: int = 3  # kernel of the dilated convolutions and of the head
    dilations: list[int] = field(default_factory=lambda: [1, 2, 4, 8])  # embedding block
    ffn_ratio: int = 4  # hidden width of the position-wise FFN, in multiples of d_model
    dropout: float = 0.0  # on attention weights, attention output and FFN; the data is
    # unlimited (fresh random windows every step), so a few-minute run does not overfit
    appliances: list[str] = field(default_factory=lambda: list(APPLIANCES))  # output order
    input_mean: float = 200.0  # W; aggregate is standardised with these two
    input_std: float = 500.0  # W
    target_scale: list[float] = field(
        default_factory=lambda: [100.0, 2500.0, 1250.0, 600.0, 600.0]
    )  # W per appliance: its mean power when on, so every target is ~1 when on
    on_threshold: list[float] = field(
        default_factory=lambda: [50.0, 500.0, 300.0, 50.0, 50.0]
    )  # W per appliance above which it counts as on (for F1)

    def __post_init__(self):
        if self.d_model % 4:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by 4")
        n = len(self.appliances)
        if len(self.target_scale) != n or len(self.on_threshold) != n:
            raise ValueError(
                f"target_scale ({len(self.target_scale)}) and on_threshold "
                f"({len(self.on_threshold)}) need one value per appliance ({n})"
            )

    def to_dict(self) -> dict:
        """Plain ints, floats, strings and lists (safe for ``torch.load(weights_only=True)``)."""
        return {k: list(v) if isinstance(v, tuple | list) else v for k, v in asdict(self).items()}


def time_features(time: np.ndarray) -> torch.Tensor:
    """Sine/cosine timestamp features, ``(..., L) datetime64 -> (..., C, L)`` float32.

    Parameters
    ----------
    time : numpy.ndarray
        datetime64 timestamps, any leading shape.

    Returns
    -------
    torch.Tensor
        ``N_TIME_FEATURES`` channels: the minute of the day at each of ``TIME_PERIODS``
        and the day of the week, each as a sine and a cosine.
    """
    time = np.asarray(time, dtype="datetime64[m]")
    days = time.astype("datetime64[D]")
    minute = (time - days).astype(np.int64).astype(np.float64)
    weekday = (days.astype(np.int64) + 3) % 7  # 1970-01-01 was a Thursday; Monday = 0
    angles = [2 * np.pi * minute / p for p in TIME_PERIODS] + [2 * np.pi * weekday / 7]
    channels = [f(a) for a in angles for f in (np.sin, np.cos)]
    return torch.from_numpy(np.stack(channels, axis=-2).astype(np.float32))


class ResUnit(nn.Module):
    """Conv -> GELU -> BatchNorm with a residual, as NILMFormer's ``ResUnit``."""

    def __init__(self, c_in: int, c_out: int, kernel_size: int, dilation: int):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Conv1d(c_in, c_out, kernel_size, dilation=dilation, padding="same"),
            nn.GELU(),
            nn.BatchNorm1d(c_out),
        )
        # A 1x1 convolution matches the residual's width when it changes (not from 1 channel).
        self.match = nn.Conv1d(c_in, c_out, 1) if c_in > 1 and c_in != c_out else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C_in, L) -> (B, C_out, L)``."""
        residual = x if self.match is None else self.match(x)
        return residual + self.layers(x)


class DilatedBlock(nn.Sequential):
    """Stacked :class:`ResUnit` with growing dilation: NILMFormer's load-curve embedding."""

    def __init__(self, c_in: int, c_out: int, kernel_size: int, dilations: list[int]):
        super().__init__(
            *(
                ResUnit(c_in if i == 0 else c_out, c_out, kernel_size, d)
                for i, d in enumerate(dilations)
            )
        )


class EncoderLayer(nn.Module):
    """NILMFormer's encoder layer on :class:`attnpanel.MultiHeadSelfAttention`."""

    def __init__(self, config: NILMFormerConfig):
        super().__init__()
        d = config.d_model
        self.norm1 = nn.LayerNorm(d)
        self.attention = MultiHeadSelfAttention(
            d, config.n_heads, mask="diagonal", dropout=config.dropout
        )
        self.norm2 = nn.LayerNorm(d)
        self.ffn = nn.Sequential(
            nn.Linear(d, d * config.ffn_ratio),
            nn.GELU(),
            nn.Dropout(config.dropout),
            nn.Linear(d * config.ffn_ratio, d),
        )
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, L, D) -> (B, L, D)``."""
        x = self.norm1(x)  # (B, L, D): what the attention sees
        x = x + self.attention(x)
        x = self.norm2(x)
        return x + self.dropout(self.ffn(x))


class NILMFormer(nn.Module):
    """Sequence-to-sequence disaggregation: aggregate power in, per-appliance power out.

    Parameters
    ----------
    config : NILMFormerConfig, optional
        Architecture and scaling; the defaults are the demo model's.
    """

    def __init__(self, config: NILMFormerConfig | None = None):
        super().__init__()
        self.config = config = config or NILMFormerConfig()
        d_load = 3 * config.d_model // 4
        self.embed_load = DilatedBlock(1, d_load, config.kernel_size, config.dilations)
        self.embed_time = nn.Conv1d(N_TIME_FEATURES, config.d_model - d_load, 1)
        self.encoder = nn.ModuleList(EncoderLayer(config) for _ in range(config.n_layers))
        self.final_norm = nn.LayerNorm(config.d_model)
        self.head = nn.Conv1d(
            config.d_model,
            len(config.appliances),
            config.kernel_size,
            padding=config.kernel_size // 2,
            padding_mode="replicate",
        )
        self.register_buffer(
            "target_scale", torch.tensor(config.target_scale).view(-1, 1), persistent=False
        )

    def embed(self, aggregate: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Encoder input from aggregate power ``(B, L)`` in W and time features ``(B, C, L)``.

        Returns ``(B, L, D)``.
        """
        if aggregate.dim() != 2 or features.shape != (
            aggregate.shape[0],
            N_TIME_FEATURES,
            aggregate.shape[1],
        ):
            raise ValueError(
                f"expected aggregate (batch, length) and features (batch, {N_TIME_FEATURES}, "
                f"length), got {tuple(aggregate.shape)} and {tuple(features.shape)}"
            )
        cfg = self.config
        load = ((aggregate - cfg.input_mean) / cfg.input_std).unsqueeze(1)  # (B, 1, L)
        x = torch.cat([self.embed_load(load), self.embed_time(features)], dim=1)  # (B, D, L)
        return x.transpose(1, 2)  # (B, L, D)

    def attention_input(
        self, aggregate: torch.Tensor, features: torch.Tensor, layer: int
    ) -> torch.Tensor:
        """What encoder layer ``layer``'s attention sees: ``norm1`` of its input, ``(B, L, D)``."""
        if not 0 <= layer < len(self.encoder):
            raise ValueError(f"layer must be in 0..{len(self.encoder) - 1}, got {layer}")
        x = self.embed(aggregate, features)
        for block in self.encoder[:layer]:
            x = block(x)
        return self.encoder[layer].norm1(x)

    def forward(self, aggregate: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Scaled per-appliance power ``(B, A, L)``; :meth:`predict` gives watts."""
        x = self.embed(aggregate, features)  # (B, L, D)
        for block in self.encoder:
            x = block(x)
        x = self.final_norm(x).transpose(1, 2)  # (B, D, L)
        return self.head(x)  # (B, A, L)

    @torch.no_grad()
    def predict(self, aggregate: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Per-appliance power in W, ``(B, A, L)``, non-negative, in eval mode."""
        with evaluating(self):  # shared by a server's sessions: restored by the last out
            return (self(aggregate, features) * self.target_scale).clamp_min(0)


def default_path(name: str = WEIGHTS_FILE) -> Path:
    """Path of a file in the demo's data folder (``attnpanel/nilm/data/``)."""
    return Path(str(importlib.resources.files("attnpanel.nilm.data") / name))


def save_model(model: NILMFormer, path: str | Path, overwrite: bool = False) -> Path:
    """Save weights as a plain dict of tensors plus the config as plain values.

    The file loads with ``torch.load(path, weights_only=True)``. It is written whole or
    not at all; an existing weights file is replaced only with ``overwrite=True``.
    """
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    content = {"config": model.config.to_dict(), "state_dict": state}
    return write_safely(path, "torch", lambda target: torch.save(content, target), overwrite)


def load_model(path: str | Path | None = None) -> NILMFormer:
    """Load a model saved by :func:`save_model` (default: the shipped demo weights).

    Raises
    ------
    FileNotFoundError
        When the file does not exist.
    ValueError
        When the file is not a saved NILMFormer.
    """
    path = default_path() if path is None else Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"no NILMFormer weights at {path}; train them with `python -m attnpanel.nilm.training`"
        )
    own = "a checkpoint of a model of your own goes with --model FILE.py:FUNCTION"
    try:
        saved = load_weights_only(path, numpy=False)  # its files: tensors and a plain config
    except ModelError as error:
        raise ValueError(f"{error}; it is not the demo's NILMFormer file: {own}") from None
    if not isinstance(saved, dict) or not {"config", "state_dict"} <= saved.keys():
        raise ValueError(
            f"{path} is not the demo's NILMFormer file (expected 'config' and 'state_dict'); {own}"
        )
    try:
        model = NILMFormer(NILMFormerConfig(**saved["config"]))
        model.load_state_dict(saved["state_dict"])
    except (TypeError, RuntimeError) as error:
        first = str(error).strip().splitlines()[0]
        raise ValueError(f"{path} does not fit the demo's NILMFormer: {first}; {own}") from None
    return model.eval()

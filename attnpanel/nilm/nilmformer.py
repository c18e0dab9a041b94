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

Run ``python -m attnpanel.nilm.nilmformer --help`` to train; the shipped weights in ``data/``
come from that command with its defaults.
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from attnpanel.kernels.attention import MultiHeadSelfAttention
from attnpanel.nilm.power import (
    APPLIANCES,
    HELDOUT_SEED,
    HELDOUT_START,
    MINUTES_PER_DAY,
    TRAIN_SEED,
    PowerConfig,
    generate,
)
from attnpanel.util.files import check_target, write_safely

TIME_PERIODS = (1440, 720, 360, 180, 60, 30, 15)  # minutes; sine/cosine pairs of the day
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
        was_training = self.training
        self.eval()
        try:
            return (self(aggregate, features) * self.target_scale).clamp_min(0)
        finally:
            self.train(was_training)


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
            f"no NILMFormer weights at {path}; "
            "train them with `python -m attnpanel.nilm.nilmformer`"
        )
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(saved, dict) or not {"config", "state_dict"} <= saved.keys():
        raise ValueError(f"{path} is not a NILMFormer file (expected 'config' and 'state_dict')")
    model = NILMFormer(NILMFormerConfig(**saved["config"]))
    model.load_state_dict(saved["state_dict"])
    return model.eval()


class SeriesSampler:
    """Random windows of a continuous power series, as model-ready tensors."""

    def __init__(self, ds, window: int):
        self.window = window
        self.aggregate = torch.from_numpy(ds["aggregate"].values)  # (N,)
        self.appliances = torch.from_numpy(ds["appliance_power"].values)  # (A, N)
        self.features = time_features(ds["time"].values)  # (C, N)

    def batch(self, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Aggregate ``(B, L)``, features ``(B, C, L)`` and truth ``(B, A, L)`` for starts."""
        index = torch.from_numpy(starts[:, None] + np.arange(self.window))  # (B, L)
        return (
            self.aggregate[index],
            self.features[:, index].transpose(0, 1),
            self.appliances[:, index].transpose(0, 1),
        )

    def random(self, rng: np.random.Generator, batch_size: int):
        """A batch of windows starting at random minutes."""
        n = len(self.aggregate) - self.window + 1
        return self.batch(rng.integers(0, n, batch_size))


def fit_scaling(ds, config: NILMFormerConfig) -> NILMFormerConfig:
    """A copy of ``config`` with input and target scaling measured on training data."""
    aggregate = ds["aggregate"].values.astype(np.float64)
    power = ds["appliance_power"].sel(appliance=config.appliances).values
    scale = []
    for values, threshold in zip(power, config.on_threshold, strict=True):
        on = values[values > threshold]
        scale.append(float(on.mean()) if len(on) else 1.0)
    return NILMFormerConfig(
        **dict(
            config.to_dict(),
            input_mean=float(aggregate.mean()),
            input_std=float(aggregate.std()),
            target_scale=scale,
        )
    )


def heldout_windows(n_days: int, config: NILMFormerConfig, seed: int = HELDOUT_SEED):
    """Non-overlapping windows of held-out days (their own seed and dates).

    Windows start at 06:00, 14:00 and 22:00, so the days' morning and evening peaks are
    not cut at window edges.
    """
    from attnpanel.nilm.power import windows

    ds = generate(n_days + 1, seed=seed, config=PowerConfig(start=HELDOUT_START))
    return windows(ds, length=config.window, offset=6 * 60).isel(
        window=slice(0, n_days * MINUTES_PER_DAY // config.window)
    )


@torch.no_grad()
def evaluate(model: NILMFormer, windows_ds, train_mean: list[float] | None = None) -> dict:
    """Per-appliance MAE and on-state F1 of the model against trivial baselines.

    Parameters
    ----------
    model : NILMFormer
        The model to score.
    windows_ds : xarray.Dataset
        Windows from :func:`attnpanel.nilm.power.windows`.
    train_mean : list of float, optional
        Each appliance's mean power on the training data, the "mean" baseline's constant
        prediction; zeros when not given.

    Returns
    -------
    dict
        ``{appliance: {"mae_model", "mae_zero", "mae_mean", "f1_model", "f1_always_on",
        "on_threshold", "on_share"}}`` (MAE in W). Predicting zero or the (small) mean
        never crosses the on-threshold, so their F1 is 0; the F1 baseline is "always on".
    """
    cfg = model.config
    truth = windows_ds["appliance_power"].sel(appliance=cfg.appliances).values  # (B, A, L)
    aggregate = torch.from_numpy(windows_ds["aggregate"].values)
    features = time_features(windows_ds["time"].values)
    predicted = torch.cat(
        [model.predict(a, f) for a, f in zip(aggregate.split(16), features.split(16), strict=True)]
    ).numpy()
    means = train_mean or [0.0] * len(cfg.appliances)
    metrics = {}
    for i, name in enumerate(cfg.appliances):
        y, p, threshold = truth[:, i], predicted[:, i], cfg.on_threshold[i]
        on = y > threshold
        metrics[name] = {
            "mae_model": float(np.abs(p - y).mean()),
            "mae_zero": float(np.abs(y).mean()),
            "mae_mean": float(np.abs(y - means[i]).mean()),
            "f1_model": _f1(on, p > threshold),
            "f1_always_on": _f1(on, np.ones_like(on)),
            "on_threshold": threshold,
            "on_share": float(on.mean()),
        }
    return metrics


def _f1(truth: np.ndarray, predicted: np.ndarray) -> float:
    tp = float(np.sum(truth & predicted))
    denominator = float(np.sum(truth) + np.sum(predicted))
    return 2 * tp / denominator if denominator else 0.0


def _learning_rate(progress: float, peak: float, warmup: float = 0.05) -> float:
    """Linear warm-up then cosine decay to 5% of the peak, over ``progress`` in [0, 1]."""
    if progress < warmup:
        return peak * progress / warmup
    decay = (progress - warmup) / (1 - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(decay, 1.0))))


@dataclass
class TrainResult:
    """What :func:`train` produced."""

    model: NILMFormer  # the trained model, in eval mode
    losses: list[float]  # training loss of every step
    metrics: dict  # evaluate() on held-out windows (empty when eval_days is 0)
    seconds: float  # wall time of the training loop
    steps: int  # optimiser steps taken


def train(
    config: NILMFormerConfig | None = None,
    *,
    steps: int | None = None,
    minutes: float | None = 5.5,
    batch_size: int = 8,
    learning_rate: float = 2e-3,
    train_days: int = 400,
    eval_days: int = 60,
    seed: int = 0,
    out: str | Path | None = None,
    metrics_out: str | Path | None = None,
    progress: bool = True,
    threads: int | None = 1,
    overwrite: bool = False,
) -> TrainResult:
    """Train a NILMFormer on synthetic household power.

    Training stops after ``steps`` optimiser steps or ``minutes`` of wall time, whichever
    comes first; the learning-rate schedule follows whichever budget is nearer its end.

    Parameters
    ----------
    config : NILMFormerConfig, optional
        Architecture; input/target scaling is re-measured on the training days.
    steps : int, optional
        Maximum optimiser steps.
    minutes : float, optional
        Maximum wall time of the training loop.
    batch_size : int
        Windows per step.
    learning_rate : float
        Peak AdamW learning rate.
    train_days : int
        Days of training data (windows are drawn at random minutes of them).
    eval_days : int
        Held-out days to score on afterwards (0 skips evaluation).
    seed : int
        Seeds the model initialisation, the batch order and the training days.
    out : str or Path, optional
        Where to save the weights; not saved when None.
    metrics_out : str or Path, optional
        Where to write the held-out metrics as JSON; not written when None.
    progress : bool
        Show a tqdm progress bar.
    threads : int, optional
        torch CPU threads while training (restored afterwards); None keeps the current
        setting. One thread is the default because on a shared 2-core machine two
        threads contend with other work and a step gets several times slower.
    overwrite : bool
        Replace existing ``out`` and ``metrics_out`` files (checked before training).

    Returns
    -------
    TrainResult
    """
    if steps is None and minutes is None:
        raise ValueError("give steps or minutes (or both) to bound the training")
    if out is not None:
        check_target(out, "torch", overwrite)  # refused now, not after minutes of training
    if metrics_out is not None:
        check_target(metrics_out, "json", overwrite)
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _train(
            config,
            steps,
            minutes,
            batch_size,
            learning_rate,
            train_days,
            eval_days,
            seed,
            out,
            metrics_out,
            progress,
            overwrite,
        )
    finally:
        torch.set_num_threads(previous_threads)


def _train(
    config,
    steps,
    minutes,
    batch_size,
    learning_rate,
    train_days,
    eval_days,
    seed,
    out,
    metrics_out,
    progress,
    overwrite,
) -> TrainResult:
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    config = config or NILMFormerConfig()
    data = generate(train_days, seed=TRAIN_SEED + seed, config=PowerConfig())
    config = fit_scaling(data, config)
    sampler = SeriesSampler(data, config.window)
    model = NILMFormer(config)
    optimiser = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=1e-2)
    budget = None if minutes is None else minutes * 60
    losses: list[float] = []
    bar = tqdm(total=steps, disable=not progress, desc="training NILMFormer", unit="step")
    model.train()
    started = time.perf_counter()
    step = 0
    while True:
        elapsed = time.perf_counter() - started
        done = [step / steps if steps else 0.0, elapsed / budget if budget else 0.0]
        if max(done) >= 1:
            break
        for group in optimiser.param_groups:
            group["lr"] = _learning_rate(max(done), learning_rate)
        aggregate, features, truth = sampler.random(rng, batch_size)
        loss = nn.functional.mse_loss(model(aggregate, features), truth / model.target_scale)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimiser.step()
        losses.append(loss.item())
        step += 1
        bar.update()
        bar.set_postfix(loss=f"{np.mean(losses[-20:]):.4f}", refresh=False)
    bar.close()
    seconds = time.perf_counter() - started
    model.eval()
    metrics = {}
    if eval_days:
        means = data["appliance_power"].sel(appliance=config.appliances).mean("time")
        metrics = evaluate(model, heldout_windows(eval_days, config), means.values.tolist())
    if out is not None:
        save_model(model, out, overwrite)
    if metrics_out is not None:
        report = {
            "train_seconds": seconds,
            "steps": step,
            "batch_size": batch_size,
            "threads": torch.get_num_threads(),
            "train_days": train_days,
            "eval_days": eval_days,
            "eval_windows": eval_days * MINUTES_PER_DAY // config.window,
            "final_loss": float(np.mean(losses[-50:])) if losses else None,
            "appliances": metrics,
        }
        text = json.dumps(report, indent=2) + "\n"
        write_safely(metrics_out, "json", lambda target: target.write_text(text), overwrite)
    return TrainResult(model, losses, metrics, seconds, step)


def main(argv: list[str] | None = None) -> int:
    """Command line: train the demo model and write its weights and held-out metrics."""
    parser = argparse.ArgumentParser(
        prog="python -m attnpanel.nilm.nilmformer",
        description="Train the demo NILMFormer on synthetic household power (CPU, minutes).",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(WEIGHTS_FILE),
        help=f"weights file (default: ./{WEIGHTS_FILE}; the shipped demo weights are never "
        "a default target)",
    )
    parser.add_argument(
        "--force", action="store_true", help="replace existing weights and metrics files"
    )
    parser.add_argument(
        "--metrics", type=Path, default=None, help="metrics JSON (default: beside --out)"
    )
    parser.add_argument("--minutes", type=float, default=5.5, help="wall-time budget")
    parser.add_argument("--steps", type=int, default=None, help="optimiser step budget")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    parser.add_argument("--layers", type=int, default=NILMFormerConfig.n_layers)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args(argv)
    metrics_out = args.metrics or args.out.with_name(METRICS_FILE)
    try:
        result = train(
            NILMFormerConfig(n_layers=args.layers),
            steps=args.steps,
            minutes=args.minutes,
            batch_size=args.batch_size,
            learning_rate=args.lr,
            seed=args.seed,
            out=args.out,
            metrics_out=metrics_out,
            threads=args.threads,
            overwrite=args.force,
        )
    except (FileExistsError, FileNotFoundError) as error:
        parser.error(str(error))
    print(f"{result.steps} steps in {result.seconds:.0f} s; weights: {args.out}")
    print(f"{'appliance':16} {'MAE model':>10} {'MAE zero':>9} {'F1 model':>9} {'F1 on':>6}")
    for name, m in result.metrics.items():
        print(
            f"{name:16} {m['mae_model']:10.1f} {m['mae_zero']:9.1f} "
            f"{m['f1_model']:9.3f} {m['f1_always_on']:6.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Training the demo NILMFormer on synthetic household power, and its held-out metrics.

Run ``python -m attnpanel.nilm.training --help`` (or ``attnpanel train``) to retrain; the
shipped weights and metrics are in ``attnpanel/nilm/data/``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from attnpanel.nilm.nilmformer import (
    METRICS_FILE,
    WEIGHTS_FILE,
    NILMFormer,
    NILMFormerConfig,
    save_model,
    time_features,
)
from attnpanel.nilm.power import (
    HELDOUT_SEED,
    HELDOUT_START,
    MINUTES_PER_DAY,
    TRAIN_SEED,
    PowerConfig,
    generate,
)
from attnpanel.util.files import check_target, write_safely


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
        never crosses the on-threshold, so their F1 is 0 (NaN where the appliance is never
        on either); the F1 baseline is "always on".
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
            "f1_model": f1_score(on, p > threshold),
            "f1_always_on": f1_score(on, np.ones_like(on)),
            "on_threshold": threshold,
            "on_share": float(on.mean()),
        }
    return metrics


def f1_score(truth: np.ndarray, predicted: np.ndarray) -> float:
    """F1 of boolean on-states, ``2 TP / (|truth on| + |predicted on|)``; NaN where neither
    is ever on (0 / 0: an appliance that does not run, rightly predicted off, has no F1,
    not an F1 of 0)."""
    tp = float(np.sum(truth & predicted))
    denominator = float(np.sum(truth) + np.sum(predicted))
    return 2 * tp / denominator if denominator else float("nan")


def _f1_text(value: float) -> str:
    return "n/a" if np.isnan(value) else f"{value:.3f}"


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
        prog="python -m attnpanel.nilm.training",
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
            f"{_f1_text(m['f1_model']):>9} {_f1_text(m['f1_always_on']):>6}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

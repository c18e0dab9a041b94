"""The metrics NILM and forecasting papers report, with the definitions named.

NILM, for one target's true power ``y`` and predicted power ``ŷ`` over the same steps
(Petralia et al., NILMFormer, KDD 2025, its ``NILMmetrics``; NILMTK where it differs):

- ``MAE`` = mean |ŷ - y|; ``MSE`` = mean (ŷ - y)²; ``RMSE`` = √MSE
- ``NDE`` = Σ (ŷ - y)² / Σ y²  (NILMFormer's; NILMTK's ``NDE (NILMTK)`` is its square root)
- ``SAE`` = |Σ ŷ - Σ y| / Σ y
- ``MR``  = Σ min(ŷ, y) / Σ max(ŷ, y)  (match rate)
- ``TECA`` = 1 - Σ |ŷ - y| / (2 Σ |y|)  (total energy correctly assigned, one target)
- of the on-state (power ≥ the target's threshold, in W): ``accuracy``, ``balanced
  accuracy``, ``precision``, ``recall``, ``F1``

Energy per period (NILMFormer's day / week / month evaluation): each house's true and
predicted energy summed per calendar period (+1, as NILMFormer does, so that no period is
zero), then the same regression metrics over the periods.

Forecasting: ``MAE``, ``RMSE``, ``sMAPE`` = 100 mean 2|ŷ - y| / (|y| + |ŷ|) (a step where both
are 0 counts 0), ``MASE`` = MAE / mean |y_t - y_{t-m}| of the history (seasonal naive, season
``m``).
"""

from __future__ import annotations

import numpy as np

NDE_FORMS = ("nilmformer", "nilmtk")


def _pair(truth, prediction) -> tuple[np.ndarray, np.ndarray]:
    y = np.asarray(truth, dtype=np.float64).ravel()
    y_hat = np.asarray(prediction, dtype=np.float64).ravel()
    if y.shape != y_hat.shape:
        raise ValueError(f"truth has {y.size} values, the prediction {y_hat.size}")
    if not y.size:
        raise ValueError("no value to score")
    return y, y_hat


def _ratio(top: float, bottom: float) -> float:
    return float(top / bottom) if bottom else float("nan")


def regression(truth, prediction) -> dict[str, float]:
    """MAE, MSE, RMSE, NDE (both forms), SAE, MR and TECA of one target."""
    y, y_hat = _pair(truth, prediction)
    error = y_hat - y
    mse = float(np.mean(error**2))
    nde = _ratio(float(np.sum(error**2)), float(np.sum(y**2)))
    return {
        "MAE": float(np.mean(np.abs(error))),
        "MSE": mse,
        "RMSE": float(np.sqrt(mse)),
        "NDE": nde,
        "NDE (NILMTK)": float(np.sqrt(nde)),
        "SAE": _ratio(abs(float(y_hat.sum() - y.sum())), float(y.sum())),
        "MR": _ratio(float(np.minimum(y_hat, y).sum()), float(np.maximum(y_hat, y).sum())),
        "TECA": 1.0 - _ratio(float(np.abs(error).sum()), 2.0 * float(np.abs(y).sum())),
    }


def on_state(truth, prediction, threshold: float) -> dict[str, float]:
    """Accuracy, balanced accuracy, precision, recall and F1 of the on-state
    (power ≥ ``threshold``)."""
    y, y_hat = _pair(truth, prediction)
    true, found = y >= threshold, y_hat >= threshold
    tp = float(np.sum(true & found))
    tn = float(np.sum(~true & ~found))
    fp = float(np.sum(~true & found))
    fn = float(np.sum(true & ~found))
    precision = _ratio(tp, tp + fp)
    recall = _ratio(tp, tp + fn)
    specificity = _ratio(tn, tn + fp)
    if tp + fp + fn == 0:
        f1 = float("nan")  # never on, never predicted on: F1 is undefined
    else:
        f1 = 2 * tp / (2 * tp + fp + fn)
    rates = [r for r in (recall, specificity) if not np.isnan(r)]
    return {
        "accuracy": (tp + tn) / y.size,
        "balanced accuracy": float(np.mean(rates)) if rates else float("nan"),
        "precision": precision,
        "recall": recall,
        "F1": f1,
    }


def nilm(truth, prediction, threshold: float | None = None) -> dict[str, float]:
    """Every NILM metric of one target: :func:`regression`, and :func:`on_state` where a
    threshold is given."""
    found = regression(truth, prediction)
    if threshold is not None:
        found.update(on_state(truth, prediction, threshold))
    return found


def energy(truth, prediction, time, houses=None, period: str = "D") -> dict[str, float]:
    """:func:`regression` of the energy per calendar ``period`` (``D``, ``W``, ``ME``),
    summed per house, each period's sums +1 (NILMFormer's rule)."""
    import pandas as pd

    y, y_hat = _pair(truth, prediction)
    stamps = pd.DatetimeIndex(np.asarray(time).ravel())
    if len(stamps) != y.size:
        raise ValueError(f"{len(stamps)} timestamps for {y.size} values")
    house = np.zeros(y.size, dtype=int) if houses is None else np.asarray(houses).ravel()
    frame = pd.DataFrame({"y": y, "y_hat": y_hat, "house": house}, index=stamps)
    sums = frame.groupby(["house", pd.Grouper(freq=period)])[["y", "y_hat"]].sum() + 1.0
    return regression(sums["y"].to_numpy(), sums["y_hat"].to_numpy())


def forecast(truth, prediction, history=None, season: int = 1) -> dict[str, float]:
    """MAE, RMSE, sMAPE (%) and, given the ``history`` before the forecast, MASE."""
    y, y_hat = _pair(truth, prediction)
    error = np.abs(y_hat - y)
    both = np.abs(y) + np.abs(y_hat)
    smape = np.divide(2 * error, both, out=np.zeros_like(error), where=both > 0)
    found = {
        "MAE": float(error.mean()),
        "RMSE": float(np.sqrt(np.mean(error**2))),
        "sMAPE": float(100 * smape.mean()),
    }
    if history is not None:
        past = np.asarray(history, dtype=np.float64).ravel()
        if past.size <= season:
            raise ValueError(f"MASE needs more than {season} steps of history, got {past.size}")
        naive = float(np.mean(np.abs(past[season:] - past[:-season])))
        found["MASE"] = _ratio(found["MAE"], naive)
    return found

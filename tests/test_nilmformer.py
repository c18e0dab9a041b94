"""The demo NILMFormer: shapes, the attention it is built on, saving, loading and training."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from attnpanel import MultiHeadSelfAttention
from attnpanel.nilm.nilmformer import (
    N_TIME_FEATURES,
    NILMFormer,
    NILMFormerConfig,
    default_path,
    load_model,
    save_model,
    time_features,
)
from attnpanel.nilm.power import APPLIANCES, generate, windows
from attnpanel.nilm.training import evaluate, heldout_windows, main, train

TINY = dict(d_model=16, n_heads=2, n_layers=1, window=64, dilations=[1, 2])


def inputs(batch: int, length: int):
    time = np.datetime64("2024-03-04T05:00") + np.arange(length) * np.timedelta64(1, "m")
    features = time_features(np.broadcast_to(time, (batch, length)))
    return torch.rand(batch, length) * 3000, features


def test_forward_shapes_and_attention_layers():
    model = NILMFormer().eval()
    aggregate, features = inputs(2, 480)
    assert features.shape == (2, N_TIME_FEATURES, 480)
    assert model(aggregate, features).shape == (2, len(APPLIANCES), 480)
    predicted = model.predict(aggregate, features)
    assert predicted.shape == (2, len(APPLIANCES), 480) and predicted.min() >= 0
    for layer in model.encoder:
        assert isinstance(layer.attention, MultiHeadSelfAttention)
        assert layer.attention.mask_name == "diagonal"
        assert (layer.attention.d_model, layer.attention.n_heads) == (96, 8)
    seen = model.attention_input(aggregate, features, layer=1)
    assert seen.shape == (2, 480, 96)
    # norm1's output: zero mean and unit variance over features at every position.
    torch.testing.assert_close(seen.mean(-1), torch.zeros(2, 480), atol=1e-4, rtol=0)


def test_attention_input_is_what_the_layer_sees():
    model = NILMFormer(NILMFormerConfig(**TINY)).eval()
    aggregate, features = inputs(3, 64)
    seen = []
    model.encoder[0].attention.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    model(aggregate, features)
    torch.testing.assert_close(model.attention_input(aggregate, features, 0), seen[0])
    with pytest.raises(ValueError, match="layer must be in 0..0"):
        model.attention_input(aggregate, features, 1)


def test_bad_inputs_are_named():
    model = NILMFormer(NILMFormerConfig(**TINY))
    aggregate, features = inputs(2, 64)
    with pytest.raises(ValueError, match="expected aggregate"):
        model(aggregate[0], features)
    with pytest.raises(ValueError, match="divisible by 4"):
        NILMFormerConfig(d_model=18, n_heads=2)
    with pytest.raises(ValueError, match="one value per appliance"):
        NILMFormerConfig(target_scale=[1.0])


def test_time_features_encode_time_of_day():
    time = np.array(["2024-01-01T00:00", "2024-01-01T06:00", "2024-01-02T00:00"], "M8[m]")
    features = time_features(time).numpy()
    assert features.shape == (N_TIME_FEATURES, 3)
    # exact values of sin and cos of an angle below 2 pi taken in float32: a few ulps of 2 pi
    np.testing.assert_allclose(features[:2, 0], [0, 1], atol=1e-6)  # sin, cos at midnight
    np.testing.assert_allclose(features[:2, 1], [1, 0], atol=1e-6)  # a quarter day later
    np.testing.assert_allclose(features[:-2, 0], features[:-2, 2], atol=1e-6)  # same minute
    assert not np.allclose(features[-2:, 0], features[-2:, 2])  # next weekday


def test_save_load_round_trip_with_weights_only(tmp_path):
    model = NILMFormer(NILMFormerConfig(**TINY, input_mean=123.0)).eval()
    path = save_model(model, tmp_path / "m.pt")
    raw = torch.load(path, weights_only=True)
    assert set(raw) == {"config", "state_dict"}
    assert all(isinstance(v, torch.Tensor) for v in raw["state_dict"].values())
    assert all(isinstance(v, int | float | str | list) for v in raw["config"].values())
    loaded = load_model(path)
    assert loaded.config == model.config and not loaded.training
    aggregate, features = inputs(2, 64)
    torch.testing.assert_close(loaded(aggregate, features), model(aggregate, features))


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no NILMFormer weights"):
        load_model(tmp_path / "missing.pt")
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(3)}, other)
    with pytest.raises(ValueError, match="not the demo's NILMFormer file"):
        load_model(other)


def test_short_training_lowers_the_loss(tmp_path):
    out, metrics_out = tmp_path / "m.pt", tmp_path / "metrics.json"
    result = train(
        NILMFormerConfig(**TINY),
        steps=40,
        minutes=None,
        batch_size=8,
        learning_rate=3e-3,
        train_days=4,
        eval_days=1,
        out=out,
        metrics_out=metrics_out,
        progress=False,
    )
    assert result.steps == 40 and len(result.losses) == 40
    assert np.mean(result.losses[-10:]) < 0.7 * np.mean(result.losses[:5])
    assert load_model(out).config == result.model.config
    report = json.loads(metrics_out.read_text())
    assert report["steps"] == 40 and set(report["appliances"]) == set(APPLIANCES)
    # The scaling is measured on the training data, not left at the defaults.
    assert result.model.config.input_mean != NILMFormerConfig().input_mean


def test_evaluate_scores_a_perfect_model_perfectly():
    class Oracle(NILMFormer):
        def predict(self, aggregate, features):
            return truth[: len(aggregate)]

    held = windows(generate(2, seed=5), length=480)
    truth = torch.from_numpy(held["appliance_power"].values)
    metrics = evaluate(Oracle(), held)
    for name, m in metrics.items():
        assert m["mae_model"] == 0
        assert m["mae_zero"] == pytest.approx(
            float(held["appliance_power"].sel(appliance=name).mean())
        )
        if m["on_share"] > 0:
            assert m["f1_model"] == 1
            assert 0 < m["f1_always_on"] < 1


def test_command_line_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--out", "--minutes", "--steps", "--seed"):
        assert option in text


def test_shipped_weights_load_and_beat_the_baseline():
    model = load_model()
    assert (model.config.d_model, model.config.n_heads, model.config.window) == (96, 8, 480)
    assert default_path().stat().st_size < 5 * 2**20
    report = json.loads(default_path("nilmformer_metrics.json").read_text())
    assert set(report["appliances"]) == set(model.config.appliances)
    # Re-scored here on a few held-out days: clearly better than predicting nothing for
    # at least one appliance, on both the error and the on/off detection.
    scores = evaluate(model, heldout_windows(4, model.config))
    assert any(
        m["mae_model"] < 0.6 * m["mae_zero"] and m["f1_model"] > m["f1_always_on"] + 0.3
        for m in scores.values()
    )

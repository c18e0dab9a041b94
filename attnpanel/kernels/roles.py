"""What role a head plays, per sample: the sums behind TransformerLens' head detector, and
the offset a head puts most weight on, accumulated block by block.

For one sample's real queries ``i`` and keys ``j`` (padded queries left out), with ``a_ij``
the weights and ``D`` a 0/1 detection pattern, TransformerLens' ``"mul"`` score is
``sum_ij a_ij D_ij / sum_ij a_ij`` (``head_detector.compute_head_attention_similarity_score``),
where ``exclude_bos`` zeroes the first real key's column and ``exclude_current_token`` the
diagonal of ``a`` first. The patterns (its ``get_*_detection_pattern``):

=====================  =========================================================
``previous_token``     ``D_ij = 1`` where ``j = i - 1``
``duplicate_token``    ``D_ij = 1`` where ``j < i`` and token ``j`` is token ``i``
``induction``          ``D_ij = 1`` where ``1 <= j <= i`` and token ``j - 1`` is token ``i``
=====================  =========================================================

``offset`` is the ``d = i - j`` whose diagonal holds the most weight, ``sum_i a_i,i-d``
over the real queries, and ``offset_weight`` that weight over all their weight ``sum a``
(the number of real queries where no real query is blocked from every key):
"looks ``d`` steps back" (``d < 0``: ahead). A head's diagonals are summed by a strided
view of its block padded on both sides (no loop over offsets).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOKEN_ROLES = ("duplicate_token", "induction")
ROLE_NAMES = ("previous_token", "duplicate_token", "induction", "offset", "offset_weight")


@dataclass(frozen=True)
class RoleInputs:
    """What the role sums need beyond the weights."""

    tokens: torch.Tensor | None = None  # (B, L) token ids (or any comparable labels' codes)
    exclude_bos: bool = False  # TransformerLens' exclude_bos: the first real key left out
    exclude_current_token: bool = False  # ... and the diagonal


class RoleSums:
    """The role sums of every head-sample, block by block.

    Parameters
    ----------
    inputs : RoleInputs
    heads : int
    first : torch.Tensor
        ``(B,)`` each sample's first real key.
    real : torch.Tensor
        ``(B, L)`` bool, True at each sample's real queries.
    named : torch.Tensor, optional
        ``(S,)`` bool, True at keys that are named tokens: their columns are left out of
        every sum (their queries are not real).
    """

    def __init__(
        self,
        inputs: RoleInputs,
        heads: int,
        first: torch.Tensor,
        real: torch.Tensor,
        named: torch.Tensor | None = None,
    ):
        self.inputs, self.heads, self.first, self.real = inputs, heads, first, real
        self.steps_only = None if named is None else ~named  # (S,) the keys that are steps
        self.every_query_real = bool(real.all())  # asked once, not per block
        self._buffer: torch.Tensor | None = None  # the diagonal sums' padded block, reused
        self.parts: dict[str, list[torch.Tensor]] = {}

    def add(self, part: slice, a: torch.Tensor) -> None:
        """Accumulate a block ``a`` ``(n, L, S)`` of head-samples ``part`` (in ``B * H``
        order).

        Every sum but the token patterns' comes from one pass, the block's diagonal sums,
        kept (``(n, 2L - 1)``, small beside the block): ``sum a`` is their total, the
        previous-token sum the diagonal at offset 1, the current token's at 0. What is read
        from them is read once, over every block, in :meth:`result` (a block is a few head-
        samples: a dozen small operations per block cost as much as the pass itself).
        """
        length, keys = a.shape[-2:]
        if length != keys:
            return  # a cross-attention has no diagonals: its roles are NaN
        sample = None
        if not self.every_query_real:
            sample = self._samples(part, a.device)
            real = self.real.to(a.device)[sample]  # (n, L)
            a = a * real[..., None].to(a.dtype)  # padded queries carry nothing
        if self.steps_only is not None:
            a = a * self.steps_only.to(a.device, a.dtype)  # nor do named keys
        if (
            self._buffer is None
            or self._buffer.shape[0] < a.shape[0]
            or self._buffer.shape[1] != length + 1
        ):
            self._buffer = a.new_zeros(a.shape[0], length + 1, 2 * length)
        found = {"diagonals": _diagonal_sums(a, self._buffer)}  # offsets L - 1 ... 1 - L
        if self.inputs.exclude_bos or self.inputs.tokens is not None:
            sample = self._samples(part, a.device) if sample is None else sample
            first = self.first.to(a.device)[sample]  # (n,)
            found.update(self._token_sums(a, sample, first))
        for name, value in found.items():
            self.parts.setdefault(name, []).append(value)

    def _samples(self, part: slice, device) -> torch.Tensor:
        return torch.arange(part.start, part.stop, device=device) // self.heads

    def _token_sums(self, a, sample, first) -> dict[str, torch.Tensor]:
        """The sums beyond the diagonals: the first real key's column and its cells
        (``exclude_bos``), and the token patterns' sums."""
        length, keys = a.shape[-2:]
        found = {}
        cases = torch.arange(len(first), device=a.device)
        if self.inputs.exclude_bos:
            at_first = a.gather(-1, first[:, None, None].expand(-1, length, 1))[..., 0]
            found["bos_column"] = at_first.sum(-1, dtype=torch.float64)
            after = (first + 1).clamp_max(length - 1)  # a_{first + 1, first}: excluded too
            found["bos_previous"] = torch.where(first + 1 < length, a[cases, after, first], 0.0)
            found["bos_own"] = a[cases, first, first].double()  # (first, first)
        if self.inputs.tokens is not None:
            rows = torch.arange(length, device=a.device)
            tokens = self.inputs.tokens.to(a.device)[sample]  # (n, L)
            for name, pattern in _token_patterns(tokens, rows).items():
                if self.inputs.exclude_bos:
                    keys_kept = torch.arange(keys, device=a.device) != first[:, None]
                    pattern = pattern & keys_kept[:, None, :]
                if self.inputs.exclude_current_token:
                    pattern = pattern & (rows[:, None] != rows[None, :])
                found[name] = (a * pattern).sum(dim=(-2, -1), dtype=torch.float64)
        return found

    def _diagonals(self) -> torch.Tensor | None:
        """Every head-sample's diagonal sums, ``(B H, 2L - 1)`` float64 (None: none)."""
        if "diagonals" not in self.parts:
            return None
        return torch.cat(self.parts["diagonals"]).to(torch.float64)

    def distance(self, batch: int, heads: int) -> torch.Tensor | None:
        """The ``distance`` statistic, ``(B, H)``: ``sum_ij a_ij |i - j|`` over a sample's
        real queries, from the diagonal sums, over their number (None: no diagonals)."""
        diagonals = self._diagonals()
        if diagonals is None:
            return None
        length = (diagonals.shape[-1] + 1) // 2
        offsets = torch.arange(length - 1, -length, -1, device=diagonals.device).abs()
        spread = (diagonals @ offsets.to(torch.float64)).reshape(batch, heads)
        count = self.real.sum(-1).to(torch.float64).clamp_min(1.0).to(spread.device)
        return spread / count[:, None]

    def result(self, batch: int, heads: int) -> dict[str, torch.Tensor]:
        """Each role statistic ``(B, H)`` float64 (NaN where it cannot be had: the token
        roles without tokens, every role of a cross-attention)."""
        nan = torch.full((batch, heads), float("nan"), dtype=torch.float64)
        diagonals = self._diagonals()
        if diagonals is None:  # a cross-attention: no diagonals, no roles
            return {name: nan for name in ROLE_NAMES}
        whole = {
            name: torch.cat(parts) for name, parts in self.parts.items() if name != "diagonals"
        }
        length = (diagonals.shape[-1] + 1) // 2
        mass = diagonals.sum(-1)  # TransformerLens' sum(a)
        previous = diagonals[:, length - 2] if length > 1 else torch.zeros_like(mass)
        total = mass.clone()
        if self.inputs.exclude_bos:
            total -= whole["bos_column"]
            previous = previous - whole["bos_previous"]
        if self.inputs.exclude_current_token:
            total -= diagonals[:, length - 1]
            if self.inputs.exclude_bos:  # the cell (first, first), taken out twice
                total += whole["bos_own"]
        tiny = torch.finfo(torch.float64).tiny
        weight, where = (diagonals / mass.clamp_min(tiny)[:, None]).max(-1)
        sums = {
            "previous_token": previous,
            "offset": (length - 1 - where).to(torch.float64),
            "offset_weight": weight,
            **{name: whole[name] for name in TOKEN_ROLES if name in whole},
        }
        total = total.clamp_min(tiny)
        found = {}
        for name in ROLE_NAMES:
            if name not in sums:
                found[name] = nan
            elif name in ("offset", "offset_weight"):
                found[name] = sums[name].reshape(batch, heads)
            else:
                found[name] = (sums[name] / total).reshape(batch, heads)
        return found


def _diagonal_sums(a: torch.Tensor, buffer: torch.Tensor | None = None) -> torch.Tensor:
    """``(n, 2L - 1)``: entry ``d'`` sums ``a[i, i + d' - (L - 1)]`` over ``i``
    (offset ``i - j = L - 1 - d'``), square blocks only.

    Each row sits in a buffer after ``L`` zeros (and one row of zeros below), read as rows
    of ``2L + 1``: row ``i`` then starts ``i`` cells later, so column ``c`` holds
    ``a[i, i + c - L]`` (what runs past a row lands in the next row's zeros), and the
    diagonals are the columns' sums, read contiguously, in the block's float32 (at most
    ``L`` terms each; the caller widens them). ``buffer`` (``(>= n, L + 1, 2L)``, zeros
    where ``a`` is not written) is reused from block to block: one copy of the block, no
    allocation.
    """
    n, length, _ = a.shape
    if buffer is None:
        buffer = a.new_zeros(n, length + 1, 2 * length)
    buffer = buffer[:n]
    buffer[:, :length, length:].copy_(a)
    flat = buffer.reshape(n, -1)[:, : length * (2 * length + 1)]
    skewed = flat.as_strided((n, length, 2 * length + 1), (flat.stride(0), 2 * length + 1, 1))
    columns = skewed.sum(dim=1)  # (n, 2L + 1): column c is the offset i - j = L - c
    return columns[:, 1 : 2 * length]  # offsets L - 1 down to -(L - 1)


def _token_patterns(tokens: torch.Tensor, rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """TransformerLens' duplicate-token and induction patterns ``(n, L, L)`` of each row's
    tokens."""
    same = tokens[:, :, None] == tokens[:, None, :]  # token i is token j
    before = rows[None, :] < rows[:, None]  # j < i
    duplicate = same & before
    # induction: token j - 1 is token i, 1 <= j <= i
    shifted = torch.nn.functional.pad(duplicate, (1, 0))[..., :-1]
    return {"duplicate_token": duplicate, "induction": shifted & (rows[None, :] <= rows[:, None])}

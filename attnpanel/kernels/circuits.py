"""What a head computes, read from its weights alone: its QK and OV circuits as low-rank
factors, their singular values, how much its OV circuit copies, and how much each head's
output is read by a later head's query, key or value (composition, Elhage et al. 2021).

In the row convention of the residual stream (``x`` a row of width ``d``), head ``h`` of a
layer with ``w_q, w_k, w_v`` (``(H E, d)``, as ``nn.Linear.weight``) and ``w_o``
(``(d, H E)``) has

========  =============================================================================
``QK_h``  ``W_q^hT W_k^h`` (``(d, E) (E, d)``): query ``x_i`` scores key ``x_j`` by
          ``x_i QK_h x_j^T`` (before the scale)
``OV_h``  ``W_v^hT W_o^hT`` (``(d, E) (E, d)``): what the head writes for a key it
          attends to fully, ``x_j OV_h``
========  =============================================================================

with ``W_q^h`` the rows ``h E .. (h + 1) E`` of ``w_q`` and ``W_o^h`` those columns of
``w_o``. TransformerLens' ``W_Q[h]`` is ``W_q^hT``: its ``QK`` and ``OV`` are these. A
factored ``A B`` is never multiplied out (:class:`Factored`): its norm, singular values and
eigenvalues come from ``E x E`` matrices.

The composition score of an earlier head ``a`` into a later head ``b`` is
``||OV_a M_b||_F / (||OV_a||_F ||M_b||_F)`` with ``M_b`` the later head's ``QK`` (Q:
``a`` writes what ``b``'s queries read), ``QK^T`` (K: what its keys read) or ``OV`` (V), as
TransformerLens' ``all_composition_scores``. Random matrices of the same shapes score
above 0 too: :func:`random_baseline` measures their mean, reported beside the scores.

The OV copying score is the share of the OV circuit's eigenvalue mass on eigenvalues of
positive real part, ``sum_{Re l > 0} |l| / sum |l|`` (1: the head writes back the direction
it reads, as a copying head does), taken in the residual stream: a text model's embedding
and unembedding are not folded in (an arbitrary model has neither).

Biases are left out and a LayerNorm before a layer is not folded in (its scale would
multiply ``w_q``, ``w_k`` and ``w_v``): these are the circuits of the layers' own matrices.
Grouped-query attention needs nothing more: a trace gives ``w_k`` and ``w_v`` per query
head (``attrs["kv_heads"]``: how many distinct ones there are).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

COMPOSITIONS = ("Q", "K", "V")
BASELINE_DRAWS = 64  # pairs of random matrices whose mean score is the baseline


@dataclass(frozen=True)
class Factored:
    """The matrix ``left @ right`` (``left`` ``(..., d, r)``, ``right`` ``(..., r, d)``),
    never multiplied out; stacked over leading dims (layers, heads)."""

    left: torch.Tensor
    right: torch.Tensor

    @property
    def T(self) -> Factored:  # noqa: N802 - the transpose, as torch and numpy name it
        return Factored(self.right.mT, self.left.mT)

    def dense(self) -> torch.Tensor:
        """The ``d x d`` product (a check's; no score needs it)."""
        return self.left @ self.right

    def reduced_right(self) -> torch.Tensor:
        """``R right`` (``(..., r, d)``) with ``left = Q R``: the product is ``Q (R right)``
        with orthonormal ``Q``, so this has the product's norm and singular values."""
        return torch.linalg.qr(self.left, mode="r")[1] @ self.right

    def reduced_left(self) -> torch.Tensor:
        """``left R^T`` (``(..., d, r)``) with ``right^T = Q R``: the product is
        ``(left R^T) Q^T``."""
        return self.left @ torch.linalg.qr(self.right.mT, mode="r")[1].mT

    def core(self) -> torch.Tensor:
        """An ``r x r`` matrix with the product's singular values (and norm)."""
        r_left = torch.linalg.qr(self.left, mode="r")[1]
        r_right = torch.linalg.qr(self.right.mT, mode="r")[1]
        return r_left @ r_right.mT

    def norm(self) -> torch.Tensor:
        """The product's Frobenius norm, per leading index."""
        return torch.linalg.matrix_norm(self.core())

    def singular_values(self) -> torch.Tensor:
        """The product's singular values that may be nonzero (``r``), largest first."""
        return torch.linalg.svdvals(self.core())

    def eigenvalues(self) -> torch.Tensor:
        """The product's eigenvalues that may be nonzero: those of ``right @ left``."""
        return torch.linalg.eigvals(self.right @ self.left)


def head_circuits(
    w_q: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor, w_o: torch.Tensor, heads: int
) -> tuple[Factored, Factored]:
    """``(QK, OV)`` of every head, stacked ``(layer, head)``, from each layer's weights as
    ``nn.Linear`` holds them (``w_q, w_k, w_v``: ``(L, H E, d)``; ``w_o``: ``(L, d, H E)``)."""
    per_head = [w.unflatten(1, (heads, -1)) for w in (w_q, w_k, w_v)]  # (L, H, E, d)
    q, k, v = per_head
    o = w_o.unflatten(2, (heads, -1)).permute(0, 2, 3, 1)  # (L, H, E, d): W_o^hT
    return Factored(q.mT, k), Factored(v.mT, o)


def copying_scores(ov: Factored) -> torch.Tensor:
    """Each OV circuit's share of eigenvalue mass of positive real part (``(layer, head)``)."""
    eigenvalues = ov.eigenvalues()
    mass = eigenvalues.abs()
    positive = torch.where(eigenvalues.real > 0, mass, torch.zeros_like(mass))
    return positive.sum(-1) / mass.sum(-1).clamp_min(torch.finfo(mass.dtype).tiny)


def _unit(matrix: torch.Tensor) -> torch.Tensor:
    """``matrix`` over its Frobenius norm (per leading index)."""
    return matrix / torch.linalg.matrix_norm(matrix)[..., None, None]


def pair_scores(ov: Factored, later: Factored) -> torch.Tensor:
    """The composition score of each ``OV`` with the ``M`` at the same leading index."""
    return torch.linalg.matrix_norm(_unit(ov.reduced_right()) @ _unit(later.reduced_left()))


def composition_scores(ov: Factored, later: Factored | list[Factored]) -> torch.Tensor:
    """``||OV_a M_b||_F / (||OV_a||_F ||M_b||_F)`` for every head ``a`` of a layer and head
    ``b`` of a later one, ``(layer, head, later layer, later head)`` (NaN where the later
    layer is not later); for a list of ``M`` (the three modes), stacked first.

    With ``OV_a = Q_a U_a`` (``Q_a`` orthonormal) and ``M_b = V_b Q_b^T``, the score is
    ``||U_a V_b||_F`` of the unit-norm ``U_a`` (``E x d``) and ``V_b`` (``d x E``): one
    matrix product per earlier layer against every later head's ``V_b`` at once."""
    u = _unit(ov.reduced_right())  # (L, H, E, d): one QR, whatever the modes
    many = isinstance(later, list)
    found = [_scores(u, _unit(m.reduced_left())) for m in (later if many else [later])]
    return torch.stack(found) if many else found[0]


def _scores(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``||u_a v_b||_F`` of every head ``a`` and head ``b`` of a later layer."""
    n_layers, n_heads, rank, width = u.shape
    scores = torch.full((n_layers, n_heads, n_layers, n_heads), float("nan"))
    for layer in range(n_layers - 1):
        rows = u[layer].reshape(n_heads * rank, width)
        cols = v[layer + 1 :].permute(2, 0, 1, 3).reshape(width, -1)  # (d, L' H E)
        blocks = (rows @ cols).reshape(n_heads, rank, -1, n_heads, rank)
        scores[layer, :, layer + 1 :] = blocks.square().sum((1, 4)).sqrt()
    return scores


def random_baseline(
    width: int, rank: int, draws: int = BASELINE_DRAWS, seed: int = 0
) -> tuple[float, float]:
    """``(mean, p95)`` of the composition score of random Gaussian factors of the heads'
    shapes (``d x r`` and ``r x d``): what a score must pass to say more than chance."""
    generator = torch.Generator().manual_seed(seed)
    a, b, c, e = (
        torch.randn((draws, *shape), generator=generator)
        for shape in ((width, rank), (rank, width), (width, rank), (rank, width))
    )
    scores = pair_scores(Factored(a, b), Factored(c, e))
    return float(scores.mean()), float(torch.quantile(scores, 0.95))


def later_circuit(qk: Factored, ov: Factored, mode: str) -> Factored:
    """What a later head reads an earlier head's output with, by composition ``mode``: its
    queries (``QK``), its keys (``QK^T``) or its values (``OV``)."""
    return {"Q": qk, "K": qk.T, "V": ov}[mode]

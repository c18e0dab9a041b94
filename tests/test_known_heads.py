"""Models trained here on tasks whose mechanism is known by construction.

Copying back: at position
``i`` it gives the token at ``i - 2`` (the first half of its outputs) and the token at
``i - 4`` (the second half). One attention layer can only do both with heads that look two
steps back and heads that look four steps back. ``head_roles`` must name them so, and exact
and attribution patching between an input and the same input with one token changed must
put a two-back head first for the two-back output and a four-back head first for the other
(trained this way, the 4 heads split 2, 2 + one mixed, 4 steps back).

Induction: two attention-only layers on random sequences said twice; the roles must find
induction heads in the second layer and none in the first, and patching must put a head of
the circuit first (an induction head, or the first layer's most previous-token head)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import attnpanel

VOCAB, LENGTH, WIDTH, HEADS, BACKS = 16, 12, 32, 4, (2, 4)


class CopyBack(nn.Module):
    """Token and position embeddings, one causal softmax attention layer, and an
    unembedding of ``VOCAB`` logits per copy (``BACKS``)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Parameter(0.5 * torch.randn(LENGTH, WIDTH))
        self.qkv, self.out = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.unembed = nn.Linear(WIDTH, VOCAB * len(BACKS))

    def forward(self, ids):
        x = self.embed(ids) + self.position[: ids.shape[1]]
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        later = torch.ones(n, n, dtype=torch.bool, device=ids.device).triu(1)
        scores = (q @ k.transpose(-1, -2)) * (d // HEADS) ** -0.5
        weights = scores.masked_fill(later, float("-inf")).softmax(dim=-1)
        context = (weights @ v).transpose(1, 2).reshape(b, n, d)
        return self.unembed(x + self.out(context))


def copy_loss(logits, ids):
    start = max(BACKS)
    loss = 0.0
    for i, back in enumerate(BACKS):
        given = logits[:, start:, i * VOCAB : (i + 1) * VOCAB]
        wanted = ids[:, start - back : LENGTH - back]
        loss = loss + nn.functional.cross_entropy(given.reshape(-1, VOCAB), wanted.reshape(-1))
    return loss


@pytest.fixture(scope="module")
def trained():
    torch.manual_seed(0)
    model = CopyBack()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(400):
        ids = torch.randint(0, VOCAB, (64, LENGTH))
        loss = copy_loss(model(ids), ids)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    ids = torch.randint(0, VOCAB, (32, LENGTH), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, start = model(ids), max(BACKS)
        for i, back in enumerate(BACKS):
            given = logits[:, start:, i * VOCAB : (i + 1) * VOCAB].argmax(-1)
            accuracy = (given == ids[:, start - back : LENGTH - back]).float().mean()
            assert accuracy > 0.99  # it learned both copies: the mechanism built for
    return model, ids


def test_roles_name_the_heads_that_look_two_and_four_steps_back(trained):
    model, ids = trained
    roles = attnpanel.head_roles(model, ids)
    named = list(roles["role"].values[0])
    for back in BACKS:
        assert f"looks {back} steps back" in named, named
    for head, role in enumerate(named):
        if role.startswith("looks"):
            assert roles["offset"].values[0, head] == int(role.split()[1])
            assert roles["offset_weight"].values[0, head] >= 0.4


@pytest.mark.parametrize("method", ["exact", "attribution"])
@pytest.mark.parametrize("copy", [0, 1])
def test_patching_puts_the_head_of_each_copy_first(trained, method, copy):
    model, ids = trained
    back, changed = BACKS[copy], 5
    corrupted = ids.clone()
    corrupted[:, changed] = (corrupted[:, changed] + 1) % VOCAB
    rows = torch.arange(ids.shape[0])

    def right_token(y):  # the logit of the changed token where this copy gives it
        return y[rows, changed + back, copy * VOCAB + ids[:, changed]].double().sum()

    effect = attnpanel.patching_effect(
        model, ids, corrupted, score=right_token, method=method, progress=False
    )
    roles = attnpanel.head_roles(model, ids)
    first = int(abs(effect.values[0]).argmax())
    assert roles["role"].values[0, first] == f"looks {back} steps back"
    assert effect.values[0, first] > 0.3  # a large share of the difference
    other = f"looks {BACKS[1 - copy]} steps back"  # the other copy's heads carry none of it
    for head in range(HEADS):
        if roles["role"].values[0, head] == other:
            assert abs(effect.values[0, head]) < 0.1


INDUCTION_VOCAB, HALF, INDUCTION_WIDTH = 24, 10, 64


class AttentionOnly(nn.Module):
    """One causal attention layer with its residual (no MLP)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(INDUCTION_WIDTH, 3 * INDUCTION_WIDTH)
        self.out = nn.Linear(INDUCTION_WIDTH, INDUCTION_WIDTH)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        later = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        scores = (q @ k.transpose(-1, -2)) * (d // HEADS) ** -0.5
        weights = scores.masked_fill(later, float("-inf")).softmax(dim=-1)
        return x + self.out((weights @ v).transpose(1, 2).reshape(b, n, d))


class Repeats(nn.Module):
    """Two attention-only layers trained on random sequences said twice: the second half
    is predictable only by an induction circuit (a head that marks each position's previous
    token, then a head that finds the earlier occurrence and copies what followed it)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(INDUCTION_VOCAB, INDUCTION_WIDTH)
        self.position = nn.Parameter(0.3 * torch.randn(2 * HALF, INDUCTION_WIDTH))
        self.layers = nn.ModuleList([AttentionOnly(), AttentionOnly()])
        self.unembed = nn.Linear(INDUCTION_WIDTH, INDUCTION_VOCAB)

    def forward(self, ids):
        x = self.embed(ids) + self.position[: ids.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.unembed(x)


def repeated(batch: int, generator=None) -> torch.Tensor:
    half = torch.randint(0, INDUCTION_VOCAB, (batch, HALF), generator=generator)
    return torch.cat([half, half], dim=1)


@pytest.fixture(scope="module")
def induction():
    """The two-layer model trained to induction, held-out repeated sequences, its roles."""
    torch.manual_seed(0)
    model = Repeats()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(300):
        ids = repeated(64)
        logits = model(ids)[:, HALF:-1]
        loss = nn.functional.cross_entropy(
            logits.reshape(-1, INDUCTION_VOCAB), ids[:, HALF + 1 :].reshape(-1)
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    ids = repeated(32, torch.Generator().manual_seed(1))
    with torch.no_grad():
        accuracy = (model(ids)[:, HALF:-1].argmax(-1) == ids[:, HALF + 1 :]).float().mean()
    assert accuracy > 0.99
    return model, ids, attnpanel.head_roles(model, ids)


@pytest.mark.slow
def test_an_induction_circuit_is_named_and_patching_puts_it_first(induction):
    model, ids, roles = induction
    role = roles["role"].values
    assert "induction" in list(role[1]) and "induction" not in list(role[0])
    assert float(roles["induction"].values[1].max()) >= 0.4
    # one token of the first half changed: the logit of what followed it, where the second
    # half says it again, is the induction circuit's doing
    changed = 3
    corrupted = ids.clone()
    corrupted[:, changed] = (corrupted[:, changed] + 1) % INDUCTION_VOCAB
    rows = torch.arange(ids.shape[0])

    def next_token(y):
        return y[rows, HALF + changed, ids[:, changed + 1]].double().sum()

    circuit = {(1, h) for h in range(HEADS) if role[1, h] == "induction"}
    circuit.add((0, int(roles["previous_token"].values[0].argmax())))  # its first half
    for method in ("exact", "attribution"):
        effect = attnpanel.patching_effect(
            model, ids, corrupted, score=next_token, method=method, progress=False
        )
        layer, head = divmod(int(abs(effect.values).argmax()), HEADS)
        assert (layer, head) in circuit, (method, effect.values.round(3))


@pytest.mark.slow
def test_the_induction_heads_keys_read_the_previous_token_head_first(induction):
    """From the weights alone (``attnpanel.circuits``): each induction head's keys read
    the first layer's previous-token head more than any other head of that layer (K-
    composition), and more than random matrices of the same shapes do."""
    model, ids, roles = induction
    result = attnpanel.circuits(attnpanel.capture(model, ids))
    previous = int(roles["previous_token"].values[0].argmax())
    k = result["composition"].sel(mode="K").values  # (layer, head, later layer, later head)
    induction_heads = [h for h in range(HEADS) if roles["role"].values[1, h] == "induction"]
    assert induction_heads
    for head in induction_heads:
        column = k[0, :, 1, head]  # every first-layer head into this one's keys
        assert int(np.argmax(column)) == previous, column.round(3)
        assert column[previous] > float(result["composition_baseline_p95"].sel(mode="K"))

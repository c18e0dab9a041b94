"""Exact patching's replay (``attnpanel.interventions.replay``): a patched forward takes
the module calls that end before the patched attention from the target run, and gives the
numbers a whole forward gives, bit for bit; where a replay would not (a side effect a later
module reads), the layer runs whole forwards."""

from __future__ import annotations

import threading

import pytest
import torch
import zoo
from torch import nn

import attnpanel
from attnpanel.interventions.effects import PatchedRun
from attnpanel.interventions.patching import HeadPatcher
from attnpanel.interventions.replay import Tape


class Block(nn.Module):
    def __init__(self, width: int = 16, heads: int = 4, in_place: bool = False):
        super().__init__()
        self.attn = nn.Module()
        self.heads, self.in_place = heads, in_place
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        context = torch.softmax(q @ k.transpose(-1, -2) * 0.5, dim=-1) @ v
        x = x + self.out(context.transpose(1, 2).reshape(b, n, d))
        if self.in_place:
            x += self.mlp(x)  # in place on what the block returns next
            return x
        return x + self.mlp(x)


class Counting(nn.Module):
    """Adds how many forwards it has run: a side effect a replay would skip."""

    def __init__(self):
        super().__init__()
        self.runs = 0

    def forward(self, x):
        self.runs += 1
        return x + 0.01 * self.runs


class Model(nn.Module):
    def __init__(self, layers: int = 4, in_place: bool = False, counting: bool = False):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.count = Counting() if counting else nn.Identity()
        self.blocks = nn.ModuleList(Block(in_place=in_place) for _ in range(layers))
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        x = self.embed(x)
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == 1:
                x = self.count(x)
        return self.head(x)


def score(y: torch.Tensor) -> torch.Tensor:
    return y[:, -1, 0].double().sum()


def by_hand(model, clean, corrupted, measure=score) -> torch.Tensor:
    """Each head's effect from whole forwards under ``attnpanel.patch``."""
    with torch.no_grad():
        base = float(measure(model(corrupted)))
        top = float(measure(model(clean)))
        rows = []
        for layer, heads in attnpanel.attention_heads(model, corrupted).items():
            row = []
            for head in range(heads):
                with attnpanel.patch(model, (clean,), heads={layer: [head]}):
                    row.append((float(measure(model(corrupted))) - base) / (top - base))
            rows.append(row)
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize("in_place", [False, True])
def test_replayed_patching_equals_whole_forwards(in_place):
    torch.manual_seed(0)
    model = Model(in_place=in_place).eval()
    clean, corrupted = torch.randn(3, 10, 8), torch.randn(3, 10, 8)
    effect = attnpanel.patching_effect(model, clean, corrupted, score=score, progress=False)
    expected = by_hand(model, clean, corrupted)
    # the same forwards, the earlier calls' outputs copied: equal to rounding of the shares
    torch.testing.assert_close(torch.from_numpy(effect.values), expected, rtol=0, atol=1e-9)


def recorded(model, clean, corrupted):
    patcher = HeadPatcher(model)
    patcher.record(clean)
    run = PatchedRun(patcher, ((corrupted,), {}), score)
    tape = Tape(model)
    with patcher.watching(), tape.recording(patcher):
        run.score({}, None)
    return patcher, run, tape


def test_the_tape_replays_the_calls_before_a_layer_and_skips_them():
    torch.manual_seed(0)
    model = Model().eval()
    clean, corrupted = torch.randn(2, 10, 8), torch.randn(2, 10, 8)
    patcher, run, tape = recorded(model, clean, corrupted)
    target = run.last
    last = "blocks.3"
    # the block runs its own softmax path: from its start on, nothing is replayed
    assert [tape.calls[i].name for i in tape.replayed(last)] == [
        "embed", "blocks.0", "blocks.1", "count", "blocks.2",
    ]  # fmt: skip
    assert 0.6 < tape.share(last) < 0.9 and tape.share("blocks.0") < 0.1
    ran = []
    hook = model.blocks[0].register_forward_pre_hook(lambda m, a: ran.append(1))
    hooks = [hook]
    try:
        with patcher.watching(), tape.replay(last):
            run.score({}, None)
        assert torch.equal(run.last, target)
        assert ran == [1]  # the hook runs, the block's forward does not (replayed)
    finally:
        for hook in hooks:
            hook.remove()
    assert "forward" not in model.blocks[0].__dict__  # the module as it was


def test_a_side_effect_a_later_module_reads_makes_the_layer_run_whole():
    torch.manual_seed(0)
    model = Model(counting=True).eval()
    clean, corrupted = torch.randn(2, 10, 8), torch.randn(2, 10, 8)
    effect = attnpanel.patching_effect(model, clean, corrupted, score=score, progress=False)
    assert effect.sizes == {"layer": 4, "head": 4}
    assert torch.isfinite(torch.from_numpy(effect.values)).all()
    patcher, run, tape = recorded(model, clean, corrupted)
    with patcher.watching(), tape.replay("blocks.3"):
        run.score({}, None)
    with patcher.watching():
        run.score({}, None)
    whole = run.last
    with patcher.watching(), tape.replay("blocks.3"):
        run.score({}, None)
    assert not torch.equal(run.last, whole)  # the replay skips the count: refused by the check


def test_another_threads_forward_during_a_replay_runs_whole():
    torch.manual_seed(0)
    model = Model().eval()
    clean, corrupted, other = (torch.randn(2, 10, 8) for _ in range(3))
    with torch.no_grad():
        expected = model(other)
    patcher, run, tape = recorded(model, clean, corrupted)
    found = {}

    def elsewhere():
        with torch.no_grad():
            found["y"] = model(other)

    with patcher.watching(), tape.replay("blocks.3"):
        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
    assert torch.equal(found["y"], expected)


def test_a_zoo_model_gives_the_same_effects_replayed_as_whole():
    """A Hugging Face model (its layers return tuples; a rotary embedding called once)."""
    model, _, kwargs = zoo.case("llama_gqa_rotary").build()
    ids = kwargs["input_ids"]
    other = ids.clone()
    other[:, 2] = (other[:, 2] + 1) % model.config.vocab_size

    def logit(y):
        return y[:, -1, 3].double().sum()

    effect = attnpanel.patching_effect(model, (ids,), (other,), score=logit, progress=False)
    with torch.no_grad():
        base = float(logit(model(other).last_hidden_state))
        top = float(logit(model(ids).last_hidden_state))
        for layer in effect["layer"].values:
            for head in (0, int(effect.sizes["head"]) - 1):
                with attnpanel.patch(model, (ids,), heads={str(layer): [head]}):
                    got = (float(logit(model(other).last_hidden_state)) - base) / (top - base)
                assert float(effect.sel(layer=layer, head=head)) == pytest.approx(got, abs=1e-9)


def test_two_threads_replaying_one_model_each_get_their_own_and_leave_it_as_it_was():
    """A served page's sessions share the demo model: replays overlap, each thread gets its
    own tape's outputs, and the last one out leaves the modules as they were (the first out
    once took the other's replay away, and the other then put a stale one back for good)."""
    torch.manual_seed(0)
    model = Model().eval()
    a_in, b_in, clean = (torch.randn(2, 10, 8) for _ in range(3))
    tapes = {name: recorded(model, clean, x) for name, x in (("a", a_in), ("b", b_in))}
    found, a_inside, b_done = {}, threading.Event(), threading.Event()

    def replaying(name, entered=None, wait=None):
        patcher, run, tape = tapes[name]
        target = run.last
        with patcher.watching(), tape.replay("blocks.3"):
            if entered is not None:
                entered.set()
            if wait is not None:
                wait.wait(10)
            run.score({}, None)
        found[name] = torch.equal(run.last, target)

    first = threading.Thread(target=replaying, args=("a", a_inside, b_done))
    first.start()
    a_inside.wait(10)
    second = threading.Thread(target=replaying, args=("b",))
    second.start()
    second.join()
    b_done.set()
    first.join()
    assert found == {"a": True, "b": True}
    assert all("forward" not in m.__dict__ for m in model.modules())
    with torch.no_grad():  # and a plain forward afterwards computes
        assert not torch.equal(model(a_in), model(b_in))


class Again(nn.Module):
    """``norm`` runs before the blocks, and once more after them when the state says so: a
    branch the target run does not take, a patched forward may."""

    def __init__(self):
        super().__init__()
        self.embed, self.norm = nn.Linear(8, 16), nn.LayerNorm(16)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head, self.threshold = nn.Linear(16, 2), None

    def body(self, x):
        h = self.norm(self.embed(x))
        for block in self.blocks:
            h = block(h)
        return h

    def forward(self, x):
        h = self.body(x)
        if self.threshold is not None and float(h[..., 0].mean()) > self.threshold:
            h = self.norm(h)
        return self.head(h)


class Filled(nn.Module):
    """A buffer one module returns and the model fills in place after the blocks, where
    the state says: the tape must not replay the buffer as it was left."""

    def __init__(self):
        super().__init__()
        self.embed, self.buffer = nn.Linear(8, 16), nn.Identity()
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        h = self.embed(x)
        out = self.buffer(torch.zeros(x.shape[0], x.shape[1], 16))
        for block in self.blocks:
            h = block(h)
        keep = (h[..., :1] > 0).expand_as(h)
        out[keep] = h[keep]
        return self.head(out)


def whole_score(y: torch.Tensor) -> torch.Tensor:
    return y[..., 0].double().sum()


@pytest.mark.parametrize("kind", ["again", "filled"])
def test_a_second_call_or_a_buffer_filled_later_is_not_replayed(kind):
    """Two holes a second read found (each gave shares 0.07-1.8 off, and passed the check
    with nothing patched): a module the target calls once, called again after the patched
    layer (only its first call is answered from the tape), and an output changed in place
    after it was returned (never replayed)."""
    torch.manual_seed(0)
    model = (Again() if kind == "again" else Filled()).eval()
    clean, corrupted = torch.randn(3, 10, 8), torch.randn(3, 10, 8)
    if kind == "again":
        with torch.no_grad():
            model.threshold = float(model.body(corrupted)[..., 0].mean()) + 1e-3
    effect = attnpanel.patching_effect(model, clean, corrupted, score=whole_score, progress=False)
    expected = by_hand(model, clean, corrupted, whole_score)
    torch.testing.assert_close(torch.from_numpy(effect.values), expected, rtol=0, atol=1e-9)
    if kind == "filled":
        patcher, run, tape = recorded(model, clean, corrupted)
        assert all(tape.calls[i].name != "buffer" for i in tape.replayed("blocks.3"))


def test_a_replay_inside_a_replay_on_one_thread_leaves_every_module_as_it_was():
    torch.manual_seed(0)
    model = Model(counting=True).eval()
    clean, corrupted = torch.randn(2, 10, 8), torch.randn(2, 10, 8)
    patcher, run, tape = recorded(model, clean, corrupted)
    with patcher.watching(), tape.replay("blocks.3"), tape.replay("blocks.1"):
        run.score({}, None)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_the_forwards_count_the_checks_and_name_the_replayed_layers():
    torch.manual_seed(0)
    model = Model().eval()
    clean, corrupted = torch.randn(2, 10, 8), torch.randn(2, 10, 8)
    effect = attnpanel.patching_effect(model, clean, corrupted, score=score, progress=False)
    replayed = effect.attrs["replayed"].split(", ")
    assert replayed == ["blocks.1", "blocks.2", "blocks.3"]  # blocks.0: too little to skip
    assert effect.attrs["forwards"] == 4 * 4 + 2 + len(replayed)

"""What a patched forward need not compute again: the module calls that end before the
patched attention starts.

Exact patching runs the target input once per head. Everything the model computes before
the patched layer's attention begins is the target run's own, bit for bit: the inputs are
the same and nothing has been patched yet. A :class:`Tape` records the target run's module
calls in order with their outputs and, through the watcher, where each layer's attention
starts (the call of the module that runs the whole site). :meth:`Tape.replay` then makes
the calls that ended before that point return their recorded outputs (copies) instead of
running: a head of the last layer of four costs about a quarter of a forward.

Replayed are only the outermost such calls (children of the calls still running when the
attention starts), of modules called once in the forward, whose outputs are tensors,
Python scalars or None in tuples, lists, dicts or Hugging Face outputs (so that a copy is
the whole output) and were not changed in place after they were returned; a replayed
module answers only the first call of each forward from the tape (a later one, in a
branch the target run did not take, runs). Before a layer's heads are patched, its
replayed forward with nothing patched must give the target run's output bit for bit;
where it does not (a module with a side effect a later one reads, a non-deterministic
kernel), that layer's heads run whole forwards. A model whose attention modules run more
than once in a forward (shared layers) is never replayed: skipping an earlier call would
rename the later ones.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch import nn

from attnpanel.watching.watcher import AttentionWatcher, Site

PLAIN_LEAVES = (torch.Tensor, int, float, bool, str, type(None))


@dataclass
class Call:
    """One module call of the recorded forward."""

    name: str
    parent: int | None  # the index of the call running it (None: the model's own)
    start: int  # events before it started
    end: int = -1  # events before it ended
    output: object = None
    versions: tuple | None = None  # its output tensors' versions as it returned them
    children: list[int] = field(default_factory=list)
    site_inside: bool = False  # an attention site started while it ran


@dataclass
class Tape:
    """Every module call of one forward of ``model`` on this thread, in order, and where
    each attention site's layer starts; then :meth:`replay`."""

    model: nn.Module
    calls: list[Call] = field(default_factory=list)
    starts: dict[str, int] = field(default_factory=dict)  # layer: the call its site runs in
    replays: dict[str, list[int]] = field(default_factory=dict)  # layer: the calls replayed

    @contextlib.contextmanager
    def recording(self, watcher: AttentionWatcher) -> Iterator[Tape]:
        """Record the next forward (run inside this block and ``watcher``'s watching)."""
        thread, stack, events = threading.get_ident(), [], [0]
        found: list[tuple[Site, tuple[int, ...]]] = []

        def enter(module, args, name):
            if threading.get_ident() == thread:
                parent = stack[-1] if stack else None
                self.calls.append(Call(name, parent, events[0]))
                if parent is not None:
                    self.calls[parent].children.append(len(self.calls) - 1)
                stack.append(len(self.calls) - 1)
                events[0] += 1

        def leave(module, args, output):
            if threading.get_ident() == thread and stack:
                call = self.calls[stack.pop()]
                call.end, call.output, call.versions = events[0], output, _versions(output)
                events[0] += 1
                if not call.site_inside:  # its calls cannot be replayed: let them go
                    for child in call.children:
                        self.calls[child].output = None

        def site(site):
            for i in stack:
                self.calls[i].site_inside = True
            found.append((site, tuple(stack)))

        handles = []
        for name, module in self.model.named_modules():
            handles.append(module.register_forward_pre_hook(lambda m, a, n=name: enter(m, a, n)))
            handles.append(module.register_forward_hook(leave, always_call=True))
        watcher.site_listener = site
        try:
            yield self
        finally:
            watcher.site_listener = None
            for handle in handles:
                handle.remove()
        self._place(found, watcher)

    def _place(self, found, watcher: AttentionWatcher) -> None:
        for call in self.calls:  # an output changed in place after it was returned: its
            if call.versions is None or _versions(call.output) != call.versions:  # value
                call.output = None  # then is not the one the model went on with
        counts = Counter(call.name for call in self.calls)
        if not any(counts[name] > 1 for name in watcher.attention_modules()):
            # (shared attention modules: an earlier call skipped would rename the later)
            for site, stack in found:
                # the call of the module running the whole site (its final scope)
                own = [i for i in stack if self.calls[i].name == site.scope and site.scope]
                if own and site.layer not in self.starts:
                    self.starts[site.layer] = own[-1]
                    self.replays[site.layer] = self._replayable(own[-1], counts)
        keep = {i for replayed in self.replays.values() for i in replayed}
        for i, call in enumerate(self.calls):
            if i not in keep:
                call.output = None  # only what a replay returns stays held

    def _replayable(self, start: int, counts: Counter) -> list[int]:
        """The calls that end before call ``start`` and run outside it, outermost only."""
        running, at = set(), start
        while at is not None:  # the calls running when it starts
            running.add(at)
            at = self.calls[at].parent
        return [
            i
            for i, call in enumerate(self.calls)
            if call.parent in running
            and call.end < self.calls[start].start
            and call.name
            and counts[call.name] == 1
            and _plain(call.output)
        ]

    def replayed(self, layer: str) -> list[int]:
        """The calls a forward patching ``layer`` takes from the tape."""
        return self.replays.get(layer, [])

    def share(self, layer: str) -> float:
        """About what share of a forward a replay for ``layer`` skips: the replayed calls'
        share of the module calls made (every call inside them included)."""
        if not self.calls:
            return 0.0
        spans = sum(self.calls[i].end - self.calls[i].start + 1 for i in self.replayed(layer))
        return spans / (2 * len(self.calls))

    @contextlib.contextmanager
    def replay(self, layer: str) -> Iterator[None]:
        """Inside this block, this thread's forwards of the model take the calls that end
        before ``layer``'s attention from the tape (copies of their outputs): the first call
        of each such module in a forward; a later one (a branch the target run did not take,
        a score that runs a module again) runs. Another thread's forwards run as they are,
        and may replay their own tapes meanwhile."""
        modules = dict(self.model.named_modules())
        taken = []
        thread = threading.get_ident()

        def new_forward(model, args):  # every replayed module answers its first call again
            if threading.get_ident() == thread:
                for replayed in taken:
                    replayed.rearm()

        handle = self.model.register_forward_pre_hook(new_forward)
        try:
            for i in self.replayed(layer):
                call = self.calls[i]
                taken.append(_Replayed.take(modules[call.name], call.output))
            yield
        finally:
            handle.remove()
            for replayed in reversed(taken):
                replayed.give_back()


class _Replayed:
    """One module's forward, answering each thread that replays it from that thread's tape
    and running as it is for every other: installed by the first replaying thread, taken
    away by the last (threads of a served page replay the same shared model)."""

    lock = threading.Lock()
    installed: dict[int, _Replayed] = {}  # id(module): its replay

    def __init__(self, module: nn.Module):
        self.module = module
        self.own = module.__dict__.get("forward")  # an instance forward already there
        # thread: the outputs it replays (innermost last) and whether this forward's
        # first call was answered
        self.outputs: dict[int, list] = {}
        self.answered: dict[int, bool] = {}

        def forward(*args, **kwargs):
            thread = threading.get_ident()
            found = self.outputs.get(thread)
            if found and not self.answered.get(thread):
                self.answered[thread] = True
                return pytree.tree_map_only(torch.Tensor, torch.Tensor.clone, found[-1])
            run = self.own if self.own is not None else type(module).forward.__get__(module)
            return run(*args, **kwargs)

        self.forward = forward

    @classmethod
    def take(cls, module: nn.Module, output) -> _Replayed:
        with cls.lock:
            replayed = cls.installed.get(id(module))
            if replayed is None:
                replayed = cls.installed[id(module)] = cls(module)
                # (past a module's own __setattr__: a wrapper may hand attributes on)
                object.__setattr__(module, "forward", replayed.forward)
            thread = threading.get_ident()
            replayed.outputs.setdefault(thread, []).append(output)
            replayed.answered[thread] = False
            return replayed

    def rearm(self) -> None:
        """A new forward on this thread: its first call is answered from the tape again."""
        self.answered[threading.get_ident()] = False

    def give_back(self) -> None:
        with self.lock:
            thread = threading.get_ident()
            mine = self.outputs.get(thread)
            if mine:
                mine.pop()
            if not mine:
                self.outputs.pop(thread, None)
                self.answered.pop(thread, None)
            if self.outputs or self.installed.get(id(self.module)) is not self:
                return
            del self.installed[id(self.module)]
            if self.own is None:
                object.__delattr__(self.module, "forward")
            else:
                object.__setattr__(self.module, "forward", self.own)


def _versions(output) -> tuple | None:
    """The version counters of an output's tensors (None where one has none: an inference
    tensor)."""
    try:
        leaves = pytree.tree_leaves(output)
        return tuple(t._version for t in leaves if isinstance(t, torch.Tensor))
    except RuntimeError:
        return None


def _plain(output) -> bool:
    """An output a copy of its tensors reproduces whole."""
    if output is None:
        return False  # not recorded (or kept only where a replay returns it)
    leaves, _ = pytree.tree_flatten(output)
    return all(isinstance(leaf, PLAIN_LEAVES) for leaf in leaves)

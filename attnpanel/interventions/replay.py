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
the whole output). Before a layer's heads are patched, its replayed forward with nothing
patched must give the target run's output bit for bit; where it does not (a module with a
side effect a later one reads, a non-deterministic kernel), that layer's heads run whole
forwards. A model whose attention modules run more than once in a forward (shared layers)
is never replayed: skipping an earlier call would rename the later ones.
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


@dataclass
class Tape:
    """Every module call of one forward of ``model`` on this thread, in order, and where
    each attention site's layer starts; then :meth:`replay`."""

    model: nn.Module
    calls: list[Call] = field(default_factory=list)
    starts: dict[str, int] = field(default_factory=dict)  # layer: the call its site runs in
    usable: dict[str, bool] = field(default_factory=dict)  # layer: its replay was checked

    @contextlib.contextmanager
    def recording(self, watcher: AttentionWatcher) -> Iterator[Tape]:
        """Record the next forward (run inside this block and ``watcher``'s watching)."""
        thread, stack, events = threading.get_ident(), [], [0]
        found: list[tuple[Site, tuple[int, ...]]] = []

        def enter(module, args, name):
            if threading.get_ident() == thread:
                self.calls.append(Call(name, stack[-1] if stack else None, events[0]))
                stack.append(len(self.calls) - 1)
                events[0] += 1

        def leave(module, args, output):
            if threading.get_ident() == thread and stack:
                call = self.calls[stack.pop()]
                call.end, call.output = events[0], output
                events[0] += 1

        handles = []
        for name, module in self.model.named_modules():
            handles.append(module.register_forward_pre_hook(lambda m, a, n=name: enter(m, a, n)))
            handles.append(module.register_forward_hook(leave, always_call=True))
        watcher.site_listener = lambda site: found.append((site, tuple(stack)))
        try:
            yield self
        finally:
            watcher.site_listener = None
            for handle in handles:
                handle.remove()
        self._place(found, watcher)

    def _place(self, found, watcher: AttentionWatcher) -> None:
        counts = Counter(call.name for call in self.calls)
        if any(counts[name] > 1 for name in watcher.attention_modules()):
            return  # shared attention modules: an earlier call skipped renames the later
        for site, stack in found:
            if site.layer in self.starts:
                continue
            # the call of the module running the whole site (its final scope)
            own = [i for i in stack if self.calls[i].name == site.scope and site.scope]
            if own:
                self.starts[site.layer] = own[-1]
        keep = {i for layer in self.starts for i in self._replayed(layer, counts)}
        for i, call in enumerate(self.calls):
            if i not in keep:
                call.output = None  # only what a replay returns stays held

    def _replayed(self, layer: str, counts: Counter | None = None) -> list[int]:
        """The calls a forward patching ``layer`` takes from the tape."""
        counts = counts or Counter(call.name for call in self.calls)
        first = self.calls[self.starts[layer]]
        running = set()
        at = self.starts[layer]
        while at is not None:  # the calls running when the site's call starts
            running.add(at)
            at = self.calls[at].parent
        return [
            i
            for i, call in enumerate(self.calls)
            if call.parent in running
            and call.end < first.start
            and call.name
            and counts[call.name] == 1
            and _plain(call.output)
        ]

    def layers(self) -> list[str]:
        """The layers whose patched forwards can skip part of the model."""
        return [layer for layer in self.starts if self._replayed(layer)]

    def share(self, layer: str) -> float:
        """About what share of a forward a replay for ``layer`` skips: the replayed calls'
        share of the module calls made (every call inside them included)."""
        if layer not in self.starts or not self.calls:
            return 0.0
        spans = sum(self.calls[i].end - self.calls[i].start + 1 for i in self._replayed(layer))
        return spans / (2 * len(self.calls))

    @contextlib.contextmanager
    def replay(self, layer: str) -> Iterator[None]:
        """Inside this block, this thread's forwards of the model take the calls that end
        before ``layer``'s attention from the tape (copies of their outputs); another
        thread's forwards run as they are, and may replay their own tapes meanwhile."""
        modules = dict(self.model.named_modules())
        taken = []
        try:
            for i in self._replayed(layer):
                call = self.calls[i]
                taken.append(_Replayed.take(modules[call.name], call.output))
            yield
        finally:
            for replayed in taken:
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
        self.outputs: dict[int, object] = {}  # thread: the output it replays

        def forward(*args, **kwargs):
            found = self.outputs.get(threading.get_ident(), _RUN)
            if found is _RUN:
                run = self.own if self.own is not None else type(module).forward.__get__(module)
                return run(*args, **kwargs)
            return pytree.tree_map_only(torch.Tensor, torch.Tensor.clone, found)

        self.forward = forward

    @classmethod
    def take(cls, module: nn.Module, output) -> _Replayed:
        with cls.lock:
            replayed = cls.installed.get(id(module))
            if replayed is None:
                replayed = cls.installed[id(module)] = cls(module)
                # (past a module's own __setattr__: a wrapper may hand attributes on)
                object.__setattr__(module, "forward", replayed.forward)
            replayed.outputs[threading.get_ident()] = output
            return replayed

    def give_back(self) -> None:
        with self.lock:
            self.outputs.pop(threading.get_ident(), None)
            if self.outputs:
                return
            del self.installed[id(self.module)]
            if self.own is None:
                object.__delattr__(self.module, "forward")
            else:
                object.__setattr__(self.module, "forward", self.own)


_RUN = object()  # no replay for this thread: the module runs


def _plain(output) -> bool:
    """An output a copy of its tensors reproduces whole."""
    if output is None:
        return False  # not recorded (or kept only where a replay returns it)
    leaves, _ = pytree.tree_flatten(output)
    return all(isinstance(leaf, PLAIN_LEAVES) for leaf in leaves)

"""Which module runs each attention call, and the layer name that call gets.

:class:`ModuleStack` hooks every module of a model while it is open and keeps the running
modules in order, for this thread only (a torch mode sees only its own thread: another
thread's forward of the same model is neither watched nor named). :meth:`ModuleStack.name_call`
is the one rule every reader and writer of a head names layers by: the innermost module
running the call (the model's class name for the model itself), by its :func:`own_name`,
then ``name[1]``, ``name[2]`` ... for its later calls in one forward.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

WRAPPED = "_original_component"  # TransformerLens 4: what a bridge component wraps


def own_name(name: str) -> str:
    """A module's name as its model's users write it. TransformerLens 4 wraps each
    component of its native model in a bridge and keeps the wrapped module as the bridge's
    ``_original_component``: the attention TL calls ``blocks.0.attn`` (its hooks
    ``blocks.0.attn.hook_z``) runs as ``blocks.0._original_component.attn.
    _original_component``, and takes its bridge's name. Other names are as they are."""
    if WRAPPED not in name:
        return name
    return ".".join(part for part in name.split(".") if part != WRAPPED)


# torch's own modules that never make an attention call themselves (their exact types: a
# subclass may): a forward whose hooks only name layers needs none on them
PLAIN_MODULES = tuple(
    kind
    for kind in (
        nn.Linear, nn.LayerNorm, nn.Embedding, nn.Dropout, nn.Identity, nn.GELU, nn.ReLU,
        nn.SiLU, nn.Tanh, nn.Conv1d, nn.Conv2d, nn.BatchNorm1d, nn.BatchNorm2d, nn.GroupNorm,
        getattr(nn, "RMSNorm", None),
    )
    if kind is not None
)  # fmt: skip


def never_attends(module: nn.Module) -> bool:
    """Whether ``module`` runs no attention call of its own: one of :data:`PLAIN_MODULES`,
    or a TransformerLens hook point (an identity) with no hook of its own."""
    if type(module) in PLAIN_MODULES:
        return True
    return (
        type(module).__name__ == "HookPoint"
        and not module._forward_hooks
        and not module._forward_pre_hooks
    )


def module_names(model: nn.Module) -> set[str]:
    """Every name a layer of ``model`` may have: its modules' names and their own names."""
    names = {name for name, _ in model.named_modules() if name}
    return names | {own_name(name) for name in names}


@dataclass
class Running:
    """A module in the middle of its forward."""

    name: str
    module: nn.Module
    args: tuple
    kwargs: dict
    scoped: bool = False  # the stack's mode was entered with it

    @property
    def batch(self) -> int | None:
        """The batch of the module's first tensor input of two or more dims."""
        first = next(
            (a for a in (*self.args, *self.kwargs.values()) if isinstance(a, torch.Tensor)), None
        )
        return int(first.shape[0]) if first is not None and first.dim() >= 2 else None


class ModuleStack:
    """The modules of ``model`` running now, innermost last, while ``with stack:`` is open.

    Parameters
    ----------
    model : torch.nn.Module
    on_enter, on_leave : callable, optional
        ``on_enter(running)`` after a module is pushed; ``on_leave(running, output)`` after
        it is popped: for what a reader learns of a module (its output, its consumer).
    only : set of str, optional
        Hook only these modules (and the model).
    scope, mode : set of str and a TorchFunctionMode, optional
        Enter ``mode`` while any of the ``scope`` modules runs, and only then: the torch
        calls of the rest of the model then run as plainly as without a mode.
    skip : callable, optional
        ``skip(module)``: leave that module unhooked (such as :func:`never_attends`).
    """

    def __init__(
        self,
        model: nn.Module,
        on_enter: Callable[[Running], None] | None = None,
        on_leave: Callable[[Running, object], None] | None = None,
        only: set[str] | None = None,
        on_restart: Callable[[], None] | None = None,
        scope: set[str] | None = None,
        mode=None,
        skip: Callable[[nn.Module], bool] | None = None,
    ):
        self.model = model
        # hook only these modules (and the model): those an earlier forward ran attention
        # in. The innermost running module at a site is the same, so are the layer names;
        # a forward with hooks on a few modules costs far less than on every one
        self.only = only
        self.root = type(model).__name__
        self.running: list[Running] = []
        self._counts: dict[str, int] = {}
        self._on_enter, self._on_leave, self._on_restart = on_enter, on_leave, on_restart
        self._handles: list = []
        self.scope, self._mode, self._depth = scope or set(), mode, 0
        self._skip = skip  # modules not to hook (they never run attention themselves)

    @property
    def innermost(self) -> Running | None:
        return self.running[-1] if self.running else None

    @property
    def module(self) -> str:
        """The innermost running module's name ("" outside any, or for the model itself)."""
        return self.running[-1].name if self.running else ""

    def name_call(self) -> str:
        """The layer name of an attention call that starts now."""
        base = own_name(self.module) or self.root
        count = self._counts.get(base, 0)
        self._counts[base] = count + 1
        return base if count == 0 else f"{base}[{count}]"

    def restart(self) -> None:
        """Count layer names from 0 again (a new forward)."""
        self._counts.clear()
        if self._on_restart is not None:
            self._on_restart()

    def __enter__(self) -> ModuleStack:
        thread = threading.get_ident()
        self.restart()
        for name, module in self.model.named_modules():
            if self.only is not None and name and name not in self.only:
                continue
            if self._skip is not None and name and self._skip(module):
                continue

            # (*rest: kwargs, then the output. Another thread's forward may call a hook
            # while this one registers it, before torch has noted that it takes kwargs:
            # it then comes without them, and returns at once)
            def enter(module, args, *rest, name=name):
                if threading.get_ident() != thread:
                    return  # another thread's forward of the same model: not watched
                kwargs = rest[0]
                if not self.running:
                    self.restart()  # a new forward: layer names count from 0 again
                entry = Running(name, module, args, kwargs, scoped=name in self.scope)
                self.running.append(entry)
                if entry.scoped:
                    self._depth += 1
                    if self._depth == 1:
                        self._mode.__enter__()
                if self._on_enter is not None:
                    self._on_enter(entry)

            def leave(module, args, *rest):
                if threading.get_ident() != thread:
                    return
                output = rest[-1]
                while self.running:
                    entry = self.running.pop()
                    self._unscope(entry)
                    if entry.module is module:
                        if self._on_leave is not None:
                            self._on_leave(entry, output)
                        break

            self._handles.append(module.register_forward_pre_hook(enter, with_kwargs=True))
            self._handles.append(
                module.register_forward_hook(leave, with_kwargs=True, always_call=True)
            )
        return self

    def _unscope(self, entry: Running) -> None:
        if entry.scoped:
            entry.scoped = False
            self._depth -= 1
            if self._depth == 0:
                self._mode.__exit__(None, None, None)

    def __exit__(self, *exc) -> bool:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        while self.running:  # a forward left by an error its hooks never saw
            self._unscope(self.running.pop())
        return False

"""A model of one's own: its factory named as ``panel serve app.py`` names an app, and its
checkpoint read safely.

``FILE.py:FUNCTION`` or ``package.module:FUNCTION`` names a function of the user's own code
that returns the model (the user's code runs, as it does when they run it themselves);
:func:`load_checkpoint` reads a state dict, or a dict holding one under
``model_state_dict``, ``state_dict`` or ``model`` (a trainer's ``torch.save`` of its whole
state, optimizer and numpy arrays beside), with ``torch.load(weights_only=True)`` and only
numpy's array types allowed through torch's safe globals. Nothing else in the file is
unpickled.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

STATE_KEYS = ("model_state_dict", "state_dict", "model")


class ModelError(ValueError):
    """A model or checkpoint that cannot be had: the message, one line, says why."""


def _one_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def load_factory(spec: str):
    """The function ``spec`` names: ``path/to/file.py:name`` or ``package.module:name``."""
    where, _, name = spec.rpartition(":")
    if not where or not name.isidentifier():
        raise ModelError(f"--model {spec}: give FILE.py:FUNCTION or package.module:FUNCTION")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ModelError(f"--model {spec}: no file {path}")
        module_name = "attnpanel_user_" + re.sub(r"\W", "_", path.stem)
        found = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(found)
        sys.modules[module_name] = module  # dataclasses and pickling look a module up by name
        folder = str(path.resolve().parent)
        if folder not in sys.path:  # its own imports of files beside it, as `python FILE.py`
            sys.path.append(folder)
        try:
            found.loader.exec_module(module)
        except Exception as error:  # the user's code: its own message, one line
            sys.modules.pop(module_name, None)
            raise ModelError(f"--model {spec}: {path} raised {type(error).__name__}: "
                             f"{_one_line(error)}") from error  # fmt: skip
    else:
        try:
            module = importlib.import_module(where)
        except Exception as error:
            raise ModelError(
                f"--model {spec}: cannot import {where}: {_one_line(error)}"
            ) from error
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ModelError(f"--model {spec}: {where} has no function {name}")
    return factory


def make_model(spec: str) -> nn.Module:
    """The model the factory ``spec`` returns, in eval mode."""
    factory = load_factory(spec)
    try:
        model = factory()
    except Exception as error:
        raise ModelError(
            f"--model {spec}: the factory raised {type(error).__name__}: {_one_line(error)}"
        ) from error
    if not isinstance(model, nn.Module):
        raise ModelError(f"--model {spec} returned a {type(model).__name__}, not a torch module")
    return model.eval()


def _safe_globals() -> list:
    """numpy's array types, which trainers save beside the weights (losses, metrics)."""
    try:
        from numpy._core.multiarray import _reconstruct, scalar
    except ImportError:  # numpy 1.x
        from numpy.core.multiarray import _reconstruct, scalar
    found = [np.ndarray, np.dtype, _reconstruct, scalar]
    found += [type(np.dtype(t)) for t in ("float64", "float32", "float16", "int64", "int32",
                                           "int8", "uint8", "bool")]  # fmt: skip
    return found


def load_weights_only(path: str | Path, numpy: bool = True):
    """What a ``torch.save`` file holds, read with ``weights_only=True`` (and numpy's arrays
    allowed where ``numpy``); a file that needs any other global is refused naming it."""
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"no checkpoint at {path}")
    try:
        with torch.serialization.safe_globals(_safe_globals() if numpy else []):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        unsafe = re.search(r"GLOBAL ([\w.]+)", str(error))
        if unsafe:
            raise ModelError(
                f"{path} holds {unsafe.group(1)}, which a checkpoint is not allowed to load "
                "(weights, numbers and numpy arrays only)"
            ) from None
        raise ModelError(f"cannot read {path} as a torch checkpoint: {_one_line(error)}") from None


def read_state(path: str | Path) -> dict:
    """The state dict in a checkpoint file (module docstring)."""
    found = load_weights_only(path)
    if isinstance(found, dict) and not all(torch.is_tensor(v) for v in found.values()):
        for key in STATE_KEYS:
            if isinstance(found.get(key), dict):
                found = found[key]
                break
        else:
            raise ModelError(
                f"{path} holds a dict without a state dict (no {', '.join(STATE_KEYS)} key); "
                f"its keys: {', '.join(map(str, list(found)[:8]))}"
            )
    if not isinstance(found, dict) or not all(torch.is_tensor(v) for v in found.values()):
        raise ModelError(f"{path} holds a {type(found).__name__}, not a state dict")
    return found


def load_checkpoint(model: nn.Module, path: str | Path) -> nn.Module:
    """``model`` with the weights of the checkpoint at ``path``; keys that do not fit are
    named (missing and unexpected) and the model is left as it was."""
    state = read_state(path)
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {_some(missing)}")
        if unexpected:
            parts.append(f"unexpected {_some(unexpected)}")
        raise ModelError(f"{path} does not fit {type(model).__name__}: {'; '.join(parts)}")
    shapes = [k for k in own if tuple(own[k].shape) != tuple(state[k].shape)]
    if shapes:
        key = shapes[0]
        raise ModelError(
            f"{path} does not fit {type(model).__name__}: {key} is {tuple(state[key].shape)} "
            f"in the checkpoint, {tuple(own[key].shape)} in the model"
            + (f" ({len(shapes) - 1} more)" if len(shapes) > 1 else "")
        )
    model.load_state_dict(state)
    return model.eval()


def _some(keys: list[str], count: int = 4) -> str:
    shown = ", ".join(keys[:count])
    return shown + (f" and {len(keys) - count} more" if len(keys) > count else "")

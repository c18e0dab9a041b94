"""How much memory attention tensors may take, and a clear refusal where they would not fit."""

from __future__ import annotations

import os

import numpy as np
import torch

MAX_ATTENTION_BYTES: int | None = None  # None: the memory available when a layer runs
MEMORY_SHARE = 0.8  # share of the available memory that attention tensors may take


def _gib(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:.3g} GiB"


def available_memory(device=None) -> int:
    """Bytes that new tensors on ``device`` may take now.

    Parameters
    ----------
    device : torch.device, optional
        CPU by default; for CUDA, the free memory of that GPU.

    Returns
    -------
    int
        :data:`MAX_ATTENTION_BYTES` when set, otherwise :data:`MEMORY_SHARE` of the memory
        the operating system (or CUDA) reports as available.
    """
    if MAX_ATTENTION_BYTES is not None:
        return int(MAX_ATTENTION_BYTES)
    device = torch.device(device or "cpu")
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0] * MEMORY_SHARE)
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(int(line.split()[1]) * 1024 * MEMORY_SHARE)
    except OSError:
        pass
    return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * MEMORY_SHARE)


def check_attention_size(shape, dtype=torch.float32, count: int = 1, device=None) -> None:
    """Raise before allocating ``count`` attention tensors that would not fit in memory.

    Parameters
    ----------
    shape : tuple of int
        ``(B, H, L, S)`` (leading dims may be dropped).
    dtype : torch.dtype
        Element type of the tensors.
    count : int
        How many such tensors are kept at once.
    device : torch.device, optional
        Where they would live.

    Raises
    ------
    ValueError
        Naming the shape, the bytes needed and the bytes available.
    """
    elements = int(np.prod([int(n) for n in shape], dtype=object))
    needed = elements * torch.empty((), dtype=dtype).element_size() * count
    budget = available_memory(device)
    if needed > budget:
        raise ValueError(
            f"attention of shape {tuple(int(n) for n in shape)} needs {count} x "
            f"{_gib(needed / count)} = {_gib(needed)} but only {_gib(budget)} may be used; "
            "the sequence is too long for full attention: trace fewer samples or heads, "
            "or a shorter window"
        )

"""How every head behaves over a whole dataset: a survey keeps statistics, never weights.

:func:`survey` runs a model over an iterable of inputs and keeps, per ``(sample, layer,
head)``, the statistics of :mod:`attnpanel.kernels.statistics`, computed from the weights
each batch's attention recorder saw (the model's own, or recomputed exactly where a fused
kernel never formed them), then dropped: memory holds one batch. With a ``store``, each
batch is appended to a zarr store as it is done, and the store says how many samples it
holds; an interrupted survey (Ctrl-C, a crash) resumes where it stopped, and a reader
never sees a half-written batch. With a ``scheduler``, the batches run on dask.distributed
workers (the model shipped to each once) and the client writes their statistics in order.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import xarray as xr
from torch import nn

from attnpanel.capturing.capture import capture, record_calls
from attnpanel.capturing.recorder import AttentionRecorder, spread_rows, tolerance
from attnpanel.kernels.roles import ROLE_NAMES, RoleInputs
from attnpanel.kernels.statistics import NAMES, head_statistics_of, head_statistics_of_scores
from attnpanel.surveys.store import FORMAT, VERSION, SurveyStore, SurveyStoreError
from attnpanel.traces import screening
from attnpanel.traces.positions import Layout

IN_FLIGHT = 2  # batches queued per worker on a cluster


def model_fingerprint(model: nn.Module) -> str:
    """A hash of the model's state: parameter and buffer names, shapes, dtypes and bytes."""
    digest = hashlib.sha256(type(model).__name__.encode())
    for name, tensor in model.state_dict().items():
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(
            tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        )
    return digest.hexdigest()[:20]


def split_batch(batch) -> tuple[tuple, dict]:
    """A batch as the model's ``(args, kwargs)``: a tensor is one input, a tuple or list
    the positional inputs, a mapping the keyword inputs."""
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    if isinstance(batch, dict):
        return (), dict(batch)
    if isinstance(batch, tuple | list):
        return tuple(batch), {}
    raise TypeError(
        f"a batch is a tensor, a tuple of inputs or a dict of keyword inputs, not "
        f"{type(batch).__name__} (give prepare= to turn yours into (args, kwargs))"
    )


def batch_size(args: tuple, kwargs: dict) -> int:
    """The samples in one batch of inputs: the first dimension of its first tensor (1
    where no input is a batched tensor)."""
    sizes = (t.shape[0] for t in (*args, *kwargs.values()) if torch.is_tensor(t) and t.dim())
    return int(next(sizes, 1))


def token_ids(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """A batch's token ids ``(B, L)``: its ``input_ids``, or its first positional input
    where that is an integer tensor of two dims; None for continuous inputs."""
    ids = kwargs.get("input_ids")
    if ids is None and args and isinstance(args[0], torch.Tensor):
        ids = args[0]
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.dim() != 2:
        return None
    return ids


def _cut(value, batch: int):
    if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == batch:
        return value[:1]
    return value


@dataclass
class Surveyor:
    """What every batch needs: the model, its layers and their output projections."""

    model: nn.Module
    layers: list[str]
    heads: dict[str, int]
    w_o: dict[str, torch.Tensor]  # (D_out, H * E) by layer, where capture found it
    roles: RoleInputs | None = None  # the role statistics' settings (None: none kept)
    tokens: torch.Tensor | None = None  # (B, L) the batch's token ids, while it runs
    given_tokens: torch.Tensor | None = None  # ids given beside the inputs (one batch)
    layout: Layout | None = None  # named tokens before or after the steps, if any

    @classmethod
    def of(cls, model: nn.Module, args: tuple, kwargs: dict) -> Surveyor:
        """Learn the layers and ``w_o`` from a capture of the first sample of a batch."""
        first = next(t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor))
        size = int(first.shape[0])
        one = capture(
            model,
            *(_cut(a, size) for a in args),
            **{k: _cut(v, size) for k, v in kwargs.items()},
        )
        if isinstance(one, xr.DataTree):
            raise ValueError(
                "a survey keeps the self-attention of one sequence; this model's capture is "
                "an encoder-decoder DataTree"
            )
        names = [str(n) for n in np.atleast_1d(one["layer"].values)]
        layers = [one.isel(layer=i) for i in range(len(names))] if "layer" in one.dims else [one]
        w_o = {
            name: torch.from_numpy(np.asarray(layer["w_o"].values, dtype=np.float64))
            for name, layer in zip(names, layers, strict=True)
            if "w_o" in layer
        }
        heads = {name: int(one.sizes["head"]) for name in names}
        return cls(model, names, heads, w_o)

    def statistics(self, args: tuple, kwargs: dict) -> dict[str, np.ndarray]:
        """Each statistic of one batch, ``(batch, layer, head)`` float64."""
        self.tokens = token_ids(args, kwargs) if self.given_tokens is None else self.given_tokens
        recorder = _Summarising(self)
        recorder, names = record_calls(self.model, args, kwargs, dense=True, recorder=recorder)
        recorder.finish()
        if names != self.layers:
            raise ValueError(f"this batch ran layers {names}, the survey's are {self.layers}")
        batch = batch_size(args, kwargs)
        heads = max(self.heads.values())
        names = list(dict.fromkeys(n for stats in recorder.summaries for n in stats))
        found = {}
        for stat in names:  # NaN where a layer lacks it (no values) or has fewer heads
            table = np.full((batch, len(self.layers), heads), np.nan)
            for index, stats in enumerate(recorder.summaries):
                if stat in stats:
                    values = stats[stat].cpu().numpy()
                    table[:, index, : values.shape[1]] = values
            found[stat] = table
        return found

    def summary(self, index: int, call) -> dict[str, torch.Tensor]:
        """The statistics of one recorded call (the ``index``-th layer), ``(B, H)``: from
        its weights, or, where it deferred them (SDPA), from its q, k and mask block by
        block, checked against the model's own output."""
        name = self.layers[index] if index < len(self.layers) else ""
        if call.q.dim() != 4:
            raise ValueError(
                f"layer {name!r}: a survey reads attention as (batch, head, query, dim); this "
                f"one runs with q of shape {tuple(call.q.shape)} (heads folded into the batch): "
                "capture it instead"
            )
        norms = self._norms(name, call)
        roles = self._roles(call)
        named = self._named(call)
        if call.weights is None:
            found, error = head_statistics_of_scores(
                call.q,
                call.k,
                call.scale,
                call.blocked,
                call.bias,
                norms,
                call.v,
                call.context,
                checked=spread_rows(
                    call.q.shape[-2], device=call.q.device
                ),  # as capture checks a long call
                roles=roles,
                named=named,
            )
            allowed = tolerance(call.dtype) * max(1.0, float(call.v.abs().max()))
            if not error <= allowed:
                raise ValueError(
                    f"layer {name!r}: its q, k and mask do not reproduce the output of its "
                    f"scaled_dot_product_attention call (max error {error:.3g})"
                )
            return found
        batch, heads = call.q.shape[:2]
        weights = call.weights.reshape(batch, heads, *call.weights.shape[-2:])
        padding = None
        if call.blocked is not None:
            blocked = call.blocked.expand(batch, heads, *weights.shape[-2:])
            padding = blocked.all(dim=1).all(dim=1)  # (B, S): keys no query may see
        return head_statistics_of(weights, padding, norms, roles, named)

    def _named(self, call) -> torch.Tensor | None:
        """``(S,)`` True at the layout's named tokens, in a self-attention over the input's
        positions (None without any)."""
        length, keys = call.q.shape[-2], call.k.shape[-2]
        names = None if self.layout is None or length != keys else self.layout.names(length)
        return None if names is None else torch.from_numpy(names != "")

    def _roles(self, call) -> RoleInputs | None:
        """The role settings with this batch's tokens where they label this call's queries
        and keys (a self-attention over the input's own positions)."""
        if self.roles is None:
            return None
        tokens = self.tokens
        length, keys = call.q.shape[-2], call.k.shape[-2]
        if tokens is not None and (tokens.shape[-1] != length or length != keys):
            if self.given_tokens is not None:
                raise ValueError(
                    f"tokens are {tuple(tokens.shape)} labels, but this attention has "
                    f"{call.q.shape[0]} x {length} queries and {keys} keys"
                )
            tokens = None
        return replace(self.roles, tokens=tokens)

    def _norms(self, name: str, call) -> torch.Tensor | None:
        """``|| v_j W_o^h ||`` as ``sqrt(v_j G_h v_j)``, ``G_h = W_o^hT W_o^h`` (``E x E``:
        no ``(B, H, S, D)`` product), or ``|| v_j ||`` where ``w_o`` is unknown."""
        if call.v is None:
            return None
        v = call.v.to(torch.float64)  # (B, H, S, E)
        if name not in self.w_o:
            return torch.linalg.vector_norm(v, dim=-1)
        return torch.einsum("bhje,bhje->bhj", v @ self._gram(name, v), v).clamp_min(0).sqrt()

    def _gram(self, name: str, v: torch.Tensor) -> torch.Tensor:
        heads, width = v.shape[1], v.shape[3]
        blocks = self.w_o[name].to(v.device).reshape(-1, heads, width).transpose(0, 1)  # (H, D, E)
        return (blocks.transpose(1, 2) @ blocks)[None]  # (1, H, E, E)


class _Summarising(AttentionRecorder):
    """A recorder that summarises each attention call as soon as it is whole and drops its
    weights: at once where the call brings its values (SDPA, ``nn.MultiheadAttention``),
    else once the next call starts (its ``weights @ v`` is done by then). A batch holds the
    weights of one layer, two at most, never of every layer."""

    defers_weights = True  # SDPA's weights: recomputed here, block by block

    def __init__(self, surveyor: Surveyor):
        super().__init__(dense=True)
        self.surveyor = surveyor
        self.summaries: list[dict[str, torch.Tensor]] = []

    def record_call(self, call, site) -> None:
        self._summarise(len(self.calls))  # every earlier call is whole now
        super().record_call(call, site)
        if call.v is not None:
            self._summarise(len(self.calls))

    def _summarise(self, upto: int) -> None:
        while len(self.summaries) < upto:
            index = len(self.summaries)
            call = self.calls[index]
            readable = call.weights is not None or call.context is not None  # or deferred
            if call.unsupported or call.virtual is not None or not readable:
                self.summaries.append({})  # record_calls says why
                continue
            self.summaries.append(self.surveyor.summary(index, call))
            call.weights = None
            call.v = None

    def finish(self) -> None:
        """Summarise the last call."""
        self._summarise(len(self.calls))


def _statistics(surveyor: Surveyor, batch, prepare) -> dict[str, np.ndarray]:
    args, kwargs = prepare(batch)
    return surveyor.statistics(args, kwargs)


def _part(stats: dict[str, np.ndarray], start: int, surveyor: Surveyor, step) -> xr.Dataset:
    count = next(iter(stats.values())).shape[0]
    heads = max(surveyor.heads.values())
    data = {}
    for name, values in stats.items():
        data[name] = (("sample", "layer", "head"), values)
    if step is not None:
        for prefix in ("", "vw_"):
            if prefix + "distance" in stats:
                data[prefix + "distance_time"] = (
                    ("sample", "layer", "head"),
                    stats[prefix + "distance"] * float(step),
                )
    return xr.Dataset(
        data,
        coords={
            "sample": np.arange(start, start + count),
            "layer": np.array(surveyor.layers, dtype=object),  # zarr v3: variable-length strings
            "head": np.arange(heads),
        },
    )


def survey(
    model: nn.Module,
    batches: Iterable,
    *,
    scheduler=None,
    store: str | Path | None = None,
    prepare: Callable | None = None,
    step: float | None = None,
    layout: Layout | None = None,
    progress: bool = True,
    roles: bool = True,
    exclude_bos: bool = False,
    exclude_current_token: bool = False,
) -> xr.Dataset:
    """Statistics of every head of ``model`` over every sample of ``batches``.

    Parameters
    ----------
    model : torch.nn.Module
        Any model :func:`attnpanel.capture` can trace (one sequence's self-attention).
    batches : iterable
        Its inputs, batch by batch: tensors, tuples of positional inputs, dicts of keyword
        inputs, or a ``DataLoader`` of those.
    scheduler : dask.distributed.Client, str or "local", optional
        Run the batches on a dask cluster: a client, a scheduler's address, or
        ``"local"`` for a ``LocalCluster`` of this machine. In-process by default.
    store : str or Path, optional
        A zarr store written batch by batch; where it holds part of this survey (the same
        model), the survey resumes after its last whole batch.
    prepare : callable, optional
        ``prepare(batch) -> (args, kwargs)``, such as ``lambda b: ((b[0],), {})`` for a
        loader of ``(x, y)`` pairs.
    step : float, optional
        Seconds between two positions: adds ``distance_time`` (seconds).
    layout : attnpanel.Layout, optional
        Named tokens before or after the steps (NILMFormer's statistics token): their
        queries are left out, their weight adds no distance and is kept as
        ``token_share`` (:mod:`attnpanel.kernels.statistics`).
    progress : bool
        A progress bar (tqdm) over the batches.
    roles : bool
        Keep the role statistics of :mod:`attnpanel.kernels.roles` too (TransformerLens'
        previous-token, duplicate-token and induction scores, the offset a head looks at
        and its weight), read by :func:`attnpanel.head_roles`. Token roles need token ids
        (``input_ids``, or an integer first input): NaN otherwise.
    exclude_bos, exclude_current_token : bool
        TransformerLens' exclusions for those scores.

    Returns
    -------
    xarray.Dataset
        ``(sample, layer, head)`` float64 variables: :data:`NAMES` of
        :mod:`attnpanel.kernels.statistics`, their ``vw_`` forms where the values are
        known, and the role statistics; read back from the store where one is given.

    Raises
    ------
    SurveyStoreError
        A store of another model, format or version.
    """
    prepare = prepare or split_batch
    target = None if store is None else SurveyStore(Path(store))
    model_name, print_ = type(model).__name__, model_fingerprint(model)
    attrs = None if target is None else target.attrs()
    done = 0
    if attrs is not None:
        target.check(attrs, model_name, print_)
        screening.refuse_unsafe_storage(target.path, "zarr")  # before anything is changed
        done = int(attrs.get("samples_done", 0))
        target.trim(done)
    iterator = iter(batches)
    first, skip = _after(iterator, prepare, done, target)
    if first is None:
        return target.read() if target is not None else xr.Dataset()
    iterator = itertools.chain([first], iterator)
    with torch.no_grad():
        surveyor = Surveyor.of(model, *prepare(first))
    if roles:
        surveyor.roles = RoleInputs(None, exclude_bos, exclude_current_token)
    surveyor.layout = layout
    named = () if layout is None else layout.before + layout.after
    header = {
        "format": FORMAT,
        "version": VERSION,
        "model": model_name,
        "fingerprint": print_,
        "statistics": list(NAMES)
        + (["token_share"] if named else [])
        + (list(ROLE_NAMES) if roles else []),
        **({} if step is None else {"step": float(step)}),
        **({"named_tokens": list(named)} if named else {}),
        "exclude_bos": int(exclude_bos),
        "exclude_current_token": int(exclude_current_token),
    }
    if roles and token_ids(*prepare(first)) is None:
        header["token_roles"] = (
            "duplicate_token and induction are NaN: the inputs carry no token ids "
            "(continuous inputs)"
        )
    parts: list[xr.Dataset] = []
    total = _length(batches)
    bar = _bar(total, skip, progress)
    batch_index = skip
    for stats in _computed(surveyor, iterator, prepare, scheduler):
        part = _part(stats, done, surveyor, step).assign_attrs(header)
        if target is not None:
            first_write = attrs is None and batch_index == skip
            target.append(part, first=first_write, before=(done, batch_index))
        else:
            parts.append(part)
        done += part.sizes["sample"]
        batch_index += 1
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    if target is not None:
        return target.read()
    return xr.concat(parts, dim="sample").assign_attrs(header)


def _after(iterator, prepare, done: int, target) -> tuple[object | None, int]:
    """The first batch past the ``done`` samples a store holds, and how many batches came
    before it; refused where ``done`` falls inside a batch (other batches than the
    survey's)."""
    seen, skipped = 0, 0
    for batch in iterator:
        if seen >= done:
            return batch, skipped
        size = batch_size(*prepare(batch))
        seen += size
        skipped += 1
        if seen > done:
            raise SurveyStoreError(
                f"{target.path} holds {done} whole samples, but these inputs' batches end at "
                f"{seen - size} and {seen}: give the batches (batch size and order) the "
                "survey began with"
            )
    return None, skipped


def _length(batches) -> int | None:
    try:
        return len(batches)
    except TypeError:
        return None


def _bar(total, skip: int, progress: bool):
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=skip, desc="surveying", unit="batch")


def _computed(surveyor: Surveyor, iterator, prepare, scheduler):
    """Each batch's statistics, in order: here, or on a dask cluster."""
    if scheduler is None:
        for batch in iterator:
            yield _statistics(surveyor, batch, prepare)
        return
    from dask.distributed import Client, LocalCluster

    owned = []
    if scheduler == "local":
        cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True)
        owned = [cluster]
        client = Client(cluster)
        owned.insert(0, client)
    elif isinstance(scheduler, str):
        client = Client(scheduler)
        owned = [client]
    else:
        client = scheduler
    try:
        yield from _on_cluster(client, surveyor, iterator, prepare)
    finally:
        for thing in owned:
            thing.close()


def _on_cluster(client, surveyor: Surveyor, iterator, prepare):
    [shipped] = client.scatter([surveyor], broadcast=True)
    limit = IN_FLIGHT * max(1, len(client.scheduler_info().get("workers", {})))
    pending = []
    for batch in iterator:
        pending.append(client.submit(_statistics, shipped, batch, prepare, pure=False))
        if len(pending) >= limit:
            yield pending.pop(0).result()
    for future in pending:
        yield future.result()

"""Start a model built on the meta device: every rank fills in only what it holds.

``initialize`` hands a meta model through three steps here:

1. ``take_source`` picks where values come from (``models.materialize.InitReplay``: what eager
   construction under the caller's seed would give) before anything changes the model;
2. ``detach_from_meta`` gives every buffer its value and swaps every parameter for one on the
   device that has its shape but no storage (``torch.utils.swap_tensors``: the Parameter
   objects the caller holds, in param groups or a client optimizer, stay the same objects).
   Tensor parallelism then cuts storage-less shards of storage-less params (nothing is read);
3. ``value_provider`` fills the flat ranges of params ZeRO keeps, in ZeRO's own buffers,
   reading from the source only the rows of the full tensors that cover them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from parallel3d.errors import ConfigError
from parallel3d.build.peft_meta import AdapterSource, base_names, draw_adapters, has_adapters, plain_model
from parallel3d.build.storageless import storageless
from parallel3d.tensor_parallel.sharding import ShardSpec


def on_meta(model: nn.Module) -> bool:
    """True when ``model``'s parameters live on the meta device (all of them: a mix is refused)."""
    where = {}
    for name, p in model.named_parameters():
        where.setdefault(p.is_meta, name)
    if len(where) == 2:
        raise ConfigError(f"the model is partly on the meta device ({where[True]} is, {where[False]} is not); "
                          "build it wholly under torch.device('meta') or wholly on a real device (some models' "
                          "constructors make parameters on the CPU even under torch.device('meta'), e.g. with "
                          "torch.normal(mean, std, size=...), which takes no device: DiffLlama, XLNet; build "
                          "those eagerly)")
    return where.get(True) is not None or any(b.is_meta for b in model.buffers())


def take_source(model: nn.Module):
    """The values a meta model starts from: those eager construction would give (same seed)."""
    from models.materialize import InitReplay, MaterializeError

    adapters = has_adapters(model)  # a PEFT model: the plain model's replay, adapters drawn (peft_meta.py)
    try:
        replay = InitReplay(plain_model(model) if adapters else model)
    except MaterializeError as exc:
        raise ConfigError(f"cannot initialize the meta-device model: {exc}") from None
    return AdapterSource(replay, base_names(model), draw_adapters(model)) if adapters else replay


def pretrained_source(directory, model: nn.Module):
    """A Hugging Face safetensors directory as a source, checked against ``model`` (names, shapes, dtypes)."""
    from models.pretrained import CheckpointError, SafetensorsSource

    adapters = has_adapters(model)  # a PEFT model: the base's weights under peft's names (peft_meta.py)
    try:
        source = SafetensorsSource.for_model(directory, plain_model(model) if adapters else model)
    except CheckpointError as exc:
        raise ConfigError(f"pretrained: {exc}") from None
    return AdapterSource(source, base_names(model), draw_adapters(model)) if adapters else source


def buffer_values(replay, weights) -> Iterator[tuple[str, torch.Tensor]]:
    """Every buffer as constructed (no random draw), persistent ones from ``weights`` when it has them."""
    stored = set(weights.names()) if weights is not replay else set()
    from_weights = [n for n in replay.buffer_names(persistent=True) if n in stored]
    yield from ((n, t) for n, t in replay.buffers() if n not in from_weights)
    if from_weights:
        for name, (value,) in weights.read({n: [()] for n in from_weights}):
            yield name, value


def load_in_place(model: nn.Module, weights) -> None:
    """Read every parameter and stored persistent buffer of a model that has storage, whole."""
    stored = set(weights.names())
    tensors = dict(model.named_parameters())
    tensors.update((n, b) for n, b in model.named_buffers() if n in stored)
    canonical = weights.aliases()
    destinations: dict[str, list] = {}
    for name, tensor in tensors.items():
        destinations.setdefault(canonical.get(name, name), []).append(((), tensor.data))
    with torch.no_grad():
        weights.fill(destinations)


def detach_from_meta(model: nn.Module, buffers: Iterator[tuple[str, torch.Tensor]], device: torch.device) -> None:
    """Give every buffer its value; make every parameter storage-less on ``device``."""
    metas = {id(b): b for b in model.buffers() if b.is_meta}
    named = {n: b for n, b in model.named_buffers(remove_duplicate=False) if id(b) in metas}
    for name, value in buffers:
        if name in named and named[name].is_meta:
            torch.utils.swap_tensors(named[name], value.to(device))
    left = [n for n, b in named.items() if b.is_meta]
    if left:
        raise ConfigError(f"meta-device model: no value for buffer(s) {left[:5]}; build the model eagerly instead")
    for p in {id(p): p for p in model.parameters()}.values():
        if p.is_meta:
            torch.utils.swap_tensors(p, nn.Parameter(storageless(p.shape, p.dtype, device), requires_grad=p.requires_grad))
    for module in model.modules():
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor) and value.is_meta:
                raise ConfigError(f"meta-device model: {type(module).__name__}.{attr} is a tensor on the meta device "
                                  "that is neither a parameter nor a buffer, so it cannot be materialized")


def _row_reads(shape: torch.Size, spec: ShardSpec | None, rows: tuple[int, int], rank: int, world: int,
               dest: torch.Tensor, first_row: int = 0) -> list[tuple[tuple[slice, ...], torch.Tensor]]:
    """(rectangle of the full tensor, view of ``dest``) pairs that fill piece rows ``rows``.

    Rows of vocabulary padding have no source: ``dest`` is zeroed first where there are any. A piece
    not split along dim 0 starts at row ``first_row`` of the full tensor (an expert-parallel rank's
    experts, whole or, under expert tensor parallelism, split along a later dim).
    """
    ra, rb = rows
    if spec is None:
        return [((slice(first_row + ra, first_row + rb),), dest)]
    if spec.padded_size > spec.full_size:
        dest.zero_()
    if spec.dim == 0:
        return [((slice(full, full + n),), dest[a - ra : a - ra + n]) for a, full, n in spec.source_runs(ra, rb, rank, world)]
    lead = (slice(first_row + ra, first_row + rb),) + (slice(None),) * (spec.dim - 1)  # tp-split experts: their rows
    return [((*lead, slice(full, full + n)), dest.narrow(spec.dim, a, n))
            for a, full, n in spec.source_runs(0, shape[spec.dim], rank, world)]


def value_provider(source, named_params: list[tuple[str, nn.Parameter]], specs: Mapping[str, ShardSpec],
                   tp_rank: int = 0, tp_world: int = 1, first_rows: Mapping[str, int] | None = None):
    """ZeRO's ``initial_values``: fill the flat ranges of (tp pieces of) params it keeps, from ``source``.

    ``first_rows``: params that are a dim-0 slice of their full tensor starting at that row (an
    expert-parallel rank's experts, ``ExpertParallelInfo.first_experts``); only their rows are read.

    Given ``{param: (start, stop, flat)}`` (``flat`` is where elements [start, stop) of the
    param go), it has the source write the whole rows inside the range straight into
    ``flat`` (several rectangles of the full tensor for packed q|k|v; vocabulary padding rows
    are zeroed, they have no source), and the at most two rows the range cuts through into a
    one-row buffer each, copied over afterwards. One ``source.fill`` for everything.
    """
    canonical = getattr(source, "aliases", lambda: {})()
    names = {id(p): n for n, p in named_params}
    first_rows = first_rows or {}
    known = set(source.names())

    def provide(wanted: Mapping[nn.Parameter, tuple[int, int, torch.Tensor]]) -> None:
        unknown = sorted(n for p in wanted if (n := names.get(id(p))) is None or canonical.get(n, n) not in known)
        if unknown:
            raise ConfigError(f"meta-device model: the model's initialization gives no value for {unknown[:5]}")
        destinations: dict[str, list] = {}
        partial_rows = []
        for param, (start, stop, flat) in wanted.items():
            if start >= stop:
                continue
            name, spec = names[id(param)], specs.get(names[id(param)])
            reads = destinations.setdefault(canonical.get(name, name), [])
            row, tail = math.prod(param.shape[1:]), param.shape[1:]
            first, last = -(-start // row), stop // row  # the rows wholly inside [start, stop)
            if first < last:
                rows = flat[first * row - start : last * row - start].view(last - first, *tail)
                reads += _row_reads(param.shape, spec, (first, last), tp_rank, tp_world, rows, first_rows.get(name, 0))
            for r in sorted({start // row, (stop - 1) // row} - set(range(first, last))):
                bounce = torch.empty((1, *tail), dtype=flat.dtype)
                reads += _row_reads(param.shape, spec, (r, r + 1), tp_rank, tp_world, bounce, first_rows.get(name, 0))
                partial_rows.append((bounce, r * row, start, stop, flat))
        source.fill(destinations)
        for bounce, row_start, start, stop, flat in partial_rows:
            a, z = max(start, row_start), min(stop, row_start + bounce.numel())
            flat[a - start : z - start].copy_(bounce.reshape(-1)[a - row_start : z - row_start])

    return provide

"""Group parameters into flat units: gradient buckets (stages 0-2) or fetch units (stage 3)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from zero.flat import FlatUnit


@dataclass
class UnitLayout:
    """Which unit owns which parameter, and for stage 3 which module gathers which units."""

    units: list[FlatUnit] = field(default_factory=list)
    module_units: list[tuple[nn.Module, list[FlatUnit]]] = field(default_factory=list)
    root_units: list[FlatUnit] = field(default_factory=list)


def _buckets(params: Sequence[nn.Parameter], bucket_size: int) -> list[list[nn.Parameter]]:
    """Split ``params`` into runs of about ``bucket_size`` elements (a big param gets its own)."""
    buckets: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in params:
        current.append(p)
        size += p.numel()
        if size >= bucket_size:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def bucketed_layout(
    param_groups: Sequence[Sequence[nn.Parameter]],
    *,
    bucket_size: int,
    rank: int,
    world: int,
    dtype: torch.dtype,
    device: torch.device,
) -> UnitLayout:
    """Stages 0-2: persistent units of about ``bucket_size`` elements.

    Parameters are taken in reverse registration order, the order in which backward
    usually produces their gradients, so the first buckets fill (and start reducing) early.
    """
    layout = UnitLayout()
    for gi, params in enumerate(param_groups):
        for bucket in _buckets(list(reversed(params)), bucket_size):
            layout.units.append(FlatUnit(bucket, gi, dtype, rank, world, persistent=True, device=device))
    return layout


def parameter_leaves(model: nn.Module) -> list[nn.Module]:
    """Submodules that hold parameters themselves and none in their children, in registration order.

    Stage 3's fetch units for a model that names no repeated block (no ``_no_split_modules``):
    each ``nn.Linear``, ``nn.Embedding``, norm... is gathered just for its own forward, as
    DeepSpeed gathers per submodule. A module holding parameters next to children that hold
    some keeps its own with the root units, and so does a module sharing a parameter with
    another (a tied weight is needed whole by both).
    """
    owners: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    leaves = []
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if not name or not own or any(owners[id(p)] > 1 for p in own):
            continue
        if all(next(child.parameters(), None) is None for child in module.children()):
            leaves.append(module)
    return leaves


def fetch_unit_layout(
    param_groups: Sequence[Sequence[nn.Parameter]],
    fetch_modules: Iterable[nn.Module],
    *,
    bucket_size: int,
    persistence_threshold: int,
    rank: int,
    world: int,
    dtype: torch.dtype,
    device: torch.device,
) -> UnitLayout:
    """Stage 3: one sharded unit per (fetch module, param group); each other param is a root unit.

    Parameters with fewer than ``persistence_threshold`` elements stay whole on every rank
    (gathered after each step like stage 2) in persistent buckets: gathering them per use
    would cost more in latency than they save in memory. Root params (embedding, head) get
    a unit each, so the head's gradient is reduced (and its buffer freed) as soon as it
    arrives instead of waiting for the embedding's at the end of backward. With one rank
    (``world == 1``) nothing is sharded and every unit is persistent.
    """
    if world == 1:
        persistence_threshold = float("inf")
    group_of = {p: gi for gi, params in enumerate(param_groups) for p in params}
    claimed: set[nn.Parameter] = set()
    small: list[list[nn.Parameter]] = [[] for _ in param_groups]
    layout = UnitLayout()

    def split(params: Iterable[nn.Parameter]) -> list[list[nn.Parameter]]:
        by_group: list[list[nn.Parameter]] = [[] for _ in param_groups]
        for p in params:
            if p in claimed or p not in group_of:
                continue
            claimed.add(p)
            if p.numel() < persistence_threshold:
                small[group_of[p]].append(p)
            else:
                by_group[group_of[p]].append(p)
        return by_group

    for module in fetch_modules:
        units = [
            FlatUnit(ps, gi, dtype, rank, world, persistent=False, device=device)
            for gi, ps in enumerate(split(module.parameters()))
            if ps
        ]
        if units:
            layout.module_units.append((module, units))
            layout.units.extend(units)
    rest = [p for params in param_groups for p in params]
    for gi, ps in enumerate(split(rest)):
        for p in ps:
            unit = FlatUnit([p], gi, dtype, rank, world, persistent=False, device=device)
            layout.root_units.append(unit)
            layout.units.append(unit)
    for gi, ps in enumerate(small):
        for bucket in _buckets(list(reversed(ps)), bucket_size):
            layout.units.append(FlatUnit(bucket, gi, dtype, rank, world, persistent=True, device=device))
    return layout

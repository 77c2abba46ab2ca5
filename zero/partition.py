"""Group parameters into flat units: gradient buckets (stages 0-2) or fetch units (stage 3)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from zero.flat import FlatUnit
from zero.sizing import plan_units


@dataclass
class UnitLayout:
    """Which unit owns which parameter, and for stage 3 which module gathers which units."""

    units: list[FlatUnit] = field(default_factory=list)
    module_units: list[tuple[nn.Module, list[FlatUnit]]] = field(default_factory=list)
    root_units: list[FlatUnit] = field(default_factory=list)


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
    The grouping is ``zero.sizing.plan_units``'s, shared with the planner.
    """
    plans = plan_units(param_groups, _numel, stage=0, world=world, bucket_size=bucket_size,
                       persistence_threshold=0)
    return UnitLayout(units=[FlatUnit(list(u.params), u.group_index, dtype, rank, world, persistent=True,
                                      device=device) for u in plans])


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
    (``world == 1``) nothing is sharded and every unit is persistent. The grouping is
    ``zero.sizing.plan_units``'s, shared with the planner.
    """
    modules = list(fetch_modules)
    plans = plan_units(param_groups, _numel, stage=3, world=world, bucket_size=bucket_size,
                       persistence_threshold=persistence_threshold,
                       fetch_modules=[list(m.parameters()) for m in modules])
    layout = UnitLayout()
    for u in plans:
        unit = FlatUnit(list(u.params), u.group_index, dtype, rank, world, persistent=u.persistent, device=device)
        layout.units.append(unit)
        if u.module is not None:
            if not layout.module_units or layout.module_units[-1][0] is not modules[u.module]:
                layout.module_units.append((modules[u.module], []))
            layout.module_units[-1][1].append(unit)
        elif u.root:
            layout.root_units.append(unit)
    return layout


def _numel(p: nn.Parameter) -> int:
    return p.numel()

"""Group parameters into flat units: gradient buckets (stages 0-2) or fetch units (stage 3)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from zero.flat import FlatUnit
from zero.stage3 import backward_reads_no_weights
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
    owners = _param_users(model)
    leaves = []
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if not name or not own or any(owners[id(p)] > 1 for p in own):
            continue
        if all(next(child.parameters(), None) is None for child in module.children()):
            leaves.append(module)
    return leaves


def _model_leaf(model: nn.Module, getter: str, blocks: Sequence[nn.Module]) -> nn.Module | None:
    """``model.<getter>()`` (HF's ``get_input_embeddings`` / ``get_output_embeddings``) when it is a
    module outside ``blocks`` that holds parameters and has no children holding some; else None."""
    get = getattr(model, getter, None)
    try:
        module = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        return None
    inside = {id(m) for block in blocks for m in block.modules()}
    if (not isinstance(module, nn.Module) or id(module) in inside or next(module.parameters(recurse=False), None) is None
            or any(next(child.parameters(), None) is not None for child in module.children())):
        return None
    return module


def embedding_tables(model: nn.Module, blocks: Sequence[nn.Module]) -> list[nn.Module]:
    """The model's input embedding (:func:`_model_leaf`) if its backward reads none of its weights
    (``zero.stage3.backward_reads_no_weights``: ``nn.Embedding``, the vocabulary-parallel one);
    tied or not. Other tables (positions, ProphetNet's n-gram streams) stay root units: models
    read some of their weights past their forward (``ngram_embeddings.weight[i]``)."""
    table = _model_leaf(model, "get_input_embeddings", blocks)
    return [table] if table is not None and backward_reads_no_weights(table) else []


def standalone_embeddings(model: nn.Module, blocks: Sequence[nn.Module]) -> list[nn.Module]:
    """The :func:`embedding_tables` whose weight no other module uses (not tied to the head):
    stage 3 makes each a fetch module of its own, gathered for its forward only, instead of a
    root unit held for the whole micro-batch (under pipeline stages a tied copy on the first
    stage is its own parameter, so it qualifies there)."""
    return _unshared(model, embedding_tables(model, blocks))


def output_head(model: nn.Module, blocks: Sequence[nn.Module]) -> nn.Module | None:
    """The model's output embedding (:func:`_model_leaf`); tied or not."""
    return _model_leaf(model, "get_output_embeddings", blocks)


def _param_users(model: nn.Module) -> dict[int, int]:
    """How many modules of ``model`` hold each parameter (by id) directly."""
    users: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            users[id(p)] = users.get(id(p), 0) + 1
    return users


def _unshared(model: nn.Module, modules: Sequence[nn.Module]) -> list[nn.Module]:
    """Those of ``modules`` whose parameters no other module of ``model`` uses."""
    users = _param_users(model)
    return [m for m in modules if all(users[id(p)] == 1 for p in m.parameters())]


def standalone_head(model: nn.Module, blocks: Sequence[nn.Module]) -> list[nn.Module]:
    """The :func:`output_head` if its weight is its own (untied, or a tied copy on the last
    pipeline stage): stage 3 makes it a fetch module kept gathered from its forward until its
    gradient is reduced. At most one module."""
    head = output_head(model, blocks)
    return _unshared(model, [head]) if head is not None else []


def stage3_fetch_modules(model: nn.Module, blocks: Sequence[nn.Module]) -> list[nn.Module]:
    """Stage 3's fetch modules: the stand-alone embeddings, the model's repeated ``blocks``
    (``models.fetch_unit_modules``), then the stand-alone head; a model with no blocks gets its
    :func:`parameter_leaves`."""
    if not blocks:
        return parameter_leaves(model)
    return [*standalone_embeddings(model, blocks), *blocks, *standalone_head(model, blocks)]


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
    would cost more in latency than they save in memory. Root params (a tied embedding and
    head, a final norm) get a unit each, so each gradient is reduced (and its buffer freed) as
    soon as it arrives. With one rank
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

"""ZeRO's layout and bytes from parameter sizes alone: which units, how padded, what a rank keeps.

``plan_units`` decides how parameters are grouped into flat units; zero/partition.py builds its
``FlatUnit``s from that plan, and the planner (parallel3d/planner) calls the same function with
parameter *sizes* instead of tensors, so a prediction and ``ZeroOptimizer.memory_report()`` come
from one grouping rule. ``unit_state_bytes`` is the arithmetic of what ``memory_report`` then
counts for one unit, on one rank:

=================  ======================================================================
params             full padded buffer (persistent unit) or the rank's shard, working dtype
gradients          full padded buffer when full gradients are accumulated (stages 0-1, and
                   pipeline.keep_full_gradients), else the shard; working dtype
master_params      the fp32 shard, 0 under fp32 (the master *is* the working shard)
optimizer_states   per *piece* (a parameter's part of the shard, padding excluded): 4 bytes
                   per element per elementwise state (Adam's m and v) plus 4 bytes per
                   scalar state (Adam's ``step``)
frozen_params      untrained parameters (``requires_grad=False``): the full padded buffer
                   (persistent unit, stages 0-2) or the rank's shard, working dtype; they
                   have no gradient, master or optimizer state
=================  ======================================================================

Those are bytes on the compute device. With ZeRO-Offload (zero/offload.py) the offloaded ones
are counted instead under ``HOST_CATEGORIES``, bytes in host memory: ``offloaded_params`` (stage
3's non-persistent shards under ``offload_param``), and under ``offload_optimizer``
``offloaded_master_params`` (the fp32 shard, 0 where it is the offloaded working shard itself),
``offloaded_optimizer_states`` and ``offloaded_gradients`` (the host fp32 copy of the gradient
shard the optimizer steps with). The host keys appear only when something is offloaded.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

CATEGORIES = ("params", "gradients", "master_params", "optimizer_states", "frozen_params")
"""Model-state bytes on the compute device."""
HOST_CATEGORIES = ("offloaded_params", "offloaded_gradients", "offloaded_master_params", "offloaded_optimizer_states")
"""Model-state bytes in host memory (ZeRO-Offload)."""


def device_bytes(report: dict[str, int]) -> int:
    """The compute-device part of a ``memory_report`` (or of a prediction of one)."""
    return sum(report.get(key, 0) for key in CATEGORIES)


def padded_numel(numel: int, world: int) -> int:
    """A unit's flat size: ``numel`` rounded up to a multiple of ``world`` (at least ``world``)."""
    return max(world, math.ceil(numel / world) * world)


@dataclass(frozen=True)
class UnitPlan(Generic[T]):
    """One flat unit: its parameters in layout order, their param group, whether it stays whole.

    ``module`` is the index of the stage-3 fetch module it belongs to, None for other units
    (buckets, stage-3 root units and persistent buckets).
    """

    params: tuple[T, ...]
    group_index: int
    persistent: bool
    module: int | None = None
    root: bool = False


def buckets(items: Sequence[T], numel: Callable[[T], int], bucket_size: int) -> list[list[T]]:
    """Split ``items`` into runs of about ``bucket_size`` elements (a big item gets its own)."""
    out: list[list[T]] = []
    current: list[T] = []
    size = 0
    for item in items:
        current.append(item)
        size += numel(item)
        if size >= bucket_size:
            out.append(current)
            current, size = [], 0
    if current:
        out.append(current)
    return out


def plan_units(param_groups: Sequence[Sequence[T]], numel: Callable[[T], int], *, stage: int, world: int,
               bucket_size: int, persistence_threshold: float,
               fetch_modules: Sequence[Sequence[T]] = ()) -> list[UnitPlan[T]]:
    """The units of ``param_groups`` (lists of parameters, or anything ``numel`` can size).

    Stages 0-2: persistent buckets of about ``bucket_size`` elements, each group's parameters in
    reverse order (the order backward produces their gradients). Stage 3: one sharded unit per
    (fetch module, group) from ``fetch_modules`` (each a list of that module's parameters), then
    one sharded root unit per remaining parameter, then persistent buckets of the parameters
    under ``persistence_threshold`` elements. With ``world == 1`` stage 3 shards nothing.
    """
    if stage != 3:
        return [UnitPlan(tuple(b), gi, True) for gi, params in enumerate(param_groups)
                for b in buckets(list(reversed(params)), numel, bucket_size)]
    threshold = float("inf") if world == 1 else persistence_threshold
    group_of = {id(p): gi for gi, params in enumerate(param_groups) for p in params}
    claimed: set[int] = set()
    small: list[list[T]] = [[] for _ in param_groups]

    def split(params: Sequence[T]) -> list[list[T]]:
        by_group: list[list[T]] = [[] for _ in param_groups]
        for p in params:
            if id(p) in claimed or id(p) not in group_of:
                continue
            claimed.add(id(p))
            (small if numel(p) < threshold else by_group)[group_of[id(p)]].append(p)
        return by_group

    units: list[UnitPlan[T]] = []
    for mi, module_params in enumerate(fetch_modules):
        units += [UnitPlan(tuple(ps), gi, False, mi) for gi, ps in enumerate(split(module_params)) if ps]
    for gi, ps in enumerate(split([p for params in param_groups for p in params])):
        units += [UnitPlan((p,), gi, False, root=True) for p in ps]
    for gi, ps in enumerate(small):
        units += [UnitPlan(tuple(b), gi, True) for b in buckets(list(reversed(ps)), numel, bucket_size)]
    return units


@dataclass(frozen=True)
class OptimizerStateShape:
    """What a torch optimizer keeps per parameter tensor (a master piece), in fp32.

    ``elementwise``: states the size of the parameter (Adam: exp_avg, exp_avg_sq; AMSGrad adds
    max_exp_avg_sq; SGD with momentum: momentum_buffer). ``scalars``: one-element states
    (Adam's ``step``), 4 bytes each.
    """

    elementwise: int
    scalars: int

    @classmethod
    def of(cls, name: str, options: dict | None = None) -> OptimizerStateShape:
        """The states of ``torch.optim.<name>`` (Adam, AdamW or SGD) with constructor ``options``."""
        options = options or {}
        if name in ("Adam", "AdamW"):
            return cls(3 if options.get("amsgrad") else 2, 1)
        if name == "SGD":
            return cls(1 if options.get("momentum", 0) else 0, 0)
        raise ValueError(f"no state shape known for optimizer {name!r}; known: Adam, AdamW, SGD")


def shard_pieces(numels: Sequence[int], lo: int, hi: int) -> list[int]:
    """Sizes of the non-empty parts of each parameter (laid end to end) inside [lo, hi)."""
    out, off = [], 0
    for n in numels:
        start, stop = max(off, lo), min(off + n, hi)
        if start < stop:
            out.append(stop - start)
        off += n
    return out


def unit_state_bytes(numels: Sequence[int], *, world: int, rank: int, persistent: bool, work_bytes: int,
                     full_gradients: bool, optimizer: OptimizerStateShape, offload_optimizer: bool = False,
                     offload_params: bool = False) -> dict[str, int]:
    """The bytes ``memory_report`` counts for one unit on dp rank ``rank`` after a step.

    ``numels``: the unit's parameter sizes in layout order; ``work_bytes``: bytes per element of
    the working dtype (4 = fp32, whose master is the working shard itself while both are in the
    same memory). ``offload_optimizer`` / ``offload_params``: ZeRO-Offload's settings (the latter
    moves only non-persistent stage-3 shards); offloaded bytes go to ``HOST_CATEGORIES``.
    """
    padded = padded_numel(sum(numels), world)
    shard = padded // world
    pieces = shard_pieces(numels, rank * shard, (rank + 1) * shard)
    params_on_host = offload_params and not persistent
    master = 0 if work_bytes == 4 and offload_optimizer == params_on_host else 4 * shard
    states = 4 * (optimizer.elementwise * sum(pieces) + optimizer.scalars * len(pieces))
    kept = work_bytes * (padded if persistent else shard)
    out = {
        "params": 0 if params_on_host else kept,
        "gradients": work_bytes * (padded if full_gradients else shard),
        "master_params": 0 if offload_optimizer else master,
        "optimizer_states": 0 if offload_optimizer else states,
    }
    if offload_optimizer or offload_params:
        out.update(offloaded_params=kept if params_on_host else 0,
                   offloaded_gradients=4 * shard if offload_optimizer else 0,
                   offloaded_master_params=master if offload_optimizer else 0,
                   offloaded_optimizer_states=states if offload_optimizer else 0)
    return out

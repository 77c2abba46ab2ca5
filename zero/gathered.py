"""Whole parameters for a while: gather ZeRO's shards, and write changes back into them.

``GatheredParams(optimizer, params, modifier_rank)`` is DeepSpeed's
``deepspeed.zero.GatheredParameters`` for a ``ZeroOptimizer``:

* on entry every unit holding one of ``params`` is materialized (stage 3 gathers it over the
  data-parallel group; stages 0-2 and persistent units are whole already), so inside the
  context each param has its full shape and current working values;
* on exit with ``modifier_rank`` (a rank of the data-parallel group) that rank's values of
  ``params`` are broadcast to the others and written into the working shards *and* into the
  fp32 master shards, so the next optimizer step starts from them (DeepSpeed writes only the
  16-bit partition, and its next step overwrites the change from the fp32 master);
* on exit without ``modifier_rank`` a change would be lost: every rank checks whether it
  changed one of ``params`` (in-place ops or a new ``.data``), the ranks agree with one
  all-reduce, and a change raises ``GatherError`` instead of being dropped without a word;
* units that were not materialized on entry are released again; while the context is open,
  a forward through the model does not release them.

The params are the ones this rank's model holds (a tensor-parallel shard stays a shard: the
gather is over data parallelism only). Entering is a collective over the data-parallel group
at stage 3, and exiting is one whenever dp > 1: every rank must enter with the same params.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from zero.flat import FlatUnit

if TYPE_CHECKING:
    from zero.optimizer import ZeroOptimizer

logger = logging.getLogger(__name__)


class GatherError(RuntimeError):
    """Parameters changed inside a gathered context that cannot keep the change."""


def param_locations(optimizer: ZeroOptimizer, params: Iterable[nn.Parameter]) -> list[tuple[nn.Parameter, FlatUnit, int]]:
    """``(param, unit, index in unit)`` for each of ``params`` that ``optimizer`` manages (once each)."""
    wanted = {id(p) for p in params}
    found = []
    for unit in optimizer.units + optimizer.frozen_units:
        for index, p in enumerate(unit.params):
            if id(p) in wanted:
                found.append((p, unit, index))
                wanted.discard(id(p))
    return found


def write_back(optimizer: ZeroOptimizer, unit: FlatUnit, index: int, full_value: torch.Tensor) -> None:
    """Make ``full_value`` (the whole param, the same on every rank) the param's value in ``unit``.

    Writes this rank's slice into the working shard and the fp32 master shard, and the whole
    value into the full working buffer when it is materialized.
    """
    flat = full_value.detach().reshape(-1)
    off, n = unit.offsets[index], unit.numels[index]
    if unit.is_materialized and unit.full is not None:
        target = unit.full[off : off + n]
        if target.data_ptr() != flat.data_ptr():
            target.copy_(flat)
    lo, hi = unit.shard_range
    start, stop = max(off, lo), min(off + n, hi)
    if start >= stop:
        return
    piece = flat[start - off : stop - off]
    shard = unit.shard[start - lo : stop - lo]
    if shard.data_ptr() != piece.data_ptr():
        shard.copy_(piece)
    if unit.master is not None and unit.master is not unit.shard:
        unit.master[start - lo : stop - lo].copy_(piece)


class GatheredParams:
    """Context manager: ``params`` whole inside, changes of ``modifier_rank`` kept on exit."""

    def __init__(self, optimizer: ZeroOptimizer, params: Iterable[nn.Parameter], modifier_rank: int | None = None) -> None:
        self.optimizer = optimizer
        self.located = param_locations(optimizer, params)
        self.modifier_rank = modifier_rank
        self._held: list[FlatUnit] = []  # stage-3 units kept materialized while the context is open
        self._gathered: list[FlatUnit] = []  # those of them this context gathered (released on exit)
        self._versions: list[tuple[int, int]] = []

    def _units(self) -> list[FlatUnit]:
        units: dict[int, FlatUnit] = {}
        for _, unit, _ in self.located:
            units.setdefault(id(unit), unit)
        return list(units.values())

    def __enter__(self) -> None:
        fetcher = self.optimizer.fetcher
        self._held = [u for u in self._units() if not u.persistent]
        self._gathered = [u for u in self._held if not u.is_materialized]
        if self._held:
            fetcher.hold(self._held)
        self._versions = [(p.data_ptr(), p._version) for p, _, _ in self.located]

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                if self.modifier_rank is None:
                    self._refuse_lost_changes()
                else:
                    self._keep_changes()
        finally:
            if self._held:
                self.optimizer.fetcher.unhold(self._held, release=self._gathered)
            self._held, self._gathered = [], []

    def _changed_anywhere(self) -> bool:
        changed = any((p.data_ptr(), p._version) != seen for (p, _, _), seen in zip(self.located, self._versions))
        opt = self.optimizer
        if opt.dp.world > 1:
            flag = torch.tensor([int(changed)], dtype=torch.int32, device=opt.units[0].device)
            opt.dp.all_reduce(flag, op=dist.ReduceOp.MAX)
            changed = bool(flag.item())
        return changed

    def _refuse_lost_changes(self) -> None:
        if self._changed_anywhere():
            raise GatherError(
                "parameters were changed inside GatheredParameters without modifier_rank: the change "
                "would be lost when they are partitioned again. Pass modifier_rank=<the data-parallel "
                "rank whose values to keep> to write the change back into the shards and the fp32 masters"
            )

    def _keep_changes(self) -> None:
        opt = self.optimizer
        if not 0 <= self.modifier_rank < opt.dp.world:
            raise GatherError(f"modifier_rank {self.modifier_rank} is not a rank of the data-parallel group "
                              f"(0 to {opt.dp.world - 1})")
        for p, unit, index in self.located:
            value = p.data
            if value.shape != unit.shapes[index]:
                raise GatherError(f"a parameter of shape {tuple(unit.shapes[index])} was given a value of shape "
                                  f"{tuple(value.shape)} inside GatheredParameters; keep its shape")
            value = value.to(device=unit.device, dtype=unit.dtype).contiguous()
            if unit.expert:  # each rank's experts: from the rank holding them in modifier_rank's ep group
                opt.expert_dp.broadcast(value, src=opt.expert_source(self.modifier_rank))
            else:
                opt.dp.broadcast(value, src=self.modifier_rank)
            if unit.is_materialized:
                unit.point_params_at(unit.full)  # a param given a new .data views the unit again
            write_back(opt, unit, index, value)
        logger.debug("GatheredParameters: kept rank %d's values of %d params", self.modifier_rank, len(self.located))

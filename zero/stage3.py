"""ZeRO stage 3: gather each fetch unit's parameters just before use, release them after.

Forward: a module's pre-hook gathers its units (waiting for a prefetch if one is in
flight) and starts gathering the next units in the recorded execution order; the post-hook
releases them and hooks the module's outputs so that backward gathers them again before
the module's backward runs (and prefetches the units that backward reaches next). Units are
released in backward once their gradients have been handed to the reducer.

The root units (embedding, final norm, head: everything outside the repeated blocks) are
gathered for the whole forward-backward of a micro-batch; a tied embedding is used at both
ends of the model, so gathering it once is also the cheapest.

The execution order is recorded during the first forward and assumed fixed afterwards (as
in DeepSpeed and FSDP); prefetch never holds more than ``max_live_numel`` gathered elements.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

from zero.comm import Pending, gather_shards
from zero.flat import FlatUnit


class ParamFetcher:
    """Gathers, prefetches and releases stage-3 units around module execution.

    Args:
        module_units: (module, its units) for every fetch module.
        root_units: units gathered for the whole step of a micro-batch.
        group: the data-parallel process group the shards live on.
        prefetch_numel: prefetch ahead while the units in flight hold fewer elements than
            this (0 disables prefetch).
        max_live_numel: never hold more gathered elements than this through prefetch.
        module_hooks: gather and release around each module's forward and backward; off
            when the caller holds everything gathered for a whole step (pipelines).
    """

    def __init__(
        self,
        module_units: Sequence[tuple[nn.Module, list[FlatUnit]]],
        root_units: Sequence[FlatUnit],
        group: dist.ProcessGroup | None,
        prefetch_numel: int,
        max_live_numel: int,
        module_hooks: bool = True,
    ) -> None:
        self.module_units = list(module_units)
        self.root_units = list(root_units)
        self.group = group
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self._in_flight: dict[int, tuple[Pending, FlatUnit]] = {}
        self._order: list[int] = []
        self._recording = True
        self._position: dict[int, int] = {}
        self._hooks = []
        for mi, (module, _) in enumerate(self.module_units if module_hooks else ()):
            self._hooks.append(module.register_forward_pre_hook(functools.partial(self._pre_forward, mi)))
            self._hooks.append(module.register_forward_hook(functools.partial(self._post_forward, mi)))

    def live_numel(self) -> int:
        gathered = sum(u.padded for _, us in self.module_units for u in us if u.is_materialized)
        return gathered + sum(unit.padded for _, unit in self._in_flight.values())

    def _start_gather(self, unit: FlatUnit) -> None:
        if unit.is_materialized or id(unit) in self._in_flight:
            return
        work = gather_shards(unit.allocate_full(), unit.shard, self.group)
        self._in_flight[id(unit)] = (work, unit)

    def gather(self, units: Sequence[FlatUnit]) -> None:
        """Materialize ``units`` now (waiting for their prefetch if one is in flight)."""
        for unit in units:
            self._start_gather(unit)
        for unit in units:
            if unit.is_materialized:
                continue
            work, _ = self._in_flight.pop(id(unit))
            work.wait()
            unit.mark_materialized()

    def release(self, units: Sequence[FlatUnit]) -> None:
        for unit in units:
            if id(unit) in self._in_flight:
                work, _ = self._in_flight.pop(id(unit))
                work.wait()
                unit.mark_materialized()
            unit.release()

    def gather_root(self) -> None:
        self.gather(self.root_units)

    def gather_all(self) -> None:
        """Materialize every unit (held for a whole step)."""
        self.gather(self.root_units + [u for _, us in self.module_units for u in us])

    def release_all(self) -> None:
        """Release every gathered unit (end of a step, or after a forward without grad)."""
        self.release(self.root_units)
        for _, units in self.module_units:
            self.release(units)

    def _prefetch_after(self, mi: int, step: int) -> None:
        """Start gathering the modules that follow ``mi`` in execution order (step -1: backward)."""
        if self.prefetch_numel <= 0 or mi not in self._position:
            return
        pos = self._position[mi] + step
        budget = self.prefetch_numel
        while 0 <= pos < len(self._order) and budget > 0:
            units = self.module_units[self._order[pos]][1]
            size = sum(u.padded for u in units if not u.is_materialized)
            if self.live_numel() + size > self.max_live_numel:
                return
            for unit in units:
                self._start_gather(unit)
            budget -= size
            pos += step

    def _pre_forward(self, mi: int, module: nn.Module, args) -> None:
        if self._recording and mi not in self._position:
            self._position[mi] = len(self._order)
            self._order.append(mi)
        self.gather(self.module_units[mi][1])
        if torch._C._current_graph_task_id() == -1:  # not a recompute inside backward
            self._prefetch_after(mi, +1)

    def _post_forward(self, mi: int, module: nn.Module, args, output):
        if torch._C._current_graph_task_id() != -1:
            # A forward re-run inside backward (activation checkpointing): its backward
            # follows at once and needs the params, which the reducer releases afterwards.
            return output
        units = self.module_units[mi][1]
        self.release(units)
        if torch.is_grad_enabled():
            hook = functools.partial(self._pre_backward, mi)
            for t in tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(hook)
        return output

    def _pre_backward(self, mi: int, grad: torch.Tensor) -> None:
        self._recording = False
        self.gather(self.module_units[mi][1])
        self._prefetch_after(mi, -1)

    def end_step_recording(self) -> None:
        """Freeze the recorded execution order after the first forward-backward."""
        self._recording = False

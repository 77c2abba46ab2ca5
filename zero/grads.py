"""Gradient readiness hooks and bucketed, overlapped gradient reduction over data parallel.

Stages 0 and 1 accumulate full gradients locally: each ``param.grad`` is a view into its
unit's flat gradient buffer, autograd adds into it in place, and only the last micro-batch
of an accumulation window communicates (stage 0 all-reduces the buffer, stage 1
reduce-scatters it and keeps the owned slice). Stages 2 and 3 keep only the owned
gradient shard: as each gradient arrives it is copied into the unit's staging buffer and
dropped, and a full unit is reduce-scattered into the shard on every micro-batch.

Buffers live for one step: a unit's buffer is made (zeroed) at its first gradient of the step
(or its reduction) and every buffer is dropped after the step, so between steps and through
the forward, while activations pile up, a rank holds no gradients (FSDP2 and torch's
``zero_grad(set_to_none=True)`` behave the same). Stages 0-1 move a unit's first gradient into
its new buffer and point the ``.grad`` of its params at their views, so autograd adds the rest
of the step's gradients into the buffer in place.

Units are reduced in one fixed *launch order*, the same on every rank: a unit's collective
starts once its last gradient has arrived *and* every unit before it in that order has
started, and runs while backward goes on. Which gradients arrive may differ across ranks
(a mixture-of-experts layer whose expert got no token here, a branch one batch skips), so
starting units as they complete would issue the ranks' collectives in different orders and
mix them up. ``finish_backward`` launches, in the same order, the units still waiting (a
param that got no gradient here contributes zeros) and waits for everything; DDP does the
same with its bucket order. The launch order is the expected arrival order (reverse
registration), so a dense model loses no overlap.

A parameter whose gradient arrives more than once in one backward (it took part in several
nested ``torch.autograd.backward`` calls) has the parts summed while its unit waits; a part
that arrives after the unit was reduced raises ``GradientArrivalError`` instead of being lost.
DeepSpeed's ``param.ds_grad_is_ready = False`` (set by its TiledMLP between chunks) defers the
hook to the last part.

The reducer also records which parameters received a gradient during the accumulation
window (``received``), so the optimizer can leave a parameter that got none on any rank
untouched, as ``torch.optim`` skips a parameter whose ``.grad`` is None.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from zero.comm import Pending, reduce_to_shard
from zero.flat import FlatUnit, shard_group_of

AVG = dist.ReduceOp.AVG


class GradientArrivalError(RuntimeError):
    """A parameter's gradient arrived where it would be lost: after its unit had been reduced in
    the same backward, or outside the engine's forward and backward (``loss.backward()``)."""


class UnusedParametersError(AssertionError):
    """Parameters got no gradient in a whole accumulation window on every data-parallel rank,
    with ``zero_optimization.ignore_unused_parameters: false`` (an AssertionError, as DeepSpeed
    raises it)."""


class GradientReducer:
    """Owns the gradient buffers of ``units`` and reduces them over ``group``.

    Args:
        units: the flat units (all share the group's rank/world).
        group: the data-parallel process group.
        stage: ZeRO stage 0-3.
        overlap_comm: start each unit's collective asynchronously from the hook.
        accumulate_full: keep full gradient buffers (``.grad`` views) and reduce only at the
            window's end; the default is stages 0-1. Pipelines set it for every stage: their
            gradients are reduced once per step, after the tied-embedding sum.
        on_unit_reduced: called with a unit once its gradients are handed to the
            collective (stage 3 releases the gathered params there).
        launch_order: unit indices in the order their collectives start (default: as listed).
        reduce: how a full buffer is averaged into the shard (``zero.comm.reduce_to_shard``, or
            ``zero.quantized_comm.reduce_to_shard_int8``).
    """

    MAX_IN_FLIGHT = 2

    def __init__(
        self,
        units: Sequence[FlatUnit],
        group: dist.ProcessGroup | None,
        stage: int,
        overlap_comm: bool = True,
        on_unit_reduced: Callable[[FlatUnit], None] | None = None,
        accumulate_full: bool | None = None,
        launch_order: Sequence[int] | None = None,
        reduce: Callable[..., Pending] = reduce_to_shard,
    ) -> None:
        self.units = list(units)
        self._reduce_to_shard = reduce  # or zero.quantized_comm's int8 one (zero_quantized_gradients)
        self.launch_order = list(range(len(self.units))) if launch_order is None else list(launch_order)
        if sorted(self.launch_order) != list(range(len(self.units))):
            raise ValueError("launch_order must list every unit index exactly once")
        self.group = group
        self.stage = stage
        self.overlap = overlap_comm
        self.on_unit_reduced = on_unit_reduced
        self.accumulate_full = stage <= 1 if accumulate_full is None else accumulate_full
        self.group_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.boundary = True
        self._unit_index: dict[nn.Parameter, tuple[int, int]] = {}
        # launched reductions, oldest first: (work, what to do once done, unit index)
        self._pending: list[tuple[dist.Work | None, Callable[[], None] | None, int]] = []
        self._ready = [0] * len(self.units)
        self._launched = [False] * len(self.units)
        self._order = self.launch_order  # the units this backward reduces, in launch order
        self._next = 0  # position in _order of the next unit to launch
        self._staging: list[torch.Tensor | None] = [None] * len(self.units)
        self._shard_fresh = [True] * len(self.units)
        self._arrived: set[nn.Parameter] = set()  # params whose gradient arrived in this backward
        self._open = False  # start_backward ran and finish_backward has not yet
        self._accepting = False  # gradients may arrive now (inside the engine's forward or backward)
        self._views: dict[nn.Parameter, torch.Tensor] = {}  # stages 0-1: the installed .grad views
        self._handles: list = []
        # received[ui][pi]: param pi of unit ui got a gradient in this accumulation window
        self.received = [[False] * len(u.params) for u in self.units]
        self.used = False  # some backward has run: memory_report() counts gradient buffers from then on
        for ui, unit in enumerate(self.units):
            for pi, p in enumerate(unit.params):
                self._unit_index[p] = (ui, pi)
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    def ensure_buffers(self) -> None:
        """Allocate every unit's gradient buffer (zeroed) that does not exist yet."""
        for ui in range(len(self.units)):
            self._ensure_unit(ui)

    def _ensure_unit(self, ui: int) -> None:
        """Allocate unit ``ui``'s gradient buffer, zeroed, and (stages 0-1) install its ``.grad`` views.

        Buffers are made as the step needs them (a unit's first gradient, or its reduction) and
        dropped by :meth:`release_buffers` after the step, as ``zero_grad(set_to_none=True)``
        drops torch's gradients: between steps, and through the forward with its activations, a
        rank holds no gradients. A model that has just been started holds none either.
        """
        unit = self.units[ui]
        if unit.grad_shard is not None:
            return
        self.used = True
        if self.accumulate_full:
            unit.grad_full = torch.zeros(unit.padded, dtype=unit.dtype, device=unit.device)
            unit.grad_shard = unit.grad_full[slice(*unit.shard_range)]
            self._install_unit_views(unit)
        else:
            unit.grad_shard = torch.zeros(unit.shard_size, dtype=unit.dtype, device=unit.device)

    def _install_unit_views(self, unit: FlatUnit) -> None:
        """Point the unit's ``.grad`` at its buffer; a gradient a param already holds outside it
        (the one whose arrival made the buffer, or one whose hook has not run yet: DeepSpeed's
        ``ds_grad_is_ready = False`` parts) moves in."""
        for p, view in zip(unit.params, unit.views(unit.grad_full)):
            self._views[p] = view
            if p.grad is view:
                continue
            if p.grad is not None and unit.is_materialized:
                view.add_(p.grad.reshape(view.shape))
            # a released stage-3 param has no shape to take a gradient of
            p.grad = view if unit.is_materialized else None

    def install_grad_views(self) -> None:
        """Stages 0-1: point every ``param.grad`` of a unit whose buffer exists at its slice of it
        (stage 3 calls it once it has gathered units for a pipelined step)."""
        if not self.accumulate_full:
            return
        for unit in self.units:
            if unit.grad_full is not None:
                self._install_unit_views(unit)

    def release_buffers(self) -> None:
        """Drop every gradient buffer and ``.grad`` view (after the step); the next backward makes
        them again, zeroed, unit by unit."""
        for p, view in self._views.items():
            if p.grad is view:
                p.grad = None
        self._views = {}
        for unit in self.units:
            unit.grad_full = unit.grad_shard = None
        self._reset_window()

    def _reset_window(self) -> None:
        self._shard_fresh = [True] * len(self.units)
        self.received = [[False] * len(u.params) for u in self.units]

    def buffer_bytes(self, units: Iterable[FlatUnit] | None = None) -> int:
        """Bytes of this rank's gradient buffers (of ``units``; default all) while they all exist (during a
        step's backward)."""
        return sum((u.padded if self.accumulate_full else u.shard_size) * u.dtype.itemsize
                   for u in (self.units if units is None else units))

    def _repair_grad_views(self) -> None:
        """Re-point ``.grad`` at the flat buffer where user code replaced it.

        ``model.zero_grad()`` (set_to_none) or an assignment to ``p.grad`` would otherwise make
        autograd accumulate outside the buffer that gets reduced: the step would silently use
        stale or zero gradients. None means zeroed; another tensor is copied in.
        """
        for p, view in self._views.items():
            grad = p.grad
            if grad is view or p.data.numel() == 0:
                continue
            if grad is None:
                view.zero_()
            else:
                view.copy_(grad)
            p.grad = view

    def has(self, p: nn.Parameter) -> bool:
        return p in self._unit_index

    def unit_of(self, p: nn.Parameter) -> int:
        return self._unit_index[p][0]

    def start_backward(self, boundary: bool, units: Sequence[int] | None = None) -> None:
        """Called before each backward: ``boundary`` marks the last micro-batch of a window.

        ``units`` limits what this backward reduces (a pipeline pass: one chunk's units; the
        others' gradients do not change in it); default every unit. The engine calls it before
        a forward that records autograd too, since a gradient can arrive during the forward (a
        custom function that runs backward inside its forward, as DeepSpeed's
        TiledFusedLogitsLoss does): it then holds until ``finish_backward``. Between the end of
        that forward (:meth:`end_forward`) and the next ``start_backward`` a gradient is refused
        (``loss.backward()`` called directly would otherwise never be reduced).
        """
        self._accepting = True
        if self._open and units is None:
            self.boundary = boundary  # the backward's word wins (engine.no_sync() may have ended between)
            return  # opened by the forward: a gradient may already have arrived in it
        self._open = True
        self.boundary = boundary
        if self.accumulate_full:
            self._repair_grad_views()
        self._ready = [0] * len(self.units)
        self._launched = [False] * len(self.units)
        wanted = None if units is None else set(units)
        self._order = self.launch_order if wanted is None else [ui for ui in self.launch_order if ui in wanted]
        self._next = 0
        self._arrived.clear()

    def end_forward(self) -> None:
        """The engine's forward returned: gradients wait for the engine's backward now."""
        self._accepting = False

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self._accepting:
            raise GradientArrivalError(
                "Direct calls to tensor.backward() bypass the engine: a parameter's gradient arrived outside "
                "engine.backward(loss), so ZeRO would never reduce it. Call engine.backward(loss) instead of "
                "loss.backward() (it scales the loss for gradient accumulation and fp16 too)")
        if getattr(p, "ds_grad_is_ready", True) is False:
            return  # DeepSpeed's protocol (TiledMLP): more of this gradient follows in this backward
        ui, pi = self._unit_index[p]
        unit = self.units[ui]
        self.received[ui][pi] = True
        again = p in self._arrived
        if again and self._launched[ui]:
            raise GradientArrivalError(
                f"a gradient of a parameter of shape {tuple(p.shape)} arrived again after its ZeRO unit was "
                "reduced in this backward: it took part in two separate autograd backward passes (a custom "
                "autograd function running backward per chunk, say), and the later part would be lost. "
                "Set param.ds_grad_is_ready = False before every backward but the last (DeepSpeed's protocol, "
                "which its TiledMLP follows), or compute the gradient in one backward")
        self._arrived.add(p)
        if self.accumulate_full:
            self._ensure_unit(ui)  # the unit's first gradient of the step moves into its new buffer
            view = self._views[p]
            if p.grad is not view:  # a param gathered since the views were installed
                view.add_(p.grad.reshape(view.shape))
                p.grad = view
            if not self.boundary or again:  # autograd added into the .grad view: nothing to do
                return
        elif not again and self._staging[ui] is None and self._takes_grad(unit, p.grad):
            self._staging[ui] = p.grad.detach().view(-1)  # the gradient is the unit: no copy
            p.grad = None
        else:
            staging = self._staging_for(ui)
            off, n = unit.offsets[pi], unit.numels[pi]
            target = staging[off : off + n]
            target.add_(p.grad.reshape(-1)) if again else target.copy_(p.grad.reshape(-1))
            p.grad = None
            if again:
                return
        self._ready[ui] += 1
        self._launch_in_order()

    def _launch_in_order(self, everything: bool = False) -> None:
        """Launch this backward's units in launch order while the next one is complete (or all, at the end)."""
        order = self._order
        while self._next < len(order):
            ui = order[self._next]
            if not everything and self._ready[ui] < len(self.units[ui].params):
                return
            self._next += 1
            self._launch(ui)

    @staticmethod
    def _takes_grad(unit: FlatUnit, grad: torch.Tensor) -> bool:
        """Whether a gradient can serve as its unit's staging buffer as it is: the unit's only
        param, no padding, same dtype and device, contiguous (a large embedding or head then
        costs no second copy of its gradient while it is reduced)."""
        return (len(unit.params) == 1 and unit.padded == unit.numel and grad.is_contiguous()
                and grad.dtype == unit.dtype and grad.device == unit.device)

    def _staging_for(self, ui: int) -> torch.Tensor:
        """The unit's full-size staging buffer; uninitialized except the padding (zeroed)."""
        if self._staging[ui] is None:
            unit = self.units[ui]
            staging = torch.empty(unit.padded, dtype=unit.dtype, device=unit.device)
            staging[unit.numel :].zero_()
            self._staging[ui] = staging
        return self._staging[ui]

    def _zero_missing(self, ui: int, staging: torch.Tensor) -> None:
        """Zero the slices of params that got no gradient (only a unit launched incomplete)."""
        unit = self.units[ui]
        if self._ready[ui] == len(unit.params):
            return
        for p, off, n in zip(unit.params, unit.offsets, unit.numels):
            if p not in self._arrived:
                staging[off : off + n].zero_()

    def _launch(self, ui: int) -> None:
        if self._launched[ui]:
            return
        self._launched[ui] = True
        unit = self.units[ui]
        work, finish = self._reduce(ui, unit)
        self._pending.append((work, finish, ui))
        # Overlap at most MAX_IN_FLIGHT units: each in-flight unit holds a full-size
        # staging buffer (stages 2-3), so an unbounded queue would hold every gradient.
        self._drain(keep=self.MAX_IN_FLIGHT if self.overlap else 0)
        if self.on_unit_reduced is not None:
            self.on_unit_reduced(unit)

    def _reduce(self, ui: int, unit: FlatUnit) -> tuple[dist.Work | Pending | None, Callable[[], None] | None]:
        """Start the unit's collective; return its handle and what to do once it is done."""
        self._ensure_unit(ui)  # a unit that got no gradient on this rank contributes zeros
        group = shard_group_of(unit, self.group)
        if unit.world == 1:
            if self.accumulate_full:
                if (self.group_size if group is self.group else dist.get_world_size(group)) == 1:
                    return None, None
                return dist.all_reduce(unit.grad_full, op=AVG, group=group, async_op=True), None
            staging, self._staging[ui] = self._staging_for(ui), None
            self._zero_missing(ui, staging)
            return None, lambda: unit.grad_shard.add_(staging)
        if self.accumulate_full:
            return self._reduce_to_shard(unit.grad_full, unit.grad_shard, group, accumulate=False), None
        staging = self._staging_for(ui)
        self._staging[ui] = None
        self._zero_missing(ui, staging)
        fresh, self._shard_fresh[ui] = self._shard_fresh[ui], False
        return self._reduce_to_shard(staging, unit.grad_shard, group, accumulate=not fresh), None

    def _drain(self, keep: int = 0) -> None:
        """Complete the oldest pending collectives until at most ``keep`` remain."""
        while len(self._pending) > keep:
            work, finish, _ = self._pending.pop(0)
            if work is not None:
                work.wait()
            if finish is not None:
                finish()

    def reap(self) -> None:
        """Finish the oldest reductions that have completed, without waiting for the others: their
        staging buffers (the gradients themselves, for a unit of one large parameter) are freed
        now rather than at the next backward's launches."""
        while self._pending and (self._pending[0][0] is None or self._pending[0][0].is_completed()):
            self._drain(keep=len(self._pending) - 1)

    def settle(self, units: Sequence[FlatUnit]) -> None:
        """Finish the pending reductions up to the last one of ``units`` (and those before it):
        stage 3 calls it before gathering a unit whose previous gradient may still be on the wire
        (an embedding's, launched last in a pipeline's backward pass, when the next forward pass
        gathers the table), so its staging buffer is freed before the full buffer is made. On NCCL
        the gather, queued on the same stream, would wait for that reduction anyway."""
        wanted = {id(u) for u in units}
        last = max((i for i, (_, _, ui) in enumerate(self._pending) if id(self.units[ui]) in wanted), default=-1)
        if last >= 0:
            self._drain(keep=len(self._pending) - last - 1)

    def finish_backward(self, wait: bool = True) -> None:
        """After backward: reduce units whose params got no gradient, then (``wait``) wait for all."""
        self._open = self._accepting = False
        if self.accumulate_full and not self.boundary:
            return
        self._launch_in_order(everything=True)
        if wait:
            self._drain()

    def wait(self) -> None:
        """Wait for every reduction launched so far."""
        self._drain()

    def remove_hooks(self) -> None:
        """Detach the gradient-readiness hooks from the parameters (the engine is being destroyed)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def zero_grad(self) -> None:
        """Zero the buffers that exist and keep them (``zero_grad(set_to_none=False)``)."""
        for unit in self.units:
            if unit.grad_shard is not None:
                (unit.grad_full if self.accumulate_full else unit.grad_shard).zero_()
        for p, view in self._views.items():
            p.grad = view if p.data.numel() else None
        self._reset_window()

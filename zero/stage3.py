"""ZeRO stage 3: gather each fetch unit's parameters just before use, release them after.

Forward: a module's pre-hook gathers its units (waiting for a prefetch if one is in
flight) and starts gathering the next units in the recorded execution order; the post-hook
releases them and hooks the module's outputs so that backward gathers them again before
the module's backward runs (and prefetches the units that backward reaches next). Units are
released in backward once their gradients have been handed to the reducer.

Frozen units (parameters with ``requires_grad=False``, such as a LoRA model's base) are
gathered with their fetch module like the trainable ones; having no gradient to reduce, they are
released in backward once the backward has moved past their module (the pre-backward hook of
the module before it releases those of the modules after it), or when the pass ends.

The root units (the final norm, a tied embedding and head: every parameter outside the
fetch modules) are gathered for the whole forward-backward of a micro-batch; a tied embedding
is used at both ends of the model, so gathering it once is also the cheapest. Besides the
repeated blocks, two kinds of module outside them are fetch modules (``zero.partition``):

* the input embedding (``get_input_embeddings()``: ``nn.Embedding`` or a class flagged
  ``backward_reads_no_weights``; untied, or a tied copy on a pipeline's first stage) is
  gathered for its forward only: its backward reads the indices, not the table. Its gradient
  still needs the parameter's shape, so for backward its params take shape-only placeholders
  (``FlatUnit.shapes_only``) instead of being gathered again. Code that reads the table's
  weight outside its forward finds an empty tensor (and fails loudly);
* an untied head is kept gathered from its forward until its gradient is reduced (its backward
  follows at once), so it is not whole through the rest of backward; an ``nn.Linear`` head
  hands its weight back inside its backward, between the input and the weight gradient
  (``zero.head``), so the whole weight and the whole weight gradient are never alive together.

Under pipeline stages both are gathered once per micro-batch instead of once per step
(``pipeline.keep_full_gradients`` holds everything for the step instead).

The execution order is recorded during the first forward and held fixed afterwards (as in
DeepSpeed and FSDP); prefetch never holds more than ``max_live_numel`` gathered elements.
Under pipeline stages each chunk of the rank runs its own blocks, in passes that interleave
with the other chunks' and with backward passes: the order is then recorded and checked per
chunk (``module_keys``), and prefetch stays within the chunk.
Every gather is a collective, so all data-parallel ranks must run the same fetch modules in
the same order: the first forward checks that they agree, module by module (one small
all-reduce each, first forward only), and every later forward must repeat that sequence. A
rank that deviates (a block skipped by layer drop or early exit, say) raises
``FetchOrderError`` before it issues a gather that the other ranks would not match. Modules *inside* a fetch module (the experts
of a mixture-of-experts layer) may run or not as they like: the block is gathered whole.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

from zero.comm import Pending, gather_shards
from zero.flat import FlatUnit, shard_group_of
from zero.head import can_release_early, releasing_forward


class FetchOrderError(RuntimeError):
    """A stage-3 fetch module ran out of the order every rank must follow."""


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
            when the caller holds everything gathered for a whole step.
        module_keys: per fetch module, the sequence it belongs to (its gradient-sync set, a
            pipeline chunk's say); each key's order is recorded, checked and prefetched along
            on its own. Default: one.
        held_to_backward: fetch modules kept gathered from their forward until their gradients
            are reduced (the head, whose backward comes right after its forward).
        release_early: those of ``held_to_backward`` (an ``nn.Linear`` head without bias) whose
            backward hands the gathered weight back before making its gradient (``zero.head``).
        settle: called with a fetch module's units before they are gathered around a use:
            finishes a reduction of their gradients still in flight (``GradientReducer.settle``).
    """

    def __init__(
        self,
        module_units: Sequence[tuple[nn.Module, list[FlatUnit]]],
        root_units: Sequence[FlatUnit],
        group: dist.ProcessGroup | None,
        prefetch_numel: int,
        max_live_numel: int,
        module_hooks: bool = True,
        module_keys: Sequence[Hashable] | None = None,
        held_to_backward: Sequence[nn.Module] = (),
        settle: Callable[[Sequence[FlatUnit]], None] | None = None,
        release_early: Sequence[nn.Module] = (),
        gather: Callable[[torch.Tensor, torch.Tensor, dist.ProcessGroup | None], Pending] = gather_shards,
        secondary_group: dist.ProcessGroup | None = None,
        secondary_until_step_end: bool = False,
    ) -> None:
        self.module_units = list(module_units)
        self._secondary_group = secondary_group  # ZeRO++'s hpZ (see _secondary_parts)
        self._secondary: dict[int, torch.Tensor] = {}  # unit id -> this rank's part of its secondary partition
        # pipelines: a block's forwards and backwards of the step's micro-batches interleave, and
        # every one of them gathers from the copy kept since the first forward (the same values)
        self._secondary_until_step_end = secondary_until_step_end
        self._gather = gather  # gather_shards, or zero.quantized_comm's int8 one (zero_quantized_weights)
        self.root_units = list(root_units)
        self.group = group
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self._in_flight: dict[int, tuple[Pending, FlatUnit]] = {}
        self._held: dict[int, int] = {}  # unit id -> open GatheredParameters contexts holding it
        self._key = list(module_keys) if module_keys is not None else [0] * len(self.module_units)
        keys = set(self._key)
        self._order: dict[int, list[int]] = {k: [] for k in keys}  # fetch modules by first use (prefetch)
        self._sequence: dict[int, list[int]] = {k: [] for k in keys}  # every forward of one pass, recorded once
        self._cursor = dict.fromkeys(keys, 0)
        self._recording = dict.fromkeys(keys, True)
        self._in_whole_forward = False  # between start_forward and end_forward
        self._position: dict[int, int] = {}  # fetch module -> its place in its key's order
        self._module_of = {p: mi for mi, (_, units) in enumerate(self.module_units) for u in units for p in u.params}
        self._input_pass: int | None = None  # the key of a running input-gradient-only backward
        # fetch modules whose backward reads none of their weights: never gathered for backward
        self._weightless = [backward_reads_no_weights(module) for module, _ in self.module_units]
        self._settle = settle
        kept = {id(m) for m in held_to_backward}
        self._held_to_backward = [id(module) in kept for module, _ in self.module_units]
        self._hooks = []
        for mi, (module, _) in enumerate(self.module_units if module_hooks else ()):
            self._hooks.append(module.register_forward_pre_hook(functools.partial(self._pre_forward, mi)))
            self._hooks.append(module.register_forward_hook(functools.partial(self._post_forward, mi),
                                                            with_kwargs=True))
        early = {id(m) for m in release_early}
        self._open_uses: dict[int, int] = {}  # early-releasing head -> its uses whose backward is to come
        self._early_of_unit: dict[int, int] = {}
        for mi, (module, units) in enumerate(self.module_units if module_hooks else ()):
            if id(module) in early and self._held_to_backward[mi] and can_release_early(module):
                self._open_uses[mi] = 0
                self._early_of_unit.update({id(u): mi for u in units})
                module.forward = releasing_forward(module, functools.partial(self._open_use, mi),
                                                   functools.partial(self._release_for_weight_gradient, mi))

    @property
    def once_per_use_units(self) -> list[FlatUnit]:
        """Units of the fetch modules gathered once per use rather than for forward and again for
        backward: embedding tables (forward only) and heads (held from forward to backward)."""
        return [u for mi, (_, units) in enumerate(self.module_units)
                if self._weightless[mi] or self._held_to_backward[mi] for u in units]

    def remove_hooks(self) -> None:
        """Detach the gather/release hooks from the fetch modules (the engine is being destroyed)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for mi in self._open_uses:  # the heads whose forward was replaced
            self.module_units[mi][0].__dict__.pop("forward", None)
        self._open_uses, self._early_of_unit = {}, {}

    def _open_use(self, mi: int) -> None:
        self._open_uses[mi] += 1

    def _release_for_weight_gradient(self, mi: int) -> None:
        """Inside a head's backward, its input gradient made: once no other use of the head waits
        for its backward (a head called twice in one forward), free the gathered weight (unless a
        GatheredParameters context holds it) and give autograd its shape for the weight gradient.
        A later backward through the head is preceded by its pre-backward gather again."""
        self._open_uses[mi] = max(0, self._open_uses[mi] - 1)
        if self._open_uses[mi]:
            return
        units = self.module_units[mi][1]
        self.release(units)
        for unit in units:
            unit.shapes_only()

    def live_numel(self) -> int:
        gathered = sum(u.padded for _, us in self.module_units for u in us if u.is_materialized)
        return gathered + sum(unit.padded for _, unit in self._in_flight.values())

    def _start_gather(self, unit: FlatUnit) -> None:
        if unit.is_materialized or id(unit) in self._in_flight:
            return
        secondary = self._secondary.get(id(unit))
        if secondary is not None:  # hpZ: backward gathers the copy kept since forward, inside the node
            work = gather_shards(unit.allocate_full(), secondary, self._secondary_group)
        else:
            work = self._gather(unit.allocate_full(), unit.shard, shard_group_of(unit, self.group))
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

    def _secondary_parts(self, units: Sequence[FlatUnit]) -> dict[int, torch.Tensor]:
        """hpZ: before a block's forward releases its units, keep this rank's 1/H of each gathered
        buffer (H ranks of the secondary group), so that its backward gathers them from there: the
        same values, over the node's links instead of every shard rank's (ZeRO++, section 3.2).
        Dropped when the unit is released again after its backward, or under pipeline stages
        (``secondary_until_step_end``) at the step's end (`release_all`)."""
        world, rank = dist.get_world_size(self._secondary_group), dist.get_rank(self._secondary_group)
        parts = {}
        for unit in units:
            if unit.is_materialized and not unit.persistent and id(unit) not in self._held:
                part = unit.padded // world
                parts[id(unit)] = unit.full[rank * part : (rank + 1) * part].clone()
        return parts

    def release(self, units: Sequence[FlatUnit]) -> None:
        for unit in units:
            if not self._secondary_until_step_end:
                self._secondary.pop(id(unit), None)
            if id(unit) in self._early_of_unit:  # released: uses counted before are over (or never ran)
                self._open_uses[self._early_of_unit[id(unit)]] = 0
            if id(unit) in self._in_flight:
                work, _ = self._in_flight.pop(id(unit))
                work.wait()
                unit.mark_materialized()
            if id(unit) not in self._held:
                unit.release()

    def hold(self, units: Sequence[FlatUnit]) -> None:
        """Materialize ``units`` and keep them so until ``unhold`` (module hooks do not release them)."""
        self.gather(units)
        for unit in units:
            self._held[id(unit)] = self._held.get(id(unit), 0) + 1

    def unhold(self, units: Sequence[FlatUnit], release: Sequence[FlatUnit]) -> None:
        """End one ``hold`` of ``units``; release those of ``release`` that no other hold keeps."""
        for unit in units:
            count = self._held.pop(id(unit)) - 1
            if count:
                self._held[id(unit)] = count
        self.release(release)

    def gather_modules_of(self, params) -> None:
        """Materialize the fetch modules that hold ``params`` (params outside them are root units) for
        their weight gradients; a module whose backward reads no weights only gets its shapes."""
        for mi in dict.fromkeys(self._module_of[p] for p in params if p in self._module_of):
            self._ready_for_backward(mi)

    def _ready_for_backward(self, mi: int) -> None:
        if self._weightless[mi]:
            for unit in self.module_units[mi][1]:
                unit.shapes_only()
        else:
            self._gather_for_use(mi)

    def _gather_for_use(self, mi: int) -> None:
        units = self.module_units[mi][1]
        if self._settle is not None and not all(u.is_materialized for u in units):
            self._settle(units)
        self.gather(units)

    def begin_input_pass(self, key: Hashable) -> None:
        """A backward that computes input gradients only (``zb_h1``'s B) starts on ``key``'s
        blocks: a block is released as soon as the backward has moved past it (no weight
        gradient will be reduced in this pass, so no reduction releases it)."""
        self._input_pass = key

    def release_key(self, key: Hashable) -> None:
        """Release every fetch module of ``key`` (a gradient-sync set); ends an input pass."""
        self._input_pass = None
        for mi, (_, units) in enumerate(self.module_units):
            if self._key[mi] == key:
                self.release(units)

    def gather_root(self) -> None:
        self.gather(self.root_units)

    def gather_all(self) -> None:
        """Materialize every unit (held for a whole step)."""
        self.gather(self.root_units + [u for _, us in self.module_units for u in us])

    def release_all(self) -> None:
        """Release every gathered unit (end of a step, or after a forward without grad), and drop
        hpZ's secondary copies: an optimizer step may follow, after which they would be stale."""
        self.release(self.root_units)
        for _, units in self.module_units:
            self.release(units)
        self._secondary.clear()

    def _prefetch_after(self, mi: int, step: int) -> None:
        """Start gathering the modules that follow ``mi`` in execution order (step -1: backward)."""
        if self.prefetch_numel <= 0 or mi not in self._position:
            return
        order = self._order[self._key[mi]]
        pos = self._position[mi] + step
        budget = self.prefetch_numel
        while 0 <= pos < len(order) and budget > 0:
            if step < 0 and self._weightless[order[pos]]:  # its backward gathers nothing
                pos += step
                continue
            units = self.module_units[order[pos]][1]
            size = sum(u.padded for u in units if not u.is_materialized)
            if self.live_numel() + size > self.max_live_numel:
                return
            for unit in units:
                self._start_gather(unit)
            budget -= size
            pos += step

    def start_forward(self, whole_model: bool = False) -> None:
        """A forward pass begins (ends the recording of the first one): of the whole model, until
        ``end_forward``, or (a pipeline's window) of passes that interleave with backward ones."""
        for key, sequence in self._sequence.items():
            if sequence:
                self._recording[key] = False
            self._cursor[key] = 0
        self._in_whole_forward = whole_model

    def end_forward(self) -> None:
        """The whole model's forward returned (a pipeline's passes never call it)."""
        self._in_whole_forward = False

    def _follow_order(self, mi: int) -> None:
        """Record the first pass's sequence (of ``mi``'s key); check every later pass against it."""
        key = self._key[mi]
        sequence = self._sequence[key]
        if self._recording[key]:
            self._agree(mi)
            if mi not in self._position:
                self._position[mi] = len(self._order[key])
                self._order[key].append(mi)
            sequence.append(mi)
            self._cursor[key] = len(sequence)
            return
        if self._cursor[key] >= len(sequence):
            self._cursor[key] = 0  # a new pass through the model (or the chunk) without start_forward
        expected = sequence[self._cursor[key]]
        if mi != expected:
            self._order_error(mi, expected)
        self._cursor[key] += 1

    def _agree(self, mi: int) -> None:
        """First pass: every rank runs the same fetch module here, checked with one small all-reduce.

        Later passes repeat the recorded sequence and are checked locally, without communication.
        """
        if not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return
        seen = torch.tensor([mi, -mi], dtype=torch.int64, device=self.module_units[mi][1][0].device)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=self.group)
        highest, lowest = int(seen[0]), -int(seen[1])
        if highest != lowest:
            self._order_error(mi, lowest if mi == highest else highest, elsewhere=True)

    def _order_error(self, mi: int, expected: int, elsewhere: bool = False) -> None:
        def name(i: int) -> str:
            return f"fetch module #{i} ({type(self.module_units[i][0]).__name__})"

        where = "ran on another data-parallel rank" if elsewhere else "was due"
        raise FetchOrderError(
            f"ZeRO stage 3: {name(mi)} ran on this rank where {name(expected)} {where}. Stage 3 "
            "gathers each block's parameters with a collective, so every data-parallel rank must "
            "run the same blocks in the same order (later forwards repeating the first one's); a "
            "block skipped on some ranks (layer drop, early exit, an expert without tokens) cannot "
            "be gathered in agreement. Run every block on every rank, name the module that holds "
            "such blocks in the model's _no_split_modules (it is then gathered whole), or use ZeRO stage 2."
        )

    def _pre_forward(self, mi: int, module: nn.Module, args) -> None:
        recompute = torch._C._current_graph_task_id() != -1  # a forward re-run inside backward
        if not recompute:
            self._follow_order(mi)
        self._gather_for_use(mi)
        if not recompute:
            self._prefetch_after(mi, +1)

    def _post_forward(self, mi: int, module: nn.Module, args, kwargs, output):
        if torch._C._current_graph_task_id() != -1:
            # A forward re-run inside backward (activation checkpointing): its backward
            # follows at once and needs the params, which the reducer releases afterwards.
            return output
        units = self.module_units[mi][1]
        if not (self._held_to_backward[mi] and torch.is_grad_enabled()):
            keep = self._secondary_group is not None and torch.is_grad_enabled()
            parts = self._secondary_parts(units) if keep else {}
            self.release(units)
            self._secondary.update(parts)
        if torch.is_grad_enabled():
            hook = functools.partial(self._pre_backward, mi)
            for t in tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(hook)
                    if t._is_view() and t._base.grad_fn is not None and _made_inside(t._base, args, kwargs):
                        # An in-place op on a view output (``x = linear(x3d); x += y``) moves the view
                        # to a new graph node and drops its hook; the base's node stays in the graph.
                        t._base.register_hook(hook)
        return output

    def _pre_backward(self, mi: int, grad: torch.Tensor) -> None:
        key = self._key[mi]
        if not self._in_whole_forward:  # a backward inside the forward (a fused loss) ends no recording
            self._recording[key] = False
        if self._input_pass == key and mi in self._position:  # the blocks after mi are done
            for later in self._order[key][self._position[mi] + 1:]:
                self.release(self.module_units[later][1])
        self._release_frozen_after(mi)
        self._ready_for_backward(mi)
        self._prefetch_after(mi, -1)

    def _release_frozen_after(self, mi: int) -> None:
        """Backward has reached ``mi``: the fetch modules after it in its key's order are done with
        their backward, so their frozen units (no gradient, so no reduction to release them after)
        are released. The trainable units are released by the reducer as their gradients complete."""
        if mi not in self._position:
            return
        for later in self._order[self._key[mi]][self._position[mi] + 1:]:
            frozen = [u for u in self.module_units[later][1] if u.frozen and u.is_materialized]
            if frozen:
                self.release(frozen)

    def release_frozen(self, key: Hashable) -> None:
        """A backward pass over ``key``'s fetch modules (a gradient-sync set) has ended: release their
        frozen units still gathered (the earliest module's, which no later backward follows)."""
        for mi, (_, units) in enumerate(self.module_units):
            if self._key[mi] == key:
                self.release([u for u in units if u.frozen])

    def end_step_recording(self) -> None:
        """Freeze the recorded execution order after the first forward-backward."""
        self._recording = dict.fromkeys(self._recording, False)


def _made_inside(base: torch.Tensor, args, kwargs) -> bool:
    """Whether ``base`` is none of the module's inputs (nor their base): a view of an input is no
    output of the module, its gradient arrives after the module's backward."""
    return not any(isinstance(x, torch.Tensor) and (x is base or x._base is base) for x in tree_leaves((args, kwargs)))


def backward_reads_no_weights(module: nn.Module) -> bool:
    """``nn.Embedding`` itself (not a subclass: its forward may use the weight otherwise; nor one
    with ``sparse`` gradients or a ``max_norm`` that renormalizes the weight in place), or a module
    whose class says so with ``backward_reads_no_weights = True`` (Zero3D's vocabulary-parallel
    embedding). Their backward scatters the output gradient by the indices: given shape-only
    placeholders, the gradient is exact. A module that claims this wrongly would get gradients
    computed from zeros."""
    if type(module) is nn.Embedding:
        return not module.sparse and module.max_norm is None
    return getattr(type(module), "backward_reads_no_weights", False) is True

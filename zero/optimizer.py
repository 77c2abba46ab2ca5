"""The ZeRO optimizer: sharded fp32 master weights and optimizer states over one dp group.

It knows nothing of tensor or pipeline parallelism: what it needs of the rest of the job comes
in the records of ``zero.inputs`` (the process groups by use, from the mesh's collection; which
params the norm counts how; the caller's gradient-sync sets; stage 3's fetch modules).

The inner ``torch.optim`` optimizer sees one tensor per (parameter, shard) intersection, a
*piece*: a view into the flat fp32 master shard. Its states are still shard-sized, but a
parameter that got no gradient on any rank in a step gets ``.grad = None`` and is skipped
exactly as ``torch.optim`` skips it on one process (no weight decay, no moment decay, no
step count), and per-parameter step counts stay per parameter.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from zero.comm import AVG, gather_shards, reduce_to_shard
from zero.dp_groups import DataParallelGroups
from zero.quantized_comm import gather_shards_int8, reduce_to_shard_int8
from zero.flat import FlatUnit, shard_group_of
from zero.grads import GradientReducer, UnusedParametersError
from zero.inputs import FetchModules, GradSyncSets, NormShares, ZeroGroups
from zero.loss_scaler import LossScaler
from zero.offload import Offloader, OffloadSettings
from zero.partition import UnitLayout, bucketed_layout, fetch_unit_layout
from zero.sizing import HOST_CATEGORIES
from zero.stage3 import ParamFetcher

logger = logging.getLogger(__name__)

_IMPLEMENTATION_OPTIONS = frozenset({"fused", "capturable", "foreach", "differentiable"})
OptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]
ValueProvider = Callable[[dict[nn.Parameter, tuple[int, int, torch.Tensor]]], None]


@dataclass
class ZeroSettings:
    """The knobs of the ZeRO engine (DeepSpeed's ``zero_optimization`` section, resolved)."""

    stage: int = 0
    overlap_comm: bool = True
    reduce_bucket_size: int = 500_000_000
    prefetch_bucket_size: int = 50_000_000
    param_persistence_threshold: int = 100_000
    max_live_parameters: int = 1_000_000_000
    gradient_clipping: float = 0.0
    windowed: bool = False
    """The caller drives the backward passes of a step (a pipeline schedule does): it brackets
    the step with :meth:`ZeroOptimizer.begin_window` / :meth:`~ZeroOptimizer.finish_window` and
    each backward pass over one gradient-sync set (``zero.inputs.GradSyncSets``) with
    :meth:`~ZeroOptimizer.begin_pass` / :meth:`~ZeroOptimizer.end_pass` instead of
    ``start_backward`` / ``finish_backward``. Stage 3 gathers each block around each use, as
    otherwise, and holds the root units (embedding, norm, head) for the step."""
    keep_full_gradients: bool = False
    """Under ``windowed``, stages 2-3: accumulate full gradients through the step and reduce
    each sync set's once, after its last pass (one reduction per step instead of one per pass, at
    a full gradient buffer's memory). Stages 0-1 always do. Stage 3 then also holds all its
    params gathered for the step (one gather per step)."""
    check_overflow: bool = True
    """Skip a step whose gradient norm is not finite (always under fp16; DeepSpeed's
    ``bf16.check_grad_overflow`` turns it off for bf16)."""
    gradient_sum: bool = False
    """Step with the sum of the data-parallel ranks' gradients instead of their mean."""
    data_parallel_size: int | None = None
    """The ranks given different data (``gradient_sum`` steps with their sum: the mean times this);
    None: every rank of the shard and replica groups. Context-parallel ranks share ZeRO's shard
    group but not data, so they are not counted."""
    offload: OffloadSettings = OffloadSettings()
    """What lives in host memory (ZeRO-Offload; zero/offload.py)."""
    quantized_weights: bool = False
    """Stage 3: gather parameters as int8 with block scales (ZeRO++'s qwZ, zero.quantized_comm)."""
    quantized_gradients: bool = False
    """Reduce gradients into shards as int8 with block scales in one all-to-all (ZeRO++'s qgZ)."""
    ignore_unused_parameters: bool = True
    """False: a step raises :class:`~zero.grads.UnusedParametersError` when a parameter got no
    gradient in the whole window on every data-parallel rank (DeepSpeed's key of that name)."""


@dataclass(frozen=True)
class Piece:
    """The part of parameter ``param`` of unit ``unit`` that lies in this rank's shard."""

    unit: int
    param: int
    start: int  # offsets within the shard
    stop: int


def shard_pieces(units: Sequence[FlatUnit]) -> list[Piece]:
    """Every non-empty (parameter, shard) intersection, unit by unit (padding belongs to none)."""
    pieces = []
    for ui, unit in enumerate(units):
        lo, hi = unit.shard_range
        for pi, start, stop in unit.param_ranges(lo, hi):
            if start < stop:
                pieces.append(Piece(ui, pi, start - lo, stop - lo))
    return pieces


def launch_order(units: Sequence[FlatUnit], param_order: Sequence[nn.Parameter]) -> list[int]:
    """Unit indices in the order their gradients are expected to complete.

    Backward produces gradients roughly in reverse registration order, and a unit is complete
    when its earliest-registered parameter's gradient arrives, so units go by that parameter's
    position, latest first.
    """
    position = {id(p): i for i, p in enumerate(param_order)}
    earliest = [min(position.get(id(p), len(position)) for p in unit.params) for unit in units]
    return sorted(range(len(units)), key=lambda ui: (-earliest[ui], ui))


def _partition(params: Sequence[nn.Parameter], key: Callable[[nn.Parameter], Hashable]) -> list[list[nn.Parameter]]:
    """``params`` split by ``key``, parts in order of first appearance, order kept within each."""
    parts: dict[Hashable, list[nn.Parameter]] = {}
    for p in params:
        parts.setdefault(key(p), []).append(p)
    return list(parts.values())


class ZeroOptimizer:
    """Shards master weights and optimizer states (1), gradients (2) and parameters (3).

    Args:
        param_groups: the trainable parameters, as torch-style groups (dicts with
            ``params`` and per-group options such as ``lr`` or ``weight_decay``).
        optimizer_factory: builds the inner ``torch.optim`` optimizer from groups of master
            shards; its states are shard-sized by construction.
        groups: the process groups, by use (``zero.inputs.ZeroGroups``: the mesh's collection).
        settings: stage, buckets, clipping.
        dtype: working precision of the params (fp32, bf16 or fp16); masters are fp32.
        loss_scaler: the fp16 loss scaler (a static scale of 1 otherwise).
        fetch: stage 3's fetch units (``zero.inputs.FetchModules``).
        norm: the params split over ``groups.tp`` or counted by another rank
            (``zero.inputs.NormShares``); units never mix params the norm treats differently.
        sync: the caller's gradient-sync sets and the params it sums with tied copies elsewhere
            (``zero.inputs.GradSyncSets``); a unit never spans two sets, so each set's units can be
            reduced around its own backward passes (``settings.windowed``).
        param_order: the model's parameters in registration order (default: as grouped);
            it decides the order in which units are reduced.
        initial_values: for params that have no values yet (built on the meta device): a
            callable given ``{param: (start, stop, flat)}`` that writes elements [start, stop)
            of each param (its flat layout) into ``flat``, a view of this rank's buffers, with
            values that are the same on every rank (computed or read identically everywhere,
            so nothing is broadcast). A rank then never holds more than its share. Default:
            the params' current values, broadcast from dp rank 0.
        param_names: each param's name, for messages.
        frozen_params: parameters that are not trained (``requires_grad=False``: a PEFT model's
            base): laid out like the trainable ones, in the working precision, and at stage 3
            sharded, gathered with their fetch module and released after its use, but with no
            gradient, no fp32 master and no optimizer state (``frozen_units``). Their initial
            values come as the trainable ones' do.
        expert_params: expert parallelism: params of which each rank of ``groups.ep`` holds
            different experts. Their units are sharded over ``groups.expert_shard`` (the ranks of
            the shard group holding the same experts) and reduced there; each of their gradients
            already sums every rank's tokens of the expert-parallel group (the all-to-all's
            backward), so the average over ``expert_shard`` is divided by the expert-parallel size
            to give the mean over the whole shard group, as for the other params. Frozen ones (also
            in ``frozen_params``) are laid out over ``expert_shard`` too, and get their values from
            its rank 0. Expert params may also be ``norm.split`` (expert tensor parallelism: each
            expert split over the tensor-parallel group), all of them or none.
    """

    def __init__(
        self,
        param_groups: Sequence[dict],
        optimizer_factory: OptimizerFactory,
        groups: ZeroGroups,
        settings: ZeroSettings,
        dtype: torch.dtype = torch.float32,
        loss_scaler: LossScaler | None = None,
        fetch: FetchModules = FetchModules(),
        norm: NormShares = NormShares(),
        sync: GradSyncSets = GradSyncSets(),
        param_order: Sequence[nn.Parameter] | None = None,
        initial_values: ValueProvider | None = None,
        param_names: Mapping[nn.Parameter, str] | None = None,
        frozen_params: Iterable[nn.Parameter] = (),
        expert_params: Iterable[nn.Parameter] = (),
    ) -> None:
        self.settings = settings
        self.param_names = dict(param_names or {})  # for messages
        replica = _more_than_one(groups.zero_replicate)
        self.dp = DataParallelGroups(groups.zero_shard, replica)
        expert = {id(p) for p in expert_params}
        self.expert_dp = DataParallelGroups(groups.expert_shard, replica) if expert else None
        self.expert_parallel_group = groups.ep if expert else None
        self._expert_parallel_size = dist.get_world_size(groups.ep) if expert else 1
        self.dtype = dtype
        self.loss_scaler = loss_scaler or LossScaler()
        self.norm_groups = list(groups.norm)
        self.model_parallel_group = _more_than_one(groups.tp)
        # Units never mix params the norm treats differently, so it can weigh whole units.
        # Nor params of different sync sets (each set's are reduced around its own backward
        # passes), nor a param tied to a copy elsewhere (its gradient is summed with the copy's) with others.
        split = {id(p) for p in norm.split}
        duplicate = {id(p) for p in norm.counted_elsewhere}
        set_of = dict(sync.set_of)
        tied = {id(p) for p in sync.tied_elsewhere}
        params, origin = [], []
        for gi, g in enumerate(param_groups):
            for kind in ((False, False), (True, False), (False, True), (True, True)):
                ps = [p for p in g["params"] if (id(p) in split, id(p) in duplicate) == kind]
                for part in _partition(ps, lambda p: (set_of.get(p, 0), id(p) if id(p) in tied else None,
                                                      id(p) in expert)):
                    params.append(part)
                    origin.append((gi, *kind))
        frozen = list(dict.fromkeys(frozen_params))
        # frozen parts, no optimizer group: their units are frozen (zero.flat.FlatUnit.frozen); frozen
        # experts (an adapter-trained MoE) are laid out with the experts, over the ranks holding the same ones
        for is_expert in (False, True):
            part = [p for p in frozen if (id(p) in expert) == is_expert]
            if part:
                params.append(part)
        self._expert_parts = {i for i, part in enumerate(params) if id(part[0]) in expert}
        if any(p.is_meta for ps in params for p in ps):
            raise ValueError("parameters on the meta device: give them storage-less tensors on the device first "
                             "(parallel3d.build.meta_init.detach_from_meta) and their values through initial_values")
        device = params[0][0].device
        self._comm_device = device  # where collectives run (offloaded shards are on the host)
        self.layout = self._expert_layout(params, list(fetch.modules), device) if expert else \
            self._layout(params, list(fetch.modules), device)
        trained = len(origin)
        self.units = [u for u in self.layout.units if u.group_index < trained]
        self.frozen_units = [u for u in self.layout.units if u.group_index >= trained]
        for unit in self.frozen_units:
            unit.frozen = True
        self._set_units: dict[Hashable, list[int]] = {}  # gradient-sync set -> its units
        for ui, unit in enumerate(self.units):
            self._set_units.setdefault(set_of.get(params[unit.group_index][0], 0), []).append(ui)
            unit.group_index, unit.model_parallel, duplicated = origin[unit.group_index]
            unit.count_in_norm = not duplicated
        split_experts = {u.model_parallel for u in self.units if u.expert}
        if len(split_experts) > 1:
            raise ValueError("expert parameters must be all model-parallel (expert tensor parallelism) or none")
        # expert tensor parallelism: the expert squares are also summed over the model-parallel group
        self._model_parallel_columns = slice(1, 3) if split_experts == {True} else slice(1, 2)
        # [units, 2]: which squared unit norms count as [replicated, model-parallel] (step-invariant)
        self._norm_weights = torch.tensor(
            [[float(u.count_in_norm and not u.model_parallel and not u.expert),
              float(u.count_in_norm and u.model_parallel and not u.expert), float(u.count_in_norm and u.expert)]
             for u in self.units]
        ).reshape(len(self.units), 3)
        if initial_values is None:
            self._install_values()
        else:
            self._install_given(initial_values)
        self.offloader = Offloader(self.units, settings.offload) if settings.offload.enabled else None
        self.fetcher: ParamFetcher | None = None
        # windowed: stage 3 holds every param gathered for the step, or only the root units
        self._hold_all = settings.windowed and settings.keep_full_gradients
        if settings.stage == 3:
            self.fetcher = ParamFetcher(
                self.layout.module_units,
                self.layout.root_units,
                self.dp.shard,
                prefetch_numel=settings.prefetch_bucket_size,
                max_live_numel=settings.max_live_parameters,
                module_hooks=not self._hold_all,
                module_keys=[set_of.get(units[0].params[0], 0) for _, units in self.layout.module_units],
                held_to_backward=fetch.held_to_backward,
                release_early=list(fetch.release_early),
                settle=lambda units: self.reducer.settle(units),  # the reducer is made below
                gather=gather_shards_int8 if settings.quantized_weights else gather_shards,
                secondary_group=groups.zero_secondary,
                secondary_until_step_end=settings.windowed,
            )
        # one dp rank shards nothing: accumulating into full buffers then saves the staging copies
        full = settings.stage <= 1 or self.dp.shard_world == 1 or (settings.windowed and settings.keep_full_gradients)
        self.reducer = GradientReducer(
            self.units,
            self.dp.shard,
            settings.stage,
            overlap_comm=settings.overlap_comm,
            on_unit_reduced=self._release_after_reduce if self.fetcher and not self._hold_all else None,
            accumulate_full=full,
            launch_order=launch_order(self.units, param_order or [p for ps in params for p in ps]),
            reduce=_gradient_reduce(settings.quantized_gradients, self.dp.shard,
                                    (groups.zero_node, groups.zero_across_nodes) if groups.zero_node else None),
        )
        # Full gradients of a param tied elsewhere are summed with the copy's before they are
        # reduced, so their units wait for finish_window; reduced shards are summed after (same layout).
        tied_units = {self.reducer.unit_of(p) for p in sync.tied_elsewhere if self.reducer.has(p)}
        self._held_units = sorted(tied_units) if full else []
        self.masters = [u.master for u in self.units]
        self.pieces = shard_pieces(self.units)
        self.master_pieces = [nn.Parameter(self.masters[pc.unit][pc.start : pc.stop]) for pc in self.pieces]
        inner_groups = []
        for gi, g in enumerate(param_groups):
            options = {k: v for k, v in g.items() if k != "params"}
            mine = [m for m, pc in zip(self.master_pieces, self.pieces) if self.units[pc.unit].group_index == gi]
            inner_groups.append({"params": mine, **options})
        self.inner = optimizer_factory(inner_groups)
        self.last_grad_norm: float | None = None
        self.skipped_steps = 0
        self._pass_set: Hashable = 0  # the gradient-sync set of the running backward pass

    def _expert_layout(self, params: list[list[nn.Parameter]], fetch_modules: list[nn.Module], device) -> UnitLayout:
        """Lay out the expert parts over the expert shard group and the others over ``group``, as one layout
        (a stage-3 fetch module's units are its dense units, then its expert units)."""
        dense = [i for i in range(len(params)) if i not in self._expert_parts]
        experts = sorted(self._expert_parts)
        layouts = []
        for indices, dp in ((dense, self.dp), (experts, self.expert_dp)):
            if not indices:
                continue
            layout = self._layout([params[i] for i in indices], fetch_modules, device, dp)
            for unit in layout.units:
                unit.group_index = indices[unit.group_index]
                unit.expert, unit.comm_group = dp is self.expert_dp, dp.shard
            layouts.append(layout)
        by_module: dict[int, tuple[nn.Module, list[FlatUnit]]] = {}
        for layout in layouts:
            for module, units in layout.module_units:
                by_module.setdefault(id(module), (module, []))[1].extend(units)
        order = {id(m): i for i, m in enumerate(fetch_modules)}
        return UnitLayout(units=[u for layout in layouts for u in layout.units],
                          module_units=sorted(by_module.values(), key=lambda mu: order[id(mu[0])]),
                          root_units=[u for layout in layouts for u in layout.root_units])

    def _layout(self, params: list[list[nn.Parameter]], fetch_modules: list[nn.Module], device,
                dp: DataParallelGroups | None = None) -> UnitLayout:
        s = self.settings
        dp = dp or self.dp
        world = 1 if s.stage == 0 else dp.shard_world
        rank = 0 if s.stage == 0 else dp.shard_rank
        if s.stage == 3:
            return fetch_unit_layout(
                params,
                fetch_modules,
                bucket_size=s.reduce_bucket_size,
                persistence_threshold=s.param_persistence_threshold,
                rank=rank,
                world=world,
                dtype=self.dtype,
                device=device,
            )
        return bucketed_layout(params, bucket_size=s.reduce_bucket_size, rank=rank, world=world, dtype=self.dtype, device=device)

    def _install_values(self) -> None:
        """Broadcast initial values from dp rank 0 (so every replica starts equal) and shard them."""
        for unit in self.layout.units:
            full = unit.flatten_current()
            (self.expert_dp if unit.expert else self.dp).broadcast(full, src=0)  # the same experts' ranks
            unit.install(full)

    def _install_given(self, provide: ValueProvider) -> None:
        """Have ``provide`` write each param's kept part into this rank's buffers (no communication).

        The buffers start uninitialized (only padding is zeroed), so their pages become
        resident as values arrive: a rank's memory grows to its share, no further.
        """
        kept, wanted = [], {}
        for unit in self.layout.units:
            lo, hi = unit.kept_range
            buffer = torch.empty(hi - lo, dtype=torch.float32, device=unit.device)
            buffer[max(unit.numel, lo) - lo :].zero_()
            kept.append(buffer)
            for pi, start, stop in unit.param_ranges(lo, hi):
                off = unit.offsets[pi]
                wanted[unit.params[pi]] = (start - off, stop - off, buffer[start - lo : stop - lo])
        provide(wanted)
        for unit, values_kept in zip(self.layout.units, kept):
            unit.install_kept(values_kept)

    def _release_after_reduce(self, unit: FlatUnit) -> None:
        """A unit whose gradients are complete is not needed again in this backward (unless held:
        a window's root units, a GatheredParameters context)."""
        self.fetcher.release([unit])

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The shard group (one replica's, under hybrid sharding)."""
        return self.dp.shard

    @property
    def expert_gradient_factor(self) -> float:
        """What an expert unit's reduced gradient shard is multiplied by to be the mean over data-parallel
        ranks: ``1/E`` (it averages the expert shard group's gradients, each of which sums the tokens of
        its ``E``-rank expert-parallel group, by the all-to-all's backward)."""
        return 1.0 / self._expert_parallel_size

    def expert_source(self, dp_rank: int) -> int:
        """The rank of ``expert_dp`` that holds this rank's experts in data-parallel rank ``dp_rank``'s
        expert-parallel group (the groups are blocks of ``E`` consecutive shard ranks)."""
        replica, shard = divmod(dp_rank, self.dp.shard_world)
        return replica * self.expert_dp.shard_world + shard // self._expert_parallel_size

    # -- the step ------------------------------------------------------------------------

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """DeepSpeed's name for the wrapped optimizer (``engine.optimizer.optimizer``): ``inner``, whose
        params are this rank's fp32 master shards and whose ``state`` holds their optimizer states."""
        return self.inner

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's groups: LR schedulers set ``lr`` here."""
        return self.inner.param_groups

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    # DeepSpeed's names for the loss scale on the optimizer initialize returns (its ZeRO optimizers'
    # ``cur_scale`` and ``dynamic_loss_scale``, its fp16 optimizer's ``loss_scale_config``), read-only
    cur_scale = loss_scale

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scaler.dynamic

    @property
    def loss_scale_config(self) -> LossScaler:
        """The scaler, which answers to the names of DeepSpeed's ``LossScaleConfig`` (zero/loss_scaler.py)."""
        return self.loss_scaler

    def start_backward(self, boundary: bool) -> None:
        self.reducer.start_backward(boundary)

    def finish_backward(self) -> None:
        self.reducer.finish_backward()
        if self.fetcher is not None:
            self.fetcher.end_step_recording()
            self.fetcher.release_all()

    # -- windowed (``settings.windowed``): the caller's passes, in this order ---------------
    #   begin_window()                                   once per step (or per evaluation)
    #   begin_pass(set, last) / end_pass()               around every weight-accumulating backward pass
    #   reap_reductions()                                before each block's forward (frees finished reductions;
    #                                                    begin_pass does too)
    #   begin_input_pass(set) / release_blocks(set)      around an input-gradient-only pass (zb_h1's B);
    #   gather_blocks_of(params)                         in its W, before each group of weight gradients
    #   tied_gradients(params) -> summed with the copies after the last pass
    #   finish_window()                                  every reduction done; then step()
    #   end_window()                                     stage 3 releases its params
    # (``set``: a gradient-sync set's id, ``GradSyncSets``; docs/design.md maps these to Megatron's
    # no_sync / start_grad_sync / finish_grad_sync.)

    def begin_window(self) -> None:
        """A windowed step (or evaluation) begins: stage 3 gathers and holds the root units for
        it (every unit with ``keep_full_gradients``); blocks are gathered around each use."""
        if self.fetcher is None:
            return
        self.fetcher.start_forward()
        self.fetcher.hold(self._window_units())
        self.reducer.install_grad_views()

    def _window_units(self) -> list[FlatUnit]:
        fetcher = self.fetcher
        return fetcher.root_units + ([u for _, us in fetcher.module_units for u in us] if self._hold_all else [])

    def begin_pass(self, sync_set: Hashable, last: bool) -> None:
        """A backward pass that accumulates gradients into the params of gradient-sync set
        ``sync_set`` begins (``GradSyncSets``).

        Stages 2-3 reduce-scatter the set's units during and after every pass and keep the
        shard; with full gradients (stages 0-1, ``keep_full_gradients``) the set's units are
        reduced during and after its ``last`` pass of the step only.
        """
        units = [ui for ui in self._set_units.get(sync_set, ()) if ui not in self._held_units]
        self._pass_set = sync_set
        self.reducer.reap()
        self.reducer.start_backward(boundary=last, units=units)

    def gather_blocks_of(self, params: Sequence[nn.Parameter]) -> None:
        """Stage 3, a weight-gradient pass run apart from its backward (``zb_h1``): gather the
        blocks of ``params`` before autograd computes their gradients (it unpacks the weights
        the forward saved); they are released once their units are reduced."""
        if self.fetcher is not None and not self._hold_all:
            self.fetcher.gather_modules_of(params)

    def begin_input_pass(self, sync_set: Hashable) -> None:
        """Stage 3: a backward pass that makes input gradients only (``zb_h1``'s B) begins on the
        blocks of gradient-sync set ``sync_set``."""
        if self.fetcher is not None and not self._hold_all:
            self.fetcher.begin_input_pass(sync_set)

    def release_blocks(self, sync_set: Hashable) -> None:
        """Stage 3: release ``sync_set``'s blocks after an input-gradient pass gathered them."""
        if self.fetcher is not None and not self._hold_all:
            self.fetcher.release_key(sync_set)

    def end_pass(self) -> None:
        """The pass has ended: launch the set's units that got no gradient (zeros), without waiting;
        stage 3 releases the set's frozen units that the pass left gathered."""
        self.reducer.finish_backward(wait=False)
        if self.fetcher is not None and not self._hold_all:
            self.fetcher.release_frozen(self._pass_set)

    def reap_reductions(self) -> None:
        """Between passes (before each block's forward): free the buffers of the reductions that
        have finished. The last units a pass launched (on the first stage the embedding, whose
        gradient is its own staging buffer) would otherwise stay alive through the next forward,
        at the step's activation peak, until the next backward launches its units."""
        self.reducer.reap()

    def tied_gradients(self, params: Sequence[nn.Parameter]) -> list[torch.Tensor]:
        """What to sum with the tied copies of ``GradSyncSets.tied_elsewhere`` params: the full
        gradient while it is still held for that sum (full gradients), else the reduced shard (its
        unit holds it alone, laid out the same on every holder). An empty tensor for a param ZeRO
        does not train."""
        self.reducer.wait()
        self.reducer.ensure_buffers()  # zeros where this stage's copy got no gradient
        out = []
        for p in params:
            if not self.reducer.has(p):
                out.append(torch.zeros(0, device=self.units[0].device if self.units else None))
                continue
            unit = self.units[self.reducer.unit_of(p)]
            out.append(unit.grad_full if self.reducer.accumulate_full else unit.grad_shard)
        return out

    def finish_window(self) -> None:
        """Reduce the held units (after the tied sum) and wait for every reduction of the step."""
        if self._held_units:
            self.reducer.start_backward(boundary=True, units=self._held_units)
            self.reducer.finish_backward()
        self.reducer.wait()

    def end_window(self) -> None:
        """Stage 3: release the params held since :meth:`begin_window`."""
        if self.fetcher is not None:
            self.fetcher.unhold(self._window_units(), release=[])
            self.fetcher.end_step_recording()
            self.fetcher.release_all()

    def gather_for_forward(self) -> None:
        """Stage 3: materialize the root units before the model's forward."""
        if self.fetcher is not None:
            self.fetcher.start_forward(whole_model=True)
            self.fetcher.gather_root()

    def end_forward(self) -> None:
        """After the model's forward: gradients wait for the engine's backward; stage 3 has recorded
        the pass whole and, without grad, drops the root units again."""
        self.reducer.end_forward()
        if self.fetcher is not None:
            self.fetcher.end_forward()
            if not torch.is_grad_enabled():
                self.fetcher.release_all()

    def _master_grads(self) -> list[torch.Tensor]:
        """Each unit's reduced gradient shard in fp32 (the pieces' gradients are views of it)."""
        self.reducer.ensure_buffers()
        if self.offloader is not None and self.settings.offload.optimizer:
            return self.offloader.grads_to_host()
        return [u.grad_shard if u.grad_shard.dtype == torch.float32 else u.grad_shard.float() for u in self.units]

    def _received_anywhere(self) -> list[list[bool]]:
        """Per unit, which params got a gradient on some dp rank in this window (a MAX over dp)."""
        local = self.reducer.received
        if self.dp.world == 1 or not local:
            return local
        flat = [flag for flags in local for flag in flags]
        agreed = torch.tensor(flat, dtype=torch.int32, device=self.units[0].device)
        self.dp.all_reduce(agreed, op=dist.ReduceOp.MAX)
        values = iter(agreed.tolist())
        return [[bool(next(values)) for _ in flags] for flags in local]

    def _point_piece_grads(self, grads: Sequence[torch.Tensor], received: list[list[bool]]) -> None:
        """Give each piece its slice of the unit gradient, or None if no rank produced one."""
        for piece, pc in zip(self.master_pieces, self.pieces):
            piece.grad = grads[pc.unit][pc.start : pc.stop] if received[pc.unit][pc.param] else None

    def global_grad_norm(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        """L2 norm of the whole model's gradient, from this rank's shards.

        Squares of [replicated, model-parallel, expert] units are summed over dp when sharded (the
        shards are disjoint; expert shards are disjoint over the expert shard group and hold
        other experts across the expert-parallel group, which together make up dp), the
        model-parallel part also over the model-parallel group (its pieces are disjoint, the
        replicated params are the same on every rank there), then everything over the norm groups.
        Unsharded (stage 0), the expert part is summed over the expert-parallel group. Experts split
        over the model-parallel group (expert tensor parallelism) are summed over it too.
        """
        squares = torch.zeros(3, dtype=torch.float32, device=grads[0].device if grads else None)
        if grads:
            per_unit = torch.stack(torch._foreach_norm(grads)).pow(2)
            squares = self._norm_weights.to(per_unit.device).t() @ per_unit
        squares = squares.to(self._comm_device)  # offloaded gradients are summed on the host
        if self.settings.stage > 0 and self.dp.shard_world > 1:
            dist.all_reduce(squares, group=self.group)
        elif self.expert_parallel_group is not None:
            dist.all_reduce(squares[2:], group=self.expert_parallel_group)
        if self.model_parallel_group is not None:
            dist.all_reduce(squares[self._model_parallel_columns], group=self.model_parallel_group)
        total = squares.sum()
        for g in self.norm_groups:
            dist.all_reduce(total, group=g)
        return total.sqrt()

    def step(self) -> bool:
        """Unscale, clip and apply the update at an accumulation boundary.

        Returns False when the step was skipped because the gradients overflowed.
        """
        received = self._received_anywhere()
        if not self.settings.ignore_unused_parameters:
            self._refuse_unused_parameters(received)
        self._average_across_replicas()
        grads = self._master_grads()
        ranks = self.settings.data_parallel_size or self.dp.world
        factor = (ranks if self.settings.gradient_sum else 1) / self.loss_scaler.scale
        if factor != 1.0:
            torch._foreach_mul_(grads, factor)
        expert_grads = [g for g, u in zip(grads, self.units) if u.expert]  # none where every expert is frozen
        if self._expert_parallel_size > 1 and expert_grads:
            torch._foreach_mul_(expert_grads, self.expert_gradient_factor)
        clip = self.settings.gradient_clipping
        check = self.settings.check_overflow or self.dtype == torch.float16
        overflow = False
        if clip > 0 or check or self.loss_scaler.dynamic:
            norm = self.global_grad_norm(grads)
            self.last_grad_norm = float(norm)
            overflow = check and not torch.isfinite(norm).item()
            if clip > 0 and not overflow:
                coef = (clip / (norm + 1e-6)).clamp(max=1.0)
                torch._foreach_mul_(grads, coef.to(grads[0].device) if grads else coef)
        self.loss_scaler.update(overflow)
        if overflow:
            self.skipped_steps += 1
        else:
            self._point_piece_grads(grads, received)
            self.inner.step()
            self.publish_params()
        self.zero_grad()
        return not overflow

    def _average_across_replicas(self) -> None:
        """Hybrid sharding: average each reduced gradient shard over the replicas that hold the same
        shard (1/S of the gradient crosses replicas, once per step, after the in-replica reduction)."""
        if self.dp.replicas == 1:
            return
        self.reducer.ensure_buffers()
        works = [dist.all_reduce(u.grad_shard, op=AVG, group=self.dp.replica, async_op=True) for u in self.units]
        for work in works:
            work.wait()

    def _refuse_unused_parameters(self, received: list[list[bool]]) -> None:
        """Raise on every rank if a parameter got no gradient on any dp rank (``received``, agreed
        over dp) anywhere in the job: one more all-reduce, over the world."""
        unused = [p for unit, flags in zip(self.units, received) for p, got in zip(unit.params, flags) if not got]
        anywhere = torch.tensor([int(bool(unused))], dtype=torch.int32, device=self._comm_device)
        if dist.is_initialized():
            dist.all_reduce(anywhere, op=dist.ReduceOp.MAX)
        if not anywhere.item():
            return
        if not unused:
            raise UnusedParametersError("parameters of another rank got no gradient in this accumulation window "
                                        "(see its error); zero_optimization.ignore_unused_parameters is false")
        order = {p: i for i, p in enumerate(self.param_names)}  # the model's order
        unused.sort(key=lambda p: order.get(p, len(order)))
        names = [self.param_names.get(p, f"a parameter of shape {list(p.shape)}") for p in unused]
        raise UnusedParametersError(
            f"{len(names)} parameter(s) got no gradient in this accumulation window on any data-parallel rank: "
            f"{', '.join(names[:5])}{', ...' if len(names) > 5 else ''}. zero_optimization.ignore_unused_parameters "
            "is false, which asks for every parameter to be used; set it to true (DeepSpeed's default) to train "
            "the model as it is, or set requires_grad=False on parameters the model does not use")

    def publish_params(self) -> None:
        """Copy updated masters into the working params; all-gather persistent shards. Stage 3
        releases what is still gathered (a head gathered by a forward that no backward followed):
        its full buffer holds the values before the step."""
        works = []
        for unit in self.units:
            if unit.master is not unit.shard:
                unit.shard.copy_(unit.master)
            if unit.persistent and unit.world > 1:
                works.append(gather_shards(unit.full, unit.shard, shard_group_of(unit, self.group)))
        for w in works:
            w.wait()
        if self.fetcher is not None:
            self.fetcher.release_all()  # held units (a GatheredParameters context, a window's) stay

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradient buffers and ``.grad`` views (the next backward makes them again,
        unit by unit, so no gradient memory is held through the forward); ``set_to_none=False``
        zeroes them in place instead. ``step()`` ends with the default."""
        for piece in self.master_pieces:
            piece.grad = None
        if set_to_none:
            self.reducer.release_buffers()
        else:
            self.reducer.zero_grad()

    # -- state ---------------------------------------------------------------------------

    def piece_params(self) -> list[tuple[nn.Parameter, int, nn.Parameter, torch.Size]]:
        """``(param, first element, master piece, param shape)`` for every piece of this rank.

        The piece holds elements ``[first, first + numel)`` of the flattened parameter (of its
        tensor-parallel shard, under tp); the master piece is a view into the fp32 master shard.
        """
        out = []
        for pc, master in zip(self.pieces, self.master_pieces):
            unit = self.units[pc.unit]
            first = unit.shard_range[0] + pc.start - unit.offsets[pc.param]
            out.append((unit.params[pc.param], first, master, unit.shapes[pc.param]))
        return out

    def piece_states(self) -> list[dict]:
        """The inner optimizer's state of each master piece (``{}`` before its first step)."""
        return [self.inner.state.get(m, {}) for m in self.master_pieces]

    def set_piece_states(self, states: Sequence[dict]) -> None:
        """Replace the inner optimizer's state, piece by piece (the order of :meth:`piece_params`)."""
        for master, state in zip(self.master_pieces, states, strict=True):
            if state:
                self.inner.state[master] = dict(state)
            else:
                self.inner.state.pop(master, None)

    def extra_state(self) -> dict:
        """Everything else a resume needs, as plain values: group options, loss scaler, skips."""
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.inner.param_groups]
        return {"param_groups": groups, "loss_scaler": self.loss_scaler.state_dict(),
                "skipped_steps": self.skipped_steps}

    def load_extra_state(self, state: dict) -> None:
        groups = state["param_groups"]
        if len(groups) != len(self.inner.param_groups):
            raise ValueError(f"the checkpoint has {len(groups)} optimizer parameter groups, this engine "
                             f"{len(self.inner.param_groups)}")
        for group, saved in zip(self.inner.param_groups, groups):
            for key, value in saved.items():
                if key in _IMPLEMENTATION_OPTIONS:
                    continue  # how this run computes the step, not training state
                group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
        self.loss_scaler.load_state_dict(state["loss_scaler"])
        self.skipped_steps = int(state["skipped_steps"])

    def full_fp32_params(self) -> dict[nn.Parameter, torch.Tensor]:
        """Every trainable parameter, whole, in fp32 from the masters (a collective over dp)."""
        out: dict[nn.Parameter, torch.Tensor] = {}
        for unit in self.units:
            full = torch.empty(unit.padded, dtype=torch.float32, device=unit.device)
            if unit.world > 1:
                gather_shards(full, unit.master.detach(), shard_group_of(unit, self.group)).wait()
            else:
                full.copy_(unit.master.detach())
            for p, view in zip(unit.params, unit.views(full)):
                out[p] = view.clone()
        return out

    def memory_report(self, experts: bool | None = None) -> dict[str, int]:
        """Bytes this rank holds for each kind of model state, at their largest in a step: of every
        param, or (``experts`` True / False) of the expert-parallel params only / of the others.

        Gradients count from the first backward on: their buffers exist from each unit's first
        gradient of a step to the end of the step (none between steps or through the forward;
        ``zero_grad``). Optimizer states count from the first step.

        Under fp32 the master shard *is* the working shard (one tensor, while both are in the
        same memory), so ``master_params`` is 0 there: its bytes are already counted in ``params``.

        ``frozen_params`` is what this rank keeps of the untrained parameters between uses: their
        working-precision shard at stage 3 (whole below the persistence threshold), whole at
        stages 0-2. A stage-3 gather holds one fetch unit more while it is in use (two with prefetch).

        The keys of ``zero.sizing.CATEGORIES`` are bytes on the compute device. With
        ZeRO-Offload the offloaded bytes are counted under ``zero.sizing.HOST_CATEGORIES``
        instead (host memory), by where the settings place them (on a CPU-only machine both
        are the same memory).
        """

        def nbytes(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        offload = self.settings.offload
        used = self.reducer.used
        units = [u for u in self.units if experts is None or u.expert == experts]
        report = {"params": 0, "gradients": self.reducer.buffer_bytes(units) if used else 0,
                  "master_params": 0, "optimizer_states": 0, "frozen_params": 0}
        if offload.enabled:
            report.update(dict.fromkeys(HOST_CATEGORIES, 0))
            if offload.optimizer and used:
                report["offloaded_gradients"] = sum(4 * u.shard_size for u in units)
        for unit in self.frozen_units:
            if experts is not None and unit.expert != experts:
                continue
            report["frozen_params"] += nbytes(unit.full) if unit.persistent else nbytes(unit.shard)
        for unit in units:
            kept = nbytes(unit.full) if unit.persistent else nbytes(unit.shard)
            report["offloaded_params" if offload.params and not unit.persistent else "params"] += kept
            if unit.master is not unit.shard:
                report["offloaded_master_params" if offload.optimizer else "master_params"] += nbytes(unit.master)
        states = "offloaded_optimizer_states" if offload.optimizer else "optimizer_states"
        chosen = {id(u) for u in units}
        for piece, master in zip(self.pieces, self.master_pieces):
            if id(self.units[piece.unit]) not in chosen:
                continue
            for value in self.inner.state.get(master, {}).values():
                if isinstance(value, torch.Tensor):
                    report[states] += nbytes(value)
        return report


def _more_than_one(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """``group`` where it has more than one rank, else None (a group of one needs no collective)."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return None
    return group


def _gradient_reduce(quantized: bool, group: dist.ProcessGroup | None,
                     node_groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None) -> Callable[..., object]:
    """How a unit's gradient is reduced to its shard: in the working precision, or as int8 in one
    hop or, on ``group`` when it spans nodes, two (``zero.quantized_comm``)."""
    if not quantized:
        return reduce_to_shard
    if node_groups is None or group is None:
        return reduce_to_shard_int8
    return functools.partial(reduce_to_shard_int8, hops=(group, *node_groups))

"""What a caller tells ``ZeroOptimizer`` about the rest of the job, as small records.

ZeRO's own job is to shard states over a data-parallel group, reduce gradients into the shards
and gather parameters around their use. The few facts it needs from outside come in these
records, each named for what it means to ZeRO, not for the part of the job that produced it:

* :class:`ZeroGroups`: the process groups, taken by use from one collection (Megatron's
  ``ProcessGroupCollection``; the mesh's ``parallel3d.runtime.mesh.ProcessGroups`` is one);
* :class:`GradSyncSets`: how the caller splits the parameters into sets whose gradients it
  has synchronized at moments of its choosing, and which parameters it sums with copies held
  outside ZeRO's groups;
* :class:`NormShares`: which parameters' gradients are split over the model-parallel group or
  counted in the norm by another rank;
* :class:`FetchModules`: stage 3's fetch units.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch.distributed as dist
from torch import nn


class ZeroGroups(Protocol):
    """The process groups ZeRO uses, by use; each None where it is the default group (the shard
    group) or absent (the others). A group of one rank counts as absent."""

    @property
    def zero_shard(self) -> dist.ProcessGroup | None:
        """Where states, gradients and (stage 3) parameters are sharded; None: the default group."""

    @property
    def zero_replicate(self) -> dist.ProcessGroup | None:
        """Hybrid sharding: the ranks holding the same shard in the other replicas of ``zero_shard``;
        reduced gradient shards are averaged over it before each step (``zero.dp_groups``)."""

    @property
    def zero_secondary(self) -> dist.ProcessGroup | None:
        """Stage 3, ZeRO++'s hpZ: the ranks of ``zero_shard`` over which each block's parameters stay
        partitioned from its forward to its backward (``zero.stage3.ParamFetcher``)."""

    @property
    def zero_node(self) -> dist.ProcessGroup | None:
        """``quantized_gradients`` on a shard group that spans nodes: its members on this rank's node
        (qgZ's first hop, ``zero.quantized_comm``); None: one all-to-all over ``zero_shard``."""

    @property
    def zero_across_nodes(self) -> dist.ProcessGroup | None:
        """With ``zero_node``: the members of ``zero_shard`` at this rank's place on the other nodes."""

    @property
    def ep(self) -> dist.ProcessGroup | None:
        """The ranks of ``zero_shard`` that each hold different experts of the expert parameters."""

    @property
    def expert_shard(self) -> dist.ProcessGroup | None:
        """The ranks of ``zero_shard`` holding the same experts: where the expert units are sharded."""

    @property
    def tp(self) -> dist.ProcessGroup | None:
        """The model-parallel group over which ``NormShares.split`` params are cut in pieces."""

    @property
    def norm(self) -> Sequence[dist.ProcessGroup]:
        """Groups over which the whole squared gradient norm is also summed (their ranks hold
        disjoint parameters)."""


@dataclass(frozen=True)
class GradSyncSets:
    """The caller's gradient-synchronization sets: which parameters' gradients are synchronized
    together when the caller says so.

    Under ``ZeroSettings.windowed`` the caller brackets every backward pass that accumulates
    gradients into one set with ``begin_pass(set_id, last)`` / ``end_pass()``; ZeRO lays out its
    units so that none spans two sets, and reduces a set's units around its passes (each pass, or
    the ``last`` only). The ids are the caller's own (one per pipeline chunk, say); ZeRO only
    compares them.
    """

    set_of: Mapping[nn.Parameter, Hashable] = field(default_factory=dict)
    """Each parameter's set id; a parameter not listed is in set ``0``."""
    tied_elsewhere: Sequence[nn.Parameter] = ()
    """Parameters of which a rank outside ZeRO's groups holds a tied copy (an embedding tied to a
    head on another rank): the caller sums their gradients with the copy's (``tied_gradients``)
    before ``finish_window``. Each gets a unit of its own, laid out alike on both ranks; with full
    gradients it is reduced only at ``finish_window``, after that sum."""


@dataclass(frozen=True)
class NormShares:
    """How the parameters' gradients enter the global gradient norm, beyond this rank's shards."""

    split: Iterable[nn.Parameter] = ()
    """Parameters cut in pieces over ``ZeroGroups.tp`` (each rank holds a different piece): their
    squared norms are also summed there; every other parameter is the same on its ranks and
    counted once."""
    counted_elsewhere: Iterable[nn.Parameter] = ()
    """Parameters whose gradient another rank of ``ZeroGroups.norm`` or ``ZeroGroups.tp`` also holds
    and counts (a tied copy, a piece held by several ranks): left out of this rank's norm."""


@dataclass(frozen=True)
class FetchModules:
    """Stage 3's fetch units: the modules whose parameters are gathered together around each use."""

    modules: Sequence[nn.Module] = ()
    """The model's repeated blocks, its stand-alone embedding tables and head
    (``zero.partition.stage3_fetch_modules``)."""
    held_to_backward: Sequence[nn.Module] = ()
    """Those whose backward follows their forward at once (a head): kept gathered from one to the
    other instead of gathered twice."""
    release_early: Sequence[nn.Module] = ()
    """Those of ``held_to_backward`` whose backward may free the gathered weight before making its
    gradient (``zero.head``: an untied ``nn.Linear`` head)."""

"""The device mesh of named axes every component receives explicitly.

``pp x dp_replicate x dp_shard x cp x tp``, built once with ``init_device_mesh``. Rank order
follows Megatron and torchtitan: tp varies fastest (its traffic is heaviest and wants the
fastest links, i.e. the GPUs of one node), then cp, then dp_shard, dp_replicate, pp. The data
parallel ranks are ``dp = dp_replicate x dp_shard``: ZeRO shards inside a ``dp_shard`` group
and replicates across ``dp_replicate`` (hybrid sharding). An axis of size 1 costs nothing but a
trivial group; with ``dp_replicate = cp = 1`` the layout is the pp x dp x tp mesh of before.
Expert parallelism is folded over ``dp_shard x cp`` (torchtitan's arrangement): each block of
``E`` consecutive ranks of a ``dp_shard_cp`` group splits the experts (``ProcessGroups.ep``) and
the ranks at one position of every block hold the same experts and shard their states
(``ProcessGroups.expert_shard``); docs/expert_parallel.md.
"""

from __future__ import annotations

import dataclasses
import math
from datetime import timedelta
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from parallel3d.errors import ConfigError
from parallel3d.runtime.watchdog import set_timeout
from parallel3d.runtime.world import default_device, ensure_process_group


AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""The mesh's dimensions, slowest-varying first (tp fastest: its traffic wants a node's links)."""

VIEWS = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}
"""Flattened views over adjacent axes, by what they are for:

* ``dp``: the ranks that are given different data (a cp or tp group shares its micro-batch);
* ``dp_shard_cp``: where ZeRO shards states (context-parallel ranks hold the same weights, so
  they share the shards, as in torchtitan's FSDP over ``dp_shard_cp``), and where expert
  parallelism is folded;
* ``dp_cp``: every rank that holds a replica of a weight outside pp and tp: the scope over which
  gradients are averaged and a loss is meaned.
"""


@dataclass(frozen=True)
class MeshShape:
    """Sizes of the five axes; ``dp`` is ``dp_replicate x dp_shard``."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1

    @classmethod
    def for_world(cls, world: int, *, tp: int = 1, pp: int = 1, cp: int = 1, dp_replicate: int = 1) -> "MeshShape":
        """The shape whose ``dp_shard`` takes the ranks left over by the other axes.

        Raises ConfigError, naming each size, when they do not divide ``world``.
        """
        named = {"tensor_parallel.size": tp, "pipeline.stages": pp, "context parallel size": cp,
                 "data-parallel replicas": dp_replicate}
        bad = [f"{name} {size}" for name, size in named.items() if not isinstance(size, int) or size < 1]
        if bad:
            raise ConfigError(f"mesh sizes must be whole numbers >= 1: {', '.join(bad)}")
        fixed = tp * pp * cp * dp_replicate
        if world % fixed != 0:
            used = " x ".join(f"{name} {size}" for name, size in named.items() if size > 1) or "1"
            raise ConfigError(
                f"world size {world} is not divisible by {used} = {fixed}; the data-parallel shard size is "
                f"world / ({fixed}) and must be a whole number"
            )
        return cls(pp=pp, dp_replicate=dp_replicate, dp_shard=world // fixed, cp=cp, tp=tp)

    def size(self, name: str) -> int:
        """The size of an axis or of a view (``VIEWS``)."""
        return math.prod(getattr(self, axis) for axis in VIEWS.get(name, (name,)))

    @property
    def dims(self) -> tuple[int, ...]:
        return tuple(getattr(self, axis) for axis in AXES)

    @property
    def world_size(self) -> int:
        return math.prod(self.dims)


@dataclass(frozen=True)
class ProcessGroups:
    """The groups components use, named by what they are for (Megatron's ProcessGroupCollection).

    Each is None in a single process run without ``torch.distributed``. Handed out by the
    mesh, so no component slices the mesh itself or keeps a group in a global. ZeRO takes the
    collection whole and reads the groups it uses by name (``zero.inputs.ZeroGroups``).
    """

    tp: dist.ProcessGroup | None = None
    pp: dist.ProcessGroup | None = None
    cp: dist.ProcessGroup | None = None
    dp: dist.ProcessGroup | None = None
    """Ranks given different micro-batches (``dp_replicate x dp_shard``)."""
    zero_shard: dist.ProcessGroup | None = None
    """Where ZeRO's states, gradients and parameters are sharded (``dp_shard x cp``)."""
    zero_replicate: dist.ProcessGroup | None = None
    """Ranks holding copies of the same ZeRO shard (``dp_replicate``): their reduced shards are
    averaged across it."""
    zero_secondary: dist.ProcessGroup | None = None
    """ZeRO++'s hpZ: consecutive blocks of ``zero_hpz_partition_size`` ranks of ``zero_shard`` (a
    node's), over which stage 3 keeps a second partition of each block's parameters for backward."""
    zero_node: dist.ProcessGroup | None = None
    """The members of ``zero_shard`` on this rank's node (consecutive blocks): qgZ's first hop; None
    unless ``zero_quantized_gradients`` runs on a shard group that spans nodes."""
    zero_across_nodes: dist.ProcessGroup | None = None
    """The members of ``zero_shard`` at this rank's place on every node (strided): qgZ's second hop."""
    ep: dist.ProcessGroup | None = None
    """Expert parallelism: ``E`` consecutive ranks of ``zero_shard`` that split each MoE layer's experts
    (tokens cross it by all-to-all); None without expert parallelism."""
    expert_shard: dist.ProcessGroup | None = None
    """The ranks of ``zero_shard`` that hold the same experts (every ``E``-th): where ZeRO shards the
    expert parameters' states (the expert-data-parallel group); None without expert parallelism."""
    gradient_mean: dist.ProcessGroup | None = None
    """Every rank whose gradient of a weight enters its mean (``dp_cp``), and a loss's mean."""
    norm: tuple[dist.ProcessGroup, ...] = ()
    """Groups over which a whole squared gradient norm is also summed: pipeline stages hold
    disjoint params (tensor-parallel pieces are summed over ``tp``, param by param). Tied
    copies on two stages need no group of their own: they sum their gradients point to point
    over ``pp`` (parallel3d/pipeline/stage.py)."""


@dataclass(frozen=True)
class ParallelMesh:
    """The device mesh of named axes (``AXES``) and views (``VIEWS``), and this rank's place in it.

    ``device_mesh`` is None in a single process run without ``torch.distributed``. Every
    group a view needs is made when the mesh is built (making one is a collective of the
    whole world, so it cannot wait until one rank asks for it).
    """

    shape: MeshShape
    device_mesh: DeviceMesh | None
    device: torch.device
    timeout_s: float | None = None
    """The collective timeout of its groups (None: torch's default); groups made later use it too."""
    flattened: Mapping[str, DeviceMesh] = field(default_factory=dict, repr=False, compare=False)
    """The 1-D meshes of views over more than one non-trivial axis (torch wants them kept by
    their maker rather than sliced from the root mesh)."""
    groups: ProcessGroups = field(default_factory=ProcessGroups, repr=False, compare=False)
    """The groups by use (:func:`build_mesh` fills them in)."""
    ep: int = 1
    """Expert-parallel degree ``E``, folded over ``dp_shard x cp`` (1: none)."""

    def __post_init__(self) -> None:
        if self.device_mesh is not None and tuple(self.device_mesh.mesh_dim_names or ()) != AXES:
            raise ValueError(f"a ParallelMesh's device mesh must have the dims {AXES}")

    def _mesh_of(self, name: str) -> DeviceMesh:
        if name in AXES:
            return self.device_mesh[name]
        if name in self.flattened:
            return self.flattened[name]
        # a view over at most one non-trivial axis is that axis (or any size-1 axis): no group of its own
        axes = VIEWS[name]
        return self.device_mesh[next((a for a in axes if self.shape.size(a) > 1), axes[0])]

    def group(self, name: str) -> dist.ProcessGroup | None:
        """The process group along an axis or view; None without distributed."""
        if name not in AXES and name not in VIEWS:
            raise KeyError(f"no mesh axis or view {name!r}: the axes are {', '.join(AXES)}, the views "
                           f"{', '.join(VIEWS)}")
        if self.device_mesh is None:
            return None
        return self._mesh_of(name).get_group()

    def size(self, name: str) -> int:
        return self.shape.size(name)

    def local_rank(self, name: str) -> int:
        """This rank's index along an axis, or along a view (its axes' coordinates, tp-fastest order)."""
        if self.device_mesh is None:
            return 0
        index = 0
        for axis in VIEWS.get(name, (name,)):
            index = index * self.shape.size(axis) + self.device_mesh.get_local_rank(axis)
        return index

    def named_groups(self) -> dict[str, dist.ProcessGroup]:
        """``{name: group}`` over axes and views, one name per group: a view that is one axis
        goes by the shorter common name (``dp``, not ``dp_shard``), groups of size > 1 first."""
        if self.device_mesh is None:
            return {}
        preference = ("tp", "pp", "cp", "dp", "dp_shard", "dp_replicate", "dp_shard_cp", "dp_cp")
        names: dict[str, dist.ProcessGroup] = {}
        seen: set[str] = set()
        if self.groups.zero_secondary is not None:
            names["hpz"] = self.groups.zero_secondary
            seen.add(self.groups.zero_secondary.group_name)
        for name, group in (("ep", self.groups.ep), ("expert_shard", self.groups.expert_shard),
                            ("node", self.groups.zero_node), ("across_nodes", self.groups.zero_across_nodes)):
            if group is not None and group.group_name not in seen:
                seen.add(group.group_name)
                names[name] = group
        for big in (True, False):
            for name in preference:
                group = self.group(name)
                if (self.size(name) > 1) == big and group.group_name not in seen:
                    seen.add(group.group_name)
                    names[name] = group
        return names

    @property
    def pp(self) -> int:
        return self.shape.pp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: ``dp_replicate x dp_shard`` (each given its own micro-batches)."""
        return self.shape.size("dp")

    @property
    def cp(self) -> int:
        return self.shape.cp

    @property
    def tp(self) -> int:
        return self.shape.tp

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self.group("dp")

    @property
    def world_size(self) -> int:
        return self.shape.world_size


def build_mesh(tp: int, pp: int, device: torch.device | None = None, timeout_s: float | None = None, *,
               cp: int = 1, dp_replicate: int = 1, hpz: int = 1, ep: int = 1, node_shard_ranks: int = 0) -> ParallelMesh:
    """Build the mesh over the current world; ``dp_shard`` takes the ranks the other axes leave.

    Its groups get the collective timeout ``timeout_s`` (torch gives new groups its 30-minute
    default, not the default group's timeout). ``hpz`` > 1 also makes ZeRO++'s secondary groups
    (``ProcessGroups.zero_secondary``); it must divide the shard group's size. ``ep`` > 1 makes the
    expert-parallel groups (``ProcessGroups.ep``, ``ProcessGroups.expert_shard``); it must divide
    the shard group's size too. ``node_shard_ranks``: members of a shard group on one node; where
    it divides the group and is neither 1 nor all of it, the groups of qgZ's two hops are made
    (``ProcessGroups.zero_node``, ``ProcessGroups.zero_across_nodes``).
    """
    device = device or default_device()
    ensure_process_group(device, timeout_s)
    world = dist.get_world_size() if dist.is_initialized() else 1
    shape = MeshShape.for_world(world, tp=tp, pp=pp, cp=cp, dp_replicate=dp_replicate)
    if ep > 1 and shape.size("dp_shard_cp") % ep:
        raise ConfigError(f"expert_parallel.autoep_size {ep} does not divide the {shape.size('dp_shard_cp')} ranks "
                          "of dp_shard x cp it is folded over (the data-parallel shard ranks times the context-"
                          "parallel size); allowed: a divisor of that")
    if not dist.is_initialized():
        return ParallelMesh(shape, None, device, ep=ep)
    mesh = init_device_mesh(device.type, shape.dims, mesh_dim_names=AXES)
    flattened = {name: mesh[axes]._flatten(name) for name, axes in VIEWS.items()
                 if sum(shape.size(a) > 1 for a in axes) > 1}
    if timeout_s is not None:
        set_timeout([mesh[axis].get_group() for axis in AXES] + [m.get_group() for m in flattened.values()],
                    timeout_s)
    built = ParallelMesh(shape, mesh, device, timeout_s, flattened)
    groups = _groups_of(built)
    if hpz > 1:
        groups = dataclasses.replace(groups, zero_secondary=_secondary_group(mesh, shape, hpz, timeout_s))
    if ep > 1:
        ep_group, expert_shard = _folded_groups(mesh, shape, ep, timeout_s)
        groups = dataclasses.replace(groups, ep=ep_group, expert_shard=expert_shard)
    if 1 < node_shard_ranks < shape.size("dp_shard_cp") and shape.size("dp_shard_cp") % node_shard_ranks == 0:
        node, across = _folded_groups(mesh, shape, node_shard_ranks, timeout_s)
        groups = dataclasses.replace(groups, zero_node=node, zero_across_nodes=across)
    return dataclasses.replace(built, groups=groups, ep=ep)


def _shard_rows(mesh: DeviceMesh, shape: MeshShape) -> torch.Tensor:
    """Every ``dp_shard_cp`` group's global ranks, one row each, in the view's order (cp fastest)."""
    return mesh.mesh.permute(0, 1, 4, 2, 3).reshape(-1, shape.size("dp_shard_cp"))


def _folded_groups(mesh: DeviceMesh, shape: MeshShape, block: int,
                   timeout_s: float | None) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's block of ``block`` consecutive members of its ``dp_shard_cp`` group and the
    members at its position in every block: the expert-parallel and expert-shard groups
    (torchtitan's inner fold), or a node's shard ranks and their peers on the other nodes (qgZ)."""
    rows = _shard_rows(mesh, shape)
    timeout = timedelta(seconds=timeout_s) if timeout_s else None
    blocks = [row[i : i + block].tolist() for row in rows for i in range(0, rows.shape[1], block)]
    strided = [row[j::block].tolist() for row in rows for j in range(block)]
    inner, _ = dist.new_subgroups_by_enumeration(blocks, timeout=timeout)
    across, _ = dist.new_subgroups_by_enumeration(strided, timeout=timeout)
    return inner, across


def _secondary_group(mesh: DeviceMesh, shape: MeshShape, hpz: int, timeout_s: float | None) -> dist.ProcessGroup:
    """This rank's block of ``hpz`` consecutive members of its ``dp_shard_cp`` group (made on every
    rank for every block: a new group is a collective of the world)."""
    size = shape.size("dp_shard_cp")
    if size % hpz:
        raise ConfigError(f"zero_optimization.zero_hpz_partition_size {hpz} does not divide the {size} ranks "
                          "ZeRO shards over; allowed: a divisor of that")
    ranks = _shard_rows(mesh, shape)
    blocks = [row[i : i + hpz].tolist() for row in ranks for i in range(0, size, hpz)]
    group, _ = dist.new_subgroups_by_enumeration(blocks, timeout=timedelta(seconds=timeout_s) if timeout_s else None)
    return group


def _groups_of(mesh: ParallelMesh) -> ProcessGroups:
    return ProcessGroups(
        tp=mesh.group("tp"),
        pp=mesh.group("pp"),
        cp=mesh.group("cp"),
        dp=mesh.group("dp"),
        zero_shard=mesh.group("dp_shard_cp"),
        zero_replicate=mesh.group("dp_replicate"),
        gradient_mean=mesh.group("dp_cp"),
        norm=(mesh.group("pp"),) if mesh.pp > 1 else (),
    )

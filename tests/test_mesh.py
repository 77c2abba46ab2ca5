"""The mesh of named axes: rank layout, the groups of axes and views, and the sizes' checks."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.distributed as dist

from parallel3d.errors import ConfigError
from parallel3d.runtime.mesh import AXES, VIEWS, MeshShape, ParallelMesh, build_mesh

# (pp, dp_replicate, cp, tp) on 8 ranks; dp_shard takes what is left
LAYOUTS_8 = [(2, 1, 1, 2), (1, 2, 1, 2), (1, 2, 2, 1), (2, 2, 1, 1), (1, 1, 2, 2), (1, 1, 1, 1)]


def _expected_rank(coords: dict[str, int], shape: MeshShape) -> int:
    """Global rank of mesh coordinates: tp fastest, then cp, dp_shard, dp_replicate, pp."""
    rank = 0
    for axis in AXES:
        rank = rank * getattr(shape, axis) + coords[axis]
    return rank


def _expected_group(rank: int, shape: MeshShape, axes: tuple[str, ...]) -> list[int]:
    """The ranks that share ``rank``'s coordinates on every axis not in ``axes``, in view order."""
    coords, rest = {}, rank
    for axis in reversed(AXES):
        coords[axis] = rest % getattr(shape, axis)
        rest //= getattr(shape, axis)
    members = []
    for values in itertools.product(*(range(getattr(shape, a)) for a in axes)):
        members.append(_expected_rank({**coords, **dict(zip(axes, values))}, shape))
    return members


def test_shape_sizes_and_views():
    shape = MeshShape.for_world(48, tp=2, pp=2, cp=3, dp_replicate=2)
    assert shape.dims == (2, 2, 2, 3, 2)
    assert shape.size("dp") == 4 and shape.size("dp_shard_cp") == 6 and shape.size("dp_cp") == 12
    assert shape.world_size == 48


@pytest.mark.parametrize("world, sizes, message", [
    (12, dict(tp=4, pp=2), "world size 12 is not divisible by tensor_parallel.size 4 x pipeline.stages 2 = 8"),
    (8, dict(cp=3), "world size 8 is not divisible by context parallel size 3 = 3"),
    (8, dict(tp=0), "mesh sizes must be whole numbers >= 1: tensor_parallel.size 0"),
])
def test_sizes_that_do_not_fit_the_world_are_refused(world, sizes, message):
    with pytest.raises(ConfigError, match=message):
        MeshShape.for_world(world, **sizes)


def test_a_single_process_mesh_has_no_groups():
    mesh = ParallelMesh(MeshShape(), None, torch.device("cpu"))
    assert mesh.group("tp") is None and mesh.group("dp_cp") is None
    assert mesh.local_rank("dp") == 0 and mesh.dp == mesh.world_size == 1
    with pytest.raises(KeyError, match="no mesh axis or view 'ep'"):
        mesh.group("ep")


def _layouts_on_every_rank() -> list[dict]:
    rank = dist.get_rank()
    found = []
    for pp, replicate, cp, tp in LAYOUTS_8:
        mesh = build_mesh(tp, pp, cp=cp, dp_replicate=replicate)
        shape = mesh.shape
        for name in AXES + tuple(VIEWS):
            axes = VIEWS.get(name, (name,))
            ranks = dist.get_process_group_ranks(mesh.group(name))
            assert ranks == _expected_group(rank, shape, axes), (shape, name, ranks)
            assert mesh.size(name) == len(ranks) == math.prod(getattr(shape, a) for a in axes)
            assert ranks[mesh.local_rank(name)] == rank, (shape, name)
        groups = mesh.groups
        assert dist.get_process_group_ranks(groups.zero_shard) == dist.get_process_group_ranks(mesh.group("dp_shard_cp"))
        assert dist.get_process_group_ranks(groups.gradient_mean) == dist.get_process_group_ranks(mesh.group("dp_cp"))
        assert len(groups.norm) == (1 if pp > 1 else 0)
        found.append({"shape": shape.dims, "names": sorted(mesh.named_groups())})
    return found


def test_groups_of_every_axis_and_view_on_8_ranks(dist):
    results = dist.run(8, _layouts_on_every_rank)
    assert all(r == results[0] for r in results)  # every rank built the same meshes
    names = {layout["shape"]: layout["names"] for layout in results[0]}
    # pp 2 x dp 2 x tp 2: the pp x dp x tp mesh of before, its dp group named "dp", not "dp_shard"
    assert {"dp", "pp", "tp"} <= set(names[(2, 1, 2, 1, 2)]) and "dp_shard" not in names[(2, 1, 2, 1, 2)]
    # hybrid: replicas and shards are different groups, and dp spans both
    assert {"dp", "dp_shard", "dp_replicate"} <= set(names[(1, 2, 2, 1, 2)])


def _secondary_groups() -> list[list[int]]:
    rank, found = dist.get_rank(), []
    for tp, cp, hpz in ((2, 1, 2), (1, 2, 4), (1, 1, 2)):
        mesh = build_mesh(tp, 1, cp=cp, hpz=hpz)
        members = _expected_group(rank, mesh.shape, ("dp_shard", "cp"))
        start = members.index(rank) // hpz * hpz
        assert dist.get_process_group_ranks(mesh.groups.zero_secondary) == members[start : start + hpz]
        assert "hpz" in mesh.named_groups()
        found.append(dist.get_process_group_ranks(mesh.groups.zero_secondary))
    return found


def test_hpz_groups_are_consecutive_blocks_of_the_shard_group(dist):
    results = dist.run(8, _secondary_groups)
    assert results[0] == [[0, 2], [0, 1, 2, 3], [0, 1]]

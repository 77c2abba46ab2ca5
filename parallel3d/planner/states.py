"""Model-state bytes per rank, as ``engine.memory_report()`` will count them, before any process runs.

The units come from ``zero.sizing.plan_units`` (the function ``ZeroOptimizer`` builds its units
with) over the rank's parameters from ``planner.inventory``; the bytes per unit from
``zero.sizing.unit_state_bytes``. So the prediction equals ``memory_report()`` exactly, padding,
straddling pieces and Adam's ``step`` scalars included (tests/test_planner_states.py).

Under expert parallelism ZeRO lays out the expert params apart, over the expert-shard group of
``dp / ep`` ranks (``ZeroOptimizer._expert_layout``): :func:`shard_sets` splits a rank's params
into the dense set (over dp) and the expert set (over dp / ep, where dp rank ``r`` is shard rank
``r // ep``), and every count here sums the two.

Under pipeline stages ZeRO reduces a chunk's gradients after its own backward passes (stages
2-3 keep only the shard, ``pipeline.keep_full_gradients`` aside): :func:`full_gradients`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from parallel3d.errors import ConfigError
from parallel3d.planner.inventory import Param, RankParams
from zero.sizing import CATEGORIES, OptimizerStateShape, UnitPlan, padded_numel, plan_units, unit_state_bytes


def full_gradients(stage: int, pipelined: bool, *, dp: int, keep_full: bool = False) -> bool:
    """Whether ZeRO accumulates into full (padded) gradient buffers rather than staging each
    backward's gradients and keeping the rank's shard.

    Stages 0-1 always do, and every stage on one dp rank (the shard is the whole). Under
    pipeline stages stages 2-3 reduce-scatter each chunk's gradients after each of its backward
    passes and keep the shard, unless ``pipeline.keep_full_gradients`` (``keep_full``) asks for
    one reduction per step.
    """
    return stage <= 1 or dp == 1 or (pipelined and keep_full)


@dataclass(frozen=True)
class ZeroSetup:
    """The ZeRO settings that decide a rank's bytes (``zero_optimization`` and precision)."""

    stage: int
    dp: int
    work_bytes: int = 2  # bytes per element of the working dtype: 2 bf16/fp16, 4 fp32
    optimizer: OptimizerStateShape = OptimizerStateShape(2, 1)
    bucket_size: int = 500_000_000
    persistence_threshold: int = 100_000
    offload_optimizer: bool = False  # ZeRO-Offload: masters, optimizer states, step's gradients on the host
    offload_params: bool = False  # stage 3's non-persistent shards on the host
    quantized_weights: bool = False  # ZeRO++'s qwZ: stage 3 gathers int8 with block scales
    quantized_gradients: bool = False  # ZeRO++'s qgZ: gradients reduced as int8
    hpz: int = 1  # ZeRO++'s hpZ: backward gathers inside blocks of this many shard ranks
    node: int = 0  # shard ranks per node where the shard group spans nodes (qgZ's two hops), else 0

    @property
    def world(self) -> int:
        """The size ZeRO shards over: 1 at stage 0 (nothing sharded), else dp."""
        return 1 if self.stage == 0 else self.dp


@dataclass(frozen=True)
class ShardSet:
    """Params ZeRO shards over one group: the rank's params of the set, the setup with the group's
    size as ``dp``, and ``stride``: data-parallel rank ``r`` is the group's rank ``r // stride``
    (blocks of ``ep`` consecutive ranks form an expert-parallel group, the expert-shard group takes
    one of each)."""

    params: RankParams
    zero: ZeroSetup
    stride: int = 1


@lru_cache(maxsize=4096)
def shard_sets(params: RankParams, zero: ZeroSetup) -> tuple[ShardSet, ...]:
    """The rank's params by the group ZeRO shards them over: all over ``zero.dp``; under expert
    parallelism the dense ones over dp and the experts over ``dp / ep``.

    Each set keeps every fetch module (``plan_units`` skips params of no group), so a unit's
    ``module`` is the same block index in both, as in ``ZeroOptimizer._expert_layout``.
    """
    expert = tuple(g for g in params.groups if g and g[0].expert)
    if params.ep == 1 or not expert:
        return (ShardSet(params, zero),)
    if zero.dp % params.ep:
        raise ConfigError(f"expert_parallel.autoep_size {params.ep} does not divide the {zero.dp} ranks ZeRO "
                          "shards over")
    dense = tuple(g for g in params.groups if not (g and g[0].expert))
    fields = (params.fetch_modules, params.embeddings, params.heads)
    return (ShardSet(RankParams(dense, *fields), zero),
            ShardSet(RankParams(expert, *fields), replace(zero, dp=zero.dp // params.ep), params.ep))


@lru_cache(maxsize=4096)
def units(params: RankParams, zero: ZeroSetup) -> list[UnitPlan[Param]]:
    """The rank's units, as ``ZeroOptimizer`` lays them out (cached: ``RankParams`` hash by identity)."""
    return plan_units([list(g) for g in params.groups], _numel, stage=zero.stage, world=zero.world,
                      bucket_size=zero.bucket_size, persistence_threshold=zero.persistence_threshold,
                      fetch_modules=[list(m) for m in params.fetch_modules])


def model_state_bytes(params: RankParams, zero: ZeroSetup, *, dp_rank: int = 0, pipelined: bool = False) -> dict[str, int]:
    """``memory_report()`` of the rank after a training step (gradients and optimizer states exist).

    Offloaded bytes are counted under ``HOST_CATEGORIES`` (host memory), as ``memory_report`` does.
    A search asks for the same rank's states many times (once per micro-batch, schedule and
    recomputation choice): computed once per (params, zero, dp rank, pipelined), a copy returned.
    """
    return dict(_model_state_bytes(params, zero, dp_rank, pipelined))


@lru_cache(maxsize=8192)
def _model_state_bytes(params: RankParams, zero: ZeroSetup, dp_rank: int, pipelined: bool) -> dict[str, int]:
    total = dict.fromkeys(CATEGORIES, 0)
    full = full_gradients(zero.stage, pipelined, dp=zero.dp)  # GradientReducer's one choice for every unit
    for part in shard_sets(params, zero):
        rank = 0 if zero.stage == 0 else dp_rank // part.stride
        for unit in units(part.params, part.zero):
            got = unit_state_bytes([p.numel for p in unit.params], world=part.zero.world, rank=rank,
                                   persistent=unit.persistent, work_bytes=zero.work_bytes, full_gradients=full,
                                   optimizer=zero.optimizer, offload_optimizer=zero.offload_optimizer,
                                   offload_params=zero.offload_params)
            for key, value in got.items():
                total[key] = total.get(key, 0) + value
    return total


def padded(unit: UnitPlan[Param], zero: ZeroSetup) -> int:
    """A unit's padded element count (what its collectives move)."""
    return padded_numel(sum(p.numel for p in unit.params), zero.world)


def _numel(p: Param) -> int:
    return p.numel

"""One layout's prediction: per-rank peak memory and the step time.

``Planner(model, workload)`` holds what every layout of one model shares (the tp-local
parameter shapes, the fake-tensor profiles of each kind of chunk) and answers
``planner.predict(layout, hardware)``. Profiles are taken for chunks of one and two blocks and
extended linearly to a chunk's block count (a chunk repeats its blocks; what differs is the
embedding at the start and the head and loss at the end).

Step time, for the slowest pipeline rank: the pipeline's makespan from ``pipeline.simulate`` on
the schedule's own table with that rank's forward and backward times per micro-batch (roofline
per op plus its tensor-parallel collectives) and the activation transfer as p2p latency; then
what ZeRO's data-parallel collectives leave exposed, the tied-embedding exchange and the
optimizer step. Under pipeline stages ZeRO's reductions run while the schedule goes on (a
chunk's after its last backward pass at stages 0-1, after each pass at stages 2-3:
``timing.dp_seconds``); stage 3 gathers blocks around each use and its root units once per step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache

import torch
from torch import nn

from models.family import text_config
from parallel3d.errors import ConfigError
from parallel3d.expert_parallel.plan import resolve_experts
from parallel3d.pipeline.schedules import has_weight_pass, validate_schedule_args
from parallel3d.planner.hardware import Hardware
from parallel3d.planner.inventory import ModelShapes, RankParams, pipeline_split
from parallel3d.planner.memory import RankMemory, pipeline_table, predict_rank
from parallel3d.planner.profile import PassProfile, ProfileError
from parallel3d.planner.profile_store import Profiler, ProfileStore
from parallel3d.planner.states import ZeroSetup
from parallel3d.planner.timing import RankCost, all_to_all_seconds, moe_layers, step_parts
from zero.sizing import OptimizerStateShape

logger = logging.getLogger(__name__)

WORK_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


def _refuse_once(refusals: dict[tuple, str | None], key: tuple, check: Callable[[], object]) -> None:
    """Run ``check`` (an engine check that raises ConfigError) once per ``key``; raise its refusal,
    remembered, on every call with that key."""
    if key not in refusals:
        try:
            check()
            refusals[key] = None
        except ConfigError as exc:
            refusals[key] = str(exc)
    if refusals[key] is not None:
        raise ConfigError(refusals[key])


@dataclass(frozen=True)
class Layout:
    """One candidate: mesh sizes, ZeRO stage, micro-batch, schedule, recomputation, sequence parallel."""

    pp: int
    dp: int
    tp: int
    zero_stage: int
    micro_batch: int
    schedule: str = "1f1b"
    virtual_stages: int = 1
    checkpointing: bool = False
    sequence_parallel: bool = False
    shard: int | None = None
    """Hybrid sharding (``zero_optimization.mics_shard_size``): ZeRO shards over groups of this many
    data-parallel ranks and replicates across them; None: over all dp (flat)."""
    zeropp: int = 0
    """ZeRO++ at stage 3 on a shard group spanning nodes of this many of its ranks each: int8
    gathers and gradients (qgZ in two hops) and hpZ over a node; 0: off."""
    ep: int = 1
    """Expert parallelism (``expert_parallel.autoep_size``): each MoE layer's routed experts split
    over groups of this many of the ranks ZeRO shards over; 1: off."""
    cp: int = 1
    """Context parallelism (``context_parallel.size``): each sequence split over this many ranks,
    which share their micro-batches (``dp`` counts the replicas without them); 1: off."""
    cp_method: str = "ulysses"
    """``context_parallel.method``: "ulysses" or "ring" (with ``cp`` 1, "ulysses")."""
    etp: int = 1
    """Expert tensor parallelism (``expert_parallel.expert_tensor_parallel_size``), with ``ep`` > 1 and
    ``tp`` > 1: 1 keeps each expert whole on every tp rank, ``tp`` splits it over them."""

    @property
    def whole_experts(self) -> bool:
        """Whether tensor parallelism leaves the experts whole on every tp rank (expert parallelism
        without expert tensor parallelism)."""
        return self.ep > 1 and self.tp > 1 and self.etp == 1

    @property
    def dp_cp(self) -> int:
        """The ranks that hold the same weights: data-parallel times context-parallel."""
        return self.dp * self.cp

    @property
    def zero_shard(self) -> int:
        """The ranks ZeRO shards over (the engine shards over dp_shard x cp)."""
        return self.shard or self.dp_cp

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp * self.cp

    def microbatches(self, global_batch: int) -> int:
        return global_batch // (self.dp * self.micro_batch)

    def describe(self) -> str:
        sched = "" if self.pp == 1 else f" {self.schedule}" + (f" v{self.virtual_stages}" if self.virtual_stages > 1 else "")
        extras = "".join([" ac" if self.checkpointing else "", " sp" if self.sequence_parallel else ""])
        hybrid = f" hs{self.shard}" if self.shard else ""
        zeropp = "++" if self.zeropp else ""
        ep = f" ep{self.ep}" + (f" etp{self.etp}" if self.etp > 1 else "") if self.ep > 1 else ""
        cp = f" cp{self.cp}-{self.cp_method}" if self.cp > 1 else ""
        return (f"pp{self.pp} dp{self.dp}{cp} tp{self.tp}{ep} z{self.zero_stage}{zeropp}{hybrid} mb{self.micro_batch}"
                f"{sched}{extras}")


@dataclass(frozen=True)
class Workload:
    """What is trained: sequence length, global batch (samples per step), precision and ZeRO's knobs."""

    seq: int
    global_batch: int
    dtype: torch.dtype = torch.bfloat16
    optimizer: OptimizerStateShape = OptimizerStateShape(2, 1)
    bucket_size: int = 500_000_000
    persistence_threshold: int = 100_000
    prefetch: int = 50_000_000
    max_live: int = 1_000_000_000
    overlap_comm: bool | None = None  # None: DeepSpeed's rule, on for stage 3 only
    offload_optimizer: bool = False  # ZeRO-Offload of the optimizer (stages 1-3)
    offload_params: bool = False  # ZeRO-Offload of stage 3's parameter shards
    balance: str = "parameters"
    quantized_weights: bool = False  # zero_quantized_weights (stage 3)
    quantized_gradients: bool = False  # zero_quantized_gradients (stages 1-3)
    hpz: int = 1  # zero_hpz_partition_size (stage 3)
    gpus_per_node: int = 0  # the node size the engine finds (LOCAL_WORLD_SIZE), for qgZ's two hops; 0: one node

    @property
    def work_bytes(self) -> int:
        return WORK_BYTES[self.dtype]


@dataclass
class Prediction:
    """What the planner says of one layout."""

    layout: Layout
    ranks: list[RankMemory]  # pipeline rank r (tp rank 0, dp rank 0)
    step_seconds: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)  # seconds by cause
    flops_per_step: float = 0.0  # counted over all devices, recomputation included

    @property
    def peak(self) -> int:
        return max(r.peak for r in self.ranks)

    def fits(self, memory: float) -> bool:
        return self.peak <= memory


@dataclass(frozen=True)
class Chunk:
    """A chunk of ``blocks`` blocks at ``micro_batch``: affine in each from profiles at 1 and 2 of both.

    Every tensor a block creates scales with the micro-batch, and a chunk repeats its blocks, so
    each quantity is ``a + b (n - 1) + c (mb - 1) + d (n - 1)(mb - 1)`` and four runs fix it.
    """

    kind: str
    blocks: int
    micro_batch: int
    runs: tuple[PassProfile, PassProfile, PassProfile, PassProfile]  # (n, mb) = (1,1), (2,1), (1,2), (2,2)

    def _grow(self, values: tuple[float, float, float, float]) -> float:
        a, n2, b2, both = values
        dn, db = self.blocks - 1, self.micro_batch - 1
        return a + dn * (n2 - a) + db * (b2 - a) + dn * db * (both - n2 - b2 + a)

    def _int(self, name: str) -> int:
        return int(self._grow(tuple(getattr(r, name) for r in self.runs)))

    @cached_property
    def at_rest(self) -> int:
        return self._int("at_rest")

    @cached_property
    def forward_peak(self) -> int:
        return self._int("forward_peak")

    @cached_property
    def backward_peak(self) -> int:
        return self._int("backward_peak")

    @cached_property
    def after_first_grad(self) -> int:
        return self._int("after_first_grad")

    @cached_property
    def input_grad_peak(self) -> int:
        """ZB-H1: the input-gradient pass's peak (from zero); what it leaves; the weight pass's peak."""
        return int(self._grow(tuple(r.split.input_peak for r in self.runs)))

    @cached_property
    def held_for_weights(self) -> int:
        return int(self._grow(tuple(r.split.held for r in self.runs)))

    @cached_property
    def weight_grad_peak(self) -> int:
        return int(self._grow(tuple(r.split.weight_peak for r in self.runs)))

    @property
    def forward_peak_in_block(self) -> bool:
        return self.runs[3].forward_peak_in_block

    @property
    def backward_peak_in_block(self) -> bool:
        return self.runs[3].backward_peak_in_block

    def seconds(self, hw: Hardware, tp: int, backward: bool, cp: int = 1) -> float:
        """One pass's seconds, never under its FLOPs at the matrix rate: the extrapolation of the four
        runs' times to a larger micro-batch could fall below that where a small op's time is its
        weight reads at micro-batch 1 and 2, whereas the FLOPs scale exactly. The search's lower
        bound (`bound.step_floor`) rests on this floor."""
        measured = self._grow(tuple(_pass_seconds(r, hw, tp, backward, cp) for r in self.runs))
        return max(measured, self.pass_flops(backward) / hw.flop_rate)

    def pass_flops(self, backward: bool) -> float:
        """FLOPs of one forward (or backward) pass of the chunk (recomputation included)."""
        return self._pass_flops[backward]

    @cached_property
    def _pass_flops(self) -> tuple[float, float]:
        return (self._grow(tuple(float(r.flops[0]) for r in self.runs)),
                self._grow(tuple(float(r.flops[1]) for r in self.runs)))

    @cached_property
    def blocks_forward_flops(self) -> float:
        """FLOPs of its blocks' forward passes: the forward's less the chunk's without blocks (its
        embedding, head and loss)."""
        forward = tuple(float(r.flops[0]) for r in self.runs)
        return self._grow(forward) - replace(self, blocks=0)._grow(forward)

    def flops(self) -> float:
        return self._grow(tuple(float(sum(r.flops)) for r in self.runs))


@lru_cache(maxsize=4096)
def _pass_seconds(profile: PassProfile, hw: Hardware, tp: int, backward: bool, cp: int = 1) -> float:
    """Roofline time of a profiled pass's ops plus its tensor-parallel collectives and its
    context-parallel exchanges on the cp group's link (cp ranks tp apart). The ring's sends are
    counted whole, though the engine overlaps each with a block's compute: an upper bound."""
    ops = profile.backward_ops if backward else profile.forward_ops
    link = hw.link(1, tp)
    comm = sum(link.seconds(op, size, tp) for op, size, back in profile.comm if back == backward)
    if cp > 1:
        cp_link = hw.link(tp, cp)
        comm += sum(cp_link.seconds(op, size, cp) for op, size, back in profile.cp_comm
                    if back == backward and op != "recv")
    return sum(hw.op_seconds(f, b) for f, b in ops) + comm


class Planner:
    """Predictions for one model (built on the meta device is fine) and one workload."""

    def __init__(self, model: nn.Module, workload: Workload, *, store: ProfileStore | None = None,
                 workers: int = 1) -> None:
        """``store``: profiles kept on disk between runs; ``workers``: processes that profile ahead
        (`prefetch`; parallel3d/planner/profile_store.py)."""
        self.model = model
        self.config = model.config
        self.workload = workload
        self.store, self.workers = store, workers
        self._profiler = Profiler(self.config, workload.seq, workload.dtype, workers)
        self._shapes: dict[tuple[int, int, int], ModelShapes] = {}
        self._profiles: dict[tuple, PassProfile] = {}
        self._failed: dict[tuple, str] = {}  # profiles that failed (why), not run again
        self._chunks: dict[tuple, Chunk] = {}
        self._kinds: dict[tuple, list[tuple[str, int]]] = {}  # chunk_kinds, by what it depends on
        self._refusals: dict[tuple, str | None] = {}  # the engine's checks, by what they were asked (_refuse_once)

    def shapes(self, tp: int, ep: int = 1, etp: int = 1) -> ModelShapes:
        etp = etp if ep > 1 else 1  # without expert parallelism tp splits the experts in any case
        if (tp, ep, etp) not in self._shapes:
            self._shapes[tp, ep, etp] = ModelShapes(self.model, tp, ep=ep, etp=etp, split=self.pipeline_split)
        return self._shapes[tp, ep, etp]

    @cached_property
    def pipeline_split(self):
        """Where a pipeline splits the model, or why it cannot (`inventory.pipeline_split`), read once."""
        return pipeline_split(self.model)

    def layout_shapes(self, layout: Layout) -> ModelShapes:
        """The parameters of ``layout``'s ranks (its tp, ep and expert tensor parallelism)."""
        return self.shapes(layout.tp, layout.ep, layout.etp)

    def _profile(self, *key) -> PassProfile:
        """The profile of ``key`` = (kind, blocks, micro_batch, tp, sp, ac, attention, split, whole_experts,
        cp, cp_method), computed once."""
        if key not in self._profiles and key not in self._failed:
            self._fill([key], workers=1)
        if key in self._failed:
            raise ProfileError(self._failed[key])
        return self._profiles[key]

    def prefetch(self, keys: Iterable[tuple], wait: bool = True) -> None:
        """Profile ``keys`` now, on ``workers`` processes and from ``store`` (else lazily, when read);
        ``wait=False``: those not stored are started on the workers and this returns (a read waits for them)."""
        if self.workers > 1 or self.store is not None:
            self._fill(keys, self.workers, wait)

    def started(self, keys: Iterable[tuple]) -> bool:
        """Whether the workers have (or had) every one of ``keys`` to profile."""
        return self._profiler.started(keys)

    def _fill(self, keys: Iterable[tuple], workers: int, wait: bool = True) -> None:
        missing = self.unknown(dict.fromkeys(keys))
        if self.store is not None:
            for key in missing:
                if (stored := self.store.get(key)) is not None:
                    self._record(key, stored)
            missing = self.unknown(missing)
        if not missing:
            return
        if wait:
            self._take(self._profiler(missing, parallel=workers > 1))
        else:
            self._profiler.ahead(missing)

    def _take(self, profiled: dict[tuple, PassProfile | ProfileError]) -> None:
        """Record (and store) what the profiler made; a failure as the message that names its settings."""
        for key, value in profiled.items():
            if isinstance(value, ProfileError):
                kind, blocks, micro_batch, tp, sp, ac, attention, split, whole_experts, cp, method = key
                value = (f"tp {tp}{', sequence parallel' if sp else ''}{', checkpointing' if ac else ''}"
                         f"{', experts whole' if whole_experts else ''}{f', cp {cp} {method}' if cp > 1 else ''}: "
                         f"{value}")
            self._record(key, value)
            if self.store is not None:
                self.store.put(key, value)

    def close(self) -> None:
        """Stop the profiling worker processes, if any (a later profile starts new ones), keeping the
        profiles they made ahead that nothing read (stored for the next run)."""
        self._take(self._profiler.close())

    def _record(self, key: tuple, value: PassProfile | str) -> None:
        if isinstance(value, str):
            self._failed[key] = value
        else:
            self._profiles[key] = value

    def chunk_keys(self, layout: Layout, kind: str, hw: Hardware, split: bool | None = None) -> list[tuple]:
        """The four profiles of a chunk; ``split``: with (True) or without (False) ZB-H1's split backward,
        None: as the layout's schedule runs it."""
        split = has_weight_pass(layout.schedule) if split is None else split
        # at expert tensor parallelism the profile is tp's own (experts split); else the experts stay whole
        key = (layout.tp, layout.sequence_parallel, layout.checkpointing, hw.attention, split,
               layout.whole_experts, layout.cp, layout.cp_method if layout.cp > 1 else "ulysses")
        return [(kind, n, mb, *key) for mb in (1, 2) for n in (1, 2)]

    def chunk(self, layout: Layout, kind: str, blocks: int, hw: Hardware, split: bool | None = None) -> Chunk:
        """The chunk's figures, one object per (profiles, blocks, micro-batch): layouts that differ in
        what the chunk does not see (ZeRO stage, dp, schedule) share its computed values."""
        keys = tuple(self.chunk_keys(layout, kind, hw, split))
        known = self._chunks.get((keys, blocks, layout.micro_batch))
        if known is None:
            known = Chunk(kind, blocks, layout.micro_batch, tuple(self._profile(*key) for key in keys))
            self._chunks[keys, blocks, layout.micro_batch] = known
        return known

    def profile_keys(self, layout: Layout, hw: Hardware, exact: bool, split: bool | None = None) -> set[tuple]:
        """The profiles `predict` reads for ``layout`` (``split``: as :meth:`chunk_keys`)."""
        return {key for rank in self.ranks_to_price(layout, exact) for kind, _ in self.chunk_kinds(layout, rank)
                for key in self.chunk_keys(layout, kind, hw, split)}

    def zero(self, layout: Layout) -> ZeroSetup:
        w = self.workload
        stage3 = layout.zero_stage == 3
        if layout.zeropp:
            extras = {"quantized_weights": True, "quantized_gradients": True, "hpz": layout.zeropp,
                      "node": layout.zeropp}
        else:  # as the config gives them; qgZ takes two hops where the shard group spans nodes (engine's rule)
            local = w.gpus_per_node // layout.tp if w.gpus_per_node % layout.tp == 0 else 0
            two_hops = w.quantized_gradients and 1 < local < layout.zero_shard and layout.zero_shard % local == 0
            extras = {"quantized_weights": w.quantized_weights and stage3, "quantized_gradients": w.quantized_gradients,
                      "hpz": w.hpz if stage3 else 1, "node": local if two_hops else 0}
        return ZeroSetup(layout.zero_stage, layout.zero_shard, w.work_bytes, w.optimizer, w.bucket_size,
                         w.persistence_threshold, offload_optimizer=w.offload_optimizer and layout.zero_stage >= 1,
                         offload_params=w.offload_params and stage3, **extras)

    def check(self, layout: Layout) -> None:
        """ConfigError when the layout cannot run this workload (the rules initialize applies)."""
        w = self.workload
        if w.global_batch % (layout.dp * layout.micro_batch):
            raise ConfigError(f"global batch {w.global_batch} is not a multiple of dp {layout.dp} x micro-batch "
                              f"{layout.micro_batch}")
        if (w.quantized_weights or w.hpz > 1) and layout.zero_stage != 3:
            raise ConfigError("zero_quantized_weights and zero_hpz_partition_size need ZeRO stage 3")
        if w.quantized_gradients and layout.zero_stage == 0:
            raise ConfigError("zero_quantized_gradients needs ZeRO stage 1, 2 or 3")
        if layout.ep > 1:
            self._check_experts(layout.ep)
            if layout.zero_shard % layout.ep:
                raise ConfigError(f"expert_parallel.autoep_size {layout.ep} does not divide the {layout.zero_shard} "
                                  "ranks ZeRO shards over")
            if layout.etp not in (1, layout.tp):
                raise ConfigError(f"expert_parallel.expert_tensor_parallel_size {layout.etp} with tensor_parallel.size "
                                  f"{layout.tp}: allowed: 1 or {layout.tp}")
            if layout.zeropp or w.hpz > 1:
                raise ConfigError("expert_parallel does not compose with ZeRO++'s hpZ")
            if self.top_k is None:
                raise ConfigError(f"expert_parallel: {type(self.config).__name__} gives no num_experts_per_tok, the "
                                  "experts each token is routed to")
        if layout.cp > 1:
            self._check_context(layout)
        if layout.sequence_parallel and w.seq // layout.cp % layout.tp:
            raise ConfigError("sequence parallelism needs a sequence length (per cp rank) divisible by tp")
        if layout.pp > 1:
            validate_schedule_args(layout.schedule, layout.pp, layout.microbatches(w.global_batch),
                                   layout.virtual_stages)

    def _check_context(self, layout: Layout) -> None:
        """The engine's refusals of context parallelism for this model and layout (``check_model``,
        once per (cp, tp, method)), and the sequence length's divisibility."""
        from parallel3d.context_parallel.model import check_model

        pieces = 2 * layout.cp if layout.cp_method == "ring" else layout.cp
        if self.workload.seq % pieces:
            raise ConfigError(f"context_parallel {layout.cp_method} at size {layout.cp} needs a sequence length "
                              f"divisible by {pieces}; {self.workload.seq} is not")
        if layout.ep > 1 or layout.shard or layout.zeropp:
            raise ConfigError("the planner prices context_parallel without expert parallelism, hybrid sharding and "
                              "ZeRO++")
        key = (layout.cp, layout.tp, layout.cp_method)
        _refuse_once(self._refusals, ("context", key), lambda: check_model(self.model, *key))

    @cached_property
    def experts(self) -> int:
        """The greatest common divisor of the routed-expert counts of the model's MoE layers (the
        ``expert_parallel`` sizes it admits divide it); 0 for a model expert parallelism cannot split."""
        try:
            modules = resolve_experts(self.model, 1)
        except ConfigError as exc:
            logger.info("no expert parallelism: %s", exc)
            return 0
        return math.gcd(*(m.num_experts for m in modules))

    def _check_experts(self, ep: int) -> None:
        """``resolve_experts``' refusal of a split over ``ep`` ranks (no experts, ``ep`` not dividing them), once per ep."""
        _refuse_once(self._refusals, ("experts", ep), lambda: resolve_experts(self.model, ep))

    @cached_property
    def top_k(self) -> int | None:
        """Routed experts per token (``num_experts_per_tok``), None for a model without."""
        value = getattr(text_config(self.config), "num_experts_per_tok", None)
        return value if isinstance(value, int) else None

    def chunk_kinds(self, layout: Layout, rank: int) -> list[tuple[str, int]]:
        """(kind, blocks) of each of the rank's chunks (computed once per pipeline, model shapes and rank)."""
        settings = (layout.pp, layout.virtual_stages, layout.tp, layout.ep, layout.etp if layout.ep > 1 else 1, rank)
        known = self._kinds.get(settings)
        if known is None:
            known = self._kinds[settings] = self._chunk_kinds(layout, rank)
        return known

    def _chunk_kinds(self, layout: Layout, rank: int) -> list[tuple[str, int]]:
        shapes = self.layout_shapes(layout)
        if layout.pp == 1:
            return [("only", len(shapes.block_params))]
        stage_layout = shapes.stage_layout(layout.pp, layout.virtual_stages, balance=self.workload.balance)
        last = stage_layout.total_stages - 1
        kinds = []
        for c in range(layout.virtual_stages):
            stage = stage_layout.stage_of(rank, c)
            kind = "only" if last == 0 else "first" if stage == 0 else "last" if stage == last else "middle"
            kinds.append((kind, stage_layout.sizes[stage]))
        return kinds

    def rank_params(self, layout: Layout, rank: int) -> RankParams:
        """The parameters pipeline rank ``rank`` holds (tp rank 0)."""
        shapes = self.layout_shapes(layout)
        stage3 = layout.zero_stage == 3
        if layout.pp == 1:
            return shapes.rank_params(stage3=stage3)
        stage_layout = shapes.stage_layout(layout.pp, layout.virtual_stages, balance=self.workload.balance)
        return shapes.rank_params(pp=layout.pp, pp_rank=rank, layout=stage_layout, stage3=stage3)

    def rank_chunks(self, layout: Layout, rank: int, hw: Hardware,
                    split: bool | None = None) -> tuple[RankParams, list[Chunk]]:
        return self.rank_params(layout, rank), [self.chunk(layout, kind, n, hw, split)
                                                for kind, n in self.chunk_kinds(layout, rank)]

    def ranks_to_price(self, layout: Layout, every_rank: bool) -> list[int]:
        """Pipeline ranks whose memory the prediction computes.

        All of them, or for long pipelines the first two, the last two and the one with the
        most parameters: a rank further down holds fewer micro-batches in flight than rank 1
        (1F1B, interleaving, ZB-H1) or as many (GPipe), and the same kind of chunks.
        """
        if every_rank or layout.pp <= 8:
            return list(range(layout.pp))
        shapes = self.layout_shapes(layout)
        stage_layout = shapes.stage_layout(layout.pp, layout.virtual_stages, balance=self.workload.balance)
        heaviest = max(range(layout.pp), key=lambda r: sum(stage_layout.sizes[stage_layout.stage_of(r, c)]
                                                           for c in range(layout.virtual_stages)))
        return sorted({0, 1, heaviest, layout.pp - 2, layout.pp - 1})

    def step_time(self, layout: Layout, hw: Hardware, *, exact: bool = True) -> tuple[dict[str, float], float]:
        """The step's seconds by cause and the FLOPs per step (all devices), without the memory walk.

        The ranks timed are those `predict` prices; so `predict`'s ``parts`` are these exactly.
        """
        self.check(layout)
        costs, flops = self.rank_costs(layout, hw, exact=exact)
        return self.parts(layout, costs, hw, exact=exact), flops

    def rank_costs(self, layout: Layout, hw: Hardware, *, exact: bool,
                   split: bool | None = None) -> tuple[list[RankCost], float]:
        """The pass seconds of each rank :meth:`step_time` times, and the FLOPs per step (all devices);
        ``split``: the profiles read (:meth:`chunk_keys`)."""
        m = layout.microbatches(self.workload.global_batch)
        costs, flops = [], 0.0
        for rank in self.ranks_to_price(layout, exact):
            params, chunks = self.rank_chunks(layout, rank, hw, split)
            moe = self.moe_seconds(layout, params, hw)
            fwd = sum(c.seconds(hw, layout.tp, False, layout.cp) for c in chunks) + moe
            bwd = sum(c.seconds(hw, layout.tp, True, layout.cp) for c in chunks) + moe
            costs.append(RankCost(fwd, bwd, params))
            flops += m * sum(c.flops() for c in chunks)
        return costs, flops * layout.world / len(costs)

    def parts(self, layout: Layout, costs: list[RankCost], hw: Hardware, *, exact: bool,
              hidden_compute: bool = False) -> dict[str, float]:
        """`timing.step_parts` of ``layout`` with its ranks' ``costs`` (``hidden_compute``: the
        data-parallel collectives as if compute hid all it can, for a lower bound)."""
        w = self.workload
        overlap = w.overlap_comm if w.overlap_comm is not None else layout.zero_stage == 3
        tied = self.layout_shapes(layout).tied_numel if layout.pp > 1 else 0
        return step_parts(layout, self.zero(layout), costs, hw, m=layout.microbatches(w.global_batch),
                          hidden_bytes=self._hidden_bytes(layout), overlap=overlap, tied_numel=tied, exact=exact,
                          hidden_compute=hidden_compute)

    @cached_property
    def recomputes_every_block(self) -> bool:
        """Whether gradient checkpointing recomputes each block of the model (`bound.recomputes_every_block`)."""
        from parallel3d.planner.bound import recomputes_every_block

        return recomputes_every_block(self.model)

    def unknown(self, keys: Iterable[tuple]) -> list[tuple]:
        """The profile keys not computed (nor failed) yet."""
        return [k for k in keys if k not in self._profiles and k not in self._failed]

    def moe_seconds(self, layout: Layout, params: RankParams, hw: Hardware) -> float:
        """One pass's expert-parallel all-to-alls on a rank, per micro-batch (`timing.all_to_all_seconds`).

        Every token's ``top_k`` rows of [hidden] in the working dtype; under sequence parallelism with
        the experts whole each tp rank dispatches its own ``1/tp`` of the tokens, whereas expert tensor
        parallelism gathers the tp ranks' tokens first and every tp rank dispatches all of them (the
        gather and the reduce-scatter after the combine, or the all-reduce without sequence
        parallelism, are the tp plan's collectives, counted in the profile)."""
        if layout.ep == 1:
            return 0.0
        link = hw.link(layout.tp, layout.ep)  # an ep group: ep consecutive shard ranks, tp apart
        rows = self._hidden_bytes(layout) // (layout.tp if layout.sequence_parallel and layout.whole_experts else 1)
        return all_to_all_seconds(moe_layers(params), self.top_k * rows, layout.ep, link)

    def _hidden_bytes(self, layout: Layout) -> int:
        """One ``[micro_batch, seq / cp, hidden]`` activation (what a pipeline stage sends)."""
        w = self.workload
        return layout.micro_batch * (w.seq // layout.cp) * self.config.hidden_size * w.work_bytes

    def predict(self, layout: Layout, hw: Hardware, *, exact: bool = True) -> Prediction:
        """Peak memory of the pipeline ranks and the step time on ``hw``.

        ``exact=False`` (the search's first pass) prices long pipelines on a few ranks and takes
        the pipeline's makespan from the schedule's closed form rather than its simulation.
        """
        parts, flops = self.step_time(layout, hw, exact=exact)
        w = self.workload
        m = layout.microbatches(w.global_batch)
        zero = self.zero(layout)
        overlap = w.overlap_comm if w.overlap_comm is not None else layout.zero_stage == 3
        ranks = []
        for rank in self.ranks_to_price(layout, exact):
            params, chunks = self.rank_chunks(layout, rank, hw)
            table = pipeline_table(layout.schedule, layout.pp, m, layout.virtual_stages, rank)
            ranks.append(predict_rank(params, zero, table=table, chunk=chunks.__getitem__,
                                      hidden_bytes=self._hidden_bytes(layout), pipelined=layout.pp > 1,
                                      prefetch=w.prefetch, max_live=w.max_live, overlap=overlap,
                                      foreach=hw.foreach_optimizer))
        prediction = Prediction(layout, ranks, flops_per_step=flops, parts=parts)
        prediction.step_seconds = sum(parts.values())
        return prediction

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
optimizer step. Under pipeline stages today every gradient is reduced after the pipeline has
drained (``defer_reduction``), so that time is all exposed (``states.full_gradients`` is the
rule to change with issue 11 item 1).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import lru_cache

import torch
from torch import nn

from parallel3d.errors import ConfigError
from parallel3d.pipeline.schedules import schedule_table, validate_schedule_args
from parallel3d.pipeline.simulate import Costs, simulate
from parallel3d.planner.hardware import Hardware
from parallel3d.planner.inventory import ModelShapes, RankParams
from parallel3d.planner.memory import RankMemory, pipeline_table, predict_rank
from parallel3d.planner.profile import PassProfile, profile_pass
from parallel3d.planner.states import ZeroSetup, full_gradients, padded, units
from zero.sizing import OptimizerStateShape

logger = logging.getLogger(__name__)

WORK_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


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

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    def microbatches(self, global_batch: int) -> int:
        return global_batch // (self.dp * self.micro_batch)

    def describe(self) -> str:
        sched = "" if self.pp == 1 else f" {self.schedule}" + (f" v{self.virtual_stages}" if self.virtual_stages > 1 else "")
        extras = "".join([" ac" if self.checkpointing else "", " sp" if self.sequence_parallel else ""])
        return f"pp{self.pp} dp{self.dp} tp{self.tp} z{self.zero_stage} mb{self.micro_batch}{sched}{extras}"


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
    balance: str = "parameters"

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
    """A chunk of ``blocks`` blocks: its profile extended linearly from one- and two-block runs."""

    kind: str
    blocks: int
    one: PassProfile
    two: PassProfile

    def _grow(self, a: float, b: float) -> float:
        return a + (self.blocks - 1) * (b - a)

    @property
    def at_rest(self) -> int:
        return int(self._grow(self.one.at_rest, self.two.at_rest))

    @property
    def forward_peak(self) -> int:
        return int(self._grow(self.one.forward_peak, self.two.forward_peak))

    @property
    def backward_peak(self) -> int:
        return int(self._grow(self.one.backward_peak, self.two.backward_peak))

    @property
    def after_first_grad(self) -> int:
        return int(self._grow(self.one.after_first_grad, self.two.after_first_grad))

    def seconds(self, hw: Hardware, tp: int, backward: bool) -> float:
        def run(p: PassProfile) -> float:
            ops = p.backward_ops if backward else p.forward_ops
            comm = sum(hw.link(1, tp).seconds(op, size, tp) for op, size, back in p.comm if back == backward)
            return sum(hw.op_seconds(f, b) for f, b in ops) + comm

        return self._grow(run(self.one), run(self.two))

    def flops(self) -> float:
        return self._grow(sum(self.one.flops), sum(self.two.flops))


class Planner:
    """Predictions for one model (built on the meta device is fine) and one workload."""

    def __init__(self, model: nn.Module, workload: Workload) -> None:
        self.model = model
        self.config = model.config
        self.workload = workload
        self._shapes: dict[int, ModelShapes] = {}
        self._profile = lru_cache(maxsize=None)(self._profile_uncached)

    def shapes(self, tp: int) -> ModelShapes:
        if tp not in self._shapes:
            self._shapes[tp] = ModelShapes(self.model, tp)
        return self._shapes[tp]

    def _profile_uncached(self, kind: str, blocks: int, micro_batch: int, tp: int, sp: bool, ac: bool) -> PassProfile:
        w = self.workload
        return profile_pass(self.config, kind, blocks, micro_batch=micro_batch, seq=w.seq, dtype=w.dtype, tp=tp,
                            sequence_parallel=sp, checkpointing=ac)

    def chunk(self, layout: Layout, kind: str, blocks: int) -> Chunk:
        key = (layout.micro_batch, layout.tp, layout.sequence_parallel, layout.checkpointing)
        return Chunk(kind, blocks, self._profile(kind, 1, *key), self._profile(kind, 2, *key))

    def zero(self, layout: Layout) -> ZeroSetup:
        w = self.workload
        return ZeroSetup(layout.zero_stage, layout.dp, w.work_bytes, w.optimizer, w.bucket_size,
                         w.persistence_threshold)

    def check(self, layout: Layout) -> None:
        """ConfigError when the layout cannot run this workload (the rules initialize applies)."""
        w = self.workload
        if w.global_batch % (layout.dp * layout.micro_batch):
            raise ConfigError(f"global batch {w.global_batch} is not a multiple of dp {layout.dp} x micro-batch "
                              f"{layout.micro_batch}")
        if layout.sequence_parallel and (layout.pp > 1 or w.seq % layout.tp):
            raise ConfigError("sequence parallelism needs pipeline.stages 1 and a sequence length divisible by tp")
        if layout.pp > 1:
            validate_schedule_args(layout.schedule, layout.pp, layout.microbatches(w.global_batch),
                                   layout.virtual_stages)

    def rank_chunks(self, layout: Layout, rank: int) -> tuple[RankParams, list[Chunk]]:
        shapes = self.shapes(layout.tp)
        stage3 = layout.zero_stage == 3
        if layout.pp == 1:
            return shapes.rank_params(stage3=stage3), [self.chunk(layout, "only", len(shapes.block_params))]
        stage_layout = shapes.stage_layout(layout.pp, layout.virtual_stages, balance=self.workload.balance)
        last = stage_layout.total_stages - 1
        chunks = []
        for c in range(layout.virtual_stages):
            stage = stage_layout.stage_of(rank, c)
            kind = "only" if last == 0 else "first" if stage == 0 else "last" if stage == last else "middle"
            chunks.append(self.chunk(layout, kind, stage_layout.sizes[stage]))
        params = shapes.rank_params(pp=layout.pp, pp_rank=rank, layout=stage_layout, stage3=stage3)
        return params, chunks

    def predict(self, layout: Layout, hw: Hardware) -> Prediction:
        """Peak memory of every pipeline rank and the step time on ``hw``."""
        self.check(layout)
        w = self.workload
        m = layout.microbatches(w.global_batch)
        zero = self.zero(layout)
        overlap = w.overlap_comm if w.overlap_comm is not None else layout.zero_stage == 3
        hidden = layout.micro_batch * w.seq * self.config.hidden_size * w.work_bytes
        pipelined = layout.pp > 1
        ranks, costs, flops = [], [], 0.0
        for rank in range(layout.pp):
            params, chunks = self.rank_chunks(layout, rank)
            table = pipeline_table(layout.schedule, layout.pp, m, layout.virtual_stages, rank)
            ranks.append(predict_rank(params, zero, table=table, chunk=chunks.__getitem__, hidden_bytes=hidden,
                                      pipelined=pipelined, prefetch=w.prefetch, max_live=w.max_live, overlap=overlap,
                                      foreach=hw.foreach_optimizer))
            fwd = sum(c.seconds(hw, layout.tp, False) for c in chunks)
            bwd = sum(c.seconds(hw, layout.tp, True) for c in chunks)
            costs.append((fwd, bwd, params))
            flops += m * sum(c.flops() for c in chunks)
        prediction = Prediction(layout, ranks, flops_per_step=flops * layout.tp * layout.dp)
        self._time(prediction, costs, hw, m, hidden, overlap)
        return prediction

    def _time(self, pred: Prediction, costs: list, hw: Hardware, m: int, hidden: int, overlap: bool) -> None:
        layout, zero = pred.layout, self.zero(pred.layout)
        fwd = max(c[0] for c in costs)
        bwd = max(c[1] for c in costs)
        if layout.pp == 1:
            pipeline = m * (fwd + bwd)
        else:
            p2p = hw.link(layout.tp * layout.dp, layout.pp).seconds("send", hidden, 2)
            split = layout.schedule == "zb_h1"
            table = schedule_table(layout.schedule, layout.pp, m, layout.virtual_stages, communication=False)
            pipeline = simulate(table, Costs(fwd, bwd / 2 if split else bwd, bwd / 2 if split else 0.0, p2p)).makespan
        dp_link = hw.link(layout.tp, layout.dp)
        exposed, step = 0.0, 0.0
        for fwd_r, bwd_r, params in costs:
            comm = _dp_seconds(params, zero, dp_link, m, pipelined=layout.pp > 1, overlap=overlap,
                               compute=(fwd_r, bwd_r))
            elements = sum(padded(u, zero) // zero.world for u in units(params, zero))
            per_element = 4 * (2 * zero.optimizer.elementwise + 4) + zero.work_bytes
            step = max(step, elements * per_element / (hw.memory_bandwidth * hw.memory_efficiency))
            exposed = max(exposed, comm)
        tied = 0.0
        if layout.pp > 1 and self.shapes(layout.tp).first and any(
                p in self.shapes(layout.tp).first for p in self.shapes(layout.tp).last):
            size = sum(p.numel for p in self.shapes(layout.tp).last if p in self.shapes(layout.tp).first)
            tied = hw.link(layout.tp * layout.dp, layout.pp).seconds("send", size * zero.work_bytes, 2)
        pred.parts = {"pipeline": pipeline, "data parallel": exposed, "tied embedding": tied, "optimizer": step}
        pred.step_seconds = sum(pred.parts.values())


def _dp_seconds(params: RankParams, zero: ZeroSetup, link, m: int, *, pipelined: bool, overlap: bool,
                compute: tuple[float, float]) -> float:
    """Seconds of ZeRO's collectives over dp that the step waits for (comm_counter's payloads)."""
    if zero.dp == 1:
        return 0.0
    plan = units(params, zero)
    n, work = zero.dp, zero.work_bytes

    def calls(op: str, chosen) -> float:
        return sum(link.seconds(op, padded(u, zero) * work, n) for u in chosen)

    sharded = [u for u in plan if not u.persistent]
    after_step = calls("all_gather", [u for u in plan if u.persistent]) if zero.stage >= 1 else 0.0
    reduce_op = "all_reduce" if zero.stage == 0 else "reduce_scatter"
    if pipelined:  # once per step, after the pipeline drained; stage 3 gathers everything first
        return calls(reduce_op, plan) + calls("all_gather", sharded) + after_step
    fwd, bwd = compute
    if full_gradients(zero.stage, False):  # one reduction, during the window's last backward
        reduce = calls(reduce_op, plan)
        return (max(0.0, reduce - bwd) if overlap else reduce) + after_step
    per_mb_bwd = calls("reduce_scatter", plan) + calls("all_gather", [u for u in sharded if not u.root])
    per_mb_fwd = calls("all_gather", sharded)
    if overlap:
        per_mb = max(0.0, per_mb_fwd - fwd) + max(0.0, per_mb_bwd - bwd)
    else:
        per_mb = per_mb_fwd + per_mb_bwd
    return m * per_mb + after_step

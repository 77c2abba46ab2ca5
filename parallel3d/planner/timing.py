"""A step's time, by cause: the pipeline, data-parallel collectives, the tied embedding, the optimizer.

* **pipeline**: the makespan of the schedule's own table (``pipeline.simulate``) with the slowest
  rank's forward and backward per micro-batch (roofline per op plus its tensor-parallel
  collectives) and the activation transfer over the pp link as p2p latency; ZB-H1 splits the
  backward into equal input- and weight-gradient halves. Without pipeline stages: micro-batches
  times (forward + backward). The search's first pass uses the schedules' closed forms instead
  (:func:`closed_form_makespan`), then simulates its best candidates.
* **data parallel**: ZeRO's collectives over dp, unit by unit with ``comm_counter``'s payloads on
  the dp link. The reduction of the window's last micro-batch (stages 0-1; under pipeline stages
  each chunk's after its last pass) or of every micro-batch (2-3) overlaps backward compute when
  ``overlap_comm`` is on; stage 3's gathers overlap the passes they serve (under pipeline
  stages its root units are gathered once per step; an embedding table and a head once per
  micro-batch).
* **tied embedding**: its gradient exchanged between the first and the last pipeline rank.
* **optimizer**: Adam reads and writes the fp32 master, its states and the gradient, and writes
  the working copy: memory-bound, ``4 (2 states + 4) + working bytes`` per element of the shard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from parallel3d.pipeline.schedules import has_weight_pass, schedule_table
from parallel3d.pipeline.simulate import Costs, simulate
from parallel3d.planner.hardware import Hardware, Link
from parallel3d.planner.inventory import RankParams
from parallel3d.planner.states import ZeroSetup, full_gradients, padded, shard_sets, units


@dataclass(frozen=True)
class ZeroLinks:
    """The links ZeRO's collectives take: the shard group's; ZeRO++'s hpZ group's (backward's
    gathers); a node's shard ranks' and their peers' across nodes (qgZ's two hops)."""

    shard: Link
    hpz: Link
    node: Link
    across: Link


def zero_links(hw: Hardware, tp: int, zero: ZeroSetup) -> ZeroLinks:
    """The links of a shard group of ``zero.dp`` ranks, ``tp`` apart in the mesh's rank order."""
    shard = hw.link(tp, zero.dp)
    node = hw.link(tp, zero.node) if zero.node > 1 else shard
    across = hw.link(tp * zero.node, zero.dp // zero.node) if zero.node > 1 else shard
    return ZeroLinks(shard, hw.link(tp, zero.hpz) if zero.hpz > 1 else shard, node, across)


def moe_layers(params: RankParams) -> int:
    """The rank's MoE layers whose experts expert parallelism split (blocks holding an expert param)."""
    return len({p.block for g in params.groups for p in g if p.expert})


def all_to_all_seconds(layers: int, payload: int, ep: int, link: Link) -> float:
    """One pass (forward or backward) of expert parallelism's all-to-alls over ``layers`` MoE layers.

    Each layer's forward dispatches every (token, choice) row to its expert's rank and combines
    the outputs back: two ``all_to_all_single`` of ``payload`` bytes (tokens x top_k x hidden x
    working bytes), of which ``(ep - 1) / ep`` leave the rank when tokens are routed evenly in
    expectation; its backward runs the same two with the splits swapped. The count exchange (ep
    integers per expert) is left out; the experts' compute is as without expert parallelism in
    total (the profile's), the same rows being computed on other ranks.
    """
    return 2 * layers * link.seconds("all_to_all", payload, ep)


@dataclass(frozen=True)
class RankCost:
    """One pipeline rank: seconds of forward and backward per micro-batch, and its parameters."""

    forward: float
    backward: float
    params: RankParams


def closed_form_makespan(schedule: str, pp: int, m: int, virtual: int, costs: Costs) -> float:
    """The schedules' textbook makespans for equal stages (Narayanan et al. 2021; Qi et al. 2023)."""
    f, b, w, lat = costs.f, costs.b, costs.w, costs.latency
    if schedule == "interleaved_1f1b":
        return (m + (pp - 1) / virtual) * (f + b + w) + 2 * (pp - 1) * lat
    if has_weight_pass(schedule):
        return (m + pp - 1) * (f + b + w) - (pp - 1) * w + 2 * (pp - 1) * lat
    return (m + pp - 1) * (f + b + w) + 2 * (pp - 1) * lat


def pipeline_seconds(schedule: str, pp: int, m: int, virtual: int, costs: Costs, exact: bool) -> float:
    if not exact:
        return closed_form_makespan(schedule, pp, m, virtual, costs)
    return simulate(_compute_table(schedule, pp, m, virtual), costs).makespan


@lru_cache(maxsize=256)
def _compute_table(schedule: str, pp: int, m: int, virtual: int) -> list:
    """The schedule's compute passes (built once: layouts that differ in ZeRO or dp share it)."""
    return schedule_table(schedule, pp, m, virtual, communication=False)


def step_parts(layout, zero: ZeroSetup, costs: list[RankCost], hw: Hardware, *, m: int, hidden_bytes: int,
               overlap: bool, tied_numel: int, exact: bool, hidden_compute: bool = False) -> dict[str, float]:
    """Seconds of one optimizer step by cause (see the module docstring).

    ``hidden_compute``: the data-parallel collectives as if the passes were long enough to hide
    all that overlap can hide (no more is exposed at any compute time): with lower bounds for
    ``costs``, the parts add up to a lower bound of the step (`bound.step_floor`)."""
    fwd, bwd = max(c.forward for c in costs), max(c.backward for c in costs)
    pp_link = hw.link(layout.tp * layout.dp * layout.cp, layout.pp)
    if layout.pp == 1:
        pipeline = m * (fwd + bwd)
    else:
        split = has_weight_pass(layout.schedule)
        step_costs = Costs(fwd, bwd / 2 if split else bwd, bwd / 2 if split else 0.0,
                           pp_link.seconds("send", hidden_bytes, 2))
        pipeline = pipeline_seconds(layout.schedule, layout.pp, m, layout.virtual_stages, step_costs, exact)
    exposed = max(dp_seconds(c.params, zero, hw, layout.tp, m, pipelined=layout.pp > 1, overlap=overlap,
                             compute=(math.inf, math.inf) if hidden_compute else (c.forward, c.backward))
                  for c in costs)
    replicas = layout.dp * layout.cp // layout.zero_shard
    if replicas > 1:  # hybrid sharding: each reduced gradient shard averaged across the replicas, once per step
        replica_link = hw.link(layout.tp * layout.zero_shard, replicas)
        exposed += max(replica_link.seconds("all_reduce", _shard_numel(c.params, zero) * zero.work_bytes, replicas)
                       for c in costs)
    per_element = 4 * (2 * zero.optimizer.elementwise + 4) + zero.work_bytes
    optimizer = max(_shard_numel(c.params, zero) for c in costs) * per_element / (hw.memory_bandwidth * hw.memory_efficiency)
    tied = pp_link.seconds("send", tied_numel * zero.work_bytes, 2) if tied_numel else 0.0
    return {"pipeline": pipeline, "data parallel": exposed, "tied embedding": tied, "optimizer": optimizer}


def dp_seconds(params: RankParams, zero: ZeroSetup, hw: Hardware, tp: int, m: int, *, pipelined: bool,
               overlap: bool, compute: tuple[float, float]) -> float:
    """Seconds of ZeRO's collectives over dp that the step waits for (comm_counter's payloads).

    Each collective stays inside its shard group (``tp`` apart in the mesh's rank order); under
    expert parallelism the experts' over the expert-shard group (``tp x ep`` apart, dp / ep ranks).
    """
    if zero.dp == 1:
        return 0.0
    calls = _dp_calls(params, zero, hw, tp)
    after_step = calls["gather persistent"] if zero.stage >= 1 else 0.0
    fwd, bwd = compute
    if pipelined:
        # stages 0-1 reduce a chunk's gradients after its last backward pass, stages 2-3
        # reduce-scatter them after each pass, both while the schedule goes on; stage 3 gathers
        # its root units once per step, each embedding table and head once per micro-batch and
        # each block around each forward and backward
        full = full_gradients(zero.stage, True, dp=zero.dp)
        reduce = calls["reduce"] if full else m * calls["reduce_scatter"]
        busy = bwd if full else m * bwd
        gather = calls["gather root"] + m * calls["gather once"]
        blocks = m * (calls["gather blocks"] + calls["gather blocks back"])
        if overlap:
            return gather + max(0.0, blocks - m * fwd) + max(0.0, reduce - busy) + after_step
        return gather + blocks + reduce + after_step
    if full_gradients(zero.stage, False, dp=zero.dp):  # one reduction, during the window's last backward
        reduce = calls["reduce"]
        return (max(0.0, reduce - bwd) if overlap else reduce) + after_step
    per_mb_bwd = calls["reduce_scatter"] + calls["gather blocks back"]
    per_mb_fwd = calls["gather sharded"]
    if overlap:
        return m * (max(0.0, per_mb_fwd - fwd) + max(0.0, per_mb_bwd - bwd)) + after_step
    return m * (per_mb_fwd + per_mb_bwd) + after_step


@lru_cache(maxsize=8192)
def _dp_calls(params: RankParams, zero: ZeroSetup, hw: Hardware, tp: int) -> dict[str, float]:
    """Seconds of each kind of ZeRO collective of one rank, its shard sets' added (read only: cached
    for every micro-batch count, schedule and compute time that prices the rank)."""
    calls: dict[str, float] = {}
    for part in shard_sets(params, zero):
        links = zero_links(hw, tp * part.stride, part.zero)
        for key, value in _collective_seconds(part.params, part.zero, links).items():
            calls[key] = calls.get(key, 0.0) + value
    return calls


@lru_cache(maxsize=8192)
def _shard_numel(params: RankParams, zero: ZeroSetup) -> int:
    """Elements of the rank's optimizer shard (padded units over the ZeRO world of their set)."""
    return sum(padded(u, part.zero) // part.zero.world for part in shard_sets(params, zero)
               for u in units(part.params, part.zero))


def int8_bytes(numel: int) -> int:
    """Bytes of ``numel`` elements sent as ZeRO++'s int8 (zero.quantized_comm): one byte each and an
    fp32 scale per block of 256."""
    return numel + 4 * -(-numel // 256)


@lru_cache(maxsize=8192)
def _collective_seconds(params: RankParams, zero: ZeroSetup, links: ZeroLinks) -> dict[str, float]:
    """Seconds of each set of ZeRO's dp collectives of one rank, once (the same for every micro-batch
    count, schedule and compute time that prices it)."""
    plan = units(params, zero)
    link = links.shard
    n, work = zero.dp, zero.work_bytes

    def calls(op: str, chosen, int8: bool = False) -> float:
        return sum(link.seconds(op, int8_bytes(padded(u, zero)) if int8 else padded(u, zero) * work, n)
                   for u in chosen)

    def reduced(op: str, chosen) -> float:
        if not zero.quantized_gradients:
            return calls(op, chosen)
        if not 1 < zero.node < n:  # one all-to-all: a reduce-scatter's volume, in int8
            return calls("reduce_scatter", chosen, int8=True)
        nodes = n // zero.node  # inside the node all of it, across the nodes a node member's 1/L
        return sum(links.node.seconds("reduce_scatter", int8_bytes(padded(u, zero)), zero.node)
                   + links.across.seconds("reduce_scatter", int8_bytes(padded(u, zero) // zero.node), nodes)
                   for u in chosen)

    sharded = [u for u in plan if not u.persistent]
    # embedding tables: gathered for each forward, never for backward; heads: for each forward,
    # kept to their backward (zero.stage3). Not modelled: a table used twice per forward (gathered
    # per use) and the head gathered again for zb_h1's weight pass.
    modules = len(params.fetch_modules)
    once = [u for u in sharded if u.module is not None and not params.embeddings <= u.module < modules - params.heads]
    blocks = [u for u in sharded if not u.root and u not in once]
    qw = zero.quantized_weights
    if zero.hpz > 1:  # backward gathers the working-precision copy kept since forward, inside the H ranks
        back = sum(links.hpz.seconds("all_gather", padded(u, zero) * work, zero.hpz) for u in blocks)
    else:
        back = calls("all_gather", blocks, qw)
    return {"gather persistent": calls("all_gather", [u for u in plan if u.persistent]),
            "reduce": reduced("all_reduce" if zero.stage == 0 else "reduce_scatter", plan),
            "reduce_scatter": reduced("reduce_scatter", plan),
            "gather root": calls("all_gather", [u for u in sharded if u.root], qw),
            "gather once": calls("all_gather", once, qw),
            "gather blocks": calls("all_gather", blocks, qw),
            "gather blocks back": back,
            "gather sharded": calls("all_gather", sharded, qw)}

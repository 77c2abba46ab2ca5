"""Enumerate the layouts of a workload on a cluster, keep those that fit, rank them by step time.

Candidates: every tp dividing the devices of a node (the heads must split: ``apply_tensor_parallel`` says),
every pp up to the block count with dp = devices / (tp x pp) dividing the global batch, every
micro-batch dividing the per-replica batch, every ZeRO stage, and under pipeline stages every
schedule the micro-batch count allows (interleaved with 2 and 4 chunks per rank where the
blocks divide); activation checkpointing on and off; sequence parallelism with tp > 1 and one
pipeline stage (what ``initialize`` accepts today); for a model with experts
(``base_model_ep_plan``) every expert-parallel size dividing both the ZeRO shard ranks and the
expert count, at tp > 1 each with the experts whole on every tp rank and split over them
(``expert_tensor_parallel_size`` 1 and tp); context-parallel sizes (``Choice.cp``) dividing the ranks left over tp x pp, each
with Ulysses and ring (``Planner.check`` applies the engine's refusals: the heads for Ulysses,
the sequence dividing by cp or 2 x cp). ``Choice`` pins any of them.

The search prices model states first (no profile needed: ``states.model_state_bytes``) and drops
what cannot fit before it profiles activations, then profiles a layout's own passes only when a
lower bound of its step (``bound.step_floor``) says it could rank, so a large space stays cheap.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

from parallel3d.errors import ConfigError
from parallel3d.pipeline.schedules import SCHEDULES, has_weight_pass
from parallel3d.planner.bound import floor_keys, split_floor, step_floor
from parallel3d.planner.hardware import Hardware
from parallel3d.planner.predict import Layout, Planner, Prediction
from parallel3d.planner.profile import ProfileError
from parallel3d.planner.states import model_state_bytes
from zero.sizing import device_bytes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Choice:
    """Pinned values (None: the planner chooses). ``micro_batch`` None tries powers of two up to
    ``max_micro_batch``."""

    tp: int | None = None
    pp: int | None = None
    zero_stage: int | None = None
    micro_batch: int | None = None
    schedule: str | None = None
    virtual_stages: int | None = None
    checkpointing: bool | None = None
    sequence_parallel: bool | None = None
    max_micro_batch: int = 16
    hybrid_sharding: bool = True
    """Also price ZeRO in one shard group per node (``mics_shard_size``) where dp spans nodes."""
    zeropp: bool = True
    """Also price ZeRO++ (int8 gathers and gradients, hpZ over a node) at stage 3 where its shard
    group spans nodes."""
    ep: int | None = None
    """Expert parallelism's size (``expert_parallel.autoep_size``); None: 1 and, for a model with
    experts, every divisor of the ZeRO shard ranks that divides each MoE layer's expert count."""
    etp: int | None = None
    """``expert_parallel.expert_tensor_parallel_size`` (1 or tp, with ep > 1 and tp > 1); None: both."""
    cp: int | None = 1
    """Context parallelism's size (``context_parallel.size``); None: every size dividing the ranks
    left over tp x pp (the cp ranks come out of the data-parallel ones). 1 (the default): off,
    since cp is worth its exchanges only where a sequence's activations do not fit otherwise."""
    cp_method: str | None = None
    """``context_parallel.method`` ("ulysses" or "ring"); None: both."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _pick(pinned, options):
    return [pinned] if pinned is not None else list(options)


def candidates(planner: Planner, hw: Hardware, choice: Choice = Choice(),
               refused: dict[str, int] | None = None) -> Iterator[Layout]:
    """Every layout of ``choice`` that ``initialize`` would accept for this model and workload;
    why the others are not goes into ``refused`` (reason -> how often it was met)."""
    refused = {} if refused is None else refused

    def refuse(reason: str) -> None:
        refused[reason] = refused.get(reason, 0) + 1

    blocks = len(planner.shapes(1).block_params)
    for tp in _pick(choice.tp, [d for d in _divisors(hw.gpus_per_node) if hw.gpus % d == 0]):
        try:
            shapes = planner.shapes(tp)
        except (ConfigError, ValueError) as exc:
            logger.info("tp %d skipped: %s", tp, exc)
            refuse(f"tp {tp}: {exc}")
            continue
        for pp in _pick(choice.pp, [d for d in _divisors(hw.gpus // tp) if d <= blocks]):
            if hw.gpus % (tp * pp):
                continue
            if pp > 1 and shapes.pipeline_refusal:
                refuse(f"pp > 1: {shapes.pipeline_refusal}")
                continue
            if (hw.gpus // (tp * pp)) % (choice.cp or 1):
                refuse(f"context_parallel.size {choice.cp} does not divide the {hw.gpus // (tp * pp)} ranks left over "
                       f"tp {tp} x pp {pp}")
                continue
            for cp, method in _context_sizes(hw.gpus // (tp * pp), choice):
                yield from _replica_layouts(planner, hw, choice, refuse, tp, pp, cp, method, blocks)


def _context_sizes(ranks: int, choice: Choice) -> list[tuple[int, str]]:
    """(cp, method) pairs: cp 1, and each cp > 1 dividing ``ranks`` with each method."""
    return [(cp, method) for cp in _pick(choice.cp, _divisors(ranks))
            for method in (("ulysses",) if cp == 1 else _pick(choice.cp_method, ("ulysses", "ring")))]


def _replica_layouts(planner: Planner, hw: Hardware, choice: Choice, refuse, tp: int, pp: int, cp: int, method: str,
                     blocks: int) -> Iterator[Layout]:
    """The layouts of one (tp, pp, cp): dp = devices / (tp x pp x cp), and every other axis."""
    w = planner.workload
    dp = hw.gpus // (tp * pp * cp)
    if w.global_batch % dp:
        refuse(f"the global batch {w.global_batch} does not divide among dp {dp} (tp {tp} x pp {pp} x cp {cp})")
        return
    per_replica = w.global_batch // dp
    micro = [b for b in _divisors(per_replica) if b <= choice.max_micro_batch and b & (b - 1) == 0]
    for mb in _pick(choice.micro_batch, micro):
        if per_replica % mb:
            refuse(f"micro-batch {mb} does not divide the {per_replica} samples per replica (dp {dp})")
            continue
        for sched, virtual in _schedules(pp, per_replica // mb, blocks, choice):
            for stage in _pick(choice.zero_stage, (0, 1, 2, 3)):
                for ac in _pick(choice.checkpointing, (False, True)):
                    for sp in _pick(choice.sequence_parallel, (False, True) if tp > 1 else (False,)):
                        shards = _shard_sizes(stage, dp, tp, hw) if choice.hybrid_sharding and cp == 1 else [None]
                        for shard in shards:
                            zeropps = _zeropp(stage, shard or dp, tp, hw) if choice.zeropp and cp == 1 else [0]
                            for zeropp in zeropps:
                                for ep in _ep_sizes(planner, shard or dp, choice) if cp == 1 else [1]:
                                    for etp in _etp_sizes(tp, ep, choice):
                                        layout = Layout(pp, dp, tp, stage, mb, sched, virtual, ac, sp, shard, zeropp,
                                                        ep, cp, method, etp)
                                        try:
                                            planner.check(layout)
                                        except ConfigError as exc:
                                            refuse(str(exc))
                                            continue
                                        yield layout


def _shard_sizes(stage: int, dp: int, tp: int, hw: Hardware) -> list[int | None]:
    """Flat ZeRO (None), and at stages 1-3 where dp spans nodes hybrid sharding with shard groups of
    one node's data-parallel ranks, or 2, 4, ... nodes' (``mics_shard_size``): a group of one node
    gathers and reduces over the node's links; a larger one, for a model whose states need more
    ranks, over fewer nodes than flat ZeRO. Only 1/S of the gradient crosses groups, once per step."""
    per_node = hw.gpus_per_node // tp
    if stage == 0 or per_node < 2 or dp <= per_node or dp % per_node:
        return [None]
    sizes: list[int | None] = [None]
    shard = per_node
    while shard < dp and dp % shard == 0:
        sizes.append(shard)
        shard *= 2
    return sizes


def _ep_sizes(planner: Planner, shard: int, choice: Choice) -> list[int]:
    """Without expert parallelism (1), and for a model with experts every divisor > 1 of the ``shard``
    ranks ZeRO shards over (the ranks expert parallelism is folded over) that divides the experts."""
    if choice.ep is not None:
        return [choice.ep]
    experts = planner.experts
    return [1] + [d for d in _divisors(shard) if d > 1 and experts % d == 0] if experts else [1]


def _etp_sizes(tp: int, ep: int, choice: Choice) -> list[int]:
    """Expert tensor parallelism's sizes: with experts split by ep under tp, whole on every tp rank (1)
    and split over the tp ranks (tp); else 1 (without expert parallelism tp splits them anyway)."""
    if ep == 1 or tp == 1:
        return [1]
    return [choice.etp] if choice.etp is not None else [1, tp]


def _zeropp(stage: int, shard: int, tp: int, hw: Hardware) -> list[int]:
    """Without ZeRO++ (0), and at stage 3 on a shard group that spans nodes with it: the group's
    ranks per node (hpZ's group and qgZ's first hop; 1 where tp fills a node: int8 alone)."""
    per_node = hw.gpus_per_node // tp
    if stage != 3 or per_node < 1 or shard <= per_node or shard % per_node:
        return [0]
    return [0, per_node]


def _schedules(pp: int, microbatches: int, blocks: int, choice: Choice) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    out = []
    for name in _pick(choice.schedule, SCHEDULES):
        if name == "interleaved_1f1b":
            for v in _pick(choice.virtual_stages, (2, 4)):
                if v > 1 and blocks % (pp * v) == 0 and microbatches % pp == 0:
                    out.append((name, v))
        elif (name == "gpipe" or microbatches >= pp) and choice.virtual_stages in (None, 1):
            out.append((name, 1))
    return out


def model_states_fit(planner: Planner, layout: Layout, hw: Hardware) -> bool:
    """Whether every rank's model states alone fit (a cheap first cut)."""
    shapes = planner.layout_shapes(layout)
    zero = planner.zero(layout)
    if layout.pp == 1:
        return device_bytes(model_state_bytes(shapes.rank_params(stage3=layout.zero_stage == 3), zero)) <= hw.memory
    stage_layout = shapes.stage_layout(layout.pp, layout.virtual_stages, balance=planner.workload.balance)
    for rank in range(layout.pp):
        params = shapes.rank_params(pp=layout.pp, pp_rank=rank, layout=stage_layout, stage3=layout.zero_stage == 3)
        if device_bytes(model_state_bytes(params, zero, pipelined=True)) > hw.memory:
            return False
    return True


@dataclass
class SearchResult:
    """The fastest layouts that fit (fastest first), how many layouts were considered, why others
    were not considered (reason -> how often it was met), and why considered ones could not be
    priced (their profile failed in the model's code: reason -> layouts)."""

    best: list[Prediction]
    considered: int
    refused: dict[str, int]
    unpriced: dict[str, int] = field(default_factory=dict)

    def why_none(self) -> str:
        """What ruled layouts out, most frequent first, for a message when nothing fits."""
        parts = []
        if self.unpriced:
            parts.append(f"{sum(self.unpriced.values())} could not be priced: " + _most_frequent(self.unpriced))
        if self.refused:
            parts.append("not considered: " + _most_frequent(self.refused))
        return "; ".join(parts)


def _most_frequent(reasons: dict[str, int]) -> str:
    return "; ".join(reason for reason, _ in sorted(reasons.items(), key=lambda kv: -kv[1])[:5])


def search(planner: Planner, hw: Hardware, choice: Choice = Choice(), top: int = 10) -> SearchResult:
    """The ``top`` fastest layouts that fit and what was considered (:class:`SearchResult`).

    Two passes: the candidates whose model states fit are priced quickly (a few ranks of a long
    pipeline, the schedule's closed-form makespan), each profiled only if a lower bound of its
    step says it could be among the best (:func:`_fastest_that_fit`); the best ``3 x top`` of those
    that fit are then priced exactly (every rank, the simulated table) and ranked again. A layout whose
    profile fails in the model's code (:class:`ProfileError`) is left out with the reason.
    """
    refused: dict[str, int] = {}
    unpriced: dict[str, int] = {}

    def priced(layout: Layout, exact: bool) -> Prediction | None:
        try:
            return planner.predict(layout, hw, exact=exact)
        except ProfileError as exc:
            unpriced[str(exc)] = unpriced.get(str(exc), 0) + 1
            return None

    considered, fitting, started, last = 0, [], set(), set()
    try:
        if choice.pp in (None, 1) and choice.cp in (None, 1):  # the bound's passes without a pipeline, read in
            # nearly every search: started before the model's shapes at each tp are read
            planner.prefetch(planner.chunk_keys(Layout(1, hw.gpus, 1, 0, 1), "only", hw), wait=False)
        for layout in candidates(planner, hw, choice, refused):
            considered += 1
            if model_states_fit(planner, layout, hw):
                fitting.append(layout)
                _profile_early(planner, hw, layout, started, last)
        planner.prefetch(last, wait=False)
        rough = _fastest_that_fit(planner, hw, fitting, 3 * top, unpriced)
        exact = [p for p in (priced(r.layout, exact=True) for r in rough) if p is not None and p.fits(hw.memory)]
    finally:
        planner.close()
    exact.sort(key=lambda p: (p.step_seconds, p.peak))
    return SearchResult(exact[:top], considered, refused, unpriced)


def _profile_early(planner: Planner, hw: Hardware, layout: Layout, started: set[tuple], last: set[tuple]) -> None:
    """Start, on the planner's workers and while the candidates are still being listed, the profiles
    the first pass will most likely read for ``layout``: the bound's and, without recomputation, its
    chunks' with one backward (what the bound or the step reads first; recomputation ranks only where
    memory is short). Once per set of settings the profiles depend on (``started``). A ZB-H1
    layout's split passes at tp 1 (the bound's own settings, the likeliest of the split ones to
    rank) go into ``last``, to start after all the others: they keep the workers busy while the walk
    comes to them. A profile read later goes ahead of these; one made for nothing costs CPU, not the
    result."""
    split = has_weight_pass(layout.schedule)
    settings = (layout.pp, layout.virtual_stages, layout.tp, layout.sequence_parallel, layout.checkpointing,
                layout.ep, layout.etp, layout.cp, layout.cp_method, split)
    if settings in started:
        return
    started.add(settings)
    keys = floor_keys(planner, layout, hw)
    if not layout.checkpointing:
        keys |= planner.profile_keys(layout, hw, exact=False, split=False)
        if split and layout.tp == 1 and layout.cp == 1:
            last |= planner.profile_keys(layout, hw, exact=False)
    planner.prefetch(keys, wait=False)


def _fastest_that_fit(planner: Planner, hw: Hardware, layouts: list[Layout], count: int,
                      unpriced: dict[str, int]) -> list[Prediction]:
    """The first pass: the ``count`` layouts that fit with the shortest step (ties: the smaller
    peak), each priced with ``exact=False``: the sort of every layout's prediction by (step, peak),
    cut to ``count``, computed without pricing most of them.

    A layout's step is priced in the order of its lower bound (`bound.step_floor`, from the
    cheapest profiles), and profiled only then; a ZB-H1 layout that comes up is first bounded again
    from its passes with one backward (`bound.split_floor`, shared with its twins of other
    schedules) and put back in that order. The memory walk (the pipeline's whole schedule
    table, built and walked per rank, most of a prediction's cost) only for the fastest, in order of
    their step, until ``count`` fit and the next one is strictly slower than the last of them. A
    priced layout is walked once no unpriced one can come before it (its bound is higher than the
    step; ties go in candidate order, as a stable sort of every step gives), so the layouts walked
    and their order are those of pricing every layout, and a layout never priced is slower than
    all of those kept. Hybrid sharding and ZeRO++ are worth a row only where faster than their flat
    twin (hybrid sharding holds more per rank than flat ZeRO over the same ranks, ZeRO++ more than
    ZeRO and it rounds weights and gradients).
    """
    index = {layout: i for i, layout in enumerate(layouts)}
    base = {key for layout in layouts for key in floor_keys(planner, layout, hw)}
    planner.prefetch(base, wait=False)
    needs = [planner.profile_keys(layout, hw, exact=False) for layout in layouts]  # each layout's profiles
    # ZB-H1 layouts not yet bounded by split_floor: the one-backward profiles that bound reads
    unsplit = {i: planner.profile_keys(layout, hw, exact=False, split=False) for i, layout in enumerate(layouts)
               if has_weight_pass(layout.schedule)}

    def wants(i: int) -> set[tuple]:
        """The profiles the next look at layout ``i`` reads."""
        return unsplit.get(i, needs[i])

    pending = [(step_floor(planner, layout, hw), i) for i, layout in enumerate(layouts)]  # (bound, index), a heap
    heapq.heapify(pending)
    steps: dict[int, float | None] = {}

    def step(i: int) -> float | None:
        if i not in steps:
            try:
                steps[i] = sum(planner.step_time(layouts[i], hw, exact=False)[0].values())
            except ProfileError as exc:
                unpriced[str(exc)] = unpriced.get(str(exc), 0) + 1
                steps[i] = None
        return steps[i]

    def faster_than_twin(i: int, own: float) -> bool:
        layout = layouts[i]
        twins = ([replace(layout, shard=None, zeropp=0)] if layout.shard is not None else []) \
            + ([replace(layout, zeropp=0)] if layout.zeropp else [])
        for twin in twins:
            other = step(index[twin]) if twin in index else None
            if other is not None and own >= other:
                return False
        return True

    for i in range(len(layouts)):  # priced now where no profile is missing: a first guess of where the walk will stop
        if not planner.unknown(needs[i]):
            step(i)
    priced: list[tuple[float, int]] = []  # (step, candidate index), a heap
    fit: list[Prediction] = []
    while True:
        bound = pending[0][0] if pending else math.inf
        slowest = fit[count - 1].step_seconds if len(fit) >= count else math.inf
        if min(priced[0][0] if priced else math.inf, bound) > slowest or (not priced and bound == math.inf):
            break
        if priced and priced[0][0] < bound:
            _, i = heapq.heappop(priced)
            prediction = planner.predict(layouts[i], hw, exact=False)
            if prediction.fits(hw.memory):
                fit.append(prediction)
            continue
        floor, i = heapq.heappop(pending)
        if planner.unknown(wants(i)):
            _profile_ahead(planner, wants, (floor, i), pending, [v for v in steps.values() if v is not None], count)
        if unsplit.pop(i, None) is not None:
            try:
                floor = max(floor, split_floor(planner, layouts[i], hw))
            except ProfileError:  # pricing it with its own profiles says why
                pass
            heapq.heappush(pending, (floor, i))
            continue
        if (own := step(i)) is not None and faster_than_twin(i, own):
            heapq.heappush(priced, (own, i))
    fit.sort(key=lambda p: (p.step_seconds, p.peak))
    return fit[:count]


def _profile_ahead(planner: Planner, wants: Callable[[int], set[tuple]], first: tuple[float, int],
                   pending: list[tuple[float, int]], priced: list[float], count: int) -> None:
    """Before looking at layout ``first`` = (bound, index), whose profiles (``wants(index)``) are missing:
    start on the planner's workers those of the ``pending`` (bound, index) likely to be looked at
    too, and wait for its own (which go first). Sure to be are those whose bound is under the
    ``count``-th smallest of the steps priced so far and the pending bounds (the ``count``-th step
    kept, where the walk stops, cannot be under it); likely, those under the ``count``-th step
    priced so far. A profile made for nothing costs time, not the result; the walk goes on while
    the workers make the others."""
    own = planner.unknown(wants(first[1]))
    if not planner.started(own):  # else the batch it belongs to was asked for already
        sure = heapq.nsmallest(count, priced + [first[0]] + [floor for floor, _ in heapq.nsmallest(count, pending)])[-1]
        likely = heapq.nsmallest(count, priced)[-1] if len(priced) >= count else sure
        limit = max(sure, likely)
        planner.prefetch(planner.unknown(set().union(*(wants(i) for floor, i in pending if floor < limit))),
                         wait=False)
    planner.prefetch(own)

"""Peak memory per pipeline rank: model states, then the schedule's activations and buffers over time.

For one rank the planner adds, at every pass of its schedule table (``schedule_table``, with
its sends and receives), what is alive then:

* **model states**: ``states.model_state_bytes`` (exactly ``memory_report()``; what ZeRO-Offload
  keeps in host memory is reported apart and not part of the device peak), the gradient
  buffers only from the step's first backward pass on: ``GradientReducer`` drops them after
  the step and makes a unit's full buffer (stages 0-1) at its first gradient, taken here whole
  from the start of that pass, or its reduced shard (stages 2-3) at its first reduction, taken
  here from the end of the first pass that produces weight gradients;
* **gathered stage-3 parameters**: the root units (for the micro-batch; under pipeline stages
  for the step) plus the fetch module being run (a block, or an embedding table in its
  forward) and the blocks prefetched after it
  (``stage3_prefetch_bucket_size``), as ``zero.stage3.ParamFetcher`` does (:func:`gathered`;
  ``pipeline.keep_full_gradients``, which holds the whole stage, is not modelled);
* **activations**: per in-flight (micro-batch, chunk) the bytes its forward leaves for backward,
  and during a pass that pass's own peak (``profile.PassProfile``, measured on fake tensors);
* **buffers**: posted receives (one ``[micro_batch, seq, hidden]`` activation or gradient each,
  from the receive to the pass that consumes it), input gradients waiting for their send,
  gradient staging of stages 2-3 (a full unit per unit in flight: ``GradientReducer`` keeps at
  most ``MAX_IN_FLIGHT`` launched plus the one filling; without ``overlap_comm`` it waits for
  each reduction in the hook that launches it, so only the one filling), counted from the first parameter
  gradient of the backward on, when the first staging buffer is allocated;
* **the optimizer step**: fp32 copies of the gradient shards (bf16/fp16) and the step's
  temporaries (``torch.optim`` foreach: one master-sized tensor; per tensor on CPU: two of the largest);
  none on the device when the optimizer is offloaded (it steps in host memory).

The peak is the maximum over those moments and the step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from parallel3d.pipeline.actions import Action, Kind
from parallel3d.pipeline.schedules import schedule_table
from parallel3d.planner.inventory import RankParams
from parallel3d.planner.profile import PassProfile
from parallel3d.planner.states import ZeroSetup, full_gradients, model_state_bytes, padded, shard_sets, units
from parallel3d.planner.walk import best_pass
from zero.grads import GradientReducer
from zero.sizing import HOST_CATEGORIES, device_bytes, shard_pieces

ChunkProfile = Callable[[int], PassProfile]  # chunk index on this rank -> its profile


@dataclass(frozen=True)
class RankMemory:
    """A rank's predicted peak and what it is made of at that moment (bytes)."""

    peak: int
    states: dict[str, int]
    gathered: int
    activations: int
    buffers: int
    step_extra: int
    where: str  # the moment of the peak: "F3.1" (forward of micro-batch 3, chunk 1), "B0", "step"

    @property
    def model_states(self) -> int:
        """Model-state bytes on the device (offloaded ones are in ``host_states``)."""
        return device_bytes(self.states)

    @property
    def host_states(self) -> int:
        """Model-state bytes ZeRO-Offload keeps in host memory."""
        return sum(self.states.get(key, 0) for key in HOST_CATEGORIES)


@lru_cache(maxsize=8192)
def gathered(params: RankParams, zero: ZeroSetup, *, prefetch: int, max_live: int) -> tuple[int, int]:
    """Bytes of stage-3 parameters gathered: (for the whole micro-batch or step, extra inside a block).

    The root units are gathered for each micro-batch's forward and backward (under pipeline
    stages for the step), and inside a fetch module (an embedding table, which comes first, or
    a block) that module and the ones prefetched after it (the worst such window).
    """
    if zero.stage != 3 or zero.world == 1:
        return 0, 0
    root, blocks = 0, {}
    for part in shard_sets(params, zero):  # under expert parallelism a block's dense and expert units
        for u in units(part.params, part.zero):
            if u.persistent:
                continue
            if u.root:
                root += padded(u, part.zero)
            if u.module is not None:
                blocks[u.module] = blocks.get(u.module, 0) + padded(u, part.zero)
    order = [blocks[m] for m in sorted(blocks)]
    worst = 0
    for i, size in enumerate(order):  # the block in use, then prefetch (ParamFetcher._prefetch_after)
        live, budget, j = size, prefetch, i + 1
        while j < len(order) and budget > 0 and live + order[j] <= max_live:
            live, budget, j = live + order[j], budget - order[j], j + 1
        worst = max(worst, live)
    # hpZ: each block's 1/H copy, kept from its forward to its backward (under pipeline stages to the
    # step's end): all of a rank's blocks at once when its last forward ends
    secondary = sum(blocks.values()) // zero.hpz if zero.hpz > 1 else 0
    return zero.work_bytes * (root + secondary), zero.work_bytes * worst


@lru_cache(maxsize=8192)
def staging(params: RankParams, zero: ZeroSetup, *, pipelined: bool, overlap: bool) -> int:
    """Gradient staging buffers alive during a backward (stages 2-3 reducing as they go)."""
    if full_gradients(zero.stage, pipelined, dp=zero.dp):
        return 0
    sizes = sorted((padded(u, part.zero) for part in shard_sets(params, zero) for u in units(part.params, part.zero)),
                   reverse=True)
    # without overlap the launch waits for the reduction (GradientReducer._drain(keep=0)) before the
    # next unit's first gradient makes its buffer: one unit at a time (7B at pp 4, zero3d simulate)
    held = GradientReducer.MAX_IN_FLIGHT + 1 if overlap else 1
    return zero.work_bytes * sum(sizes[:held])


@lru_cache(maxsize=8192)
def step_extra(params: RankParams, zero: ZeroSetup, *, foreach: bool) -> int:
    """Bytes the optimizer step adds: fp32 gradient copies (mixed precision) and Adam's temporaries
    (on the host, not the device, when the optimizer is offloaded)."""
    if zero.offload_optimizer:
        return 0
    shards = [(u, padded(u, part.zero) // part.zero.world) for part in shard_sets(params, zero)
              for u in units(part.params, part.zero)]
    fp32_grads = 0 if zero.work_bytes == 4 else 4 * sum(shard for _, shard in shards)
    pieces = [n for u, shard in shards for n in shard_pieces([p.numel for p in u.params], 0, shard)]  # dp rank 0
    # Adam's denominator: one tensor for every piece at once (foreach), else sqrt and quotient of the largest
    temps = 4 * (sum(pieces) if foreach else 2 * max(pieces, default=0)) if zero.optimizer.elementwise else 0
    return fp32_grads + temps


def rank_peak(states: dict[str, int], gathered_bytes: tuple[int, int], staging_bytes: int, step_bytes: int,
              table: list, chunk: ChunkProfile, hidden_bytes: int, *, pipelined: bool,
              full_grads: bool = True) -> RankMemory:
    """Walk one rank's actions (``table``: its list from ``schedule_table``; a single ``F0``/``B0`` pair
    per micro-batch without pipeline stages) and take the largest total. ``full_grads``: the
    gradients are full buffers (made at a unit's first gradient), else reduced shards."""
    static = device_bytes(states)
    held, in_block = gathered_bytes
    best = RankMemory(static + step_bytes + (held if pipelined else 0), states, held if pipelined else 0, 0, 0,
                      step_bytes, "step")
    no_grads = states.get("gradients", 0)  # until the first backward pass of the step
    if len(table) >= FAST_WALK_MIN:  # the same walk as array arithmetic (parallel3d/planner/walk.py)
        found = best_pass(table, chunk, hidden_bytes, staging_bytes, full_grads=full_grads, base=static,
                          no_grads=no_grads, held=held, in_block=in_block)
        if found is not None and found[0] > best.peak:
            best = RankMemory(found[0], states, found[1], found[2], found[3], 0, found[4])
        return best
    live, pending, waiting_send = 0, 0, 0
    split = has_weight_passes(table)  # zb_h1: activations live until the weight pass

    def consider(extra_act: int, buffers: int, block: bool, where: str) -> None:
        nonlocal best
        gathered_now = held + (in_block if block else 0)
        total = static - no_grads + gathered_now + extra_act + buffers
        if total > best.peak:
            best = RankMemory(total, states, gathered_now, extra_act, buffers, 0, where)

    for a in table:
        if a.kind in (Kind.RECV_F, Kind.RECV_B):
            pending += hidden_bytes
        elif a.kind == Kind.SEND_B:
            waiting_send -= hidden_bytes
        elif a.kind == Kind.F:
            profile = chunk(a.chunk)
            if profile.kind in ("middle", "last"):
                pending -= hidden_bytes  # the received buffer is the pass's input from here on
            consider(live + profile.forward_peak, pending + waiting_send, profile.forward_peak_in_block,
                     f"F{a.microbatch}.{a.chunk}")
            live += profile.at_rest
        elif a.kind == Kind.B:
            if full_grads and not split:
                no_grads = 0
            profile = chunk(a.chunk)
            if profile.kind in ("first", "middle"):
                pending -= hidden_bytes  # the received gradient
            if split:  # ZB-H1's input-gradient pass keeps what the weight pass needs
                consider(live - profile.at_rest + profile.input_grad_peak, pending + waiting_send,
                         profile.backward_peak_in_block, f"B{a.microbatch}.{a.chunk}")
                live += profile.held_for_weights - profile.at_rest
            else:
                during = max(profile.backward_peak, profile.after_first_grad + staging_bytes)
                consider(live - profile.at_rest + during, pending + waiting_send, profile.backward_peak_in_block,
                         f"B{a.microbatch}.{a.chunk}")
                live -= profile.at_rest
                no_grads = 0
            if profile.kind in ("middle", "last"):
                waiting_send += hidden_bytes
        elif a.kind == Kind.W:
            if full_grads:
                no_grads = 0
            profile = chunk(a.chunk)
            during = max(profile.weight_grad_peak, profile.after_first_grad + staging_bytes)
            consider(live - profile.held_for_weights + during, pending + waiting_send,
                     profile.backward_peak_in_block, f"W{a.microbatch}.{a.chunk}")
            live -= profile.held_for_weights
            no_grads = 0
    return best


FAST_WALK_MIN = 24
"""Tables of at least this many actions are walked by `walk.best_pass` (numpy), shorter ones here."""

EXACT_P2P_PASSES = 4096
"""Tables with more passes than this are walked without their sends and receives (placing them
simulates the whole table); the walk then leaves out posted receive buffers and input gradients
waiting for their send, one or two ``[micro_batch, seq, hidden]`` tensors at a time."""


class RankTable(list):
    """A rank's actions, knowing whether it has weight passes (ZB-H1) without a scan per walk."""

    def __init__(self, actions) -> None:
        super().__init__(actions)
        self.has_weight_passes = any(x.kind == Kind.W for x in self)


def has_weight_passes(table: list) -> bool:
    known = getattr(table, "has_weight_passes", None)
    return known if known is not None else any(x.kind == Kind.W for x in table)


def pipeline_table(schedule: str, pp: int, microbatches: int, virtual: int, rank: int) -> list:
    """The rank's actions: the schedule's table under pipeline stages, else F/B per micro-batch.

    Without pipeline stages the walk of `rank_peak` is the same for every micro-batch after the
    first (nothing is alive between them, and the gradients exist from the first backward on),
    and a later equal total never replaces an earlier one, so two micro-batches give its result.
    """
    if pp == 1:
        return _single(min(microbatches, 2))
    return _table(schedule, pp, microbatches, virtual)[rank]


@lru_cache(maxsize=4)
def _single(microbatches: int) -> RankTable:
    return RankTable(a for i in range(microbatches) for a in (Action(Kind.F, i), Action(Kind.B, i)))


@lru_cache(maxsize=512)
def _table(schedule: str, pp: int, microbatches: int, virtual: int) -> list[RankTable]:
    exact = 2 * pp * microbatches * virtual <= EXACT_P2P_PASSES
    return [RankTable(t) for t in schedule_table(schedule, pp, microbatches, virtual, communication=exact)]


def predict_rank(params: RankParams, zero: ZeroSetup, *, table: list, chunk: ChunkProfile, hidden_bytes: int,
                 pipelined: bool, prefetch: int, max_live: int, overlap: bool, foreach: bool) -> RankMemory:
    """The rank's peak: model states plus the walk of its schedule, and the optimizer step."""
    states = model_state_bytes(params, zero, pipelined=pipelined)
    return rank_peak(states, gathered(params, zero, prefetch=prefetch, max_live=max_live),
                     staging(params, zero, pipelined=pipelined, overlap=overlap),
                     step_extra(params, zero, foreach=foreach), table, chunk, hidden_bytes, pipelined=pipelined,
                     full_grads=full_gradients(zero.stage, pipelined, dp=zero.dp))

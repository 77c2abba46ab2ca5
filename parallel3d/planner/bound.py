"""A lower bound on a layout's first-pass step time, from the cheapest profiles only.

The search profiles a layout's own chunks only when this bound says it could rank
(`search._fastest_that_fit`): a first run of a large model then profiles the settings (tp,
sequence parallelism, recomputation, split backward) that compete, not all of them. The bound
must never exceed `Planner.step_time(layout, hw, exact=False)`, or the search could miss a layout
that ranks; each step below says why it holds.

* **A pass is at least its FLOPs at the matrix rate.** An op's roofline time is at least its FLOPs
  over `Hardware.flop_rate`, and `Chunk.seconds` keeps that floor for the extrapolated chunk too.
* **The FLOPs of a chunk are at least those of the same chunk at tp 1, without sequence
  parallelism, recomputation or the split backward (the base profile), over tp.** The FLOPs the
  profile counts are matrix products and attention (torch's ``flop_registry``); tensor parallelism
  splits each evenly over the tp ranks (columns, rows, heads, the vocabulary) or leaves it whole on
  every one (a router, key-value heads fewer than tp, experts under expert parallelism). Sequence
  parallelism and ZB-H1's split backward run the same products, in other places and order.
* **Recomputation adds the blocks' forward to the backward**, where every block is a layer that
  transformers' gradient checkpointing recomputes (``GradientCheckpointingLayer``, what the
  profile enables): each runs its forward again before its backward (ZB-H1: more than once).
* **The step formula grows with each rank's pass times** (`timing.step_parts`): the pipeline's
  closed-form makespan by at least ``m`` per second of a rank's pass, more than the
  data-parallel collectives' exposure shrinks (at most ``m`` per second); with the collectives
  priced as if compute hid all it can (``hidden_compute``), the parts are each at most the step's.
  Expert-parallel all-to-alls, the tied embedding and the optimizer need no profile: they are the
  step's own.
* **A split backward costs at least the one backward** (`split_floor`, a second, tighter bound
  for a ZB-H1 layout, from the profiles of the same chunks with one backward). The executor's
  input pass and weight passes run every autograd node the one backward runs, each for part of
  its gradients: the same kernels, or a node's kernel twice where its gradients fall in both
  passes (a LayerNorm's input gradient in the first, its weight's in the second), each call
  reading the node's saved tensors again. The forward and the tp collectives are the same. So
  the search profiles a ZB-H1 layout's own passes (whose memory differs) only when even this
  bound could rank.
* **Context parallelism gets no bound (0)**: ring attention's causal work per rank is not a fixed
  share of the whole, so those layouts are always profiled.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from models.anatomy import fetch_unit_modules
from parallel3d.planner.hardware import Hardware
from parallel3d.planner.profile import ProfileError
from parallel3d.planner.timing import RankCost

if TYPE_CHECKING:
    from parallel3d.planner.predict import Layout, Planner


def base_layout(layout: Layout) -> Layout:
    """The layout whose profiles bound ``layout``'s: tp 1, no sequence parallelism, recomputation,
    split backward, expert or context parallelism (same pipeline, micro-batch and ZeRO)."""
    return replace(layout, tp=1, sequence_parallel=False, checkpointing=False, schedule="1f1b", ep=1, etp=1,
                   cp=1, cp_method="ulysses")


def floor_keys(planner: Planner, layout: Layout, hw: Hardware) -> set[tuple]:
    """The profiles :func:`step_floor` reads for ``layout`` (none under context parallelism)."""
    if layout.cp > 1:
        return set()
    base = base_layout(layout)
    return {key for rank in planner.ranks_to_price(layout, False) for kind, _ in planner.chunk_kinds(layout, rank)
            for key in planner.chunk_keys(base, kind, hw)}


def step_floor(planner: Planner, layout: Layout, hw: Hardware) -> float:
    """A lower bound on ``planner.step_time(layout, hw, exact=False)``'s seconds (see the module
    docstring); 0 under context parallelism or where a base profile fails."""
    if layout.cp > 1:
        return 0.0
    planner.check(layout)
    base = base_layout(layout)
    try:
        costs = [_rank_floor(planner, layout, base, rank, hw) for rank in planner.ranks_to_price(layout, False)]
    except ProfileError:
        return 0.0
    return sum(planner.parts(layout, costs, hw, exact=False, hidden_compute=True).values())


def _rank_floor(planner: Planner, layout: Layout, base: Layout, rank: int, hw: Hardware) -> RankCost:
    forward = backward = 0.0
    for kind, blocks in planner.chunk_kinds(layout, rank):
        chunk = planner.chunk(base, kind, blocks, hw)
        forward += chunk.pass_flops(False)
        backward += chunk.pass_flops(True)
        if layout.checkpointing and planner.recomputes_every_block:
            backward += chunk.blocks_forward_flops
    params = planner.rank_params(layout, rank)
    moe = planner.moe_seconds(layout, params, hw)
    rate = hw.flop_rate * layout.tp
    return RankCost(forward / rate + moe, backward / rate + moe, params)


def recomputes_every_block(model) -> bool:
    """Whether transformers' gradient checkpointing recomputes each of the model's blocks (each is a
    ``GradientCheckpointingLayer``); without blocks, no."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    blocks = fetch_unit_modules(model)
    return bool(blocks) and all(isinstance(b, GradientCheckpointingLayer) for b in blocks)


def split_floor(planner: Planner, layout: Layout, hw: Hardware) -> float:
    """A lower bound on the first-pass step of ``layout``, whose schedule splits the backward (ZB-H1),
    from the profiles of its chunks with one backward (see the module docstring); at least as high
    as :func:`step_floor` where those profiles are the base's."""
    costs, _ = planner.rank_costs(layout, hw, exact=False, split=False)
    return sum(planner.parts(layout, costs, hw, exact=False, hidden_compute=True).values())

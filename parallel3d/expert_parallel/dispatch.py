"""Tokens to their experts' ranks and back: the all-to-all of expert parallelism, dropless.

A rank of an expert-parallel group of ``E`` ranks holds experts ``[r L, (r + 1) L)`` of a layer
(``L = num_experts / E``). Each of its tokens chose ``K`` experts; every (token, choice) pair
is one row sent to the rank holding that expert, rows sorted by expert (a stable sort, so a
rank's rows for one expert keep token order). No capacity is set and no row is dropped, so the
experts see exactly the rows one process would give them, and the result equals one process.

The counts go first (one small all-to-all of ``[E, L]`` per-expert counts), then the rows. The
receiving rank runs its local experts on what it got, sorted by local expert (the rows arrive
grouped by source rank, each source's rows sorted by expert), and sends each row's output back
along the same route; the source weighs it by its routing weight and sums a token's ``K``
outputs. Routing weights never travel: their gradient stays on the rank that computed them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with split sizes, whose backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = rows.new_empty((sum(recv), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.recv,
                               group=ctx.group)
        return out, None, None, None


def all_to_all(rows: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Send ``send[j]`` leading rows of ``rows`` (in order) to rank ``j`` of ``group``, receive ``recv[j]`` from
    it; differentiable."""
    return _AllToAll.apply(rows, send, recv, group)


@dataclass(frozen=True)
class Route:
    """Where one rank's (token, choice) rows go and what it receives, for one MoE layer call."""

    order: torch.Tensor
    """The pairs (flattened ``[tokens x K]``) sorted by global expert: the order rows are sent in."""
    send: list[int]
    """Rows to each rank of the group."""
    recv: list[int]
    """Rows from each rank of the group."""
    local_ids: torch.Tensor
    """The local expert of each received row."""
    by_expert: torch.Tensor
    """Received rows in local-expert order (a stable sort of ``local_ids``)."""


def plan_route(top_k_index: torch.Tensor, num_experts: int, group: dist.ProcessGroup) -> Route:
    """Exchange per-expert counts and plan the rows' route (one all-to-all of ``num_experts`` integers)."""
    world = dist.get_world_size(group)
    local = num_experts // world
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).to(torch.int64)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)  # [source rank, local expert]
    send = counts.view(world, local).sum(1).tolist()
    recv_by_expert = received.view(world, local)
    recv = recv_by_expert.sum(1).tolist()
    ids = torch.arange(local, device=flat.device).repeat(world)
    local_ids = torch.repeat_interleave(ids, received.to(flat.device))
    return Route(order, send, recv, local_ids, torch.argsort(local_ids, stable=True))


def dispatch_combine(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int,
                     group: dist.ProcessGroup, run_local: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                     ) -> torch.Tensor:
    """The MoE experts' output for this rank's tokens ``hidden`` [T, H] routed to ``top_k_index`` [T, K] with
    ``top_k_weights`` [T, K]: each row goes to its expert's rank, ``run_local(rows, local_ids)`` (rows sorted by
    local expert) computes the unweighted expert outputs there, and they come back to be weighted and summed."""
    tokens, k = top_k_index.shape
    route = plan_route(top_k_index, num_experts, group)
    rows = all_to_all(hidden[route.order // k], route.send, route.recv, group)
    by_expert = route.by_expert
    computed = run_local(rows[by_expert], route.local_ids[by_expert])
    outputs = torch.empty_like(computed).index_copy(0, by_expert, computed)  # back to arrival order
    returned = all_to_all(outputs, route.recv, route.send, group)
    pairs = torch.empty_like(returned).index_copy(0, route.order, returned)  # back to (token, choice) order
    weighted = pairs.view(tokens, k, -1) * top_k_weights.unsqueeze(-1)
    return weighted.sum(1).to(hidden.dtype)

"""An HF experts module cut to this rank's experts, its forward routed through the all-to-all.

The module stays HF's own (same class, same parameter names, so optimizer groups, checkpoints and
exports keep their names): its stacked weights are sliced to experts ``[r L, (r + 1) L)``, its
``num_experts`` set to ``L``, and its forward replaced by one that routes every (token, choice)
row to its expert's rank (:func:`~parallel3d.expert_parallel.dispatch.dispatch_combine`). There
the module's own forward computes the received rows, given local expert ids and routing weights of
one: HF's per-expert loop (or whatever ``config._experts_implementation`` picks) on the CPU, and
``torch._grouped_mm`` through HF's ``grouped_mm`` implementation on CUDA, where the module uses
``use_experts_implementation``. The routing weights are applied where the tokens live.

A rank that receives no rows still makes a (zero) gradient for its experts, as one process does
for an expert no token chose (the stacked weight is used, so every expert's slice gets one):
otherwise the optimizer would skip the weight on that rank only. Its (empty) received rows stay in
the graph too: HF's forwards do not read rows no expert got, and without them that rank would
skip the all-to-all of the backward that the others run.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parallel3d.errors import ConfigError
from parallel3d.expert_parallel.dispatch import dispatch_combine
from parallel3d.build.storageless import clone


def _grouped_mm_forward(module: nn.Module):
    """HF's grouped-GEMM experts forward when the module takes implementations and runs on CUDA."""
    if not hasattr(module, "has_gate"):
        return None
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    return types.MethodType(ALL_EXPERTS_FUNCTIONS["grouped_mm"], module)


def _check_inputs(owner: str, hidden: Any, index: Any, weights: Any) -> None:
    ok = (isinstance(hidden, torch.Tensor) and hidden.dim() == 2 and isinstance(index, torch.Tensor)
          and index.dim() == 2 and not index.is_floating_point() and index.shape[0] == hidden.shape[0]
          and isinstance(weights, torch.Tensor) and weights.shape == index.shape)
    if not ok:
        shapes = [list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in (hidden, index, weights)]
        raise ConfigError(f"expert_parallel: {owner} was called with inputs of shapes {shapes}; expert parallelism "
                          "routes experts modules called as (hidden_states [tokens, hidden], top_k_index [tokens, k], "
                          "top_k_weights [tokens, k]), HF's convention for stacked experts")


def split_experts(module: nn.Module, num_experts: int, group: dist.ProcessGroup) -> list[nn.Parameter]:
    """Keep this rank's experts of ``module`` and route its forward over ``group``; the new parameters."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    local = num_experts // world
    kept = []
    for name, param in list(module.named_parameters(recurse=False)):
        # a meta start's storage-less weight stays storage-less: ZeRO fills this slice from the source
        piece = nn.Parameter(clone(param.data[rank * local : (rank + 1) * local]), requires_grad=param.requires_grad)
        setattr(module, name, piece)
        kept.append(piece)
    module.num_experts = local
    local_forward = module.forward
    grouped = _grouped_mm_forward(module)
    owner = type(module).__name__

    def run_local(rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        compute = grouped if grouped is not None and rows.is_cuda else local_forward
        ones = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
        out = compute(rows, local_ids.unsqueeze(1), ones)
        if rows.shape[0] == 0:  # keep the rows (the all-to-all's backward) and every weight in the graph
            # the module's current parameters: expert tensor parallelism replaces them by their tp slices
            out = out + (rows.sum() + sum(p.sum() for p in module.parameters(recurse=False))) * 0
        return out

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        _check_inputs(owner, hidden_states, top_k_index, top_k_weights)
        return dispatch_combine(hidden_states, top_k_index, top_k_weights, num_experts, group, run_local)

    module.forward = forward
    module.expert_parallel = (rank, world, num_experts)
    return kept

"""Mixture-of-experts weights under tensor parallelism: each rank a slice of every expert.

HF's MoE families keep all experts of a layer in one module with stacked weights
(``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]; transposed layouts,
``is_transposed``, swap the last two dims) and plan it as ``moe_tp_experts``: the gate|up (or
up) weight and its bias are split along their output features (a concatenated gate|up as two
packed blocks, so every rank keeps matching gate and up rows), the down weight along its input
features. The plan's style names for them follow the tensor's dims (Aria's transposed
``gate_up_proj`` is ``packed_rowwise``), so the split is taken from the weight's role. Each rank then runs every routed token
through its slice of the chosen experts, and the experts' outputs are partial sums, as a row
layer's are. The router stays replicated.

The collectives sit at the experts module, as HF's ``MoeExpertsParallel`` puts them: on entry
the hidden states *and the routing weights* pass through ``copy_to_tp`` (identity forward,
all-reduce backward), because each rank's gradient of both comes from its slice of the experts
only; on exit the output is all-reduced. The routing weights scale the partial outputs before
the sum, so their gradient is the sum of the ranks' shares: without the entry all-reduce the
router would train on one rank's share.

Refused, naming the parameter or the attribute: expert weights the plan does not name (a
down-projection bias would be added once per rank), a norm after each expert
(``has_post_expert_norm``: it would normalize a partial sum), and sequence parallelism (the
experts' tokens are a rank's sequence shard, whose partial outputs cannot be summed across ranks).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from parallel3d.errors import ConfigError
from parallel3d.tensor_parallel.comm import copy_to_tp, reduce_from_tp
from parallel3d.tensor_parallel.sharding import ShardSpec, make_spec


def _split_dim(param: nn.Parameter, down: bool, transposed: bool) -> int:
    """The dim of a stacked expert weight ([E, out, in], or [E, in, out] when transposed) to split:
    the input features of the down projection, the output features of the others."""
    if param.dim() == 2:  # an up or gate|up bias [E, out]
        return 1
    out_dim, in_dim = (2, 1) if transposed else (1, 2)
    return in_dim if down else out_dim


def expert_specs(model: nn.Module, path: str, planned: set[str], world: int) -> dict[str, ShardSpec]:
    """How each weight of the experts module ``path`` is split (full names); ConfigError if it cannot be."""
    module = model.get_submodule(path)
    owner = type(model).__name__
    if getattr(module, "has_post_expert_norm", False):
        raise ConfigError(f"{owner}: {path} normalizes each expert's output (has_post_expert_norm), which under "
                          "tensor parallelism would normalize a partial sum")
    transposed = bool(getattr(module, "is_transposed", False))
    packed_layout = getattr(module, "is_concatenated", True)
    specs: dict[str, ShardSpec] = {}
    for local, param in module.named_parameters():
        down = "down" in local
        if local not in planned or param.dim() not in (2, 3) or (down and param.dim() < 3):
            raise ConfigError(f"{owner}: parameter {path}.{local} (shape {list(param.shape)}) of the experts module is "
                              "not split by its tensor-parallel plan; each rank would add it to its partial sum")
        dim = _split_dim(param, down, transposed)
        packed = 2 if "gate_up" in local and packed_layout else 1
        try:
            specs[f"{path}.{local}"] = make_spec(param.shape[dim], dim, world, packed=packed)
        except ValueError as exc:
            raise ConfigError(f"{owner}: {path}.{local} cannot be split over tensor_parallel.size={world}: "
                              f"{exc}") from None
    return specs


def expert_hooks(module: nn.Module, group: ProcessGroup) -> list[Any]:
    """Enter tensor parallelism at the experts module (hidden states and routing weights) and sum its output."""

    def enter(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return copy_to_tp(value, group)
        return value

    def pre(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return tuple(enter(a) for a in args), {k: enter(v) for k, v in kwargs.items()}

    def post(_: nn.Module, args: tuple, output: Any) -> Any:
        if isinstance(output, tuple):
            return (reduce_from_tp(output[0], group), *output[1:])
        return reduce_from_tp(output, group)

    return [module.register_forward_pre_hook(pre, with_kwargs=True), module.register_forward_hook(post)]

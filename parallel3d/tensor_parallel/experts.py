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

Under sequence parallelism a rank's router sees its own part of the sequence, and so would its
slice of the experts, whose partial sums could then not be added across ranks. So the entry
all-gathers every tensor input along its first dim (the tokens: ``[tokens, ...]`` flattened from
``[batch, sequence part]``, or ``[batch, sequence part, ...]``; each rank's part is token-major,
so the gathered tokens line up across inputs), with a reduce-scatter of the gradient for
floating inputs, and the exit reduce-scatters the output along the same dim, handing each rank
its own tokens' sums: Megatron's sequence-parallel MoE layer without expert parallelism. The
experts compute token by token, so the gathered order (rank by rank) does not change any value.

Refused, naming the parameter or the attribute: expert weights the plan does not name (a
down-projection bias would be added once per rank), LoRA on the stacked weights (peft's
``target_parameters``: one adapter pair spans every expert whole) and a norm after each expert
(``has_post_expert_norm``: it would normalize a partial sum); under sequence parallelism, an
experts module called with an input that is not a tensor of tokens.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.distributed import ProcessGroup

from parallel3d.errors import ConfigError
from parallel3d.expert_parallel.plan import refuse_expert_adapters
from parallel3d.tensor_parallel.comm import all_gather_tokens, copy_to_tp, gather_seq, reduce_from_tp, reduce_scatter_seq
from parallel3d.tensor_parallel.sequence import first_output_hook
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
    refuse_expert_adapters(module, path, "tensor_parallel", f"tensor parallelism (tensor_parallel.size {world})",
                           "tensor parallelism keeps only each rank's slice of every expert")
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


def check_token_input(owner: str, value: Any, tokens: int | None) -> None:
    """ConfigError unless ``value``, an input of the experts module ``owner`` under sequence
    parallelism, is a tensor of its ``tokens`` tokens (``[tokens, ...]``), which can be gathered."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != tokens:
        what = f"shape {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise ConfigError(f"sequence parallelism: {owner} is called with an input ({what}) that is not a tensor "
                          f"of its {tokens} tokens, so the ranks' parts of the sequence cannot be gathered for it")


def token_inputs_hook(enter: Callable[[Any, int | None], Any]) -> Callable:
    """A forward pre-hook (with kwargs) applying ``enter(value, tokens)`` to every input of an
    experts module, ``tokens`` being its first input's leading size (the token count)."""

    def pre(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        first = args[0] if args else next(iter(kwargs.values()), None)
        tokens = first.shape[0] if isinstance(first, torch.Tensor) and first.dim() else None
        return tuple(enter(a, tokens) for a in args), {k: enter(v, tokens) for k, v in kwargs.items()}

    return pre


def expert_hooks(module: nn.Module, group: ProcessGroup, sequence_parallel: bool = False) -> list[Any]:
    """Enter tensor parallelism at the experts module (hidden states and routing weights) and sum its
    output; under sequence parallelism gather the tokens on entry and reduce-scatter them on exit."""
    owner = type(module).__name__

    def enter(value: Any, tokens: int | None) -> Any:
        if not sequence_parallel:
            return copy_to_tp(value, group) if isinstance(value, torch.Tensor) and value.is_floating_point() else value
        if value is None:
            return value
        check_token_input(owner, value, tokens)
        return gather_seq(value, group, 0) if value.is_floating_point() else all_gather_tokens(value, group)

    def leave(output: torch.Tensor) -> torch.Tensor:
        return reduce_scatter_seq(output, group, 0) if sequence_parallel else reduce_from_tp(output, group)

    return [module.register_forward_pre_hook(token_inputs_hook(enter), with_kwargs=True),
            module.register_forward_hook(first_output_hook(leave))]

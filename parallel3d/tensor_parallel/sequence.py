"""Sequence parallelism's hooks: where the sequence is split, gathered and kept whole.

Between the split regions each tp rank holds its part of the sequence (Megatron's sequence
parallelism): the first text block scatters the hidden states along the sequence, the last one
gathers them back (``sequence_segment_hooks``; under pipeline stages, per chunk), regions
all-gather on entry and their row layers reduce-scatter on exit (``layers.py``). Inside the
blocks:

* a **per-token input** a block receives beside its hidden states (DeepSeek V4's ``input_ids``
  for its hash router, Gemma's per-layer inputs) comes from the base model whole and is cut to
  the rank's part at each block's entry (``split_to_tp``: the whole gradient reaches what
  computed it). Inputs that mixers need whole (masks, rotary tables, positions, caches, by
  name) are left alone;
* a **replicated token mixer** (an attention the plan does not split, a state-space or
  convolution mixer) runs on the gathered sequence and keeps its rank's part of the output,
  so its gradient comes from that part only: the entry's reduce-scatter sums the input
  gradients, and its parameters are summed over tp like the norms' (``partial_params``);
* **experts** gather the ranks' tokens themselves (``experts.py``).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from models.anatomy import text_blocks
from parallel3d.errors import ConfigError
from parallel3d.tensor_parallel.comm import gather_from_tp, gather_seq, split_to_tp
from parallel3d.tensor_parallel.layers import RowParallelLinear
from parallel3d.tensor_parallel.rng import SplitRegionRNG

# Inputs only a module that mixes tokens takes (HF attention, state-space and convolution mixers);
# norms, MLPs, routers and experts work token by token and take none of them.
MIXER_INPUTS = frozenset({"attention_mask", "position_embeddings", "position_ids", "past_key_values", "cache",
                          "cache_params", "cache_position", "past_key_value", "layer_past"})


def hidden_states_hook(enter: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    """A forward pre-hook (with kwargs) applying ``enter`` to a module's hidden-states input."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (enter(args[0]), *args[1:]), kwargs
        for key in ("hidden_states", "x"):
            if key in kwargs:
                return args, {**kwargs, key: enter(kwargs[key])}
        raise RuntimeError(f"tensor parallel: no hidden states among the inputs of {type(module).__name__}")

    return hook


def first_output_hook(leave: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    """A forward hook applying ``leave`` to a module's (first) output."""

    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        if isinstance(output, tuple):
            return (leave(output[0]), *output[1:])
        return leave(output)

    return hook


def sequence_segment_hooks(first: nn.Module, last: nn.Module, group: ProcessGroup,
                           rng: SplitRegionRNG | None) -> list[Any]:
    """Sequence parallelism over a run of blocks: ``first`` scatters the hidden states along the
    sequence, ``last`` gathers them back; between them each tp rank holds its part of the
    sequence and draws dropout from its own stream. The whole block list is one run; under
    pipeline stages each chunk's blocks are one (``apply_tensor_parallel(..., sequence_segments=False)``)."""
    world = dist.get_world_size(group)

    def scatter(x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] % world:
            raise ConfigError(f"sequence parallelism: sequence length {x.shape[1]} must be divisible by "
                              f"tensor_parallel.size={world} (under context parallelism this is a rank's part of "
                              "the sequence: the length given must then be divisible by context_parallel.size x "
                              "tensor_parallel.size)")
        return split_to_tp(x, group, 1)

    # prepended: the blocks' own pre-hooks (``token_input_hook``) see the hidden states already cut
    handles = [first.register_forward_pre_hook(hidden_states_hook(scatter), with_kwargs=True, prepend=True),
               last.register_forward_hook(first_output_hook(lambda x: gather_from_tp(x, group, 1)))]
    if rng is not None:
        handles += [first.register_forward_pre_hook(rng.entry_hook(), with_kwargs=True),
                    last.register_forward_hook(rng.exit_hook(first))]
    return handles


def _mixes_tokens(module: nn.Module) -> bool:
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return bool(MIXER_INPUTS & set(params))


def sequence_mixers(model: nn.Module, regions: set[str]) -> list[str]:
    """The outermost modules inside the text blocks that mix tokens (by their inputs:
    ``MIXER_INPUTS``) and are neither split regions nor inside or around one: replicated
    attention or state-space mixers, which under sequence parallelism must see the whole sequence."""
    names = {id(m): n for n, m in model.named_modules()}
    out: list[str] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            name = names.get(id(child), "")
            holds_region = any(r == name or r.startswith(name + ".") for r in regions)
            if holds_region:
                if name not in regions:
                    visit(child)
            elif _mixes_tokens(child):
                out.append(name)
            else:
                visit(child)

    for block in text_blocks(model):
        visit(block)
    return out


# Name parts of block inputs that mixers read whole (Falcon-H1's ``mamba_attention_mask``,
# rotary tables, positions, caches, a cross-attention's encoder states), beside ``MIXER_INPUTS``.
_WHOLE_PARTS = ("mask", "position", "cache", "past", "rotary", "rope", "freqs", "encoder")


def whole_mixers(mixers: list[str], tp_layers: set[str]) -> list[str]:
    """The mixers that hold tensor-parallel layers (Qwen3-Next's linear attention: its projections
    split their weights and gather their outputs). Each rank runs them whole, forward and
    backward, as under plain tensor parallelism (``sequence_parallel_hooks``)."""
    return [m for m in mixers if any(layer.startswith(m + ".") for layer in tp_layers)]


def _kept_whole(name: str) -> bool:
    return name in MIXER_INPUTS or any(part in name for part in _WHOLE_PARTS)


def token_input_hook(block: nn.Module, world: int, cut: Callable[[torch.Tensor, int], torch.Tensor]) -> Callable:
    """A pre-hook on a block that cuts every per-token input other than the hidden states and the
    mixers' (masks, positions, rotary tables, caches: ``_kept_whole``) to the rank's part: a
    tensor [batch, whole sequence, ...] whose sequence is ``world`` times the hidden states'.
    ``cut(x, part_length)`` cuts one."""
    try:
        signature: inspect.Signature | None = inspect.signature(block.forward)
    except (TypeError, ValueError):
        signature = None

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if signature is None:
            return args, kwargs
        try:
            bound = signature.bind_partial(*args, **kwargs)
        except TypeError:
            return args, kwargs
        names = list(bound.arguments)
        hidden = bound.arguments.get(names[0]) if names else None
        if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2:
            return args, kwargs
        batch, part = hidden.shape[0], hidden.shape[1]

        def per_token(name: str, value: Any) -> bool:
            return (not _kept_whole(name) and isinstance(value, torch.Tensor) and value.dim() >= 2
                    and value.shape[0] == batch and value.shape[1] == part * world)

        args = tuple(cut(a, part) if i < len(names) and per_token(names[i], a) else a for i, a in enumerate(args))
        return args, {k: cut(v, part) if per_token(k, v) else v for k, v in kwargs.items()}

    return hook


def sequence_parallel_hooks(model: nn.Module, group: ProcessGroup, regions: set[str], mixers: list[str],
                            whole: list[str]) -> list[Any]:
    """Sequence parallelism's hooks inside the text blocks (module docstring): regions gather the
    sequence, per-token inputs are cut to the rank's part, replicated ``mixers``
    (``sequence_mixers``) run on the whole sequence.

    A mixer of ``whole`` (``whole_mixers``: it holds tensor-parallel layers, whose collectives
    need the same gradient on every rank) takes the gathered sequence with ``gather_from_tp``
    and hands back its rank's part with ``split_to_tp``: every rank then runs its backward on
    the whole output gradient, as plain tensor parallelism does, and its parameters get whole
    gradients (``partial_params`` leaves them out). The other mixers take it with
    ``gather_seq`` and keep their part with a local slice: each rank's backward covers its own
    part, the entry's reduce-scatter sums the input gradients, and their parameters are summed
    over tp like the norms'."""
    blocks = text_blocks(model)
    if not blocks:
        raise ConfigError(f"sequence parallelism: {type(model).__name__} names no block class in _no_split_modules")
    world, rank = dist.get_world_size(group), dist.get_rank(group)

    def cut(x: torch.Tensor, part: int) -> torch.Tensor:
        if x.is_floating_point():
            return split_to_tp(x, group, 1)
        return x.narrow(1, rank * part, part)

    handles = [block.register_forward_pre_hook(token_input_hook(block, world, cut), with_kwargs=True)
               for block in blocks]
    for name in regions:
        handles.append(model.get_submodule(name).register_forward_pre_hook(
            hidden_states_hook(lambda x: gather_seq(x, group, -2)), with_kwargs=True))
    for name in mixers:
        module = model.get_submodule(name)
        if name in whole:
            enter, leave = (lambda x: gather_from_tp(x, group, 1)), (lambda x: split_to_tp(x, group, 1))
        else:
            enter = lambda x: gather_seq(x, group, 1)  # noqa: E731
            leave = lambda x: x.narrow(1, rank * (x.shape[1] // world), x.shape[1] // world)  # noqa: E731
        handles.append(module.register_forward_pre_hook(hidden_states_hook(enter), with_kwargs=True))
        handles.append(module.register_forward_hook(first_output_hook(leave)))
    return handles


def partial_params(model: nn.Module, regions: set[str], sharded: set[nn.Parameter],
                   rows: list[RowParallelLinear], whole: list[str] = ()) -> set[nn.Parameter]:
    """Replicated params that only see this rank's tokens under sequence parallelism (not those of
    the regions, nor of the mixers every rank runs whole)."""
    own = {id(p) for name in [*regions, *whole] for p in model.get_submodule(name).parameters()}
    out = {p for block in text_blocks(model) for p in block.parameters()
           if p.requires_grad and p not in sharded and id(p) not in own}
    return out | {r.bias for r in rows if r.bias is not None and r.bias.requires_grad}

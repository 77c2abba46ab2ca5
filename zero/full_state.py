"""One parameter's fp32 value, gradient or optimizer state, whole: read from or written into the shards.

DeepSpeed's ``safe_get_full_fp32_param`` / ``safe_get_full_grad`` /
``safe_get_full_optimizer_state`` and their ``safe_set_*`` twins, for a ``ZeroOptimizer``.
Each reader is a collective over the data-parallel group when the parameter's unit is
sharded (every rank calls it for the same parameter): each rank contributes the slice it
owns and an all-gather of the unit-sized buffer assembles the whole. Each writer takes the
whole value (the same on every rank) and keeps this rank's slice; it communicates nothing.

Gradients are the ones the optimizer will step with: after the backward that ends an
accumulation window and before ``step``, reduced over data parallelism, in the working
precision; under fp16 in fp32 with the loss scale divided out (DeepSpeed returns them in fp16,
still multiplied by the scale).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from zero.comm import gather_shards
from zero.flat import FlatUnit, shard_group_of
from zero.gathered import write_back

if TYPE_CHECKING:
    from zero.optimizer import ZeroOptimizer


class StateAccessError(ValueError):
    """A parameter, state key or value that the full-state accessors cannot serve."""


def locate(optimizer: ZeroOptimizer, param: nn.Parameter) -> tuple[FlatUnit, int]:
    """The unit holding ``param`` and its index there."""
    for unit in optimizer.units:
        for index, p in enumerate(unit.params):
            if p is param:
                return unit, index
    raise StateAccessError("this parameter is not trained by the engine (frozen, or of another model)")


def _assemble(optimizer: ZeroOptimizer, unit: FlatUnit, index: int, shard_values: torch.Tensor) -> torch.Tensor:
    """The param's whole value from each rank's shard-sized fp32 ``shard_values`` (a collective if sharded)."""
    if unit.world > 1:
        full = torch.empty(unit.padded, dtype=shard_values.dtype, device=unit.device)  # host shards: gathered on the device
        gather_shards(full, shard_values.contiguous(), shard_group_of(unit, optimizer.group)).wait()
    else:
        full = shard_values.to(unit.device)  # an offloaded shard: on the compute device, as with dp > 1
    off, n = unit.offsets[index], unit.numels[index]
    return full[off : off + n].clone().view(unit.shapes[index])


def _check_value(unit: FlatUnit, index: int, value: torch.Tensor, what: str) -> torch.Tensor:
    shape = unit.shapes[index]
    if not isinstance(value, torch.Tensor) or value.shape != shape:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise StateAccessError(f"{what}: the value must be a tensor of the parameter's shape {tuple(shape)}, got {got}")
    return value.detach().to(device=unit.device, dtype=torch.float32).reshape(-1)


def _shard_slice(unit: FlatUnit, index: int) -> tuple[int, int, int, int]:
    """``(start, stop)`` of the param within this rank's shard, and within the param."""
    lo, hi = unit.shard_range
    off, n = unit.offsets[index], unit.numels[index]
    start, stop = max(off, lo), min(off + n, hi)
    stop = max(start, stop)
    return start - lo, stop - lo, start - off, stop - off


def full_fp32_param(optimizer: ZeroOptimizer, param: nn.Parameter) -> torch.Tensor:
    """The fp32 master value of ``param``, whole."""
    unit, index = locate(optimizer, param)
    return _assemble(optimizer, unit, index, unit.master.detach())


def set_full_fp32_param(optimizer: ZeroOptimizer, param: nn.Parameter, value: torch.Tensor) -> None:
    """Make ``value`` the fp32 master and the working value of ``param``."""
    unit, index = locate(optimizer, param)
    flat = _check_value(unit, index, value, "safe_set_full_fp32_param")
    write_back(optimizer, unit, index, flat)
    a, b, c, d = _shard_slice(unit, index)
    unit.master[a:b].copy_(flat[c:d])  # the master keeps fp32 values, not the working-precision ones


def _grad_shard(optimizer: ZeroOptimizer, unit: FlatUnit) -> torch.Tensor | None:
    return unit.grad_shard if optimizer.reducer.boundary and unit.grad_shard is not None else None


def full_grad(optimizer: ZeroOptimizer, param: nn.Parameter) -> torch.Tensor | None:
    """The reduced, unscaled gradient of ``param``, whole; None when it got none in this window.

    In the dtype gradients accumulate in (the working precision, as DeepSpeed returns it), except
    under fp16, where dividing out the loss scale could underflow: fp32 there.
    """
    unit, index = locate(optimizer, param)
    received = optimizer.reducer.received[optimizer.units.index(unit)][index]
    if optimizer.dp.world > 1:  # a param may get a gradient on some ranks only
        flag = torch.tensor([int(received)], dtype=torch.int32, device=unit.device)
        optimizer.dp.all_reduce(flag, op=dist.ReduceOp.MAX)
        received = bool(flag.item())
    shard = _grad_shard(optimizer, unit)
    if not received or shard is None:
        return None
    if optimizer.dp.replicas > 1:  # the step averages the shard over the replicas; so does this copy
        shard = shard.clone()
        dist.all_reduce(shard, op=dist.ReduceOp.AVG, group=optimizer.dp.replica)
    if unit.expert:  # the step's 1/E (ZeroOptimizer.expert_gradient_factor)
        shard = shard * optimizer.expert_gradient_factor
    if unit.dtype == torch.float16:
        return _assemble(optimizer, unit, index, shard.float() / optimizer.loss_scale)
    return _assemble(optimizer, unit, index, shard)


def set_full_grad(optimizer: ZeroOptimizer, param: nn.Parameter, value: torch.Tensor) -> None:
    """Make ``value`` (unscaled) the gradient the next step uses for ``param``."""
    unit, index = locate(optimizer, param)
    flat = _check_value(unit, index, value, "safe_set_full_grad")
    shard = _grad_shard(optimizer, unit)
    if shard is None:
        raise StateAccessError("safe_set_full_grad: gradients exist only after the backward that ends an "
                               "accumulation window and before engine.step()")
    a, b, c, d = _shard_slice(unit, index)
    scale = optimizer.loss_scale / (optimizer.expert_gradient_factor if unit.expert else 1.0)
    shard[a:b].copy_(flat[c:d] * scale)
    optimizer.reducer.received[optimizer.units.index(unit)][index] = True


def _piece_state(optimizer: ZeroOptimizer, param: nn.Parameter, key: str) -> tuple[FlatUnit, int, torch.Tensor | None]:
    """The inner optimizer's elementwise state ``key`` of this rank's piece of ``param`` (None if no piece).

    ``key`` is checked against this piece's state, or on a rank that holds no piece of ``param``
    against any piece's (a torch optimizer keeps the same keys for every parameter it has
    stepped), so that every rank refuses the same key before the collective that follows.
    """
    unit, index = locate(optimizer, param)
    mine, example = None, None
    for (p, _, master, _), state in zip(optimizer.piece_params(), optimizer.piece_states()):
        if p is param:
            mine, example = (master, state), (master, state)
            break
        if example is None and state:
            example = (master, state)
    master, state = example if example is not None else (None, {})
    if key not in state:
        known = ", ".join(sorted(state)) or "none yet (the optimizer has not stepped)"
        raise StateAccessError(f"optimizer state {key!r} does not exist for this parameter; its states: {known}")
    value = state[key]
    if not isinstance(value, torch.Tensor) or value.shape != master.shape:
        raise StateAccessError(f"optimizer state {key!r} is not elementwise (a scalar such as a step count); "
                               "only states of the parameter's shape can be read or written whole")
    return unit, index, value if mine is not None else None


def full_optimizer_state(optimizer: ZeroOptimizer, param: nn.Parameter, key: str) -> torch.Tensor:
    """The inner optimizer's elementwise state ``key`` (``exp_avg``...) of ``param``, whole, in fp32."""
    unit, index, mine = _piece_state(optimizer, param, key)
    shard = torch.zeros(unit.shard_size, dtype=torch.float32, device=unit.device)
    if mine is not None:
        a, b, _, _ = _shard_slice(unit, index)
        shard[a:b].copy_(mine.detach().reshape(-1))
    return _assemble(optimizer, unit, index, shard)


def set_full_optimizer_state(optimizer: ZeroOptimizer, param: nn.Parameter, value: torch.Tensor, key: str) -> None:
    """Make ``value`` the inner optimizer's state ``key`` of ``param`` (the state must exist)."""
    unit, index, mine = _piece_state(optimizer, param, key)
    flat = _check_value(unit, index, value, "safe_set_full_optimizer_state")
    if mine is not None:
        _, _, c, d = _shard_slice(unit, index)
        mine.copy_(flat[c:d].view_as(mine))

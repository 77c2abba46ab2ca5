"""``parallel3d.GatheredParameters``: whole parameters inside a ``with`` block, at any ZeRO stage.

DeepSpeed's ``deepspeed.zero.GatheredParameters`` recognizes its own partitioned parameters by
their ``ds_id`` attribute and is a silent no-op on any other tensor. On Zero3D's stage-3
parameters (shape (0,) between uses) that no-op would hand a script empty tensors without a
word, so ``initialize`` turns those parameters into ``ShardedParameter``: an ``nn.Parameter``
that has a ``ds_id`` and whose DeepSpeed internals (``all_gather``, ``ds_tensor``, ...) raise a
``UsageError`` naming this module's ``GatheredParameters``, the one that works on them.

Which ZeRO optimizer owns a parameter is kept in a weak map filled by ``initialize``
(``register``), so ``GatheredParameters(model.parameters())`` needs no engine argument, like
DeepSpeed's.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from parallel3d.errors import UsageError
from zero import ZeroOptimizer
from zero.gathered import GatherError, GatheredParams

_OWNERS = WeakIdKeyDictionary()  # param (by identity) -> weakref to its ZeroOptimizer

_DEEPSPEED_INTERNALS = ("all_gather", "partition", "ds_tensor", "ds_numel", "ds_shape", "ds_process_group",
                        "ds_persist", "ds_active_sub_modules", "_z3_optimizer")
"""What DeepSpeed's ZeRO-3 code reads of a parameter it believes partitioned, past ``ds_id``."""


def _refuse(name: str) -> property:
    def get(self: nn.Parameter) -> Any:
        raise UsageError(
            f"DeepSpeed's ZeRO-3 code asked for {name!r} of a parameter that Zero3D shards (ZeRO stage 3, shape (0,) "
            "between uses): deepspeed.zero.GatheredParameters and DeepSpeed's other ZeRO-3 helpers cannot gather it. "
            "Use parallel3d.GatheredParameters(params, modifier_rank=None) (same arguments) to see it whole, and "
            "parallel3d.safe_get_full_fp32_param / safe_get_full_grad / safe_get_full_optimizer_state for its fp32 "
            "value, gradient and optimizer state")

    return property(get)


class _Zero3DStatus:
    """What ``ds_status`` answers: not DeepSpeed's NOT_AVAILABLE, so DeepSpeed never tries to gather it itself."""

    name = "ZERO3D_SHARDED"


class ShardedParameter(nn.Parameter):
    """A Zero3D stage-3 parameter: an ``nn.Parameter`` that DeepSpeed's ZeRO-3 code cannot mistake for a plain one.

    DeepSpeed recognizes a partitioned parameter by ``ds_id``. This one has it, so
    ``deepspeed.zero.GatheredParameters`` does not silently skip it; the first thing DeepSpeed
    then does with it (``all_gather``, ``partition``, ``ds_tensor``...) raises a ``UsageError``
    naming ``parallel3d.GatheredParameters``. ``ds_status`` is not DeepSpeed's NOT_AVAILABLE, so
    DeepSpeed's ZeRO-3 linear (which stays patched into ``torch.nn.functional`` in a process that
    ran DeepSpeed stage 3 before) computes with the parameter as Zero3D gathered it.
    """

    ds_id = -1
    ds_status = _Zero3DStatus()


for _name in _DEEPSPEED_INTERNALS:
    setattr(ShardedParameter, _name, _refuse(_name))


def register(optimizer: ZeroOptimizer) -> None:
    """Record ``optimizer`` as the owner of its parameters; at stage 3 make them ``ShardedParameter``."""
    owner = weakref.ref(optimizer)
    for unit in optimizer.units + optimizer.frozen_units:
        for param in unit.params:
            _OWNERS[param] = owner
            if optimizer.settings.stage == 3 and type(param) is nn.Parameter:
                param.__class__ = ShardedParameter


def owner_of(param: torch.Tensor) -> ZeroOptimizer | None:
    """The live ZeRO optimizer that manages ``param``, or None."""
    ref = _OWNERS.get(param) if isinstance(param, torch.Tensor) else None
    return ref() if ref is not None else None


class GatheredParameters:
    """DeepSpeed's ``GatheredParameters`` for Zero3D: ``params`` are whole inside the block.

    Args:
        params: a parameter or an iterable of them. Parameters no engine manages (plain tensors,
            integer parameters) are left as they are; frozen ones are gathered like trained ones.
        modifier_rank: the data-parallel rank whose changes to ``params`` are kept: on exit its
            values are broadcast and written into every rank's shards and fp32 master weights,
            so training continues from them. Without it a change would be lost, so a change
            made on any rank raises ``UsageError`` on exit.
        fwd_module: DeepSpeed's registration of an external parameter for the forward of
            another module; not supported (Zero3D gathers a parameter with its own block).
        enabled: False makes the block a no-op.

    Entering is a collective over the data-parallel group at ZeRO stage 3, and exiting is one
    whenever the data-parallel size is above 1: every rank enters with the same params. Under
    tensor parallelism a parameter is this rank's tp shard, gathered over data parallelism.
    """

    def __init__(self, params: torch.Tensor | Iterable[torch.Tensor], modifier_rank: int | None = None,
                 fwd_module: nn.Module | None = None, enabled: bool = True) -> None:
        if fwd_module is not None:
            raise UsageError("GatheredParameters(fwd_module=...) is not supported: Zero3D gathers a parameter "
                             "together with the block it belongs to; use the parameter inside its own module, "
                             "or call GatheredParameters around the code that reads it")
        if modifier_rank is not None and (isinstance(modifier_rank, bool) or not isinstance(modifier_rank, int)):
            raise UsageError(f"GatheredParameters: modifier_rank must be None or a data-parallel rank (int), "
                             f"got {modifier_rank!r}")
        params = [params] if isinstance(params, torch.Tensor) else list(params) if enabled else []
        by_owner: dict[int, tuple[ZeroOptimizer, list[torch.Tensor]]] = {}
        for p in params:
            opt = owner_of(p)
            if opt is not None:
                by_owner.setdefault(id(opt), (opt, []))[1].append(p)
        self._contexts = [GatheredParams(opt, ps, modifier_rank) for opt, ps in by_owner.values()]
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        try:
            for ctx in self._contexts:
                stack.enter_context(ctx)
        except BaseException:
            stack.close()
            raise
        self._stack = stack

    def __exit__(self, exc_type, exc, tb) -> bool:
        stack, self._stack = self._stack, None
        try:
            return bool(stack.__exit__(exc_type, exc, tb)) if stack is not None else False
        except GatherError as err:
            raise UsageError(str(err)) from None

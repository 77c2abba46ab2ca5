"""DeepSpeed's ``deepspeed.utils.safe_get_full_*`` / ``safe_set_full_*`` for Zero3D parameters.

Same names and arguments as DeepSpeed's, so ``from parallel3d import safe_get_full_grad``
replaces ``from deepspeed.utils import safe_get_full_grad``. A parameter no Zero3D engine
trains gives None (getters) or is left alone (setters), as DeepSpeed does for a parameter
outside ZeRO.

* Getters are collectives over the data-parallel group (every rank asks for the same
  parameter); setters take the whole value, the same on every rank, and communicate nothing.
* A parameter is the one this rank's model holds: under tensor parallelism its tp shard.
* ``safe_get_full_grad`` is the gradient the next ``engine.step()`` uses: after the backward
  that ends an accumulation window, reduced over data parallelism, in the working precision
  (as DeepSpeed's); under fp16 in fp32 with the loss scale divided out (DeepSpeed's is fp16 and
  still carries the scale). None outside that window or for a parameter no rank gave a
  gradient. ``safe_set_full_grad`` takes an unscaled gradient.
* Optimizer states are the inner ``torch.optim`` optimizer's elementwise ones (``exp_avg``,
  ``exp_avg_sq``, ``momentum_buffer``); they exist after the first step.
"""

from __future__ import annotations

import torch

from parallel3d.errors import UsageError
from parallel3d.compat.gathered import owner_of
from zero import full_state
from zero.full_state import StateAccessError

__all__ = ["safe_get_full_fp32_param", "safe_set_full_fp32_param", "safe_get_full_grad", "safe_set_full_grad",
           "safe_get_full_optimizer_state", "safe_set_full_optimizer_state"]


def _call(function, param: torch.Tensor, *args):
    optimizer = owner_of(param)
    if optimizer is None:
        return None
    try:
        return function(optimizer, param, *args)
    except StateAccessError as err:
        raise UsageError(str(err)) from None


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """The fp32 master value of ``param``, whole (a collective over data parallelism)."""
    return _call(full_state.full_fp32_param, param)


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set ``param``'s fp32 master and working value to ``value`` (the same on every rank)."""
    _call(full_state.set_full_fp32_param, param, value)


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The reduced, unscaled gradient of ``param``, whole (a collective over data parallelism)."""
    return _call(full_state.full_grad, param)


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Replace the gradient the next step uses for ``param`` by ``value`` (unscaled, the same on every rank)."""
    _call(full_state.set_full_grad, param, value)


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """The optimizer state ``optim_state_key`` of ``param``, whole, fp32 (a collective over data parallelism)."""
    return _call(full_state.full_optimizer_state, param, optim_state_key)


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Set the optimizer state ``optim_state_key`` of ``param`` to ``value`` (the same on every rank)."""
    _call(full_state.set_full_optimizer_state, param, value, optim_state_key)

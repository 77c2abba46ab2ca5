"""Which optimizers may step on sharded parameters.

ZeRO (stage 1 and up) hands the optimizer flat shards of the parameters, and tensor parallelism
hands it slices: an optimizer whose update of an element depends only on that element's
gradient and state (Adam, SGD, ...) computes exactly what it would on whole parameters; one
that reads a whole tensor (LAMB's trust ratio, Adafactor's factored second moments, Muon's
orthogonalization, any per-tensor norm) computes something else, without an error (Adafactor
at ZeRO-1: parameters 0.06 off after three steps). DeepSpeed refuses every optimizer outside
the list it has tested unless ``zero_allow_untested_optimizer`` is true; Zero3D keeps that rule
and that key, with the elementwise optimizers of torch and DeepSpeed as its list.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from parallel3d.errors import UntestedOptimizerError

logger = logging.getLogger(__name__)

__all__ = ["ELEMENTWISE_OPTIMIZERS", "check_sharded_optimizer"]

ELEMENTWISE_OPTIMIZERS = frozenset({
    torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad, torch.optim.Adamax,
    torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Rprop, torch.optim.ASGD, torch.optim.Adadelta,
})
"""Exact types (a subclass may change ``step``) whose update is elementwise."""

_DEEPSPEED_ELEMENTWISE = frozenset({
    "deepspeed.ops.adam.fused_adam.FusedAdam", "deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam",
    "deepspeed.ops.adagrad.cpu_adagrad.DeepSpeedCPUAdagrad", "deepspeed.ops.lion.fused_lion.FusedLion",
    "deepspeed.ops.lion.cpu_lion.DeepSpeedCPULion", "apex.optimizers.fused_adam.FusedAdam",
})
"""DeepSpeed's (and apex's) elementwise optimizers, by qualified name (neither need be installed).
DeepSpeed's list also has Muon, whose orthogonalization reads whole matrices: refused here, as
Zero3D does not gather them for it."""


def _known(cls: type) -> bool:
    return cls in ELEMENTWISE_OPTIMIZERS or f"{cls.__module__}.{cls.__qualname__}" in _DEEPSPEED_ELEMENTWISE


def check_sharded_optimizer(cls: type, zero_stage: int, tp_size: int, allow_untested: bool) -> None:
    """UntestedOptimizerError when ``cls`` is not known to be elementwise and the parameters it
    steps are sharded (ZeRO stage >= 1 or tensor parallelism), unless ``allow_untested``."""
    if (zero_stage < 1 and tp_size < 2) or _known(cls):
        return
    where = f"ZeRO stage {zero_stage}" if zero_stage >= 1 else f"tensor_parallel.size {tp_size}"
    if allow_untested:
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        logger.warning("optimizer %s is not known to update elementwise and steps on sharded parameters (%s); "
                       "zero_allow_untested_optimizer is true, so it runs: its result equals one process's only if "
                       "its update of each element reads nothing but that element", cls.__name__, where)
        return
    known = sorted(c.__name__ for c in ELEMENTWISE_OPTIMIZERS) + sorted(n.rsplit(".", 1)[1] for n in _DEEPSPEED_ELEMENTWISE)
    raise UntestedOptimizerError(
        f"optimizer {cls.__module__}.{cls.__qualname__} would step on sharded parameters ({where}: flat shards or "
        "slices of each tensor), which gives another result for any optimizer that reads a whole tensor (per-tensor "
        f"norms, factored moments: LAMB, Adafactor, Muon); known elementwise: {', '.join(known)}. Set "
        '"zero_allow_untested_optimizer": true (DeepSpeed\'s key) if its update of each element reads only that '
        "element, or train it without ZeRO and tensor parallelism")

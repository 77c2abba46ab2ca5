"""ZeRO stage 3: a vocabulary head whose backward frees its gathered weight before it makes the
weight's gradient.

Autograd's backward of ``F.linear`` holds the weight (saved for the input gradient) while it
computes the weight gradient, so a stage-3 rank has the whole gathered weight and the whole
weight gradient alive at once; at a vocabulary head both are vocabulary x hidden, the largest
pair of tensors it ever holds together. :class:`ReleasingLinear` computes the input gradient
first, then hands the weight's unit back (``release``: freed, its params pointing at
shape-only placeholders, into which autograd accumulates the gradient), then computes the
weight gradient: the same two matrix products as autograd's (``mm`` of the same operands, so
the same bits), with one vocabulary-sized tensor fewer at the peak.

Used only where every backward of the head is preceded by a gather of its unit (stage 3's
pre-backward hook on the module's output) and the weight is nobody else's: an untied
``nn.Linear`` head without bias, outside an input-gradient-only pass (``zb_h1``'s B).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class ReleasingLinear(torch.autograd.Function):
    """``F.linear(x, weight)`` whose backward calls ``release`` between the input and weight gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, release: Callable[[], None]) -> torch.Tensor:
        ctx.release = release
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad2d = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = None
        if ctx.needs_input_grad[0] and _will_run(ctx, 0, default=True):
            grad_x = grad2d.mm(weight).view(x.shape)
        wanted = _will_run(ctx, 1, default=None) if ctx.needs_input_grad[1] else False
        if wanted is not False:  # None: inside autograd.grad, which may want it (kept gathered then)
            if wanted:
                ctx.release()
            grad_w = grad2d.t().mm(x.reshape(-1, x.shape[-1]))
        return grad_x, grad_w, None


def _will_run(ctx, index: int, default: bool | None) -> bool | None:
    """Whether this backward reaches input ``index``'s node; ``default`` where torch cannot say
    (a leaf's node inside ``autograd.grad``)."""
    node = ctx.next_functions[index][0]
    if node is None:
        return False
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:
        return default


def releasing_forward(module: nn.Linear, opened: Callable[[], None],
                      release: Callable[[], None]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A ``forward`` for ``module`` (an ``nn.Linear`` without bias) that uses :class:`ReleasingLinear`
    when it builds a graph; plain ``F.linear`` otherwise (no grad, autocast, mixed dtypes).
    ``opened()`` is called for each such use outside a backward (a recomputation inside one is
    not a use of its own), ``release()`` by each use's backward before its weight gradient."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        weight = module.weight
        if (not torch.is_grad_enabled() or not weight.requires_grad or x.dtype != weight.dtype
                or torch.is_autocast_enabled(x.device.type)):
            return F.linear(x, weight)
        if torch._C._current_graph_task_id() == -1:
            opened()
        return ReleasingLinear.apply(x, weight, release)

    return forward


def can_release_early(module: nn.Module) -> bool:
    """An exact ``nn.Linear`` without bias (a subclass may compute something else) whose
    ``forward`` nobody has replaced on the instance (accelerate's hooks, a user's patch)."""
    return type(module) is nn.Linear and module.bias is None and "forward" not in vars(module)

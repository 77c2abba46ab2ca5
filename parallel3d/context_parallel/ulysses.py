"""Ulysses attention: all-to-all from sequence-split to head-split around the model's own kernel.

Each rank of a context-parallel group holds 1/cp of the sequence's tokens for every head. Before
attention, one all-to-all per tensor gives each rank the whole sequence for 1/cp of the heads
(DeepSpeed-Ulysses); the model's own attention function (sdpa, or the model file's eager one)
then runs unchanged on the full sequence with a causal mask of the full length, and one
all-to-all gives the output back its sequence split. Backward is autograd through the exchange
(``_AllToAll``: its backward is the inverse all-to-all of the gradient).

With fewer key/value heads than cp ranks (GQA or MQA; cp a multiple of them), each kv head is
repeated so that every rank receives the one its query heads use, as DeepSpeed's
``UlyssesSPAttentionHF`` does; the module's ``num_key_value_groups`` is set for the call.

It is registered with transformers' ``AttentionInterface`` under a name of its own and the model's
config is switched to it (parallel3d/context_parallel/model.py), so transformers builds no mask
(a name outside ``AttentionMaskInterface`` gets none) and every attention layer calls it.

Masks: the kernel sees the whole sequence, so it takes the mask one process builds, built here
with transformers' own mask functions (``masking_utils``) from what the batch cutter hands over
for the whole micro-batch: the padding ``attention_mask`` (a key that is padding is masked), and
for packed rows (position ids restarting, without an attention mask, as transformers detects
them) the documents and position ids, so no token attends across a document boundary. Built
once per micro-batch ([B, 1, S, S], as one process holds it) and reused by every layer. Without
padding or documents sdpa runs with ``is_causal`` and no mask, as for one process.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from parallel3d.context_parallel.mask_inputs import MaskInputs
from parallel3d.errors import ConfigError


def _exchange(x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    world = dist.get_world_size(group)
    send = torch.stack(x.chunk(world, dim=scatter_dim)).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """The exchange, whose backward is the inverse exchange of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _exchange(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``x`` into the group's size along ``scatter_dim``, send piece j to rank j, and join what
    arrives along ``gather_dim`` in rank order (differentiable: backward is the inverse exchange)."""
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


class UlyssesAttention:
    """The attention function of one model under Ulysses context parallelism.

    ``inner`` is the model's own implementation ("sdpa" or "eager"). ``calls`` counts the
    attention calls since the last ``reset``, so a forward whose layers did not come here (an
    attention that bypasses the interface) is caught rather than silently wrong.
    """

    method = "ulysses"

    def __init__(self, group: dist.ProcessGroup, inner: str, model_type: str) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.inner = inner
        self.model_type = model_type
        self.calls = 0
        self.inputs = MaskInputs()  # the micro-batch's padding and packed documents (set by the batch cutter)
        self._mask: tuple[MaskInputs, tuple, torch.Tensor | None] | None = None

    def reset(self) -> None:
        self.calls = 0

    def _full_mask(self, batch: int, length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """The mask one process's kernel gets over the whole sequence (None: sdpa's ``is_causal``),
        built once per micro-batch (its ``inputs``) and reused by every layer."""
        inputs, key = self.inputs, (batch, length, dtype, device)
        if self._mask is not None and self._mask[0] is inputs and self._mask[1] == key:
            return self._mask[2]
        from transformers import masking_utils

        function = masking_utils.causal_mask_function
        if inputs.documents is not None:  # as transformers' create_causal_mask does for packed rows
            function = masking_utils.and_masks(
                masking_utils.remap_positions_for_packed_sequence(function, inputs.positions.to(device)),
                masking_utils.packed_sequence_mask_function(inputs.documents.to(device)))
        padding = None if inputs.padding is None else inputs.padding.to(device)
        if self.inner == "eager":
            mask = masking_utils.eager_mask(batch_size=batch, q_length=length, kv_length=length, mask_function=function,
                                            attention_mask=padding, dtype=dtype, device=device)
        elif padding is None and inputs.documents is None:
            mask = None
        else:
            mask = masking_utils.sdpa_mask(batch_size=batch, q_length=length, kv_length=length, mask_function=function,
                                           attention_mask=padding, allow_is_causal_skip=False, device=device)
        self._mask = (inputs, key, mask)
        return mask

    def _refuse(self, reason: str) -> ConfigError:
        return ConfigError(f"context_parallel (ulysses) cannot run {self.model_type}'s attention: {reason}")

    def _kernel(self, module: nn.Module) -> Callable:
        if self.inner == "sdpa":
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            return sdpa_attention_forward
        kernel = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if kernel is None:
            raise self._refuse(f"its eager attention function was not found in {type(module).__module__}")
        return kernel

    def __call__(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, sliding_window: int | None = None, softcap: float | None = None,
                 **kwargs) -> tuple[torch.Tensor, None]:
        """query [B, Hq, s, D], key/value [B, Hkv, s, D] for this rank's s = S / cp tokens;
        returns [B, s, Hq, D] as transformers' attention functions do (no attention weights: a rank
        holds them for its heads only)."""
        self.calls += 1
        cp, full = self.size, query.shape[2] * self.size
        if attention_mask is not None or kwargs.get("position_bias") is not None:
            raise self._refuse("it adds its own mask or position bias (alibi, custom masks) to the attention scores")
        if softcap is not None:
            raise self._refuse("attention logit softcapping")
        if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
            raise self._refuse("attention sinks")
        if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
            raise self._refuse("a non-causal (bidirectional) attention layer")
        if sliding_window is not None and sliding_window < full:
            raise self._refuse(f"a sliding window of {sliding_window} tokens, shorter than the sequence ({full})")
        heads, kv_heads = query.shape[1], key.shape[1]
        if heads % cp or (kv_heads % cp and cp % kv_heads):
            raise self._refuse(f"{heads} query and {kv_heads} key/value heads on this rank: the query heads must "
                               f"divide by context_parallel.size {cp}, the kv heads divide it or by it")
        problem = self.inputs.problem(query.shape[0], full)
        if problem is not None:
            raise self._refuse(problem)
        if kv_heads < cp:  # each rank receives the kv head its query heads share
            key = key.repeat_interleave(cp // kv_heads, dim=1)
            value = value.repeat_interleave(cp // kv_heads, dim=1)
        query, key, value = (all_to_all(t, self.group, scatter_dim=1, gather_dim=2) for t in (query, key, value))
        mask = self._full_mask(query.shape[0], full, query.dtype, query.device)
        with _groups_for_call(module, query.shape[1] // key.shape[1]):
            output, _ = self._kernel(module)(module, query, key, value, mask, **kwargs)
        # [B, S, Hq/cp, D] -> this rank's tokens, every head: [B, s, Hq, D]
        return all_to_all(output, self.group, scatter_dim=1, gather_dim=2), None


@contextlib.contextmanager
def _groups_for_call(module: nn.Module, groups: int):
    """``module.num_key_value_groups`` (read by the kernels' repeat_kv) as the exchanged heads need it."""
    had = hasattr(module, "num_key_value_groups")
    before = getattr(module, "num_key_value_groups", None)
    module.num_key_value_groups = groups
    try:
        yield
    finally:
        if had:
            module.num_key_value_groups = before
        else:
            del module.num_key_value_groups

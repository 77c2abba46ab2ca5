"""Vocab-parallel cross entropy: the loss from vocabulary-sharded logits, never gathered.

Each rank holds logits for its vocabulary slice [vocab_start, vocab_start + V/T). Per token
the loss is ``logsumexp(z) - z[target]``; three numbers per token cross the wire instead
of V/T logits: the max (all-reduce MAX, for stability), and the sum of exponentials and
the target's logit (one all-reduce SUM of both; only the rank owning the target adds a
non-zero logit). The backward is local: ``softmax - onehot(target)`` on this rank's slice.

Padded vocabulary columns (the vocabulary rounded up to a multiple of T) are set to -inf
before anything else, so they never win the max, add nothing to the sum, and get a zero
gradient. The loss is computed in fp32 (as transformers upcasts logits for its loss), or in
fp64 for fp64 logits (transformers' ``.float()`` would cast those down).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group: ProcessGroup, vocab_start: int,  # type: ignore[override]
                vocab_size: int, ignore_index: int) -> torch.Tensor:
        z = logits.to(torch.promote_types(logits.dtype, torch.float32))
        rows = z.shape[-1]
        valid_cols = max(0, min(rows, vocab_size - vocab_start))
        if valid_cols < rows:  # padded vocabulary on this rank
            z = z.clone()
            z[..., valid_cols:] = float("-inf")
        zmax = z.max(dim=-1).values
        dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
        z = z - zmax.unsqueeze(-1)

        ignored = target == ignore_index
        local_t = target - vocab_start
        mine = (local_t >= 0) & (local_t < valid_cols) & ~ignored
        local_t = local_t.masked_fill(~mine, 0)
        target_logit = z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        exp = z.exp()
        sums = torch.stack([exp.sum(dim=-1), target_logit])
        dist.all_reduce(sums, group=group)
        sum_exp, target_logit = sums[0], sums[1]
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)

        exp.div_(sum_exp.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(exp, local_t, mine, ignored)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):  # type: ignore[override]
        softmax, local_t, mine, ignored = ctx.saved_tensors
        grad = softmax
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -mine.to(grad.dtype).unsqueeze(-1))
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, target: torch.Tensor, group: ProcessGroup, *,
                                 vocab_start: int, vocab_size: int, ignore_index: int = -100) -> torch.Tensor:
    """Per-token loss (0 where ``target == ignore_index``), shape of ``target``.

    ``local_logits`` [..., V_pad/T] are this rank's columns starting at global index
    ``vocab_start``; columns at or beyond ``vocab_size`` are padding.
    """
    return _VocabParallelCE.apply(local_logits, target, group, vocab_start, vocab_size, ignore_index)


def causal_lm_loss(local_logits: torch.Tensor, labels: torch.Tensor | None, group: ProcessGroup, *, vocab_start: int,
                   vocab_size: int, ignore_index: int = -100, num_items_in_batch: int | torch.Tensor | None = None,
                   shift_labels: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' causal LM loss (``ForCausalLMLoss``) from vocab-sharded logits.

    Position t predicts label t+1 (labels shifted left, the last position gets
    ``ignore_index``); the mean is over tokens whose label is not ``ignore_index``, or the
    sum divided by ``num_items_in_batch`` when the trainer passes it (gradient accumulation
    over uneven micro-batches), exactly as transformers does. ``shift_labels``, when given, are
    the targets as they are (transformers' rule: context parallelism shifts before it cuts).
    """
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shifted = shift_labels.to(local_logits.device)
    per_token = vocab_parallel_cross_entropy(local_logits, shifted, group, vocab_start=vocab_start,
                                             vocab_size=vocab_size, ignore_index=ignore_index)
    total = per_token.sum()
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch
    return total / (shifted != ignore_index).sum()

"""The loss as the mean over a global batch's label tokens (``loss_normalization: "tokens"``).

A causal LM's loss per micro-batch is a mean over that micro-batch's label tokens. Averaging
those means over gradient accumulation and data-parallel ranks weights a token of a short
micro-batch more than one of a long one, so the same data gives another loss (and gradient)
at another dp, micro-batch or accumulation: the error HF Trainer shipped until late 2024. The
fix is HF's: count the label tokens of the whole optimizer step (every micro-batch of the
window on every dp rank) before its first forward, hand the count to the model as
``num_items_in_batch`` (transformers' causal LM loss then returns the micro-batch's summed
token loss divided by it), and *sum* the micro-batches' gradients instead of averaging them.

The engine keeps its reductions: it does not divide the loss by the accumulation steps and
multiplies it by the data-parallel size before backward, so the dp average of the gradients
becomes their sum (HF Trainer's ``loss *= num_processes`` with ``scale_wrt_gas=False``).
Tensor-, context- and pipeline-parallel ranks of one replica are handed the same
micro-batches, so the count is all-reduced over dp only; the factor and the loss's sum are over
every rank whose gradients are averaged (``dp_cp``, parallel3d/runtime/mesh.py), where a
context-parallel rank's loss covers its slice of the sequence.

Counted as transformers counts: labels shifted left by one (position t predicts label t+1,
``labels[..., 1:]``), or ``shift_labels`` as given, that are not -100.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from parallel3d.engine.batch_check import IGNORE_INDEX


def batch_problem(batch) -> str | None:
    """Why ``batch`` cannot be counted, or None."""
    if not isinstance(batch, dict) or not any(isinstance(batch.get(k), torch.Tensor) for k in ("labels", "shift_labels")):
        return ('loss_normalization "tokens" needs each micro-batch as a dict with a "labels" tensor '
                "(the label tokens of the step are counted before its first forward)")
    if "num_items_in_batch" in batch:
        return ('loss_normalization "tokens": the micro-batch already holds num_items_in_batch; the engine counts '
                'the step\'s label tokens itself (leave it out, or use loss_normalization "micro_batch")')
    return None


def call_problem(call: dict) -> str | None:
    """Why a direct ``engine(...)`` call would give a loss the engine scales wrongly, or None.

    The engine's backward skips the division by the accumulation steps and multiplies by the
    data-parallel size, which is right only for a loss divided by the global batch's label
    tokens; a call with labels but without ``num_items_in_batch`` gets the micro-batch's mean,
    and its gradients would come out (accumulation steps x dp) times too large.
    """
    labelled = any(isinstance(call.get(k), torch.Tensor) for k in ("labels", "shift_labels"))
    if not labelled or call.get("num_items_in_batch") is not None:
        return None
    return ('loss_normalization "tokens": a call with labels needs num_items_in_batch, the label tokens of the whole '
            "optimizer step on every data-parallel rank (parallel3d.engine.token_mean.global_label_tokens(window_batches, "
            "engine.mesh.dp_group, engine.device)); or use engine.train_batch(data_iter), which counts them, or "
            'loss_normalization "micro_batch"')


def model_problem(model: nn.Module) -> str | None:
    """Why ``model``'s loss cannot be the token mean, or None: transformers marks a model class whose
    loss ignores ``num_items_in_batch`` with ``accepts_loss_kwargs = False`` (HF Trainer reads it too).
    ``model`` is the HF model (initialize unwraps a PeftModel first)."""
    if getattr(type(model), "accepts_loss_kwargs", None) is not False:
        return None
    return (f'loss_normalization "tokens": {type(model).__name__} computes its loss without num_items_in_batch '
            "(its class sets accepts_loss_kwargs = False), so its loss would stay a per-micro-batch mean and the "
            'engine would scale its gradients wrongly; use loss_normalization "micro_batch"')


def label_tokens(batch: dict) -> torch.Tensor:
    """The label tokens a causal LM's loss counts in one micro-batch (an int64 scalar)."""
    shifted = batch["shift_labels"] if isinstance(batch.get("shift_labels"), torch.Tensor) else batch["labels"][..., 1:]
    return (shifted != IGNORE_INDEX).sum()


def global_label_tokens(batches: list[dict], group: dist.ProcessGroup | None, device: torch.device,
                        at_least_one: bool = True) -> torch.Tensor:
    """The label tokens of every micro-batch of the step on every rank of ``group`` (one all-reduce).

    At least 1 (unless ``at_least_one`` is False), so a step whose labels are all -100 has a loss
    (and gradient) of 0, not NaN.
    """
    count = torch.stack([label_tokens(b).to(device) for b in batches]).sum()
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(count, group=group)
    return count.clamp_min(1) if at_least_one else count


def with_num_items(batches: list[dict], count: torch.Tensor) -> list[dict]:
    """The micro-batches with ``num_items_in_batch`` added (the same count for all of them)."""
    return [{**b, "num_items_in_batch": count} for b in batches]

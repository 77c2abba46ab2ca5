"""Tensor-parallel styles: how one planned module or parameter is split, and HF's style names.

This module only describes; it imports no parallel code (``models`` sits below ``parallel3d``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["column", "row", "partial_grad", "replicate", "experts"]


class TPPlanError(ValueError):
    """The model's plan asks for something zero3d does not support (message says what)."""


@dataclass(frozen=True)
class LayerPlan:
    """How one module (or, inside an ``experts`` module, one parameter) is split.

    kind: ``column`` (output features split), ``row`` (input features split, output summed),
        ``partial_grad`` (replicated module whose parameter gradients are partial per rank,
        e.g. Qwen3's per-head q_norm/k_norm: summed over tp), ``replicate`` (nothing to do),
        ``experts`` (a mixture-of-experts module holding every expert's weights as stacked
        parameters: each rank keeps a slice of every expert, HF's ``moe_tp_experts``).
    gather_output: column only; all-gather the features after (HF ``colwise_gather_output``).
    split_input: row only; the input is replicated and split locally (``rowwise_split_input``).
    packed: the split dim holds this many equal blocks, each split across ranks (GPT-2's
        q|k|v output, CodeGen's four head groups on its output projection's input).
    """

    kind: Kind
    gather_output: bool = False
    split_input: bool = False
    packed: int = 1


# transformers' style names (transformers/distributed/tensor_parallel.py) -> ours.
HF_STYLES: dict[str, LayerPlan | None] = {
    "colwise": LayerPlan("column"),
    "colwise_rep": LayerPlan("column", gather_output=True),
    "colwise_gather_output": LayerPlan("column", gather_output=True),
    "packed_colwise": LayerPlan("column", packed=2),
    "rowwise": LayerPlan("row"),
    "rowwise_rep": LayerPlan("row", split_input=True),
    "rowwise_split_input": LayerPlan("row", split_input=True),
    "replicated_with_grad_allreduce": LayerPlan("partial_grad"),
    "replicate": LayerPlan("replicate"),
    "local_params": LayerPlan("replicate"),
    "moe_tp_experts": LayerPlan("experts"),
    # handled elsewhere: the input embedding is always vocab-parallel; norms follow the
    # `sequence_parallel` switch of apply_tensor_parallel.
    "embedding_rowwise": None,
    "sequence_parallel": None,
}
UNSUPPORTED_HF_STYLES = ("packed_rowwise", "embedding_colwise", "all_reduce", "mla_kv_a_proj", "moe_identity_expert")


def style(value: str | LayerPlan, key: str, owner: str) -> LayerPlan | None:
    """The LayerPlan of one plan value (an HF style name or a LayerPlan); TPPlanError if unsupported."""
    if isinstance(value, LayerPlan):
        return value
    if value in UNSUPPORTED_HF_STYLES or value not in HF_STYLES:
        raise TPPlanError(f"{owner}: base_model_tp_plan entry {key!r}: {value!r} is not supported by zero3d "
                          f"(supported: {', '.join(HF_STYLES)})")
    return HF_STYLES[value]

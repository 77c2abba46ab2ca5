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
    # MLA's kv_a_proj_with_mqa (DeepSeek V2/V3.2, GLM-4 MoE Lite, LongCat, MiniCPM3): a replicated
    # projection inside the attention region; its output's rope slice bypasses the split kv_b_proj
    # and feeds this rank's heads only, so (as transformers' MlaKvAProjParallel sums that slice's
    # gradient) its weight gradient is partial: summed over tp.
    "mla_kv_a_proj": LayerPlan("partial_grad"),
    # a module holding stacked weights that the plan splits by parameter (Inkling's shared
    # experts: gate/up colwise, down rowwise) whose output is a partial sum: transformers'
    # AllReduceParallel. The same as an experts module: a slice per rank, entered with copy_to_tp,
    # its output all-reduced; experts.py refuses it when it holds a weight the plan does not split.
    "all_reduce": LayerPlan("experts"),
    # handled elsewhere: the input embedding is always vocab-parallel; norms follow the
    # `sequence_parallel` switch of apply_tensor_parallel.
    "embedding_rowwise": None,
    "sequence_parallel": None,
}
UNSUPPORTED_HF_STYLES = ("packed_rowwise", "embedding_colwise", "moe_identity_expert")


def style(value: str | LayerPlan, key: str, owner: str) -> LayerPlan | None:
    """The LayerPlan of one plan value (an HF style name or a LayerPlan); TPPlanError if unsupported."""
    if isinstance(value, LayerPlan):
        return value
    if value in UNSUPPORTED_HF_STYLES or value not in HF_STYLES:
        raise TPPlanError(f"{owner}: base_model_tp_plan entry {key!r}: {value!r} is not supported by zero3d "
                          f"(supported: {', '.join(HF_STYLES)})")
    return HF_STYLES[value]

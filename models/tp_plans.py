"""Tensor-parallel plans: which module of a HF causal LM is column / row parallel.

Most families carry their plan in the config (``config.base_model_tp_plan``, keys relative
to the base model with ``*`` for the layer index, e.g. ``"layers.*.self_attn.q_proj":
"colwise"``): it is read, not retyped, so any such family works without new code. Families
without one (GPT-2) get a plan here. The vocabulary-parallel input embedding and lm head
are not part of a plan: every causal LM has them and ``apply_tensor_parallel`` handles both.

This module only describes; it imports no parallel code (``models`` sits below
``parallel3d``). Problems are ``TPPlanError``; the caller turns them into ``ConfigError``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Literal

from torch import nn

Kind = Literal["column", "row", "partial_grad", "replicate"]


class TPPlanError(ValueError):
    """The model's plan asks for something zero3d does not support (message says what)."""


@dataclass(frozen=True)
class LayerPlan:
    """How one module is split.

    kind: ``column`` (output features split), ``row`` (input features split, output summed),
        ``partial_grad`` (replicated module whose parameter gradients are partial per rank,
        e.g. Qwen3's per-head q_norm/k_norm: summed over tp), ``replicate`` (nothing to do).
    gather_output: column only; all-gather the features after (HF ``colwise_gather_output``).
    split_input: row only; the input is replicated and split locally (``rowwise_split_input``).
    packed: column only; the output holds this many equal blocks, each split across ranks.
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
    # handled elsewhere: the input embedding is always vocab-parallel; norms follow the
    # `sequence_parallel` switch of apply_tensor_parallel.
    "embedding_rowwise": None,
    "sequence_parallel": None,
}
UNSUPPORTED_HF_STYLES = ("packed_rowwise", "embedding_colwise", "all_reduce", "mla_kv_a_proj", "moe_tp_experts",
                         "moe_identity_expert")

# Attention attributes that hold a head count: made per-rank where heads are split
# (parallel3d/tensor_parallel/heads.py: H/T query heads, K/T or one replicated kv head).
HEAD_COUNT_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads")


@dataclass
class ModelTPPlan:
    """A plan resolved against one model instance (concrete module paths from the model root)."""

    layers: dict[str, LayerPlan]
    divide_attrs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    attention_modules: set[str] = field(default_factory=set)  # parents of head-splitting columns
    source: str = ""

    @property
    def heads_sharded(self) -> bool:
        return bool(self.attention_modules)


def base_model_prefix(model: nn.Module) -> str:
    """Path of the base model inside a ``*ForCausalLM`` ("model", "transformer", "gpt_neox")."""
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and isinstance(getattr(model, prefix, None), nn.Module):
        return prefix
    raise TPPlanError(f"{type(model).__name__} has no base model at `base_model_prefix` ({prefix!r})")


def _gpt2_plan(model: nn.Module) -> dict[str, LayerPlan]:
    """GPT-2: Conv1D projections; c_attn packs [q | k | v], each split by heads."""
    if getattr(model.config, "add_cross_attention", False):
        raise TPPlanError("GPT-2 with cross attention (add_cross_attention=True) is not supported under tensor parallelism")
    return {
        "h.*.attn.c_attn": LayerPlan("column", packed=3),
        "h.*.attn.c_proj": LayerPlan("row"),
        "h.*.mlp.c_fc": LayerPlan("column"),
        "h.*.mlp.c_proj": LayerPlan("row"),
    }


# Families whose config has no base_model_tp_plan: model_type -> plan, and the per-rank
# attributes their attention stores (GPT-2 splits its c_attn output with `split_size`).
FAMILY_PLANS: dict[str, Callable[[nn.Module], dict[str, LayerPlan]]] = {"gpt2": _gpt2_plan}
FAMILY_DIVIDE_ATTRS: dict[str, tuple[str, ...]] = {"gpt2": ("split_size", "num_heads", "embed_dim")}


def _hf_plan(model: nn.Module) -> dict[str, LayerPlan] | None:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    raw = getattr(config, "base_model_tp_plan", None)
    if not raw:
        return None
    plan: dict[str, LayerPlan] = {}
    for key, style in raw.items():
        if style in UNSUPPORTED_HF_STYLES or style not in HF_STYLES:
            raise TPPlanError(
                f"{type(model).__name__}: base_model_tp_plan entry {key!r}: {style!r} is not supported by zero3d "
                f"(supported: {', '.join(s for s in HF_STYLES)})")
        if HF_STYLES[style] is not None:
            plan[key] = HF_STYLES[style]
    return plan


def resolve_tp_plan(model: nn.Module) -> ModelTPPlan:
    """The plan for ``model``: from its config's ``base_model_tp_plan`` or a family plan."""
    prefix = base_model_prefix(model)
    model_type = getattr(model.config, "model_type", "")
    plan = _hf_plan(model)
    source = "config.base_model_tp_plan"
    if plan is None:
        if model_type not in FAMILY_PLANS:
            raise TPPlanError(
                f"{type(model).__name__} (model_type {model_type!r}) has no base_model_tp_plan in its config and zero3d "
                f"has no plan for it (own plans: {', '.join(FAMILY_PLANS)})")
        plan, source = FAMILY_PLANS[model_type](model), f"zero3d {model_type} plan"

    base = getattr(model, prefix)
    modules = dict(base.named_modules())
    params = dict(base.named_parameters())
    resolved: dict[str, LayerPlan] = {}
    for key, layer in plan.items():
        pattern = re.compile("^" + re.escape(key).replace(r"\*", r"\d+") + "$")
        hits = [name for name in modules if pattern.match(name)]
        if not hits and any(pattern.match(name) for name in params) and layer.kind in ("column", "row"):
            raise TPPlanError(f"{type(model).__name__}: plan entry {key!r} names parameters (e.g. fused MoE experts); "
                              "zero3d splits nn.Linear / Conv1D modules only")
        for name in hits:
            resolved[f"{prefix}.{name}"] = layer

    result = ModelTPPlan(layers=resolved, source=source)
    extra = FAMILY_DIVIDE_ATTRS.get(model_type, ())
    for name, layer in resolved.items():
        if layer.kind == "column" and not layer.gather_output:
            parent = name.rpartition(".")[0]
            if re.search(r"attn|attention", parent.rpartition(".")[2]):
                result.attention_modules.add(parent)
    for parent in result.attention_modules:
        module = model.get_submodule(parent)
        attrs = tuple(a for a in (*HEAD_COUNT_ATTRS, *extra) if isinstance(getattr(module, a, None), int))
        if attrs:
            result.divide_attrs[parent] = attrs
    return result

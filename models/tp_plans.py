"""Tensor-parallel plans: which module of a HF causal LM is column / row parallel.

Most families carry their plan in the config (``config.base_model_tp_plan``, keys relative
to the base model with ``*`` for the layer index, e.g. ``"layers.*.self_attn.q_proj":
"colwise"``): it is read, not retyped, so any such family works without new code. A family
record (:mod:`models.families`) adds or replaces entries where the config has no plan (GPT-2,
Falcon, OPT, ...) or where its plan is wrong. The vocabulary-parallel input embedding and lm
head are not part of a plan: every causal LM has them and ``apply_tensor_parallel`` handles both.

Entries of HF's ``moe_tp_experts`` style name a module that stores every expert's weights as
stacked parameters; the entries naming those parameters (``experts.gate_up_proj``:
``packed_colwise``, ``experts.down_proj``: ``rowwise``, or ``packed_rowwise`` / ``colwise`` for
the transposed layout) say that they are split; how follows from their role (``experts.py``).

This module only describes; it imports no parallel code (``models`` sits below
``parallel3d``). Problems are ``TPPlanError``; the caller turns them into ``ConfigError``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping

from torch import nn

from models.families import RECORDS, family_record
from models.family import text_config
from models.tp_styles import LayerPlan, TPPlanError, style

__all__ = ["HEAD_COUNT_ATTRS", "LayerPlan", "ModelTPPlan", "TPPlanError", "base_model_prefix", "resolve_tp_plan"]

# Styles HF gives the stacked weights of a moe_tp_experts module (the names follow the tensor's
# dims, which a transposed layout swaps; the split itself follows the weight's role)
EXPERT_WEIGHT_STYLES = ("colwise", "rowwise", "packed_colwise", "packed_rowwise")

# Attention attributes that hold a head count: made per-rank where heads are split
# (parallel3d/tensor_parallel/heads.py: H/T query heads, K/T or one replicated kv head).
HEAD_COUNT_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads")


@dataclass
class ModelTPPlan:
    """A plan resolved against one model instance (concrete paths from the model root).

    ``layers``: planned modules; ``experts``: each ``experts`` module's planned parameters
    (local names); ``regions``: the modules that own a row layer (attention,
    MLP), entered once for all of their column layers, except a repeated block itself (OPT keeps
    fc1 and fc2 in its decoder layer: such a pair's column enters tensor parallelism on its own)
    and a module whose only planned layers split their replicated input themselves;
    ``attention_modules``: parents of head-splitting columns,
    with the attributes (``divide_attrs``) and per-head inputs (``head_inputs``) that become
    per-rank there.
    """

    layers: dict[str, LayerPlan]
    experts: dict[str, set[str]] = field(default_factory=dict)
    regions: set[str] = field(default_factory=set)
    divide_attrs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    attention_modules: set[str] = field(default_factory=set)
    head_inputs: dict[str, Mapping[str, str]] = field(default_factory=dict)
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


def _entries(model: nn.Module, tp_size: int) -> tuple[dict[str, str | LayerPlan], str]:
    """The plan's entries (HF's, with the family record's laid over them) and where they come from."""
    owner = type(model).__name__
    record = family_record(model.config)
    hf = dict(getattr(text_config(model.config), "base_model_tp_plan", None) or {})
    declared = dict(record.tp_entries(model.config, tp_size))
    if not hf and not declared:
        model_type = getattr(model.config, "model_type", "")
        own = sorted(r.name for r in RECORDS if r.tp_plan is not None)
        raise TPPlanError(f"{owner} (model_type {model_type!r}) has no base_model_tp_plan in its config and zero3d "
                          f"declares no plan for its family (declared: {', '.join(own)})")
    plan = {key: value for key, value in {**hf, **declared}.items() if value is not None}
    if not declared:
        return plan, "config.base_model_tp_plan"
    return plan, f"zero3d {record.name} plan" + (" over config.base_model_tp_plan" if hf else "")


def _pattern(key: str) -> re.Pattern:
    return re.compile("^" + re.escape(key).replace(r"\*", r"\d+") + "$")


def resolve_tp_plan(model: nn.Module, tp_size: int) -> ModelTPPlan:
    """The plan for ``model`` at tensor-parallel size ``tp_size``."""
    prefix = base_model_prefix(model)
    owner = type(model).__name__
    entries, source = _entries(model, tp_size)
    base = getattr(model, prefix)
    modules = dict(base.named_modules())
    params = dict(base.named_parameters())
    result = ModelTPPlan(layers={}, source=source)
    param_entries: list[tuple[str, str | LayerPlan, re.Pattern]] = []
    for key, value in entries.items():
        pattern = _pattern(key)
        hits = [name for name in modules if pattern.match(name)]
        if not hits and any(pattern.match(name) for name in params):
            param_entries.append((key, value, pattern))
            continue
        layer = style(value, key, owner) if hits else None  # an entry for modules this config lacks is moot
        for name in hits if layer is not None else ():
            result.layers[f"{prefix}.{name}"] = layer
            if layer.kind == "experts":
                result.experts[f"{prefix}.{name}"] = set()
    for key, value, pattern in param_entries:
        for name in (n for n in params if pattern.match(n)):
            module, _, leaf = f"{prefix}.{name}".rpartition(".")
            if module not in result.experts:
                # a bare parameter of an attention or MLP module (Beam's per-head gate_bias): the
                # split-region analysis (parallel3d/tensor_parallel/regions.py) splits it by heads,
                # sums its gradient or refuses the model, from its shape
                continue
            declared = isinstance(value, LayerPlan) and value.kind in ("column", "row")
            if value not in EXPERT_WEIGHT_STYLES and not declared:
                raise TPPlanError(f"{owner}: plan entry {key!r} gives an expert weight the style {value!r}; "
                                  f"expected one of {', '.join(EXPERT_WEIGHT_STYLES)}")
            result.experts[module].add(leaf)

    record = family_record(model.config)
    blocks = record.block_names(model)
    columns = {name.rpartition(".")[0] for name, layer in result.layers.items() if layer.kind == "column"}
    for name, layer in result.layers.items():
        parent = name.rpartition(".")[0]
        if layer.split_input and parent not in columns:
            # a row layer that splits a replicated input itself (Qwen4-Exp's hyper-connection
            # mixer) gathers that input's gradient itself: its module, which computes on the
            # whole input besides, is no region (a region's entry would sum those gradients)
            continue
        if layer.kind == "row" and type(model.get_submodule(parent)).__name__ not in blocks:
            result.regions.add(parent)
    for name, layer in result.layers.items():
        if layer.kind == "column" and not layer.gather_output:
            parent = name.rpartition(".")[0]
            if re.search(r"attn|attention", parent.rpartition(".")[2]):
                result.attention_modules.add(parent)
    for parent in result.attention_modules:
        module = model.get_submodule(parent)
        attrs = tuple(a for a in (*HEAD_COUNT_ATTRS, *record.tp_size_attrs) if isinstance(getattr(module, a, None), int))
        if attrs:
            result.divide_attrs[parent] = attrs
        if record.tp_head_inputs:
            result.head_inputs[parent] = record.tp_head_inputs
    return result

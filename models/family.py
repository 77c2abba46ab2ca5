"""What Zero3D knows about one model family: a record, generic unless a family declares otherwise.

Everything the parallel engines need about a Hugging Face causal LM is read from the model's
own metadata by default:

* the tensor-parallel plan from ``config.base_model_tp_plan``;
* the pipeline anatomy from ``config.base_model_pp_plan`` (the module that loops over the blocks
  is the base model, ``model.<base_model_prefix>``);
* the repeated block (ZeRO-3's fetch unit, the pipeline's block check) from ``_no_split_modules``.

A :class:`FamilyRecord` (declared in :mod:`models.families`) states only what that metadata
misses or gets wrong for one family: a plan where the config ships none (GPT-2, Falcon, OPT,
...), plan entries that replace HF's (GPT-2's packed q|k|v, a gathered projection where heads
cannot be split), attention attributes and inputs that hold per-head sizes, a pipeline plan
and the module whose ``forward`` runs the blocks. This module imports no parallel code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Union

from models.tp_styles import LayerPlan, TPPlanError

__all__ = ["FamilyRecord", "PlanEntries", "TPPlanError", "text_config"]

# A tensor-parallel plan in HF's format: keys relative to the base model with ``*`` for a layer
# index; values are HF style names (``"colwise"``) or zero3d's LayerPlan; None drops HF's entry.
PlanEntries = Mapping[str, Union[str, LayerPlan, None]]
PPPlan = Mapping[str, tuple[list[str], list[str]]]


def text_config(config: Any) -> Any:
    """The config that describes the language model (the text config of a multimodal one)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


@dataclass(frozen=True)
class FamilyRecord:
    """One family's departures from HF's metadata (all optional; the generic record has none).

    name: the family as users know it, for messages.
    model_types: the ``config.model_type`` values the record applies to.
    tp_plan: plan entries (see :data:`PlanEntries`) laid over ``base_model_tp_plan``; a
        callable ``(config, tp_size) -> entries`` when they depend on the config (it raises
        :class:`TPPlanError` with the reason when the family cannot be split that way).
    tp_check: ``(config, tp_size) -> None``, raising :class:`TPPlanError` with the reason when
        the family's own plan would split something its forward needs whole (Gemma 3n's
        activation sparsity).
    tp_size_attrs: attributes of a head-splitting attention module that hold a width in
        features and become per-rank (divided by T), besides the head counts every family has.
    tp_head_inputs: inputs of a head-splitting attention module laid out per head, which each
        rank narrows to its own heads: name -> ``"batch*heads"`` (dim 0 holds batch x heads,
        BLOOM's ALiBi) or ``"heads"`` (dim 1 holds the heads when its size is the head count).
    pp_plan: ``base_model_pp_plan`` for a family whose config ships none (HF's format,
        relative to ``pp_base``).
    pp_base: path from the base model to the module whose ``forward`` loops over the blocks
        ("" for the base model itself; OPT's is ``decoder``).
    block_classes: the repeated block's class names where ``_no_split_modules`` is wrong.
    """

    name: str
    model_types: tuple[str, ...] = ()
    tp_plan: PlanEntries | Callable[[Any, int], PlanEntries] | None = None
    tp_check: Callable[[Any, int], None] | None = None
    tp_size_attrs: tuple[str, ...] = ()
    tp_head_inputs: Mapping[str, str] = field(default_factory=dict)
    pp_plan: PPPlan | None = None
    pp_base: str = ""
    block_classes: tuple[str, ...] = ()

    def tp_entries(self, config: Any, tp_size: int) -> PlanEntries:
        """The record's plan entries for ``config`` at tensor-parallel size ``tp_size``."""
        if self.tp_check is not None:
            self.tp_check(text_config(config), tp_size)
        if self.tp_plan is None:
            return {}
        return self.tp_plan(text_config(config), tp_size) if callable(self.tp_plan) else self.tp_plan

    def pipeline_plan(self, config: Any) -> PPPlan | None:
        """The pipeline plan: the config's ``base_model_pp_plan``, else the declared one."""
        return getattr(text_config(config), "base_model_pp_plan", None) or self.pp_plan

    def block_names(self, model: Any) -> set[str]:
        """Class names of the model's repeated block."""
        return set(self.block_classes or getattr(model, "_no_split_modules", None) or ())


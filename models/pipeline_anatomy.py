"""Pipeline anatomy of Hugging Face causal LMs, read from the model's own metadata.

A pipeline stage runs a slice of the model outside HF's ``forward``. What it needs:

* **where the parts live**: the config's ``base_model_pp_plan`` (transformers ships it on most
  decoder-only families) lists the base model's top-level modules in order with their
  inputs and outputs; the entry whose module is the block list (input ``hidden_states``,
  output ``hidden_states`` only) splits it into the first stage's modules (embedding, its
  dropout) and the last stage's (final norm). The head is ``model.get_output_embeddings()``.
  Parameter-free modules of the base model outside the plan (the rotary table) are kept by
  every stage. Families without a plan get a declared one in their record (:mod:`models.families`),
  which may also name the module under the base model whose ``forward`` runs the blocks (OPT's
  ``decoder``);
* **how to call them**: the model's own ``forward`` code, cut into pieces
  (:mod:`models.stage_program`), so masks per layer type, rotary tables, embedding scales,
  logit soft-capping and logit scales are computed by HF's code, not by a copy of it.

Refused, with the reason (:class:`AnatomyError`): no plan and no declared one; a base model
with parameters outside the plan (they belong to no stage); blocks whose class is not named
in ``_no_split_modules``; and whatever :mod:`models.stage_program` cannot cut. This module only
describes and adapts; it imports no parallel code. Callers turn the error into ``ConfigError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from models.families import RECORDS, family_record
from models.forward_source import SourceError, check_called_as_written
from models.stage_program import BaseProgram, HeadProgram

__all__ = ["AnatomyError", "AnatomyPaths", "PipelineAnatomy", "anatomy_paths", "causal_lm_class_name",
           "pipeline_anatomy"]


class AnatomyError(ValueError):
    """The model cannot be split: no plan, an unexpected layout, or a forward the pipeline
    cannot reproduce."""


_Plan = Mapping[str, tuple[list[str], list[str]]]


@dataclass(frozen=True)
class AnatomyPaths:
    """Where a pipeline's parts live (the part of :class:`PipelineAnatomy` read from metadata alone)."""

    family: str
    base: str
    first: dict[str, str]
    blocks: str
    last: dict[str, str]
    shared: dict[str, str]

    @property
    def head(self) -> str:
        return self.last["head"]


@dataclass(frozen=True, eq=False)
class PipelineAnatomy(AnatomyPaths):
    """Dotted paths (from the ``*ForCausalLM`` root) of the parts a pipeline splits, and the
    programs that run them.

    ``first`` and ``last`` map plan names to paths (``{"embed_tokens": "model.embed_tokens"}``,
    ``{"norm": "model.norm"}``; ``last`` also holds ``"head"``), ``shared`` the parameter-free
    modules every stage keeps. ``base`` is the base model's path.
    """

    base_program: BaseProgram
    head_program: HeadProgram


def causal_lm_class_name(model_type: str) -> str | None:
    """The class transformers maps ``model_type`` to for causal language modelling."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)


def _describe(model: nn.Module) -> str:
    return f"{type(model).__name__} (model_type={getattr(getattr(model, 'config', None), 'model_type', None)!r})"


def _path_of(model: nn.Module, module: nn.Module) -> str | None:
    return next((name for name, m in model.named_modules() if m is module), None)


def _base_model(model: nn.Module, what: str) -> tuple[str, nn.Module]:
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(base, nn.Module) or head is None:
        wanted = causal_lm_class_name(getattr(model.config, "model_type", ""))
        raise AnatomyError(f"{what} is not a causal LM with a head; pipeline parallelism splits the "
                           f"*ForCausalLM class{f' ({wanted})' if wanted else ''}")
    return prefix, base


def _split_plan(plan: _Plan, base: nn.Module, what: str) -> tuple[list[str], str, list[str]]:
    """(first-stage names, the block list's name, last-stage names) of a plan.

    An entry whose module the model leaves out (``None``: OPT's ``project_in`` when the
    embedding has the hidden size) is dropped."""
    names = [n for n in plan if not (hasattr(base, n) and getattr(base, n) is None)]
    blocks = [n for n in names if isinstance(getattr(base, n, None), nn.ModuleList)]
    if len(blocks) != 1:
        raise AnatomyError(f"{what}: its pipeline plan {names} names {len(blocks)} block lists; expected one")
    name = blocks[0]
    inputs, outputs = plan[name]
    if list(outputs) != ["hidden_states"] or not inputs or inputs[0] != "hidden_states":
        raise AnatomyError(f"{what}: its blocks ({name}) take {list(inputs)} and give {list(outputs)}; the pipeline "
                           "passes only hidden_states between stages")
    for n in names:
        if not isinstance(getattr(base, n, None), nn.Module):
            raise AnatomyError(f"{what}: its pipeline plan names {n!r}, which is not a module of "
                               f"{type(base).__name__}")
    k = names.index(name)
    return names[:k], name, names[k + 1:]


def _check_blocks(allowed: set[str], blocks: nn.ModuleList, what: str) -> None:
    kinds = sorted({type(b).__name__ for b in blocks})
    if allowed and not set(kinds) <= allowed:
        raise AnatomyError(f"{what}: its blocks are {kinds}, not the block classes it names in _no_split_modules "
                           f"({sorted(allowed)})")


def _outside(model: nn.Module, owned: list[str]) -> list[str]:
    return [n for n, _ in model.named_parameters(remove_duplicate=False)
            if not any(n.startswith(p + ".") for p in owned)]


def anatomy_paths(model: nn.Module) -> AnatomyPaths:
    """The module paths of ``model``'s pipeline parts, read from its plan without running anything
    (so also on the meta device); :class:`AnatomyError` if the plan does not fit the model."""
    what = _describe(model)
    config = getattr(model, "config", None)
    family = getattr(config, "model_type", None)
    record = family_record(config)
    plan = record.pipeline_plan(config)
    if not plan:
        declared = sorted(r.name for r in RECORDS if r.pp_plan)
        raise AnatomyError(
            f"pipeline parallelism does not support {what}: its config has no base_model_pp_plan and zero3d declares "
            f"none for its family; supported: every family whose config ships base_model_pp_plan, and "
            f"{', '.join(declared)}")
    prefix, _ = _base_model(model, what)
    base_path = ".".join(p for p in (prefix, record.pp_base) if p)
    base = model.get_submodule(base_path)
    first, blocks_name, last = _split_plan(plan, base, what)
    _check_blocks(record.block_names(model), getattr(base, blocks_name), what)
    head_path = _path_of(model, model.get_output_embeddings())
    paths = {n: f"{base_path}.{n}" for n in (*first, blocks_name, *last)}
    shared = {n: f"{base_path}.{n}" for n, m in base.named_children()
              if n not in paths and m is not None and not any(True for _ in m.parameters())}
    outside = _outside(model, [*paths.values(), head_path])
    if outside:
        raise AnatomyError(f"{what}: parameters {outside[:3]}{' ...' if len(outside) > 3 else ''} lie outside its "
                           "pipeline plan and head, so no stage would hold them")
    return AnatomyPaths(family=family, base=base_path, first={n: paths[n] for n in first}, blocks=paths[blocks_name],
                        last={**{n: paths[n] for n in last}, "head": head_path}, shared=shared)


def pipeline_anatomy(model: nn.Module) -> PipelineAnatomy:
    """The anatomy of ``model`` (a ``*ForCausalLM``); :class:`AnatomyError` if it cannot be split."""
    what = _describe(model)
    parts = anatomy_paths(model)
    config = model.config
    record = family_record(config)
    prefix, _ = _base_model(model, what)
    base = model.get_submodule(parts.base)
    blocks_name = parts.blocks.rpartition(".")[2]
    blocks = getattr(base, blocks_name)
    first = list(parts.first)
    try:
        check_called_as_written(model, "the causal LM")
        check_called_as_written(base, parts.base)
        base_program = BaseProgram(type(base), blocks_name, set(first))
        head_program = HeadProgram(type(model), prefix, record.pp_base, base_program.positional)
        head_program.check(model)
        base_program.check(base, blocks, config.hidden_size, _dtype(base), _device(model))
        _check_logits(model, base, base_program, head_program, config.hidden_size)
    except SourceError as exc:
        raise AnatomyError(f"pipeline parallelism does not support {what}: {exc}") from None
    return PipelineAnatomy(
        family=parts.family, base=parts.base, first=parts.first, blocks=parts.blocks, last=parts.last,
        shared=parts.shared, base_program=base_program, head_program=head_program)


def _check_logits(model: nn.Module, base: nn.Module, base_program: BaseProgram, head_program: HeadProgram,
                  hidden_size: int) -> None:
    """The last stage's logits of a two-token input must have shape (1, 2, vocabulary). Skipped
    for a head tensor parallelism has replaced (its forward may gather over the group, and
    ``parallel3d.tensor_parallel.head_program`` reads that head)."""
    if type(model.get_output_embeddings()).__module__.startswith("parallel3d"):
        return
    x = torch.zeros(1, 2, hidden_size, dtype=_dtype(base), device=_device(model))
    with torch.no_grad():
        ns, _ = base_program.prepare(base, False, x, None, None)
        head_program.check_logits(model, base_program.finish(ns, x))


def _dtype(base: nn.Module) -> torch.dtype:
    return next((p.dtype for p in base.parameters() if p.is_floating_point()), torch.get_default_dtype())


def _device(model: nn.Module) -> torch.device:
    tensor: Any = next(model.buffers(), None)
    if tensor is None:
        tensor = next(model.parameters(), None)
    return tensor.device if tensor is not None else torch.device("cpu")

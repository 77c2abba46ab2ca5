"""Which stored checkpoint keys make which model tensors, the way ``from_pretrained`` decides.

Transformers 5 saves some families in their original hub layout and converts on load
(``transformers/conversion_mapping.py``; the loop is ``convert_and_load_state_dict_in_model``
in ``core_model_loading.py``): a *renaming* changes only a key (GPT-NeoX ``embed_out.weight``
-> ``lm_head.weight``; a base-model prefix added or dropped), a *converter* builds one model
tensor from several stored ones (Mixtral: ``experts.{e}.w1/w3.weight`` stacked and
concatenated into ``experts.gate_up_proj``). This module asks transformers for the model's
transforms and applies its own ``rename_source_key``, so every family it knows is covered
without a table here. A renamed tensor is read by slices like any other; a converted one is
read from its stored parts, converted with transformers' own operations, then sliced: one
converted tensor in flight. Stacked per-expert weights (``ConvertedGroup.stacks_rows``) are read
from the experts whose rows are asked for only (an expert-parallel rank's, a ZeRO shard's);
other converted tensors whole.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class ConvertedGroup:
    """Model tensors that one transformers ``WeightConverter`` makes from stored tensors."""

    converter: object  # transformers.core_model_loading.WeightConverter (a fresh copy per use)
    layer_name: str  # the first target name, as transformers calls convert() with
    sources: list[str]  # stored keys, in transformers' order
    patterns: list[str]  # the converter source pattern each key matched
    model: nn.Module
    targets: list[str] = field(default_factory=list)
    shapes: dict[str, torch.Size] = field(default_factory=dict)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)

    def _convert(self, load) -> dict[str, torch.Tensor]:
        conv = copy.deepcopy(self.converter)
        for key, pattern in zip(self.sources, self.patterns):
            conv.add_tensor(self.layer_name, key, pattern, lambda key=key: load(key))
        out = conv.convert(self.layer_name, model=self.model, config=getattr(self.model, "config", None))
        return {name: (v[0] if isinstance(v, list) else v) for name, v in out.items()}

    def describe(self, stored: Mapping) -> None:
        """Fill targets, shapes and dtypes by converting meta stand-ins (no data read)."""
        out = self._convert(
            lambda key: torch.empty(stored[key].shape, dtype=stored[key].dtype or torch.uint8, device="meta")
        )
        self.targets = list(out)
        self.shapes = {n: t.shape for n, t in out.items()}
        self.dtypes = {n: t.dtype for n, t in out.items()}

    def stacks_rows(self) -> bool:
        """Whether row ``r`` of the targets is made from the ``r``-th stored key of each pattern alone:
        stacked per-expert weights (``MergeModulelist(dim=0)``, then at most a ``Concatenate`` along
        another dim: Mixtral's ``w1``/``w3``, Qwen2-MoE's ``gate_proj``/``up_proj``). Then a range of
        rows (an expert-parallel rank's experts, a ZeRO shard) is converted from those keys only."""
        from transformers.core_model_loading import Concatenate, MergeModulelist

        ops = list(getattr(self.converter, "operations", []))
        if not ops or type(ops[0]) is not MergeModulelist or ops[0].dim != 0:
            return False
        if not all(type(op) is Concatenate and op.dim != 0 for op in ops[1:]):
            return False
        counts = {p: self.patterns.count(p) for p in self.patterns}
        return len(set(counts.values())) == 1 and all(self.shapes[n][0] == next(iter(counts.values()))
                                                      for n in self.targets)

    def materialize(self, stored: Mapping, cast: Mapping[str, torch.dtype],
                    rows: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
        """Read the stored parts, convert, cast: ``{target name: tensor}``. With ``rows`` (only when
        :meth:`stacks_rows`), just those rows of each target, from the stored keys that make them."""
        from safetensors import safe_open

        def load(key: str) -> torch.Tensor:
            st = stored[key]
            with safe_open(st.file, framework="pt") as f:
                return f.get_tensor(key)

        if rows is None:
            out = self._convert(load)
        else:
            out = self._part(rows)._convert(load)
        return {n: (t.to(cast[n]) if n in cast and t.dtype != cast[n] else t) for n, t in out.items()}

    def _part(self, rows: tuple[int, int]) -> ConvertedGroup:
        """This group with the stored keys of rows ``[lo, hi)`` only (the ``r``-th key of each pattern is row ``r``)."""
        lo, hi = rows
        seen: dict[str, int] = {}
        sources, patterns = [], []
        for key, pattern in zip(self.sources, self.patterns):
            index = seen[pattern] = seen.get(pattern, -1) + 1
            if lo <= index < hi:
                sources.append(key)
                patterns.append(pattern)
        return ConvertedGroup(self.converter, self.layer_name, sources, patterns, self.model)


def key_plan(model: nn.Module, stored: Mapping) -> tuple[dict[str, str], list[ConvertedGroup]]:
    """``({stored key: model name}, [converted groups])`` for ``model`` reading ``stored`` keys.

    A model transformers does not know (or an older transformers without conversion mappings)
    gets no renames: stored names are model names.
    """
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
        )
    except ImportError:  # pragma: no cover - depends on the transformers version
        return {}, []
    if not isinstance(model, PreTrainedModel):
        return {}, []
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    model_keys = model.state_dict()
    prefix = model.base_model_prefix
    renames: dict[str, str] = {}
    groups: dict[str, ConvertedGroup] = {}
    for key in sorted(stored, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, model_keys)
        if renamed not in model_keys and key in model_keys:
            renamed, pattern = rename_source_key(key, [], [], base_model_prefix=prefix, meta_state_dict=model_keys)
        if renamed not in model_keys:
            continue  # unexpected: from_pretrained ignores it too
        if pattern is None:
            if renamed != key:
                renames[key] = renamed
            continue
        g = groups.setdefault(renamed, ConvertedGroup(by_pattern[pattern], renamed, [], [], model))
        g.sources.append(key)
        g.patterns.append(pattern)
    for g in groups.values():
        g.describe(stored)
    return renames, list(groups.values())

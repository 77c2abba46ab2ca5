"""Pipeline anatomy of Hugging Face causal LMs: where each part lives and how to call it.

A pipeline stage runs a slice of the model outside HF's own ``forward``, so it needs, per
family: the input embedding(s), the repeated block list, the final norm, the head, the rotary
embedding module (``None`` where positions are learned), and how a block is called. Masks and
positions are rebuilt on every stage from the micro-batch (never sent between stages):

* position ids: ``arange(seq)`` unless the batch brings its own (HF's default without a cache);
* causal mask: ``transformers.masking_utils.create_causal_mask`` with the stage's hidden
  states as ``inputs_embeds`` (shape, dtype and device are all it reads). With sdpa and no
  padding it returns ``None`` (= "use is_causal"), with eager an additive float mask; the
  attention code consumes whichever it gets, so eager and sdpa both stay right. Models with
  ``config.layer_types`` (Qwen2's optional sliding window) get one mask per layer type;
* rotary embeddings: the base model's rotary module, called once per stage forward.

This module only describes and adapts; it imports no parallel code (``models`` sits below
``parallel3d``). Problems are :class:`AnatomyError`; callers turn them into ``ConfigError``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

__all__ = [
    "SUPPORTED_FAMILIES", "AnatomyError", "PipelineAnatomy", "build_masks", "call_block", "default_position_ids",
    "embed", "pipeline_anatomy",
]


class AnatomyError(ValueError):
    """The model cannot be split: an unsupported family or an unexpected layout."""


@dataclass(frozen=True)
class PipelineAnatomy:
    """Dotted paths (from the ``*ForCausalLM`` root) of the parts a pipeline splits.

    ``embeddings`` maps a short role name to a module path (``tokens``; GPT-2 also
    ``positions``), ``embed_dropout`` is applied after the embedding sum (``None`` if the
    family has none), ``rotary`` is ``None`` for learned positions, ``head`` is the output
    projection whose weight may be tied to ``embeddings["tokens"]``.
    """

    family: str
    embeddings: dict[str, str]
    blocks: str
    final_norm: str
    head: str
    rotary: str | None
    embed_dropout: str | None = None

    def module_paths(self) -> dict[str, str | None]:
        return {**{f"embed_{k}": v for k, v in self.embeddings.items()}, "blocks": self.blocks,
                "final_norm": self.final_norm, "head": self.head, "rotary": self.rotary,
                "embed_dropout": self.embed_dropout}


_ANATOMIES: dict[str, PipelineAnatomy] = {
    "llama": PipelineAnatomy("llama", {"tokens": "model.embed_tokens"}, "model.layers", "model.norm", "lm_head",
                             "model.rotary_emb"),
    "qwen2": PipelineAnatomy("qwen2", {"tokens": "model.embed_tokens"}, "model.layers", "model.norm", "lm_head",
                             "model.rotary_emb"),
    "gpt_neox": PipelineAnatomy("gpt_neox", {"tokens": "gpt_neox.embed_in"}, "gpt_neox.layers",
                                "gpt_neox.final_layer_norm", "lm_head", "gpt_neox.rotary_emb",
                                embed_dropout="gpt_neox.emb_dropout"),
    "gpt2": PipelineAnatomy("gpt2", {"tokens": "transformer.wte", "positions": "transformer.wpe"}, "transformer.h",
                            "transformer.ln_f", "lm_head", None, embed_dropout="transformer.drop"),
}
_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gpt_neox": "GPTNeoXForCausalLM",
            "gpt2": "GPT2LMHeadModel"}
SUPPORTED_FAMILIES = tuple(_ANATOMIES)


def pipeline_anatomy(model: nn.Module) -> PipelineAnatomy:
    """The anatomy of ``model`` (a ``*ForCausalLM``); :class:`AnatomyError` if unsupported."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    supported = ", ".join(f"{f} ({c})" for f, c in _CLASSES.items())
    anatomy = _ANATOMIES.get(model_type)
    if anatomy is None:
        raise AnatomyError(f"pipeline parallelism does not support {type(model).__name__} "
                           f"(model_type={model_type!r}); supported families: {supported}")
    if anatomy.family == "gpt_neox" and not hasattr(model, "lm_head") and hasattr(model, "embed_out"):
        anatomy = replace(anatomy, head="embed_out")  # transformers 4.x name
    for role, path in anatomy.module_paths().items():
        if path is None:
            continue
        try:
            model.get_submodule(path)
        except AttributeError:
            raise AnatomyError(f"{type(model).__name__} (model_type={model_type!r}) has no {role} module at "
                               f"{path!r}; pipeline parallelism needs the causal-LM class: {supported}") from None
    if not isinstance(model.get_submodule(anatomy.blocks), nn.ModuleList):
        raise AnatomyError(f"{type(model).__name__}: {anatomy.blocks!r} is not a ModuleList of blocks")
    config = model.config
    if anatomy.family == "gpt2" and getattr(config, "add_cross_attention", False):
        raise AnatomyError("GPT-2 with cross attention (add_cross_attention=True) cannot be pipelined")
    return anatomy


def default_position_ids(batch: int, seq: int, device: torch.device) -> torch.Tensor:
    """HF's default without a cache: ``arange(seq)`` with a batch dimension of 1."""
    return torch.arange(seq, device=device).unsqueeze(0)


def embed(anatomy: PipelineAnatomy, modules: dict[str, nn.Module], input_ids: torch.Tensor,
          position_ids: torch.Tensor) -> torch.Tensor:
    """The hidden states entering the first block (``modules`` maps role names of
    ``anatomy.embeddings`` plus ``embed_dropout`` to the stage's modules)."""
    hidden = modules["tokens"](input_ids)
    if "positions" in modules:  # GPT-2: learned absolute positions
        hidden = hidden + modules["positions"](position_ids).to(hidden.device)
    if modules.get("embed_dropout") is not None:
        hidden = modules["embed_dropout"](hidden)
    return hidden


def build_masks(config: Any, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor) -> dict[str, Any]:
    """Causal masks by layer type, built as the HF base model does (no cache).

    Returns ``{"full_attention": mask}`` plus ``"sliding_attention"`` when the config lists
    sliding layers. A mask may be ``None``: sdpa then runs with ``is_causal``.
    """
    from transformers.masking_utils import create_causal_mask

    if attention_mask is not None and attention_mask.ndim < 4:
        attention_mask = attention_mask.view(hidden.shape[0], -1)
    kwargs = dict(config=config, inputs_embeds=hidden, attention_mask=attention_mask, past_key_values=None,
                  position_ids=position_ids)
    masks = {"full_attention": create_causal_mask(**kwargs)}
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        from transformers.masking_utils import create_sliding_window_causal_mask

        masks["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
    return masks


def layer_type(config: Any, layer_index: int) -> str:
    types = getattr(config, "layer_types", None)
    return types[layer_index] if types else "full_attention"


def call_block(anatomy: PipelineAnatomy, block: nn.Module, hidden: torch.Tensor, mask: Any,
               position_embeddings: Any, position_ids: torch.Tensor) -> torch.Tensor:
    """Run one block as its base model does (no cache); returns the hidden states."""
    if anatomy.family == "gpt2":
        out = block(hidden, None, mask, None, encoder_attention_mask=None, use_cache=False, position_ids=position_ids)
    elif anatomy.family == "gpt_neox":
        out = block(hidden, attention_mask=mask, position_ids=position_ids, layer_past=None, use_cache=False,
                    position_embeddings=position_embeddings)
    else:  # llama, qwen2
        out = block(hidden, attention_mask=mask, position_embeddings=position_embeddings, position_ids=position_ids,
                    past_key_values=None, use_cache=False)
    return out[0] if isinstance(out, tuple) else out

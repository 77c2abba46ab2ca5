"""The forward that replaces a tensor-parallel HF causal LM's ``forward``.

HF's ``*ForCausalLM.forward`` runs the base model, the lm head, optional elementwise logit
transforms and ``ForCausalLMLoss`` on full-vocabulary logits (what it does there is read from its
source by ``head_program``, which refuses what this forward would not reproduce). This one does the same with
the vocab-parallel head and ``causal_lm_loss``, so the full logits exist only when asked
for. It is bound to the model (``types.MethodType``), so a deep copy stays consistent, and
it finds the base model and head through the model's own accessors.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from models.forward_source import SourceError
from models.loss_terms import extra_loss_terms
from models.tp_plans import base_model_prefix
from parallel3d.errors import ConfigError
from parallel3d.tensor_parallel.comm import gather_from_tp
from parallel3d.tensor_parallel.cross_entropy import causal_lm_loss
from parallel3d.tensor_parallel.head_program import head_program


def check_logit_transforms(model: nn.Module) -> None:
    """Refuse a model whose forward does something between its base model and its loss that the
    replacement would not reproduce (``head_program``: fails closed, naming the statement)."""
    head_program(model, base_model_prefix(model)).check(model)


def _gather_tokens(x: Any, batch: int, group: Any) -> Any:
    """A per-token tensor of this rank's part of the sequence (``[batch x part, ...]`` or
    ``[batch, part, ...]``) with every rank's parts in sequence order; whole gradient back."""
    if not isinstance(x, torch.Tensor):
        return x
    whole = gather_from_tp(x.reshape(batch, -1, *x.shape[1 if x.dim() == 2 else 2:]), group, 1)
    return whole.reshape(-1, *whole.shape[2:]) if x.dim() == 2 else whole


def check_extra_loss_terms(model: nn.Module) -> None:
    """Refuse a model whose forward adds loss terms (the router's auxiliary loss) that the
    replacement cannot reproduce for this config (``models.loss_terms``)."""
    try:
        extra_loss_terms(model, base_model_prefix(model)).check(model)
    except SourceError as exc:
        raise ConfigError(f"{exc}; zero3d's tensor-parallel forward computes the token loss on vocabulary "
                          "shards and adds only the terms it can read from the model's forward") from None


def causal_lm_forward(self: nn.Module, input_ids: torch.Tensor | None = None,
                       attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                       past_key_values: Any = None, inputs_embeds: torch.Tensor | None = None,
                       labels: torch.Tensor | None = None, use_cache: bool | None = None,
                       logits_to_keep: int | torch.Tensor = 0, gather_logits: bool | None = None,
                       num_items_in_batch: Any = None, shift_labels: torch.Tensor | None = None,
                       sequence_group: Any = None, **kwargs: Any) -> Any:
    """The replacement ``model.forward`` (bound to the model, so a deep copy stays consistent).

    HF's ``*ForCausalLM.forward`` with the vocab-parallel head and loss: base model ->
    this rank's logits -> ``causal_lm_loss``. ``gather_logits``: True returns the full
    logits (all-gathered, padding removed), False none; by default they are gathered only
    when no labels are given (there would be nothing else to return). ``sequence_group``: the tp
    group under sequence parallelism (bound by ``apply_tensor_parallel``), whose ranks' router
    logits are gathered before the model's own loss terms read them.
    """
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    base, head = getattr(self, base_model_prefix(self)), self.get_output_embeddings()
    kwargs.pop("return_dict", None)
    out = base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
               past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
    hidden = out[0]
    if isinstance(logits_to_keep, int):
        hidden = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
    else:
        hidden = hidden[:, logits_to_keep]
    program = head_program(self, base_model_prefix(self))  # the model's own elementwise maps, on this rank's slice
    local = program.post(self, head(program.pre(self, hidden)))
    loss = None
    if labels is not None or shift_labels is not None:
        loss = causal_lm_loss(local, labels, head.group, vocab_start=head.vocab_start, vocab_size=head.vocab_size,
                              num_items_in_batch=num_items_in_batch, shift_labels=shift_labels)
    terms, aux_loss = extra_loss_terms(self, base_model_prefix(self)), None
    if terms.has_terms:
        if sequence_group is not None and getattr(out, "router_logits", None):
            out.router_logits = tuple(_gather_tokens(x, out[0].shape[0], sequence_group) for x in out.router_logits)
        extra, aux_loss = terms(self, out, torch.zeros((), dtype=torch.float32, device=hidden.device),
                                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache, **kwargs)
        if loss is not None:
            loss = loss + extra  # the model's own `loss += coef * aux_loss`, bit for bit (x + 0.0 == x)
    want = gather_logits if gather_logits is not None else loss is None
    fields = dict(loss=loss, logits=head.gather(local) if want else None,
                  past_key_values=getattr(out, "past_key_values", None), hidden_states=getattr(out, "hidden_states", None),
                  attentions=getattr(out, "attentions", None))
    if terms.aux_name is None:
        return CausalLMOutputWithPast(**fields)
    return MoeCausalLMOutputWithPast(**fields, aux_loss=aux_loss, router_logits=getattr(out, "router_logits", None))


# read by models.forward_source.check_called_as_written: this forward's own reader is head_program
causal_lm_forward.replaces_forward = True

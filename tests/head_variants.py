"""Llama causal LMs whose ``forward`` does something of its own between the base model and the
loss, written as users write them, for the tensor-parallel forward's source check.

Each variant is a subclass made from one template with a few lines of its own; its source is
registered with ``linecache`` so that ``inspect.getsource`` reads it as it reads a file.
"""

from __future__ import annotations

import linecache
import textwrap

import torch
from transformers import LlamaForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

_TEMPLATE = '''
class {name}(LlamaForCausalLM):
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        outputs = self.model(input_ids={input_ids}, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                             **kwargs)
        hidden_states = outputs.last_hidden_state
{head}
        loss = None
        if labels is not None:
{loss}
        return {ret}
'''
_LOSS = "loss = self.loss_function(logits, labels, self.config.vocab_size, **kwargs)"
_RETURN = "CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values)"
_MADE: dict[str, type] = {}


def variant(name: str, head: str, loss: str = _LOSS, input_ids: str = "input_ids", ret: str = _RETURN) -> type:
    """The subclass ``name`` whose forward passes ``input_ids`` to its base model, runs ``head``
    (lines that end with ``logits`` bound), then ``loss`` under ``if labels is not None``, and
    returns ``ret``."""
    if name not in _MADE:
        source = _TEMPLATE.format(name=name, input_ids=input_ids, ret=ret, head=textwrap.indent(textwrap.dedent(head).strip(), " " * 8),
                                  loss=textwrap.indent(loss, " " * 12))
        filename = f"<zero3d-head-variant-{name}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        namespace = {"LlamaForCausalLM": LlamaForCausalLM, "CausalLMOutputWithPast": CausalLMOutputWithPast,
                     "torch": torch, "__name__": __name__}
        exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - the test's own source
        _MADE[name] = namespace[name]
    return _MADE[name]

"""Llama base models whose ``forward`` does something of its own around the block loop, written as
users write them, for the pipeline's stage programs (``models.stage_program``).

Each variant is a subclass of ``LlamaModel`` made from one template with a few lines of its own;
its source is registered with ``linecache`` so that ``inspect.getsource`` reads it as it reads a
file (as ``tests/head_variants.py`` does for causal LMs).
"""

from __future__ import annotations

import functools
import linecache
import textwrap

import torch
from transformers import LlamaModel
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast

_TEMPLATE = '''
class {name}(LlamaModel):
{decorator}    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                use_cache=None, **kwargs):
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if position_ids is None:
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device).unsqueeze(0)
        causal_mask = create_causal_mask(config=self.config, inputs_embeds=inputs_embeds,
                                         attention_mask=attention_mask, cache=None, position_ids=position_ids)
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
{pre}
        for {target} in {blocks}:
            hidden_states = decoder_layer(hidden_states, attention_mask=causal_mask,
                                          position_embeddings=position_embeddings, position_ids=position_ids)
{body}
{post}
        return BaseModelOutputWithPast(last_hidden_state=hidden_states)
'''
_MADE: dict[str, type] = {}


def scaled(factor: float):
    """A user's decorator that changes what ``forward`` returns (``functools.wraps``, as decorators are written)."""
    def wrap(forward):
        @functools.wraps(forward)
        def run(self, *args, **kwargs):
            out = forward(self, *args, **kwargs)
            out.last_hidden_state = out.last_hidden_state * factor
            return out
        return run
    return wrap


def base_variant(name: str, *, body: str = "", pre: str = "", post: str = "hidden_states = self.norm(hidden_states)",
                 target: str = "decoder_layer", blocks: str = "self.layers[: self.config.num_hidden_layers]",
                 decorator: str = "") -> type:
    """The ``LlamaModel`` subclass ``name``: ``pre`` before its loop ``for target in blocks``, ``body``
    after the block call inside it, ``post`` after it; ``decorator`` on its forward."""
    if name not in _MADE:
        source = _TEMPLATE.format(name=name, target=target, blocks=blocks,
                                  decorator=f"    {decorator}\n" if decorator else "",
                                  pre=textwrap.indent(textwrap.dedent(pre).strip(), " " * 8),
                                  body=textwrap.indent(textwrap.dedent(body).strip(), " " * 12),
                                  post=textwrap.indent(textwrap.dedent(post).strip(), " " * 8))
        filename = f"<zero3d-stage-variant-{name}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        namespace = {"LlamaModel": LlamaModel, "BaseModelOutputWithPast": BaseModelOutputWithPast, "torch": torch,
                     "create_causal_mask": create_causal_mask, "scaled": scaled, "__name__": __name__}
        exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - the test's own source
        _MADE[name] = namespace[name]
    return _MADE[name]

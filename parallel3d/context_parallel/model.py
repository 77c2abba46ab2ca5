"""Which models run under context parallelism, and switching one to Ulysses or ring attention.

Fail closed: a model is taken only when everything its attention does is reproduced by the cp
attention: Ulysses runs the model's own kernel (sdpa or eager) on the full sequence with one process's
causal mask; ring runs its own blocked softmax with the causal mask, the layer's sliding window
and softcapping (parallel3d/context_parallel/ring.py). Refused, with the model type and the
reason: attention that does not go through transformers' ``AttentionInterface``, an
encoder-decoder or bidirectional attention, chunked or linear-attention layers (``layer_types``,
``attention_chunk_size``), alibi, attention sinks, a router's load-balancing loss (computed per
rank's slice), a loss that does not take pre-shifted labels; for Ulysses also sliding-window
layers, softcapping and head counts the cp size does not divide (ring has no head limit). What
only shows at run time (a Ulysses sliding window shorter than the sequence, a mask or position
bias added to the scores, layers that bypass the interface, a sliding layer that does not pass
its window to ring) is refused by the attention function and by the counts after each forward.
"""

from __future__ import annotations

import inspect
import itertools
import weakref

import torch.distributed as dist
from torch import nn

from parallel3d.context_parallel.ring import RingAttention
from parallel3d.context_parallel.ulysses import UlyssesAttention
from parallel3d.errors import ConfigError

_KERNELS = ("sdpa", "eager")
_names = itertools.count()


def _text_config(model: nn.Module):
    config = getattr(model, "config", None)
    return config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config


def _local_heads(total: int, tp: int) -> int:
    """Heads one tensor-parallel rank holds (a kv head is replicated when there are fewer than tp)."""
    return total // tp if total >= tp else 1


def windowed_layers(model: nn.Module) -> tuple[tuple[int, ...], int | None]:
    """The indices of the model's attention layers that have a sliding window (each must pass it
    to ring), and the config's window."""
    config = _text_config(model)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention"), window
    return (tuple(range(getattr(config, "num_hidden_layers", 0))) if window is not None else ()), window


def check_model(model: nn.Module, cp: int, tp: int, method: str = "ulysses") -> None:
    """Raise ConfigError if ``model`` cannot run context parallelism over ``cp`` ranks with ``method``."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise ConfigError(f"context_parallel.size {cp} needs a transformers PreTrainedModel (its attention is "
                          f"replaced through transformers' AttentionInterface), got {type(model).__name__}")
    config = _text_config(model)
    kind = getattr(model.config, "model_type", type(model).__name__)

    def refuse(reason: str) -> ConfigError:
        return ConfigError(f"context_parallel ({method}) does not support {kind} ({type(model).__name__}): {reason}")

    implementation = model.config._attn_implementation
    if implementation not in _KERNELS:
        raise refuse(f'its attention implementation is {implementation!r}; load it with attn_implementation "sdpa" '
                     'or "eager"')
    if not type(model)._can_set_attn_implementation():
        raise refuse("its attention does not go through transformers' AttentionInterface")
    if getattr(model.config, "is_encoder_decoder", False) or getattr(config, "use_bidirectional_attention", False):
        raise refuse("it has bidirectional (non-causal) attention")
    if not isinstance(getattr(config, "num_hidden_layers", None), int):
        raise refuse("its config names no num_hidden_layers (the engine checks after each forward that every layer's "
                     "attention went through the cp attention)")
    layer_types = set(getattr(config, "layer_types", None) or ())
    reproduced = {"full_attention", "sliding_attention"} if method == "ring" else {"full_attention"}
    if layer_types - reproduced:
        raise refuse(f"its layer_types include {sorted(layer_types - reproduced)}: only "
                     f"{' and '.join(sorted(reproduced))} layers are reproduced"
                     + ("" if method == "ring" else ' (method "ring" takes sliding-window layers)'))
    refused = [("attention_chunk_size", "chunked attention"), ("alibi", "alibi position biases")]
    if method == "ulysses":
        refused.append(("attn_logit_softcapping", 'attention logit softcapping (method "ring" applies it)'))
    for key, what in refused:
        if getattr(config, key, None):
            raise refuse(what)
    if getattr(config, "position_embedding_type", None) == "alibi":
        raise refuse("alibi position biases")
    if getattr(config, "output_router_logits", False) or getattr(model.config, "output_router_logits", False):
        raise refuse("its router's load-balancing loss (output_router_logits) would be computed over each rank's "
                     "slice of the sequence, not over the whole; set output_router_logits False to train without it")
    if any(name.endswith("sinks") for name, _ in model.named_parameters()):
        raise refuse("attention sinks")
    if "self.loss_function(" not in inspect.getsource(type(model).forward):
        raise refuse("its forward computes the loss itself; the labels must be shifted before the sequence is cut, "
                     "which transformers' loss_function (shift_labels) allows")
    if method == "ring":
        return  # ring attention has no head-count limit: k/v keep their heads, queries broadcast over them
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if not isinstance(heads, int):
        raise refuse("its config names no num_attention_heads")
    problem = ulysses_head_problem(_local_heads(heads, tp), _local_heads(kv_heads, tp), cp)
    if problem is not None:
        raise refuse(f"{problem} (num_attention_heads {heads}, num_key_value_heads {kv_heads}, tensor_parallel.size "
                     f'{tp}); method "ring" has no head limit')


def ulysses_head_problem(heads: int, kv_heads: int, cp: int) -> str | None:
    """Why Ulysses cannot split these (tensor-parallel-local) heads over ``cp`` ranks, or None."""
    if heads % cp:
        return f"{heads} attention heads per tensor-parallel rank do not divide by context_parallel.size {cp}"
    if kv_heads % cp and cp % kv_heads:
        return (f"{kv_heads} key/value heads per tensor-parallel rank neither divide by context_parallel.size {cp} "
                "nor divide it (then each would be repeated cp / kv-heads times)")
    return None


def _unregister(name: str) -> None:
    from transformers import AttentionInterface

    AttentionInterface._global_mapping.pop(name, None)


def install_attention(model: nn.Module, group: dist.ProcessGroup, method: str) -> UlyssesAttention | RingAttention:
    """Register this model's cp attention over the cp ``group`` (``method`` "ulysses" or "ring") with
    transformers and switch the model to it."""
    from transformers import AttentionInterface

    kind = getattr(model.config, "model_type", type(model).__name__)
    attention = (RingAttention(group, kind, model.config._attn_implementation) if method == "ring"
                 else UlyssesAttention(group, model.config._attn_implementation, kind))
    name = f"zero3d_{method}_{next(_names)}"
    AttentionInterface.register(name, attention)
    # transformers' registry is process-wide and the attention holds the cp group: the entry goes
    # with the model (its config names it), so no engine leaves its group behind
    weakref.finalize(model, _unregister, name)
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:
        raise ConfigError(f"context_parallel: {type(model).__name__} did not accept the attention implementation "
                          f"{name!r} (transformers kept {model.config._attn_implementation!r})")
    return attention

"""Token ids checked before they reach the model: one clear error on every layout.

An id outside the vocabulary fails differently per layout: at tp 1 ``nn.Embedding`` raises
torch's bare ``IndexError`` (on a GPU, a device-side assert), while at tp > 1 the
vocabulary-parallel embedding masks ids outside each rank's part, so an id >= the
vocabulary (or a negative one) embeds as zeros and trains silently wrong. Labels outside the
vocabulary are masked the same way by the tensor-parallel cross entropy. An empty
micro-batch raises deep inside the model's reshape.

`batch_problem` finds such a micro-batch with one ``aminmax`` per tensor (a min and a max,
no copy of the batch): ``input_ids`` must lie in ``[0, vocab_size)``; ``labels`` too, or be
``IGNORE_INDEX`` (-100, Hugging Face's "no loss here"). Models without a ``config.vocab_size``
are checked for empty and non-integer ids only.

Packed documents (``position_ids`` that restart inside a row, no ``attention_mask``) are kept
apart by transformers only without a key/value cache: a model whose config has ``use_cache``
makes one in training too, and then builds a plain causal mask, so the documents attend to each
other. `packed_cache_problem` asks for ``use_cache=False`` in such a batch.

A micro-batch given as a tuple or list (``engine(*batch)``: the model's positional arguments)
is read by the names of the model forward's positional parameters (`positional_names`), so
``(input_ids, attention_mask, ..., labels)`` is checked as the dict with those keys is.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

IGNORE_INDEX = -100  # Hugging Face's "no loss here" label; the one definition, imported elsewhere
TOKEN_KEYS = ("input_ids", "labels")


def vocab_size_of(module: nn.Module) -> int | None:
    """The model's vocabulary size from its Hugging Face config (the text part of a multimodal one)."""
    config = getattr(module, "config", None)
    if config is None:
        return None
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    size = getattr(config, "vocab_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def positional_names(module: nn.Module) -> tuple[str, ...]:
    """The names of ``module.forward``'s positional parameters, in order (up to a ``*args``)."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):  # a builtin or C forward: tuple batches go unchecked
        return ()
    names = []
    for param in params:
        if param.kind not in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
            break
        names.append(param.name)
    return tuple(names)


def call_arguments(args: Sequence, kwargs: dict, names: Sequence[str]) -> dict:
    """``forward(*args, **kwargs)``'s arguments by name (positional ones named by ``names``)."""
    return {**dict(zip(names, args)), **kwargs}


def _ranges(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """(min, max) of each tensor, read back in one transfer (one device sync on a GPU, not two a tensor)."""
    if not tensors:
        return []
    device = tensors[0].device
    stacked = torch.stack([torch.stack(torch.aminmax(t.detach())).to(device, torch.int64) for t in tensors]).tolist()
    return [(low, high) for low, high in stacked]


def batch_problem(batch: Any, vocab_size: int | None, names: Sequence[str] = ()) -> str | None:
    """What is wrong with a micro-batch's token ids and labels, or None.

    ``batch`` is a dict of keyword arguments, or a tuple/list of positional ones named by
    ``names`` (`positional_names` of the model); anything else is not checked.
    """
    if isinstance(batch, (tuple, list)):
        where = {name: f"{name} (item {i} of the {type(batch).__name__})" for i, name in enumerate(names)}
        batch = dict(zip(names, batch))
    elif isinstance(batch, dict):
        where = {}
    else:
        return None
    tokens = {key: batch[key] for key in TOKEN_KEYS if isinstance(batch.get(key), torch.Tensor)}
    for key, t in tokens.items():
        label = where.get(key, key)
        if t.numel() == 0:
            return (f"{label} is empty (shape {list(t.shape)}); a micro-batch needs at least one sequence of at least "
                    "one token")
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            return f"{label} has dtype {str(t.dtype).removeprefix('torch.')}; token ids must be integers"
    if vocab_size is None:
        return None
    values = [torch.where(t == IGNORE_INDEX, 0, t) if key == "labels" else t for key, t in tokens.items()]
    for (key, _), (low, high) in zip(tokens.items(), _ranges(values)):
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            allowed = f"[0, {vocab_size})" + (f" or {IGNORE_INDEX} (ignored)" if key == "labels" else "")
            return (f"{where.get(key, key)} holds {bad}, outside the model's vocabulary: token ids must be in "
                    f"{allowed}, where {vocab_size} is the model config's vocab_size (a tokenizer larger than the "
                    "model, or padding with -1?)")
    return None


def packed_cache_problem(batch: Any) -> str | None:
    """Why a dict micro-batch of packed documents would let them attend to each other, or None."""
    if not isinstance(batch, dict) or batch.get("use_cache") is False or batch.get("attention_mask") is not None:
        return None
    positions = batch.get("position_ids")
    if not isinstance(positions, torch.Tensor) or positions.shape[-1] < 2:
        return None
    if not bool((positions[..., 1:] - positions[..., :-1] != 1).any()):
        return None
    return ("position_ids restart inside a row (packed documents) but use_cache is not False: transformers then "
            "builds a key/value cache and a plain causal mask, so the documents attend to each other; pass "
            "use_cache=False with packed micro-batches")


def first_problem(batches: list, vocab_size: int | None, names: Sequence[str] = (),
                  cache_on: bool = False) -> str | None:
    """The first micro-batch's problem in ``batches``, named by its position, or None. ``cache_on``:
    the model makes a key/value cache unless told not to (`packed_cache_problem`)."""
    for index, batch in enumerate(batches):
        problem = batch_problem(batch, vocab_size, names) or (packed_cache_problem(batch) if cache_on else None)
        if problem is not None:
            return f"micro-batch {index}: {problem}" if len(batches) > 1 else problem
    return None

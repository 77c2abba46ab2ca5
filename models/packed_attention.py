"""Whether a model keeps packed documents apart: attention that does not cross them.

Packed training rows hold several documents; each restarts its ``position_ids`` at 0 and the
batch carries no ``attention_mask`` (and ``use_cache=False``). transformers then keeps the
documents apart on its own, in two ways:

* **sdpa, eager, flex_attention**: the mask builders of ``transformers.masking_utils``
  (``create_causal_mask`` and its sliding-window and chunked kin) read the packed documents
  from ``position_ids`` (``find_packed_sequence_indices``) and add a block-diagonal term to the
  causal mask -- provided the model hands them ``position_ids``. Models that build their masks
  without (Bloom, MPT: ALiBi from the 2D mask) let documents see each other.
* **flash_attention_2/3**: the varlen kernel's sequence boundaries come from ``position_ids``
  (``prepare_fa_kwargs_from_position_ids``), but only for a batch of one row
  (``_is_packed_sequence``): with more rows per micro-batch the documents of a row attend to
  each other.

:func:`packing_problem` says which applies to a model, from its attention implementation and
the source of its base model's ``forward`` (every mask builder call must receive
``position_ids``, by keyword or in the ``**mask_kwargs`` dict the Gemma family builds).
"""

from __future__ import annotations

import ast
import inspect
import textwrap

from torch import nn

MASKED = ("sdpa", "eager", "flex_attention")
"""Attention implementations whose mask transformers builds with the packed-document term."""
VARLEN = ("flash_attention_2", "flash_attention_3")
"""Attention implementations that find documents from position_ids in a one-row batch only."""
_BUILDERS = {"create_causal_mask", "create_sliding_window_causal_mask", "create_chunked_causal_mask",
             "create_masks_for_generate"}


def _dict_keys(node: ast.AST) -> set[str]:
    return {k.value for k in node.keys if isinstance(k, ast.Constant)} if isinstance(node, ast.Dict) else set()


def _builder_calls(tree: ast.AST) -> tuple[int, int]:
    """(mask builder calls, those that receive position_ids) in a function's source."""
    dicts: dict[str, set[str]] = {}  # name -> keys of the dict literal bound to it (or to what it copies)
    builders = set(_BUILDERS)  # and names bound to one (Mistral: ``mask_function = create_causal_mask if ...``)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = node.value
            if {n.id for n in ast.walk(value) if isinstance(n, ast.Name)} & _BUILDERS and not isinstance(value, ast.Call):
                builders.add(node.targets[0].id)
            if (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "copy"
                    and isinstance(value.func.value, ast.Name)):
                dicts[node.targets[0].id] = dicts.get(value.func.value.id, set())
            else:
                dicts.setdefault(node.targets[0].id, set()).update(_dict_keys(value))
    calls = given = 0
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
        if name not in builders:
            continue
        calls += 1
        keys = {k.arg for k in node.keywords if k.arg is not None}
        for k in node.keywords:
            if k.arg is None:
                keys |= dicts.get(k.value.id, set()) if isinstance(k.value, ast.Name) else _dict_keys(k.value)
        given += "position_ids" in keys
    return calls, given


def builds_masks_from_position_ids(model: nn.Module) -> bool:
    """Whether the base model's ``forward`` builds every mask with transformers' builders and
    hands each of them ``position_ids`` (and there is at least one)."""
    base = getattr(model, "base_model", model)
    try:
        source = textwrap.dedent(inspect.getsource(type(base).forward))
    except (OSError, TypeError):
        return False
    calls, given = _builder_calls(ast.parse(source))
    return calls > 0 and given == calls


def packing_problem(model: nn.Module, attn_implementation: str | None, rows_per_micro_batch: int) -> str | None:
    """Why packed documents would attend to each other in ``model``, or None when they are kept apart."""
    name = type(model).__name__
    impl = attn_implementation or "the default"
    supported = (f"supported: {', '.join(MASKED)} (masks from position_ids), and {', '.join(VARLEN)} with one row "
                 "per micro-batch (train_micro_batch_size_per_gpu 1)")
    if attn_implementation in VARLEN:
        if rows_per_micro_batch != 1:
            return (f"{impl} keeps packed documents apart only in a micro-batch of one row (transformers reads "
                    f"their boundaries from position_ids only then), and train_micro_batch_size_per_gpu is "
                    f"{rows_per_micro_batch}; set it to 1 (raise gradient_accumulation_steps instead) or use sdpa")
        return None
    if attn_implementation not in MASKED:
        return f'attention implementation "{impl}" is not known to keep packed documents apart; {supported}'
    if getattr(model.config, "alibi", False):
        return (f"{name} adds ALiBi position biases computed from the attention mask, not from position_ids, so "
                "packed documents would see each other")
    if not builds_masks_from_position_ids(model):
        return (f"{name} builds its attention mask without position_ids (not through transformers.masking_utils "
                f"with them), so its {impl} attention would let packed documents see each other")
    return None

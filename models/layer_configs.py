"""A Hugging Face config cut to some of its layers, everything per layer following them.

Configs describe their layers in several ways besides the count: lists with one entry per
layer (``layer_types``, ``mlp_layer_types``, per-layer windows), lists of layer indices
(``mlp_only_layers``, a hybrid model's attention layer ids) and transformers' per-layer
overrides (``per_layer_config``: Gemma 4's wider global heads). Some are derived properties
that refuse to be set (Bamba's ``layers_block_type`` follows ``attn_layer_indices``). Cutting
the count alone leaves the others describing layers that no longer exist; setting a derived
one fails. :func:`layer_entries` gives the stored entries for a choice of layers, and
:func:`with_layers` builds the config anew (``from_dict``) with them, so its own validation and
properties see a consistent whole. Used by the planner (a pipeline chunk's first layers) and by
the coverage script's tiny configs (``models/tiny_config.py``: one layer of each kind).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["LAYER_COUNTS", "is_index_list", "layer_count", "layer_entries", "layers_of_each_kind", "overrides", "stored",
           "with_layers"]

LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "decoder_layers", "n_layers")


def stored(config: Any) -> dict[str, Any]:
    """What the config stores itself (no derived properties, no private state)."""
    return {k: v for k, v in vars(config).items() if not k.startswith("_")}


def overrides(config: Any) -> dict[int, dict[str, Any]]:
    """transformers' per-layer overrides of a heterogeneous config, by layer index."""
    spec = getattr(config, "_heterogeneity_spec", None)
    return {int(k): dict(v) for k, v in (getattr(spec, "per_layer_overrides", None) or {}).items()}


def layer_count(config: Any, keys: Sequence[str] = LAYER_COUNTS) -> tuple[str, int] | None:
    """The stored key that counts the config's layers, and its value."""
    values = stored(config)
    for key in keys:
        value = values.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return key, value
    return None


def is_index_list(value: Any, layers: int) -> bool:
    """A list of some (not all) layer indices."""
    return (isinstance(value, list) and 0 < len(value) < layers
            and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in value))


def layer_entries(config: Any, layers: int, picks: Sequence[int],
                  scale: Callable[[str, Any], Any] | None = None) -> dict[str, Any]:
    """The stored per-layer lists, layer-index lists and per-layer overrides of ``config`` (of
    ``layers`` layers) for the layers ``picks`` (in order); ``scale(name, value)`` maps an
    overridden value (the tiny configs scale sizes)."""
    out: dict[str, Any] = {}
    for name, value in stored(config).items():
        if isinstance(value, list) and len(value) == layers:
            out[name] = [value[j] for j in picks]
        elif is_index_list(value, layers):
            out[name] = [i for i, j in enumerate(picks) if j in value]
    per_layer = overrides(config)
    if per_layer:
        out["per_layer_config"] = {
            i: {a: scale(a, v) if scale else v for a, v in per_layer[j].items()}
            for i, j in enumerate(picks) if j in per_layer}
    return out


def layers_of_each_kind(config: Any, layers: int, count: int) -> list[int]:
    """``count`` (at most ``layers``) of the config's ``layers`` layers, in order: the first of each
    kind, then the second of each, and so on (a layer's kind: its entries in every per-layer list
    and index list, and its overrides), so that a few layers show every kind the model has."""
    if not 0 < count <= layers:
        raise ValueError(f"{count} of {layers} layers")
    values, per_layer_overrides = stored(config), overrides(config)
    per_layer = [v for v in values.values() if isinstance(v, list) and len(v) == layers]
    indexed = [set(v) for v in values.values() if is_index_list(v, layers)]

    def kind(j: int) -> str:
        return repr(([v[j] for v in per_layer], [j in s for s in indexed], sorted(per_layer_overrides.get(j, {}).items())))

    by_kind: dict[str, list[int]] = {}
    for j in range(layers):
        by_kind.setdefault(kind(j), []).append(j)
    picks: list[int] = []
    while len(picks) < count:  # round robin over the kinds, in order of first appearance
        for indices in by_kind.values():
            if indices and len(picks) < count:
                picks.append(indices.pop(0))
    return sorted(picks)


_PRIVATE = ("_attn_implementation_internal", "_experts_implementation_internal", "_name_or_path")


def with_layers(config: Any, count: int) -> Any:
    """A copy of ``config`` with ``count`` layers (``config`` is unchanged): its first ones, past
    its own count by repeating them (a one-layer model profiled at two), or where the config's own
    validation refuses the first ones (a hybrid model that wants an attention layer among them)
    :func:`layers_of_each_kind`. A composite config (text and vision parts) has its text part cut.
    Where the config refuses to be rebuilt with any choice, its count and per-layer lists are set
    on a copy directly (its derived properties are left as they are)."""
    found = layer_count(config)
    derived = getattr(config, "num_hidden_layers", None)
    if found is None and not (isinstance(derived, int) and derived > 0):
        return _with_text_layers(config, count)
    # a count derived from a per-layer list (Nemotron-H's layers_block_type) follows the list
    key, layers = found if found is not None else (None, derived)
    if count <= 0:
        raise ValueError(f"{count} layers of a {type(config).__name__}")
    if count == layers:
        return copy.deepcopy(config)
    text = {k: v for k, v in config.to_dict().items() if k != "per_layer_config"}
    if key is not None:
        text[key] = count

    def build(picks: Sequence[int]) -> Any:
        built = type(config).from_dict({**text, **layer_entries(config, layers, picks)})
        if key is None and built.num_hidden_layers != count:
            raise ValueError(f"{type(config).__name__}: no stored value sets its layer count ({layers})")
        for name in _PRIVATE:
            if name in vars(config):
                setattr(built, name, getattr(config, name))
        return built

    choices = [[j % layers for j in range(count)]]
    if count < layers:
        choices.append(layers_of_each_kind(config, layers, count))
    errors = []
    for picks in choices:
        try:
            return build(picks)
        except Exception as exc:  # noqa: BLE001 - a config's own validation raises what it likes
            errors.append(exc)
    if key is None:
        raise errors[0]
    return _set_directly(config, key, layers, choices[0])


def _set_directly(config: Any, key: str, layers: int, picks: Sequence[int]) -> Any:
    """A copy with the count and the stored per-layer entries set as attributes (no validation)."""
    out = copy.deepcopy(config)
    for name, value in {key: len(picks), **layer_entries(config, layers, picks)}.items():
        if name != "per_layer_config":
            object.__setattr__(out, name, value)
    return out


def _with_text_layers(config: Any, count: int) -> Any:
    """A composite config whose text part (``get_text_config()``) has ``count`` layers."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    names = [n for n in getattr(config, "sub_configs", {}) if getattr(config, n, None) is text]
    if text is config or not names:
        raise ValueError(f"{type(config).__name__} stores its layer count under none of {', '.join(LAYER_COUNTS)}")
    out = copy.deepcopy(config)
    setattr(out, names[0], with_layers(text, count))
    return out

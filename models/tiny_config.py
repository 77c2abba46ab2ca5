"""The tiny config of one causal-LM type, from its default config's own metadata (``scripts/coverage.py``,
and the init replay's self-check: :mod:`models.init_self_check`).

Sizes (``TINY``) replace the default's where the config stores them. Everything the default
ties to those sizes is shrunk with them, read from the config itself rather than from a list
of types:

* **layers**: the default's per-layer lists (any list as long as its layer count:
  ``layer_types``, ``mlp_layer_types``, per-layer windows) and layer-index lists (ints below its
  layer count: ``mlp_only_layers``, hybrid attention layer ids) keep the entries of the layers
  chosen for the tiny model: the first layer of each distinct kind (the kind being a layer's
  entries in every such list and its per-layer overrides), then the second of each, and so on,
  kept in order (two kinds in four layers alternate, so a pipeline stage gets each kind and
  layers shared across a kind, Zamba's, have a partner);
* **per-layer overrides** (transformers' heterogeneous configs, ``per_layer_config``: Gemma 4's
  wider global-attention heads, dots3's per-layer head counts) follow the chosen layers, each
  overridden size scaled as its global size is (512 of 256 becomes 16 of 8);
* **head dimensions**: every ``*head_dim`` the default sets to a positive size is scaled by one
  factor that makes ``head_dim`` (or the smallest) 8 (one that is the sum of two others is left
  to be derived), so q/k/v, latent-attention and per-layer dims keep their relations (dots3:
  head_dim = nope + rope) and stay nonzero; a state-space mixer's head count follows from the
  tiny width (heads x head dim = expand x hidden);
* **tied widths**: other sizes equal to a default hidden width (a vision adapter's input and
  output) become 32, and other vocabularies (hashed byte groups, per-layer inputs) 96;
* **shared counts**: ``n_shared_experts`` is 1 (dots1's default None is not a config
  transformers can run).

Types whose default config is not one transformers can run get a targeted override below, each
with its reason.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from models.layer_configs import LAYER_COUNTS, layer_count, layer_entries, layers_of_each_kind, stored

VOCAB = 96
TINY = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4, num_local_experts=4,
            n_routed_experts=4, num_experts_per_tok=2, n_embd=32, n_layer=4, n_head=4, n_positions=64, n_inner=48,
            ffn_dim=48, ffn_hidden_size=48, rotary_dim=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=8,  # multi-head latent attention: its rotary part is head_dim
            d_model=32, decoder_layers=4, encoder_layers=2, decoder_attention_heads=4, encoder_attention_heads=4,
            decoder_ffn_dim=48, encoder_ffn_dim=48, num_layers=4,  # encoder-decoder names
            n_group=1, topk_group=1,  # grouped expert routing over the tiny expert count
            n_shared_experts=1,
            vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,  # Gemma 3n/4 per-layer embeddings
            num_kv_shared_layers=0,  # Gemma 3n: the shared layers' types must all be among the tiny first ones
            num_encoder_layers=2, num_decoder_layers=4)  # ProphetNet's names
HEAD_DIM = 8


def get(config: Any, key: str, default: Any = None) -> Any:
    """``config.key`` without transformers' refusal to read a per-layer attribute globally; ``default``
    where reading it raises (XLNet's max_position_embeddings: it has no sequence length limit)."""
    raw = getattr(config, "_getattr_without_heterogeneous_validation", None)
    try:
        return raw(key, default) if raw is not None else getattr(config, key, default)
    except (AttributeError, NotImplementedError):
        return default


def _settable(config: Any, key: str) -> bool:
    """Whether ``config`` has ``key`` as a size it stores and lets be set (not a derived property,
    nor one whose setter refuses: ProphetNet's num_hidden_layers, XLNet's max_position_embeddings)."""
    missing = object()
    if get(config, key, missing) is missing:
        return False
    prop = getattr(type(config), key, None)
    if not isinstance(prop, property):
        return True
    try:
        prop.__set__(copy.copy(config), TINY.get(key, 1))
    except Exception:  # noqa: BLE001 - a setter that refuses, whatever it raises
        return False
    return True


def _scaled(value: Any, default: Any, tiny: Any) -> Any:
    """A per-layer override of a size, scaled as its global size was."""
    if all(isinstance(v, int) and not isinstance(v, bool) for v in (value, default, tiny)) and default > 0:
        return max(1, round(value * tiny / default))
    return value


def _layer_sizes(config: Any, sizes: dict[str, Any]) -> dict[str, Any]:
    """Per-layer lists, layer-index lists and per-layer overrides for the tiny layer count."""
    found = layer_count(config, [k for k in LAYER_COUNTS if k in TINY])
    if found is None:
        return {}
    key, layers = found
    count = sizes.get(key, layers)
    if count >= layers:
        return {}
    picks = layers_of_each_kind(config, layers, count)
    return layer_entries(config, layers, picks, lambda name, v: _scaled(v, get(config, name), sizes.get(name)))


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _head_dims(config: Any) -> dict[str, int]:
    """Every ``*head_dim`` the config stores, scaled by one factor: ``head_dim`` (or the smallest) to 8."""
    dims = {k: v for k, v in stored(config).items() if k.endswith("head_dim") and _positive_int(v)}
    sums = {a + b for ka, a in dims.items() for kb, b in dims.items() if ka < kb}
    dims = {k: v for k, v in dims.items() if k == "head_dim" or v not in sums}  # qk_head_dim = nope + rope: derived
    if not dims:
        return {}
    base = dims.get("head_dim") or min(dims.values())
    return {k: max(2, round(v * HEAD_DIM / base)) for k, v in dims.items()}


def _mamba_heads(config: Any, sizes: dict[str, Any]) -> dict[str, int]:
    """A state-space mixer's head count from the tiny width: heads x head dim = expand x hidden."""
    out = {}
    for prefix, heads, dim in (("", "num_heads", "head_dim"), ("mamba_", "mamba_n_heads", "mamba_d_head")):
        expand, head_dim = get(config, f"{prefix}expand"), sizes.get(dim, get(config, dim))
        if _positive_int(expand) and _positive_int(head_dim) and _positive_int(get(config, heads)):
            out[heads] = max(1, TINY["hidden_size"] * expand // head_dim)
    return out


def _tied_widths(config: Any, widths: set[int]) -> dict[str, int]:
    """Stored sizes that equal a default hidden width (``widths``: the config's own, and every
    part's for a part of a multimodal one) become the tiny width: dots3's vision adapter maps the
    vision width to the text width, BLT's local decoder reads its global model's width. Vocabularies (hash or per-layer ones) become the tiny one."""
    out = {}
    for key, value in stored(config).items():
        if not _positive_int(value) or key in TINY or key.endswith("head_dim") or "divisible" in key:
            continue
        if "vocab" in key and value > VOCAB:
            out[key] = VOCAB
        elif value in widths and re.search(r"dim|size", key) and not re.search(r"window|position|length|chunk|patch", key):
            out[key] = TINY["hidden_size"]
    return out


def tiny_sizes(config: Any, widths: set[int] = frozenset()) -> dict[str, Any]:
    """The keyword arguments that make ``config``'s type tiny (module docstring); ``widths``: the
    default hidden widths of the model it is part of."""
    sizes = {k: v for k, v in TINY.items() if _settable(config, k)}
    sizes.update(_tied_widths(config, set(widths) | {get(config, "hidden_size")}))
    sizes.update(_head_dims(config))
    sizes.update(_mamba_heads(config, sizes))
    if _settable(config, "kv_lora_rank") and "num_attention_heads" in sizes:  # latent attention: keys and
        sizes["num_key_value_heads"] = sizes["num_attention_heads"]  # values for every query head
    sizes.update(_layer_sizes(config, sizes))
    sizes.update(_overrides_for(config, sizes))
    return sizes


def _overrides_for(config: Any, sizes: dict[str, Any]) -> dict[str, Any]:
    """Targeted overrides where a default config is not one transformers runs; each says why."""
    out: dict[str, Any] = {}
    if getattr(config, "model_type", "") == "dbrx":
        # DBRX's attention reads attn_config.rope_theta, which its default attention config lacks,
        # and clamps q/k/v to clip_qkv, which it leaves None (its checkpoints' configs carry both)
        out["attn_config"] = {**sizes.get("attn_config", {}), "rope_theta": 10000.0, "clip_qkv": 8.0}
    if getattr(config, "model_type", "") == "zaya":  # its validator: "supports num_experts_per_tok=1 only"
        out["num_experts_per_tok"] = 1
    if getattr(config, "model_type", "") == "lfm2_moe" and get(config, "layer_types") is None:
        # its decoder layers index layer_types, which the default leaves None; LFM2's checkpoints
        # alternate short convolutions and attention
        out["layer_types"] = ["conv", "full_attention"] * (sizes.get("num_hidden_layers", 4) // 2)
    if get(config, "indexer_compress_ratio", 0) is None and get(config, "indexer_n_heads", 0) is None:
        # Qwen4-Exp leaves its sparse-attention indexer's sizes None, which its indexed-attention
        # layers divide ("None // None"); any small consistent sizes run
        out.update(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=HEAD_DIM, indexer_budget=8,
                   indexer_compress_ratio=2)
    rope = get(config, "rope_parameters")
    layer_types = sizes.get("layer_types", get(config, "layer_types"))
    if rope == {} and isinstance(layer_types, list):
        # Cohere Compass: the default's rope_parameters is empty, yet its rotary embedding reads
        # one entry per layer type (KeyError 'full_attention'); its checkpoints carry them.
        out["rope_parameters"] = {t: {"rope_type": "default", "rope_theta": 10000.0} for t in sorted(set(layer_types))}
    return out


def drop_off(config: Any) -> None:
    """Every dropout rate of ``config`` and its text part off."""
    for part in {id(c): c for c in (config, config.get_text_config())}.values():
        for key, value in vars(part).items():
            if isinstance(value, float) and re.search(r"dropout|pdrop|drop_prob|layerdrop|drop_path|jitter", key):
                setattr(part, key, 0.0)


def text_part(config: Any) -> Any:
    try:
        return config.get_text_config()
    except ValueError:  # several text parts (MusicGen): the model is not one causal LM
        return config


def tiny_config(model_type: str) -> Any:
    """The tiny config of ``model_type`` (module docstring), its sub-configs (a multimodal model's
    text and vision parts) made tiny too."""
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(model_type)
    sizes = tiny_sizes(defaults)
    parts = [get(defaults, name) for name in getattr(defaults, "sub_configs", {})]
    widths = {get(part, "hidden_size") for part in (defaults, text_part(defaults), *parts) if part is not None}
    for name in getattr(defaults, "sub_configs", {}):
        part = get(defaults, name)
        if hasattr(part, "to_dict"):
            own = tiny_sizes(part, widths)
            own = {"model_type": part.model_type, **own} if part.model_type else own
            sizes[name] = {**own, **sizes.get(name, {})}
    return AutoConfig.for_model(model_type, **sizes)

"""The declared family records: only what HF's metadata misses or gets wrong (:mod:`models.family`).

Each record says why it exists. Families not listed use the generic record: their config's
``base_model_tp_plan`` and ``base_model_pp_plan`` and their ``_no_split_modules``.

Fused q|k|v projections are split by heads where their output is laid out per head (BLOOM,
Falcon without multi-query, GPT-BigCode without multi-query) or in equal blocks split per
block (GPT-2's [q | k | v], CodeGen's four head groups). Where one fused weight holds the
query heads and a single shared key/value head (multi-query Falcon and GPT-BigCode), a rank
cannot hold "its" heads without keeping part of one weight replicated; those projections are
split and their output gathered instead (HF's ``colwise_gather_output``, as its own Phi-3
plan does for fused projections), so the attention itself runs whole on every tp rank.
"""

from __future__ import annotations

from typing import Any

from models.family import FamilyRecord, PlanEntries, text_config
from models.tp_styles import LayerPlan, TPPlanError

__all__ = ["RECORDS", "family_record"]

_SPLIT_ATTENTION = ("colwise", "rowwise")
_GATHERED_ATTENTION = ("colwise_gather_output", "rowwise_split_input")


def _no_cross_attention(family: str, config: Any) -> None:
    if getattr(config, "add_cross_attention", False):
        raise TPPlanError(f"{family} with cross attention (add_cross_attention=True) is not supported under tensor "
                          "parallelism")


def _gpt2_tp(config: Any, tp: int) -> PlanEntries:
    """Conv1D projections; c_attn packs [q | k | v], each split by heads."""
    _no_cross_attention("GPT-2", config)
    return {"h.*.attn.c_attn": LayerPlan("column", packed=3), "h.*.attn.c_proj": "rowwise",
            "h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise"}


_GPT2_PP = {
    "wte": (["input_ids"], ["inputs_embeds"]),
    "wpe": (["position_ids"], ["position_embeds"]),
    "drop": (["hidden_states"], ["hidden_states"]),
    "h": (["hidden_states", "attention_mask"], ["hidden_states"]),
    "ln_f": (["hidden_states"], ["hidden_states"]),
}
_WTE_H_LNF = {
    "wte": (["input_ids"], ["inputs_embeds"]),
    "drop": (["hidden_states"], ["hidden_states"]),
    "h": (["hidden_states", "attention_mask"], ["hidden_states"]),
    "ln_f": (["hidden_states"], ["hidden_states"]),
}


def _stablelm_tp(config: Any, tp: int) -> PlanEntries:
    """Llama's layout; with ``qk_layernorm`` each head has its own LayerNorm module, held in a list
    the attention zips with its heads, so the heads stay whole (q/k/v gathered)."""
    col, row = _GATHERED_ATTENTION if config.qk_layernorm else _SPLIT_ATTENTION
    return {"layers.*.self_attn.q_proj": col, "layers.*.self_attn.k_proj": col, "layers.*.self_attn.v_proj": col,
            "layers.*.self_attn.o_proj": row, "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise",
            "layers.*.mlp.down_proj": "rowwise"}


def _falcon_tp(config: Any, tp: int) -> PlanEntries:
    """query_key_value is laid out [heads, (q, k, v), head_dim] (classic), [kv groups, (queries of the
    group, k, v), head_dim] (new decoder architecture: split by whole groups when T divides them) or
    [query heads | k | v] (multi-query: gathered, module docstring)."""
    if config.new_decoder_architecture:
        split = config.num_kv_heads % tp == 0
    else:
        split = not config.multi_query
    col, row = _SPLIT_ATTENTION if split else _GATHERED_ATTENTION
    return {"h.*.self_attention.query_key_value": col, "h.*.self_attention.dense": row,
            "h.*.mlp.dense_h_to_4h": "colwise", "h.*.mlp.dense_4h_to_h": "rowwise"}


def _bigcode_tp(config: Any, tp: int) -> PlanEntries:
    """c_attn is [heads, (q, k, v), head_dim] without multi-query, [query heads | k | v] with it (gathered)."""
    _no_cross_attention("GPT-BigCode", config)
    col, row = _GATHERED_ATTENTION if config.multi_query else _SPLIT_ATTENTION
    return {"h.*.attn.c_attn": col, "h.*.attn.c_proj": row, "h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise"}


def _opt_tp(config: Any, tp: int) -> PlanEntries:
    """fc1 and fc2 sit in the decoder layer itself, not in an MLP module."""
    attention = "decoder.layers.*.self_attn."
    return {attention + "q_proj": "colwise", attention + "k_proj": "colwise", attention + "v_proj": "colwise",
            attention + "out_proj": "rowwise", "decoder.layers.*.fc1": "colwise", "decoder.layers.*.fc2": "rowwise"}


def _bloom_tp(config: Any, tp: int) -> PlanEntries:
    """query_key_value is [heads, (q, k, v), head_dim]; ALiBi slopes are per head (``tp_head_inputs``)."""
    if config.pretraining_tp > 1 and config.slow_but_exact:
        raise TPPlanError("BLOOM with slow_but_exact=True slices its projections by pretraining_tp, which tensor "
                          "parallelism does not reproduce")
    return {"h.*.self_attention.query_key_value": "colwise", "h.*.self_attention.dense": "rowwise",
            "h.*.mlp.dense_h_to_4h": "colwise", "h.*.mlp.dense_4h_to_h": "rowwise"}


def _gemma3n_tp_check(config: Any, tp: int) -> None:
    """Gemma 3n's MLP keeps the largest gate activations of each token by the mean and standard
    deviation over all its intermediate features (``_gaussian_topk``), which its plan splits."""
    sparse = [i for i, s in enumerate(getattr(config, "activation_sparsity_pattern", None) or ()) if s > 0]
    if sparse:
        raise TPPlanError(f"Gemma 3n's activation sparsity (activation_sparsity_pattern > 0 in layers {sparse}) "
                          "thresholds each token's gate activations by their mean and standard deviation over all "
                          "intermediate features, which tensor parallelism splits across ranks; set the pattern to 0 "
                          "to train it with tensor parallelism")


def _gptj_tp(config: Any, tp: int) -> PlanEntries:
    return {"h.*.attn.q_proj": "colwise", "h.*.attn.k_proj": "colwise", "h.*.attn.v_proj": "colwise",
            "h.*.attn.out_proj": "rowwise", "h.*.mlp.fc_in": "colwise", "h.*.mlp.fc_out": "rowwise"}


_CODEGEN_GROUPS = 4  # CodeGenAttention.forward: mp_num = 4


def _codegen_tp(config: Any, tp: int) -> PlanEntries:
    """qkv_proj is [4 groups, (q, v, k) of the group's heads]: twelve blocks, each split by heads;
    a rank's heads are then a slice of every group, so out_proj's input is four split blocks.
    transformers >= 5.24 sizes the groups from ``embed_dim`` (a per-rank width, divided by T)."""
    heads = config.num_attention_heads
    if heads % (_CODEGEN_GROUPS * tp):
        raise TPPlanError(f"CodeGen reads its fused q|v|k projection in {_CODEGEN_GROUPS} fixed groups of heads, so "
                          f"num_attention_heads={heads} must be a multiple of {_CODEGEN_GROUPS} x "
                          f"tensor_parallel.size={tp}")
    return {"h.*.attn.qkv_proj": LayerPlan("column", packed=3 * _CODEGEN_GROUPS),
            "h.*.attn.out_proj": LayerPlan("row", packed=_CODEGEN_GROUPS),
            "h.*.mlp.fc_in": "colwise", "h.*.mlp.fc_out": "rowwise"}


RECORDS: tuple[FamilyRecord, ...] = (
    FamilyRecord("GPT-2", ("gpt2",), tp_plan=_gpt2_tp, tp_size_attrs=("split_size", "embed_dim"), pp_plan=_GPT2_PP),
    FamilyRecord("StableLM", ("stablelm",), tp_plan=_stablelm_tp, pp_plan={
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }),
    FamilyRecord("Falcon", ("falcon",), tp_plan=_falcon_tp,
                 tp_head_inputs={"alibi": "heads", "attention_mask": "heads"}, pp_plan={
                     "word_embeddings": (["input_ids"], ["inputs_embeds"]),
                     "h": (["hidden_states", "attention_mask"], ["hidden_states"]),
                     "ln_f": (["hidden_states"], ["hidden_states"]),
                 }),
    FamilyRecord("GPT-BigCode", ("gpt_bigcode",), tp_plan=_bigcode_tp, pp_plan=_GPT2_PP),
    FamilyRecord("OPT", ("opt",), tp_plan=_opt_tp, pp_base="decoder", pp_plan={
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "embed_positions": (["attention_mask", "position_ids"], ["position_embeds"]),
        "project_in": (["inputs_embeds"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "final_layer_norm": (["hidden_states"], ["hidden_states"]),
        "project_out": (["hidden_states"], ["hidden_states"]),
    }),
    FamilyRecord("BLOOM", ("bloom",), tp_plan=_bloom_tp, tp_head_inputs={"alibi": "batch*heads"}, pp_plan={
        "word_embeddings": (["input_ids"], ["inputs_embeds"]),
        "word_embeddings_layernorm": (["inputs_embeds"], ["hidden_states"]),
        "h": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "ln_f": (["hidden_states"], ["hidden_states"]),
    }),
    FamilyRecord("Gemma 3n", ("gemma3n", "gemma3n_text"), tp_check=_gemma3n_tp_check),
    FamilyRecord("GPT-J", ("gptj",), tp_plan=_gptj_tp, pp_plan=_WTE_H_LNF),
    FamilyRecord("CodeGen", ("codegen",), tp_plan=_codegen_tp, tp_size_attrs=("embed_dim",), pp_plan=_WTE_H_LNF),
    # HF's plan names the dense layers' MLP but not the shared expert of the sparse ones
    FamilyRecord("Qwen2-MoE", ("qwen2_moe",), tp_plan={
        "layers.*.mlp.shared_expert.gate_proj": "colwise", "layers.*.mlp.shared_expert.up_proj": "colwise",
        "layers.*.mlp.shared_expert.down_proj": "rowwise"}),
)

_BY_TYPE = {t: r for r in RECORDS for t in r.model_types}


def family_record(config: Any) -> FamilyRecord:
    """The record of ``config``'s family (the generic one for families without a declared record)."""
    model_type = getattr(text_config(config), "model_type", None) or getattr(config, "model_type", "")
    return _BY_TYPE.get(model_type) or FamilyRecord(name=model_type or "model")


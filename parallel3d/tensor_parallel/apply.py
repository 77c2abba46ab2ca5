"""``apply_tensor_parallel``: shard an unmodified HF causal LM across a tp group, in place.

What changes, in this order:

1. Plan (``models.tp_plans``): the config's ``base_model_tp_plan`` with the family record's
   entries over it (``models.families``: a plan for families whose config has none);
   head counts, intermediate sizes and every split dim are checked against T first. When T
   exceeds the kv-head count the kv projections are replicated (``heads.py``), and every
   parameter of a split region that no planned layer owns is summed, split or refused
   (``regions.py``) before anything is changed.
2. Projections become ``ColumnParallelLinear`` / ``RowParallelLinear`` (same names, same
   weight layout, 1/T of the weight). The module that owns a row-parallel layer (attention,
   MLP) is a *region*: one forward pre-hook on it enters tensor parallelism once for all of
   its column layers (``copy_to_tp``: one all-reduce of the input grad per region, not one
   per q/k/v), and the row layer leaves it (all-reduce). A block that owns a row layer itself
   (OPT's fc1/fc2) is no region: its column layers enter on their own. Head-count attributes of
   split attention modules (GPT-2's ``split_size``/``num_heads``/``embed_dim``) become per-rank,
   and inputs laid out per head (BLOOM's ALiBi) are narrowed to the rank's heads. Experts
   modules (``moe_tp_experts``) keep a slice of every expert (``experts.py``).
3. The input embedding becomes vocab-parallel and the lm head column-parallel over the
   vocabulary (padded to a multiple of T); a tied head shares the embedding's parameter.
4. Sequence parallelism (optional): a pre-hook on the first block keeps this rank's
   sequence chunk, regions all-gather the sequence on entry and row layers reduce-scatter
   it on exit, so norms, residuals and dropout between regions run on 1/T of the tokens; a
   hook on the last block all-gathers the sequence again, so the final norm and the head
   (and HF's reshapes to the full input shape) see whole sequences. The split sits at block
   boundaries because HF attention reads the sequence length from its input.
   Per-token block inputs, replicated token mixers and experts are handled in ``sequence.py``
   and ``experts.py``.
5. Replicated parameters whose gradient is a per-rank partial sum get a gradient hook that
   all-reduces (sums) it over tp before it is accumulated into ``.grad``: Qwen3/Gemma3-style
   per-head norms (``replicated_with_grad_allreduce``) and the other parameters
   ``regions.py`` finds (Apertus' activation scalars) always; under sequence parallelism
   also every replicated parameter in a block outside the regions (norms) and every
   row-parallel bias. Afterwards every replicated parameter has the same, whole gradient on
   every tp rank, so ZeRO (or DDP) can treat it as an ordinary replicated parameter. Shards
   held by several ranks (replicated kv heads) are summed over their holders the same way;
   every holder but the first is listed in ``norm_duplicate_params``.
6. ``model.forward`` is replaced: base model -> vocab-parallel head -> the family's
   elementwise logit scaling/softcapping -> vocab-parallel cross entropy (HF's shifted
   causal LM loss); logits are gathered only on request. A forward that transforms its
   logits in any other way is refused (checked from its source) rather than silently wrong.

Dropout runs where the model puts it. Replicated activations draw from the default generator,
the same on every tp rank; inside split regions (and, under sequence parallelism, across the
blocks) each rank draws from its own stream, which recomputation replays (``rng.py``).
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from models.anatomy import text_blocks
from models.tp_plans import ModelTPPlan, TPPlanError, base_model_prefix, resolve_tp_plan
from parallel3d.errors import ConfigError
from parallel3d.tensor_parallel.adapters import check_adapter, shard_adapter
from parallel3d.tensor_parallel.comm import all_reduce_grad_hook, copy_to_tp
from parallel3d.tensor_parallel.forward import causal_lm_forward, check_extra_loss_terms, check_logit_transforms
from parallel3d.tensor_parallel.experts import expert_hooks, expert_specs
from parallel3d.tensor_parallel.heads import (
    HeadLayout, head_input_hook, head_layout, kv_projections, localize_head_counts,
)
from parallel3d.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    _linear_parts,
    is_adapter_layer,
)
from parallel3d.tensor_parallel.regions import LeftBehind, find_left_behind, split_params, split_regions
from parallel3d.tensor_parallel.rng import SplitRegionRNG
from parallel3d.tensor_parallel.sequence import (
    hidden_states_hook, partial_params, sequence_mixers, sequence_parallel_hooks, sequence_segment_hooks, whole_mixers,
)
from parallel3d.tensor_parallel.sharding import ShardSpec


@dataclass
class TensorParallelInfo:
    """What ``apply_tensor_parallel`` did, for ZeRO, checkpoints and the grad norm.

    ``sharded_params``: parameters split across tp (column weights and biases, row weights,
    the vocab-parallel embedding and head); every other parameter is replicated and has the
    same gradient on every tp rank. ``shard_specs`` maps each sharded parameter's name to how
    it is cut from the full tensor (``ShardSpec.unshard`` rebuilds it from all ranks).
    ``partial_grad_params``: replicated parameters whose gradients are summed over tp by a
    hook (see the module docstring); informational, nothing to do for the caller.
    ``norm_duplicate_params``: sharded parameters whose shard a lower tp rank also holds
    (replicated kv heads): the gradient norm must leave them out on this rank.
    ``rng``: the dropout streams of the split regions (``rng.py``), driven by ``hooks``.
    ``head``: the vocabulary-parallel head, None on a pipeline rank that does not hold it.
    """

    group: ProcessGroup
    tp_size: int
    tp_rank: int
    sequence_parallel: bool
    sharded_params: set[nn.Parameter]
    shard_specs: dict[str, ShardSpec]
    partial_grad_params: set[nn.Parameter]
    vocab_size: int
    padded_vocab_size: int
    head: VocabParallelLMHead | None
    plan_source: str
    norm_duplicate_params: set[nn.Parameter] = field(default_factory=set)
    rng: SplitRegionRNG | None = None
    hooks: list[Any] = field(default_factory=list, repr=False)

    def is_sharded(self, param: nn.Parameter) -> bool:
        return param in self.sharded_params

    def keep_held(self, model: nn.Module) -> None:
        """Forget the parameters ``model`` no longer holds (a pipeline split removed them), so that
        this info does not keep their storage alive."""
        held = {id(p) for p in model.parameters()}
        for params in (self.sharded_params, self.partial_grad_params, self.norm_duplicate_params):
            kept = [p for p in params if id(p) in held]
            params.clear()
            params.update(kept)
        if self.head is not None and not any(id(p) in held for p in self.head.parameters()):
            self.head = None


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _check_intermediate(model: nn.Module, world: int) -> None:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    inter = getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None)
    if isinstance(inter, int) and inter % world:
        raise ConfigError(f"tensor_parallel.size={world} must divide intermediate_size={inter} of {type(model).__name__}")


def _check_vocab_adapters(model: nn.Module) -> None:
    """Refuse LoRA adapters on the input embedding or the lm head: the vocabulary-parallel layers
    replace both and would drop them. Refuse peft's trained copies of whole modules
    (``modules_to_save``, ``trainable_token_indices``): tensor parallelism would split or replace
    the module inside the wrapper, not the copy that trains."""
    for name, module in model.named_modules():
        if hasattr(module, "original_module") and hasattr(module, "adapter_state_dict_load_map"):
            raise ConfigError(f"peft's {type(module).__name__} around {name} (modules_to_save or "
                              "trainable_token_indices) under tensor parallelism is not supported: the tensor-parallel "
                              "layers would replace the module it wraps, not the copy that trains; train it with "
                              "tensor_parallel.size 1, or leave it out of modules_to_save")
    for what, module in (("input embedding", model.get_input_embeddings()), ("lm head", model.get_output_embeddings())):
        if isinstance(module, nn.Module) and (is_adapter_layer(module) or hasattr(module, "lora_embedding_A")):
            raise ConfigError(f"LoRA adapters on the {what} ({type(module).__name__}) under tensor parallelism: the "
                              "vocabulary-parallel layer replaces it; leave it out of target_modules or use "
                              "tensor_parallel.size 1")


def _check_embedding(model: nn.Module) -> None:
    """Refuse an input embedding the vocabulary-parallel one would not reproduce: one with
    parameters besides its table (Inkling's norm inside the embedding module)."""
    emb = model.get_input_embeddings()
    extra = [n for n, _ in emb.named_parameters()] if isinstance(emb, nn.Module) else []
    if isinstance(emb, nn.Embedding) and extra != ["weight"]:
        raise ConfigError(f"{type(model).__name__}: its input embedding {type(emb).__name__} holds parameters besides "
                          f"its table ({', '.join(n for n in extra if n != 'weight')}), which the vocabulary-parallel "
                          "embedding would drop")


def _check_head(model: nn.Module) -> None:
    """Refuse an lm head the vocabulary-parallel one would not reproduce: a Linear subclass with
    parameters besides its weight and bias or a forward of its own (Dory's learned per-token
    logit scale)."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        return
    extra = [n for n, _ in head.named_parameters() if n not in ("weight", "bias")]
    if extra or type(head).forward is not nn.Linear.forward:
        what = f"holds parameters besides its weight and bias ({', '.join(extra)})" if extra else "has a forward of its own"
        raise ConfigError(f"{type(model).__name__}: its lm head {type(head).__name__} {what}, which the "
                          "vocabulary-parallel head would not reproduce")


def _check_row_outputs(model: nn.Module, plan: ModelTPPlan) -> None:
    """Refuse a row layer of a head-splitting attention whose output is not the model's width.

    Such an output (Doge's ``dt_proj``: one value per kv head) is summed over tp and then feeds
    per-head computations that would need every head on every rank."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    width = getattr(cfg, "hidden_size", None)
    for name, layer in plan.layers.items():
        if layer.kind != "row" or name.rpartition(".")[0] not in plan.attention_modules or not isinstance(width, int):
            continue
        weight, _, out_dim = _linear_parts(model.get_submodule(name))
        if weight.shape[out_dim] != width:
            raise ConfigError(f"{type(model).__name__}: row-parallel {name} outputs {weight.shape[out_dim]} features, "
                              f"not the hidden size {width}; its summed output feeds per-head computations of the "
                              "attention, which tensor parallelism would need whole on every rank")


def _shard_layers(model: nn.Module, plan: ModelTPPlan, group: ProcessGroup, sp: bool, specs: dict[str, ShardSpec],
                  partial: set[nn.Parameter], regions: set[str], kv_layers: dict[str, int],
                  whole: list[str] = (), hooks: list[Any] | None = None) -> list[RowParallelLinear]:
    """Swap every planned module for its parallel layer; returns the row layers. A LoRA layer
    (``adapters.py``) keeps its place: its base is swapped and its adapters split; ``hooks``
    receives the hooks that adds.

    ``kv_layers``: column layers whose slices are replicated, with their replica count.
    ``whole``: sequence-parallel mixers every rank runs on the whole sequence, whose layers are
    plain tensor-parallel ones.
    """
    world = dist.get_world_size(group)
    rows = []
    hooks = hooks if hooks is not None else []
    for name, layer in plan.layers.items():
        module = model.get_submodule(name)
        if layer.kind == "partial_grad":
            partial.update(p for p in module.parameters(recurse=False) if p.requires_grad)
            continue
        if layer.kind in ("replicate", "experts"):  # experts: their weights are split by expert_specs
            continue
        adapter = module if is_adapter_layer(module) else None
        if adapter is not None:
            check_adapter(name, adapter, sp)
            module = adapter.base_layer
        try:
            _linear_parts(module)
            parent = name.rpartition(".")[0]
            layer_sp = sp and not any(name.startswith(m + ".") for m in whole)  # checked by _check_sequence_layers
            if layer.kind == "column":
                new: nn.Module = ColumnParallelLinear(
                    module, group, input_comm="none" if parent in regions or adapter is not None else "copy",
                    gather_output=layer.gather_output, packed=layer.packed, replicas=kv_layers.get(name, 1))
            else:
                new = RowParallelLinear(module, group, split_input=layer.split_input, packed=layer.packed,
                                        output_comm="reduce_scatter_seq" if layer_sp else "all_reduce")
                rows.append(new)
        except TypeError as exc:
            raise ConfigError(f"tensor parallel plan entry {name}: {exc}") from None
        except ValueError as exc:
            raise ConfigError(f"{type(model).__name__}: {name} cannot be split over tensor_parallel.size={world}: "
                              f"{exc}") from None
        if adapter is None:
            _replace(model, name, new)
            specs.update({f"{name}.{p}": s for p, s in new.specs.items()})
            continue
        adapter.base_layer = new
        specs.update({f"{name}.base_layer.{p}": s for p, s in new.specs.items()})
        adapter_specs, adapter_partial, adapter_hooks = shard_adapter(
            name, adapter, layer, group, replicas=kv_layers.get(name, 1), region_entered=parent in regions)
        specs.update(adapter_specs)
        partial.update(adapter_partial)
        hooks += adapter_hooks
    return rows


def _shard_vocab(model: nn.Module, group: ProcessGroup, specs: dict[str, ShardSpec]) -> VocabParallelLMHead:
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if not isinstance(emb, nn.Embedding) or head is None:
        raise ConfigError(f"{type(model).__name__}: tensor parallelism needs an nn.Embedding input embedding and an "
                          f"lm head (got {type(emb).__name__} and {type(head).__name__})")
    names = {id(m): n for n, m in model.named_modules()}
    emb_name, head_name = names[id(emb)], names[id(head)]
    tied = head.weight is emb.weight
    new_emb = VocabParallelEmbedding(emb, group)
    new_head = VocabParallelLMHead(head, group, tied=new_emb if tied else None)
    _replace(model, emb_name, new_emb)
    _replace(model, head_name, new_head)
    specs[f"{emb_name}.weight"] = new_emb.specs["weight"]
    specs.update({f"{head_name}.{p}": s for p, s in new_head.specs.items()})
    return new_head


@dataclass
class Preparation:
    """What tensor parallelism over ``world`` ranks will do to a model, decided and checked before
    anything changes (``apply_tensor_parallel``)."""

    world: int
    plan: ModelTPPlan
    layout: HeadLayout | None
    kv_layers: dict[str, int]  # replicated kv projections -> their replica count
    left_behind: LeftBehind
    experts: dict[str, ShardSpec]
    # sequence parallelism (sequence.py): the replicated token mixers, and those of them every rank
    # runs whole because they hold tensor-parallel layers
    sequence_mixers: list[str] = field(default_factory=list)
    whole_mixers: list[str] = field(default_factory=list)


def prepare_tensor_parallel(model: nn.Module, world: int, sequence_parallel: bool = False,
                            whole: frozenset[str] = frozenset()) -> Preparation:
    """Plan ``world``-way tensor parallelism of ``model``; ``ConfigError`` naming the reason when it
    cannot be done (every check ``apply_tensor_parallel`` makes, none of its changes). The modules
    named in ``whole`` (experts that expert parallelism keeps whole) are left out of the plan."""
    try:
        plan = resolve_tp_plan(model, world)
        base_model_prefix(model)
    except TPPlanError as exc:
        raise ConfigError(str(exc)) from None
    for name in whole:
        plan.experts.pop(name, None)
        plan.layers.pop(name, None)
    layout = head_layout(model, plan, world)
    _check_intermediate(model, world)
    _check_row_outputs(model, plan)
    _check_vocab_adapters(model)
    _check_embedding(model)
    _check_head(model)
    check_logit_transforms(model)
    check_extra_loss_terms(model)
    kv_layers = dict.fromkeys(kv_projections(model, plan, layout), layout.kv_replicas) if layout else {}
    left_behind = find_left_behind(model, plan, layout, world)
    experts = {n: s for path, planned in sorted(plan.experts.items())
               for n, s in expert_specs(model, path, planned, world).items()}
    mixers = sequence_mixers(model, plan.regions) if sequence_parallel else []
    whole = _check_sequence_layers(plan, mixers) if sequence_parallel else []
    return Preparation(world, plan, layout, kv_layers, left_behind, experts, mixers, whole)


def _check_sequence_layers(plan: ModelTPPlan, mixers: list[str]) -> list[str]:
    """Under sequence parallelism: the mixers every rank runs whole (``sequence.whole_mixers``);
    ConfigError for a column or row layer outside the split regions and those mixers, whose
    input would be a rank's part of the sequence."""
    tp_layers = {n: layer for n, layer in plan.layers.items() if layer.kind in ("column", "row")}
    whole = whole_mixers(mixers, set(tp_layers))
    for name, layer in tp_layers.items():
        if name.rpartition(".")[0] in plan.regions or any(name.startswith(m + ".") for m in whole):
            continue
        if layer.kind == "column":
            raise ConfigError(f"sequence parallelism: column-parallel {name} is not inside a module that ends in a "
                              "row-parallel layer, so its input cannot be gathered at a region entry")
        raise ConfigError(f"sequence parallelism: row-parallel {name} splits a replicated input outside a module "
                          "that tensor parallelism enters, so its sequence is never gathered")
    return whole


def head_input_hooks(model: nn.Module, prep: Preparation, rank: int) -> list[Any]:
    """Pre-hooks narrowing per-head inputs (BLOOM's ALiBi) to ``rank``'s heads."""
    if prep.layout is None:
        return []
    return [model.get_submodule(name).register_forward_pre_hook(
        head_input_hook(model.get_submodule(name), inputs, prep.layout, rank), with_kwargs=True)
        for name, inputs in sorted(prep.plan.head_inputs.items())]


def apply_tensor_parallel(model: nn.Module, tp_group: ProcessGroup, *, sequence_parallel: bool = False,
                          sequence_segments: bool = True, whole: frozenset[str] = frozenset()) -> TensorParallelInfo:
    """Shard ``model`` (an unmodified HF causal LM, same weights on every tp rank) in place.

    With ``sequence_parallel`` the block list is one sequence-parallel run (scattered at its
    first block, gathered after its last); ``sequence_segments=False`` leaves that to the caller
    (:func:`sequence_segment_hooks` per pipeline chunk). Modules named in ``whole`` stay as they are
    (experts that expert parallelism keeps whole: every tp rank runs them on the same tokens, like a
    norm, and their gradients agree across tp).

    Returns a ``TensorParallelInfo``. Afterwards ``model(input_ids=..., labels=...)``
    returns a ``CausalLMOutputWithPast`` whose ``.loss`` equals the single-process loss;
    ``.logits`` are gathered only with ``gather_logits=True`` (or when no labels are given).
    """
    world, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    prep = prepare_tensor_parallel(model, world, sequence_parallel, whole)
    plan, layout, kv_layers, left_behind, experts = prep.plan, prep.layout, prep.kv_layers, prep.left_behind, prep.experts
    regions = plan.regions
    specs: dict[str, ShardSpec] = {}
    partial: set[nn.Parameter] = set()
    whole = prep.whole_mixers
    adapter_hooks: list[Any] = []
    rows = _shard_layers(model, plan, tp_group, sequence_parallel, specs, partial, regions, kv_layers, whole,
                         adapter_hooks)
    split_params(model, {**left_behind.split, **experts}, rank, world)
    specs.update(left_behind.split)
    specs.update(experts)
    _localize_attention(model, plan, layout, world)
    head = _shard_vocab(model, tp_group, specs)

    params = dict(model.named_parameters(remove_duplicate=False))
    sharded = {params[n] for n in specs}
    partial |= {params[n] for n in left_behind.summed if params[n].requires_grad}
    hooks = [model.get_submodule(name).register_forward_pre_hook(
        hidden_states_hook(lambda x: copy_to_tp(x, tp_group)), with_kwargs=True)
        for name in regions if not sequence_parallel]
    hooks += [h for path in sorted(plan.experts) for h in expert_hooks(model.get_submodule(path), tp_group, sequence_parallel)]
    hooks += head_input_hooks(model, prep, rank)
    hooks += adapter_hooks
    rng = SplitRegionRNG(rank)
    if sequence_parallel:
        hooks += sequence_parallel_hooks(model, tp_group, regions, prep.sequence_mixers, whole)
        partial |= partial_params(model, regions, sharded, rows, whole)
        if sequence_segments:
            blocks = text_blocks(model)
            hooks += sequence_segment_hooks(blocks[0], blocks[-1], tp_group, rng)
    hooks += [p.register_hook(all_reduce_grad_hook(tp_group)) for p in partial]
    hooks += _rng_hooks(model, plan, rng)
    replicated = {n: s for n, s in specs.items() if s.replicas > 1 and params[n].requires_grad}
    hooks += [params[n].register_hook(all_reduce_grad_hook(tp_group, *s.pieces(rank, world)))
              for n, s in replicated.items()]

    forward = functools.partial(causal_lm_forward, sequence_group=tp_group) if sequence_parallel else causal_lm_forward
    model.forward = types.MethodType(forward, model)
    return TensorParallelInfo(
        group=tp_group, tp_size=world, tp_rank=rank, sequence_parallel=sequence_parallel, sharded_params=sharded,
        shard_specs=specs, partial_grad_params=partial, vocab_size=head.vocab_size,
        padded_vocab_size=head.padded_vocab_size, head=head, plan_source=plan.source,
        norm_duplicate_params={params[n] for n, s in replicated.items() if not s.is_first_replica(rank)}, rng=rng,
        hooks=hooks)


def _rng_hooks(model: nn.Module, plan: ModelTPPlan, rng: SplitRegionRNG) -> list[Any]:
    """Rank streams from each split region's entry to the start of its row layer (or its own exit)
    (under sequence parallelism also over each sequence-parallel run: ``sequence_segment_hooks``)."""
    spans = []  # (opener, modules whose start closes it, module whose end closes it)
    for region in split_regions(plan):
        rows = [model.get_submodule(n) for n, layer in plan.layers.items()
                if layer.kind == "row" and n.rpartition(".")[0] == region]
        spans.append((model.get_submodule(region), rows, model.get_submodule(region)))
    for parent, (column, rows) in _loose_pairs(plan).items():  # from the column's start to the row's
        spans.append((model.get_submodule(column), [model.get_submodule(r) for r in rows], model.get_submodule(parent)))
    handles = []
    for opener, starts, end in spans:
        handles.append(opener.register_forward_pre_hook(rng.entry_hook(), with_kwargs=True))
        handles += [m.register_forward_pre_hook(rng.exit_hook(opener)) for m in starts]
        handles.append(end.register_forward_hook(rng.exit_hook(opener)))
    return handles


def _loose_pairs(plan: ModelTPPlan) -> dict[str, tuple[str, list[str]]]:
    """Blocks that own row layers themselves (no region): the block -> (its first split column, its rows)."""
    out: dict[str, tuple[str, list[str]]] = {}
    for name, layer in plan.layers.items():
        parent = name.rpartition(".")[0]
        if layer.kind == "column" and not layer.gather_output and parent not in plan.regions and parent not in out:
            rows = [n for n, lp in plan.layers.items() if lp.kind == "row" and n.rpartition(".")[0] == parent]
            if rows:
                out[parent] = (name, rows)
    return out


def _localize_attention(model: nn.Module, plan: ModelTPPlan, layout: HeadLayout | None, world: int) -> None:
    """Per-rank head counts on every attention module whose heads are split."""
    for name in plan.attention_modules:
        localize_head_counts(model.get_submodule(name), plan.divide_attrs.get(name, ()), layout, world)

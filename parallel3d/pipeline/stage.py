"""Split an unmodified Hugging Face causal LM into pipeline stages.

Layout: P pipeline ranks, V model chunks per rank (``virtual_stages``, > 1 only for
``interleaved_1f1b``), S = P * V global stages; chunk c of rank r is global stage ``c * P + r``
(Megatron's layout, the one ``schedule_table`` uses). Global stage 0 owns the embedding(s)
(GPT-2: ``wte`` and ``wpe``) and the modules its plan puts before the blocks, the last global
stage owns the final norm, the head and the loss,
and every stage owns a contiguous run of blocks:

* ``balance="parameters"`` (default): contiguous runs that minimise the largest stage's
  parameter count (stage 0 counts its embeddings, the last stage its norm and head);
* ``balance="layers"``: equal block counts, the first ``n % S`` stages one block more;
* ``partition=[n_0, ..., n_{S-1}]``: explicit block counts by global stage (each >= 1,
  summing to the block count).

Rules (each a :class:`ConfigError`): at least one block per global stage; with V > 1 and no
explicit ``partition`` the block count must be a multiple of P * V (Megatron's rule for
interleaving; every chunk then holds n / (P * V) blocks); a ``partition`` has S positive
entries that sum to the block count; the model must have a pipeline anatomy
(:mod:`models.pipeline_anatomy`: read from ``base_model_pp_plan``, run by the model's own
forward code).

Memory: :func:`split_model` consumes the HF model. The modules of other ranks' stages are
removed from it (set to ``None``), so the rank keeps 1/P of the blocks; the stage modules
share this rank's module objects with the remaining HF shell, so ``model.named_parameters()``
of the shell still lists this rank's parameters under their HF names (also
:meth:`PipelineModel.hf_named_parameters`).

Tied embedding and head (GPT-2, ``tie_word_embeddings=True``): when stage 0 and the last
stage sit on different ranks, each keeps the same tensor as its own parameter (a copy, since
the ranks are different processes). Their gradients are partial and must be summed across the
two ranks every step -- Megatron's embedding group. :func:`sum_tied_grads` does that with one
p2p exchange between pp ranks 0 and P-1 (no extra process group); the executor calls it after
the last backward of a step unless told not to, exchanging only the step's contribution (so
gradients accumulated over several ``run`` calls are not summed twice). The sum is formed in the same order on both
ranks, so the copies get bitwise equal gradients and stay equal under any deterministic
optimizer. On one rank (P = 1) the tie is kept as one parameter and nothing is exchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from models.pipeline_anatomy import AnatomyError, PipelineAnatomy, pipeline_anatomy
from parallel3d.errors import ConfigError
from parallel3d.runtime.fake_backend import receive_buffer

__all__ = [
    "BALANCE_METHODS", "PipelineModel", "PipelineStage", "StageLayout", "TiedParam", "partition_blocks",
    "split_model", "sum_tied_grads", "sync_tied_params", "tied_grad_snapshot",
]

BALANCE_METHODS = ("parameters", "layers")

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class StageLayout:
    """Which blocks each global stage holds. ``sizes[s]`` blocks for global stage s."""

    num_stages: int  # P, pipeline ranks
    virtual_stages: int  # V, chunks per rank
    sizes: tuple[int, ...]  # blocks per global stage, len P * V

    @property
    def total_stages(self) -> int:
        return self.num_stages * self.virtual_stages

    def stage_of(self, rank: int, chunk: int) -> int:
        return chunk * self.num_stages + rank

    def rank_of(self, stage: int) -> int:
        return stage % self.num_stages

    def block_range(self, stage: int) -> range:
        start = sum(self.sizes[:stage])
        return range(start, start + self.sizes[stage])


def partition_blocks(weights: Sequence[float], num_stages: int, first_extra: float = 0.0,
                     last_extra: float = 0.0) -> list[int]:
    """Contiguous block counts (each >= 1) minimising the heaviest stage, then the sum of
    squared stage weights; stage 0 carries ``first_extra``, the last stage ``last_extra``."""
    n, s = len(weights), num_stages
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def cost(stage: int, i: int, j: int) -> float:  # blocks i..j-1 on stage
        return (prefix[j] - prefix[i] + (first_extra if stage == 0 else 0.0)
                + (last_extra if stage == s - 1 else 0.0))

    inf = (float("inf"), float("inf"))
    # best[k][j]: (max, sum of squares) placing blocks 0..j-1 on stages 0..k-1
    best = [[inf] * (n + 1) for _ in range(s + 1)]
    choice = [[0] * (n + 1) for _ in range(s + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, s + 1):
        for j in range(k, n - (s - k) + 1):
            for i in range(k - 1, j):
                if best[k - 1][i] == inf:
                    continue
                c = cost(k - 1, i, j)
                cand = (max(best[k - 1][i][0], c), best[k - 1][i][1] + c * c)
                if cand < best[k][j]:
                    best[k][j], choice[k][j] = cand, i
    sizes, j = [], n
    for k in range(s, 0, -1):
        i = choice[k][j]
        sizes.append(j - i)
        j = i
    return sizes[::-1]


def _numel(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def make_layout(model: nn.Module, anatomy: PipelineAnatomy, num_stages: int, virtual_stages: int = 1,
                partition: Sequence[int] | None = None, balance: str = "parameters") -> StageLayout:
    """Validate the split arguments and decide the blocks of every global stage."""
    for key, value in (("num_stages", num_stages), ("virtual_stages", virtual_stages)):
        if not _is_int(value) or value < 1:
            raise ConfigError(f"pipeline {key} must be an integer >= 1, got {value!r}")
    p, v = num_stages, virtual_stages
    s = p * v
    blocks = model.get_submodule(anatomy.blocks)
    n = len(blocks)
    chunks = f"{p} stages x {v} virtual stages = {s} model chunks" if v > 1 else f"{p} stages"
    if n < s:
        raise ConfigError(
            f"pipeline: {type(model).__name__} has {n} blocks ({anatomy.blocks}) but {chunks} need at least one "
            f"block each; use at most {n} " + ("model chunks (num_stages x virtual_stages)" if v > 1 else "stages"))
    if partition is not None:
        if (not isinstance(partition, (list, tuple)) or not all(_is_int(x) for x in partition)):
            raise ConfigError(f"pipeline.partition must be a list of block counts per stage, got {partition!r}")
        if len(partition) != s:
            raise ConfigError(
                f"pipeline.partition has {len(partition)} entries but the pipeline has {chunks}; give one block "
                "count per global stage" + (" (ordered by global stage c * num_stages + rank)" if v > 1 else ""))
        if any(x < 1 for x in partition):
            raise ConfigError(f"pipeline.partition {list(partition)} has a stage with fewer than 1 block; "
                              "every stage needs at least one block")
        if sum(partition) != n:
            raise ConfigError(f"pipeline.partition {list(partition)} sums to {sum(partition)} blocks but "
                              f"{type(model).__name__} has {n} blocks ({anatomy.blocks})")
        return StageLayout(p, v, tuple(partition))
    if balance not in BALANCE_METHODS:
        raise ConfigError(f"pipeline balance {balance!r} is unknown; allowed: {', '.join(BALANCE_METHODS)} "
                          "(or an explicit pipeline.partition)")
    if v > 1:
        if n % s:
            raise ConfigError(
                f"pipeline: interleaving needs the number of blocks to be a multiple of num_stages x "
                f"virtual_stages (Megatron's rule), got {n} blocks for {chunks}; change virtual_stages or give "
                "an explicit pipeline.partition")
        return StageLayout(p, v, (n // s,) * s)
    if balance == "layers":
        return StageLayout(p, v, tuple(n // s + (1 if i < n % s else 0) for i in range(s)))
    first = sum(_numel(model.get_submodule(path)) for path in anatomy.first.values())
    last = sum(_numel(model.get_submodule(path)) for path in anatomy.last.values())
    return StageLayout(p, v, tuple(partition_blocks([_numel(b) for b in blocks], s, first, last)))


class PipelineStage(nn.Module):
    """One model chunk: global stage ``stage`` of ``total_stages``.

    With ``activation_checkpointing`` each block keeps only its input and recomputes its
    activations in backward (``torch.utils.checkpoint``, non-reentrant).

    ``forward(x, attention_mask=None, position_ids=None, labels=None)``: ``x`` is the
    micro-batch's ``input_ids`` on the first stage, else the hidden states
    ``[micro_batch, seq, hidden]`` from the previous stage. Returns the hidden states, or on
    the last stage the loss (HF's causal-LM loss: mean over the micro-batch's tokens whose
    shifted label is not -100, or their sum divided by ``num_items_in_batch`` when given, as
    transformers does; ``shift_labels``, when given, are the targets as they are, shifted before
    context parallelism cut the sequence) -- the logits when ``labels`` is None.
    """

    def __init__(self, model: nn.Module, anatomy: PipelineAnatomy, layout: StageLayout, stage: int,
                 loss_fn: LossFn | None = None, activation_checkpointing: bool = False) -> None:
        super().__init__()
        self.anatomy = anatomy
        self.activation_checkpointing = activation_checkpointing
        self.config = model.config
        self.stage = stage
        self.total_stages = layout.total_stages
        self.is_first = stage == 0
        self.is_last = stage == layout.total_stages - 1
        blocks = model.get_submodule(anatomy.blocks)
        self.block_indices = list(layout.block_range(stage))
        self.layers = nn.ModuleList(blocks[i] for i in self.block_indices)
        self.hf_prefix: dict[str, str] = {f"layers.{k}": f"{anatomy.blocks}.{i}"
                                          for k, i in enumerate(self.block_indices)}
        # the HF shells the forward code runs on (not registered: they hold other ranks' parts)
        self.__dict__["hf_model"] = model
        self.__dict__["hf_base"] = model.get_submodule(anatomy.base)
        self.embed = self.tail = None
        if self.is_first:
            self.embed = nn.ModuleDict({name: model.get_submodule(path) for name, path in anatomy.first.items()})
            self.hf_prefix.update({f"embed.{name}": path for name, path in anatomy.first.items()})
        # parameter-free modules (the rotary table): every stage computes them for its own blocks
        self.shared = nn.ModuleDict({name: model.get_submodule(path) for name, path in anatomy.shared.items()})
        self.hf_prefix.update({f"shared.{name}": path for name, path in anatomy.shared.items()})
        self.loss_fn: LossFn | None = None
        if self.is_last:
            self.tail = nn.ModuleDict({name: model.get_submodule(path) for name, path in anatomy.last.items()})
            self.hf_prefix.update({f"tail.{name}": path for name, path in anatomy.last.items()})
            if loss_fn is None:
                hf_loss, vocab = model.loss_function, model.config.vocab_size

                def loss_fn(logits: torch.Tensor, labels: torch.Tensor, **kwargs) -> torch.Tensor:
                    return hf_loss(logits=logits, labels=labels, vocab_size=vocab, **kwargs)
            self.loss_fn = loss_fn

    def hf_name(self, local_name: str) -> str:
        """The HF model's name for a parameter/buffer name of this stage module."""
        for prefix in sorted(self.hf_prefix, key=len, reverse=True):
            if local_name == prefix or local_name.startswith(prefix + "."):
                return self.hf_prefix[prefix] + local_name[len(prefix):]
        raise KeyError(local_name)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                num_items_in_batch: torch.Tensor | int | None = None,
                shift_labels: torch.Tensor | None = None) -> torch.Tensor:
        program = self.anatomy.base_program
        ns, hidden = program.prepare(self.hf_base, self.is_first, x, attention_mask, position_ids)
        for index, layer in zip(self.block_indices, self.layers):
            if self.activation_checkpointing and torch.is_grad_enabled():
                hidden = checkpoint(program.block, ns, index, layer, hidden, use_reentrant=False)
            else:
                hidden = program.block(ns, index, layer, hidden)
        if not self.is_last:
            return hidden
        logits = self.anatomy.head_program.logits(self.hf_model, program.finish(ns, hidden))
        if labels is None:
            return logits
        given = {"num_items_in_batch": num_items_in_batch, "shift_labels": shift_labels}
        return self.loss_fn(logits, labels, **{k: v for k, v in given.items() if v is not None})


@dataclass(frozen=True)
class TiedParam:
    """A parameter of this rank whose copy on pp rank ``peer`` must get the same gradient."""

    name: str  # the HF name on this rank (e.g. ``lm_head.weight`` on the last stage)
    names: tuple[str, ...]  # every HF name of the tied tensor, sorted
    param: nn.Parameter
    peer: int  # pp rank holding the other copy
    first: bool  # whether this rank is the lower of the two pp ranks


class PipelineModel(nn.Module):
    """This rank's chunks (``chunks[c]`` is global stage ``c * P + rank``) and their metadata.

    ``parameters()`` are exactly the parameters this rank trains (a tie on one rank counted
    once); :meth:`hf_named_parameters` names them as the HF model does.
    """

    def __init__(self, chunks: list[PipelineStage], layout: StageLayout, rank: int, anatomy: PipelineAnatomy,
                 tied: list[TiedParam]) -> None:
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        self.layout = layout
        self.rank = rank
        self.anatomy = anatomy
        self.tied = tied

    @property
    def num_stages(self) -> int:
        return self.layout.num_stages

    @property
    def virtual_stages(self) -> int:
        return self.layout.virtual_stages

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.layout.num_stages - 1

    def hf_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(HF name, parameter) for this rank's parameters, each once."""
        seen: set[int] = set()
        for chunk in self.chunks:
            for name, p in chunk.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield chunk.hf_name(name), p

    def chunk_parameters(self, chunk: int) -> list[nn.Parameter]:
        return list(self.chunks[chunk].parameters())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError("a pipelined model is not called directly: run a step with "
                          "PipelineExecutor.run(micro_batches) (engine.train_batch)")


def _module_of(model: nn.Module, anatomy: PipelineAnatomy, layout: StageLayout, param_name: str) -> int | None:
    """The global stage holding HF parameter ``param_name`` (None: held by none, e.g. rotary)."""
    blocks = anatomy.blocks + "."
    if param_name.startswith(blocks):
        index = int(param_name[len(blocks):].split(".")[0])
        return next(s for s in range(layout.total_stages) if index in layout.block_range(s))
    for path in anatomy.first.values():
        if param_name.startswith(path + "."):
            return 0
    for path in anatomy.last.values():
        if param_name.startswith(path + "."):
            return layout.total_stages - 1
    return None


def split_model(model: nn.Module, num_stages: int, rank: int, *, virtual_stages: int = 1,
                partition: Sequence[int] | None = None, balance: str = "parameters",
                loss_fn: LossFn | None = None, activation_checkpointing: bool = False) -> PipelineModel:
    """Split ``model`` (an HF ``*ForCausalLM``) and keep pp rank ``rank``'s chunks.

    The model is consumed: modules of other ranks are removed from it. ``loss_fn(logits,
    labels)`` replaces HF's causal-LM loss on the last stage (e.g. a vocab-parallel loss);
    ``activation_checkpointing`` recomputes each block in backward.
    """
    try:
        anatomy = pipeline_anatomy(model)
    except AnatomyError as exc:
        raise ConfigError(str(exc)) from None
    layout = make_layout(model, anatomy, num_stages, virtual_stages, partition, balance)
    if not _is_int(rank) or not 0 <= rank < num_stages:
        raise ConfigError(f"pipeline rank must be in [0, {num_stages}), got {rank!r}")
    p, v = num_stages, virtual_stages

    # ties that cross ranks: every HF name of each tensor, the ranks holding it
    names_of: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
        params[id(param)] = param
    tied: list[TiedParam] = []
    for pid, names in names_of.items():
        holders: dict[int, str] = {}
        for name in sorted(names):
            stage = _module_of(model, anatomy, layout, name)
            if stage is not None:
                holders.setdefault(layout.rank_of(stage), name)
        if len(holders) > 2:
            raise ConfigError(f"pipeline: parameter {sorted(names)} is shared by more than two pipeline ranks "
                              f"({sorted(holders)}); only an embedding tied to the head is supported")
        if len(holders) == 2 and rank in holders:
            peer = next(r for r in holders if r != rank)
            tied.append(TiedParam(holders[rank], tuple(sorted(names)), params[pid], peer, rank < peer))
    tied.sort(key=lambda t: t.names)

    chunks = [PipelineStage(model, anatomy, layout, layout.stage_of(rank, c), loss_fn, activation_checkpointing)
              for c in range(v)]

    # free what other ranks hold: blocks, embeddings, final norm, head
    mine = {layout.stage_of(rank, c) for c in range(v)}
    blocks = model.get_submodule(anatomy.blocks)
    for stage in range(layout.total_stages):
        if stage not in mine:
            for i in layout.block_range(stage):
                blocks[i] = None
    drop = [] if 0 in mine else list(anatomy.first.values())
    if layout.total_stages - 1 not in mine:
        drop += list(anatomy.last.values())
    for path in drop:
        parent, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, None)
    return PipelineModel(chunks, layout, rank, anatomy, tied)


def _p2p_exchange(tensors: list[torch.Tensor], peer: int, group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Send ``tensors`` to pp rank ``peer`` and receive its tensors of the same shapes."""
    dst = dist.get_global_rank(group, peer)
    out = [receive_buffer(t.shape, t.dtype, t.device, group) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), dst, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, o, dst, group) for o in out]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return out


def tied_grad_snapshot(pipe: PipelineModel) -> list[torch.Tensor | None]:
    """Copies of the tied gradients before a step, for :func:`sum_tied_grads`'s ``base``."""
    return [None if t.param.grad is None else t.param.grad.detach().clone() for t in pipe.tied]


def sum_tied_grads(pipe: PipelineModel, group: dist.ProcessGroup,
                   grads: Sequence[torch.Tensor] | None = None,
                   base: Sequence[torch.Tensor | None] | None = None) -> None:
    """Sum the gradients of tied copies across their two pp ranks (Megatron's embedding group).

    Call on every pp rank after the last backward of the step, before the gradients are
    reduced over dp or clipped. Works in place on ``param.grad`` (a missing grad counts as
    zero) or on ``grads`` given in the order of ``pipe.tied`` (e.g. views into a flat buffer).
    Without ``base`` the whole gradient is this step's and is summed. With ``base`` (the
    values before the step, from :func:`tied_grad_snapshot`, equal on both ranks) only this
    step's contributions are exchanged: ``grad = base + (delta_lower + delta_upper)``, so
    gradients accumulated over several steps are not counted twice. Both ranks form the sum
    in the same order and end bitwise equal. A no-op on ranks without ties.
    """
    if not pipe.tied:
        return
    if grads is None:
        for t in pipe.tied:
            if t.param.grad is None:
                t.param.grad = torch.zeros_like(t.param)
        grads = [t.param.grad for t in pipe.tied]
    base = list(base) if base is not None else [None] * len(pipe.tied)
    deltas = [g if b is None else g - b for g, b in zip(grads, base)]
    by_peer: dict[int, list[int]] = {}
    for i, t in enumerate(pipe.tied):
        by_peer.setdefault(t.peer, []).append(i)
    for peer, idx in sorted(by_peer.items()):
        theirs = _p2p_exchange([deltas[i] for i in idx], peer, group)
        for i, other in zip(idx, theirs):
            mine = deltas[i]
            # same operand order on both ranks: the lower pp rank's contribution first
            total = mine + other if pipe.tied[i].first else other + mine
            if base[i] is not None:
                total = base[i] + total
            grads[i].copy_(total)


def sync_tied_params(pipe: PipelineModel, group: dist.ProcessGroup) -> None:
    """Copy the tied tensors from the lower pp rank to the higher one (e.g. after loading
    weights that differ); call on every pp rank."""
    if not pipe.tied:
        return
    by_peer: dict[int, list[TiedParam]] = {}
    for t in pipe.tied:
        by_peer.setdefault(t.peer, []).append(t)
    for peer, ties in sorted(by_peer.items()):
        with torch.no_grad():
            theirs = _p2p_exchange([t.param.detach() for t in ties], peer, group)
            for t, other in zip(ties, theirs):
                if not t.first:
                    t.param.copy_(other)

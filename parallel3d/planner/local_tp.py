"""A model as one tensor-parallel rank holds it, built without a process group.

The planner needs two things from tensor parallelism before any process exists: the shape of
every parameter a rank keeps (for ZeRO's accounting) and the tensors a rank's forward and
backward create (for activations, FLOPs and the collectives' volumes). ``localize`` changes a
model in place (meta or fake tensors) so that running it on one process creates exactly the
shapes tp rank 0 creates: the same plan (``models.tp_plans``), head layout and kv replication
(``tensor_parallel.heads``), left-behind parameters (``tensor_parallel.regions``), per-head
inputs and shard specs (``tensor_parallel.sharding.make_spec``) as ``apply_tensor_parallel``,
decided and checked by the same ``prepare_tensor_parallel`` (so the planner refuses exactly
the models ``initialize`` refuses). Every collective becomes
a local op of the same output shape that records its payload in a :class:`CommLog`: an
all-reduce becomes a copy (as ``_all_reduce`` copies), an all-gather a concatenation, a
reduce-scatter a contiguous slice.

Differences from the real ranks, all small next to a layer's activations: the loss is
transformers' cross entropy on this rank's vocabulary slice (the vocab-parallel one keeps the
same fp32 softmax-sized tensor, plus three [batch, seq] tensors); dropout streams are not
switched.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from models.anatomy import text_blocks
from parallel3d.tensor_parallel.apply import head_input_hooks, prepare_tensor_parallel
from parallel3d.tensor_parallel.experts import check_token_input, token_inputs_hook
from parallel3d.tensor_parallel.sequence import first_output_hook, hidden_states_hook, token_input_hook
from parallel3d.tensor_parallel.heads import localize_head_counts
from parallel3d.tensor_parallel.layers import _linear_parts, _matmul
from parallel3d.tensor_parallel.regions import split_params
from parallel3d.tensor_parallel.sharding import ShardSpec, make_spec

logger = logging.getLogger(__name__)


@dataclass
class CommLog:
    """Collectives a local run would have issued: (op, payload bytes, in backward?) per call.

    Payload as ``comm_counter`` counts it: an all-reduce's tensor, a reduce-scatter's input and
    an all-gather's output (all n chunks).
    """

    calls: list[tuple[str, int, bool]] = field(default_factory=list)

    def record(self, op: str, t: torch.Tensor) -> None:
        backward = torch._C._current_graph_task_id() != -1
        self.calls.append((op, t.numel() * t.element_size(), backward))

    def clear(self) -> None:
        self.calls.clear()


@dataclass
class LocalTP:
    """What ``localize`` did: the shard specs by parameter name and the log its collectives write."""

    size: int
    specs: dict[str, ShardSpec]
    log: CommLog
    padded_vocab: int
    experts: frozenset[str] = frozenset()  # expert weights split over tp


class _Enter(torch.autograd.Function):
    """copy_to_tp: identity forward, all-reduce (a copy here) backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, log: CommLog) -> torch.Tensor:  # type: ignore[override]
        ctx.log = log
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        ctx.log.record("all_reduce", grad)
        return grad.contiguous().clone(), None


class _Leave(torch.autograd.Function):
    """reduce_from_tp: all-reduce (a copy here) forward, identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, log: CommLog) -> torch.Tensor:  # type: ignore[override]
        log.record("all_reduce", x)
        return x.contiguous().clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


class _Seq(torch.autograd.Function):
    """The sequence-parallel pairs along ``dim``: ``gather`` (all-gather forward; reduce-scatter or a
    local split backward) and its reverse ``scatter`` (reduce-scatter or a local split forward)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, log: CommLog, world: int, gather: bool, comm_back: bool,  # type: ignore[override]
                comm_fwd: bool, dim: int = 1) -> torch.Tensor:
        ctx.log, ctx.world, ctx.gather, ctx.comm_back, ctx.dim = log, world, gather, comm_back, dim
        return _seq(x, log, world, gather, comm_fwd, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _seq(grad, ctx.log, ctx.world, not ctx.gather, ctx.comm_back, ctx.dim), None, None, None, None, None, None


def _seq(x: torch.Tensor, log: CommLog, world: int, gather: bool, comm: bool, dim: int = 1) -> torch.Tensor:
    if gather:
        out = torch.cat([x] * world, dim=dim)
        if comm:
            log.record("all_gather", out)
        return out
    if comm:
        log.record("reduce_scatter", x)
    return x.narrow(dim, 0, x.shape[dim] // world).contiguous()


def _expert_hooks(module: nn.Module, log: CommLog, world: int, sequence_parallel: bool) -> None:
    """``tensor_parallel.experts.expert_hooks`` on one rank: enter (copy_to_tp on floating inputs,
    or under sequence parallelism an all-gather of every token input) and leave (all-reduce, or
    reduce-scatter of the tokens)."""

    def enter(value, tokens):
        if sequence_parallel and value is not None:
            check_token_input(type(module).__name__, value, tokens)
        if not isinstance(value, torch.Tensor):
            return value
        if sequence_parallel:
            return _Seq.apply(value, log, world, True, value.is_floating_point(), True, 0) \
                if value.is_floating_point() else _seq(value, log, world, True, True, 0)
        return _Enter.apply(value, log) if value.is_floating_point() else value

    def leave(y: torch.Tensor) -> torch.Tensor:
        return _Seq.apply(y, log, world, False, True, True, 0) if sequence_parallel else _Leave.apply(y, log)

    module.register_forward_pre_hook(token_inputs_hook(enter), with_kwargs=True)
    module.register_forward_hook(first_output_hook(leave))


def _local_param(full: torch.Tensor, spec: ShardSpec | None, world: int) -> nn.Parameter:
    shape = list(full.shape)
    if spec is not None:
        shape[spec.dim] = spec.padded_size // (world // spec.replicas)
    return nn.Parameter(full.new_empty(shape), requires_grad=full.requires_grad)


class _LocalLinear(nn.Module):
    """Column (``row=False``) or row layer of one rank: the real layers' matmul, local collectives."""

    def __init__(self, full: nn.Module, world: int, log: CommLog, *, row: bool, enter: bool, packed: int = 1,
                 replicas: int = 1, gather_output: bool = False, split_input: bool = False, seq: bool = False):
        super().__init__()
        weight, bias, self.out_dim = _linear_parts(full)
        self.world, self.log, self.row, self.enter = world, log, row, enter
        self.gather_output, self.split_input, self.seq = gather_output, split_input, seq
        dim = 1 - self.out_dim if row else self.out_dim
        self.specs = {"weight": make_spec(weight.shape[dim], dim, world, packed=packed, replicas=replicas)}
        self.weight = _local_param(weight, self.specs["weight"], world)
        if bias is not None and not row:
            self.specs["bias"] = make_spec(bias.shape[0], 0, world, packed=packed, replicas=replicas)
        self.bias = None if bias is None else _local_param(bias, self.specs.get("bias"), world)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.row:
            if self.enter:
                x = _Enter.apply(x, self.log)
            y = _matmul(x, self.weight, self.bias, self.out_dim)
            return torch.cat([y] * self.world, dim=-1) if self.gather_output else y
        if self.split_input:
            x = x.narrow(-1, 0, x.shape[-1] // self.world).contiguous()
        y = _matmul(x, self.weight, None, self.out_dim)
        y = _Seq.apply(y, self.log, self.world, False, True, True, -2) if self.seq else _Leave.apply(y, self.log)
        return y + self.bias if self.bias is not None else y


class _LocalEmbedding(nn.Module):
    """VocabParallelEmbedding's ops on one rank's rows (padded vocabulary / T)."""

    backward_reads_no_weights = True  # as VocabParallelEmbedding: ZeRO-3 makes it a fetch module

    def __init__(self, full: nn.Embedding, world: int, log: CommLog) -> None:
        super().__init__()
        self.specs = {"weight": make_spec(full.weight.shape[0], 0, world, pad=True)}
        self.weight = _local_param(full.weight, self.specs["weight"], world)
        self.rows, self.log = self.weight.shape[0], log
        self.embed_scale = getattr(full, "embed_scale", None)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < 0) | (ids >= self.rows)
        out = nn.functional.embedding(ids.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        out = _Leave.apply(out, self.log)
        return out * self.embed_scale.to(out.dtype) if self.embed_scale is not None else out


class _LocalHead(nn.Module):
    """VocabParallelLMHead on one rank: logits for its vocabulary slice, the loss's two all-reduces."""

    def __init__(self, full: nn.Module, world: int, log: CommLog, tied: _LocalEmbedding | None) -> None:
        super().__init__()
        weight, bias, _ = _linear_parts(full)
        self.specs = {"weight": make_spec(weight.shape[0], 0, world, pad=True)}
        self.weight = tied.weight if tied is not None else _local_param(weight, self.specs["weight"], world)
        if bias is not None:
            self.specs["bias"] = self.specs["weight"]
        self.bias = None if bias is None else _local_param(bias, self.specs["weight"], world)
        self.log = log

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = nn.functional.linear(_Enter.apply(hidden, self.log), self.weight, self.bias)
        tokens = logits.new_empty(logits.shape[:-1], dtype=torch.float32)
        self.log.record("all_reduce", tokens)  # the max of each token's logits
        self.log.record("all_reduce", torch.stack([tokens, tokens]))  # sum of exponentials, target logit
        return logits


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def localize(model: nn.Module, world: int, *, sequence_parallel: bool = False) -> LocalTP:
    """Make ``model`` (meta or fake tensors, consumed) what tp rank 0 of ``world`` holds and runs."""
    log = CommLog()
    specs: dict[str, ShardSpec] = {}
    if world == 1:
        vocab = model.get_input_embeddings().weight.shape[0]
        return LocalTP(1, specs, log, vocab)
    prep = prepare_tensor_parallel(model, world, sequence_parallel)
    plan, layout, kv, left, experts = prep.plan, prep.layout, prep.kv_layers, prep.left_behind, prep.experts
    regions = plan.regions
    whole = prep.whole_mixers
    for name, layer in plan.layers.items():
        if layer.kind not in ("column", "row"):
            continue
        new = _LocalLinear(model.get_submodule(name), world, log, row=layer.kind == "row",
                           enter=name.rpartition(".")[0] not in regions, packed=layer.packed,
                           replicas=kv.get(name, 1), gather_output=layer.gather_output,
                           split_input=layer.split_input,
                           seq=sequence_parallel and not any(name.startswith(m + ".") for m in whole))
        _replace(model, name, new)
        specs.update({f"{name}.{p}": s for p, s in new.specs.items()})
    split_params(model, {**left.split, **experts}, 0, world)
    specs.update(left.split)
    specs.update(experts)
    for name in plan.attention_modules:
        localize_head_counts(model.get_submodule(name), plan.divide_attrs.get(name, ()), layout, world)
    head_input_hooks(model, prep, 0)
    names = {id(m): n for n, m in model.named_modules()}
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    local_emb = _LocalEmbedding(emb, world, log)
    local_head = _LocalHead(head, world, log, local_emb if head.weight is emb.weight else None)
    specs[f"{names[id(emb)]}.weight"] = local_emb.specs["weight"]
    specs.update({f"{names[id(head)]}.{p}": s for p, s in local_head.specs.items()})
    _replace(model, names[id(emb)], local_emb)
    _replace(model, names[id(head)], local_head)
    for name in regions:
        module = model.get_submodule(name)
        enter = (lambda x: _Seq.apply(x, log, world, True, True, True, -2)) if sequence_parallel else (
            lambda x: _Enter.apply(x, log))
        module.register_forward_pre_hook(hidden_states_hook(enter), with_kwargs=True)
    for path in sorted(plan.experts):
        _expert_hooks(model.get_submodule(path), log, world, sequence_parallel)
    if sequence_parallel:
        for block in text_blocks(model):  # per-token inputs cut to the rank's part (no collective)
            block.register_forward_pre_hook(
                token_input_hook(block, world, lambda x, part: x.narrow(1, 0, part)), with_kwargs=True)
        for name in prep.sequence_mixers:  # replicated mixers: whole sequence in, own part out (sequence.py)
            mixer = model.get_submodule(name)
            if name in whole:  # gather_from_tp in, split_to_tp out: the whole gradient comes back
                enter = lambda x: _Seq.apply(x, log, world, True, False, True)  # noqa: E731
                leave = lambda x: _Seq.apply(x, log, world, False, True, False)  # noqa: E731
            else:  # gather_seq in, a local slice out
                enter = lambda x: _Seq.apply(x, log, world, True, True, True)  # noqa: E731
                leave = lambda x: x.narrow(1, 0, x.shape[1] // world)  # noqa: E731
            mixer.register_forward_pre_hook(hidden_states_hook(enter), with_kwargs=True)
            mixer.register_forward_hook(first_output_hook(leave))
        blocks = text_blocks(model)
        scatter = hidden_states_hook(lambda x: _Seq.apply(x, log, world, False, True, False))
        # before the blocks' own hooks (token_input_hook), as sequence_segment_hooks registers it
        blocks[0].register_forward_pre_hook(scatter, with_kwargs=True, prepend=True)
        blocks[-1].register_forward_hook(first_output_hook(lambda x: _Seq.apply(x, log, world, True, False, True)))
    return LocalTP(world, specs, log, local_emb.specs["weight"].padded_size, frozenset(experts))

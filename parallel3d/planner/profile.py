"""What one micro-batch's pass through a pipeline chunk creates: measured on fake tensors.

Korthikanti et al. 2022 count, tensor by tensor, what a transformer layer keeps for backward
(34 s b h + 5 a s^2 b bytes in fp16 for GPT). Rather than a closed form per family, the planner
*runs* the model's own forward and backward on ``FakeTensorMode`` tensors (shapes without data:
no memory, no compute) with the real sizes, and records every storage that op outputs create
and every storage's death (``LiveBytes``), every op's FLOPs (torch's ``flop_registry``) and bytes
touched, and every tensor-parallel collective (``comm_counter``). Under tensor parallelism the
model is the engine's own ``apply_tensor_parallel`` on a fake process group (``fake_tp``): the
pass is what tp rank 0 runs, loss included (the vocabulary-parallel one). On fake CPU tensors
attention dispatches to the flash kernel, as on GPUs, so what it keeps (q, k, v, output and the
log-sum-exp) is what a device keeps. The same fake run on the same code gives the same bytes
as a real run (checked in tests/test_planner_profile.py against real CPU runs).

A chunk is profiled the way the pipeline executor runs it: a non-first chunk's input is a
detached leaf that requires grad (the received activations), a non-last chunk's output is held
and backward starts from a gradient of its shape; the whole model (``only``) runs embedding to
loss. Parameter gradients are dropped as they arrive (ZeRO moves them into its own buffers,
which the planner counts from its unit accounting).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from functools import cached_property

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from models.anatomy import fetch_unit_modules
from models.layer_configs import with_layers
from parallel3d.runtime.comm_counter import count_collectives
from parallel3d.errors import ConfigError
from parallel3d.expert_parallel.plan import resolve_experts
from parallel3d.planner.fake_tp import fake_tp_cp_groups
from parallel3d.tensor_parallel.apply import apply_tensor_parallel

logger = logging.getLogger(__name__)

KINDS = ("only", "first", "middle", "last")

_CPU_FLASH = {"_scaled_dot_product_flash_attention_for_cpu": False,
              "_scaled_dot_product_flash_attention_for_cpu_backward": True}


def _grouped_mm_flops(name: str, args: tuple) -> int:
    """Grouped matrix multiplies (MoE experts: ``torch._grouped_mm``, transformers' fallback ops), which torch's
    registry lacks: twice the multiply-adds of every group, whichever operand the groups cut."""
    a, b = args[0], args[1]
    if name == "grouped_mm_fallback":  # (input [S, K], weight [G, K, N], offs)
        return 2 * a.numel() * b.shape[2]
    if name == "grouped_mm_fallback_backward":  # grad_input and grad_weight: two products of that size
        return 4 * a.numel() * b.shape[2]
    if a.dim() == 3 and b.dim() == 2:  # [G, M, K] x [K, sum N_g]
        return 2 * a.shape[1] * a.shape[2] * b.shape[1]
    return 2 * a.numel() * b.shape[-1]  # [S, K] x [G, K, N], [M, sum K_g] x [sum K_g, N], [G, M, K] x [G, K, N]


_GROUPED = frozenset({"_grouped_mm", "grouped_mm_fallback", "grouped_mm_fallback_backward"})


def _op_flops(func, args, kwargs, out) -> int:
    packet = func._overloadpacket
    if packet in flop_registry:
        return int(flop_registry[packet](*args, **kwargs, out_val=out))
    name = packet.__name__
    if name in _GROUPED:
        return _grouped_mm_flops(name, args)
    if name not in _CPU_FLASH:  # the CPU flash kernels are not in torch's registry; same FLOPs as CUDA's
        return 0
    if _CPU_FLASH[name]:  # backward(grad_out, query, key, value, out, logsumexp, ...)
        return int(sdpa_backward_flop_count(args[0].shape, args[1].shape, args[2].shape, args[3].shape))
    return int(sdpa_flop_count(args[0].shape, args[1].shape, args[2].shape))


_DEVICE = torch.ops.prim.device.default
_NO_DATA = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view",
                      "lift_fresh"})


@functools.cache
def _moves_data(func) -> bool:
    """Whether an op that returns tensors reads or writes tensor memory: not a view, not an allocation."""
    if func.namespace != "aten" or func._overloadpacket.__name__ in _NO_DATA:
        return False
    return not any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


def _tensors(tree) -> list[torch.Tensor]:
    """The tensors of an op's arguments or result (nested in tuples, lists and dicts, the only containers
    an ATen op takes or returns): what ``tree_leaves`` keeps of them, without its per-node dispatch,
    which cost a sixth of a profile's time."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    found, stack = [], [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, torch.Tensor):
            found.append(node)
        elif isinstance(node, (tuple, list)):
            stack.extend(node)
        elif isinstance(node, dict):
            stack.extend(node.values())
    return found


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storage alive, created inside the mode; the peak since ``reset_peak``;
    and per op (FLOPs, bytes read and written) for the roofline, split by forward/backward.

    ``UntypedStorage.resize_`` (how stage 3 frees and refills gathered blocks) does not pass
    through the dispatcher, so it is wrapped while the mode is active (as torch's MemTracker does).
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, tuple[weakref.ref, list[int]]] = {}
        self.ops: dict[bool, list[tuple[int, int]]] = {False: [], True: []}
        self._resize = None
        self.marked: int | None = None  # the most alive since ``mark()`` (None before)
        self.in_block = False  # set by the profile's block hooks
        self.received: torch.Tensor | None = None  # a non-first chunk's input leaf
        self.peak_in_block = False  # whether the peak was reached inside a block

    def mark(self) -> None:
        """Start a second peak count from now (the planner marks the first parameter gradient)."""
        if self.marked is None:
            self.marked = self.live

    def reset_peak(self) -> None:
        self.peak = self.live
        self.peak_in_block = self.in_block

    def exclude(self, tensors) -> None:
        """Storages that exist already and are not to be counted (parameters): views of them are free."""
        for t in tensors:
            storage = t.untyped_storage()
            self._refs[id(storage)] = (weakref.ref(storage), [0])

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        known = self._refs.get(key)
        if known is not None and known[0]() is storage:
            return
        if known is not None:  # the excluded storage died and its id was reused
            self._refs.pop(key)
        size = [storage.nbytes()]

        def gone(_: weakref.ref, key: int = key, size: list[int] = size) -> None:
            self.live -= size[0]
            self._refs.pop(key, None)

        self._refs[key] = (weakref.ref(storage, gone), size)
        self._add(size[0])

    def _add(self, n: int) -> None:
        self.live += n
        if self.live > self.peak:
            self.peak, self.peak_in_block = self.live, self.in_block
        if self.marked is not None:
            self.marked = max(self.marked, self.live)

    def __enter__(self):
        original = self._resize = torch.UntypedStorage.resize_

        def resize_(storage: torch.UntypedStorage, nbytes: int):
            out = original(storage, nbytes)
            known = self._refs.get(id(storage))
            if known is not None and known[0]() is storage:
                self._add(nbytes - known[1][0])
                known[1][0] = nbytes
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE and type(args[0]) is FakeTensor:
            # the autograd engine asks each gradient's device: two thirds of a pass's dispatches, answered
            # as FakeTensor's own handler answers them, without the round trip through FakeTensorMode
            fake = args[0]
            return torch.device("meta") if fake.fake_mode.in_kernel_invocation else fake.fake_device
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outputs = _tensors(out)
        for t in outputs:
            self._track(t.untyped_storage())
        if outputs and _moves_data(func):
            moved = sum(t.numel() * t.element_size() for t in (*_tensors(args), *_tensors(kwargs), *outputs))
            self.ops[torch._C._current_graph_task_id() != -1].append((_op_flops(func, args, kwargs, out), moved))
        return out


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class _Attention(torch.autograd.Function):
    """Attention as a GPU runs it, for the planner: ``flash`` keeps q, k, v, the output and the fp32
    log-sum-exp and recomputes the scores in backward; ``materialized`` is the fused
    scale-mask-softmax of Megatron-LM (2021), which keeps what Korthikanti et al. 2022 count (the
    softmax output and the dropout output, 2 bytes each, and the 1-byte dropout mask per score,
    besides q, k and v). Each records its FLOPs and the bytes its kernels read and write."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,  # type: ignore[override]
                live: LiveBytes, kind: str, dropout: bool) -> torch.Tensor:
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        ctx.live, ctx.kind = live, kind
        flops = int(sdpa_flop_count(q.shape, k.shape, v.shape))
        if kind == "flash":
            lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
            ctx.save_for_backward(q, k, v, out, lse, mask)
            moved = _nbytes(q, k, v, out, lse, mask)
        else:
            scores = q.new_empty((*q.shape[:-1], k.shape[-2]))  # QK^T, then softmax in place of it
            probs = torch.empty_like(scores)
            keep = torch.empty_like(scores, dtype=torch.bool) if dropout else None
            dropped = torch.empty_like(scores) if dropout else None
            ctx.save_for_backward(q, k, v, probs, keep, dropped)
            # QK^T writes the scores; the fused softmax reads them, writes probs; dropout reads probs,
            # writes its output and mask; the product with V reads what it multiplies
            moved = _nbytes(q, k, scores) + _nbytes(scores, probs, mask) + _nbytes(probs, dropped, keep) \
                + _nbytes(dropped if dropout else probs, v, out)
        live.ops[torch._C._current_graph_task_id() != -1].append((flops, moved))
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        saved = ctx.saved_tensors
        q, k, v = saved[:3]
        grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
        flops = int(sdpa_backward_flop_count(grad.shape, q.shape, k.shape, v.shape))
        if ctx.kind == "flash":
            moved = _nbytes(*saved, grad, *grads)
        else:
            flops = 2 * int(sdpa_flop_count(q.shape, k.shape, v.shape))  # four products, no recomputation
            probs, keep, dropped = saved[3:]
            grad_scores = torch.empty_like(probs)
            moved = _nbytes(grad, v, dropped if dropped is not None else probs, grads[2], grad_scores) \
                + _nbytes(grad_scores, keep, grad_scores) + _nbytes(grad_scores, probs, grad_scores) \
                + _nbytes(grad_scores, q, k, grads[0], grads[1])
        ctx.live.ops[True].append((flops, moved))
        return (*grads, None, None, None, None)


@contextlib.contextmanager
def _gpu_kernels(live: LiveBytes, attention: str) -> Iterator[None]:
    """Run attention and dropout as a GPU does while profiling: ``F.scaled_dot_product_attention``
    through :class:`_Attention`, ``F.dropout`` through ``native_dropout`` (a 1-byte mask, where the
    CPU path keeps its mask in the activation dtype). The attributes are replaced, not intercepted
    by a TorchFunctionMode: activation checkpointing recomputes the forward inside backward, where
    function modes are not active."""
    sdpa, dropout = nn.functional.scaled_dot_product_attention, nn.functional.dropout

    def attention_kernel(query, key, value, attn_mask=None, dropout_p=0.0, *args, **kwargs):
        return _Attention.apply(query, key, value, attn_mask, live, attention, dropout_p > 0)

    def dropout_kernel(x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False):
        if not training or p == 0:
            return x
        return torch.ops.aten.native_dropout(x, p, True)[0]

    nn.functional.scaled_dot_product_attention, nn.functional.dropout = attention_kernel, dropout_kernel
    try:
        yield
    finally:
        nn.functional.scaled_dot_product_attention, nn.functional.dropout = sdpa, dropout


ATTENTION = ("native", "flash", "materialized")


@dataclass(frozen=True)
class SplitBackward:
    """ZB-H1's two backward passes: the input-gradient pass's peak, what it leaves for the weight
    pass (activations and the captured gradients), and the weight pass's peak (all from zero)."""

    input_peak: int = 0
    held: int = 0
    weight_peak: int = 0


@dataclass(frozen=True, eq=False)
class PassProfile:
    """One micro-batch through one chunk of ``blocks`` blocks (bytes of the working dtype included).

    ``at_rest``: bytes alive between its forward and backward (what the schedule keeps per
    in-flight micro-batch); ``forward_peak`` / ``backward_peak``: the most alive during each pass,
    counted from before the forward (so ``backward_peak`` includes ``at_rest``); ``ops``: (FLOPs,
    bytes) of every op of the forward and of the backward (recomputation included);
    ``comm``: tensor-parallel collectives (op, payload bytes, in backward?); ``cp_comm``: the
    context-parallel attention's (all-to-alls, the ring's sends and receives), the same way;
    ``output_grad``: bytes of the gradient a non-last chunk's backward starts from (made after
    the forward, before the backward; 0 where the backward starts from the loss).
    """

    kind: str
    blocks: int
    at_rest: int
    forward_peak: int
    backward_peak: int
    after_first_grad: int
    forward_peak_in_block: bool
    backward_peak_in_block: bool
    forward_ops: tuple[tuple[int, int], ...]
    backward_ops: tuple[tuple[int, int], ...]
    comm: tuple[tuple[str, int, bool], ...] = field(default=())
    split: SplitBackward = field(default_factory=SplitBackward)
    cp_comm: tuple[tuple[str, int, bool], ...] = field(default=())
    output_grad: int = 0

    @cached_property
    def flops(self) -> tuple[int, int]:
        return sum(f for f, _ in self.forward_ops), sum(f for f, _ in self.backward_ops)


class _Stop(Exception):
    def __init__(self, output: torch.Tensor) -> None:
        super().__init__()
        self.output = output


class ProfileError(ConfigError):
    """A pass the profile cannot run: the model's code fails on fake tensors, or its config
    cannot be cut to the chunk's blocks. The planner leaves the layouts that need it out."""


def _text(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _build(config, blocks: int, dtype: torch.dtype, group, sequence_parallel: bool, checkpointing: bool,
           whole_experts: bool = False, cp_group=None, cp_method: str = "ulysses") -> nn.Module:
    """The model with ``blocks`` blocks on fake tensors, as tp rank 0 of ``group`` (None: no tp) holds it;
    ``whole_experts``: its experts modules left out of tensor parallelism, as expert parallelism has them;
    its attention the engine's cp attention over ``cp_group`` (None: no context parallelism)."""
    from parallel3d.context_parallel.model import install_attention

    from transformers import AutoModelForCausalLM

    try:
        cut = with_layers(config, blocks)
    except Exception as exc:  # noqa: BLE001 - a config's own validation raises what it likes
        raise ProfileError(f"{type(config).__name__} cannot be cut to {blocks} block(s) to profile "
                           f"({type(exc).__name__}: {exc})") from None
    try:
        model = AutoModelForCausalLM.from_config(cut, dtype=dtype)
    except Exception as exc:  # noqa: BLE001 - the model's own constructor: any error, reported
        raise ProfileError(f"transformers cannot build {type(config).__name__}'s model with {blocks} block(s) "
                           f"({type(exc).__name__}: {exc})") from None
    model.train()
    if group is not None:
        whole = _experts_modules(model) if whole_experts else frozenset()
        apply_tensor_parallel(model, group, sequence_parallel=sequence_parallel, whole=whole)
    if cp_group is not None:
        install_attention(model, cp_group, cp_method)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _experts_modules(model: nn.Module) -> frozenset[str]:
    """The experts modules expert parallelism splits (none in a chunk of dense blocks, as DeepSeek V3's first)."""
    try:
        return frozenset(m.name for m in resolve_experts(model, 1))
    except ConfigError:
        return frozenset()


def _hook(model: nn.Module, kind: str, live: LiveBytes) -> list:
    """Parameter gradients dropped as they arrive (the first one marked); block boundaries noted;
    a non-first chunk's input made a leaf, a non-last chunk's forward stopped after its blocks.
    Returns the hooks' handles (a built model serves several passes, each with its own hooks)."""

    def drop(p: nn.Parameter) -> None:
        live.mark()
        p.grad = None

    handles = [p.register_post_accumulate_grad_hook(drop) for p in model.parameters() if p.requires_grad]
    layers = fetch_unit_modules(model)
    for layer in layers:  # where the peaks fall: inside a block (its stage-3 parameters gathered) or not
        handles += [layer.register_forward_pre_hook(lambda *_: setattr(live, "in_block", True)),
                    layer.register_forward_hook(lambda *_: setattr(live, "in_block", False)),
                    layer.register_full_backward_pre_hook(lambda *_: setattr(live, "in_block", True)),
                    layer.register_full_backward_hook(lambda *_: setattr(live, "in_block", False))]
    if kind in ("middle", "last"):
        def detach_input(module: nn.Module, args: tuple, kwargs: dict):
            x = args[0] if args else kwargs["hidden_states"]
            leaf = x.detach().requires_grad_(True)
            live.received = leaf
            return ((leaf, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": leaf})

        handles.append(layers[0].register_forward_pre_hook(detach_input, with_kwargs=True, prepend=True))
    if kind in ("first", "middle"):
        def stop(module: nn.Module, args: tuple, output):
            raise _Stop(output[0] if isinstance(output, tuple) else output)

        handles.append(layers[-1].register_forward_hook(stop))
    return handles


class _GroupedMMAnyDtype(TorchDispatchMode):
    """``aten._grouped_mm`` on fake tensors of any floating dtype (float32 MoE experts), as the kernels run it.

    torch's meta kernel holds every call to the CUDA fast path's rule (bf16 operands only), while the
    kernels themselves take float32 and float16 too: CPU's, and CUDA's fallback (one matrix multiply per
    group, written into one output). On those the operands' strides are checked as the kernels check them
    (``_check_grouped_mm_strides``) and the output is allocated as the meta kernel allocates it
    (``_create_grouped_mm_output_tensor``: the same rule as the kernels', padded on a CUDA build), so the
    profile keeps, and counts the FLOPs of, what a real run of that dtype does, and fails where it fails.
    Sits under ``LiveBytes``."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.ops.aten._grouped_mm.default or args[0].dtype == torch.bfloat16:
            return func(*args, **kwargs)
        from torch._meta_registrations import _create_grouped_mm_output_tensor

        _check_grouped_mm_strides(args[0])
        _check_grouped_mm_strides(args[1])
        offs = args[2] if len(args) > 2 else kwargs.get("offs")
        return _create_grouped_mm_output_tensor(args[0], args[1], offs, kwargs.get("out_dtype"))


def _check_grouped_mm_strides(mat: torch.Tensor) -> None:
    """The grouped-mm kernels' rule on an operand, for every dtype (ATen's ``check_valid_strides_and_return_transposed``,
    which the meta kernel applies to bf16 only): row- or column-major in its last two dims, the leading stride a
    multiple of 16 bytes."""
    stride, size = mat.stride(), mat.shape
    alignment = 16 // mat.element_size()
    if stride[-2] == 1 and stride[-1] >= max(1, size[-2]):
        leading = stride[-1]
    elif stride[-1] == 1 and stride[-2] >= max(1, size[-1]):
        leading = stride[-2]
    else:
        raise RuntimeError(f"Invalid strides/sizes, got {list(stride)} for strides and {list(size)} for sizes")
    if leading % alignment:
        raise RuntimeError("strides should be multiple of 16 bytes")


@contextlib.contextmanager
def _profiling(tp: int, cp: int, dtype: torch.dtype) -> Iterator[tuple[dist.ProcessGroup | None,
                                                                      dist.ProcessGroup | None]]:
    """What every pass runs inside: fake tensors, the fake tp and cp groups, the planner's random stream
    kept (tp regions draw their seeds from it), the model's deprecation notices silenced (they
    are about how the profile calls it, not the user's plan); in a dtype other than bf16,
    :class:`_GroupedMMAnyDtype` (a dispatch mode costs every op some time: not where it does nothing)."""
    grouped = contextlib.nullcontext() if dtype == torch.bfloat16 else _GroupedMMAnyDtype()
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings(), FakeTensorMode(allow_non_fake_inputs=True), \
            fake_tp_cp_groups(tp, cp) as groups, grouped:
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        yield groups


def _check(kind: str, attention: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"chunk kind {kind!r}; allowed: {', '.join(KINDS)}")
    if attention not in ATTENTION:
        raise ValueError(f"attention {attention!r}; allowed: {', '.join(ATTENTION)}")


def profile_pass(config, kind: str, blocks: int, *, micro_batch: int, seq: int, dtype: torch.dtype, tp: int = 1,
                 sequence_parallel: bool = False, checkpointing: bool = False, attention: str = "native",
                 split_backward: bool = False, whole_experts: bool = False, cp: int = 1,
                 cp_method: str = "ulysses") -> PassProfile:
    """Profile ``kind`` (one of :data:`KINDS`) with ``blocks`` blocks of the model ``config`` describes.

    ``attention``: how ``scaled_dot_product_attention`` runs: ``native`` as this CPU dispatches
    it (its flash kernel has no dropout; with dropout it materializes the scores), ``flash`` or
    ``materialized`` as :class:`_Attention` models a GPU's kernels (and dropout as a GPU runs it:
    :func:`_gpu_kernels`). The model is run with
    transformers' ``sdpa`` attention unless its config names another. ``split_backward``: the
    backward as ZB-H1 runs it, the executor's ``backward_input`` then ``backward_weight``.
    ``whole_experts``: under tp, the experts modules stay whole (every tp rank computes them on the
    same rows), as the engine leaves them under expert parallelism; all experts are there, so the
    experts' compute is the whole layer's for this rank's tokens, which expert parallelism only moves.
    ``cp``: context parallelism, ``cp_method`` "ulysses" or "ring": the pass of cp rank 0, which
    holds ``seq / cp`` tokens and runs the engine's cp attention over a fake cp group (its
    exchanges' buffers, what it keeps for backward and its FLOPs over the whole sequence's keys
    are the real ones; which tokens the rank holds does not change them).
    """
    _check(kind, attention)
    with _profiling(tp, cp, dtype) as (group, cp_group):
        model = _build(config, blocks, dtype, group, sequence_parallel, checkpointing, whole_experts, cp_group,
                       cp_method)
        return _run(model, config, kind, blocks, micro_batch, seq // cp, dtype, tp, attention, split_backward,
                    cp_group)


def model_key(key: tuple) -> tuple:
    """What of a pass's key its built model depends on: (blocks, tp, sequence_parallel,
    checkpointing, whole_experts, cp, cp_method)."""
    return key[1], key[3], key[4], key[5], key[8], key[9], key[10]


def profile_passes(config, keys: Iterable[tuple], *, seq: int,
                   dtype: torch.dtype) -> dict[tuple, PassProfile | ProfileError]:
    """:func:`profile_pass` of each key = (kind, blocks, micro_batch, tp, sequence_parallel,
    checkpointing, attention, split_backward, whole_experts, cp, cp_method), or the ProfileError it raises; the
    same figures.

    The passes that share a :func:`model_key` run on one built model (building and sharding it
    is a tenth of a pass's time): each pass adds its own hooks and removes them, and parameter
    gradients are dropped as they arrive, so the model a pass starts from is the one a fresh
    build gives. After a pass fails the model is built again.
    """
    keys = list(dict.fromkeys(keys))
    derived = [key for key in keys if key[0] == "first" and key[7]]
    groups: dict[tuple, list[tuple]] = {}
    for key in dict.fromkeys([*(k for k in keys if k not in derived), *map(_unsplit, derived)]):
        _check(key[0], key[6])
        groups.setdefault(model_key(key), []).append(key)
    out: dict[tuple, PassProfile | ProfileError] = {}
    for (blocks, tp, sp, ac, whole, cp, method), group_keys in groups.items():
        with _profiling(tp, cp, dtype) as (group, cp_group):
            model = None
            for key in group_keys:
                kind, micro_batch, attention, split = key[0], key[2], key[6], key[7]
                try:
                    if model is None:
                        model = _build(config, blocks, dtype, group, sp, ac, whole, cp_group, method)
                    out[key] = _run(model, config, kind, blocks, micro_batch, seq // cp, dtype, tp, attention, split,
                                    cp_group)
                except ProfileError as exc:
                    out[key], model = exc, None
    for key in derived:
        base = out[_unsplit(key)]
        out[key] = base if isinstance(base, ProfileError) else first_split(base)
    return {key: out[key] for key in keys}


def _unsplit(key: tuple) -> tuple:
    return (*key[:7], False, *key[8:])


def first_split(profile: PassProfile) -> PassProfile:
    """A first chunk's pass under ZB-H1's split backward, from its pass with one backward: the same
    figures but the split's. A first chunk has no input that requires grad, so the executor's
    ``backward_input`` computes nothing and defers the whole backward to ``backward_weight``, the
    one ``torch.autograd.backward`` of the unsplit pass on the same references: the input pass's
    peak and what it leaves are what is alive after the forward plus the output's gradient, and the
    weight pass's peak is the unsplit backward's (tests/test_planner_profile.py measures both)."""
    if profile.kind != "first":
        raise ValueError(f"only a first chunk's split backward is its unsplit one; got a {profile.kind} chunk")
    held = profile.at_rest + profile.output_grad
    return replace(profile, backward_peak=max(held, profile.backward_peak),
                   split=SplitBackward(held, held, profile.backward_peak))


def _run(model: nn.Module, config, kind: str, blocks: int, micro_batch: int, seq: int, dtype: torch.dtype, tp: int,
         attention: str, split_backward: bool, cp_group=None) -> PassProfile:
    """One pass of ``model`` (built by :func:`_build` inside :func:`_profiling`) over ``seq`` tokens, counted
    (the cp group's exchanges apart)."""
    from parallel3d.pipeline.executor import backward_input, backward_weight

    live = LiveBytes()
    handles = _hook(model, kind, live)
    try:
        ids = torch.zeros(micro_batch, seq, dtype=torch.long)
        live.exclude([*model.parameters(), *model.buffers()])
        kernels = contextlib.nullcontext() if attention == "native" else _gpu_kernels(live, attention)
        split = SplitBackward()
        with live, kernels, count_collectives(names={"cp": cp_group} if cp_group is not None else None) as comm:
            try:
                inputs: dict = {"input_ids": ids}
                if kind in ("middle", "last"):  # no embedding lookup: the received activations stand in
                    inputs = {"inputs_embeds": torch.empty(micro_batch, seq, _text(config).hidden_size, dtype=dtype)}
                if kind != "only":
                    inputs["use_cache"] = False  # as the pipeline's stage programs call the blocks
                try:  # the model's own loss, or under tp the engine's vocabulary-parallel one
                    with comm.tag("forward"):
                        out = model(**inputs, labels=ids).loss
                except _Stop as stop_at:
                    out = stop_at.output
                at_rest, forward_peak, forward_in_block = live.live, live.peak, live.peak_in_block
                live.reset_peak()
                grad = None if out.dim() == 0 else torch.ones_like(out)
                output_grad = _nbytes(grad)
                with comm.tag("backward"):
                    if split_backward:
                        params = [p for p in model.parameters() if p.requires_grad]
                        # as the executor: one weight-gradient call per checkpointed block
                        together = [list(b.parameters()) for b in fetch_unit_modules(model)] \
                            if model.is_gradient_checkpointing else []
                        _, work = backward_input(out, grad, live.received, params, together)
                        del out, grad
                        split = SplitBackward(live.peak, live.live)
                        live.reset_peak()
                        backward_weight(work)
                        del work
                        split = SplitBackward(split.input_peak, split.held, live.peak)
                    else:
                        torch.autograd.backward(out, grad_tensors=grad)
                        del out, grad
            except ConfigError:
                raise
            except Exception as exc:  # noqa: BLE001 - the model's own code on fake tensors: any error, reported
                logger.info("profile of a %s chunk of %d block(s) at tp %d failed", kind, blocks, tp, exc_info=True)
                raise ProfileError(f"the model's forward and backward fail on the profile's fake tensors ({kind} "
                                   f"chunk of {blocks} block(s): {type(exc).__name__}: "
                                   f"{str(exc).splitlines()[0][:200] if str(exc) else ''})") from None
    finally:
        for handle in handles:
            handle.remove()
        live.received = None
    backward_peak = max(split.input_peak, split.weight_peak) if split_backward else live.peak
    return PassProfile(kind, blocks, at_rest, forward_peak, backward_peak, live.marked or 0, forward_in_block,
                       live.peak_in_block, tuple(live.ops[False]), tuple(live.ops[True]),
                       tuple((c.op, c.nbytes, c.tag == "backward") for c in comm.calls if c.group != "cp"), split,
                       tuple((c.op, c.nbytes, c.tag == "backward") for c in comm.calls if c.group == "cp"), output_grad)

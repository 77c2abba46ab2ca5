"""What one micro-batch's pass through a pipeline chunk creates: measured on fake tensors.

Korthikanti et al. 2022 count, tensor by tensor, what a transformer layer keeps for backward
(34 s b h + 5 a s^2 b bytes in fp16 for GPT). Rather than a closed form per family, the planner
*runs* the model's own forward and backward on ``FakeTensorMode`` tensors (shapes without data:
no memory, no compute) with the real sizes, and records every storage that op outputs create
and every storage's death (``LiveBytes``), every op's FLOPs (torch's ``flop_registry``) and bytes
touched, and every tensor-parallel collective (``local_tp.CommLog``). On fake CPU tensors
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

import copy
import logging
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from models.anatomy import fetch_unit_modules
from parallel3d.planner.local_tp import localize

logger = logging.getLogger(__name__)

KINDS = ("only", "first", "middle", "last")

_CPU_FLASH = {"_scaled_dot_product_flash_attention_for_cpu": False,
              "_scaled_dot_product_flash_attention_for_cpu_backward": True}


def _op_flops(func, args, kwargs, out) -> int:
    packet = func._overloadpacket
    if packet in flop_registry:
        return int(flop_registry[packet](*args, **kwargs, out_val=out))
    name = packet.__name__
    if name not in _CPU_FLASH:  # the CPU flash kernels are not in torch's registry; same FLOPs as CUDA's
        return 0
    if _CPU_FLASH[name]:  # backward(grad_out, query, key, value, out, logsumexp, ...)
        return int(sdpa_backward_flop_count(args[0].shape, args[1].shape, args[2].shape, args[3].shape))
    return int(sdpa_flop_count(args[0].shape, args[1].shape, args[2].shape))


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

    def mark(self) -> None:
        """Start a second peak count from now (the planner marks the first parameter gradient)."""
        if self.marked is None:
            self.marked = self.live

    def reset_peak(self) -> None:
        self.peak = self.live

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
        self.peak = max(self.peak, self.live)
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
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        for t in outputs:
            self._track(t.untyped_storage())
        if not any(r.alias_info is not None for r in func._schema.returns):  # views move nothing
            moved = sum(t.numel() * t.element_size() for t in tree_leaves((args, kwargs, out))
                        if isinstance(t, torch.Tensor))
            self.ops[torch._C._current_graph_task_id() != -1].append((_op_flops(func, args, kwargs, out), moved))
        return out


@dataclass(frozen=True)
class PassProfile:
    """One micro-batch through one chunk of ``blocks`` blocks (bytes of the working dtype included).

    ``at_rest``: bytes alive between its forward and backward (what the schedule keeps per
    in-flight micro-batch); ``forward_peak`` / ``backward_peak``: the most alive during each pass,
    counted from before the forward (so ``backward_peak`` includes ``at_rest``); ``ops``: (FLOPs,
    bytes) of every op of the forward and of the backward (recomputation included);
    ``comm``: tensor-parallel collectives (op, payload bytes, in backward?).
    """

    kind: str
    blocks: int
    at_rest: int
    forward_peak: int
    backward_peak: int
    after_first_grad: int
    forward_ops: tuple[tuple[int, int], ...]
    backward_ops: tuple[tuple[int, int], ...]
    comm: tuple[tuple[str, int, bool], ...] = field(default=())

    @property
    def flops(self) -> tuple[int, int]:
        return sum(f for f, _ in self.forward_ops), sum(f for f, _ in self.backward_ops)


class _Stop(Exception):
    def __init__(self, output: torch.Tensor) -> None:
        super().__init__()
        self.output = output


def _truncated_config(config, blocks: int):
    """``config`` with ``blocks`` layers (per-layer lists cut to match)."""
    cfg = copy.deepcopy(config)
    key = "n_layer" if hasattr(cfg, "n_layer") and not hasattr(cfg, "num_hidden_layers") else "num_hidden_layers"
    setattr(cfg, key, blocks)
    for name in ("layer_types", "sliding_window_pattern_list"):
        value = getattr(cfg, name, None)
        if isinstance(value, list):
            setattr(cfg, name, value[:blocks])
    return cfg


def profile_pass(config, kind: str, blocks: int, *, micro_batch: int, seq: int, dtype: torch.dtype, tp: int = 1,
                 sequence_parallel: bool = False, checkpointing: bool = False) -> PassProfile:
    """Profile ``kind`` (one of :data:`KINDS`) with ``blocks`` blocks of the model ``config`` describes."""
    from transformers import AutoModelForCausalLM

    if kind not in KINDS:
        raise ValueError(f"chunk kind {kind!r}; allowed: {', '.join(KINDS)}")
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = AutoModelForCausalLM.from_config(_truncated_config(config, blocks), dtype=dtype)
        model.train()
        info = localize(model, tp, sequence_parallel=sequence_parallel)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        live = LiveBytes()

        def drop(p: nn.Parameter) -> None:
            live.mark()
            p.grad = None

        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(drop)
        layers = fetch_unit_modules(model)
        received: list[torch.Tensor] = []
        if kind in ("middle", "last"):
            def detach_input(module: nn.Module, args: tuple, kwargs: dict):
                x = args[0] if args else kwargs["hidden_states"]
                leaf = x.detach().requires_grad_(True)
                received.append(leaf)
                return ((leaf, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": leaf})

            layers[0].register_forward_pre_hook(detach_input, with_kwargs=True, prepend=True)
        if kind in ("first", "middle"):
            def stop(module: nn.Module, args: tuple, output):
                raise _Stop(output[0] if isinstance(output, tuple) else output)

            layers[-1].register_forward_hook(stop)
        ids = torch.zeros(micro_batch, seq, dtype=torch.long)
        live.exclude([*model.parameters(), *model.buffers()])
        with live:
            inputs = {"input_ids": ids}
            if kind in ("middle", "last"):  # no embedding lookup: the received activations stand in
                inputs = {"inputs_embeds": torch.empty(micro_batch, seq, config.hidden_size, dtype=dtype)}
            try:
                out = model(**inputs, labels=ids).loss
            except _Stop as stop_at:
                out = stop_at.output
            at_rest, forward_peak = live.live, live.peak
            grad = None if out.dim() == 0 else torch.ones_like(out)
            torch.autograd.backward(out, grad_tensors=grad)
            del out, grad
    return PassProfile(kind, blocks, at_rest, forward_peak, live.peak, live.marked or 0, tuple(live.ops[False]),
                       tuple(live.ops[True]), tuple(info.log.calls))

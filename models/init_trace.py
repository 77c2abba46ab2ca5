"""Run a model's construction on the meta device while the CPU generator advances as in eager.

The engine behind :class:`models.materialize.InitReplay`. A *program* (a zero-argument function
that builds and initializes a model, e.g. ``lambda: LlamaForCausalLM._from_config(cfg)``) runs
twice under two modes:

- :class:`MetaConstructors` (a TorchFunctionMode) sends factory functions that name no device to
  the meta device, like ``torch.device("meta")``, but it is *not* a ``DeviceContext`` and leaves
  literal tensors (``torch.tensor``) on the CPU, so code that asks which device it is being built
  on (``torch.get_default_device()``, transformers' ``get_torch_context_manager_or_global_device``,
  which tests ``torch.tensor([]).device``) sees the CPU and takes eager's path: transformers then
  runs ``initialize_weights`` instead of skipping it as it does under ``torch.device("meta")``.
  It also answers ``Tensor.is_meta`` with ``False``, because torch's own init functions skip
  meta tensors without drawing.
- :class:`Trace` (a TorchDispatchMode) sees every aten op touching a meta tensor. Storages are
  numbered in order of first sight, so both runs name them alike.

Run 1 (:class:`Recorder`; :class:`~models.init_execute.ValuedRecorder` when the construction
branches on values it draws) records, per op, which storages it reads, writes, fully overwrites
and creates; it runs with the generator forked. :func:`plan` then walks the record backwards
(liveness, as a compiler does for registers) from the storages requested at the end: an op is
*needed* if a storage it writes is live after it. Run 2 (:class:`~models.init_execute.Executor`,
in :mod:`models.init_execute`) computes needed ops
on real CPU "shadow" storages, runs every random op that is not needed on a scratch tensor of
the same size, strides and dtype (so the generator advances exactly as eager: CPU ``normal_``
picks its algorithm by numel and contiguity), emits a requested tensor right after the last op
that touches it, and frees a shadow as soon as it is dead. A parameter's construction-time
``kaiming_uniform_`` is therefore drawn into scratch (``_init_weights`` overwrites it later)
and only the values the caller asked for are ever held, one tensor in flight.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

_META = torch.device("meta")
_CPU = torch.device("cpu")


class TraceError(RuntimeError):
    """The construction cannot be replayed (it reads a meta value, or differs between runs)."""


# --------------------------------------------------------------------------- function mode


_LITERALS = frozenset({torch.tensor, torch.as_tensor, torch.asarray, torch.scalar_tensor})
_IS_META = torch._C.TensorBase.__dict__.get("is_meta")


def missing_torch_details() -> list[str]:
    """The private torch details the replay relies on that this torch lacks (empty: none).

    Checked before a replay starts, so a torch release that renamed one is refused with its name
    rather than failing (or worse, tracing something else) halfway through a construction."""
    import torch.utils._python_dispatch as dispatch

    missing = [] if _IS_META is not None else ["torch._C.TensorBase.is_meta (a descriptor the replay answers)"]
    try:
        from torch.utils._device import _device_constructors  # noqa: F401 - checked for presence
    except ImportError:
        missing.append("torch.utils._device._device_constructors (the factory functions sent to meta)")
    if not hasattr(dispatch, "_disable_current_modes"):
        missing.append("torch.utils._python_dispatch._disable_current_modes")
    if not hasattr(torch._C, "DisableTorchFunction"):
        missing.append("torch._C.DisableTorchFunction")
    return missing


@functools.lru_cache(1)
def _constructors() -> frozenset:
    from torch.utils._device import _device_constructors

    return frozenset(_device_constructors() - _LITERALS)


class MetaConstructors(TorchFunctionMode):
    """``torch.device("meta")`` for factory functions, minus literals, without being a DeviceContext.

    ``Tensor.is_meta`` reads ``False``: torch's own ``trunc_normal_``, ``orthogonal_``,
    ``dirac_`` and ``sparse_`` (torch 2.13 ``nn/init.py``) return at once on a meta tensor
    without drawing, where eager draws. ``Tensor.device`` still says meta.

    A literal asked for on the meta device (``torch.tensor(data, device=w.device)``, RWKV's
    init does it) is built on the CPU and moved with ``.to("meta")``: torch builds literals
    with dispatch modes off, so the data would otherwise reach the trace as a meta tensor
    with no known value.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is _IS_META:
            return False
        if func in _constructors() and kwargs.get("device") is None:
            kwargs["device"] = _META
        elif func in _LITERALS and _is_meta(kwargs.get("device")):
            return _literal_on_meta(func, args, kwargs)
        elif (
            func is torch.Tensor.new_tensor
            and args[0].is_meta
            and (kwargs.get("device") is None or _is_meta(kwargs["device"]))
        ):
            kwargs.setdefault("dtype", args[0].dtype)
            return _literal_on_meta(torch.tensor, args[1:], {**kwargs, "device": _META})
        return func(*args, **kwargs)


def _literal_on_meta(func, args, kwargs):
    grad = kwargs.pop("requires_grad", False)
    out = func(*args, **{**kwargs, "device": _CPU}).to(_META)
    return out.requires_grad_() if grad else out


# --------------------------------------------------------------------------- op facts

# In-place ops that write every element of ``self`` without reading it.
_OVERWRITE = frozenset(
    "fill_ zero_ copy_ normal_ uniform_ random_ bernoulli_ exponential_ geometric_ log_normal_ cauchy_".split()
)
# In-place ops that change metadata only.
_META_INPLACE = frozenset(
    "set_ detach_ as_strided_ squeeze_ unsqueeze_ t_ transpose_ swapdims_ swapaxes_ resize_ "
    "resize_as_ requires_grad_".split()
)
_EMPTY = frozenset("empty empty_like empty_strided new_empty new_empty_strided empty_permuted".split())
# Random ops whose schemas take no Generator argument.
_RANDOM_EXTRA = frozenset("native_dropout rrelu_with_noise rrelu_with_noise_ _fused_dropout".split())


@dataclass(frozen=True)
class OpInfo:
    name: str
    mutated: tuple[tuple[int, str, bool], ...]  # (position, argument name, kwarg_only)
    overwrites_self: bool  # a pure overwrite of its mutated arguments
    random: bool
    metadata_only: bool  # reads no values of its tensor inputs (views, *_like, new_*)
    uninitialized_output: bool
    observer: bool  # returns Python values (item(), bool()): the program may branch on them


@functools.lru_cache(None)
def op_info(func) -> OpInfo:
    schema = func._schema
    packet = func.overloadpacket
    name = packet.__name__
    mutated = tuple(
        (i, a.name, a.kwarg_only)
        for i, a in enumerate(schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    )
    random = name in _RANDOM_EXTRA or any(
        "Generator" in str(a.type) for ov in packet.overloads() for a in getattr(packet, ov)._schema.arguments
    )
    view = bool(schema.returns) and not mutated and all(r.alias_info is not None for r in schema.returns)
    if name in _META_INPLACE:
        mutated = ()
    metadata_only = (
        view or name in _META_INPLACE or name.endswith("_like") or name.startswith("new_") or name in _EMPTY
    )
    overwrites = name in _OVERWRITE or (bool(mutated) and all(n.startswith("out") for _, n, _ in mutated))
    observer = bool(schema.returns) and not any("Tensor" in str(r.type) for r in schema.returns)
    return OpInfo(name, mutated, overwrites, random, metadata_only, name in _EMPTY, observer)


def _arg(args, kwargs, pos, name, kwarg_only):
    if not kwarg_only and pos < len(args):
        return args[pos]
    return kwargs.get(name)


def _tensors(x) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def covers_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` views every byte of its storage exactly once."""
    if t.storage_offset() != 0 or t.numel() * t.element_size() != t.untyped_storage().nbytes():
        return False
    expected = 1
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, t.stride()) if s != 1), key=lambda p: p[1]):
        if stride != expected:
            return False
        expected *= size
    return True


# --------------------------------------------------------------------------- the trace


@dataclass
class OpRecord:
    name: str
    reads: tuple[int, ...]  # storages whose values the op reads, mutated partial writes included
    input_reads: tuple[int, ...]  # the same, without the op's mutated arguments
    writes: tuple[int, ...]  # mutated and created storages
    overwrites: tuple[int, ...]  # mutated storages written whole without being read
    creates: tuple[int, ...]
    random: bool
    observer: bool  # returns something other than tensors (a Python value the program may branch on)


class Trace(TorchDispatchMode):
    """Shared bookkeeping of both runs: numbering storages, classifying each op."""

    def __init__(self) -> None:
        super().__init__()
        self.sid_of: dict[int, int] = {}
        self._alive: list = []  # keeps numbered storages alive so their addresses are not reused
        self.initialized: list[bool] = []
        self.real_draws: list[str] = []  # random ops on CPU tensors (drawn even when built on meta)
        self.k = 0

    def sid(self, t: torch.Tensor, *, initialized: bool = False) -> int:
        key = _storage_key(t)
        sid = self.sid_of.get(key)
        if sid is None:
            sid = self.sid_of[key] = len(self.initialized)
            self._alive.append(t.untyped_storage())
            self.initialized.append(initialized)
        return sid

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = pytree.tree_leaves((args, kwargs))
        if not any(isinstance(x, torch.Tensor) and x.is_meta for x in leaves) and not _is_meta(kwargs.get("device")):
            if op_info(func).random:
                # A draw on a real CPU tensor: it happens under torch.device("meta") too.
                self.real_draws.append(str(func))
            return func(*args, **kwargs)
        info = op_info(func)
        mutated = [t for m in info.mutated for t in _tensors(_arg(args, kwargs, *m))]
        if any(not t.is_meta for t in mutated):
            raise TraceError(f"{info.name} writes a CPU tensor from meta values; this construction cannot be replayed")
        for t in _tensors((args, kwargs)):
            if t.is_meta:
                self.sid(t)  # a storage made outside the trace is numbered (uninitialized) on first sight
        mutated_sids = [self.sid(t) for t in mutated]
        mutated_keys = {_storage_key(t) for t in mutated}
        input_reads: list[int] = []
        if not info.metadata_only:
            for t in _tensors((args, kwargs)):
                if t.is_meta and _storage_key(t) not in mutated_keys:
                    input_reads.append(self.sid(t))
        reads = list(input_reads)
        overwrites = []
        for t, s in zip(mutated, mutated_sids):
            if info.overwrites_self and covers_storage(t):
                overwrites.append(s)
            else:
                reads.append(s)
        meta_args, meta_kwargs = pytree.tree_map(_to_meta, (args, kwargs))
        # An observer of a meta value has no meta result: the run computes it, or gives up.
        out = None if info.observer else func(*meta_args, **meta_kwargs)
        known = set(self.sid_of)
        fresh = []
        for t in _tensors(out):
            if t.is_meta and _storage_key(t) not in known:
                known.add(_storage_key(t))
                fresh.append((t, self.sid(t, initialized=not info.uninitialized_output)))
        for s in mutated_sids:
            self.initialized[s] = True
        rec = OpRecord(
            name=str(func),
            reads=tuple(dict.fromkeys(reads)),
            input_reads=tuple(dict.fromkeys(input_reads)),
            writes=tuple(dict.fromkeys(mutated_sids + [s for _, s in fresh])),
            overwrites=tuple(overwrites),
            creates=tuple(s for _, s in fresh),
            random=info.random,
            observer=info.observer,
        )
        k = self.k
        self.k += 1
        return self.after(k, rec, func, args, kwargs, out, fresh)

    def after(self, k, rec, func, args, kwargs, out, fresh):  # pragma: no cover - overridden
        raise NotImplementedError


def _is_meta(device) -> bool:
    return device is not None and torch.device(device).type == "meta"


def _to_meta(x):
    if isinstance(x, torch.Tensor) and not x.is_meta:
        return x.to(_META)
    return x


class NeedsValues(BaseException):
    """The construction branches on a value (``if not mask.any()``): record again with values.

    A BaseException, so that no ``except Exception`` in model code swallows it.
    """


class Recorder(Trace):
    """Run 1: record the ops; values are never computed (see :class:`ValuedRecorder`)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[OpRecord] = []

    def after(self, k, rec, func, args, kwargs, out, fresh):
        if rec.observer:
            raise NeedsValues(rec.name)
        self.records.append(rec)
        return out


# --------------------------------------------------------------------------- the plan


@dataclass
class Plan:
    needed: list[bool]
    run_random: list[bool]  # random ops that run on scratch only to advance the generator
    emit_after: dict[int, list[int]]
    free_after: dict[int, list[int]]


def plan(records: list[OpRecord], requested: set[int], *, advance_rng: bool = True) -> Plan:
    """Backward liveness from the ``requested`` storages (live at the end of the program)."""
    n = len(records)
    needed = [False] * n
    emit_after: dict[int, list[int]] = defaultdict(list)
    free_after: dict[int, list[int]] = defaultdict(list)
    live = set(requested)
    pending = set(requested)
    for k in range(n - 1, -1, -1):
        r = records[k]
        out_live = r.observer or any(s in live for s in r.writes)
        if not (out_live or r.random):
            continue
        after = live.copy() if len(r.reads) + len(r.writes) else live
        used = set(r.input_reads)
        if out_live:
            needed[k] = True
            live.difference_update(r.overwrites)
            live.difference_update(r.creates)
            used.update(r.reads)
        live.update(used)
        for s in dict.fromkeys(r.reads + r.writes):
            if s in pending and (needed[k] or s in used):
                emit_after[k].append(s)
                pending.discard(s)
            elif s not in after and (needed[k] or s in used):
                free_after[k].append(s)
    last_random = max((k for k in range(n) if needed[k] and records[k].random), default=-1)
    run_random = [
        records[k].random and not needed[k] and (advance_rng or k < last_random) for k in range(n)
    ]
    return Plan(needed, run_random, dict(emit_after), dict(free_after))

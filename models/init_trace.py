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
- :class:`Trace` (a TorchDispatchMode) sees every aten op touching a meta tensor. Storages are
  numbered in order of first sight, so both runs name them alike.

Run 1 (:class:`Recorder`) records, per op, which storages it reads, writes, fully overwrites
and creates; it runs with the generator forked. :func:`plan` then walks the record backwards
(liveness, as a compiler does for registers) from the storages requested at the end: an op is
*needed* if a storage it writes is live after it. Run 2 (:class:`Executor`) computes needed ops
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


@functools.lru_cache(1)
def _constructors() -> frozenset:
    from torch.utils._device import _device_constructors

    literal = {torch.tensor, torch.as_tensor, torch.asarray, torch.scalar_tensor}
    return frozenset(_device_constructors() - literal)


class MetaConstructors(TorchFunctionMode):
    """``torch.device("meta")`` for factory functions, minus literals, without being a DeviceContext."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _constructors() and kwargs.get("device") is None:
            kwargs["device"] = _META
        return func(*args, **kwargs)


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
    return OpInfo(name, mutated, overwrites, random, metadata_only, name in _EMPTY)


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
        out = func(*meta_args, **meta_kwargs)
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
            observer=bool(func._schema.returns)
            and not any("Tensor" in str(r.type) for r in func._schema.returns),
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


class Recorder(Trace):
    """Run 1: record the ops; values are never computed."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[OpRecord] = []

    def after(self, k, rec, func, args, kwargs, out, fresh):
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


# --------------------------------------------------------------------------- run 2


@dataclass
class Stats:
    ops: int = 0
    computed_ops: int = 0
    scratch_random_ops: int = 0
    shadow_bytes: int = 0  # live shadows plus the spare buffer
    peak_bytes: int = 0  # the most shadow + scratch bytes alive at once (values handed back not counted)
    emitted_bytes: int = 0


class Executor(Trace):
    """Run 2: compute what the plan needs on CPU shadows; emit requested storages when final.

    ``emit(sid, executor) -> bool`` is called right after the last op that touches a requested
    storage; it reads the value with :meth:`view_as` and returns whether it kept the storage
    itself (zero-copy hand-off), otherwise the storage is recycled.

    One *spare* storage, the largest freed so far, is recycled for the next shadow or scratch
    that fits, whatever its size: with fresh allocations per op, glibc's heap grew by every
    layer's draws (measured: RSS +52 MB while at most 9 MB were alive, for a 54 MB model), and
    page faults on fresh buffers cost more than the draws themselves.
    """

    def __init__(self, records: list[OpRecord], the_plan: Plan, emit) -> None:
        super().__init__()
        self.records = records
        self.the_plan = the_plan
        self.emit = emit
        self.shadows: dict[int, torch.UntypedStorage] = {}
        self.spare: torch.UntypedStorage | None = None
        self.stats = Stats()

    # ------------------------------------------------------------ memory

    def _track(self, extra: int = 0) -> None:
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.stats.shadow_bytes + extra)

    def _take(self, nbytes: int) -> torch.UntypedStorage:
        spare = self.spare
        if spare is not None and nbytes <= spare.nbytes():
            self.spare = None
            self.stats.shadow_bytes -= spare.nbytes()
            return spare
        return torch.UntypedStorage(nbytes, device=_CPU)

    def _release(self, st: torch.UntypedStorage) -> None:
        if self.spare is None or st.nbytes() > self.spare.nbytes():
            if self.spare is not None:
                self.stats.shadow_bytes -= self.spare.nbytes()
            self.spare = st
            self.stats.shadow_bytes += st.nbytes()

    def _set_shadow(self, sid: int, st: torch.UntypedStorage) -> None:
        self._free(sid)
        self.shadows[sid] = st
        self.stats.shadow_bytes += st.nbytes()
        self._track()

    def _free(self, sid: int, *, handed_off: bool = False) -> None:
        st = self.shadows.pop(sid, None)
        if st is not None:
            self.stats.shadow_bytes -= st.nbytes()
            if not handed_off:
                self._release(st)

    def view(self, sid: int, like: torch.Tensor) -> torch.Tensor:
        """The shadow of meta tensor ``like`` (whose storage is ``sid``)."""
        return self.view_as(sid, like.dtype, like.size(), like.stride(), like.storage_offset())

    def view_as(self, sid: int, dtype, size, stride, offset) -> torch.Tensor:
        return _on(self.shadows[sid], dtype, size, stride, offset)

    # ------------------------------------------------------------ ops

    def after(self, k, rec, func, args, kwargs, out, fresh):
        if k >= len(self.records) or self.records[k].name != rec.name:
            expected = self.records[k].name if k < len(self.records) else "the end of the program"
            raise TraceError(f"construction differs between two runs at op {k}: {rec.name} vs {expected}")
        p = self.the_plan
        self.stats.ops += 1
        if p.needed[k]:
            self.stats.computed_ops += 1
            out = self._compute(k, rec, func, args, kwargs, out, fresh)
        elif p.run_random[k]:
            self.stats.scratch_random_ops += 1
            self._draw(rec, func, args, kwargs)
        for s in p.emit_after.get(k, ()):
            self._free(s, handed_off=bool(self.emit(s, self)))
        for s in p.free_after.get(k, ()):
            self._free(s)
        return out

    def _compute(self, k, rec, func, args, kwargs, out, fresh):
        writes = set(rec.writes)

        def real(x):
            if isinstance(x, torch.Tensor) and x.is_meta:
                s = self.sid(x)
                if s not in self.shadows:
                    if s not in writes:
                        raise TraceError(
                            f"op {k} ({rec.name}) reads a meta tensor that has no value here; it was made "
                            "outside the replayed construction (a cached tensor?)"
                        )
                    self._set_shadow(s, self._take(x.untyped_storage().nbytes()))
                return self.view(s, x)
            if isinstance(x, torch.device) and x.type == "meta":
                return _CPU
            return x

        real_args, real_kwargs = pytree.tree_map(real, (args, kwargs))
        res = func(*real_args, **real_kwargs)
        by_meta = {id(m): r for m, r in zip(_tensors(out), _tensors(res))}
        for m, s in fresh:
            self._adopt(s, m, by_meta[id(m)])
        return res if rec.observer else out

    def _draw(self, rec, func, args, kwargs) -> None:
        """A random op nobody needs: draw into scratch so the generator advances as in eager."""
        mutated = set(rec.writes) - set(rec.input_reads)
        taken: list[torch.UntypedStorage] = []

        def scratch_or_shadow(x):
            if isinstance(x, torch.Tensor) and x.is_meta:
                s = self.sid(x)
                if s not in mutated and s in self.shadows:
                    return self.view(s, x)
                taken.append(self._take(x.untyped_storage().nbytes()))
                return _on(taken[-1], x.dtype, x.size(), x.stride(), x.storage_offset())
            if isinstance(x, torch.device) and x.type == "meta":
                return _CPU
            return x

        real_args, real_kwargs = pytree.tree_map(scratch_or_shadow, (args, kwargs))
        res = func(*real_args, **real_kwargs)
        made = {st.data_ptr() for st in taken}
        extra = sum(st.nbytes() for st in taken) + sum(
            t.untyped_storage().nbytes() for t in _tensors(res) if t.untyped_storage().data_ptr() not in made
        )
        self._track(extra)
        del res, real_args, real_kwargs
        for st in taken:
            self._release(st)

    def _adopt(self, sid: int, meta: torch.Tensor, real: torch.Tensor) -> None:
        nbytes = meta.untyped_storage().nbytes()
        if (
            real.device == _CPU
            and real.dtype == meta.dtype
            and real.stride() == meta.stride()
            and real.storage_offset() == meta.storage_offset()
            and real.untyped_storage().nbytes() == nbytes
        ):
            self._set_shadow(sid, real.untyped_storage())
        else:
            self._set_shadow(sid, self._take(nbytes))
            self.view(sid, meta).copy_(real)


def _on(storage: torch.UntypedStorage, dtype, size, stride, offset) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=_CPU).set_(storage, offset, size, stride)

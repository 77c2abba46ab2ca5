"""Count what every ``torch.distributed`` collective moves: op, group, elements, bytes.

```python
from parallel3d.runtime.comm_counter import count_collectives

with count_collectives(engine.mesh) as comm:      # the mesh names groups "dp", "tp", "pp"
    with comm.tag("forward"):
        out = engine(**batch)
    with comm.tag("backward"):
        engine.backward(out.loss)
    engine.step()
print(comm.table())            # one row per (tag, group, op)
comm.total("numel", op="all_reduce", group="tp", tag="forward")
```

Where it hooks in, and why there. Every collective in ``torch.distributed.distributed_c10d``
(whatever spelling the caller used: ``all_gather_single``, ``all_gather_into_tensor``, the
list form ``all_gather``, ``reduce_scatter_single``/``reduce_scatter_tensor``,
``batch_isend_irecv``'s ``isend``/``irecv`` ...) ends in exactly one method call on the
``ProcessGroup`` object, e.g. ``group.allreduce([tensor], opts)``. While a counter is active
those methods of the ``ProcessGroup`` class are replaced by a wrapper that records the call
and calls the original; on exit the originals are put back. Wrapping the Python functions
instead would miss the aliases bound at import time (``zero.comm``,
``parallel3d.tensor_parallel.comm``) and would break ``P2POp``/``batch_isend_irecv``, which
test ``op is isend``. Calls from autograd backward, gradient hooks and async (``async_op=True``)
collectives are all seen, counted when issued. Not seen: C++ callers (DDP's reducer) and,
unless ``functional=True``, functional collectives (``torch.distributed._functional_collectives``,
DTensor), which dispatch through ``_c10d_functional`` ops straight to C++. With
``functional=True`` a ``TorchDispatchMode`` records those ops too (method
``functional.<op>``); it lets DTensor desugar its ops first (as torch's ``CommDebugMode``
does), so a redistribution is seen as the collectives it issues. Results are unchanged (the same method is called
with the same arguments); when no counter is active nothing is patched, so the cost is
zero, and while active it is one Python call per collective.

What "crosses the wire": two numbers per call.

==============  =============================  =========================================
op              ``numel``/``bytes`` (payload)  ``wire_bytes`` (ring algorithm, per rank)
==============  =============================  =========================================
all_reduce      the tensor                     2 (n-1)/n x bytes (reduce-scatter + all-gather)
reduce_scatter  the input (all n chunks)       (n-1)/n x bytes
all_gather      the output (all n chunks)      (n-1)/n x bytes
all_to_all      the input                      (n-1)/n x bytes
broadcast       the tensor                     bytes (pipelined chain: each rank forwards it once)
send / recv     the tensor                     bytes (sent / received by this rank)
barrier         0                              0
==============  =============================  =========================================

``n`` is the group size; on a group of one nothing crosses (``wire_bytes`` 0). ``wire_bytes``
is what each rank sends (and receives) under the bandwidth-optimal ring algorithm, whatever
the backend really does (gloo may implement a reduce-scatter differently); the ZeRO paper's
"volume" is ``wire_bytes x n/(n-1)``: an all-reduce of Psi is 2 Psi, reduce-scatter plus
all-gather of Psi is Psi + Psi. Reduce, gather and scatter are not counted (nothing here
uses them).

Groups are named, in order: by the ``names`` mapping or mesh given to
``count_collectives`` (a group that serves a mesh dimension of size > 1 is named after it:
at dp = world the dp group is the default group), by a ``DeviceMesh`` group's description
(``mesh_tp`` -> ``tp``), ``world`` for the default group, else by its ranks (``ranks[0,2]``).
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Call", "CommCounter", "count_collectives", "wire_factor"]

# ProcessGroup method -> (op, index of the positional argument that is the payload).
_METHODS: dict[str, tuple[str, int | None]] = {
    "allreduce": ("all_reduce", 0),
    "allreduce_coalesced": ("all_reduce", 0),
    "all_gather_single": ("all_gather", 0),
    "_allgather_base": ("all_gather", 0),
    "allgather": ("all_gather", 0),
    "allgather_coalesced": ("all_gather", 0),
    "allgather_into_tensor_coalesced": ("all_gather", 0),
    "all_gather_single_coalesced": ("all_gather", 0),
    "reduce_scatter_single": ("reduce_scatter", 1),
    "_reduce_scatter_base": ("reduce_scatter", 1),
    "reduce_scatter": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 1),
    "reduce_scatter_single_coalesced": ("reduce_scatter", 1),
    "alltoall_base": ("all_to_all", 1),
    "alltoall": ("all_to_all", 1),
    "all_to_all_single": ("all_to_all", 1),
    "broadcast": ("broadcast", 0),
    "send": ("send", 0),
    "recv": ("recv", 0),
    "recv_anysource": ("recv", 0),
    "barrier": ("barrier", None),
}


def wire_factor(op: str, n: int) -> float:
    """Bytes each rank sends per payload byte under the ring algorithm on ``n`` ranks."""
    if op in ("send", "recv"):
        return 1.0
    if n <= 1 or op == "barrier":
        return 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n
    return 1.0  # broadcast


@dataclass(frozen=True)
class Call:
    """One collective call as this rank issued it."""

    op: str
    group: str
    group_size: int
    numel: int
    nbytes: int
    wire_bytes: float
    tag: str
    method: str  # the ProcessGroup method (the spelling at the bottom of torch.distributed)


@dataclass
class CommCounter:
    """The calls recorded while active, and their summary per (tag, group, op)."""

    names: dict[str, str] = field(default_factory=dict)  # ProcessGroup.group_name -> our name
    calls: list[Call] = field(default_factory=list)
    _tag: str = ""
    _groups: dict[str, tuple[str, int]] = field(default_factory=dict, repr=False)

    @contextlib.contextmanager
    def tag(self, name: str) -> Iterator[None]:
        """Label the calls made inside (e.g. "forward", "backward"); tags do not nest."""
        previous, self._tag = self._tag, name
        try:
            yield
        finally:
            self._tag = previous

    def clear(self) -> None:
        self.calls.clear()

    def _group(self, pg: Any) -> tuple[str, int]:
        key = pg.group_name
        if key not in self._groups:
            size = pg.size()
            name = self.names.get(key)
            if name is None:
                desc = getattr(pg, "group_desc", "") or ""
                if desc.startswith("mesh_"):
                    name = desc[len("mesh_"):]
                elif pg is dist.group.WORLD or desc == "default_pg":
                    name = "world"
                else:
                    name = f"ranks{dist.get_process_group_ranks(pg)}".replace(" ", "")
            self._groups[key] = (name, size)
        return self._groups[key]

    def _record(self, pg: Any, op: str, method: str, payload: Any) -> None:
        name, size = self._group(pg)
        numel = nbytes = 0
        for t in _tensors(payload):
            numel += t.numel()
            nbytes += t.numel() * t.element_size()
        self.calls.append(Call(op, name, size, numel, nbytes, nbytes * wire_factor(op, size), self._tag, method))

    # -- reading the counts ------------------------------------------------------------

    def select(self, op: str | None = None, group: str | None = None, tag: str | None = None) -> list[Call]:
        return [c for c in self.calls if (op is None or c.op == op) and (group is None or c.group == group)
                and (tag is None or c.tag == tag)]

    def total(self, field: str = "numel", op: str | None = None, group: str | None = None,
              tag: str | None = None) -> float:
        """Sum of ``field`` ("numel", "nbytes", "wire_bytes") over the matching calls; "calls" counts them."""
        chosen = self.select(op, group, tag)
        return len(chosen) if field == "calls" else sum(getattr(c, field) for c in chosen)

    def summary(self) -> list[dict]:
        """One row per (tag, group, op), in order of first call: calls, numel, bytes, wire bytes, sizes."""
        rows: dict[tuple[str, str, str], dict] = {}
        for c in self.calls:
            row = rows.setdefault((c.tag, c.group, c.op), {
                "tag": c.tag, "group": c.group, "group_size": c.group_size, "op": c.op,
                "calls": 0, "numel": 0, "nbytes": 0, "wire_bytes": 0.0, "sizes": Counter()})
            row["calls"] += 1
            row["numel"] += c.numel
            row["nbytes"] += c.nbytes
            row["wire_bytes"] += c.wire_bytes
            row["sizes"][c.numel] += 1
        return list(rows.values())

    def table(self) -> str:
        """The summary as fixed-width text; ``sizes`` lists "calls x elements" per distinct call size."""
        head = f"{'tag':<10} {'group':<9} {'op':<15} {'calls':>5} {'elements':>12} {'MiB':>9} {'wire MiB':>9}  sizes"
        lines = [head, "-" * len(head)]
        for r in self.summary():
            sizes = ", ".join(f"{k}x{n}" for n, k in sorted(r["sizes"].items(), key=lambda kv: -kv[0] * kv[1]))
            lines.append(f"{r['tag'] or '-':<10} {r['group'] + '/' + str(r['group_size']):<9} {r['op']:<15} "
                         f"{r['calls']:>5} {r['numel']:>12} {r['nbytes'] / 2**20:>9.3f} "
                         f"{r['wire_bytes'] / 2**20:>9.3f}  {sizes}")
        return "\n".join(lines)


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


# -- patching the ProcessGroup class while any counter is active --------------------------

_active: list[CommCounter] = []
_originals: dict[str, Any] = {}  # method -> the raw class attribute, restored on the last exit
_lock = threading.Lock()


def _counted(method: str, op: str, index: int | None, original: Any):
    def wrapper(self, *args, **kwargs):
        payload = args[index] if index is not None and index < len(args) else ()
        for counter in _active:
            counter._record(self, op, method, payload)
        return original(self, *args, **kwargs)

    wrapper.__name__ = wrapper.__qualname__ = method
    wrapper.__doc__ = getattr(original, "__doc__", None)
    return wrapper


def _install() -> None:
    cls = dist.ProcessGroup
    for method, (op, index) in _METHODS.items():
        raw = cls.__dict__.get(method)
        if raw is None:  # not in this torch release
            continue
        _originals[method] = raw
        setattr(cls, method, _counted(method, op, index, getattr(cls, method)))


def _uninstall() -> None:
    cls = dist.ProcessGroup
    for method, raw in _originals.items():
        setattr(cls, method, raw)  # the raw pybind entry (an instancemethod), so binding still works
    _originals.clear()


def _group_names(mesh: Any) -> dict[str, str]:
    """``ProcessGroup.group_name`` -> mesh dimension name, for dimensions of size > 1 first."""
    if mesh is None:
        return {}
    if isinstance(mesh, Mapping):
        return {pg.group_name: name for name, pg in mesh.items() if pg is not None}
    if hasattr(mesh, "named_groups"):  # parallel3d's ParallelMesh: its views by their names too
        return {pg.group_name: name for name, pg in mesh.named_groups().items()}
    if mesh.mesh_dim_names is None:  # a DeviceMesh
        return {}
    names: dict[str, str] = {}
    for big in (True, False):
        for dim in mesh.mesh_dim_names:
            if (mesh[dim].size() > 1) == big:
                names.setdefault(mesh[dim].get_group().group_name, dim)
    return names


# _c10d_functional op -> (op, index of the payload argument, index of the group size or None)
_FUNCTIONAL: dict[str, tuple[str, int, int | None]] = {
    "all_reduce": ("all_reduce", 0, None), "all_reduce_": ("all_reduce", 0, None),
    "all_reduce_coalesced": ("all_reduce", 0, None), "all_reduce_coalesced_": ("all_reduce", 0, None),
    "all_gather_into_tensor": ("all_gather", 0, 1), "all_gather_into_tensor_out": ("all_gather", 0, 1),
    "all_gather_into_tensor_coalesced": ("all_gather", 0, 1),
    "reduce_scatter_tensor": ("reduce_scatter", 0, None), "reduce_scatter_tensor_out": ("reduce_scatter", 0, None),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0, None),
    "all_to_all_single": ("all_to_all", 0, None), "broadcast": ("broadcast", 0, None),
    "broadcast_": ("broadcast", 0, None),
}


def _functional_mode(counter: CommCounter):
    """A dispatch mode recording ``_c10d_functional`` collectives into ``counter``."""
    from torch.distributed.distributed_c10d import _resolve_process_group
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Functional(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented  # a DTensor op: let it desugar into collectives first
            name = func._overloadpacket.__name__
            if func.namespace == "_c10d_functional":
                entry = _FUNCTIONAL.get(name)
                if entry is not None:
                    op, index, size_at = entry
                    payload = args[index]
                    if size_at is not None:  # all-gather: the payload is the gathered output
                        n = args[size_at]
                        payload = [t.expand(n, *t.shape) for t in _tensors(payload)]
                    counter._record(_resolve_process_group(args[-1]), op, f"functional.{name}", payload)
            return func(*args, **(kwargs or {}))

    return _Functional()


@contextlib.contextmanager
def count_collectives(mesh: Any = None, names: Mapping[str, Any] | None = None,
                      functional: bool = False) -> Iterator[CommCounter]:
    """Record every collective this process issues inside the block; yields the ``CommCounter``.

    ``mesh``: a ``ParallelMesh`` (``engine.mesh``), a ``DeviceMesh`` or a mapping ``{name:
    ProcessGroup}`` used to name the groups; ``names`` adds or overrides ``{name:
    ProcessGroup}``. Counters may nest (each records every call made while it is active). A counter sees every
    collective of this process, from any thread, while it is active; with ``functional=True`` it
    also sees functional collectives (DTensor's) issued in this thread and in autograd's.
    """
    counter = CommCounter(names={**_group_names(mesh), **_group_names(names)})
    with _lock:
        if not _active:
            _install()
        _active.append(counter)
    try:
        if functional:
            with _functional_mode(counter):
                yield counter
        else:
            yield counter
    finally:
        with _lock:
            _active.remove(counter)
            if not _active:
                _uninstall()

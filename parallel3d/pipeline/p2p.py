"""Point-to-point transfers between pipeline stages.

Activations go forward and their gradients backward as tensors of a shape every rank knows
ahead: ``[micro_batch, seq, hidden]`` of the micro-batch (all pp ranks see the same
micro-batches, so they read the shape from the batch) in the activation dtype. Nothing is
negotiated per micro-batch: a receive allocates its buffer and posts ``irecv`` at once.

A run of consecutive communication actions of a schedule table is one batch, posted together
with ``torch.distributed.batch_isend_irecv`` (coalesced on NCCL, individual ops on gloo).
Nothing waits at posting: a receive is waited for by the pass that consumes it, a send is
kept (with its tensor, which must stay alive) until :meth:`P2P.drain` at the end of the step
or until it is found complete. Peers are pp ranks (ranks of ``group``); untagged p2p between
a pair of ranks matches in posting order, which the tables respect.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from parallel3d.runtime.fake_backend import receive_buffer

__all__ = ["P2P", "PendingRecv"]


@dataclass
class PendingRecv:
    """A posted receive: ``wait()`` returns the filled buffer."""

    buffer: torch.Tensor
    work: Any = None

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.buffer


class P2P:
    """Async send/receive of stage tensors over the pp ``group``."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group = group
        self.device = torch.device(device)
        self._global = [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]
        self._sends: list[tuple[Any, Any]] = []  # (work, the tensor(s) it sends: kept alive)
        self.bytes_sent = 0
        self.bytes_received = 0

    def post(self, sends: list[tuple[torch.Tensor, int]],
             recvs: list[tuple[tuple[int, ...], torch.dtype, int]]) -> list[PendingRecv]:
        """Post one batch: ``sends`` as (tensor, peer), ``recvs`` as (shape, dtype, peer).

        Returns one :class:`PendingRecv` per receive, in order. Sends are tracked here.
        """
        ops: list[dist.P2POp] = []
        sent: list[torch.Tensor] = []
        for tensor, peer in sends:
            tensor = tensor.detach().contiguous()
            sent.append(tensor)
            ops.append(dist.P2POp(dist.isend, tensor, self._global[peer], self.group))
            self.bytes_sent += tensor.numel() * tensor.element_size()
        pending: list[PendingRecv] = []
        for shape, dtype, peer in recvs:
            buf = receive_buffer(shape, dtype, self.device, self.group)
            pending.append(PendingRecv(buf))
            ops.append(dist.P2POp(dist.irecv, buf, self._global[peer], self.group))
            self.bytes_received += buf.numel() * buf.element_size()
        if not ops:
            return pending
        works = dist.batch_isend_irecv(ops)
        if len(works) == len(ops):  # gloo: one work per operation
            self._sends.extend(zip(works[:len(sent)], sent))
            for p, work in zip(pending, works[len(sent):]):
                p.work = work
        else:  # NCCL coalesces the batch into one work
            whole = _AllOf(works)
            if sent:
                self._sends.append((whole, sent))
            for p in pending:
                p.work = whole
        self._reap()
        return pending

    def _reap(self) -> None:
        """Forget completed sends (their tensors may be freed)."""
        keep = []
        for work, tensor in self._sends:
            done = False
            try:
                done = work.is_completed()
            except (AttributeError, RuntimeError):
                pass
            if not done:
                keep.append((work, tensor))
        self._sends = keep

    def drain(self) -> None:
        """Wait for every outstanding send (end of step)."""
        for work, _ in self._sends:
            work.wait()
        self._sends = []


class _AllOf:
    """Wait on a list of works as one."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

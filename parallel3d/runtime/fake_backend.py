"""torch's ``fake`` process-group backend, on which ``zero3d simulate`` runs one rank of a job alone.

On ``fake`` every collective returns at once without moving data. All-gathers and
reduce-scatters still write their outputs (copies of this rank's input), all-reduces leave
their input as it is, but a receive and a broadcast from another rank leave their buffer
unwritten: memory straight from the allocator, whose bytes may read as NaN and would end the
simulated step in an overflow skip (no optimizer step, so none of its memory). The engine asks
:func:`is_fake` where that matters and zero-fills such buffers there; on any other backend
nothing changes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

FAKE = "fake"


def is_fake(group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``group`` (default: the world) runs on torch's fake backend."""
    return dist.is_initialized() and dist.get_backend(group) == FAKE


def receive_buffer(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device,
                   group: dist.ProcessGroup | None) -> torch.Tensor:
    """A buffer a receive over ``group`` fills: uninitialized, or zeros where no receive will write it."""
    return (torch.zeros if is_fake(group) else torch.empty)(shape, dtype=dtype, device=device)

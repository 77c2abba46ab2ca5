"""ZeRO-Offload: this rank's fp32 master shard, optimizer states and (stage 3) parameter shards in host memory.

With **optimizer offload** every unit's fp32 master shard is a host tensor of its own (pinned
when an accelerator is present and ``pin_memory`` asks for it), so the inner ``torch.optim``
optimizer, built over views of the masters, keeps its states in host memory and steps there.
Each step copies the unit's reduced gradient shard from the compute device into a host fp32
buffer (kept for the engine's life: pinned allocations are slow), unscaling, the gradient norm,
clipping and the overflow check work on those copies (the copy of a bf16/fp16 value to fp32 is
exact, so the norm and the clipped values are the ones the device would compute), and the
updated masters are copied back into the working-precision shards by ``publish_params``.

With **parameter offload** (stage 3) each non-persistent unit's working shard is a host tensor;
``zero.comm.gather_shards`` copies it into the rank's own chunk of the device buffer it gathers
into, so a gather needs no extra device memory and a release frees everything on the device.
Persistent units (params under the persistence threshold) stay on the device, as in DeepSpeed.

The placement is decided by the settings, never by where tensors happen to be: on a CPU-only
machine the compute device *is* the host, the copies still happen (the same code path as on
an accelerator), and ``memory_report`` counts the offloaded bytes as host memory.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from zero.flat import FlatUnit

logger = logging.getLogger(__name__)

HOST = torch.device("cpu")


@dataclass(frozen=True)
class OffloadSettings:
    """What lives in host memory (DeepSpeed's ``offload_optimizer`` / ``offload_param`` with device cpu)."""

    optimizer: bool = False
    """fp32 master shards, optimizer states and the step's fp32 gradient copies."""
    params: bool = False
    """Stage 3: the working-precision shards of the non-persistent units."""
    pin_optimizer: bool = True
    """Page-locked host buffers for the optimizer's tensors, where an accelerator exists."""
    pin_params: bool = True
    """Page-locked host buffers for the parameter shards, where an accelerator exists."""

    @property
    def enabled(self) -> bool:
        return self.optimizer or self.params


def can_pin() -> bool:
    """Whether page-locked host memory can be allocated (an accelerator is present)."""
    return torch.accelerator.is_available()


def host_copy(tensor: torch.Tensor, pin: bool, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new host tensor holding ``tensor``'s values (in ``dtype``), pinned when ``pin`` and possible."""
    out = torch.empty(tensor.shape, dtype=dtype or tensor.dtype, device=HOST, pin_memory=pin and can_pin())
    out.copy_(tensor)
    return out


class Offloader:
    """Places the units' shards in host memory and moves gradients to the host each step.

    Args:
        units: the optimizer's flat units, their values installed.
        settings: what to offload.
    """

    def __init__(self, units: Sequence[FlatUnit], settings: OffloadSettings) -> None:
        self.units = list(units)
        self.settings = settings
        self.pin = settings.pin_optimizer and can_pin()  # the optimizer's host tensors
        self.pin_params = settings.pin_params and can_pin()
        self._host_grads: list[torch.Tensor] | None = None
        moved = self._place()
        logger.info("ZeRO-Offload: %d bytes of %s in host memory (pinned: optimizer %s, params %s)", moved,
                    " and ".join(w for w, on in (("optimizer state", settings.optimizer),
                                                 ("parameter shards", settings.params)) if on),
                    self.pin, self.pin_params)

    def _place(self) -> int:
        """Move the shards the settings name to the host; returns the bytes now there."""
        moved = 0
        for unit in self.units:
            aliased = unit.master is unit.shard  # fp32: one tensor is both
            if self.settings.params and not unit.persistent:
                unit.shard = host_copy(unit.shard, self.pin_params)
                moved += unit.shard.nbytes
                if aliased and self.settings.optimizer:
                    unit.master = unit.shard  # one host tensor, as before one device tensor
                    continue
            if self.settings.optimizer:
                unit.master = host_copy(unit.master, self.pin)
                moved += unit.master.nbytes
        return moved

    def grads_to_host(self) -> list[torch.Tensor]:
        """Every unit's reduced gradient shard, copied into its host fp32 buffer (made at the first step)."""
        if self._host_grads is None:
            self._host_grads = [torch.empty(u.shard_size, dtype=torch.float32, device=HOST, pin_memory=self.pin)
                                for u in self.units]
        devices = set()
        for unit, host in zip(self.units, self._host_grads):
            host.copy_(unit.grad_shard, non_blocking=self.pin)
            devices.add(unit.grad_shard.device)
        for device in devices if self.pin else ():
            if device.type != "cpu":  # the non-blocking copies have landed before the CPU reads them
                torch.accelerator.synchronize(device)
        return self._host_grads

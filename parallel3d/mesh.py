"""The pp x dp x tp device mesh every component receives explicitly.

Rank order follows Megatron: tp varies fastest (its traffic is heaviest and wants the
fastest links, i.e. the GPUs of one node), then dp, then pp. Built on
``init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from parallel3d.errors import ConfigError
from parallel3d.watchdog import prepare_flight_recorder, set_timeout


@dataclass(frozen=True)
class Mesh3D:
    """A 3D mesh and this rank's coordinates in it.

    ``device_mesh`` is None in a single process run without ``torch.distributed``.
    """

    pp: int
    dp: int
    tp: int
    device_mesh: DeviceMesh | None
    device: torch.device
    timeout_s: float | None = None
    """The collective timeout of its groups (None: torch's default); groups made later use it too."""

    def group(self, dim: str) -> dist.ProcessGroup | None:
        """The process group along ``dim`` ("pp", "dp" or "tp"); None without distributed."""
        if self.device_mesh is None:
            return None
        return self.device_mesh[dim].get_group()

    def local_rank(self, dim: str) -> int:
        if self.device_mesh is None:
            return 0
        return self.device_mesh.get_local_rank(dim)

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self.group("dp")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp


def default_device() -> torch.device:
    """CUDA device of this local rank when CUDA is there, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _job_store(timeout: timedelta) -> dist.Store | None:
    """torchrun's store with a prefix of this restart, or None to let torch rendezvous.

    Under torchrun's agent store the workers of a restart (``--max-restarts``) reuse the store
    of the run they replace, whose keys still name the dead workers' gloo addresses: without a
    prefix of their own the new ranks connect to those, or wait forever for a key that is
    already there (torch 2.13's static rendezvous; the futex hang of restarted workers).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"/zero3d/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def ensure_process_group(device: torch.device, timeout_s: float | None = None) -> None:
    """Join the job's process group from torchrun's environment if nobody has yet.

    ``timeout_s`` is the collective timeout of the group created here (None: torch's default).
    """
    if dist.is_initialized() or "WORLD_SIZE" not in os.environ:
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    prepare_flight_recorder()
    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
    store = _job_store(timeout or timedelta(minutes=5))
    if store is None:
        dist.init_process_group(backend_for(device), timeout=timeout)
    else:
        dist.init_process_group(backend_for(device), store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)


def build_mesh(tp: int, pp: int, device: torch.device | None = None, timeout_s: float | None = None) -> Mesh3D:
    """Build the pp x dp x tp mesh over the current world; dp = world / (tp * pp).

    Its groups get the collective timeout ``timeout_s`` (torch gives new groups its 30-minute
    default, not the default group's timeout).
    """
    device = device or default_device()
    ensure_process_group(device, timeout_s)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if tp < 1 or pp < 1 or world % (tp * pp) != 0:
        raise ConfigError(
            f"world size {world} is not divisible by tensor_parallel.size {tp} x pipeline.stages {pp}; "
            "the data-parallel size is world / (tp x pp) and must be a whole number"
        )
    dp = world // (tp * pp)
    if not dist.is_initialized():
        return Mesh3D(pp=pp, dp=dp, tp=tp, device_mesh=None, device=device)
    mesh = init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    if timeout_s is not None:
        set_timeout((mesh[dim].get_group() for dim in ("pp", "dp", "tp")), timeout_s)
    return Mesh3D(pp=pp, dp=dp, tp=tp, device_mesh=mesh, device=device, timeout_s=timeout_s)

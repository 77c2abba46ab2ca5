"""Joining the job's world: the device of this rank and the default process group.

Under torchrun the environment names the world; a plain single process stays without one.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from parallel3d.runtime.watchdog import prepare_flight_recorder


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

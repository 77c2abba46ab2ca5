"""``zero3d launch``: start a training script on one or many nodes through torchrun.

We do not write a process manager: every node runs ``python -m torch.distributed.run`` with
the static rendezvous flags (``--nnodes/--node-rank/--master-addr/--master-port``), and this
module only works out those flags from the command line, a DeepSpeed-style hostfile or the
Slurm environment. With a multi-host hostfile and no Slurm, the head node starts each node's
torchrun over ssh (like DeepSpeed's ssh runner); under Slurm, ``srun`` has already put one
``zero3d launch`` on every node, so each starts only its own torchrun.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from parallel3d.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_PORT = 29500
# Environment variables forwarded to remote nodes over ssh (prefix match), like DeepSpeed's
# EXPORT_ENVS: the worker needs the same Python path, thread and communication settings.
EXPORT_PREFIXES = ("PYTHON", "OMP_", "NCCL_", "GLOO_", "TORCH_", "CUDA_", "HF_", "TRANSFORMERS_", "DS_", "ZERO3D_")


def torchrun_command(
    target: list[str],
    *,
    nproc_per_node: int,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int = DEFAULT_PORT,
    module: bool = False,
) -> list[str]:
    """The exact argv that runs ``target`` (a script and its args, or a module with ``module``)."""
    if not target:
        raise ConfigError("launch needs a training script (or -m module) to run")
    if nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node must be >= 1, got {nproc_per_node}")
    if nnodes < 1:
        raise ConfigError(f"--nnodes must be >= 1, got {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise ConfigError(f"--node-rank must be in [0, nnodes={nnodes}), got {node_rank}")
    if not 0 < master_port < 65536:
        raise ConfigError(f"--master-port must be in 1..65535, got {master_port}")
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", str(nproc_per_node),
        "--nnodes", str(nnodes),
        "--node-rank", str(node_rank),
        "--master-addr", master_addr,
        "--master-port", str(master_port),
    ]
    if module:
        cmd.append("-m")
    return cmd + list(target)


def worker_env(nproc_per_node: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with OMP_NUM_THREADS set if unset.

    torchrun would set it to 1 with a warning; splitting this node's cores among its workers
    is a better default on CPU, where the threads do the actual work.
    """
    env = dict(os.environ if base is None else base)
    if "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc_per_node))
    return env


def free_port() -> int:
    """A TCP port free on this machine now (for single-node runs, which own the rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_local(target: list[str], nproc_per_node: int, module: bool = False) -> int:
    """Run ``target`` on this machine under torchrun with ``nproc_per_node`` workers.

    Uses a free port rather than 29500 so two local runs (or tests) do not collide.
    """
    cmd = torchrun_command(target, nproc_per_node=nproc_per_node, master_port=free_port(), module=module)
    logger.info("running %s", shlex.join(cmd))
    return _run(cmd, worker_env(nproc_per_node))


def _run(cmd: list[str], env: Mapping[str, str]) -> int:
    proc = subprocess.Popen(cmd, env=dict(env))
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        return proc.wait()

"""What the Zero3D Trainer refuses before it builds anything: a start by ``accelerate launch``,
DeepSpeed's own Trainer integration beside a Zero3D config, and Trainer features whose
machinery Zero3D replaces.

Each check raises one ``ConfigError`` that names what was given and what to do instead. They
read only the environment and ``TrainingArguments``, so every rank raises the same message
before the first collective.
"""

from __future__ import annotations

import os
from typing import Any

from parallel3d.errors import ConfigError

ACCELERATE_MARKERS = ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP",
                      "ACCELERATE_DYNAMO_BACKEND", "ACCELERATE_USE_CPU")
"""Variables every ``accelerate launch`` path sets for its workers (accelerate/utils/launch.py);
torchrun and ``zero3d launch`` set none of them."""


def refuse_accelerate_launch(environ: dict[str, str] | None = None) -> None:
    """``accelerate launch`` would hand the script accelerate's own process layout, mixed precision and
    DeepSpeed/FSDP plugins, which Zero3D's engine replaces: refuse it and say which command runs the
    same script unchanged."""
    env = os.environ if environ is None else environ
    found = [name for name in ACCELERATE_MARKERS if name in env]
    if not found:
        return
    procs = env.get("LOCAL_WORLD_SIZE") or env.get("WORLD_SIZE") or "N"
    raise ConfigError(
        f"parallel3d.hf.Trainer was started by `accelerate launch` (the environment holds {', '.join(found)}); "
        "Zero3D builds its own process layout, precision and sharding from zero3d_config, so start the same "
        f"script with `torchrun --nproc-per-node {procs} SCRIPT [ARGS]` or "
        f"`zero3d launch --nproc-per-node {procs} SCRIPT [ARGS]` instead")


def refuse_competing_arguments(args: Any, model_init: Any) -> None:
    """Trainer arguments that would start a second engine, or that Zero3D's config says instead."""
    if getattr(args, "deepspeed", None):
        raise ConfigError(
            "TrainingArguments(deepspeed=...) was given together with zero3d_config: the two would both shard "
            "the model. Move the DeepSpeed JSON to zero3d_config= (it reads DeepSpeed's keys) and leave "
            "TrainingArguments.deepspeed unset")
    if getattr(args, "fsdp", None):
        raise ConfigError(f"TrainingArguments(fsdp={args.fsdp!r}) was given together with zero3d_config: Zero3D "
                          "shards the model itself (zero_optimization.stage 3 is FSDP's full sharding); leave fsdp unset")
    if getattr(args, "torch_compile", False):  # also set by torch_compile_backend / torch_compile_mode
        raise ConfigError("TrainingArguments(torch_compile=True) was given together with zero3d_config: the Trainer "
                          "compiles the model in accelerate's prepare, which the Zero3D engine replaces, so the model "
                          'would train uncompiled; set "compile": {"enabled": true, "backend": ...} in zero3d_config '
                          "(each block compiled on its own, docs/compile.md) and leave torch_compile unset")
    if model_init is not None:
        raise ConfigError("parallel3d.hf.Trainer takes model= (a model, or a name/path started on the meta device), "
                          "not model_init=: the engine shards the one model it is given")
